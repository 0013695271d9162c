"""Architecture adapters: find the base model, decoder layers, final norm, LM head and logit scaling through
PEFT, DDP/FSDP and torch.compile wrappers."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DDP/FSDP1 (``.module``), torch.compile (``._orig_mod``) and PEFT (``get_base_model()``) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in (
            "DistributedDataParallel",
            "FullyShardedDataParallel",
            "DataParallel",
            "DeepSpeedEngine",  # TRL wraps the reference model in its own (inference) engine
        ):
            model = model.module
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
    return model


def data_parallel_reason(trainer: Any, why: str) -> str | None:
    """A reason when ``trainer.train()`` will run the model through ``nn.DataParallel`` (one process that sees
    several GPUs, no launcher), or already does. DataParallel copies every module per forward with a shallow copy of
    its ``__dict__``: a forward patched on the instance stays bound to the original module (its weights, its device)
    and forward hooks are shared by every replica. ``why`` says what that breaks for the optimization."""
    args = getattr(trainer, "args", None)
    wrapped = isinstance(getattr(trainer, "model_wrapped", None), nn.DataParallel)
    n_gpu = getattr(args, "n_gpu", 1) if args is not None else 1
    mode = str(getattr(getattr(args, "parallel_mode", None), "value", ""))
    if not wrapped and not (isinstance(n_gpu, int) and n_gpu > 1 and mode == "not_distributed"):
        return None
    return (
        f"nn.DataParallel (one process, {n_gpu} GPUs: transformers.Trainer wraps the model at train()) replicates the "
        f"model every forward; {why}: launch one process per GPU (accelerate launch / torchrun: DDP) or make one GPU "
        "visible (CUDA_VISIBLE_DEVICES=0)"
    )


def planned_steps(trainer: Any) -> int | None:
    """The optimizer steps the trainer will run: ``max_steps``, else epochs x batches of a sized dataset."""
    args = trainer.args
    if getattr(args, "max_steps", -1) and args.max_steps > 0:
        return int(args.max_steps)
    data = getattr(trainer, "train_dataset", None)
    try:
        rows = len(data)
    except TypeError:
        return None
    per_step = max(1, args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size))
    return max(1, int(args.num_train_epochs * -(-rows // per_step)))


def tokens_per_micro_batch(trainer: Any) -> int | None:
    """Batch x the longest sequence the trainer is told of (SFT's max_length, GRPO's prompt + completion), if any."""
    args = trainer.args
    length = getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)
    completion = getattr(args, "max_completion_length", None)
    if completion:
        length = (getattr(args, "max_prompt_length", None) or 0) + completion
    if not length:
        return None
    return int(args.per_device_train_batch_size) * int(length)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


# (trunk attribute, layers, final norm) per family; the trunk is found through ``base_model_prefix`` first.
_LAYER_NAMES = ("layers", "h", "blocks")
_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


@dataclass
class DecoderParts:
    """The pieces of a causal LM that the optimizations use, shared (never copied)."""

    model: nn.Module  # the *ForCausalLM
    trunk: nn.Module  # the decoder stack (LlamaModel, GPT2Model, ...)
    layers: nn.ModuleList
    final_norm: nn.Module | None
    lm_head: nn.Module
    logit_scale: float  # multiplies h·Wᵀ before the softcap
    softcap: float | None  # final_logit_softcapping (Gemma 2/3)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Locate the decoder parts of a causal LM (any wrapper); raise ValueError with the reason if not possible."""
    base = unwrap_model(model)
    trunk = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    if not isinstance(trunk, nn.Module):
        raise ValueError(f"{type(base).__name__}: no decoder trunk at `{base.base_model_prefix}`")
    layers = next(
        (getattr(trunk, n) for n in _LAYER_NAMES if isinstance(getattr(trunk, n, None), nn.ModuleList)), None
    )
    if layers is None:
        raise ValueError(f"{type(trunk).__name__}: no decoder layer list ({', '.join(_LAYER_NAMES)})")
    norm = next((getattr(trunk, n) for n in _NORM_NAMES if isinstance(getattr(trunk, n, None), nn.Module)), None)
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(base).__name__} has no output embeddings (LM head)")
    config = base.config
    scale, softcap = logit_transform(config)
    return DecoderParts(base, trunk, layers, norm, head, scale, softcap)


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) config; the config itself where it has no such part."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_transform(config: Any) -> tuple[float, float | None]:
    """(logit_scale, softcap) from a config: the scalings TRL's fused head knows (scale, divide, softcap)."""
    text = text_config(config)
    scale = 1.0
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text, name, None)
        if value is not None and value != 1:
            scale *= float(value)
    divide = getattr(text, "logits_scaling", None)
    if divide is not None and divide != 1:  # Granite and MiniCPM3 divide by it; HyperCLOVA X multiplies (as TRL reads)
        scale = scale * float(divide) if getattr(text, "model_type", None) == "hyperclovax" else scale / float(divide)
    softcap = getattr(text, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


def head_weight(head: nn.Module) -> torch.Tensor:
    """The LM head weight as a plain tensor (FSDP2 DTensor → full tensor)."""
    weight = head.weight
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    return weight


def head_weight_reasons(weight: Any) -> list[str]:
    """What the fused LM-head op cannot take as a head weight, before any call (per call: ``lm_head._checks``)."""
    if not isinstance(weight, torch.Tensor):
        return [f"the LM head has no weight tensor (got {type(weight).__name__})"]
    reasons = []
    shape = getattr(weight, "ds_shape", weight.shape)  # ZeRO-3 partitioned: empty here, gathered around the op
    if len(shape) != 2:
        reasons.append(f"the LM head weight is {len(shape)}-D, expected [vocab, hidden]")
    if not weight.dtype.is_floating_point:
        reasons.append(f"the LM head weight is {weight.dtype} (a quantized head)")
    if weight.device.type == "meta":
        reasons.append("the LM head weight is on the meta device (offloaded by a device map)")
    return reasons


def zero3_gather(*params: torch.Tensor | None) -> Any:
    """A context in which DeepSpeed ZeRO-3 partitioned ``params`` hold their full tensors (nothing to do elsewhere).

    Like TRL's own fused head, it gathers only what is not available yet: inside the engine's forward, reading
    ``lm_head.weight`` already gathers it for the running module (DeepSpeed >= 0.15 parameter access), and gathering
    an available parameter again would release it under that module. The op's backward recomputes the logits tiles
    with the weight (trainable head), so it enters the same context; the full-shape weight gradient it returns is
    reduced and partitioned by ZeRO's own gradient hooks."""
    pending = [p for p in params if p is not None and hasattr(p, "ds_id") and not _available(p)]
    if not pending:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(pending, modifier_rank=None)


def _available(param: torch.Tensor) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.AVAILABLE

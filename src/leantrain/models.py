"""Architecture adapters: find the base model, decoder layers, final norm, LM head and logit scaling through
PEFT, DDP/FSDP and torch.compile wrappers."""

from __future__ import annotations

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
    if divide is not None and divide != 1:
        scale /= float(divide)
    softcap = getattr(text, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


def head_weight(head: nn.Module) -> torch.Tensor:
    """The LM head weight as a plain tensor (FSDP2 DTensor → full tensor)."""
    weight = head.weight
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    return weight

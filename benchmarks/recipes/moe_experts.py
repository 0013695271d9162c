"""MoE QLoRA with LoRA on attention AND experts (moe_qlora_experts): the Qwen3-30B-A3B shape with fewer layers.

Stock = what a user runs today with transformers 5.23: the attention projections 4-bit nf4 ``Linear4bit`` (double
quantization, bf16 compute: what ``BitsAndBytesConfig`` makes of them; ``model.is_loaded_in_4bit`` set as that load
sets it, so PEFT builds its bitsandbytes LoRA layers and TRL casts the adapters to bf16), the 3-D expert stacks bf16
(bitsandbytes quantizes ``nn.Linear`` only), LoRA r=16 on q/k/v/o (``target_modules``) and on the experts (PEFT
``target_parameters``). leantrain = the same with the expert stacks quantized by ``quantize_experts_4bit`` and
``patch_trainer(moe4bit=True)``. A variant whose model ends up without expert adapters (PEFT matched nothing on the
quantized stacks) is recorded as "not measured" with that reason, never timed as if it had them.

Each layer count in ``settings.moex_layers`` is one config; two counts give the per-layer peak memory, projected to
the released 48 layers in the table (next to a 24 GiB card).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .moe_qlora import build_layerwise
from .runner import (
    Budget,
    NotMeasured,
    Variant,
    checkpointing,
    filtered,
    gib,
    leantrain_patch,
    log,
    run_group,
    sft_trainer,
    token_dataset,
)
from .settings import Settings


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
VARIANTS = (  # name, kind, baseline, experts quantized, patched
    ("stock (bf16 experts)", "stock", None, False, False),
    ("leantrain (4-bit experts)", "leantrain", "stock (bf16 experts)", True, True),
    ("4-bit experts, unpatched", "reference", "stock (bf16 experts)", True, False),
)


def linear4bit(linear: torch.nn.Linear, dtype: torch.dtype) -> torch.nn.Module:
    """``linear`` as bitsandbytes nf4 with double quantization and ``dtype`` compute, as BitsAndBytesConfig(
    load_in_4bit, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant, bnb_4bit_compute_dtype) loads it."""
    import bitsandbytes as bnb

    quant = dict(quant_type="nf4", compress_statistics=True)
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=dtype,
        device="meta",
        **quant,
    )
    layer.weight = bnb.nn.Params4bit(linear.weight.detach().clone(), requires_grad=False, module=layer, **quant)
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return layer.to(linear.weight.device)  # bitsandbytes quantizes on the first move to a device


def quantize_layer(layer: torch.nn.Module, experts_4bit: bool, dtype: torch.dtype) -> None:
    from leantrain import quantize_experts_4bit

    for name in ATTENTION:
        setattr(layer.self_attn, name, linear4bit(getattr(layer.self_attn, name), dtype))
    if experts_4bit:
        quantize_experts_4bit(layer)


def lora_config(s: Settings, model: torch.nn.Module, leantrain_targets: bool) -> Any:
    """LoRA on attention and on both expert stacks. PEFT matches quantized stacks only by their full names:
    ``leantrain.expert_lora_targets(model)`` gives them (the leantrain variant); the stock call's suffixes match the
    bf16 stacks and nothing on quantized ones (the unpatched 4-bit variant then records "no expert adapters")."""
    from peft import LoraConfig

    from leantrain import expert_lora_targets

    experts = expert_lora_targets(model) if leantrain_targets else list(EXPERT_PARAMETERS)
    return LoraConfig(
        r=s.lora_r,
        lora_alpha=2 * s.lora_r,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=list(ATTENTION),
        target_parameters=experts,
    )


def expert_adapters(model: torch.nn.Module) -> tuple[int, int]:
    """(tensors, values) of the trainable LoRA parameters that live on an experts module."""
    found = [p for n, p in model.named_parameters() if p.requires_grad and ".experts." in n and "lora_" in n]
    return len(found), sum(p.numel() for p in found)


def recipe_moe_qlora_experts(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    import transformers

    warmup, timed = s.moex_steps
    fields = s.moex_shape
    full = fields["num_hidden_layers"]
    counts = args.layers or s.moex_layers
    data = token_dataset(fields["vocab_size"], (warmup + timed) * s.moex_batch, s.moex_seq)
    tmp = Path(tempfile.mkdtemp(prefix="recipes_moex_"))
    records: list[dict] = []
    try:
        for layers in counts:
            config = (
                f"{s.moex_name} {layers}L/{full} {fields['num_experts']}E top-{fields['num_experts_per_tok']} "
                f"{s.moex_batch}x{s.moex_seq}"
            )
            for name, kind, baseline, experts_4bit, patched in VARIANTS:
                settings = dict(
                    shape=s.moex_name,
                    layers=layers,
                    full_layers=full,
                    batch=s.moex_batch,
                    seq=s.moex_seq,
                    lora_r=s.lora_r,
                    lora_targets="q,k,v,o_proj + experts gate_up_proj, down_proj (target_parameters)",
                    attention="nf4 Linear4bit, double quant",
                    experts="nf4 stacks (quantize_experts_4bit)" if experts_4bit else "bf16 3-D stacks",
                    lr=2e-4,
                    checkpointing=s.cuda,
                )

                def make(layers=layers, experts_4bit=experts_4bit, patched=patched) -> tuple[Any, dict]:
                    layout = "4-bit experts" if experts_4bit else "bf16 experts"
                    model, info = build_layerwise(
                        "Qwen3MoeConfig",
                        dict(fields, num_hidden_layers=layers),
                        lambda layer: quantize_layer(layer, experts_4bit, s.dtype),
                        layout,
                        s,
                    )
                    model.is_loaded_in_4bit = True  # as a BitsAndBytesConfig load marks it (see the docstring)
                    log(f"  built {s.moex_name} {layers}L ({layout}) in {info['build_model_s']:.1f} s: "
                        f"{gib(info['model_gib'])} GiB")  # fmt: skip
                    transformers.set_seed(0)  # LoRA init
                    trainer = sft_trainer(
                        model,
                        data,
                        tmp,
                        warmup + timed,
                        s,
                        peft_config=lora_config(s, model, experts_4bit and patched),
                        learning_rate=2e-4,
                        per_device_train_batch_size=s.moex_batch,
                        max_length=s.moex_seq,
                        **checkpointing(s.cuda),
                    )
                    count, numel = expert_adapters(trainer.model)
                    info.update(expert_lora_params=count, expert_lora_numel=numel)
                    if count == 0:
                        raise NotMeasured(
                            f"no expert adapters were created: PEFT target_parameters={list(EXPERT_PARAMETERS)} "
                            f"matched nothing on the {layout} (LoRA on attention only would be timed)"
                        )
                    return trainer, info

                patch = leantrain_patch(moe4bit=True) if patched else None
                v = Variant("moe_qlora_experts", config, name, kind, baseline, make, patch, settings=settings)
                for chosen in filtered([v], args.only):
                    records += run_group([chosen], s.moex_steps, s, budget)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records

"""MoE QLoRA recipe: gpt-oss-20b shape, LoRA on attention, frozen 4-bit experts, stock vs leantrain moe4bit."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .runner import (
    TOKENS,
    Budget,
    Variant,
    allocated,
    checkpointing,
    default_dtype,
    filtered,
    gib,
    init_parameter,
    leantrain_patch,
    log,
    run_group,
    sft_trainer,
    token_dataset,
)
from .settings import Settings


def build_gpt_oss(fields: dict, layout: str, s: Settings) -> tuple[torch.nn.Module, dict[str, Any]]:
    """gpt-oss built layer by layer (build_layerwise) with its experts quantized right away (``stacked``:
    quantize_experts_4bit; ``linear4bit``: per-expert bnb Linear4bit lists; ``bf16``: as is)."""
    from leantrain import quantize_experts_4bit
    from testkit.moe4bit_models import linear4bit_experts_from

    def transform(layer: torch.nn.Module) -> None:
        if layout == "stacked":
            quantize_experts_4bit(layer)
        elif layout == "linear4bit":
            layer.mlp.experts = linear4bit_experts_from(layer.mlp.experts)

    return build_layerwise("GptOssConfig", fields, transform, layout, s)


def build_layerwise(
    config_cls: str, fields: dict, transform: Callable[[torch.nn.Module], None], layout: str, s: Settings
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A causal LM on the meta device, then one decoder layer at a time on the device, seeded by parameter name
    (init_parameter) and passed to ``transform`` (quantize it) before the next one exists: the model is never
    whole in bf16, so a build of a model with 4-bit experts peaks at one bf16 layer above its 4-bit size."""
    import transformers

    t0 = time.perf_counter()
    config = getattr(transformers, config_cls)(**fields, **TOKENS)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=s.dtype)
    config = model.config  # attention / experts implementations resolved by from_config
    layer_cls = type(model.model.layers[0])
    std = config.initializer_range
    for i in range(config.num_hidden_layers):
        with torch.device(s.device), default_dtype(s.dtype):
            layer = layer_cls(config, i)
        for name, param in layer.named_parameters():
            init_parameter(f"model.layers.{i}.{name}", param, std)
        transform(layer)
        model.model.layers[i] = layer
        del layer
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, child = name.rpartition(".")
            with torch.device(s.device):  # inv_freq is computed in __init__: build it again on the device
                setattr(model.get_submodule(parent), child, type(module)(config=config))
    for name, module in model.named_modules():
        meta = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
        if meta:
            module.to_empty(device=s.device, recurse=False)
            for n in meta:
                init_parameter(f"{name}.{n}", getattr(module, n), std)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left[:5]}")
    if s.cuda:
        torch.cuda.synchronize()
    info = {
        "build_model_s": time.perf_counter() - t0,
        "model_gib": allocated() / 2**30 if s.cuda else None,
        "layout": layout,
        "experts_implementation": config._experts_implementation,
        "attention": config._attn_implementation,
    }
    return model.train(), info


MOE_VARIANTS = (  # name, kind, baseline, layout, patched
    ("leantrain grouped (stacked)", "leantrain", "stock stacked 4-bit", "stacked", True),
    ("stock stacked 4-bit", "stock", None, "stacked", False),
    ("leantrain grouped (Linear4bit)", "leantrain", "stock Linear4bit loop", "linear4bit", True),
    ("stock Linear4bit loop", "stock", None, "linear4bit", False),
    ("stock bf16 experts", "reference", None, "bf16", False),
)


def recipe_moe_qlora(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    from peft import LoraConfig

    warmup, timed = s.moe_steps
    fields = s.moe_shape
    data = token_dataset(fields["vocab_size"], (warmup + timed) * s.moe_batch, s.moe_seq)
    tmp = Path(tempfile.mkdtemp(prefix="recipes_moe_"))
    config = (
        f"gpt-oss {fields['num_hidden_layers']}L {fields['num_local_experts']}E top-"
        f"{fields['num_experts_per_tok']} {s.moe_batch}x{s.moe_seq}"
    )
    variants = []
    for name, kind, baseline, layout, patched in MOE_VARIANTS:
        settings = dict(
            fields,
            batch=s.moe_batch,
            seq=s.moe_seq,
            lora_r=s.lora_r,
            lora_targets="q,k,v,o_proj",
            layout=layout,
            lr=2e-4,
            checkpointing=s.cuda,
        )

        def make(layout=layout) -> tuple[Any, dict]:
            import transformers

            model, info = build_gpt_oss(fields, layout, s)
            log(f"  built gpt-oss ({layout}) in {info['build_model_s']:.1f} s: {gib(info['model_gib'])} GiB")
            transformers.set_seed(0)  # LoRA init
            lora = LoraConfig(
                r=s.lora_r,
                lora_alpha=2 * s.lora_r,
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            )
            trainer = sft_trainer(
                model,
                data,
                tmp,
                warmup + timed,
                s,
                peft_config=lora,
                learning_rate=2e-4,
                per_device_train_batch_size=s.moe_batch,
                max_length=s.moe_seq,
                **checkpointing(s.cuda),
            )
            return trainer, info

        patch = leantrain_patch(moe4bit=True) if patched else None
        variants.append(Variant("moe_qlora", config, name, kind, baseline, make, patch, settings=settings))
    records: list[dict] = []
    try:
        for v in filtered(variants, args.only):
            records += run_group([v], s.moe_steps, s, budget)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records

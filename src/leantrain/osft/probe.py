"""OSFT's probe: whether the trainer can take factored linears, and which linears to factor (the plan):
per-architecture defaults and user patterns.

Pattern syntax (``osft_targets``), matched against module names relative to the model (``model.layers.0.mlp.up_proj``):
- ``re:<regex>``: a regular expression that must match the whole name;
- a pattern with ``*``, ``?`` or ``[``: an ``fnmatch`` glob on the whole name (``*.self_attn.*_proj``);
- anything else: an exact last-name suffix (``up_proj`` or ``mlp.up_proj`` match ``…layers.3.mlp.up_proj``).
Only plain ``nn.Linear`` and GPT-2 ``Conv1D`` modules are targets; a pattern that matches none is an error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..models import text_config, unwrap_model
from ..optimization import PatchContext, Readiness
from .linear import is_conv1d


_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LLAMA_LIKE = (*_ATTENTION, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "phi3": ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    "gpt_neox": ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    "gpt_oss": _ATTENTION,  # experts are fused 3-D parameters: attention only
}
# Any other model type gets the Llama set (Llama, Qwen, Mistral, Gemma, Granite, ...), attention only for MoE.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_target_type(module: nn.Module) -> bool:
    return type(module) is nn.Linear or is_conv1d(module)


def is_moe(config: object) -> bool:
    text = text_config(config)
    return any((getattr(text, key, 0) or 0) > 0 for key in _MOE_KEYS)


def default_patterns(config: object) -> tuple[str, ...]:
    model_type = getattr(text_config(config), "model_type", "")
    if model_type in DEFAULT_TARGETS:
        return DEFAULT_TARGETS[model_type]
    return _ATTENTION if is_moe(config) else _LLAMA_LIKE


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def find_targets(model: nn.Module, patterns: Sequence[str], *, strict: bool) -> list[tuple[str, nn.Module]]:
    """(name, module) of every plain Linear/Conv1D whose name matches a pattern, in model order.

    ``strict``: each pattern must match at least one such module (user patterns), else ValueError.
    """
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as error:
                raise ValueError(f"osft_targets: bad regular expression {pattern!r}: {error}") from None
    hits: dict[str, int] = dict.fromkeys(patterns, 0)
    found = []
    for name, module in model.named_modules():
        if not is_target_type(module):
            continue
        matched = [p for p in patterns if _matches(p, name)]
        for p in matched:
            hits[p] += 1
        if matched:
            found.append((name, module))
    missing = [p for p, n in hits.items() if n == 0]
    if strict and missing:
        raise ValueError(
            f"osft_targets pattern(s) {', '.join(map(repr, missing))} match no nn.Linear/Conv1D module of "
            f"{type(model).__name__} (names look like {_example(model)!r}; see leantrain.osft.probe for the syntax)"
        )
    return found


def _example(model: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if is_target_type(m)), "<no linear layers>")


def plan_targets(
    model: nn.Module, targets: Sequence[str] | None
) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """(targets to factor, {name: why skipped}). User patterns must each match; defaults come from the config."""
    base = unwrap_model(model)
    patterns = tuple(targets) if targets else default_patterns(getattr(base, "config", None))
    found = find_targets(base, patterns, strict=bool(targets))
    shared = _shared_weights(base)
    chosen, skipped = [], {}
    for name, module in found:
        weight = module.weight
        if not weight.requires_grad:
            skipped[name] = "weight is frozen (requires_grad=False, e.g. a PEFT base layer)"
        elif not weight.is_floating_point() or type(weight) not in (nn.Parameter, torch.Tensor):
            skipped[name] = f"weight is a {type(weight).__name__} ({weight.dtype}), not a dense float parameter"
        elif id(weight) in shared:
            skipped[name] = "weight is shared with another module (tied)"
        else:
            chosen.append((name, module))
    return chosen, skipped


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _readiness_problem(trainer: Any) -> str | None:
    if getattr(trainer, "optimizer", None) is not None:
        return (
            "the trainer already has an optimizer (passed with optimizers= or created by an earlier train()); it "
            "holds the dense weights that OSFT replaces: build the trainer without optimizers= and call "
            "patch_trainer before train()"
        )
    if getattr(trainer, "model_init", None) is not None:
        return "model_init re-creates the model inside train(), dropping the factored layers: pass model= instead"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed keeps gradients in its own partitions, out of reach of the projection: use FSDP2 or DDP"
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) != 2:
            return "FSDP1 flattens parameters, out of reach of the projection: use FSDP2 (fsdp_version: 2)"
    args = getattr(trainer, "args", None)
    if getattr(args, "use_vllm", False):
        return "vLLM weight sync needs dense weights and OSFT holds factors: set use_vllm=False"
    return None


def _linear_suffixes(model: nn.Module, limit: int = 4) -> list[str]:
    """The model's own linear names with the layer index cut off (``encoder.layer.0.attention.self.query`` ->
    ``attention.self.query``): patterns a user can pass as ``osft_targets``."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not is_target_type(module):
            continue
        parts = name.split(".")
        digits = [i for i, part in enumerate(parts) if part.isdigit()]
        suffix = ".".join(parts[digits[-1] + 1 :]) if digits else name
        if suffix and suffix not in found:
            found.append(suffix)
    return found[:limit]


def _no_targets_reason(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(text_config(config), "model_type", None) or "?"
    patterns = ", ".join(default_patterns(config))
    if model_type in DEFAULT_TARGETS:
        tried = f"the defaults for model type {model_type!r} ({patterns}) matched nothing"
    else:
        tried = f"model type {model_type!r} has no OSFT defaults, and the Llama names ({patterns}) matched nothing"
    own = _linear_suffixes(model)
    hint = f"; its linear layers include {', '.join(own)}" if own else ""
    return f"no OSFT target linears in {type(model).__name__}: {tried}{hint}; pass osft_targets=[...] name patterns"


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    problem = _readiness_problem(trainer)
    if problem:
        return Readiness.no(problem)
    model = unwrap_model(trainer.model)
    named, skipped = plan_targets(model, ctx.config.osft_targets)  # unmatched user pattern: ValueError
    if not named:
        if skipped:
            name, why = next(iter(skipped.items()))
            return Readiness.no(f"no usable OSFT target: {name}: {why} ({len(skipped)} such)")
        return Readiness.not_applicable(_no_targets_reason(model))
    if any(hasattr(module.weight, "device_mesh") for _, module in named):
        return Readiness.no(
            "the model is already sharded (DTensor weights, e.g. loaded with tp_plan or a device mesh): OSFT "
            "must factor dense weights before sharding"
        )
    return Readiness(detail=f"{len(named)} target linears", plan=(named, skipped))

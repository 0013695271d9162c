"""Which linears OSFT factors: per-architecture defaults and user patterns.

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

from torch import nn

from ..models import text_config
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
            f"{type(model).__name__} (names look like {_example(model)!r}; see leantrain.osft.targets for the syntax)"
        )
    return found


def _example(model: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if is_target_type(m)), "<no linear layers>")

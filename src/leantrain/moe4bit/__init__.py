"""Grouped 4-bit MoE experts: one dequantize per projection stack and two grouped GEMMs instead of the
per-expert loop (a dequantize and two matmuls per expert), with the loop kept as the fallback.

Serves frozen bitsandbytes 4-bit experts in two layouts: per-expert ``Linear4bit`` lists (community pre-quantized
gpt-oss checkpoints) and stock transformers 3-D experts quantized by :func:`quantize_experts_4bit`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .._patching import Undo
from .._registry import Applied, Optimization, PatchContext, Readiness, optional_import_reason, register
from ..config import ResolvedConfig
from ..models import unwrap_model
from .quantize import QuantizeReport, quantize_experts_4bit


__all__ = ["Moe4bit", "QuantizeReport", "quantize_experts_4bit"]

ROUTING_INDEX_NAMES = ("router_indices", "top_k_index")
ROUTING_WEIGHT_NAMES = ("routing_weights", "top_k_weights")


def _bnb_reason() -> str | None:
    return optional_import_reason("bitsandbytes", "bnb")


def _group(reasons: list[tuple[str, str]]) -> tuple[str, ...]:
    """One sentence per distinct reason, naming how many modules it affects and the first of them."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name, reason in reasons:
        by_reason[reason].append(name)
    return tuple(
        f"{reason} ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''})"
        for reason, names in by_reason.items()
    )


def _plugin(trainer: Any, name: str) -> Any:
    """accelerate's ``deepspeed_plugin`` / ``fsdp_plugin`` of the trainer's accelerator state, or None."""
    return getattr(getattr(getattr(trainer, "accelerator", None), "state", None), name, None)


def _zero3(trainer: Any) -> bool:
    plugin = _plugin(trainer, "deepspeed_plugin")
    return getattr(trainer, "is_deepspeed_enabled", False) and getattr(plugin, "zero_stage", None) == 3


def _fsdp2(trainer: Any) -> bool:
    plugin = _plugin(trainer, "fsdp_plugin")
    return getattr(trainer, "is_fsdp_enabled", False) and getattr(plugin, "fsdp_version", 1) == 2


def _fsdp_reason(trainer: Any, model: Any) -> str | None:
    """FSDP2 serves the stacked layout (the plan follows the unsharded stacks); FSDP1 flattens parameters and the
    per-expert Linear4bit layout is consolidated into shared buffers that sharding would split."""
    from . import _layouts

    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    if not _fsdp2(trainer):
        return "FSDP1 flattens the packed 4-bit expert stacks into its flat parameters: use FSDP2 (fsdp_version: 2)"
    lists = [f.name for f in _layouts.find_experts(unwrap_model(model)) if f.layout != "stacked"]
    if lists:
        return (
            f"FSDP2 would shard each expert's Linear4bit weight ({lists[0]}{' and more' if len(lists) > 1 else ''}),"
            " which the grouped path reads as one consolidated stack: use DDP or DeepSpeed ZeRO-2, where frozen "
            "4-bit experts stay whole on every rank"
        )
    return None


def readiness(model: Any) -> Readiness:
    """The probe on a model: not applicable without 4-bit MoE experts, else every reason the path cannot run."""
    from . import _layouts

    model = unwrap_model(model)
    found = _layouts.find_experts(model)
    older = _transformers_reason(model, bool(found))
    if older:
        return Readiness.no(older)
    if not found:
        return Readiness.not_applicable(f"{type(model).__name__} has no MoE experts module")
    reason = _bnb_reason()
    if reason:
        return Readiness.no(reason)
    quantized = [f for f in found if _layouts.is_4bit(f)]
    if not quantized:
        return Readiness.not_applicable(_layouts.NOT_4BIT_REASON)
    wrapped = _layouts._wrapped_ids(model)
    problems = [(f.name, _layouts.NOT_4BIT_REASON) for f in found if f not in quantized]
    problems += [(f.name, r) for f in quantized if (r := _layouts.module_reason(f, wrapped)) is not None]
    if problems:
        return Readiness.no(*_group(problems))
    details = set()
    for f in quantized:
        ok, detail = _layouts.grouped_mm_status(*_layouts.compute_dtype(f))
        if not ok:
            return Readiness.no(detail)
        details.add(detail)
    layouts = sorted({f.layout for f in quantized})
    return Readiness(detail=f"{len(quantized)} experts modules ({', '.join(layouts)}); {'; '.join(sorted(details))}")


def _transformers_reason(model: Any, found: bool) -> str | None:
    """On a MoE model, transformers 4.x: most experts are one module per expert there, and the experts' call
    convention is tested on 5.x only (the parity tests need 5.x's experts classes)."""
    from .._compat import TRANSFORMERS_3D_EXPERTS, needs

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (found or getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)):
        return None
    return needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D MoE experts and their tested call convention")


def _routing_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(expert ids, routing weights) from an experts forward call, positional or by any stock keyword."""
    rest = list(args)
    indices = rest.pop(0) if rest else next((kwargs[n] for n in ROUTING_INDEX_NAMES if n in kwargs), None)
    weights = rest.pop(0) if rest else next((kwargs[n] for n in ROUTING_WEIGHT_NAMES if n in kwargs), None)
    if indices is None or weights is None:
        raise TypeError("experts forward called without expert indices and routing weights")
    return indices, weights


def _fixed(plan, check):
    """A plan built at patch time, served after the per-call check (a moved model takes the stock path)."""

    def plan_for(hidden_states, indices, weights):
        check(hidden_states, indices, weights)
        return plan

    return plan_for


def _patched_forward(plan_for, fallback):
    from ._grouped import grouped_forward

    def make(original):
        def fast(hidden_states, *args, **kwargs):
            indices, weights = _routing_args(args, kwargs)
            plan = plan_for(hidden_states, indices, weights)  # before any kernel: raises into the fallback
            return grouped_forward(plan, hidden_states, indices, weights)

        def forward(hidden_states, *args, **kwargs):
            return fallback.call(fast, original, hidden_states, *args, **kwargs)

        return forward

    return make


@register
class Moe4bit(Optimization):
    """Grouped 4-bit MoE experts (see the module docstring); ``moe_recompute`` re-dequantizes in backward."""

    name = "moe4bit"

    def check_environment(self) -> tuple[str, ...]:
        reason = _bnb_reason()
        return (reason,) if reason else ()

    def probe(self, trainer: Any, config: ResolvedConfig) -> Readiness:
        ready = readiness(trainer.model)
        if not ready.ready:
            return ready
        if _zero3(trainer):
            return Readiness.no(
                "DeepSpeed ZeRO-3 partitions every parameter, the packed 4-bit expert stacks included, and the "
                "grouped path reads whole stacks: use ZeRO-2 (frozen 4-bit experts stay whole on every rank) or DDP"
            )
        reason = _fsdp_reason(trainer, trainer.model)
        return Readiness.no(reason) if reason else ready

    def apply(self, trainer: Any, ctx: PatchContext) -> Applied:
        from . import _adapters, _layouts

        model = unwrap_model(trainer.model)
        recompute = bool(ctx.config.moe_recompute)
        live = _fsdp2(trainer)  # FSDP2 swaps whole stacks in per call: the plan is rebuilt around them per call
        undo = Undo()
        targets = []
        wrapped = _adapters.wrapped_map(model)
        try:
            for found in _layouts.find_experts(model):
                if live:
                    plan_for = _layouts.live_stacked_plan(found.module, recompute)
                else:
                    plan_for = _fixed(*_layouts.build_plan(found, undo, recompute))
                plan_for = _adapters.with_adapters(
                    plan_for, _adapters.adapters_for(found.layout, found.module, wrapped)
                )
                owner = _adapters.forward_owner(wrapped, found.module)  # PEFT target_parameters: its outer wrapper
                undo.wrap_method(
                    owner,
                    "forward",
                    _adapters.owner_forward(_patched_forward(plan_for, ctx.fallback), owner, found.module),
                )
                targets.append(found.name)
        except BaseException:
            undo()
            raise
        detail = readiness(model).detail + f"; recompute {'on' if recompute else 'off'}"
        detail += "; FSDP2: plan rebuilt per call around the unsharded stacks" if live else ""
        return Applied(undo, tuple(targets), detail)

"""Readiness: whether the grouped 4-bit path can serve each experts module, with a precise reason when it cannot
(cached per module until what it looked at changes), and the probe on a trainer: the model plan (one target per
experts module with everything ``apply`` needs, recompute chosen per layout and shape)."""

from __future__ import annotations

import dataclasses
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ..models import data_parallel_reason, unwrap_model
from ..optimization import PatchContext, Readiness, optional_import_reason
from . import _adapters, measured, recompute
from ._custom_ops import grouped_mm
from .layouts import Found
from .plan import ModelPlan, Target
from .registry import find_experts, layout_of


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str | None]] = weakref.WeakKeyDictionary()


def module_reason(found: Found, wrapped: dict[int, nn.Module]) -> str | None:
    """Why this module cannot take the grouped path (None: it can); cached per module until its signature changes."""
    layout = layout_of(found)
    sig = layout.signature(found.module, wrapped)
    hit = _CACHE.get(found.module)
    if hit is not None and hit[0] == sig:
        return hit[1]
    reason = layout.reason(found.module, wrapped)
    _CACHE[found.module] = (sig, reason)
    return reason


_GMM_CACHE: dict[tuple[str, torch.dtype], tuple[bool, str]] = {}


def grouped_mm_status(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(usable, detail): run a tiny grouped_mm once per device/dtype rather than trusting version numbers."""
    key = (str(device), dtype)
    if key in _GMM_CACHE:
        return _GMM_CACHE[key]
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        result = (False, f"torch {torch.__version__} has no grouped_mm: upgrade torch (>= 2.9)")
    else:
        try:
            a = torch.ones(3, 16, device=device, dtype=dtype)
            b = torch.ones(2, 16, 8, device=device, dtype=dtype)
            out = grouped_mm(a, b, torch.tensor([1, 3], device=device, dtype=torch.int32))
            if not bool((out == 16).all()):  # probe-time host sync, once per device/dtype
                raise RuntimeError("wrong result")
            result = (True, _path_detail(device, dtype))
        except Exception as error:
            result = (False, f"torch grouped_mm does not run on {device} with {dtype} ({type(error).__name__})")
    _GMM_CACHE[key] = result
    return result


def _path_detail(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10):
        return "fast path (bf16 grouped GEMM on sm90/sm100)"
    return (
        f"slow path: grouped_mm on {device.type} with {str(dtype).replace('torch.', '')} runs one GEMM per group "
        "(bf16 on sm90/sm100 is the fast path)"
    )


def compute_dtype(found: Found) -> tuple[torch.device, torch.dtype]:
    return layout_of(found).compute_dtype(found.module)


# ------------------------------------------------------------------------------------------------- model probe


def bnb_reason() -> str | None:
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


def zero3(trainer: Any) -> bool:
    plugin = _plugin(trainer, "deepspeed_plugin")
    return getattr(trainer, "is_deepspeed_enabled", False) and getattr(plugin, "zero_stage", None) == 3


def fsdp2(trainer: Any) -> bool:
    plugin = _plugin(trainer, "fsdp_plugin")
    return getattr(trainer, "is_fsdp_enabled", False) and getattr(plugin, "fsdp_version", 1) == 2


ZERO3_REASON = (
    "DeepSpeed ZeRO-3 partitions every parameter, the packed 4-bit expert stacks included, and the grouped path "
    "reads whole stacks: use ZeRO-2 (frozen 4-bit experts stay whole on every rank) or DDP"
)


def fsdp_reason(trainer: Any, model: Any) -> str | None:
    """FSDP2 serves the stacked layout (the plan follows the unsharded stacks); FSDP1 flattens parameters and the
    per-expert Linear4bit layout is consolidated into shared buffers that sharding would split."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    if not fsdp2(trainer):
        return "FSDP1 flattens the packed 4-bit expert stacks into its flat parameters: use FSDP2 (fsdp_version: 2)"
    lists = [f.name for f in find_experts(unwrap_model(model)) if not layout_of(f).fsdp2]
    if lists:
        return (
            f"FSDP2 would shard each expert's Linear4bit weight ({lists[0]}{' and more' if len(lists) > 1 else ''}),"
            " which the grouped path reads as one consolidated stack: use DDP or DeepSpeed ZeRO-2, where frozen "
            "4-bit experts stay whole on every rank"
        )
    return None


def readiness(model: Any) -> Readiness:
    """The probe on a model: not applicable without 4-bit MoE experts, else every reason the path cannot run.

    Checked in the order that names what actually blocks: no experts, experts not quantized (nothing to do, whatever
    is installed), the transformers version, bitsandbytes, then each module."""
    model = unwrap_model(model)
    found = find_experts(model)
    older = _transformers_reason(model, found)
    if not found:
        hint = f" ({older})" if older else ""
        return Readiness.not_applicable(f"{type(model).__name__} has no MoE experts module{hint}")
    bnb_missing = bnb_reason()
    quantized = [f for f in found if _is_4bit(f, bnb_missing)]
    if not quantized:
        return Readiness.not_applicable(not_4bit_reason(found[0]))
    if older:
        return Readiness.no(older)
    if bnb_missing:
        return Readiness.no(bnb_missing)
    wrapped = _adapters.wrapped_map(model)
    problems = [(f.name, not_4bit_reason(f)) for f in found if f not in quantized]
    problems += [(f.name, r) for f in quantized if (r := module_reason(f, wrapped)) is not None]
    if problems:
        return Readiness.no(*_group(problems))
    details = set()
    for f in quantized:
        ok, detail = grouped_mm_status(*compute_dtype(f))
        if not ok:
            return Readiness.no(detail)
        details.add(detail)
    layouts = sorted({f.layout for f in quantized})
    return Readiness(detail=f"{len(quantized)} experts modules ({', '.join(layouts)}); {'; '.join(sorted(details))}")


def _is_4bit(found: Found, bnb_missing: str | None) -> bool:
    """Whether the module's experts are bitsandbytes 4-bit. Without an importable bitsandbytes, by the classes alone
    (a 4-bit layer or parametrization is an instance of a bitsandbytes class), so that experts that are not
    quantized say so rather than asking for bitsandbytes."""
    if bnb_missing is None:
        return layout_of(found).is_4bit(found.module)
    return any(type(m).__module__.partition(".")[0] == "bitsandbytes" for m in found.module.modules())


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    """The probe on a trainer: the model's readiness, then the engine (ZeRO-3, FSDP, DataParallel); when ready, the
    plan with one :class:`Target` per experts module (recompute per layout and shape: :mod:`recompute`). Off CUDA
    the auto rule is the measured table (:mod:`measured`), weighed with any blocker by the entry point."""
    ready = readiness(trainer.model)
    if not ready.applicable:
        return ready
    rule, measured_why = auto_rule(trainer, ctx.trainer_kind)
    if ready.blocked:
        return ready.with_auto_rule(rule)
    if zero3(trainer):
        return Readiness.no(ZERO3_REASON).with_auto_rule(rule)
    reason = fsdp_reason(trainer, trainer.model) or data_parallel_reason(
        trainer,
        "the grouped experts forward is patched on the module instance and its plan holds the packed "
        "stacks of the first GPU, so every replica would compute there",
    )
    if reason:
        return Readiness.no(reason).with_auto_rule(rule)
    model = unwrap_model(trainer.model)
    wrapped = _adapters.wrapped_map(model)
    targets = [target(f, wrapped, ctx.config.moe_recompute) for f in find_experts(model)]
    live = fsdp2(trainer)  # FSDP2 swaps whole stacks in per call: the plan is rebuilt around them per call
    choices = sorted({f"{t.layout} {recompute.describe(t.recompute, t.recompute_why)}" for t in targets})
    detail = "; ".join([ready.detail, *choices, *([measured_why] if measured_why else [])])
    detail += "; FSDP2: plan rebuilt per call around the unsharded stacks" if live else ""
    return dataclasses.replace(ready, detail=detail, plan=ModelPlan(targets, detail, live)).with_auto_rule(rule)


def auto_rule(trainer: Any, kind: str) -> tuple[str | None, str]:
    """(why auto mode keeps the stock experts here or None, why it applies them or ""). On CUDA no rule (the grouped
    path serves wherever it is ready); elsewhere the measured table decides for every distinct experts count."""
    model = unwrap_model(trainer.model)
    found = find_experts(model)
    device = _device(found, trainer)
    if device == "cuda":
        return None, ""
    if _adapters.stock_lora_breaks(model, [f.module for f in found]):
        return None, STOCK_LORA_BREAKS
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    counts = sorted({layout_of(f).num_experts(f.module) for f in found})
    verdicts = [measured.choose(device, kind, experts, hidden) for experts in counts]
    slower = [why for faster, why in verdicts if not faster]
    return (slower[0], "") if slower else (None, "; ".join(why for _, why in verdicts))


def stock_lora_reason(trainer: Any) -> str | None:
    """Why PEFT's own LoRA forward cannot train the trainer's expert stacks (4-bit parametrized stacks under PEFT
    ``ParamWrapper``s), or None."""
    model = unwrap_model(trainer.model)
    found = find_experts(model)
    if not found or not _adapters.stock_lora_breaks(model, [f.module for f in found]):
        return None
    return (
        f"LoRA sits on {len(found)} 4-bit expert stack(s) (quantize_experts_4bit), which PEFT's own forward cannot "
        "train (its nested wrappers drop the inner stack's adapter, then fail on the next forward); leave moe4bit "
        "on auto (or pass moe4bit=True): its grouped path applies the adapters itself"
    )


STOCK_LORA_BREAKS = (
    "applies where not measured faster: PEFT's own forward cannot train LoRA on these 4-bit expert stacks (its "
    "nested wrappers drop the inner stack's adapter, then fail on the next forward), so the grouped path, which "
    "applies the adapters itself, serves them"
)


def _device(found: list[Found], trainer: Any) -> str:
    """The device class the experts compute on: where their weights are, else the trainer's device."""
    for f in found:
        for tensor in (*f.module.parameters(), *f.module.buffers()):
            return tensor.device.type
    return trainer.args.device.type


def target(found: Found, wrapped: dict[int, nn.Module], explicit_recompute: bool | None) -> Target:
    """Everything ``apply`` needs for one ready experts module: the method it replaces (a 4.x block's forward or
    DeepSeek-V2's ``moe``; the experts' forward, or the outermost ParamWrapper's under ``target_parameters`` LoRA),
    the block recipe, the adapters, and recompute or saved stacks."""
    layout = layout_of(found)
    recipe = layout.recipe(found.module)
    if recipe is not None:
        owner, hook = found.module, recipe.hook
    else:
        owner, hook = _adapters.forward_owner(wrapped, found.module), "forward"
    rc, why = recompute.choose(found.layout, _stack_bytes(found), explicit_recompute)
    adapters = layout.adapters(found.module, wrapped)
    return Target(found.name, found.module, found.layout, owner, hook, recipe, adapters, rc, why)


def _stack_bytes(found: Found) -> int:
    """Bytes of the larger dequantized stack (gate_up: [E, 2I, H]) in the dtype it dequantizes to."""
    layout = layout_of(found)
    dtype = layout.compute_dtype(found.module)[1]
    return layout.stack_elements(found.module) * torch.empty((), dtype=dtype).element_size()


def not_4bit_reason(found: Found) -> str:
    return layout_of(found).not_4bit_reason


def _transformers_reason(model: Any, found: list[Found]) -> str | None:
    """On transformers 4.x: the per-expert MLP blocks are served (their 4.57 forwards are reproduced and tested);
    3-D stacks and the gpt-oss Linear4bit lists follow 5.x's experts call convention, tested on 5.x only."""
    from .._compat import TRANSFORMERS_3D_EXPERTS, needs

    if found and all(layout_of(f).transformers4 for f in found):
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (found or getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)):
        return None
    return needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D MoE experts and their tested call convention")

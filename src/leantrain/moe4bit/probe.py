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
from . import _adapters, recompute
from ._stacks import MAX_ELEMENTS_PER_CALL, NESTED_BLOCKSIZE, state_tensors
from .layouts import (
    Found,
    block_recipe,
    bnb_parametrization,
    expert_mlp_names,
    expert_projections,
    find_experts,
    is_4bit,
    is_stock_expert_mlp,
    replaced,
)
from .ops import grouped_mm
from .plan import ModelPlan, Target, device_mix_reason, state_key, tensor_key
from .quantize import BIAS_NAMES, STACK_NAMES


LORA_REASON = (
    "a PEFT tuner wraps an experts module or an expert MLP as a whole: the grouped 4-bit path serves LoRA on the "
    'expert projections (PEFT target_modules naming them, or "all-linear") and target_parameters LoRA on '
    "quantize_experts_4bit stacks"
)
NOT_4BIT_REASON = "MoE experts are not 4-bit: run leantrain.quantize_experts_4bit(model) first"
NOT_4BIT_MLPS_REASON = (
    "MoE expert MLPs are not 4-bit: load the model with quantization_config=BitsAndBytesConfig(load_in_4bit=True)"
)


def lora_reason(module: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    """Why a PEFT tuner wrapping this whole module (an MoE block or an expert MLP) keeps it off the grouped path;
    None: not wrapped."""
    tuned = id(module) in wrapped or _adapters.is_tuned(module)
    return LORA_REASON if tuned else None


def expert_lora_reason(found: Found, wrapped: dict[int, nn.Module]) -> str | None:
    """Why PEFT adapters on a served layout keep it off the grouped path (``_adapters``: LoRA on every expert
    projection of the per-expert layouts, ``target_parameters`` LoRA on 4-bit stacks); None: no adapters, or
    servable."""
    if found.layout == "stacked":
        return _adapters.stacked_reason(found.module, wrapped)
    if found.layout == "expert_mlps":
        names = expert_mlp_names(found.module.experts[0])
        return _adapters.per_expert_reason(dict(zip(names, expert_projections(found.module))))
    return _adapters.per_expert_reason(
        {"gate_up_projs": list(found.module.gate_up_projs), "down_projs": list(found.module.down_projs)}
    )


def _linear4bit_tensors(name: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    weight = layer.weight
    found = {f"{name} packed data": weight}
    found.update({f"{name} {k}": t for k, t in state_tensors(weight.quant_state).items()})
    if layer.bias is not None:
        found[f"{name} bias"] = layer.bias
    return found


def _stacked_tensors(module: nn.Module, plists: list) -> dict[str, torch.Tensor]:
    found = {}
    for name, plist in zip(STACK_NAMES, plists):
        found[f"{name} packed data"] = plist.original
        found.update({f"{name} {k}": t for k, t in state_tensors(plist[0].quant_state).items()})
    for name in BIAS_NAMES:
        if module._parameters.get(name) is not None:
            found[name] = module._parameters[name]
    return found


def _format_reason(qs_list: list, rows_cols: tuple[int, int]) -> str | None:
    """Checks shared by both layouts on the quant states of one projection stack."""
    first = qs_list[0]
    rows, cols = rows_cols
    if first.quant_type not in ("nf4", "fp4"):
        return f"unknown 4-bit quant_type {first.quant_type!r}"
    if (rows * cols) % first.blocksize or (rows * cols) % 2:
        return f"an expert's {rows}x{cols} elements are not a whole number of {first.blocksize}-element blocks"
    if rows * cols > MAX_ELEMENTS_PER_CALL:
        return f"an expert's {rows}x{cols} elements exceed bitsandbytes' 32-bit element count"
    if first.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"experts dequantize to {first.dtype}"
    if first.nested and first.state2.blocksize != NESTED_BLOCKSIZE:
        return f"double quantization with absmax blocksize {first.state2.blocksize} (bitsandbytes uses 256)"
    if rows % 8 or cols % 8:
        return f"expert dims {rows}x{cols} are not multiples of 8 (grouped_mm needs 16-byte aligned strides)"
    return None


def _layer_reason(layer: nn.Module, wrapped: dict[int, nn.Module] | None) -> str | None:
    """One per-expert projection: a plain, quantized, frozen ``bnb.nn.Linear4bit`` in training layout (``wrapped``
    None: its adapters were checked already and ``layer`` is the Linear4bit under them)."""
    import bitsandbytes as bnb

    reason = lora_reason(layer, wrapped) if wrapped is not None else None
    if reason:
        return reason
    if type(layer) is not bnb.nn.Linear4bit:
        return f"an expert is a {type(layer).__name__}, not a plain bitsandbytes Linear4bit"
    weight = layer.weight
    if not isinstance(weight, bnb.nn.Params4bit) or getattr(weight, "quant_state", None) is None:
        return "an expert weight is not quantized yet (no quant_state): move the model to its device first"
    if weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad):
        return "expert weights or biases require grad: the grouped path computes no expert gradients"
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        return "an expert weight was repacked by bitsandbytes for CPU inference (eval without grad on CPU)"
    return None


def _stack_reason(layers: list[nn.Module]) -> str | None:
    """Layers consolidated into one packed stack: one format, device, compute dtype and bias presence."""
    states = [layer.weight.quant_state for layer in layers]
    first = states[0]
    key = (first.quant_type, first.blocksize, first.dtype, tuple(first.shape), first.nested)
    bias_key = layers[0].bias is None
    if any((qs.quant_type, qs.blocksize, qs.dtype, tuple(qs.shape), qs.nested) != key for qs in states) or any(
        (layer.bias is None) != bias_key for layer in layers
    ):
        return "experts differ in quant_type, blocksize, dtype, shape, double quantization or bias"
    if len({layer.weight.device for layer in layers}) > 1 or len({layer.compute_dtype for layer in layers}) > 1:
        return "experts live on different devices or use different compute dtypes"
    if first.nested and any(not torch.equal(qs.state2.code, first.state2.code) for qs in states[1:]):
        return "experts use different double-quantization codes"
    return _format_reason(states, tuple(int(s) for s in first.shape))


def _layers_reason(named: dict[str, list[nn.Module]], wrapped: dict[int, nn.Module] | None) -> str | None:
    """Per-layer checks, then one device for every tensor the kernels read."""
    for layers in named.values():
        for layer in layers:
            reason = _layer_reason(layer, wrapped)
            if reason:
                return reason
    tensors = {}
    for label, layers in named.items():
        for e, layer in enumerate(layers):
            tensors.update(_linear4bit_tensors(f"{label}.{e}", layer))
    return device_mix_reason(tensors)


def _lists_reason(module: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    ups, downs = list(module.gate_up_projs), list(module.down_projs)
    if not ups or len(ups) != len(downs):
        return f"gate_up_projs ({len(ups)}) and down_projs ({len(downs)}) differ in length"
    reason = expert_lora_reason(Found("", module, "linear4bit"), wrapped)  # served LoRA: checked here
    if reason:
        return reason
    ups, downs = ([_adapters.base(m) for m in group] for group in (ups, downs))  # the Linear4bit under any LoRA
    reason = _layers_reason({"gate_up_projs": ups, "down_projs": downs}, None)
    if reason:
        return reason
    for layers in (ups, downs):
        reason = _stack_reason(layers)
        if reason:
            return reason
    up_rows, hidden = (int(s) for s in ups[0].weight.quant_state.shape)
    down_rows, inter = (int(s) for s in downs[0].weight.quant_state.shape)
    if down_rows != hidden or up_rows != 2 * inter:
        return f"gate_up ({up_rows}x{hidden}) and down ({down_rows}x{inter}) shapes do not form a gated MLP"
    if not (hasattr(module, "alpha") and hasattr(module, "limit")) and not callable(getattr(module, "act_fn", None)):
        return "unknown expert activation (neither gpt-oss alpha/limit nor act_fn)"
    return None


def _routing_reason(block: nn.Module, recipe) -> str | None:
    """The block attributes the replaced forward reads, as the stock forward would use them."""
    experts = len(block.experts)
    if recipe.hook == "moe":  # DeepSeek-V2: the stock router and forward stay; only the experts step is replaced
        if getattr(block, "ep_rank", 0) != 0 or getattr(block, "experts_per_rank", experts) != experts:
            return "expert-parallel MoE blocks (ep_rank / experts_per_rank) are not supported"
        return None
    top_k = getattr(block, "top_k", None)
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        return f"the MoE block's top_k ({top_k!r}) is not an expert count in 1..{experts}"
    if getattr(block.gate, "out_features", experts) != experts:
        return f"the router scores {block.gate.out_features} experts, the block has {experts}"
    if recipe.normalize == "norm_topk_prob" and not isinstance(getattr(block, "norm_topk_prob", None), bool):
        return "the MoE block has no boolean norm_topk_prob"
    if getattr(block, "jitter_noise", 0):
        return (
            f"router jitter noise ({block.jitter_noise}) multiplies the hidden states by fresh noise in training: "
            "set router_jitter_noise=0 in the model config to use the grouped path"
        )
    if recipe.shared and not all(isinstance(getattr(block, n, None), nn.Module) for n in SHARED_NAMES):
        return "the MoE block has no shared_expert / shared_expert_gate"
    return None


SHARED_NAMES = ("shared_expert", "shared_expert_gate")


def _expert_mlps_reason(block: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    """A transformers 4.x sparse MoE block: a stock forward, stock expert MLPs, and per-expert Linear4bit gate, up and
    down projections that consolidate into one gate_up and one down stack."""
    recipe = block_recipe(block)
    if recipe is None:
        module, qualname = (getattr(type(block).forward, a, "?") for a in ("__module__", "__qualname__"))
        return (
            f"{type(block).__name__}'s forward ({module}.{qualname}) is not a stock transformers 4.x MoE block "
            "forward whose routing leantrain reproduces (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2)"
        )
    if replaced(block, recipe.hook):
        return f"the MoE block's {recipe.hook} is already replaced on the instance (another library patched it)"
    reason = lora_reason(block, wrapped) or _routing_reason(block, recipe)
    if reason:
        return reason
    for expert in block.experts:
        reason = lora_reason(expert, wrapped)
        if reason:
            return reason
        if not is_stock_expert_mlp(expert) or replaced(expert, "forward"):
            return f"an expert is a {type(expert).__name__} whose forward is not a stock gated MLP"
        if not callable(getattr(expert, "act_fn", None)) or type(expert.act_fn) is not type(block.experts[0].act_fn):
            return "experts have no act_fn or different activations"
    reason = expert_lora_reason(Found("", block, "expert_mlps"), wrapped)  # served LoRA: checked here
    if reason:
        return reason
    gates, ups, downs = ([_adapters.base(m) for m in group] for group in expert_projections(block))  # under any LoRA
    reason = _layers_reason({"gate": gates, "up": ups, "down": downs}, None)
    if reason:
        return reason
    if any(layer.bias is not None for layer in gates + ups + downs):
        return "expert projections have biases (stock 4.x MoE experts have none; config mlp_bias=True)"
    reason = _stack_reason(gates + ups) or _stack_reason(downs)  # gate and up rows form one gate_up stack
    if reason:
        return reason
    inter, hidden = (int(s) for s in gates[0].weight.quant_state.shape)
    if tuple(int(s) for s in downs[0].weight.quant_state.shape) != (hidden, inter):
        return (
            f"gate/up ({inter}x{hidden}) and down {tuple(downs[0].weight.quant_state.shape)} do not form a gated MLP"
        )
    return None


def _stacked_reason(module: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    reason = expert_lora_reason(Found("", module, "stacked"), wrapped)
    if reason:
        return reason
    plists = [bnb_parametrization(module, n) for n in STACK_NAMES]
    if any(p is None for p in plists):
        return NOT_4BIT_REASON
    if any(p.original.requires_grad for p in plists):
        return "packed expert stacks require grad: the grouped path computes no expert gradients"
    if any(module._parameters.get(b) is not None and module._parameters[b].requires_grad for b in BIAS_NAMES):
        return "expert biases require grad: freeze them (leantrain.quantize_experts_4bit does)"
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return "experts without a gate or with a post-expert norm are not supported"
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel experts are not supported"
    if not callable(getattr(module, "_apply_gate", None)) and not callable(getattr(module, "act_fn", None)):
        return "unknown expert activation (no _apply_gate or act_fn)"
    reason = device_mix_reason(_stacked_tensors(module, plists))
    if reason:
        return reason
    states = [p[0].quant_state for p in plists]
    if len({qs.dtype for qs in states}) > 1:
        return "gate_up and down stacks dequantize to different dtypes"
    for qs in states:
        if len(qs.shape) != 3:
            return f"a packed expert stack has shape {tuple(qs.shape)}, not [E, rows, cols]"
        reason = _format_reason([qs], (int(qs.shape[1]), int(qs.shape[2])))
        if reason:
            return reason
    (e1, a1, b1), (e2, a2, b2) = ((int(s) for s in qs.shape) for qs in states)
    transposed = bool(getattr(module, "is_transposed", False))
    hidden, two_i = (a1, b1) if transposed else (b1, a1)
    inter, hidden2 = (a2, b2) if transposed else (b2, a2)
    if e1 != e2 or hidden != hidden2 or two_i != 2 * inter:
        return f"gate_up {tuple(states[0].shape)} and down {tuple(states[1].shape)} do not form a gated MLP"
    return None


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str | None]] = weakref.WeakKeyDictionary()


def _signature(found: Found, wrapped: dict[int, nn.Module]) -> tuple:
    """Cheap identity of what the readiness check looked at (modules, tensors with their devices, states, grads)."""
    module = found.module
    if found.layout == "stacked":
        parts = [id(module) in wrapped, getattr(module, "_is_expert_parallel", False)]
        for name in STACK_NAMES:
            plist = bnb_parametrization(module, name)
            parts.append(
                None if plist is None else (tensor_key(plist.original), id(plist[0]), state_key(plist[0].quant_state))
            )
        parts += [tensor_key(module._parameters.get(name)) for name in BIAS_NAMES]
        return tuple(parts)
    if found.layout == "expert_mlps":
        parts = [
            *(getattr(module, n, None) for n in ("top_k", "norm_topk_prob", "jitter_noise", "ep_rank")),
            id(getattr(module, "gate", None)),
            type(module),
            tuple(replaced(module, k) for k in ("forward", "moe")),
            tuple(id(m) in wrapped or replaced(m, "forward") for m in (module, *module.experts)),
        ]
        layers = [m for group in expert_projections(module) for m in group]
    else:
        parts, layers = [], list(module.gate_up_projs) + list(module.down_projs)

    for layer in layers:
        inner = _adapters.base(layer)
        weight, bias = getattr(inner, "weight", None), getattr(inner, "bias", None)
        parts.append(
            (
                id(layer),
                id(inner),
                id(layer) in wrapped,
                _adapters.adapter_key(layer),
                tensor_key(weight) if isinstance(weight, torch.Tensor) else id(weight),
                state_key(getattr(weight, "quant_state", None)),
                tensor_key(bias) if isinstance(bias, torch.Tensor) else id(bias),
                getattr(inner, "compute_dtype", None),
            )
        )
    return tuple(parts)


def module_reason(found: Found, wrapped: dict[int, nn.Module]) -> str | None:
    """Why this module cannot take the grouped path (None: it can); cached per module until its signature changes."""
    sig = _signature(found, wrapped)
    hit = _CACHE.get(found.module)
    if hit is not None and hit[0] == sig:
        return hit[1]
    check = {"stacked": _stacked_reason, "expert_mlps": _expert_mlps_reason}.get(found.layout, _lists_reason)
    reason = check(found.module, wrapped)
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
    if found.layout == "stacked":
        plist = bnb_parametrization(found.module, STACK_NAMES[0])
        return plist.original.device, plist[0].quant_state.dtype
    layer = expert_projections(found.module)[0][0] if found.layout == "expert_mlps" else found.module.gate_up_projs[0]
    layer = _adapters.base(layer)
    return layer.weight.device, layer.compute_dtype or layer.weight.quant_state.dtype


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
    lists = [f.name for f in find_experts(unwrap_model(model)) if f.layout != "stacked"]
    if lists:
        return (
            f"FSDP2 would shard each expert's Linear4bit weight ({lists[0]}{' and more' if len(lists) > 1 else ''}),"
            " which the grouped path reads as one consolidated stack: use DDP or DeepSpeed ZeRO-2, where frozen "
            "4-bit experts stay whole on every rank"
        )
    return None


def readiness(model: Any) -> Readiness:
    """The probe on a model: not applicable without 4-bit MoE experts, else every reason the path cannot run."""
    model = unwrap_model(model)
    found = find_experts(model)
    older = _transformers_reason(model, found)
    if older:
        return Readiness.no(older)
    if not found:
        return Readiness.not_applicable(f"{type(model).__name__} has no MoE experts module")
    reason = bnb_reason()
    if reason:
        return Readiness.no(reason)
    quantized = [f for f in found if is_4bit(f)]
    if not quantized:
        return Readiness.not_applicable(not_4bit_reason(found[0]))
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


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    """The probe on a trainer: the model's readiness, then the engine (ZeRO-3, FSDP, DataParallel); when ready, the
    plan with one :class:`Target` per experts module (recompute per layout and shape: :mod:`recompute`)."""
    ready = readiness(trainer.model)
    if not ready.ready:
        return ready
    if zero3(trainer):
        return Readiness.no(ZERO3_REASON)
    reason = fsdp_reason(trainer, trainer.model) or data_parallel_reason(
        trainer,
        "the grouped experts forward is patched on the module instance and its plan holds the packed "
        "stacks of the first GPU, so every replica would compute there",
    )
    if reason:
        return Readiness.no(reason)
    model = unwrap_model(trainer.model)
    wrapped = _adapters.wrapped_map(model)
    targets = [target(f, wrapped, ctx.config.moe_recompute) for f in find_experts(model)]
    live = fsdp2(trainer)  # FSDP2 swaps whole stacks in per call: the plan is rebuilt around them per call
    choices = sorted({f"{t.layout} {recompute.describe(t.recompute, t.recompute_why)}" for t in targets})
    detail = "; ".join([ready.detail, *choices])
    detail += "; FSDP2: plan rebuilt per call around the unsharded stacks" if live else ""
    return dataclasses.replace(ready, detail=detail, plan=ModelPlan(targets, detail, live))


def target(found: Found, wrapped: dict[int, nn.Module], explicit_recompute: bool | None) -> Target:
    """Everything ``apply`` needs for one ready experts module: the method it replaces (a 4.x block's forward or
    DeepSeek-V2's ``moe``; the experts' forward, or the outermost ParamWrapper's under ``target_parameters`` LoRA),
    the block recipe, the adapters, and recompute or saved stacks."""
    recipe = block_recipe(found.module) if found.layout == "expert_mlps" else None
    if recipe is not None:
        owner, hook = found.module, recipe.hook
    else:
        owner, hook = _adapters.forward_owner(wrapped, found.module), "forward"
    rc, why = recompute.choose(found.layout, _stack_bytes(found), explicit_recompute)
    adapters = _adapters.find(found.layout, found.module, wrapped)
    return Target(found.name, found.module, found.layout, owner, hook, recipe, adapters, rc, why)


def _stack_bytes(found: Found) -> int:
    """Bytes of the larger dequantized stack (gate_up: [E, 2I, H]) in the dtype it dequantizes to."""
    dtype = compute_dtype(found)[1]
    if found.layout == "stacked":
        elements = bnb_parametrization(found.module, STACK_NAMES[0])[0].quant_state.shape.numel()
    elif found.layout == "expert_mlps":
        gates = expert_projections(found.module)[0]
        elements = 2 * len(gates) * _adapters.base(gates[0]).weight.quant_state.shape.numel()
    else:
        ups = found.module.gate_up_projs
        elements = len(ups) * _adapters.base(ups[0]).weight.quant_state.shape.numel()
    return int(elements) * torch.empty((), dtype=dtype).element_size()


def not_4bit_reason(found: Found) -> str:
    return NOT_4BIT_MLPS_REASON if found.layout == "expert_mlps" else NOT_4BIT_REASON


def _transformers_reason(model: Any, found: list[Found]) -> str | None:
    """On transformers 4.x: the per-expert MLP blocks are served (their 4.57 forwards are reproduced and tested);
    3-D stacks and the gpt-oss Linear4bit lists follow 5.x's experts call convention, tested on 5.x only."""
    from .._compat import TRANSFORMERS_3D_EXPERTS, needs

    if found and all(f.layout == "expert_mlps" for f in found):
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (found or getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)):
        return None
    return needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D MoE experts and their tested call convention")

"""Find MoE experts modules, decide whether the grouped 4-bit path can serve them (with reasons), and build the plan.

Two layouts:
- ``linear4bit``: ``gate_up_projs`` / ``down_projs`` ModuleLists of ``bnb.nn.Linear4bit`` (community pre-quantized
  gpt-oss checkpoints; ``F.linear`` orientation, gate/up interleaved, biases, dense ``[T, E]`` routing weights).
- ``stacked``: stock transformers 5.x experts whose 3-D ``gate_up_proj`` / ``down_proj`` were quantized by
  :func:`leantrain.quantize_experts_4bit` (bitsandbytes' 4-bit parametrization).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .._patching import Undo
from ._grouped import ExpertsPlan, Projection, clamp_swiglu, gated_act, grouped_mm
from ._stacks import (
    MAX_ELEMENTS_PER_CALL,
    NESTED_BLOCKSIZE,
    consolidate_linear4bit,
    stack_from_quant_state,
    state_tensors,
)
from .quantize import BIAS_NAMES, STACK_NAMES


NOT_4BIT_REASON = "MoE experts are not 4-bit: run leantrain.quantize_experts_4bit(model) first"


@dataclass
class Found:
    name: str
    module: nn.Module
    layout: str  # "linear4bit" | "stacked"


def _is_lists(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_projs", None), nn.ModuleList) and isinstance(
        getattr(module, "down_projs", None), nn.ModuleList
    )


def _is_stacked(module: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    def ok(name: str) -> bool:
        param = module._parameters.get(name)
        return (param is not None and param.dim() == 3) or parametrize.is_parametrized(module, name)

    return all(ok(name) for name in STACK_NAMES)


def find_experts(model: nn.Module) -> list[Found]:
    """Every experts module of either layout (structural: needs no bitsandbytes)."""
    found = []
    for name, module in model.named_modules():
        if _is_lists(module):
            found.append(Found(name, module, "linear4bit"))
        elif _is_stacked(module):
            found.append(Found(name, module, "stacked"))
    return found


def _wrapped_ids(model: nn.Module) -> dict[int, nn.Module]:
    """Modules that a PEFT tuner layer wraps, by id, to their wrapper: LoRA on an expert or on an experts stack."""
    from ._adapters import wrapped_map

    return wrapped_map(model)


def _bnb_parametrization(module: nn.Module, name: str):
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from torch.nn.utils import parametrize

    if not parametrize.is_parametrized(module, name):
        return None
    plist = module.parametrizations[name]
    if len(plist) != 1 or not isinstance(plist[0], Bnb4bitParametrization) or plist[0].quant_state is None:
        return None
    return plist


def is_4bit(found: Found) -> bool:
    import bitsandbytes as bnb

    if found.layout == "stacked":
        return all(_bnb_parametrization(found.module, n) is not None for n in STACK_NAMES)
    layers = list(found.module.gate_up_projs) + list(found.module.down_projs)
    return bool(layers) and all(isinstance(getattr(m, "base_layer", m), bnb.nn.Linear4bit) for m in layers)


# ---------------------------------------------------------------------------------------------------- readiness


def device_mix_reason(tensors: dict[str, torch.Tensor]) -> str | None:
    """A reason when the tensors a dequantize / grouped GEMM reads are not all on one device (a CUDA kernel handed a
    foreign pointer is an illegal memory access, which no fallback survives). Smallest groups are named first."""
    by_device: dict[str, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(str(t.device), []).append(name)
    if len(by_device) < 2:
        return None
    groups = sorted(by_device.items(), key=lambda kv: len(kv[1]))
    where = "; ".join(
        f"{', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''} on {device}"
        for device, names in groups
    )
    return (
        f"4-bit expert tensors are on different devices ({where}): move the whole model with .to() / .cuda() "
        "(leantrain.quantize_experts_4bit stacks move their quantization state with it)"
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


def _lists_reason(module: nn.Module, wrapped: set[int]) -> str | None:
    import bitsandbytes as bnb

    from ._adapters import base, lists_reason

    ups, downs = list(module.gate_up_projs), list(module.down_projs)
    if not ups or len(ups) != len(downs):
        return f"gate_up_projs ({len(ups)}) and down_projs ({len(downs)}) differ in length"
    reason = lists_reason(ups, downs)  # PEFT LoRA on the experts: served when every expert carries it alike
    if reason:
        return reason
    ups, downs = [base(m) for m in ups], [base(m) for m in downs]
    for layer in ups + downs:
        if type(layer) is not bnb.nn.Linear4bit:
            return f"an expert is a {type(layer).__name__}, not a plain bitsandbytes Linear4bit"
        weight = layer.weight
        if not isinstance(weight, bnb.nn.Params4bit) or getattr(weight, "quant_state", None) is None:
            return "an expert weight is not quantized yet (no quant_state): move the model to its device first"
        if weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad):
            return "expert weights or biases require grad: the grouped path computes no expert gradients"
        if getattr(weight.quant_state, "packing_format_for_cpu", False):
            return "an expert weight was repacked by bitsandbytes for CPU inference (eval without grad on CPU)"
    tensors = {}
    for lists, layers in (("gate_up_projs", ups), ("down_projs", downs)):
        for e, layer in enumerate(layers):
            tensors.update(_linear4bit_tensors(f"{lists}.{e}", layer))
    reason = device_mix_reason(tensors)
    if reason:
        return reason
    for layers in (ups, downs):
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
        reason = _format_reason(states, tuple(int(s) for s in first.shape))
        if reason:
            return reason
    up_rows, hidden = (int(s) for s in ups[0].weight.quant_state.shape)
    down_rows, inter = (int(s) for s in downs[0].weight.quant_state.shape)
    if down_rows != hidden or up_rows != 2 * inter:
        return f"gate_up ({up_rows}x{hidden}) and down ({down_rows}x{inter}) shapes do not form a gated MLP"
    if not (hasattr(module, "alpha") and hasattr(module, "limit")) and not callable(getattr(module, "act_fn", None)):
        return "unknown expert activation (neither gpt-oss alpha/limit nor act_fn)"
    return None


def _stacked_reason(module: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    from ._adapters import stacked_reason

    reason = stacked_reason(module, wrapped)  # PEFT target_parameters LoRA on the stacks: served
    if reason:
        return reason
    plists = [_bnb_parametrization(module, n) for n in STACK_NAMES]
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


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """Host-side identity of a tensor's storage: object, pointer, device, dtype, grad flag (attribute reads only:
    no device sync). No in-place version: DDP's start-up broadcast rewrites frozen parameters in place."""
    return None if t is None else (id(t), t.data_ptr(), t.device, t.dtype, t.requires_grad)


def _state_key(qs) -> tuple | None:
    """A quantization state's identity, with the in-place versions of its tensors (not parameters, so no framework
    rewrites them; an in-place ``load_state_dict`` does, and a plan may hold padded copies of them)."""
    if qs is None:
        return None
    tensors = state_tensors(qs).values()
    versions = tuple(-1 if t.is_inference() else t._version for t in tensors)  # inference tensors have no counter
    return (id(qs), qs.dtype, getattr(qs, "packing_format_for_cpu", False), versions) + tuple(
        tensor_key(t) for t in tensors
    )


def _signature(found: Found, wrapped: set[int]) -> tuple:
    """Cheap identity of what the readiness check looked at (modules, tensors with their devices, states, grads)."""
    module = found.module
    if found.layout == "stacked":
        parts = [id(module) in wrapped, getattr(module, "_is_expert_parallel", False)]
        for name in STACK_NAMES:
            plist = _bnb_parametrization(module, name)
            parts.append(
                None if plist is None else (tensor_key(plist.original), id(plist[0]), _state_key(plist[0].quant_state))
            )
        parts += [tensor_key(module._parameters.get(name)) for name in BIAS_NAMES]
        return tuple(parts)
    parts = []
    for layer in list(module.gate_up_projs) + list(module.down_projs):
        weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
        parts.append(
            (
                id(layer),
                id(layer) in wrapped,
                tensor_key(weight) if isinstance(weight, torch.Tensor) else id(weight),
                _state_key(getattr(weight, "quant_state", None)),
                tensor_key(bias) if isinstance(bias, torch.Tensor) else id(bias),
                getattr(layer, "compute_dtype", None),
            )
        )
    return tuple(parts)


def module_reason(found: Found, wrapped: set[int]) -> str | None:
    """Why this module cannot take the grouped path (None: it can); cached per module until its signature changes."""
    sig = _signature(found, wrapped)
    hit = _CACHE.get(found.module)
    if hit is not None and hit[0] == sig:
        return hit[1]
    check = _stacked_reason if found.layout == "stacked" else _lists_reason
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
        plist = _bnb_parametrization(found.module, STACK_NAMES[0])
        return plist.original.device, plist[0].quant_state.dtype
    layer = found.module.gate_up_projs[0]
    return layer.weight.device, layer.compute_dtype or layer.weight.quant_state.dtype


# --------------------------------------------------------------------------------------------------------- plans


Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _plan_device(plan: ExpertsPlan) -> torch.device:
    """The one device of every tensor the plan's kernels read (the probe declined device mixes; this re-asserts it
    before any kernel can see a foreign pointer)."""
    tensors = {}
    for label, proj in (("gate_up", plan.gate_up), ("down", plan.down)):
        tensors.update({f"{label} stack tensor {i}": t for i, t in enumerate(proj.stack.tensors())})
        if proj.bias is not None:
            tensors[f"{label} bias"] = proj.bias
    reason = device_mix_reason(tensors)
    if reason:
        raise RuntimeError(reason)
    return plan.gate_up.stack.data.device


def _make_check(plan: ExpertsPlan, snapshot: Callable[[], tuple], frozen: Callable[[], bool], what: str) -> Check:
    """The per-call guard run before any kernel: the module still holds exactly the tensors the plan was built from
    (same objects, pointers, devices, dtypes, versions) and the inputs are on the plan's device. Host-side
    attribute reads only (no device sync)."""
    device, base = _plan_device(plan), snapshot()

    def check(hidden_states: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> None:
        if snapshot() != base:
            if not frozen():
                raise RuntimeError(f"{what} were unfrozen after patching")
            raise RuntimeError(f"{what} were moved, cast, reloaded or replaced after patching")
        if hidden_states.device != device or indices.device != device or weights.device != device:
            raise RuntimeError(
                f"experts inputs on {hidden_states.device} / {indices.device} / {weights.device}, experts on {device}"
            )

    return check


def build_plan(found: Found, undo: Undo, recompute: bool) -> tuple[ExpertsPlan, Check]:
    """The plan for one ready module plus a cheap per-call check that the module was not changed under it and that
    the inputs are on its device: a moved model takes the stock path (run-time fallback), never a kernel with
    mixed devices."""
    module = found.module
    if found.layout == "stacked":
        return _stacked_plan(module, recompute)
    from ._adapters import base

    ups, downs = [base(m) for m in module.gate_up_projs], [base(m) for m in module.down_projs]
    stacks = [consolidate_linear4bit(layers, undo) for layers in (ups, downs)]
    _clone_shared_on_save(module, stacks, undo)

    def projection(layers: list, stack) -> Projection:
        bias = None if layers[0].bias is None else torch.stack([layer.bias.detach() for layer in layers])
        return Projection(stack, False, bias, layers[0].compute_dtype, restore_dtype=True, cast_bias=True)

    if hasattr(module, "alpha") and hasattr(module, "limit"):
        gate = clamp_swiglu(float(module.alpha), float(module.limit))
    else:
        gate = gated_act(module.act_fn)
    plan = ExpertsPlan(
        len(ups), ups[0].in_features, projection(ups, stacks[0]), projection(downs, stacks[1]), gate, True, recompute
    )
    sampled = [module.gate_up_projs, module.down_projs]  # the first and last expert of each list (a module move
    # moves them all; watching every expert would cost O(E) attribute reads per call)

    def snapshot() -> tuple:
        parts = []
        for layers in sampled:
            for layer in (layers[0], layers[-1]):
                parts.append(id(layer))  # a PEFT wrapper added or removed after patching
                layer = base(layer)
                weight = layer.weight
                parts += [id(layer), tensor_key(weight), _state_key(weight.quant_state), layer.compute_dtype]
                parts.append(tensor_key(layer.bias))
        return tuple(parts)

    def frozen() -> bool:
        return not any(base(layer).weight.requires_grad for layers in sampled for layer in (layers[0], layers[-1]))

    return plan, _make_check(plan, snapshot, frozen, "expert weights")


def _clone_shared_on_save(module: nn.Module, stacks: list, undo: Undo) -> None:
    """Consolidated experts share storage, which safetensors and ``save_pretrained`` refuse: hand out private
    copies of those tensors in this module's state dict (loading still copies into the shared buffers)."""
    buffers = [t for s in stacks for t in (s.data, s.absmax) if t is not None]
    buffers += [t for s in stacks if s.nested is not None for t in (s.nested.codes, s.nested.absmax2)]
    shared = {t.untyped_storage().data_ptr() for t in buffers}

    def hook(mod: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for key, value in list(state_dict.items()):
            if key.startswith(prefix) and isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() in shared:
                    state_dict[key] = value.detach().clone()

    undo.push(module.register_state_dict_post_hook(hook).remove)


def _is_stock_gpt_oss_gate(module: nn.Module) -> bool:
    """transformers' own gpt-oss ``_apply_gate`` (clamp-SwiGLU on interleaved columns), not a subclass override."""
    method = getattr(type(module), "_apply_gate", None)
    return (
        getattr(method, "__qualname__", "") == "GptOssExperts._apply_gate"
        and getattr(method, "__module__", "") == "transformers.models.gpt_oss.modeling_gpt_oss"
        and hasattr(module, "alpha")
        and hasattr(module, "limit")
    )


def _stacked_plan(module: nn.Module, recompute: bool) -> tuple[ExpertsPlan, Callable[[], None]]:
    plists = [_bnb_parametrization(module, n) for n in STACK_NAMES]
    states = [p[0].quant_state for p in plists]
    in_major = bool(getattr(module, "is_transposed", False))
    has_bias = bool(getattr(module, "has_bias", False))
    projections = []
    for plist, qs, bias_name in zip(plists, states, BIAS_NAMES):
        bias = module._parameters.get(bias_name) if has_bias else None
        stack = stack_from_quant_state(plist.original, qs)
        projections.append(Projection(stack, in_major, bias, qs.dtype, restore_dtype=False, cast_bias=False))
    gate = module._apply_gate if callable(getattr(module, "_apply_gate", None)) else gated_act(module.act_fn)
    if _is_stock_gpt_oss_gate(module):  # the same math; its backward joins gate/up grads in one kernel
        gate = clamp_swiglu(float(module.alpha), float(module.limit))
    experts, a, b = (int(s) for s in states[0].shape)
    plan = ExpertsPlan(experts, a if in_major else b, projections[0], projections[1], gate, False, recompute)

    def snapshot() -> tuple:
        parts: list = [id(module.parametrizations)]
        for name in STACK_NAMES:
            plist = module.parametrizations[name]
            parts += [id(plist), id(plist[0]), tensor_key(plist.original), _state_key(plist[0].quant_state)]
        return tuple(parts) + tuple(tensor_key(module._parameters.get(name)) for name in BIAS_NAMES)

    def frozen() -> bool:
        return not any(module.parametrizations[name].original.requires_grad for name in STACK_NAMES)

    return plan, _make_check(plan, snapshot, frozen, "packed expert stacks")


PlanFor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], ExpertsPlan]


def live_stacked_plan(module: nn.Module, recompute: bool) -> PlanFor:
    """For FSDP2: the plan rebuilt on every call around the module's live packed stacks and biases.

    ``fully_shard`` replaces the packed stacks and biases by shards and swaps the whole tensors in only around the
    layer's forward and backward, so a plan captured at patch time would hold a stale whole copy. The quantization
    states (absmax, code) are plain attributes that FSDP leaves whole on every rank: they are taken once. A forward
    saves its plan for backward, whose recompute reads the same unsharded tensor after FSDP's pre-backward unshard
    has refilled it. Per call: attribute reads and a few small objects, no device sync."""
    template, _ = _stacked_plan(module, recompute)
    states = [module.parametrizations[name][0].quant_state for name in STACK_NAMES]
    projections = (template.gate_up, template.down)

    def live(name: str, qs, proj: Projection, bias_name: str, device: torch.device) -> Projection:
        plist = module.parametrizations[name]
        packed = plist.original
        if plist[0].quant_state is not qs:
            raise RuntimeError(f"the quantization state of {name} was replaced after patching")
        if type(packed) not in (torch.Tensor, nn.Parameter) or packed.dtype != torch.uint8:
            raise RuntimeError(f"{name} is a {type(packed).__name__} of {packed.dtype}, not the whole packed stack")
        if packed.numel() * 2 != proj.stack.numel or packed.device != device or packed.requires_grad:
            raise RuntimeError(
                f"{name}: {packed.numel()} packed bytes on {packed.device} (requires_grad={packed.requires_grad}); "
                f"the plan needs {proj.stack.numel // 2}, frozen, on {device}"
            )
        bias = module._parameters.get(bias_name) if proj.bias is not None else None
        if bias is not None and (bias.device != device or bias.requires_grad):
            raise RuntimeError(f"{bias_name} on {bias.device} (requires_grad={bias.requires_grad}), inputs: {device}")
        return dataclasses.replace(proj, stack=dataclasses.replace(proj.stack, data=packed.reshape(-1)), bias=bias)

    def plan_for(hidden_states: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> ExpertsPlan:
        device = hidden_states.device
        if indices.device != device or weights.device != device:
            raise RuntimeError(f"experts inputs on {device} / {indices.device} / {weights.device}")
        if any(t.device != device for qs in states for t in state_tensors(qs).values()):
            raise RuntimeError(f"the quantization states are not on the inputs' device {device}")
        gate_up, down = (
            live(name, qs, proj, bias_name, device)
            for name, qs, proj, bias_name in zip(STACK_NAMES, states, projections, BIAS_NAMES)
        )
        return dataclasses.replace(template, gate_up=gate_up, down=down)

    return plan_for

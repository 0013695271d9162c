"""What ``apply`` executes: the model plan the probe returns (one :class:`Target` per experts module, with
everything apply needs), and, per module, the plan the grouped path serves: the packed stacks (consolidated from
per-expert ``Linear4bit`` modules, or views of the 3-D stacks), projections, gate, and a cheap per-call check;
under FSDP2 the plan is rebuilt per call around the live unsharded stacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._stacks import Record, consolidate_linear4bit, stack_from_quant_state, state_tensors
from .layouts import BlockRecipe, Found, bnb_parametrization, expert_mlp_names, expert_projections
from .ops import ExpertsPlan, Projection, clamp_swiglu, gated_act
from .quantize import BIAS_NAMES, STACK_NAMES
from .saved import clone_shared_on_save


Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
PlanFor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], ExpertsPlan]


@dataclass
class Target(Found):
    """One ready experts module and everything ``apply`` needs for it: which method of which module is replaced
    (``owner.hook``: the 4.x block's forward or DeepSeek-V2's ``moe``, the experts' forward, or under
    ``target_parameters`` LoRA the outermost ParamWrapper's forward), the block recipe (4.x), where its PEFT adapters
    are (``_adapters.AdapterSpec``), and recompute or saved stacks with the reason for the report."""

    owner: nn.Module = None  # type: ignore[assignment]
    hook: str = "forward"
    recipe: BlockRecipe | None = None
    adapters: Any = None  # _adapters.AdapterSpec | None
    recompute: bool = True
    recompute_why: str = ""


@dataclass
class ModelPlan:
    """What the probe hands to ``apply``: the targets, whether FSDP2 swaps their stacks per call, the report's
    detail."""

    targets: list[Target]
    detail: str
    fsdp2: bool = False


# ------------------------------------------------------------------------------ host-side identity and devices


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """Host-side identity of a tensor's storage: object, pointer, device, dtype, grad flag (attribute reads only:
    no device sync). No in-place version: DDP's start-up broadcast rewrites frozen parameters in place."""
    return None if t is None else (id(t), t.data_ptr(), t.device, t.dtype, t.requires_grad)


def state_key(qs) -> tuple | None:
    """A quantization state's identity, with the in-place versions of its tensors (not parameters, so no framework
    rewrites them; an in-place ``load_state_dict`` does, and a plan may hold padded copies of them)."""
    if qs is None:
        return None
    tensors = state_tensors(qs).values()
    versions = tuple(-1 if t.is_inference() else t._version for t in tensors)  # inference tensors have no counter
    return (id(qs), qs.dtype, getattr(qs, "packing_format_for_cpu", False), versions) + tuple(
        tensor_key(t) for t in tensors
    )


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


# ------------------------------------------------------------------------------------------ per-module plans


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


def build_plan(found: Found, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
    """The plan for one ready module plus a cheap per-call check that the module was not changed under it and that
    the inputs are on its device: a moved model takes the stock path (run-time fallback), never a kernel with
    mixed devices."""
    module = found.module
    if found.layout == "stacked":
        return _stacked_plan(module, recompute)
    if found.layout == "expert_mlps":
        return expert_mlps_plan(module, record, recompute)
    from ._adapters import base

    ups, downs = [base(m) for m in module.gate_up_projs], [base(m) for m in module.down_projs]  # under any LoRA
    stacks = [consolidate_linear4bit(layers, record) for layers in (ups, downs)]
    _clone_shared_on_save(module, stacks, record)

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
                parts += [id(layer), tensor_key(weight), state_key(weight.quant_state), layer.compute_dtype]
                parts.append(tensor_key(layer.bias))
        return tuple(parts)

    def frozen() -> bool:
        return not any(base(layer).weight.requires_grad for layers in sampled for layer in (layers[0], layers[-1]))

    return plan, _make_check(plan, snapshot, frozen, "expert weights")


def expert_mlps_plan(block: nn.Module, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
    """A transformers 4.x MoE block: each expert's gate and up ``Linear4bit`` consolidated as one ``[E, 2I, H]``
    gate_up stack (expert e's gate rows, then its up rows: ``chunk(2)`` halves), the down projections as
    ``[E, H, I]``; ``F.linear`` orientation, no biases, the experts' ``act_fn``. The per-expert modules keep their
    weights as views of the stacks (state dict and save unchanged)."""
    from ._adapters import base

    gates, ups, downs = ([base(m) for m in group] for group in expert_projections(block))  # under any LoRA
    pairs = [layer for pair in zip(gates, ups) for layer in pair]  # g0, u0, g1, u1, ...: the [E, 2I, H] byte order
    experts, (inter, hidden) = len(gates), (int(s) for s in gates[0].weight.quant_state.shape)
    gate_up = dataclasses.replace(consolidate_linear4bit(pairs, record), shape=(experts, 2 * inter, hidden))
    down = consolidate_linear4bit(downs, record)
    _clone_shared_on_save(block, [gate_up, down], record)
    compute = gates[0].compute_dtype
    projections = [
        Projection(stack, False, None, compute, restore_dtype=True, cast_bias=False) for stack in (gate_up, down)
    ]
    plan = ExpertsPlan(experts, hidden, *projections, gated_act(block.experts[0].act_fn), False, recompute)
    names = expert_mlp_names(block.experts[0])

    def sampled() -> list[nn.Module]:  # read from the block per call: the first and last expert, as above
        experts = block.experts
        return [getattr(experts[i], n) for i in (0, -1) for n in names]

    def snapshot() -> tuple:
        parts = []
        for layer in sampled():
            parts.append(id(layer))  # a PEFT wrapper added or removed after patching
            layer = base(layer)
            weight = layer.weight
            parts += [id(layer), tensor_key(weight), state_key(weight.quant_state), layer.compute_dtype]
        return tuple(parts)

    def frozen() -> bool:
        return not any(base(layer).weight.requires_grad for layer in sampled())

    return plan, _make_check(plan, snapshot, frozen, "expert weights")


def _clone_shared_on_save(module: nn.Module, stacks: list, record: Record) -> None:
    """Consolidated experts share storage: ``saved.clone_shared_on_save`` over every buffer of the stacks."""
    buffers = [t for s in stacks for t in (s.data, s.absmax) if t is not None]
    buffers += [t for s in stacks if s.nested is not None for t in (s.nested.codes, s.nested.absmax2)]
    clone_shared_on_save(module, buffers, record)


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
    plists = [bnb_parametrization(module, n) for n in STACK_NAMES]
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
            parts += [id(plist), id(plist[0]), tensor_key(plist.original), state_key(plist[0].quant_state)]
        return tuple(parts) + tuple(tensor_key(module._parameters.get(name)) for name in BIAS_NAMES)

    def frozen() -> bool:
        return not any(module.parametrizations[name].original.requires_grad for name in STACK_NAMES)

    return plan, _make_check(plan, snapshot, frozen, "packed expert stacks")


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


def fixed(plan: ExpertsPlan, check: Callable) -> PlanFor:
    """A plan built at patch time, served after the per-call check (a moved model takes the stock path)."""

    def plan_for(hidden_states, indices, weights):
        check(hidden_states, indices, weights)
        return plan

    return plan_for


def plan_provider(target: Target, fsdp2: bool, record: Record) -> PlanFor:
    """Per call, the plan for ``target``: built now (consolidating per-expert stacks, each restore step going to
    ``record``) and checked per call, or under FSDP2 rebuilt per call around the unsharded stacks."""
    if fsdp2:
        return live_stacked_plan(target.module, target.recompute)
    return fixed(*build_plan(target, record, target.recompute))

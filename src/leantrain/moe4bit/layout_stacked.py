"""The ``stacked`` layout: stock transformers 5.x experts whose 3-D ``gate_up_proj`` / ``down_proj`` were quantized
by :func:`leantrain.quantize_experts_4bit` (bitsandbytes' 4-bit parametrization). The plan reads the packed stacks
in place (no consolidation); under FSDP2 it is rebuilt per call around the unsharded stacks
(:func:`live_stacked_plan`); PEFT LoRA comes as ``target_parameters`` ParamWrappers around the stacks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _adapters
from ._checks import format_reason
from ._stacks import BIAS_NAMES, STACK_NAMES, Record, stack_from_quant_state, state_tensors
from .layouts import NOT_4BIT_REASON, Layout, Wrapped, bnb_parametrization, is_stacked
from .ops import ExpertsPlan, Projection, clamp_swiglu, gated_act
from .plan import PlanFor, device_mix_reason, make_check, state_key, tensor_key


class StackedLayout(Layout):
    name = "stacked"
    fsdp2 = True

    def matches(self, module: nn.Module) -> bool:
        return is_stacked(module)

    def is_4bit(self, module: nn.Module) -> bool:
        return all(bnb_parametrization(module, n) is not None for n in STACK_NAMES)

    def num_experts(self, module: nn.Module) -> int:
        from torch.nn.utils import parametrize

        name = STACK_NAMES[0]
        if not parametrize.is_parametrized(module, name):
            return int(module._parameters[name].shape[0])
        plist = module.parametrizations[name]
        state = getattr(plist[0], "quant_state", None)  # a packed 4-bit stack: its shape is the quantization state's
        return int(state.shape[0] if state is not None else plist.original.shape[0])

    def lora_reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        return _adapters.stacked_reason(module, wrapped)

    def reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        return stacked_reason(module, wrapped)

    def signature(self, module: nn.Module, wrapped: Wrapped) -> tuple:
        parts = [id(module) in wrapped, getattr(module, "_is_expert_parallel", False)]
        for name in STACK_NAMES:
            plist = bnb_parametrization(module, name)
            parts.append(
                None if plist is None else (tensor_key(plist.original), id(plist[0]), state_key(plist[0].quant_state))
            )
        parts += [tensor_key(module._parameters.get(name)) for name in BIAS_NAMES]
        return tuple(parts)

    def compute_dtype(self, module: nn.Module) -> tuple[torch.device, torch.dtype]:
        plist = bnb_parametrization(module, STACK_NAMES[0])
        return plist.original.device, plist[0].quant_state.dtype

    def stack_elements(self, module: nn.Module) -> int:
        return int(bnb_parametrization(module, STACK_NAMES[0])[0].quant_state.shape.numel())

    def adapters(self, module: nn.Module, wrapped: Wrapped) -> _adapters.AdapterSpec | None:
        chain = tuple(_adapters.param_wrappers(wrapped, module))
        return _adapters.AdapterSpec(chain=chain) if chain else None

    def build_plan(self, module: nn.Module, record: Record, recompute: bool) -> tuple[ExpertsPlan, Callable]:
        return stacked_plan(module, recompute)  # the stacks are read in place: nothing to restore

    def live_plan(self, module: nn.Module, recompute: bool) -> PlanFor:
        return live_stacked_plan(module, recompute)

    def stock(self, forward: Callable) -> Callable:
        """The stock forward under torch's parametrization cache (what bitsandbytes' detached hooks turned on): the
        per-expert loop dequantizes each stack once per call, not once per expert."""
        from torch.nn.utils import parametrize

        def cached(*args: Any, **kwargs: Any) -> Any:
            with parametrize.cached():
                return forward(*args, **kwargs)

        return cached

    def share(self, modules: list[nn.Module], record: Record, fsdp2: bool) -> None:
        for module in modules:
            detach_cache_hooks(module, record)
        if not fsdp2:  # fully_shard gives each module a class of its own again; compiled layers run on one process
            share_classes(modules, record)


LAYOUT = StackedLayout()


# ------------------------------------------------------------------------- one compiled code for every layer
# torch.compile guards on the type of every module it traces and on the hooks of each: per module, both differ here.

BNB_CACHE_HOOKS = ("_enable_parametrization_cache", "_disable_parametrization_cache")


def _is_cache_hook(hook: Any) -> bool:
    return getattr(hook, "__module__", "") == "bitsandbytes.nn.parametrize" and getattr(hook, "__name__", "") in (
        BNB_CACHE_HOOKS
    )


def detach_cache_hooks(module: nn.Module, record: Record) -> None:
    """Detach bitsandbytes' forward pre-hooks and always-called forward hooks that turn torch's parametrization
    cache on around the module's call (one pair per parametrized stack). The grouped path reads the packed stacks,
    never the parametrized ones, and the stock fallback runs under the cache itself (:meth:`StackedLayout.stock`);
    the hooks' ids, which compiled code guards on, differ per module. Each is put back in its place on undo."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            if _is_cache_hook(hook):
                always = module._forward_hooks_always_called.pop(key, None) if hooks is module._forward_hooks else None
                del hooks[key]
                record(functools.partial(_reattach, module, hooks, key, hook, always))


def _reattach(module: nn.Module, hooks: dict, key: int, hook: Callable, always: bool | None) -> None:
    hooks[key] = hook
    for later in [k for k in hooks if k > key]:  # hook ids grow with registration: back in its place
        hooks.move_to_end(later)
    if always is not None:
        module._forward_hooks_always_called[key] = always


def share_classes(modules: list[nn.Module], record: Record) -> None:
    """Give every parametrized module of one class and one set of parametrized stacks one class: torch's
    ``register_parametrization`` makes a class per module (``Parametrized<Class>``, its properties reading the
    instance's own parametrizations), so compiled code would guard on a different type in every layer. The first
    module's class serves them all; each other module's own class comes back on undo, which runs before anything
    that removes a parametrization could delete a property from the shared class."""
    from torch.nn.utils import parametrize

    shared: dict[tuple, type] = {}
    for module in modules:
        if not parametrize.is_parametrized(module):
            continue
        own = type(module)
        first = shared.setdefault((own.__bases__, tuple(sorted(vars(own)))), own)
        if first is not own:
            module.__class__ = first
            record(functools.partial(_restore_class, module, first, own))


def _restore_class(module: nn.Module, shared: type, own: type) -> None:
    if type(module) is shared:  # not replaced since (a wrapper's class): that one stays
        module.__class__ = own


def _stacked_tensors(module: nn.Module, plists: list) -> dict[str, torch.Tensor]:
    found = {}
    for name, plist in zip(STACK_NAMES, plists):
        found[f"{name} packed data"] = plist.original
        found.update({f"{name} {k}": t for k, t in state_tensors(plist[0].quant_state).items()})
    for name in BIAS_NAMES:
        if module._parameters.get(name) is not None:
            found[name] = module._parameters[name]
    return found


def stacked_reason(module: nn.Module, wrapped: Wrapped) -> str | None:
    """Frozen bitsandbytes-parametrized stacks of a stock gated experts module, one format, one device."""
    reason = _adapters.stacked_reason(module, wrapped)
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
        reason = format_reason([qs], (int(qs.shape[1]), int(qs.shape[2])))
        if reason:
            return reason
    (e1, a1, b1), (e2, a2, b2) = ((int(s) for s in qs.shape) for qs in states)
    transposed = bool(getattr(module, "is_transposed", False))
    hidden, two_i = (a1, b1) if transposed else (b1, a1)
    inter, hidden2 = (a2, b2) if transposed else (b2, a2)
    if e1 != e2 or hidden != hidden2 or two_i != 2 * inter:
        return f"gate_up {tuple(states[0].shape)} and down {tuple(states[1].shape)} do not form a gated MLP"
    return None


def _is_stock_gpt_oss_gate(module: nn.Module) -> bool:
    """transformers' own gpt-oss ``_apply_gate`` (clamp-SwiGLU on interleaved columns), not a subclass override."""
    method = getattr(type(module), "_apply_gate", None)
    return (
        getattr(method, "__qualname__", "") == "GptOssExperts._apply_gate"
        and getattr(method, "__module__", "") == "transformers.models.gpt_oss.modeling_gpt_oss"
        and hasattr(module, "alpha")
        and hasattr(module, "limit")
    )


def stacked_plan(module: nn.Module, recompute: bool) -> tuple[ExpertsPlan, Callable[[], None]]:
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

    return plan, make_check(plan, snapshot, frozen, "packed expert stacks")


def live_stacked_plan(module: nn.Module, recompute: bool) -> PlanFor:
    """For FSDP2: the plan rebuilt on every call around the module's live packed stacks and biases.

    ``fully_shard`` replaces the packed stacks and biases by shards and swaps the whole tensors in only around the
    layer's forward and backward, so a plan captured at patch time would hold a stale whole copy. The quantization
    states (absmax, code) are plain attributes that FSDP leaves whole on every rank: they are taken once. A forward
    saves its plan for backward, whose recompute reads the same unsharded tensor after FSDP's pre-backward unshard
    has refilled it. Per call: attribute reads and a few small objects, no device sync."""
    template, _ = stacked_plan(module, recompute)
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

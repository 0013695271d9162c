"""The ``linear4bit`` layout: ``gate_up_projs`` / ``down_projs`` ModuleLists of ``bnb.nn.Linear4bit`` (community
pre-quantized gpt-oss checkpoints; ``F.linear`` orientation, gate/up interleaved, biases, dense ``[T, E]`` routing
weights). The plan consolidates each list into one packed stack; PEFT LoRA comes on every expert projection."""

from __future__ import annotations

import torch
from torch import nn

from . import _adapters
from ._adapters import base
from ._checks import is_linear4bit, layer_device_dtype, layers_reason, layers_signature, stack_reason
from ._stacks import Record, consolidate_linear4bit
from .layouts import Layout, Wrapped, is_lists
from .ops import ExpertsPlan, Projection, clamp_swiglu, gated_act
from .plan import Check, clone_stacks_on_save, make_check, state_key, tensor_key


class Linear4bitLayout(Layout):
    name = "linear4bit"

    def matches(self, module: nn.Module) -> bool:
        return is_lists(module)

    def is_4bit(self, module: nn.Module) -> bool:
        return is_linear4bit(list(module.gate_up_projs) + list(module.down_projs))

    def num_experts(self, module: nn.Module) -> int:
        return len(module.gate_up_projs)

    def lora_reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        return _adapters.per_expert_reason(
            {"gate_up_projs": list(module.gate_up_projs), "down_projs": list(module.down_projs)}
        )

    def reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        return lists_reason(module, wrapped)

    def signature(self, module: nn.Module, wrapped: Wrapped) -> tuple:
        return tuple(layers_signature(list(module.gate_up_projs) + list(module.down_projs), wrapped))

    def compute_dtype(self, module: nn.Module) -> tuple[torch.device, torch.dtype]:
        return layer_device_dtype(module.gate_up_projs[0])

    def stack_elements(self, module: nn.Module) -> int:
        ups = module.gate_up_projs
        return int(len(ups) * base(ups[0]).weight.quant_state.shape.numel())

    def adapters(self, module: nn.Module, wrapped: Wrapped) -> _adapters.AdapterSpec | None:
        gate_up = (_adapters.Piece(tuple(module.gate_up_projs), 0),)
        return _adapters.spec_of(gate_up, list(module.down_projs))

    def build_plan(self, module: nn.Module, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
        return lists_plan(module, record, recompute)


LAYOUT = Linear4bitLayout()


def lists_reason(module: nn.Module, wrapped: Wrapped) -> str | None:
    ups, downs = list(module.gate_up_projs), list(module.down_projs)
    if not ups or len(ups) != len(downs):
        return f"gate_up_projs ({len(ups)}) and down_projs ({len(downs)}) differ in length"
    reason = LAYOUT.lora_reason(module, wrapped)  # served LoRA: checked here
    if reason:
        return reason
    ups, downs = ([base(m) for m in group] for group in (ups, downs))  # the Linear4bit under any LoRA
    reason = layers_reason({"gate_up_projs": ups, "down_projs": downs}, None)
    if reason:
        return reason
    for layers in (ups, downs):
        reason = stack_reason(layers)
        if reason:
            return reason
    up_rows, hidden = (int(s) for s in ups[0].weight.quant_state.shape)
    down_rows, inter = (int(s) for s in downs[0].weight.quant_state.shape)
    if down_rows != hidden or up_rows != 2 * inter:
        return f"gate_up ({up_rows}x{hidden}) and down ({down_rows}x{inter}) shapes do not form a gated MLP"
    if not (hasattr(module, "alpha") and hasattr(module, "limit")) and not callable(getattr(module, "act_fn", None)):
        return "unknown expert activation (neither gpt-oss alpha/limit nor act_fn)"
    return None


def lists_plan(module: nn.Module, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
    """Each list's ``Linear4bit`` layers consolidated into one packed stack (the layers keep views of it), biases
    stacked, gpt-oss clamp-SwiGLU or the module's ``act_fn``; the check samples the first and last expert."""
    ups, downs = [base(m) for m in module.gate_up_projs], [base(m) for m in module.down_projs]  # under any LoRA
    stacks = [consolidate_linear4bit(layers, record) for layers in (ups, downs)]
    clone_stacks_on_save(module, stacks, record)

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

    return plan, make_check(plan, snapshot, frozen, "expert weights")

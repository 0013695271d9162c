"""The ``expert_mlps`` layout: transformers 4.x sparse MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2):
an ``experts`` ModuleList of gated MLPs next to the block's ``gate`` router, each projection a ``bnb.nn.Linear4bit``
(``BitsAndBytesConfig(load_in_4bit=True)``). The found module is the block: its stock forward (or DeepSeek-V2's
``moe``) is replaced by one reproducing its routing (``BlockRecipe``); the plan consolidates gate and up into one
``[E, 2I, H]`` stack and down into ``[E, H, I]``; PEFT LoRA comes on every expert projection."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import _adapters
from ._adapters import base
from ._checks import is_linear4bit, layer_device_dtype, layers_reason, layers_signature, lora_reason, stack_reason
from ._stacks import Record, consolidate_linear4bit
from .layouts import (
    BlockRecipe,
    Layout,
    Wrapped,
    block_recipe,
    expert_mlp_names,
    expert_projections,
    is_expert_mlps,
    is_stock_expert_mlp,
    replaced,
)
from .ops import ExpertsPlan, Projection, gated_act
from .plan import Check, clone_stacks_on_save, make_check, state_key, tensor_key


NOT_4BIT_MLPS_REASON = (
    "MoE expert MLPs are not 4-bit: load the model with quantization_config=BitsAndBytesConfig(load_in_4bit=True)"
)


class ExpertMlpsLayout(Layout):
    name = "expert_mlps"
    not_4bit_reason = NOT_4BIT_MLPS_REASON
    transformers4 = True

    def matches(self, module: nn.Module) -> bool:
        return hasattr(module, "gate") and is_expert_mlps(module)

    def is_4bit(self, module: nn.Module) -> bool:
        return is_linear4bit([m for group in expert_projections(module) for m in group])

    def num_experts(self, module: nn.Module) -> int:
        return len(module.experts)

    def lora_reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        names = expert_mlp_names(module.experts[0])
        return _adapters.per_expert_reason(dict(zip(names, expert_projections(module))))

    def reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        return expert_mlps_reason(module, wrapped)

    def signature(self, module: nn.Module, wrapped: Wrapped) -> tuple:
        parts = [
            *(getattr(module, n, None) for n in ("top_k", "norm_topk_prob", "jitter_noise", "ep_rank")),
            id(getattr(module, "gate", None)),
            type(module),
            tuple(replaced(module, k) for k in ("forward", "moe")),
            tuple(id(m) in wrapped or replaced(m, "forward") for m in (module, *module.experts)),
        ]
        return tuple(parts + layers_signature([m for group in expert_projections(module) for m in group], wrapped))

    def compute_dtype(self, module: nn.Module) -> tuple[torch.device, torch.dtype]:
        return layer_device_dtype(expert_projections(module)[0][0])

    def stack_elements(self, module: nn.Module) -> int:
        gates = expert_projections(module)[0]
        return int(2 * len(gates) * base(gates[0]).weight.quant_state.shape.numel())

    def recipe(self, module: nn.Module) -> BlockRecipe | None:
        return block_recipe(module)

    def adapters(self, module: nn.Module, wrapped: Wrapped) -> _adapters.AdapterSpec | None:
        gates, ups, downs = expert_projections(module)
        inter = int(base(gates[0]).weight.quant_state.shape[0])
        gate_up = (_adapters.Piece(tuple(gates), 0), _adapters.Piece(tuple(ups), inter))  # the [E, 2I, H] halves
        return _adapters.spec_of(gate_up, downs)

    def build_plan(self, module: nn.Module, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
        return expert_mlps_plan(module, record, recompute)


LAYOUT = ExpertMlpsLayout()


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


def expert_mlps_reason(block: nn.Module, wrapped: Wrapped) -> str | None:
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
    reason = LAYOUT.lora_reason(block, wrapped)  # served LoRA: checked here
    if reason:
        return reason
    gates, ups, downs = ([_adapters.base(m) for m in group] for group in expert_projections(block))  # under any LoRA
    reason = layers_reason({"gate": gates, "up": ups, "down": downs}, None)
    if reason:
        return reason
    if any(layer.bias is not None for layer in gates + ups + downs):
        return "expert projections have biases (stock 4.x MoE experts have none; config mlp_bias=True)"
    reason = stack_reason(gates + ups) or stack_reason(downs)  # gate and up rows form one gate_up stack
    if reason:
        return reason
    inter, hidden = (int(s) for s in gates[0].weight.quant_state.shape)
    if tuple(int(s) for s in downs[0].weight.quant_state.shape) != (hidden, inter):
        return (
            f"gate/up ({inter}x{hidden}) and down {tuple(downs[0].weight.quant_state.shape)} do not form a gated MLP"
        )
    return None


def expert_mlps_plan(block: nn.Module, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
    """A transformers 4.x MoE block: each expert's gate and up ``Linear4bit`` consolidated as one ``[E, 2I, H]``
    gate_up stack (expert e's gate rows, then its up rows: ``chunk(2)`` halves), the down projections as
    ``[E, H, I]``; ``F.linear`` orientation, no biases, the experts' ``act_fn``. The per-expert modules keep their
    weights as views of the stacks (state dict and save unchanged)."""
    gates, ups, downs = ([base(m) for m in group] for group in expert_projections(block))  # under any LoRA
    pairs = [layer for pair in zip(gates, ups) for layer in pair]  # g0, u0, g1, u1, ...: the [E, 2I, H] byte order
    experts, (inter, hidden) = len(gates), (int(s) for s in gates[0].weight.quant_state.shape)
    gate_up = dataclasses.replace(consolidate_linear4bit(pairs, record), shape=(experts, 2 * inter, hidden))
    down = consolidate_linear4bit(downs, record)
    clone_stacks_on_save(block, [gate_up, down], record)
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

    return plan, make_check(plan, snapshot, frozen, "expert weights")

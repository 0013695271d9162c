"""Trainer glue: :func:`install` patches one target of the model plan (its per-call plan, its adapters, the
replaced method), and the forwards it installs: they read the routing from the stock call, take the plan (checked
per call: raising sends the call to the stock forward through the run-time fallback) and run the grouped path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..fallback import EAGER_CHECK_ATTR, TRACEABLE_ATTR
from . import _adapters
from .ops import ExpertsPlan
from .plan import Check, Target
from .registry import LAYOUTS, layout_of, plan_provider


ROUTING_INDEX_NAMES = ("router_indices", "top_k_index", "topk_ids")
ROUTING_WEIGHT_NAMES = ("routing_weights", "top_k_weights", "topk_weight")

PlanFor = Callable[[Any, Any, Any], ExpertsPlan]


def routing_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(expert ids, routing weights) from an experts forward call, positional or by any stock keyword."""
    rest = list(args)
    indices = rest.pop(0) if rest else next((kwargs[n] for n in ROUTING_INDEX_NAMES if n in kwargs), None)
    weights = rest.pop(0) if rest else next((kwargs[n] for n in ROUTING_WEIGHT_NAMES if n in kwargs), None)
    if indices is None or weights is None:
        raise TypeError("experts forward called without expert indices and routing weights")
    return indices, weights


def experts_forward(plan_for: PlanFor, fallback: Any, as_stock: Callable = lambda forward: forward) -> Callable:
    """``Undo.wrap_method`` factory: the experts module's forward through the grouped path, stock on failure
    (``as_stock``: the stock forward as the layout runs it while patched). Marked traceable: a compiled decoder
    layer traces it (the grouped path's custom ops) instead of taking it back to the stock loop."""

    def make(original):
        from .ops import grouped_forward  # looked up at patch time (tests spy on it)

        stock = as_stock(original)

        def fast(hidden_states, *args, **kwargs):
            indices, weights = routing_args(args, kwargs)
            plan = plan_for(hidden_states, indices, weights)  # before any kernel: raises into the fallback
            return grouped_forward(plan, hidden_states, indices, weights)

        def forward(hidden_states, *args, **kwargs):
            return fallback.call_at(fast, fast, stock, hidden_states, *args, **kwargs)  # fast: one per module

        setattr(forward, TRACEABLE_ATTR, True)
        return forward

    return make


def eager_check(check: Check, fallback: Any) -> Callable[[], None]:
    """The plan's module check without inputs, through the run-time fallback: what a compiled layer runs eagerly
    before its compiled code (``fallback.EAGER_CHECK_ATTR``), where the traced forward skips the check. A failed
    check warns once, marks moe4bit failed and the experts take the stock path (strict mode raises)."""

    def run() -> None:
        fallback.call(check.unchanged, _nothing)

    return run


def _nothing() -> None:
    return None


def route_top_k(router_logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype):
    """The 4.x sparse MoE blocks' routing, op for op: softmax over all experts in fp32, top-k, optional renormalize
    (in place, as stock), cast to the hidden dtype. Returns ``([T, k] weights, [T, k] expert ids)``."""
    weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(weights, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), selected


def block_forward(block: Any, plan_for: PlanFor, normalize: str, shared: bool, fallback: Any) -> Callable:
    """``Undo.wrap_method`` factory for a transformers 4.x sparse MoE block's forward: the stock router module (its
    gradient flows), the stock routing, the grouped experts, the gated shared expert if any; returns
    ``(hidden [B, S, H], router_logits [B*S, E])`` like the stock block (the logits feed the aux loss)."""

    def make(original):
        from .ops import grouped_forward  # looked up at patch time (tests spy on it)

        def fast(hidden_states: torch.Tensor):
            batch, seq, hidden = hidden_states.shape
            x = hidden_states.view(-1, hidden)
            router_logits = block.gate(x)
            norm = True if normalize == "always" else block.norm_topk_prob
            weights, selected = route_top_k(router_logits, block.top_k, norm, x.dtype)
            plan = plan_for(x, selected, weights)  # before any kernel: raises into the fallback
            out = grouped_forward(plan, x, selected, weights)
            if shared:  # the stock order (expert, then its gate): autograd then adds the input grads in its order
                shared_out = block.shared_expert(x)
                out = out + F.sigmoid(block.shared_expert_gate(x)) * shared_out
            return out.reshape(batch, seq, hidden), router_logits

        def forward(hidden_states, *args, **kwargs):
            if args or kwargs:  # the stock blocks take the hidden states only
                return original(hidden_states, *args, **kwargs)
            return fallback.call_at(fast, fast, original, hidden_states)  # fast: one per block

        return forward

    return make


def install(target: Target, fsdp2: bool, undo: Any, fallback: Any) -> _adapters.AdaptersFor | None:
    """Patch one experts module as its target says, every change recorded on ``undo`` (an ``Undo``) as it is made:
    its per-call plan (consolidated stacks, or FSDP2's per-call plan), its adapters' provider (factor stacks), and
    the replaced method, one of three: a transformers 4.x block's forward (router, routing, experts, shared
    expert), DeepSeek-V2's experts step ``moe``, or the experts' forward (called through the outermost
    ParamWrapper under ``target_parameters`` LoRA, whose stock fallback folds the adapters in as PEFT would:
    ``_adapters.stock_forward``). Returns the adapters' provider (None: no adapters)."""
    adapters = _adapters.provider(target.adapters, target.module, undo.push)
    plan_for, check = plan_provider(target, fsdp2, undo.push)
    plan_for = _adapters.with_adapters(plan_for, adapters)
    recipe = target.recipe
    if recipe is not None and recipe.hook == "forward":
        make = block_forward(target.module, plan_for, recipe.normalize, recipe.shared, fallback)
    else:
        as_stock = layout_of(target).stock
        if target.owner is target.module:
            make = experts_forward(plan_for, fallback, as_stock)
        else:  # PEFT's ParamWrapper forward is wrong on 4-bit stacks
            stock = _adapters.stock_forward(target.module, target.adapters.chain, as_stock)
            make = (lambda fast: lambda original: fast(stock))(experts_forward(plan_for, fallback))
    undo.wrap_method(target.owner, target.hook, make)
    if check is not None:
        undo.set_attr(target.module, EAGER_CHECK_ATTR, eager_check(check, fallback))
    return adapters


def share(targets: list[Target], fsdp2: bool, undo: Any) -> None:
    """After every target is installed: each layout makes its served modules look alike to ``torch.compile``
    (``Layout.share``: one compiled code for every decoder layer), every change recorded on ``undo``."""
    for name, layout in LAYOUTS.items():
        modules = [t.module for t in targets if t.layout == name]
        if modules:
            layout.share(modules, undo.push, fsdp2)

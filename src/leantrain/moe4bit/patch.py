"""The forwards installed on patched modules: they read the routing from the stock call, take the plan (checked
per call: raising sends the call to the stock forward through the run-time fallback) and run the grouped path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._grouped import ExpertsPlan


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


def fixed(plan: ExpertsPlan, check: Callable) -> PlanFor:
    """A plan built at patch time, served after the per-call check (a moved model takes the stock path)."""

    def plan_for(hidden_states, indices, weights):
        check(hidden_states, indices, weights)
        return plan

    return plan_for


def experts_forward(plan_for: PlanFor, fallback: Any) -> Callable:
    """``Undo.wrap_method`` factory: the experts module's forward through the grouped path, stock on failure."""

    def make(original):
        from ._grouped import grouped_forward  # looked up at patch time (tests spy on it)

        def fast(hidden_states, *args, **kwargs):
            indices, weights = routing_args(args, kwargs)
            plan = plan_for(hidden_states, indices, weights)  # before any kernel: raises into the fallback
            return grouped_forward(plan, hidden_states, indices, weights)

        def forward(hidden_states, *args, **kwargs):
            return fallback.call(fast, original, hidden_states, *args, **kwargs)

        return forward

    return make


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
        from ._grouped import grouped_forward  # looked up at patch time (tests spy on it)

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
            return fallback.call(fast, original, hidden_states)

        return forward

    return make

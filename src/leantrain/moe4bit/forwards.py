"""The forwards installed on patched modules: they read the routing from the stock call, take the plan (checked
per call: raising sends the call to the stock forward through the run-time fallback) and run the grouped path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._grouped import ExpertsPlan, grouped_forward


ROUTING_INDEX_NAMES = ("router_indices", "top_k_index")
ROUTING_WEIGHT_NAMES = ("routing_weights", "top_k_weights")

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
        def fast(hidden_states, *args, **kwargs):
            indices, weights = routing_args(args, kwargs)
            plan = plan_for(hidden_states, indices, weights)  # before any kernel: raises into the fallback
            return grouped_forward(plan, hidden_states, indices, weights)

        def forward(hidden_states, *args, **kwargs):
            return fallback.call(fast, original, hidden_states, *args, **kwargs)

        return forward

    return make

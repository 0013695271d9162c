"""The forwards ``apply`` binds on the model's module instances (never on a class or a transformers module).

Each is bound with ``MethodType``, so a deep copy of the model rebinds it to the copy's module, and reads the
module's state (weight, epsilon, projections) at call time, so PEFT adapters, ``.to()`` and sharded parameters
are seen as the stock forward sees them. Every kernel call runs through the run-time fallback: the first failure
warns once and the stock forward serves from then on (a norm's or MLP's checkpoint recompute keeps the path its
forward took)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..fallback import RuntimeFallback
from ..undo import Undo
from . import ops
from .families import Family
from .probe import ROPE, LayerKernelsPlan


def install(plan: LayerKernelsPlan, undo: Undo, fallback: RuntimeFallback) -> tuple[str, ...]:
    """Bind the kernels' forwards on the planned modules (each recorded on ``undo``); the qualified names."""
    norm, mlp = norm_forward(plan.spec, fallback), mlp_forward(plan.spec, fallback)
    for _, module in plan.norms:
        undo.set_attr(module, "forward", types.MethodType(norm, module))
    for _, module in plan.mlps:
        undo.set_attr(module, "forward", types.MethodType(mlp, module))
    if plan.attentions:
        attention = rescoped_forward(plan, fallback)
        for _, module in plan.attentions:
            undo.set_attr(module, "forward", types.MethodType(attention, module))
    return tuple(name for group in (plan.norms, plan.mlps, plan.attentions) for name, _ in group)


def norm_forward(spec: Family, fallback: RuntimeFallback) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def fast(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if spec.casting == "llama" and x.dtype != self.weight.dtype:
            # the stock forward returns weight · x in the promoted dtype; Liger's llama casting keeps x's dtype
            return type(self).forward(self, x)
        return ops.rms_norm(x, self.weight, getattr(self, spec.norm_eps), spec.offset, spec.casting)

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return fallback.call_at(self, fast, type(self).forward, self, hidden_states)

    return forward


def mlp_forward(spec: Family, fallback: RuntimeFallback) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def fast(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gated = ops.swiglu if spec.gate == "swiglu" else ops.geglu
        return self.down_proj(gated(self.gate_proj(x), self.up_proj(x)))

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return fallback.call_at(self, fast, type(self).forward, self, x)

    return forward


def rescoped_forward(plan: LayerKernelsPlan, fallback: RuntimeFallback) -> Callable[..., Any]:
    """The attention class's own forward (same code object), with ``apply_rotary_pos_emb`` looked up in a copy of its
    module's globals that names Liger's RoPE: only the instances it is bound to see the kernel."""
    stock_rope = getattr(plan.modeling, ROPE)

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> Any:
        return fallback.call(ops.rope, stock_rope, q, k, cos, sin, unsqueeze_dim)

    stock = getattr(plan.modeling, plan.spec.attention_class).forward
    scope = {**vars(plan.modeling), ROPE: rope}
    forward = types.FunctionType(stock.__code__, scope, stock.__name__, stock.__defaults__, stock.__closure__)
    forward.__kwdefaults__ = stock.__kwdefaults__
    forward.__qualname__, forward.__doc__ = stock.__qualname__, stock.__doc__
    forward.__leantrain_original__ = stock  # type: ignore[attr-defined]
    return forward

"""The grouped forward/backward: routing sorted once on the device, one dequantize per projection stack, two
grouped GEMMs, bias per group, the gate, and a weighted combine in fp32. No host syncs.

Summation orders are chosen to match the per-expert loop bit for bit in fp32: the forward adds each token's
expert outputs in ascending expert order (as the loop's ``index_add_`` does), the backward adds the input-gradient
contributions in descending expert order (the order in which autograd accumulates the loop's per-expert branches).
Both are deterministic on CUDA (gathers and adds, no atomics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._stacks import PackedStack


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[S, K] x [G, K, N] -> [S, N]``, rows split into groups by the int32 cumulative ends ``offs``."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is not None:
        return fn(mat_a, mat_b, offs=offs)
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


@dataclass
class Projection:
    """One expert projection: its packed stack, its storage orientation and bias, and its dtype policy."""

    stack: PackedStack
    in_major: bool  # stored [E, in, out] (``x @ W[e]``, gpt-oss 3-D); else [E, out, in] (``F.linear``)
    bias: torch.Tensor | None  # [E, out]
    compute_dtype: torch.dtype | None  # None: compute in the input's dtype
    restore_dtype: bool  # cast the output back to the input's dtype (bnb Linear4bit does)
    cast_bias: bool  # cast the bias to the compute dtype before adding (bnb Linear4bit does)

    def dtype_for(self, inp: torch.Tensor) -> torch.dtype:
        return self.compute_dtype or inp.dtype

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.stack.dequantize(dtype)

    def forward(self, inp: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
        mat_b = w if self.in_major else w.transpose(1, 2)  # a transposed view, never a copy
        out = grouped_mm(inp.to(w.dtype).contiguous(), mat_b, routing.offs)
        if self.bias is not None:
            bias = self.bias.to(out.dtype) if self.cast_bias else self.bias
            out.add_(bias[routing.eid])
        return out.to(inp.dtype) if self.restore_dtype else out

    def backward(self, grad: torch.Tensor, w: torch.Tensor, routing: Routing, inp_dtype: torch.dtype) -> torch.Tensor:
        mat_b = w.transpose(1, 2) if self.in_major else w
        return grouped_mm(grad.to(w.dtype).contiguous(), mat_b, routing.offs).to(inp_dtype)


@dataclass
class ExpertsPlan:
    """Everything the grouped path needs for one experts module."""

    num_experts: int
    hidden_size: int
    gate_up: Projection
    down: Projection
    gate: Callable[[torch.Tensor], torch.Tensor]  # [S, 2I] -> [S, I]
    dense_weights: bool  # routing weights arrive as [T, E] when their last dim is E
    recompute: bool = True


@dataclass
class Routing:
    """Sorted routing, all on the device: (token, expert) pairs sorted by expert, then top-k slot, then token."""

    pair: torch.Tensor  # [S] index into the flattened [T, k] routing of each sorted pair
    tok: torch.Tensor  # [S] token of each sorted pair
    eid: torch.Tensor  # [S] expert of each sorted pair (ascending)
    offs: torch.Tensor  # [E] int32 cumulative group ends
    by_rank: torch.Tensor  # [T, k] sorted-pair index of each token's r-th smallest expert id


def route(indices: torch.Tensor, num_experts: int) -> Routing:
    """Sort ``[T, k]`` expert ids once; counts by ``scatter_add_`` and offsets by ``cumsum`` (no bincount, no
    ``.tolist()``, no ``nonzero``: no host sync, CUDA-graph friendly).

    Within an expert, rows are ordered by (slot, token) like the stock loop's ``torch.where(mask[e])``: a GEMM
    row's rounding can depend on its position in the block, so the same order keeps fp32 results bit-identical.
    """
    tokens, top_k = indices.shape
    flat = indices.t().reshape(-1).long()  # slot-major: q = slot * T + token
    order = flat.argsort(stable=True)
    eid = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    tok = order % tokens
    pair = tok * top_k + torch.div(order, tokens, rounding_mode="floor")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # Sorted positions grow with the expert id, so sorting a token's positions ranks its experts ascending.
    by_rank = inverse.view(top_k, tokens).t().sort(dim=1).values
    return Routing(pair, tok, eid, offs, by_rank)


def combine(y: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``out[t] = sum_j w_j * y_j`` over token t's pairs, in fp32, ascending expert order."""
    w32 = w.float()
    out = None
    for r in range(routing.by_rank.shape[1]):  # top_k terms (a handful), each a [T, H] gather
        j = routing.by_rank[:, r]
        term = y[j].float() * w32[j, None]
        out = term if out is None else out.add_(term)
    return out


class GroupedExperts4bit(torch.autograd.Function):
    """Forward of the whole expert block; saves the routing, the gate input and the expert outputs, and the
    dequantized stacks only when ``plan.recompute`` is off (else they are dequantized again in backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, plan: ExpertsPlan, routing: Routing) -> torch.Tensor:
        up, down = plan.gate_up, plan.down
        xs = x[routing.tok]
        w1 = up.weight(up.dtype_for(xs))
        h = up.forward(xs, w1, routing)
        keep = [] if plan.recompute else [w1]
        ctx.w_dtypes = [w1.dtype]
        del xs, w1  # with recompute, freed before the next stack is dequantized (peak: one stack)
        a = plan.gate(h)
        w2 = down.weight(down.dtype_for(a))
        y = down.forward(a, w2, routing)
        keep += [] if plan.recompute else [w2]
        ctx.w_dtypes.append(w2.dtype)
        ctx.x_dtype, ctx.a_dtype, ctx.y_dtype = x.dtype, a.dtype, y.dtype
        del a, w2
        out = combine(y, w, routing).to(x.dtype)
        ctx.plan, ctx.routing = plan, routing
        ctx.save_for_backward(h, y if ctx.needs_input_grad[1] else None, w, *keep)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        plan, routing = ctx.plan, ctx.routing
        h, y, w, *kept = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g32, w32 = grad_out.float(), w.float()
        dy = torch.empty(w.shape[0], g32.shape[1], dtype=ctx.y_dtype, device=g32.device) if need_x else None
        dw = torch.empty(w.shape[0], dtype=torch.float32, device=g32.device) if need_w else None
        for r in range(routing.by_rank.shape[1]):  # top_k terms: the combine's backward, [T, H] at a time
            j = routing.by_rank[:, r]
            if need_w:
                dw[j] = (g32 * y[j].float()).sum(-1)
            if need_x:
                dy[j] = (g32 * w32[j, None]).to(dy.dtype)
        dx = None
        if need_x:
            down, up = plan.down, plan.gate_up
            w2 = kept[1] if kept else down.weight(ctx.w_dtypes[1])
            da = down.backward(dy, w2, routing, ctx.a_dtype)
            del dy, w2
            with torch.enable_grad():
                hh = h.detach().requires_grad_()
                (dh,) = torch.autograd.grad(plan.gate(hh), hh, da)
            del da
            w1 = kept[0] if kept else up.weight(ctx.w_dtypes[0])
            dxs = up.backward(dh, w1, routing, ctx.x_dtype)
            del dh, w1
            for r in reversed(range(routing.by_rank.shape[1])):
                term = dxs[routing.by_rank[:, r]].float()
                dx = term if dx is None else dx.add_(term)
            dx = dx.to(ctx.x_dtype)
        return dx, (dw.to(w.dtype) if need_w else None), None, None


def grouped_forward(
    plan: ExpertsPlan, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for an experts module's forward: ``[..., H]`` hidden states, ``[T, k]`` expert ids, routing weights
    ``[T, k]`` (stock) or ``[T, E]`` (dense); returns ``[..., H]`` in the hidden states' dtype."""
    x = hidden_states.reshape(-1, plan.hidden_size)
    indices = router_indices.reshape(x.shape[0], -1)
    routing = route(indices, plan.num_experts)
    weights = routing_weights.reshape(x.shape[0], -1)
    top_k = indices.shape[1]
    if weights.shape[1] == plan.num_experts and (plan.dense_weights or top_k != plan.num_experts):
        w = weights[routing.tok, routing.eid]
    elif weights.shape[1] == top_k:
        w = weights.reshape(-1)[routing.pair]
    else:
        raise ValueError(
            f"routing weights of shape {tuple(routing_weights.shape)} match neither [T, top_k={top_k}] nor "
            f"[T, num_experts={plan.num_experts}]"
        )
    out = GroupedExperts4bit.apply(x, w, plan, routing)
    return out.view(hidden_states.shape)


def clamp_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt-oss gate on interleaved gate/up columns: (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate clamped."""

    def gate(h: torch.Tensor) -> torch.Tensor:
        g = h[..., ::2].clamp(min=None, max=limit)
        u = h[..., 1::2].clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))

    return gate


def gated_act(act: nn.Module | Callable, interleaved: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """SiLU-style gate: act(gate) * up, gate/up as halves (Mixtral, Qwen, OLMoE) or interleaved columns."""

    def gate(h: torch.Tensor) -> torch.Tensor:
        g, u = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
        return act(g) * u

    return gate

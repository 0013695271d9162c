"""The grouped forward/backward: routing sorted once on the device, one dequantize per projection stack, two
grouped GEMMs, bias per group, the gate, and a weighted combine (fp32 accumulation). No host syncs.

The block is three small autograd functions around plain autograd for the gate and the routing weights (the same
op list as transformers' ``grouped_mm`` experts): ``_Dispatch`` (gather tokens), ``_GroupedProjection`` (dequantize,
grouped GEMM, bias; no weight grad; with ``recompute`` the stack is dequantized again in backward, nothing else is
recomputed) and ``_Combine`` (weight, gather, sum over top-k). Their backwards are one gather + one sum where
autograd would scatter into zeros (``index_put_`` with ``accumulate``). PEFT LoRA on the experts adds split LoRA
(``lora``) to each projection's output.

Summation orders match the per-expert loop bit for bit in fp32: the forward adds each token's expert outputs in
ascending expert order (as the loop's ``index_add_`` does), the backward adds the input-gradient contributions in
descending expert order (the order in which autograd accumulates the loop's per-expert branches). transformers'
``grouped_mm`` path sums in top-k slot order instead; the cost is the same (one gather of ``[T*k, H]`` by a
precomputed index, one ``sum`` over k). ``sum`` over a middle dim of size k <= 16 adds sequentially on CPU, which
is what makes the fp32 results bit-identical (checked by the parity tests). Deterministic on CUDA (no atomics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ._custom_ops import grouped_proj4bit, rows_backward, rows_forward
from ._stacks import PackedStack


@dataclass
class Projection:
    """One expert projection: its packed stack, its storage orientation and bias, and its dtype policy."""

    stack: PackedStack
    in_major: bool  # stored [E, in, out] (``x @ W[e]``, gpt-oss 3-D); else [E, out, in] (``F.linear``)
    bias: torch.Tensor | None  # [E, out]
    compute_dtype: torch.dtype | None  # None: compute in the input's dtype
    restore_dtype: bool  # cast the output back to the input's dtype (bnb Linear4bit does)
    cast_bias: bool  # cast the bias to the compute dtype before adding (bnb Linear4bit does)
    _cast_biases: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def dtype_for(self, inp: torch.Tensor) -> torch.dtype:
        return self.compute_dtype or inp.dtype

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.stack.dequantize(dtype)

    def bias_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The stacked bias in ``dtype``, cast once and cached (frozen: the probe refuses trainable biases)."""
        if self.bias is None or not self.cast_bias or self.bias.dtype == dtype:
            return self.bias
        hit = self._cast_biases.get(dtype)
        if hit is None or hit[0] is not self.bias or hit[1] != self.bias._version:
            hit = self._cast_biases[dtype] = (self.bias, self.bias._version, self.bias.to(dtype))
        return hit[2]

    def forward(self, inp: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self._epilogue(rows_forward(inp, w, routing.offs, self.in_major), inp, routing)

    def backward(self, grad: torch.Tensor, w: torch.Tensor, routing: Routing, inp_dtype: torch.dtype) -> torch.Tensor:
        return rows_backward(grad, w, routing.offs, self.in_major, inp_dtype)

    def packed_forward(self, inp: torch.Tensor, routing: Routing) -> torch.Tensor:
        """:meth:`forward` as one ``leantrain::grouped_proj4bit`` op (for code Dynamo traces): the same kernels and
        bits, and its backward dequantizes the stack again, so a compiled forward saves no dequantized stack."""
        stack, dtype = self.stack, self.dtype_for(inp)
        out = grouped_proj4bit(
            inp, stack.data, stack.absmax_fp32(), routing.offs, self.bias_for(dtype), routing.eid, list(stack.shape),
            stack.blocksize, stack.quant_type, self.in_major, dtype,
        )  # fmt: skip
        return out.to(inp.dtype) if self.restore_dtype else out

    def _epilogue(self, out: torch.Tensor, inp: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The forward's tail: the bias per group, then the dtype policy."""
        bias = self.bias_for(out.dtype)
        if bias is not None:
            out.add_(bias.index_select(0, routing.eid))  # grouped_mm takes no bias
        return out.to(inp.dtype) if self.restore_dtype else out


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
    # PEFT LoRA on the experts (``_adapters``): called once per forward for the active adapters' factors, added as
    # split LoRA (``lora.split_lora``) to each projection's output; None: frozen experts without adapters
    adapters: Callable[[], object] | None = None


@dataclass
class Routing:
    """Sorted routing, all on the device: (token, expert) pairs sorted by expert, then top-k slot, then token."""

    order: torch.Tensor  # [S] slot-major index (slot * T + token) of each sorted pair
    tok: torch.Tensor  # [S] token of each sorted pair
    eid: torch.Tensor  # [S] expert of each sorted pair (ascending)
    offs: torch.Tensor  # [E] int32 cumulative group ends
    ascending: torch.Tensor  # [T * k] sorted-pair index of each token's experts, ascending expert id
    descending: torch.Tensor  # [T * k] the same, descending expert id
    tokens: int


def route(indices: torch.Tensor, num_experts: int) -> Routing:
    """Sort ``[T, k]`` expert ids once; group ends by one ``searchsorted`` of the sorted ids (no bincount, no
    ``.tolist()``, no ``nonzero``: no host sync, CUDA-graph friendly).

    Within an expert, rows are ordered by (slot, token) like the stock loop's ``torch.where(mask[e])``: a GEMM
    row's rounding can depend on its position in the block, so the same order keeps fp32 results bit-identical.
    """
    tokens, top_k = indices.shape
    flat = indices.t().reshape(-1).long()  # slot-major: q = slot * T + token
    order = flat.argsort(stable=True)
    eid = flat[order]
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    offs = torch.searchsorted(eid, experts, right=True, out_int32=True)  # pairs with expert <= e
    tok = order % tokens
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    ranked = inverse.view(top_k, tokens).t()  # [T, k]: sorted position of each (token, slot)
    if top_k > 1:  # sorted positions grow with the expert id: sorting a token's positions ranks its experts
        ranked = ranked.sort(dim=1).values
    return Routing(order, tok, eid, offs, ranked.reshape(-1), ranked.flip(1).reshape(-1), tokens)


def _sum_over_k(src: torch.Tensor, index: torch.Tensor, tokens: int) -> torch.Tensor:
    """``out[t] = sum_r src[index[t * k + r]]``: one gather and one ``sum`` over k (fp32 accumulation for bf16/fp16,
    rounded once; sequential in r on CPU for k <= 16, hence the loop's exact order in fp32)."""
    return src.index_select(0, index).view(tokens, -1, src.shape[-1]).sum(1)


class _Dispatch(torch.autograd.Function):
    """``x[tok]``; backward adds each token's pair gradients in descending expert order (the loop's order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ctx.routing = routing
        return x.index_select(0, routing.tok)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_over_k(grad, ctx.routing.descending, ctx.routing.tokens), None


class _GroupedProjection(torch.autograd.Function):
    """Dequantize the stack, grouped GEMM, bias per group. Saves nothing but the stack when ``recompute`` is off;
    with it on, backward dequantizes the stack once more (the only thing recomputed). Experts are frozen."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, proj: Projection, routing: Routing, recompute: bool) -> torch.Tensor:
        w = proj.weight(proj.dtype_for(inp))
        ctx.proj, ctx.routing, ctx.inp_dtype, ctx.w_dtype = proj, routing, inp.dtype, w.dtype
        ctx.save_for_backward(None if recompute else w)
        return proj.forward(inp, w, routing)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (w,) = ctx.saved_tensors
        w = ctx.proj.weight(ctx.w_dtype) if w is None else w
        return ctx.proj.backward(grad, w, ctx.routing, ctx.inp_dtype), None, None, None


def _project(plan: ExpertsPlan, inp: torch.Tensor, proj: Projection, routing: Routing) -> torch.Tensor:
    """One projection of the expert-sorted rows. Eager: ``_GroupedProjection`` (no custom-op dispatch per call).
    While Dynamo traces with ``recompute`` on: the projection op, whose backward dequantizes again (traced,
    ``_GroupedProjection``'s recompute would be undone by the partitioner, which may save the dequantized stack)."""
    if plan.recompute and torch.compiler.is_compiling():
        return proj.packed_forward(inp, routing)
    return _GroupedProjection.apply(inp, proj, routing, plan.recompute)


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j w_j * y_j`` over token t's pairs in ascending expert order (the loop's ``index_add_``
    order); backward gathers each pair's token gradient instead of scattering into zeros."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
        ctx.routing, ctx.y_dtype, ctx.w_dtype = routing, y.dtype, w.dtype
        ctx.save_for_backward(y if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None)
        return _sum_over_k(y * w[:, None], routing.ascending, routing.tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, w = ctx.saved_tensors
        g = grad.index_select(0, ctx.routing.tok)  # every pair's gradient is its token's
        # The same products, casts and reduction as autograd's mul backward (bit-identical to the loop in fp32).
        dy = (g * w[:, None]).to(ctx.y_dtype) if ctx.needs_input_grad[0] else None
        dw = (g * y).to(ctx.w_dtype).sum(-1) if ctx.needs_input_grad[1] else None
        return dy, dw, None


def pair_weights(plan: ExpertsPlan, weights: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """Each sorted pair's routing weight from ``[T, k]`` (stock) or dense ``[T, E]`` weights (differentiable)."""
    if weights.shape[1] == plan.num_experts and (plan.dense_weights or top_k != plan.num_experts):
        return weights[routing.tok, routing.eid]
    if weights.shape[1] == top_k:
        return weights.t().reshape(-1)[routing.order]
    raise ValueError(
        f"routing weights of shape {tuple(weights.shape)} match neither [T, top_k={top_k}] nor "
        f"[T, num_experts={plan.num_experts}]"
    )


def grouped_forward(
    plan: ExpertsPlan, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for an experts module's forward: ``[..., H]`` hidden states, ``[T, k]`` expert ids, routing weights
    ``[T, k]`` (stock) or ``[T, E]`` (dense); returns ``[..., H]`` in the hidden states' dtype."""
    x = hidden_states.reshape(-1, plan.hidden_size)
    indices = router_indices.reshape(x.shape[0], -1)
    routing = route(indices, plan.num_experts)
    w = pair_weights(plan, routing_weights.reshape(x.shape[0], -1), routing, indices.shape[1])
    xs = _Dispatch.apply(x, routing)
    adapters = plan.adapters() if plan.adapters is not None else None
    h = _project(plan, xs, plan.gate_up, routing)
    h = _with_lora(h, xs, adapters and adapters.gate_up, routing, adapters, (x, routing.tok))  # xs re-gathered
    a = plan.gate(h)  # the gate: plain autograd
    y = _with_lora(_project(plan, a, plan.down, routing), a, adapters and adapters.down, routing, adapters)
    out = _Combine.apply(y, w, routing)
    return out.to(x.dtype).view(hidden_states.shape)


def _with_lora(
    base: torch.Tensor, inp: torch.Tensor, factors, routing: Routing, adapters, source=None
) -> torch.Tensor:
    """``base`` plus each active adapter's split LoRA of ``inp`` (``lora.add_lora``: PEFT's order and casts), with
    the same group ends as the base GEMM. ``source = (tokens, index)``: backward re-gathers ``inp`` from the tokens
    instead of keeping the top-k times larger sorted rows."""
    if not factors:
        return base
    from .lora import add_lora

    return add_lora(base, inp, factors, routing.offs, adapters.training, source)


def clamp_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt-oss gate on interleaved gate/up columns: (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate clamped.

    gate/up are taken by ``unbind`` of a ``[..., I, 2]`` view: the same strided views as ``h[..., ::2]`` /
    ``h[..., 1::2]`` (same values), but autograd joins their gradients with one ``stack`` instead of two
    zero-filled ``slice_backward`` buffers and an add."""

    def gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.unflatten(-1, (-1, 2)).unbind(-1)
        g = g.clamp(min=None, max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))

    return gate


def gated_act(act: nn.Module | Callable, interleaved: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """SiLU-style gate: act(gate) * up, gate/up as halves (Mixtral, Qwen, OLMoE) or interleaved columns."""

    def gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.unflatten(-1, (-1, 2)).unbind(-1) if interleaved else h.chunk(2, dim=-1)
        return act(g) * u

    return gate

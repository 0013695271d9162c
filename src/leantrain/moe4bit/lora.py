"""Split LoRA on grouped experts: ``y = s * (x @ A_e^T) @ B_e^T`` per expert as two grouped GEMMs over the
expert-sorted rows, with the same int32 group ends as the frozen base GEMM. The per-expert delta ``B_e @ A_e`` (a
full ``[E, out, in]`` stack) is never formed.

Plain tensors in: ``a`` is ``[E, r, in]`` and ``b`` is ``[E, out, r]`` (PEFT's ``lora_A`` / ``lora_B`` weights per
expert), ``offs`` the cumulative group ends. The backward computes dX, dA and dB with grouped GEMMs too (dA, dB in
grouped_mm's 2-D x 2-D weight-gradient form); experts with no rows get exact zero gradients (some CUDA kernels
leave those groups unwritten, pytorch#172439).

grouped_mm wants 16-byte aligned strides: a rank whose row is not a multiple of 16 bytes (rank 4 in bf16 is 8 B)
is padded with zero rows of A / zero columns of B, which changes no result (the padding contributes exact zeros
and its gradient is dropped by ``F.pad``'s backward).

:func:`add_lora` adds every active adapter's output to a projection's output in PEFT's order, an adapter's column
pieces side by side (a 4.x expert's gate and up adapters fill the two halves of one gate_up stack). :func:`stacked`
hands E per-expert parameters that are slices of one buffer to the GEMMs as that buffer, without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._custom_ops import grouped_mm  # while Dynamo traces, an op with a fake for every dtype


def rank_multiple(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: the rank must be a multiple of it for grouped_mm's stride rule."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def padded_rank(rank: int, dtype: torch.dtype) -> int:
    m = rank_multiple(dtype)
    return -(-rank // m) * m


@dataclass
class LoraFactors:
    """One adapter on one expert projection: per-expert factors and PEFT's scaling and dropout probability.

    ``start`` is the first output column of the projection's stack the adapter adds to: a transformers 4.x expert's
    gate and up projections are two PEFT layers whose outputs are the two halves of one ``[E, 2I, H]`` gate_up stack
    (gate at 0, up at I); every other placement covers the whole output (``start`` 0, ``out`` = the stack's rows)."""

    a: torch.Tensor  # [E, r, in]
    b: torch.Tensor  # [E, out, r]
    scaling: float
    dropout: float = 0.0
    start: int = 0

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


def _empty_groups(offs: torch.Tensor) -> torch.Tensor:
    """[E] bool: groups with no rows (device-side, no sync)."""
    return torch.diff(offs, prepend=offs.new_zeros(1)) == 0


class _SplitLora(torch.autograd.Function):
    """``scaling * grouped_mm(grouped_mm(x, A^T), B^T)`` with a grouped-GEMM backward for x, A and B.

    With ``tokens`` / ``index`` (``x == tokens[index]`` cast to A's dtype) the backward gathers ``x`` again instead
    of keeping it: the expert-sorted rows are top-k times the tokens, which the caller keeps anyway."""

    @staticmethod
    def forward(ctx, x, a, b, offs, scaling, tokens=None, index=None):
        xa = grouped_mm(x, a.transpose(1, 2), offs)  # [S, r]
        y = grouped_mm(xa, b.transpose(1, 2), offs)  # [S, out]
        ctx.save_for_backward(x if tokens is None else None, a, b, offs, xa, tokens, index)
        ctx.scaling = scaling
        return y * scaling

    @staticmethod
    def backward(ctx, gy):
        x, a, b, offs, xa, tokens, index = ctx.saved_tensors
        if x is None:
            x = tokens.index_select(0, index).to(a.dtype)
        g = (gy * ctx.scaling).contiguous()
        empty = _empty_groups(offs).view(-1, 1, 1)
        gxa = grouped_mm(g, b, offs)  # [S, r]: dY_e @ B_e
        db = da = dx = None
        if ctx.needs_input_grad[2]:
            db = grouped_mm(g.t(), xa, offs).masked_fill_(empty, 0)  # [E, out, r]: dY_e^T @ xa_e
        if ctx.needs_input_grad[1]:
            da = grouped_mm(gxa.t(), x, offs).masked_fill_(empty, 0)  # [E, r, in]: gxa_e^T @ x_e
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(gxa, a, offs)  # [S, in]
        return dx, da, db, None, None, None, None


def split_lora(
    x: torch.Tensor,
    lora: LoraFactors,
    offs: torch.Tensor,
    training: bool = True,
    source: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The adapter's output ``[S, out]`` for expert-sorted rows ``x [S, in]`` (group ends ``offs``), in the factors'
    dtype: PEFT's ``lora_B(lora_A(dropout(x))) * scaling`` per expert, as two grouped GEMMs.

    Dropout (when ``training`` and p > 0) masks each row independently, as PEFT's per-expert dropout does; the
    random draws differ from PEFT's (one call over all rows instead of one per expert).

    ``source = (tokens, index)`` with ``x == tokens[index]``: backward re-gathers x rather than keeping it (without
    dropout; the gradient still flows to ``x``)."""
    a, b = lora.a, lora.b
    x = x.to(a.dtype)
    if lora.dropout > 0 and training:
        x = F.dropout(x, lora.dropout, training=True)
        source = None  # the mask is not recomputed: keep the dropped rows
    rank, padded = a.shape[1], padded_rank(a.shape[1], a.dtype)
    if padded != rank:
        a = F.pad(a, (0, 0, 0, padded - rank))  # zero rows of A
        b = F.pad(b, (0, padded - rank))  # zero columns of B
    tokens, index = (None, None) if source is None else (source[0].detach(), source[1])
    return _SplitLora.apply(x.contiguous(), a.contiguous(), b.contiguous(), offs, lora.scaling, tokens, index)


def add_lora(
    base: torch.Tensor,
    x: torch.Tensor,
    adapters: list[tuple[LoraFactors, ...]],
    offs: torch.Tensor,
    training: bool = True,
    source: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``base`` plus every active adapter's output, added one adapter after another in ``base``'s dtype (PEFT's
    order: ``result = result + lora(x)`` per adapter). Each adapter is a tuple of column pieces (see
    :class:`LoraFactors`): pieces side by side, zeros where a projection carries no piece of this adapter."""
    out = base
    rows, width = base.shape
    for pieces in adapters:  # adapters, not experts: usually one
        parts, column = [], 0
        for lora in pieces:
            if lora.start > column:
                parts.append(base.new_zeros(rows, lora.start - column))
            parts.append(split_lora(x, lora, offs, training, source).to(base.dtype))
            column = lora.start + parts[-1].shape[1]
        if column < width:
            parts.append(base.new_zeros(rows, width - column))
        out = out + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return out


class _Stacked(torch.autograd.Function):
    """The ``[E, ...]`` buffer whose slices are the storage of the E given parameters, as one tensor without a copy;
    backward hands each parameter its slice of one contiguous gradient (autograd keeps such a slice as the
    parameter's ``.grad`` without copying it when the parameter has none yet)."""

    @staticmethod
    def forward(ctx, buffer, *params):
        return buffer.detach()

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.contiguous().unbind(0))


def stacked(buffer: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``torch.stack(params)`` for tensors whose storage is ``buffer[e]`` (the caller checks that): the same values
    and gradients, no copy per call."""
    return _Stacked.apply(buffer, *params)

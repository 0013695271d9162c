"""The gated MLP's elementwise steps for ``ops.lora_mlp_backward``, one pass each over a chunk of rows, in fp32
registers (as inductor computes the same expressions: one rounding to the 16-bit dtype per stored result).

- ``silu_mul``: ``h = silu(g) * u`` (the down projection's input, rebuilt for its adapter's gradient).
- ``silu_mul_backward_``: from ``dh`` (the gradient of ``h``), ``du = dh * silu(g)`` and ``dg = dh * u * silu'(g)``
  written over ``dh``.

``g`` and ``u`` are contiguous rows; the results' rows may be strided (``ops`` keeps ``dg`` and ``h``, then ``du``,
side by side in one buffer, so that one GEMM reads both).

The kernels are defined when this module is imported (``TRITON_INTERPRET`` is read then: set it first; the CPU
interpreter runs the tests)."""

from __future__ import annotations

import torch


try:  # optional: without triton, ``ops`` computes the same steps with torch ops
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

BLOCK = 1024


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, n, cols, h_stride, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        strided = (offs // cols) * h_stride + offs % cols
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + strided, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_backward_kernel(dh_ptr, g_ptr, u_ptr, du_ptr, n, cols, stride, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        strided = (offs // cols) * stride + offs % cols
        dh = tl.load(dh_ptr + strided, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        du = dh * (g * sig)
        dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))
        tl.store(du_ptr + strided, du.to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + strided, dg.to(dh_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(columns, row stride) of a 2-D (or 1-D: one row) tensor whose columns are contiguous."""
    if t.dim() == 1:
        return t.shape[0], t.shape[0]
    assert t.dim() == 2 and t.stride(1) == 1, "rows with contiguous columns"
    return t.shape[1], t.stride(0)


def silu_mul(g: torch.Tensor, u: torch.Tensor, h: torch.Tensor) -> None:
    """``h = silu(g) * u`` (``g``, ``u`` contiguous; ``h`` of their shape, rows possibly strided)."""
    cols, stride = _rows(h)
    _silu_mul_kernel[_grid(g.numel())](g, u, h, g.numel(), cols, stride, BLOCK=BLOCK)


def silu_mul_backward_(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, du: torch.Tensor) -> None:
    """The gradient of ``u`` into ``du`` and of ``g`` over ``dh`` of ``silu(g) * u`` (``g``, ``u`` contiguous;
    ``dh`` and ``du`` of their shape, rows of one stride)."""
    cols, stride = _rows(dh)
    assert _rows(du) == (cols, stride), "dh and du rows of one stride"
    _silu_mul_backward_kernel[_grid(g.numel())](dh, g, u, du, g.numel(), cols, stride, BLOCK=BLOCK)

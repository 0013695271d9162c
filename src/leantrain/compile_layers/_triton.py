"""The gated MLP's elementwise steps for ``ops.lora_mlp_backward``, one pass each over a chunk of rows, in fp32
registers (as inductor computes the same expressions: one rounding to the 16-bit dtype per stored result).

- ``silu_mul``: ``h = silu(g) * u`` into a new tensor (the down projection's input, rebuilt for its adapter's
  gradient).
- ``silu_mul_backward_``: from ``dh`` (the gradient of ``h``), ``du = dh * silu(g)`` into a new tensor and
  ``dg = dh * u * silu'(g)`` written over ``dh``: the chunk holds two full-width buffers where an out-of-place pass
  would hold three.

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
    def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_backward_kernel(dh_ptr, g_ptr, u_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        du = dh * (g * sig)
        dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + offs, dg.to(dh_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` (contiguous, same shape and dtype)."""
    h = torch.empty_like(g)
    _silu_mul_kernel[_grid(g.numel())](g, u, h, g.numel(), BLOCK=BLOCK)
    return h


def silu_mul_backward_(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The gradient of ``u`` (returned) and of ``g`` (written over ``dh``) of ``silu(g) * u`` (contiguous)."""
    du = torch.empty_like(dh)
    _silu_mul_backward_kernel[_grid(dh.numel())](dh, g, u, du, dh.numel(), BLOCK=BLOCK)
    return du

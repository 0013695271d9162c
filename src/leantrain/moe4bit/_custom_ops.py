"""The grouped kernels as ``torch.library`` custom ops (namespace ``leantrain``), so that ``torch.compile`` can trace
the grouped path as opaque calls with fake kernels. Defined once at import; they need torch only (bitsandbytes is
imported when a 4-bit stack is first dequantized).

- ``leantrain::grouped_mm``: torch's grouped GEMM with a fake kernel for every dtype (torch's own fake kernel of
  ``_grouped_mm`` accepts bf16 only, although the CPU kernel runs fp32 and fp16 too).
- ``leantrain::grouped_proj4bit`` and its gradient op ``leantrain::grouped_proj4bit_grad``: a whole 4-bit grouped
  projection (dequantize the packed stack, grouped GEMM, bias per row) as one op whose autograd returns the input
  gradient only (frozen experts) and dequantizes the stack again in backward. A compiled forward therefore saves the
  packed bytes and absmax, never a dequantized ``[E, rows, cols]`` stack: the partitioner cannot choose to keep the
  weight it would see inside a traced projection.

Eager code calls the kernels directly (``grouped_mm``, ``rows_forward``, ``rows_backward``); only code Dynamo traces
goes through the ops, whose real kernels run those same functions (the same bits as eager). Every op returns a
contiguous tensor, as its fake kernel says (CUDA's grouped GEMM may pad its output's row stride)."""

from __future__ import annotations

import torch

from ._stacks import dequantize_stack


def grouped_mm_kernel(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM: ``[S, K] x [G, K, N] -> [S, N]`` (rows grouped by the int32 cumulative ends ``offs``),
    or ``[M, S] x [S, N] -> [G, M, N]`` (the weight-gradient form)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is not None:
        return fn(mat_a, mat_b, offs=offs)
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm_kernel`; while Dynamo traces, the ``leantrain::grouped_mm`` op (a fake for every dtype)."""
    if torch.compiler.is_compiling():
        return grouped_mm_op(mat_a, mat_b, offs)
    return grouped_mm_kernel(mat_a, mat_b, offs)


@torch.library.custom_op("leantrain::grouped_mm", mutates_args=())
def grouped_mm_op(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_mm_kernel(mat_a, mat_b, offs).contiguous()


@grouped_mm_op.register_fake
def _grouped_mm_fake(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        return mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    raise ValueError(
        f"leantrain::grouped_mm takes [S, K] x [G, K, N] or [M, S] x [S, N], got {mat_a.dim()}-D x {mat_b.dim()}-D"
    )


def rows_forward(inp: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, in_major: bool) -> torch.Tensor:
    """Expert-sorted rows through their experts' dequantized weights ``w`` (``[E, in, out]`` when ``in_major``, else
    ``[E, out, in]``, used as a transposed view, never a copy), in ``w``'s dtype."""
    mat_b = w if in_major else w.transpose(1, 2)
    return grouped_mm(inp.to(w.dtype).contiguous(), mat_b, offs)


def rows_backward(
    grad: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, in_major: bool, inp_dtype: torch.dtype
) -> torch.Tensor:
    """The input gradient of :func:`rows_forward`, in the input's dtype."""
    mat_b = w.transpose(1, 2) if in_major else w
    return grouped_mm(grad.to(w.dtype).contiguous(), mat_b, offs).to(inp_dtype)


@torch.library.custom_op("leantrain::grouped_proj4bit", mutates_args=())
def grouped_proj4bit(
    x: torch.Tensor,
    data: torch.Tensor,
    absmax: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None,
    eid: torch.Tensor,
    shape: list[int],
    blocksize: int,
    quant_type: str,
    in_major: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Expert-sorted rows ``x [S, in]`` -> ``[S, out]`` in ``dtype``: the packed stack (flat uint8 ``data``, fp32
    ``absmax``, ``shape`` ``[E, rows, cols]``) dequantized, one grouped GEMM, then ``bias[eid]`` added per row."""
    w = dequantize_stack(data, absmax, shape, blocksize, quant_type, dtype)
    out = rows_forward(x, w, offs, in_major)
    if bias is not None:
        out.add_(bias.index_select(0, eid))  # grouped_mm takes no bias
    return out.contiguous()


@grouped_proj4bit.register_fake
def _grouped_proj4bit_fake(x, data, absmax, offs, bias, eid, shape, blocksize, quant_type, in_major, dtype):
    return x.new_empty(x.shape[0], shape[2] if in_major else shape[1], dtype=dtype)


@torch.library.custom_op("leantrain::grouped_proj4bit_grad", mutates_args=())
def grouped_proj4bit_grad(
    grad: torch.Tensor,
    data: torch.Tensor,
    absmax: torch.Tensor,
    offs: torch.Tensor,
    shape: list[int],
    blocksize: int,
    quant_type: str,
    in_major: bool,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The input gradient of :func:`grouped_proj4bit` in ``out_dtype``: the stack dequantized again (recompute)."""
    w = dequantize_stack(data, absmax, shape, blocksize, quant_type, dtype)
    return rows_backward(grad, w, offs, in_major, out_dtype).contiguous()


@grouped_proj4bit_grad.register_fake
def _grouped_proj4bit_grad_fake(grad, data, absmax, offs, shape, blocksize, quant_type, in_major, dtype, out_dtype):
    return grad.new_empty(grad.shape[0], shape[1] if in_major else shape[2], dtype=out_dtype)


def _save_packed(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, data, absmax, offs, _bias, _eid, shape, blocksize, quant_type, in_major, dtype = inputs
    ctx.save_for_backward(data, absmax, offs)  # packed bytes and absmax only: backward dequantizes again
    ctx.stack = (list(shape), blocksize, quant_type, in_major, dtype, x.dtype)


def _input_grad(ctx, grad: torch.Tensor) -> tuple:
    data, absmax, offs = ctx.saved_tensors
    shape, blocksize, quant_type, in_major, dtype, x_dtype = ctx.stack
    dx = None
    if ctx.needs_input_grad[0]:
        dx = grouped_proj4bit_grad(grad, data, absmax, offs, shape, blocksize, quant_type, in_major, dtype, x_dtype)
    return (dx,) + (None,) * 10


grouped_proj4bit.register_autograd(_input_grad, setup_context=_save_packed)

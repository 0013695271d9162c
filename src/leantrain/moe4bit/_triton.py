"""Fused 4-bit grouped GEMM: the packed NF4/FP4 bytes and fp32 absmax are read inside the GEMM and dequantized in
registers, so no bf16 copy of an expert stack is ever written (forward and the input-gradient GEMM; experts are
frozen, so there is no weight gradient).

Layout (bitsandbytes, see ``_stacks``): the logical ``[E, rows, cols]`` stack is packed row-major, element ``2i`` in
the HIGH nibble of byte ``i`` and ``2i + 1`` in the low one; one absmax per ``blocksize`` consecutive elements;
``value = code[nibble] * absmax`` in fp32, then cast to the compute dtype. The dequantize below does exactly that,
so a tile the GEMM multiplies holds bitwise the values ``PackedStack.dequantize`` would have written.

One kernel serves both weight orientations (``TRANSPOSED``): ``B_g = W[g]`` stored ``[E, K, N]`` or ``W[g]^T``
stored ``[E, N, K]``. Either way a weight tile is loaded in its stored orientation, one contiguous run of bytes per
stored row (the stored row length is even: whole bytes), split into nibbles that are decoded by a select tree over
the 16 code values (no per-element memory gather) and interleaved back; the transposed case then transposes the
tile in registers.

Grid, without host syncs: axis 0 is an upper bound on the number of M tiles, ``cdiv(S, BLOCK_M) + E`` (each group
adds at most one partial tile); every program reads the ``[E]`` group ends ``offs``, finds the group its tile index
falls into and exits when it has none. Axis 1 walks N tiles.

The kernels are defined when this module is imported (``TRITON_INTERPRET`` is read then: set it first; the CPU
interpreter runs the tests); ``_grouped`` imports this module only for ``kernel="fused"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ._stacks import PackedStack


try:  # optional: without triton only ``fused_reasons`` is usable (and says why)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANT_TYPES = ("nf4", "fp4")
MAX_EXPERTS = 4096  # the group ends are held as one register vector of next_pow2(E) int32 per program
LOOKUPS = ("gather", "tree")
MAX_BLOCK_M = 256  # the largest BLOCK_M a TileConfig may use (int32 offsets within a tile are checked for it)


@dataclass(frozen=True)
class TileConfig:
    """GEMM tile sizes and launch knobs (tl.dot needs every tile dim >= 16)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    lookup: str = "gather"  # code[nibble] by a register gather ("gather", faster on the H100) or a select tree

    def __post_init__(self) -> None:
        if self.lookup not in LOOKUPS:
            raise ValueError(f"unknown code lookup {self.lookup!r}: expected one of {LOOKUPS}")


# Measured on an H100 (2026-11-23, gpt-oss-20b gate_up stack [32, 2880, 5760], nf4, bf16; benchmarks/results/
# moe4bit_fused_kernel.md): 256x128x64 with the gather lookup was fastest at 4096 tokens (7.4 ms fwd / dX) and within
# 10% of the best at 512 (2.7-3.1 ms); it needs 80 KiB of shared memory (fits sm_80..sm_90, also the ~100 KiB
# GPUs). All of it is 3-16x slower than dequantize + grouped_mm (see ExpertsPlan.kernel): the decode is redone per
# M tile and its ALU work is not overlapped with the MMAs. fp32 (tests; IEEE dot = FMA loop) takes small tiles.
DEFAULT_TILES = {
    torch.bfloat16: TileConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, lookup="gather"),
    torch.float16: TileConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, lookup="gather"),
    torch.float32: TileConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2, lookup="gather"),
}
DEQUANT_BLOCK = 1024
# Explicit (Triton 3.9 warns when left to its default): nothing here may contract, since the dequantize is one
# multiply (code * absmax, as bitsandbytes computes it) and the GEMM's sums are tl.dot's
FP_FUSION = False


# Triton's CPU interpreter (TRITON_INTERPRET=1, development and CI) runs the kernels on CPU tensors. Triton picks
# interpreter or compiler when a kernel is defined (this module's import), so that moment's setting is the one
# that holds for every launch from this process.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_missing() -> str | None:
    if triton is None:
        return "triton not installed: pip install triton (ships with torch's CUDA wheels)"
    return None


def fused_reasons(stack: PackedStack, a: torch.Tensor, offs: torch.Tensor | None = None) -> list[str]:
    """Every reason the fused kernel cannot run ``a`` against ``stack`` (empty: it can), from host-side metadata
    only (no device sync). Checked before any launch: a bad pointer in a CUDA kernel is an illegal memory access
    that poisons the process, so nothing the kernel assumes is left to the kernel."""
    reasons = []
    missing = _triton_missing()
    if missing:
        reasons.append(missing)
    reasons += _device_reasons(stack, a, offs)
    if a.dtype not in FUSED_DTYPES:
        reasons.append(f"the fused 4-bit kernel computes in bf16/fp16/fp32, not {a.dtype}")
    if a.dim() != 2:
        reasons.append(f"activations must be 2-D [rows, features], got shape {tuple(a.shape)}")
    elif MAX_BLOCK_M * abs(a.stride(0)) + a.shape[1] * abs(a.stride(1)) >= 2**31:
        reasons.append(f"activation strides {a.stride()} exceed the kernel's int32 offsets within one tile")
    reasons += _stack_reasons(stack)
    if offs is not None and (offs.dtype != torch.int32 or offs.shape != (stack.shape[0],)):
        reasons.append(f"offs must be int32 [{stack.shape[0]}], got {offs.dtype} {tuple(offs.shape)}")
    return reasons


def _device_reasons(stack: PackedStack, a: torch.Tensor, offs: torch.Tensor | None) -> list[str]:
    tensors = {"activations": a, **{f"stack tensor {i}": t for i, t in enumerate(stack.tensors())}}
    if offs is not None:
        tensors["offs"] = offs
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        return [f"activations, packed stack and offs must be on one device: {where}"]
    device = a.device
    if device.type != "cuda" and not (device.type == "cpu" and INTERPRETED):
        return [f"the fused 4-bit kernel runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {device}"]
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        # Triton launches on the current device: another GPU's pointers would be read from the wrong one
        return [
            f"tensors on {device} but the current CUDA device is cuda:{torch.cuda.current_device()}: "
            f"call under torch.cuda.device({device})"
        ]
    return []


def _stack_reasons(stack: PackedStack) -> list[str]:
    reasons = []
    experts, rows, cols = stack.shape
    if stack.quant_type not in QUANT_TYPES:
        reasons.append(f"unknown 4-bit quant_type {stack.quant_type!r} (the kernel decodes nf4 and fp4)")
    bs = stack.blocksize
    if bs < 2 or bs & (bs - 1):
        reasons.append(f"blocksize {bs} is not a power of two >= 2 (the kernel finds absmax blocks by a shift)")
    if stack.data.dtype != torch.uint8 or stack.data.numel() * 2 != stack.numel:
        reasons.append(
            f"packed data must be {stack.numel // 2} uint8 bytes for shape {stack.shape}, "
            f"got {stack.data.numel()} {stack.data.dtype}"
        )
    if (rows * cols) % 2 or (bs >= 2 and (rows * cols) % bs):  # each expert starts a byte and an absmax block
        reasons.append(f"an expert's {rows}x{cols} elements are not a whole number of bytes and {bs}-element blocks")
    elif cols % 2:  # the kernel loads whole bytes per stored row
        reasons.append(f"an expert's stored rows have {cols} elements, not a whole number of bytes (odd)")
    if stack.nested is None and (stack.absmax is None or stack.absmax.numel() != stack.numel // max(bs, 1)):
        reasons.append(f"absmax must hold one fp32 scale per {bs}-element block")
    if rows * cols >= 2**31 or max(rows, cols) * MAX_BLOCK_M >= 2**31:
        reasons.append(f"an expert's {rows}x{cols} elements exceed the kernel's int32 offsets within one expert")
    if not 1 <= experts <= MAX_EXPERTS:
        reasons.append(f"{experts} experts: the kernel holds the group ends of 1..{MAX_EXPERTS} experts")
    return reasons


# -------------------------------------------------------------------------------------------------- code tables


_CODES: dict[tuple[str, str], torch.Tensor] = {}


def code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16-entry fp32 code table on ``device``, built once per device (building it is a blocking
    host-to-device copy: a sync, so never per call)."""
    key = (quant_type, str(device))
    hit = _CODES.get(key)
    if hit is None:
        import bitsandbytes.functional as bnbf

        hit = _CODES[key] = bnbf.get_4bit_type(quant_type, device=device).to(torch.float32).contiguous()
    return hit


def _absmax_fp32(stack: PackedStack) -> torch.Tensor:
    absmax = stack.absmax_fp32()
    return absmax if absmax.dtype == torch.float32 and absmax.is_contiguous() else absmax.float().contiguous()


# ------------------------------------------------------------------------------------------------------ kernels


if triton is not None:

    @triton.jit
    def cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """``x.to(dtype)``, rounding to nearest even. GPUs do that in hardware; Triton 3.9's CPU interpreter
        truncates fp32 -> bf16, so under it bf16 is rounded in integer arithmetic to the same RTNE result (finite
        inputs): the interpreter tests then check the GPU's numbers."""
        if INTERPRETED:
            if dtype == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                y = x.to(dtype)
        else:
            y = x.to(dtype)
        return y

    @triton.jit
    def dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
        """``acc + a @ b`` in fp32. The interpreter multiplies bf16 tiles as their raw uint16 storage: there, bf16
        operands go in as fp32 (exact: every bf16 is an fp32 and bf16 products are exact in fp32)."""
        if INTERPRETED:
            if a.dtype == tl.bfloat16:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def code_tree(nib, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
        """``code[nib]`` for a tensor of nibbles: a select tree over the 4 bits (15 selects, no memory gather; the
        16 code values are scalars the caller loads once)."""
        b = (nib & 1) != 0
        v0, v1 = tl.where(b, c1, c0), tl.where(b, c3, c2)
        v2, v3 = tl.where(b, c5, c4), tl.where(b, c7, c6)
        v4, v5 = tl.where(b, c9, c8), tl.where(b, c11, c10)
        v6, v7 = tl.where(b, c13, c12), tl.where(b, c15, c14)
        b = (nib & 2) != 0
        w0, w1, w2, w3 = tl.where(b, v1, v0), tl.where(b, v3, v2), tl.where(b, v5, v4), tl.where(b, v7, v6)
        b = (nib & 4) != 0
        x0, x1 = tl.where(b, w1, w0), tl.where(b, w3, w2)
        return tl.where((nib & 8) != 0, x1, x0)

    @triton.jit
    def load_codes(code_ptr, LOOKUP: tl.constexpr):
        """The 16 code values as the decoder wants them: 16 scalars for the select tree, a [16] tensor to gather."""
        if LOOKUP == "gather":
            codes = tl.load(code_ptr + tl.arange(0, 16))
        else:
            codes = (
                tl.load(code_ptr + 0), tl.load(code_ptr + 1), tl.load(code_ptr + 2), tl.load(code_ptr + 3),
                tl.load(code_ptr + 4), tl.load(code_ptr + 5), tl.load(code_ptr + 6), tl.load(code_ptr + 7),
                tl.load(code_ptr + 8), tl.load(code_ptr + 9), tl.load(code_ptr + 10), tl.load(code_ptr + 11),
                tl.load(code_ptr + 12), tl.load(code_ptr + 13), tl.load(code_ptr + 14), tl.load(code_ptr + 15),
            )  # fmt: skip
        return codes

    @triton.jit
    def decode(nib, codes, LOOKUP: tl.constexpr):
        """``code[nib]``: a gather from the [16] table (broadcast along the nibbles' other axis), or the tree."""
        if LOOKUP == "gather":
            if len(nib.shape) == 2:
                value = tl.gather(tl.broadcast_to(codes[:, None], (16, nib.shape[1])), nib, 0)
            else:
                value = tl.gather(codes, nib, 0)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = codes
            value = code_tree(nib, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
        return value

    @triton.jit
    def dequant_bytes(packed_ptr, absmax_ptr, idx, mask, codes, LOG2_BLOCKSIZE: tl.constexpr, LOOKUP: tl.constexpr):
        """fp32 values of the two elements in each byte ``idx`` (counted from ``packed_ptr``'s first byte, which
        starts an absmax block): ``(high nibble, low nibble)`` = elements ``2·idx`` and ``2·idx + 1``, both in
        block ``2·idx >> log2(blocksize)`` (blocks hold an even number of elements), ``value = code * absmax`` in
        fp32 as bitsandbytes computes it. Masked bytes give 0 (absmax 0, codes finite)."""
        byte = tl.load(packed_ptr + idx, mask=mask, other=0).to(tl.int32)
        scale = tl.load(absmax_ptr + ((idx * 2) >> LOG2_BLOCKSIZE), mask=mask, other=0.0)
        return decode(byte >> 4, codes, LOOKUP) * scale, decode(byte & 15, codes, LOOKUP) * scale

    @triton.jit
    def dequant_kernel(
        packed_ptr, absmax_ptr, code_ptr, out_ptr, n_bytes,
        LOG2_BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr, LOOKUP: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        # Test/reference kernel: the GEMM's own per-byte dequantize, written out flat (BLOCK bytes per program)
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < n_bytes
        codes = load_codes(code_ptr, LOOKUP)
        hi, lo = dequant_bytes(packed_ptr, absmax_ptr, idx, mask, codes, LOG2_BLOCKSIZE, LOOKUP)
        out = tl.reshape(tl.join(hi, lo), (2 * BLOCK,))
        pos = tl.reshape(tl.join(2 * idx, 2 * idx + 1), (2 * BLOCK,))
        tl.store(out_ptr + pos, cast(out, out_ptr.dtype.element_ty, INTERPRETED), mask=pos < 2 * n_bytes)

    @triton.jit
    def weight_tile(
        packed_ptr, absmax_ptr, codes, rows, row_ok, byte0, row_bytes,
        ROWS: tl.constexpr, COLS: tl.constexpr, LOG2_BLOCKSIZE: tl.constexpr, LOOKUP: tl.constexpr,
    ):  # fmt: skip
        """fp32 ``[ROWS, COLS]`` tile of one expert in its stored orientation: stored rows ``rows``, stored columns
        ``2·byte0 .. 2·byte0 + COLS`` (the row length is even, so each tile row is whole bytes: one contiguous
        ``COLS / 2``-byte load per row, split into nibbles, interleaved back)."""
        b = byte0 + tl.arange(0, COLS // 2)
        idx = rows[:, None] * row_bytes + b[None, :]
        mask = row_ok[:, None] & (b < row_bytes)[None, :]
        hi, lo = dequant_bytes(packed_ptr, absmax_ptr, idx, mask, codes, LOG2_BLOCKSIZE, LOOKUP)
        return tl.reshape(tl.join(hi, lo), (ROWS, COLS))

    @triton.jit
    def find_tile(offs_ptr, tile, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """(group, first row of the tile, group end) of M tile ``tile``; group >= E when the tile is past the last
        group's tiles. Group g owns cdiv(size_g, BLOCK_M) consecutive tile indices, in expert order."""
        g = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + g, mask=g < E, other=0)
        starts = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g < E), other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # 0 for empty groups and the padding lanes
        before = tl.cumsum(tiles, axis=0) <= tile  # groups whose tiles all come before this one
        # padding lanes end at the total, so they count only when the tile is past every group (then group >= E)
        group = tl.sum(before.to(tl.int32), axis=0)
        first_tile = tl.sum(tl.where(before, tiles, 0), axis=0)
        group_c = tl.where(group < E, group, E - 1)  # a valid address also for tiles that will exit
        row_start = tl.load(offs_ptr + group_c - 1, mask=group_c >= 1, other=0)
        row_end = tl.load(offs_ptr + group_c)
        return group, row_start + (tile - first_tile) * BLOCK_M, row_end

    @triton.jit
    def grouped_kernel(
        a_ptr, packed_ptr, absmax_ptr, code_ptr, offs_ptr, out_ptr,
        N, K, stride_am, stride_ak, stride_om, stride_on, expert_numel,
        E: tl.constexpr, E_POW2: tl.constexpr, LOG2_BLOCKSIZE: tl.constexpr, TRANSPOSED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
        LOOKUP: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        group, row0, row_end = find_tile(offs_ptr, tl.program_id(0), E, E_POW2, BLOCK_M)
        if group >= E:  # the grid is an upper bound: this tile index belongs to no group
            return
        # int64 only in the scalar base pointers (stacks pass 2**31 elements, activations may too); offsets inside
        # one expert / one tile stay int32 (rows * cols < 2**31 is checked): fewer registers per tile element.
        # The expert's first element is a multiple of the blocksize and even (checked): whole bytes, whole blocks.
        base = group.to(tl.int64) * expert_numel
        packed_ptr += base >> 1
        absmax_ptr += base >> LOG2_BLOCKSIZE
        a_ptr += row0.to(tl.int64) * stride_am
        out_ptr += row0.to(tl.int64) * stride_om
        codes = load_codes(code_ptr, LOOKUP)
        rows = tl.arange(0, BLOCK_M)
        n0 = tl.program_id(1) * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < row_end - row0, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if TRANSPOSED:  # B_g = W[g]^T, W[g] stored [N, K]: load [BLOCK_N, BLOCK_K] rows of K, then transpose
                w = tl.trans(weight_tile(packed_ptr, absmax_ptr, codes, cols, col_ok, k0 // 2, K // 2,
                                         BLOCK_N, BLOCK_K, LOG2_BLOCKSIZE, LOOKUP))  # fmt: skip
            else:  # B_g = W[g] stored [K, N]
                w = weight_tile(packed_ptr, absmax_ptr, codes, ks, k_ok, n0 // 2, N // 2,
                                BLOCK_K, BLOCK_N, LOG2_BLOCKSIZE, LOOKUP)  # fmt: skip
            # Rounded to the activation dtype exactly as the dequantize-then-GEMM path rounds its stack
            acc = dot(a, cast(w, a.dtype, INTERPRETED), acc, PRECISION, INTERPRETED)
        out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out, cast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


def _log2(blocksize: int) -> int:
    return blocksize.bit_length() - 1


def _raise_unless_ready(stack: PackedStack, a: torch.Tensor, offs: torch.Tensor | None) -> None:
    reasons = fused_reasons(stack, a, offs)
    if reasons:
        raise ValueError("fused 4-bit kernel cannot run: " + "; ".join(reasons))


def dequantize_4bit(stack: PackedStack, dtype: torch.dtype, lookup: str = "gather") -> torch.Tensor:
    """The whole stack in ``dtype`` through the GEMM's own dequantize helper (tests prove it bitwise equal to
    bitsandbytes' ``dequantize_4bit``; the GEMM path never calls this)."""
    _raise_unless_ready(stack, torch.empty(0, 0, dtype=dtype, device=stack.data.device), None)
    out = torch.empty(stack.shape, dtype=dtype, device=stack.data.device)
    grid = (triton.cdiv(stack.numel // 2, DEQUANT_BLOCK),)
    code = code_table(stack.quant_type, out.device)
    dequant_kernel[grid](
        stack.data, _absmax_fp32(stack), code, out, stack.numel // 2, LOG2_BLOCKSIZE=_log2(stack.blocksize),
        BLOCK=DEQUANT_BLOCK, LOOKUP=lookup, INTERPRETED=INTERPRETED, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out


def operand_shape(stack: PackedStack, transpose_w: bool) -> tuple[int, int]:
    """(K, N) of ``B_g``: ``W[g]`` (stored [E, K, N]) or ``W[g]^T`` (stored [E, N, K])."""
    _, rows, cols = stack.shape
    return (cols, rows) if transpose_w else (rows, cols)


def grouped_mm_4bit(
    a: torch.Tensor,
    stack: PackedStack,
    offs: torch.Tensor,
    transpose_w: bool,
    out_dtype: torch.dtype | None = None,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ B_g`` for every group g (rows split by the int32 cumulative ends
    ``offs``; rows past ``offs[-1]`` are left unwritten, as in grouped_mm). ``B_g = W[g]`` when the stack is stored
    ``[E, K, N]``, ``W[g]^T`` with ``transpose_w`` (stored ``[E, N, K]``). fp32 accumulation; the dequantized
    tile is rounded to ``a``'s dtype before ``tl.dot``. No host sync: shapes and metadata only."""
    _raise_unless_ready(stack, a, offs)
    if out_dtype is not None and out_dtype not in FUSED_DTYPES:
        raise ValueError(f"the fused 4-bit kernel writes bf16/fp16/fp32, not {out_dtype}")
    k, n = operand_shape(stack, transpose_w)
    if a.shape[1] != k:
        raise ValueError(f"activations have {a.shape[1]} features, the {'transposed ' * transpose_w}stack needs {k}")
    experts = stack.shape[0]
    out = torch.empty(a.shape[0], n, dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    t = tiles or DEFAULT_TILES[a.dtype]
    if t.block_m > MAX_BLOCK_M:
        raise ValueError(f"block_m {t.block_m} > {MAX_BLOCK_M}: int32 tile offsets are checked up to {MAX_BLOCK_M}")
    grid = (triton.cdiv(a.shape[0], t.block_m) + experts, triton.cdiv(n, t.block_n))
    # fp32 means IEEE fp32, as torch's matmul does by default (TF32 off); ignored for bf16/fp16 operands
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grouped_kernel[grid](
        a, stack.data, _absmax_fp32(stack), code_table(stack.quant_type, a.device), offs, out,
        n, k, a.stride(0), a.stride(1), out.stride(0), out.stride(1), stack.numel // experts,
        E=experts, E_POW2=max(2, triton.next_power_of_2(experts)), LOG2_BLOCKSIZE=_log2(stack.blocksize),
        TRANSPOSED=transpose_w,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, PRECISION=precision, LOOKUP=t.lookup,
        INTERPRETED=INTERPRETED, num_warps=t.num_warps, num_stages=t.num_stages, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out

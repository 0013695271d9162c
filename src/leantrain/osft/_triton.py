"""fp32 GEMM ``out ← beta·out + alpha·(a @ b)`` in Triton for the OSFT projection: ``input_precision="tf32x3"``
splits each fp32 tile into a TF32 head and tail in registers and sums hi·hi + hi·lo + lo·hi on the tensor cores
(fp32-level accuracy), so no split copy of an operand is ever written and each product is one launch.

- Operands are strided 2-D views (``.t()`` views included: never copied); accumulation in fp32; ``alpha`` ∈ {1, −1}
  and ``beta`` ∈ {0, 1} are compile-time constants (the projection only needs C = Xᵀ·Y and Y −= X·C).
- Batching: ``B`` same-shaped, same-strided problems in one launch (grid axis 2). Each operand is either
  ``base + b·batch_stride`` (a stacked tensor, e.g. the coefficients) or a device table of int64 base addresses
  (separate tensors: parameters and gradients of many layers, which stacking would copy); the kernel casts the
  loaded address with ``.to(tl.pointer_type(tl.float32))`` (works under the CPU interpreter too).
- Split-K, for long contractions with few output tiles (the coefficient: k×k output, contraction over N or M):
  each split writes its partial tile to an fp32 workspace ``[SPLIT_K, B, M, N]`` and a second kernel sums the
  splits in a fixed order and applies alpha/beta. Atomic adds would save the workspace and the second pass, but
  their order (and so the result's rounding) varies run to run; the workspace is ≤ ~2 waves of tiles (split-K is
  only chosen when the grid underfills the GPU), a few MiB, and the reduction pass is bandwidth-trivial.

The kernels are defined when this module is imported (``TRITON_INTERPRET`` is read then: set it first; the CPU
interpreter runs the tests, where ``input_precision`` has no effect: numpy multiplies fp32 as fp32).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


try:  # optional: without triton only ``gemm_reasons`` is usable (and says why)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


PRECISIONS = ("tf32x3", "tf32", "ieee")
INT32_MAX = 2**31 - 1
MAX_SPLIT_K = 16
# Triton picks interpreter or compiler when a kernel is defined (this module's import): that moment's setting holds.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch knobs (tl.dot needs every tile dim ≥ 16). ``group_m``: M tiles per L2 group."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


# Measured on an H100 (triton 3.6, every shape class of a 1B Llama batched over 16 layers; the tile sweep in
# benchmarks/results/osft_projection_triton.md). 128x64x32, 4 warps, 4 stages (q/o 11.4 ms, gate/up 24.9,
# down 11.7, k/v 3.1 per pass; 2026-11-23: 128x128x32 / 8 warps 15.4, 38.2, 15.6) needs 96 KiB of shared memory;
# 256x64x32, 8 warps, 3 stages is faster on every class (10.7, 23.0, 11.2, 2.8 on 2026-11-24: -6.5% a pass) and
# needs 120 KiB, so it is the default where the GPU grants a block that much (Hopper, A100), else the former.
# Other tiles are measured by changing these and rerunning benchmarks/bench_osft.py (projection time per step).
DEFAULT_TILES = TileConfig(block_m=128, block_n=64, block_k=32, num_warps=4, num_stages=4)
LARGE_TILES = TileConfig(block_m=256, block_n=64, block_k=32, num_warps=8, num_stages=3)
REDUCE_BLOCK = 1024
# Explicit (Triton 3.9 warns when left to its default); the kernels have no multiply-add outside tl.dot to contract.
FP_FUSION = False


# ----------------------------------------------------------------------------------------------- readiness


def _triton_missing() -> str | None:
    return None if triton is not None else "triton not installed: pip install triton (ships with torch's CUDA wheels)"


def _span(t: torch.Tensor) -> int:
    """Largest element offset from the view's first element (the kernel's in-operand offsets are int32)."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)


def _device_reasons(tensors: dict[str, torch.Tensor]) -> list[str]:
    tensors = {n: t for n, t in tensors.items() if t.device.type != "meta"}  # shape-only stand-ins
    devices = {t.device for t in tensors.values()}
    if not devices:
        return []
    if len(devices) > 1:
        return ["operands on different devices: " + ", ".join(f"{n} on {t.device}" for n, t in tensors.items())]
    device = next(iter(devices))
    if device.type != "cuda" and not (device.type == "cpu" and INTERPRETED):
        return [f"the Triton GEMM runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {device}"]
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        # Triton launches on the current device: another GPU's pointers would be read from the wrong one
        return [f"tensors on {device} but the current CUDA device is cuda:{torch.cuda.current_device()}"]
    return []


def _operand_reasons(tensors: dict[str, torch.Tensor], written: str) -> list[str]:
    """Rank, device, dtype, int32 offsets and overlap of the named operands (``written`` is stored to)."""
    reasons = [r for r in (_triton_missing(),) if r]
    bad_rank = [f"{n} {tuple(t.shape)}" for n, t in tensors.items() if t.dim() != 2]
    if bad_rank:
        return reasons + ["operands must be 2-D: " + ", ".join(bad_rank)]
    reasons += _device_reasons(tensors)
    bad_dtype = [f"{n} {t.dtype}" for n, t in tensors.items() if t.dtype != torch.float32]
    if bad_dtype:
        reasons.append("the Triton GEMM is fp32 only: " + ", ".join(bad_dtype))
    if any(_span(t) > INT32_MAX or max(map(abs, t.stride())) > INT32_MAX for t in tensors.values()):
        reasons.append("an operand's element offsets exceed the kernel's int32 offsets")
    out = tensors[written]
    if any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride())):
        reasons.append(f"{written} has a zero stride {out.stride()}: its elements overlap")
    return reasons


def gemm_reasons(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """Every reason the kernel cannot compute ``out ← beta·out + alpha·a@b`` (empty: it can), from host metadata
    only (no device sync). Checked before any launch: a bad address in a CUDA kernel is an illegal memory access
    that poisons the process, so nothing the kernel assumes is left to the kernel."""
    reasons = _operand_reasons({"out": out, "a": a, "b": b}, "out")
    if a.dim() == b.dim() == out.dim() == 2 and (a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1])):
        reasons.append(f"shapes do not chain: out {tuple(out.shape)} = a {tuple(a.shape)} @ b {tuple(b.shape)}")
    return reasons


def projection_reasons(side: str, basis: torch.Tensor, target: torch.Tensor | None) -> list[str]:
    """Every reason the kernel cannot run one projection (side 'u': C = basisᵀ·target, target −= basis·C; side
    'v': C = target·basisᵀ, target −= C·basis) with a fresh contiguous fp32 coefficient: host metadata only."""
    target = basis if target is None else target  # no target here: the job only reserves its coefficient slot
    reasons = _operand_reasons({"basis": basis, "target": target}, "target")
    if basis.dim() == target.dim() == 2:
        dim = 0 if side == "u" else 1  # the contraction of the coefficient
        if basis.shape[dim] != target.shape[dim]:
            reasons.append(f"side {side}: basis {tuple(basis.shape)} and target {tuple(target.shape)} do not chain")
        if basis.shape[1 - dim] * target.shape[1 - dim] > INT32_MAX:
            reasons.append("the coefficient's element offsets exceed the kernel's int32 offsets")
    return reasons


# --------------------------------------------------------------------------------------------- operands


@dataclass(frozen=True)
class Operand:
    """``size`` same-shaped, same-strided 2-D views for one launch: ``first`` gives shape and strides; member b is
    at ``table[b]`` (int64 device addresses) or, without a table, ``first.data_ptr() + b·batch_stride`` elements."""

    first: torch.Tensor
    size: int = 1
    table: torch.Tensor | None = None
    batch_stride: int = 0
    aligned: bool = False  # every member's address is 16-byte aligned (tables only; see PointerTables.aligned)

    @staticmethod
    def stacked(t: torch.Tensor) -> Operand:
        """A 3-D tensor (or view) as ``t.shape[0]`` members."""
        return Operand(t[0], t.shape[0], None, t.stride(0))

    def pointer(self) -> torch.Tensor:
        return self.first if self.table is None else self.table


class PointerTables:
    """Device tables of ``data_ptr()`` values, one per slot, rebuilt only when a member's address changes.

    Building a table is a host→device copy; parameters never move, gradients may be reallocated between steps
    (``zero_grad(set_to_none=True)``; the caching allocator often hands back the same block), so the host-side
    address tuple is compared on every call and the copy happens only on a change (pinned + non_blocking: no
    sync). The tensors must stay alive until the kernels that read the table have run (the caller's references
    and the stream-ordered allocator see to that)."""

    def __init__(self) -> None:
        self._tables: dict[object, tuple[tuple[int, ...], torch.Tensor]] = {}

    @staticmethod
    def aligned(tensors: Sequence[torch.Tensor]) -> bool:
        return all(t.data_ptr() % 16 == 0 for t in tensors)

    def get(self, slot: object, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        ptrs = tuple(t.data_ptr() for t in tensors)
        hit = self._tables.get(slot)
        if hit is not None and hit[0] == ptrs:
            return hit[1]
        host = torch.tensor(ptrs, dtype=torch.int64)
        device = tensors[0].device
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        self._tables[slot] = (ptrs, table)
        return table


# ------------------------------------------------------------------------------------------------- kernels


if triton is not None:

    @triton.jit
    def _base(ptr, bid, batch_stride, TABLE: tl.constexpr, ALIGNED: tl.constexpr = False):
        """Member ``bid``'s first element: from the address table, or a batch stride away from ``ptr``. A loaded
        address carries no alignment the compiler can see: ``ALIGNED`` (every member 16-byte aligned, checked on
        the host) says so, else the tile loads cannot vectorize (4-byte loads: several times slower)."""
        if TABLE:
            base = tl.load(ptr + bid).to(tl.pointer_type(tl.float32))
            if ALIGNED:
                base = tl.multiple_of(base, 16)
        else:
            base = ptr + bid.to(tl.int64) * batch_stride
        return base

    @triton.jit
    def _epilogue(c, acc, mask, ALPHA: tl.constexpr, BETA: tl.constexpr, MASKED: tl.constexpr):
        if ALPHA < 0:
            acc = -acc
        if MASKED:
            if BETA != 0:
                acc += tl.load(c, mask=mask, other=0.0)
            tl.store(c, acc, mask=mask)
        else:
            if BETA != 0:
                acc += tl.load(c)
            tl.store(c, acc)

    @triton.jit
    def addmm_kernel(
        a_ptr, b_ptr, c_ptr, ws_ptr,
        M, N, K, K_SPLIT,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        batch_a, batch_b, batch_c,
        A_TABLE: tl.constexpr, B_TABLE: tl.constexpr, C_TABLE: tl.constexpr,
        ALPHA: tl.constexpr, BETA: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        pid, split, bid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        # grouped tile order: GROUP_M consecutive M tiles share the B tiles they read (L2 reuse)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        rows_in_group = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % rows_in_group
        pid_n = (pid % width) // rows_in_group
        a = _base(a_ptr, bid, batch_a, A_TABLE, ALIGNED)
        b = _base(b_ptr, bid, batch_b, B_TABLE, ALIGNED)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Whole tiles (EVEN_*: the shapes the projection meets, multiples of 128) need no masks or wrapping, and the
        # hints let the loads along a unit-stride dim vectorize (a mask with a runtime bound or a modulo hides that
        # contiguity from the compiler: scalar loads). Edge tiles otherwise read a wrapped row/col, never stored.
        if EVEN_M:
            a_rows = tl.max_contiguous(tl.multiple_of(rm, BLOCK_M), BLOCK_M)[:, None] * stride_am
        else:
            a_rows = (rm % M)[:, None] * stride_am
        if EVEN_N:
            b_cols = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)[None, :] * stride_bn
        else:
            b_cols = (rn % N)[None, :] * stride_bn
        k0 = split * K_SPLIT
        k_end = min(k0 + K_SPLIT, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            ks = tl.max_contiguous(tl.multiple_of(k + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            if EVEN_K:  # K_SPLIT and K are whole BLOCK_Ks: every step is full
                x = tl.load(a + a_rows + ks[None, :] * stride_ak)
                y = tl.load(b + ks[:, None] * stride_bk + b_cols)
            else:
                k_ok = ks < k_end
                x = tl.load(a + a_rows + ks[None, :] * stride_ak, mask=k_ok[None, :], other=0.0)
                y = tl.load(b + ks[:, None] * stride_bk + b_cols, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(x, y, acc, input_precision=PRECISION)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if SPLIT_K == 1:
            c = _base(c_ptr, bid, batch_c, C_TABLE, ALIGNED) + rm[:, None] * stride_cm + rn[None, :] * stride_cn
            _epilogue(c, acc, mask, ALPHA, BETA, not (EVEN_M and EVEN_N))
        else:  # partial tile into the workspace [SPLIT_K, B, M, N]; reduce_kernel sums and applies alpha/beta
            part = ws_ptr + (split * tl.num_programs(2) + bid).to(tl.int64) * M * N
            tl.store(part + rm[:, None] * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def reduce_kernel(
        ws_ptr, c_ptr, M, N, stride_cm, stride_cn, batch_c,
        C_TABLE: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        bid = tl.program_id(1)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < M * N
        members = tl.num_programs(1)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
            acc += tl.load(ws_ptr + (s * members + bid).to(tl.int64) * M * N + idx, mask=mask, other=0.0)
        c = _base(c_ptr, bid, batch_c, C_TABLE) + (idx // N) * stride_cm + (idx % N) * stride_cn
        _epilogue(c, acc, mask, ALPHA, BETA, True)


# ------------------------------------------------------------------------------------------------- launch


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one "SM", no split-K unless asked
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_memory(tiles: TileConfig) -> int:
    """Bytes of shared memory the pipelined fp32 operand tiles take (what decides whether a config can launch)."""
    return (tiles.block_m + tiles.block_n) * tiles.block_k * 4 * tiles.num_stages


@functools.cache
def _shared_memory_optin(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def default_tiles(device: torch.device) -> TileConfig:
    """LARGE_TILES where the device can hold them (host metadata, cached), else DEFAULT_TILES."""
    return LARGE_TILES if _shared_memory_optin(device) >= shared_memory(LARGE_TILES) else DEFAULT_TILES


def choose_split_k(m: int, n: int, k: int, members: int, tiles: TileConfig, device: torch.device) -> int:
    """Splits of the contraction so that the grid covers the GPU about once; 1 when the output tiles already do
    (batched projections usually) or the contraction is short (each split keeps ≥ 4 K steps)."""
    programs = members * triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    sms = _multiprocessors(device)
    if programs >= sms:
        return 1
    return max(1, min(sms // programs, k // (4 * tiles.block_k), MAX_SPLIT_K))


def _check(out: Operand, a: Operand, b: Operand, alpha: float, beta: float, precision: str) -> None:
    reasons = gemm_reasons(out.first, a.first, b.first)
    if reasons:
        raise ValueError("Triton GEMM cannot run: " + "; ".join(reasons))
    if not out.size == a.size == b.size:
        raise ValueError(f"batch sizes differ: out {out.size}, a {a.size}, b {b.size}")
    if alpha not in (1, -1) or beta not in (0, 1) or precision not in PRECISIONS:
        raise ValueError(f"alpha ±1, beta 0/1 and precision in {PRECISIONS}; got {alpha}, {beta}, {precision!r}")


def addmm(
    out: Operand | torch.Tensor,
    a: Operand | torch.Tensor,
    b: Operand | torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    precision: str = "tf32x3",
    tiles: TileConfig | None = None,
    split_k: int | None = None,
) -> None:
    """``out[i] ← beta·out[i] + alpha·a[i] @ b[i]`` for every batch member i, fp32 accumulation, one launch (two
    with split-K). Tensors are single members. ``split_k`` None: :func:`choose_split_k`. No host sync."""
    out, a, b = (x if isinstance(x, Operand) else Operand(x) for x in (out, a, b))
    _check(out, a, b, alpha, beta, precision)
    t = tiles or default_tiles(out.first.device)
    (m, k), n = a.first.shape, b.first.shape[1]
    if out.size == 0 or m == 0 or n == 0:
        return
    splits = split_k or choose_split_k(m, n, k, out.size, t, out.first.device)
    k_split = triton.cdiv(triton.cdiv(max(k, 1), splits), t.block_k) * t.block_k
    splits = max(1, triton.cdiv(k, k_split))  # no empty trailing split
    ws = out.first  # unused placeholder pointer when not split
    if splits > 1:
        ws = torch.empty((splits, out.size, m, n), dtype=torch.float32, device=out.first.device)
    c = out.first
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), splits, out.size)
    addmm_kernel[grid](
        a.pointer(), b.pointer(), out.pointer(), ws, m, n, k, k_split,
        a.first.stride(0), a.first.stride(1), b.first.stride(0), b.first.stride(1), c.stride(0), c.stride(1),
        a.batch_stride, b.batch_stride, out.batch_stride,
        A_TABLE=a.table is not None, B_TABLE=b.table is not None, C_TABLE=out.table is not None,
        ALPHA=int(alpha), BETA=int(beta), SPLIT_K=splits, PRECISION=precision,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        EVEN_M=m % t.block_m == 0, EVEN_N=n % t.block_n == 0, EVEN_K=k % t.block_k == 0,
        ALIGNED=all(x.aligned for x in (a, b, out) if x.table is not None),
        num_warps=t.num_warps, num_stages=t.num_stages, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    if splits > 1:
        reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK), out.size)](
            ws, out.pointer(), m, n, c.stride(0), c.stride(1), out.batch_stride,
            C_TABLE=out.table is not None, ALPHA=int(alpha), BETA=int(beta), SPLIT_K=splits, BLOCK=REDUCE_BLOCK,
            num_warps=4, enable_fp_fusion=FP_FUSION,
        )  # fmt: skip

"""Keep the trainable factors orthogonal to the frozen subspace, batched over every target, shard-correct.

Per target (factored; never an M×M or N×N Gram matrix):
    dU ← dU − U_high (U_highᵀ dU)        coefficient k_high×k_low
    dV ← dV − (dV V_highᵀ) V_high        coefficient k_low×k_high
applied to the gradients before ``optimizer.step()`` and to the parameters after it (AdamW's elementwise update
leaks into the frozen subspace otherwise).

Layouts, detected per target from the DTensor placements at call time (rank-uniform: placements and global shapes
are the same on every rank):
- plain tensors (single process, DDP: gradients already averaged): local, no collective;
- U Shard(0) (FSDP2 default): ``U_highᵀ dU`` contracts over the sharded N, so per-rank products are partial sums;
- V Shard(1) (``leantrain.osft.fully_shard``): ``dV V_highᵀ`` contracts over the sharded M: partial sums too.
  Every partial coefficient of every target goes into one flat buffer and one all-reduce (per ``bucket_mib``);
- V Shard(0) (accelerate's default FSDP2 prepare): the local block ``dV_p V_high,pᵀ`` is only a diagonal block,
  so all-reducing it is wrong; instead V_high is all-gathered (one padded collective per bucket of targets, the next
  bucket's in flight while one is projected) and each rank projects its own rows of dV exactly. V_high is frozen:
  with ``cache_v_high`` it is gathered once and kept (the full V_high on every rank) while each member's identity
  (parameter, storage, version) is unchanged.

Precision of fp32 targets (``precision``; bf16 factors always use their own dtype): ``fp32`` exact reference;
``tf32`` / ``bf16`` one pass of reduced-precision GEMMs (leaves ~eps of the gradient in the frozen subspace:
5e-4 / 4e-3); ``tf32x3`` / ``bf16x3`` split each operand into a reduced-precision head and tail (x = hi + lo) and
form every product as hi·hi + hi·lo + lo·hi, three reduced-precision GEMMs accumulated in fp32, for both the
coefficient and the update: residual ~eps² (tf32x3: fp32 level; bf16x3 ~1e-5) at 6 cheap GEMMs instead of 2 fp32
ones, one pass, so sharded layouts keep one collective. Re-projecting with rounded GEMMs (iterative refinement)
does not help: the second coefficient ``B_highᵀ·G₁`` is small but its operands are not, so rounding B and G₁ alone
leaves ~eps again (measured: tf32 4.1e-4 → 2.4e-4, bf16 2.9e-3 → 2.2e-3). Reduced precision only runs on CUDA
(elsewhere the fp32 GEMMs are used) unless ``emulate=True`` rounds the GEMM inputs in software (tests).

``tf32x3`` with ``kernel="triton"`` runs a Triton GEMM (``_triton``) that splits the fp32 tiles in registers
(``tl.dot(..., input_precision="tf32x3")``): one launch per product instead of three cuBLAS GEMMs plus the split
passes, and same-shaped local targets (many layers share shapes) are projected with one launch per shape class and
product, through device tables of their addresses. A job the kernel cannot take (``_triton.projection_reasons``,
host metadata only) runs plain fp32 GEMMs instead (exact; faster than the split on an H100); the reasons are kept
in ``Projector.fallbacks``. TF32 is enabled around the split / one-pass TF32 GEMMs alone, never around fp32 ones.
``kernel="split"`` keeps the cuBLAS split; ``kernel="auto"`` (default) picks per ``TRITON_BY_DEFAULT`` (on);
``kernel="triton"`` also asks for it off CUDA (the CPU interpreter).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _triton
from .linear import OSFTLinear


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed
    DTensor = ()  # type: ignore[assignment,misc]


class LayoutError(RuntimeError):
    """A sharding of the OSFT factors that the projection cannot handle exactly."""


@dataclass(frozen=True)
class Layout:
    """Where one factor lives: ``dim`` is the sharded tensor dim (None: whole tensor on every rank)."""

    dim: int | None = None
    group: Any = None
    size: int = 1


def layout(t: torch.Tensor) -> Layout:
    if not isinstance(t, DTensor):
        return Layout()
    shards = [(i, p.dim) for i, p in enumerate(t.placements) if p.is_shard()]
    if not shards:
        return Layout()
    if len(shards) > 1:
        raise LayoutError(f"OSFT factor sharded on more than one mesh dimension: {t.placements}")
    mesh_dim, dim = shards[0]
    mesh = t.device_mesh
    return Layout(dim, mesh.get_group(mesh_dim), mesh.size(mesh_dim))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard as a view (in-place edits reach the parameter / gradient storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def matmul_tf32(enabled: bool) -> Iterator[None]:
    """Let fp32 projection GEMMs use TF32 on CUDA for the duration (restored after)."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        old, matmul.fp32_precision = matmul.fp32_precision, "tf32"
        legacy = False
    except (AttributeError, RuntimeError):  # older torch, or the legacy flag was used in this process
        old, matmul.allow_tf32, legacy = matmul.allow_tf32, True, True
    try:
        yield
    finally:
        if legacy:
            matmul.allow_tf32 = old
        else:
            matmul.fp32_precision = old


PRECISIONS = (
    "fp32",
    "tf32",
    "bf16",
    "tf32x3",
    "bf16x3",
)  # config.OSFT_PRECISIONS offers these (a test keeps them equal)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"osft projection precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Nearest TF32 value (10-bit mantissa) as float32: a TF32 GEMM reads it unchanged, whatever its rounding."""
    return torch.bitwise_and(x.view(torch.int32) + 0x1000, -0x2000).view(torch.float32)


Parts = tuple[torch.Tensor, "torch.Tensor | None"]  # (head, tail) of a split operand; tail None: one product


@dataclass(frozen=True)
class _Gemm:
    """Reduced-precision GEMMs with fp32 accumulation into an fp32 ``out``: ``kind`` 'tf32' or 'bf16', ``splits``
    1 (one product) or 3 (hi·hi + hi·lo + lo·hi); ``emulate`` rounds the inputs in software (exact emulation of a
    tensor-core GEMM up to the accumulation order)."""

    kind: str
    splits: int
    emulate: bool

    def _read(self, x: torch.Tensor) -> torch.Tensor:
        """The operand as the GEMM reads it. TF32 on CUDA rounds in hardware; bf16 operands are cast."""
        if self.kind == "bf16":
            return x.bfloat16().float() if self.emulate else x.bfloat16()
        return _round_tf32(x) if self.emulate else x

    def split(self, x: torch.Tensor) -> Parts:
        if self.splits == 1:
            return self._read(x), None
        hi = _round_tf32(x) if self.kind == "tf32" else x.bfloat16().float()  # exactly representable head
        lo = x - hi  # exact in fp32 (|lo| ≤ ulp(hi)/2); its own rounding costs ~eps² of x
        return self._read(hi), self._read(lo)

    @staticmethod
    def _mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float) -> None:
        if a.dtype == torch.bfloat16:  # CUDA bf16 operands, fp32 accumulator and output
            if beta == 0:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
            else:
                torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=torch.float32, out=out)
        elif beta == 0:  # (alpha is 1 here: coefficients)
            torch.mm(a, b, out=out)
        else:  # rounded fp32 operands (emulation), or TF32 tensor cores under ``matmul_tf32``
            out.addmm_(a, b, alpha=alpha)

    def addmm(self, out: torch.Tensor, a: Parts, b: Parts, *, alpha: float, beta: float) -> None:
        """out ← beta·out + alpha·a·b (beta 0 or 1), a and b split by :meth:`split`."""
        (a_hi, a_lo), (b_hi, b_lo) = a, b
        # TF32 tensor cores for these GEMMs only: a job that runs plain fp32 GEMMs beside them stays exact
        with matmul_tf32(self.kind == "tf32" and not self.emulate):
            if a_lo is not None and b_lo is not None:  # small terms first, the head last
                self._mm(out, a_hi, b_lo, alpha, beta)
                self._mm(out, a_lo, b_hi, alpha, 1.0)
                beta = 1.0
            self._mm(out, a_hi, b_hi, alpha, beta)


def _gemm(precision: str, device: torch.device, emulate: bool) -> _Gemm | None:
    """The reduced-precision GEMM for this precision and device; None: plain GEMMs in the tensors' dtype."""
    if precision == "fp32" or not (emulate or device.type == "cuda"):
        return None
    return _Gemm(precision[:4], 3 if precision.endswith("x3") else 1, emulate)


@dataclass(frozen=True)
class _TritonGemm:
    """The Triton GEMM (``_triton.addmm``) at ``precision``."""

    precision: str

    def addmm(self, out: Any, a: Any, b: Any, *, alpha: float, beta: float) -> None:
        _triton.addmm(out, a, b, alpha=alpha, beta=beta, precision=self.precision)


KERNELS = ("auto", "triton", "split")
# What "auto" picks for tf32x3 on CUDA. Measured on an H100 (triton 3.6, benchmarks/results/osft_projection_triton.md:
# one gradient pass over the 112 targets of bench_osft's 1.1B Llama): Triton batched 51 ms at the default tiles
# (one launch per target, older tiles: 99 ms), fp32 cuBLAS 58 ms, cuBLAS split 76 ms; residual
# max|U_highᵀdU′|/max|dU| 1.2e-6 (Triton), 1.4e-6 (fp32), 2.6e-5 (split). False restores the split path.
TRITON_BY_DEFAULT = True


def _t(parts: Parts) -> Parts:
    return parts[0].t(), None if parts[1] is None else parts[1].t()


@dataclass
class _Job:
    """One coefficient: side 'u' → C = basisᵀ·target, target −= basis·C; side 'v' → C = target·basisᵀ,
    target −= C·basis. ``target`` None (no gradient here) still reserves its slot so buffers stay rank-uniform."""

    side: str
    basis: torch.Tensor
    target: torch.Tensor | None
    shape: tuple[int, int]
    dtype: torch.dtype  # of the coefficient: the target's (fast path) or float32 (simple path)
    group: Any = None
    gemm: _Gemm | _TritonGemm | None = None  # reduced-precision GEMMs (fp32 target and basis only)

    def coefficient(self, out: torch.Tensor, basis: Parts | None = None) -> None:
        if self.target is None:
            out.zero_()
            return
        if isinstance(self.gemm, _TritonGemm):
            a, b = (self.basis.t(), self.target) if self.side == "u" else (self.target, self.basis.t())
            self.gemm.addmm(out, a, b, alpha=1.0, beta=0.0)
            return
        if self.gemm is not None:
            basis_t, target = _t(basis or self.gemm.split(self.basis)), self.gemm.split(self.target)
            a, b = (basis_t, target) if self.side == "u" else (target, basis_t)
            self.gemm.addmm(out, a, b, alpha=1.0, beta=0.0)
            return
        basis, target = self.basis.to(out.dtype), self.target.to(out.dtype)
        if self.side == "u":
            torch.mm(basis.t(), target, out=out)
        else:
            torch.mm(target, basis.t(), out=out)

    def apply(self, coeff: torch.Tensor, basis: Parts | None = None) -> None:
        if self.target is None:
            return
        if isinstance(self.gemm, _TritonGemm):
            a, b = (self.basis, coeff) if self.side == "u" else (coeff, self.basis)
            self.gemm.addmm(self.target, a, b, alpha=-1.0, beta=1.0)
            return
        if self.gemm is not None:
            parts, c = basis or self.gemm.split(self.basis), self.gemm.split(coeff)
            a, b = (parts, c) if self.side == "u" else (c, parts)
            self.gemm.addmm(self.target, a, b, alpha=-1.0, beta=1.0)
            return
        basis = self.basis.to(coeff.dtype)
        if coeff.dtype == self.target.dtype:
            if self.side == "u":
                self.target.addmm_(basis, coeff, alpha=-1)
            else:
                self.target.addmm_(coeff, basis, alpha=-1)
        else:  # simple path: the correction in float32, rounded once
            correction = basis @ coeff if self.side == "u" else coeff @ basis
            self.target.sub_(correction.to(self.target.dtype))

    def run_local(self) -> None:
        if self.target is None:
            return
        coeff = torch.empty(self.shape, dtype=self.dtype, device=self.target.device)
        basis = self.gemm.split(self.basis) if isinstance(self.gemm, _Gemm) else None  # once for both products
        self.coefficient(coeff, basis)
        self.apply(coeff, basis)


def _shape_class(job: _Job) -> tuple:
    """Jobs with equal keys run in one batched launch (shapes and strides are the kernel's, per launch)."""
    basis, target = job.basis, job.target
    return job.side, basis.shape, basis.stride(), target.shape, target.stride(), target.device


@dataclass
class _Gather:
    """A Shard(0) V: gather V_high (padded to ceil(k_high/P) rows per rank), then project locally."""

    v_high: torch.Tensor  # local rows
    k_high: int
    target: torch.Tensor | None
    layout: Layout
    source: Any  # the V_high parameter (its identity keys the gathered-V_high cache)

    def identity(self) -> tuple:
        """What a cached gather of this V_high is valid for: the parameter object, its local storage and the
        storage's version (an in-place copy, e.g. a checkpoint load, bumps it). Host metadata only."""
        return id(self.source), self.v_high.data_ptr(), self.v_high._version, tuple(self.v_high.shape)

    @property
    def rows(self) -> int:
        return math.ceil(self.k_high / self.layout.size)

    @property
    def numel(self) -> int:
        return self.rows * self.v_high.shape[1]


class Projector:
    """Projects the gradients (pre-step) or parameters (post-step) of a list of ``OSFTLinear`` layers.

    ``batched=False`` is the simple path used as the run-time fallback: coefficients in float32 whatever the factor
    dtype, one collective per coefficient / per gathered V_high, no flat buffers, fp32 GEMMs (the exact reference).
    ``precision`` (one of :data:`PRECISIONS`) sets the GEMMs for fp32 factors on CUDA (module docstring);
    ``tf32=True`` is the legacy spelling of ``precision="tf32"`` (it wins). ``emulate`` runs the reduced-precision
    GEMMs in software on any device (tests). ``kernel`` (tf32x3 only): "auto" the Triton GEMM on CUDA when
    ``TRITON_BY_DEFAULT`` (not with ``emulate``), "triton" wherever its readiness check passes (also CPU under
    ``TRITON_INTERPRET=1``), "split" the cuBLAS split products; ``fallbacks`` counts the reasons jobs ran
    fp32 GEMMs instead of Triton.
    """

    def __init__(
        self,
        layers: Sequence[OSFTLinear],
        *,
        precision: str = "fp32",
        tf32: bool = False,
        bucket_mib: float = 256,
        batched: bool = True,
        emulate: bool = False,
        kernel: str = "auto",
        cache_v_high: bool = False,
    ) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"osft projection kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.layers = list(layers)
        self.precision = "tf32" if tf32 else check_precision(precision)
        self.emulate = emulate
        self.bucket_bytes = int(bucket_mib * 2**20)
        self.batched = batched
        self.kernel = kernel
        self.fallbacks: dict[str, int] = {}  # reason → jobs that ran fp32 GEMMs instead of the Triton GEMM
        self._tables = _triton.PointerTables()  # address tables of batched local targets, reused across steps
        self.cache_v_high = cache_v_high
        self._gathered: dict[int, tuple[tuple, list[Any], torch.Tensor]] = {}  # bucket → (identity, sources, V_high)
        self.gathers = 0  # all-gathers issued (V_high of Shard(0) targets), for tests and benchmarks

    def clear_cache(self) -> None:
        """Forget the gathered V_high (call on every rank after changing V_high other than on all ranks at once)."""
        self._gathered.clear()

    def project_gradients(self) -> None:
        self._run(grad=True)

    def project_parameters(self) -> None:
        self._run(grad=False)

    def uses_collectives(self) -> bool:
        return any(layout(t).dim is not None for layer in self.layers for t in (layer.U_high, layer.V_high))

    @torch.no_grad()
    def _run(self, grad: bool) -> None:
        reduce_jobs: list[_Job] = []
        gathers: list[_Gather] = []
        batched: list[_Job] = []  # local Triton jobs, run per shape class
        for layer in self.layers:
            self._plan(layer, grad, reduce_jobs, gathers, batched)
        self._project_batches(batched, grad)
        self._gather_and_project(gathers)
        self._reduce_and_project(reduce_jobs)

    def _plan(
        self, layer: OSFTLinear, grad: bool, reduce_jobs: list[_Job], gathers: list[_Gather], batched: list[_Job]
    ) -> None:
        if layer.k_high == 0:
            return  # ratio 1.0: nothing frozen, nothing to project
        u_low, v_low = layer.U_low, layer.V_low
        u_t = u_low.grad if grad else u_low.detach()
        v_t = v_low.grad if grad else v_low.detach()
        lu_high, lu_low, lv_high, lv_low = (layout(t) for t in (layer.U_high, u_low, layer.V_high, v_low))
        if (lu_high.dim, lu_low.dim) not in ((None, None), (0, 0)):
            raise LayoutError(f"U factors sharded as {lu_high.dim}/{lu_low.dim}: only Shard(0) is exact")
        if lv_high.dim != lv_low.dim or lv_high.dim not in (None, 0, 1):
            raise LayoutError(f"V factors sharded as {lv_high.dim}/{lv_low.dim}: use Shard(0) or Shard(1) for both")
        u_target = None if u_t is None else _local(u_t)
        v_target = None if v_t is None else _local(v_t)
        k_high, k_low = layer.k_high, layer.k_low
        dtype = u_low.dtype if self.batched else torch.float32
        gemm = self._gemm(u_low)
        u_job = self._job("u", _local(layer.U_high), u_target, (k_high, k_low), dtype, lu_high.group, gemm)
        if lu_high.dim is None:
            self._run_local(u_job, batched)
        else:
            reduce_jobs.append(u_job)
        if lv_high.dim == 0:
            gathers.append(_Gather(_local(layer.V_high), k_high, v_target, lv_high, layer.V_high))
            return
        v_job = self._job("v", _local(layer.V_high), v_target, (k_low, k_high), dtype, lv_high.group, gemm)
        if lv_high.dim is None:
            self._run_local(v_job, batched)
        else:
            reduce_jobs.append(v_job)

    def _gemm(self, factor: torch.Tensor) -> _Gemm | _TritonGemm | None:
        if not self.batched or factor.dtype != torch.float32:
            return None  # the simple path is the fp32 reference; low-precision factors use their own dtype
        split = _gemm(self.precision, factor.device, self.emulate)
        auto = TRITON_BY_DEFAULT and factor.device.type == "cuda" and not self.emulate
        triton = self.kernel == "triton" or (self.kernel == "auto" and auto)
        if self.precision == "tf32x3" and triton:
            return _TritonGemm(self.precision)
        return split

    def _job(self, side: str, basis: torch.Tensor, target, shape, dtype, group, gemm) -> _Job:
        """A job whose Triton GEMM, if any, passed its readiness check. A job the kernel cannot take runs plain fp32
        GEMMs: on an H100 they are faster and ~20x closer to exact than the cuBLAS split (58 ms, residual 1.4e-6 vs
        76 ms, 2.6e-5 per pass over a 1.1B Llama; benchmarks/results/osft_projection_triton.md)."""
        if isinstance(gemm, _TritonGemm):
            reasons = _triton.projection_reasons(side, basis, target)
            for reason in reasons:
                self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            if reasons:
                gemm = None
        return _Job(side, basis, target, shape, dtype, group, gemm)

    @staticmethod
    def _run_local(job: _Job, batched: list[_Job]) -> None:
        if isinstance(job.gemm, _TritonGemm) and job.target is not None:
            batched.append(job)
        else:
            job.run_local()

    def _project_batches(self, jobs: list[_Job], grad: bool) -> None:
        """Local Triton jobs of one shape class (side, shapes, strides, device) → one launch per product and
        bucket (``bucket_mib`` caps the stacked coefficients), targets and bases addressed through tables."""
        counts: dict[Any, int] = {}
        for bucket in self._buckets(jobs, _shape_class, lambda j: j.shape[0] * j.shape[1] * 4):
            first, members = bucket[0], len(bucket)
            cls = _shape_class(first)
            slot = (cls, grad, counts.setdefault(cls, 0))  # stable across calls: the same layers in the same order
            counts[cls] += 1
            bases, targets = [j.basis for j in bucket], [j.target for j in bucket]
            basis_table, target_table = (
                self._tables.get((*slot, "basis"), bases),
                self._tables.get((*slot, "target"), targets),
            )
            aligned = _triton.PointerTables.aligned(bases + targets)
            target = _triton.Operand(first.target, members, target_table, aligned=aligned)
            basis = _triton.Operand(first.basis, members, basis_table, aligned=aligned)
            basis_t = _triton.Operand(first.basis.t(), members, basis_table, aligned=aligned)
            coeff = _triton.Operand.stacked(
                torch.empty((members, *first.shape), dtype=torch.float32, device=first.target.device)
            )
            gemm = first.gemm
            if first.side == "u":  # C = basisᵀ·target, target −= basis·C
                gemm.addmm(coeff, basis_t, target, alpha=1.0, beta=0.0)
                gemm.addmm(target, basis, coeff, alpha=-1.0, beta=1.0)
            else:  # C = target·basisᵀ, target −= C·basis
                gemm.addmm(coeff, target, basis_t, alpha=1.0, beta=0.0)
                gemm.addmm(target, coeff, basis, alpha=-1.0, beta=1.0)

    def _buckets(self, items: list[Any], key, size) -> Iterator[list[Any]]:
        """Consecutive runs of same-key items up to the byte cap (one item each when not batched)."""
        groups: dict[Any, list[Any]] = {}
        for item in items:
            groups.setdefault(key(item), []).append(item)
        for members in groups.values():
            bucket: list[Any] = []
            total = 0
            for item in members:
                if bucket and (not self.batched or total + size(item) > self.bucket_bytes):
                    yield bucket
                    bucket, total = [], 0
                bucket.append(item)
                total += size(item)
            if bucket:
                yield bucket

    def _reduce_and_project(self, jobs: list[_Job]) -> None:
        key = lambda j: (id(j.group), j.dtype)  # noqa: E731
        size = lambda j: j.shape[0] * j.shape[1] * j.dtype.itemsize  # noqa: E731
        for bucket in self._buckets(jobs, key, size):
            first = bucket[0]
            device = first.basis.device
            flat = torch.empty(sum(j.shape[0] * j.shape[1] for j in bucket), dtype=first.dtype, device=device)
            views, offset = [], 0
            for job in bucket:
                n = job.shape[0] * job.shape[1]
                views.append(flat[offset : offset + n].view(job.shape))
                job.coefficient(views[-1])
                offset += n
            dist.all_reduce(flat, group=first.group)
            for job, coeff in zip(bucket, views):
                job.apply(coeff)

    def _gather_and_project(self, gathers: list[_Gather]) -> None:
        key = lambda g: (id(g.layout.group), g.v_high.dtype)  # noqa: E731
        size = lambda g: g.numel * g.v_high.dtype.itemsize * g.layout.size  # noqa: E731
        buckets = list(self._buckets(gathers, key, size))
        # One bucket's all-gather in flight while the previous bucket is projected (NCCL: on its own stream; the
        # wait only orders the compute stream after it, no host sync)
        pending = self._start_gather(0, buckets[0]) if buckets else None
        for index, bucket in enumerate(buckets):
            out, work = pending
            pending = self._start_gather(index + 1, buckets[index + 1]) if index + 1 < len(buckets) else None
            if work is not None:
                work.wait()
            self._project_gathered(bucket, out)

    def _start_gather(self, index: int, bucket: list[_Gather]) -> tuple[torch.Tensor, Any]:
        """``[world, numel]``: every rank's padded V_high rows of the bucket, and the collective's work handle (None
        when served from the cache: V_high is frozen, so with ``cache_v_high`` it is gathered once and reused while
        every member's identity is unchanged; the identities are rank-uniform when V_high changes on all ranks)."""
        identity = tuple(g.identity() for g in bucket)
        hit = self._gathered.get(index) if self.cache_v_high else None
        if hit is not None and hit[0] == identity:
            return hit[2], None
        first = bucket[0]
        world = first.layout.size
        local = torch.zeros(sum(g.numel for g in bucket), dtype=first.v_high.dtype, device=first.v_high.device)
        offset = 0
        for g in bucket:
            local[offset : offset + g.v_high.numel()].copy_(g.v_high.reshape(-1))  # pad rows at the end
            offset += g.numel
        out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        work = dist.all_gather_into_tensor(out, local, group=first.layout.group, async_op=True)
        self.gathers += 1
        out = out.view(world, -1)
        if self.cache_v_high:  # the sources are held so their ids cannot be reused while cached
            self._gathered[index] = (identity, [g.source for g in bucket], out)
        return out, work

    def _project_gathered(self, bucket: list[_Gather], out: torch.Tensor) -> None:
        world = bucket[0].layout.size
        offset = 0
        for g in bucket:
            m = g.v_high.shape[1]
            # torch.chunk layout: rank r holds rows [r·c, r·c + len_r), only the tail is short or empty, so
            # the first k_high rows of the rank-major concatenation are V_high in order.
            full = out[:, offset : offset + g.numel].reshape(world * g.rows, m)[: g.k_high]
            offset += g.numel
            if g.target is not None:
                dtype = g.target.dtype if self.batched else torch.float32
                gemm = self._gemm(g.target)
                self._job("v", full, g.target, (g.target.shape[0], g.k_high), dtype, None, gemm).run_local()


@torch.no_grad()
def frozen_overlap(layer: OSFTLinear) -> float:
    """Largest |cos| between a frozen singular direction and a trainable one (U columns, V rows); 0 is exact.

    Gathers full tensors if sharded (a collective: every rank calls it).
    """
    if layer.k_high == 0:
        return 0.0
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).double()  # noqa: E731
    u_high, u_low = full(layer.U_high), full(layer.U_low)
    v_high, v_low = full(layer.V_high), full(layer.V_low)
    unit_cols = lambda t: t / t.norm(dim=0, keepdim=True).clamp_min(1e-30)  # noqa: E731
    u_cos = unit_cols(u_high).t() @ unit_cols(u_low)
    v_cos = unit_cols(v_low.t()).t() @ unit_cols(v_high.t())
    return float(max(u_cos.abs().max(), v_cos.abs().max()))


def gram_project(dU: torch.Tensor, dV: torch.Tensor, U_high: torch.Tensor, V_high: torch.Tensor):
    """Reference only (tests, benchmark): the Gram form ``dU − (U_high U_highᵀ) dU``, ``dV − dV (V_highᵀ V_high)``
    that PEFT's utilities and older mini_trainer use; forms N×N and M×M matrices."""
    return dU - (U_high @ U_high.t()) @ dU, dV - dV @ (V_high.t() @ V_high)

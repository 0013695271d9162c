"""Fused per-token log-probabilities, entropies, top-1 flags and losses of an LM head without the ``[N, V]`` logits.

API (every function takes hidden ``[N, H]``, weight ``[V, H]``, integer targets ``[N]``; targets < 0 are ignored rows:
their logp and entropy are 0, ``is_top1`` False, and no gradient flows from them):

- ``token_stats(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
  need_entropy=True, need_top1=False, entropy_grad=False, tile_mib=512, backend=None, keep_logits_mib=0,
  weight_context=None) -> TokenStats(logp, entropy, is_top1)``: fp32 ``logp`` [N] (differentiable into hidden, weight
  and bias), fp32 ``entropy`` [N] or None, bool ``is_top1`` [N] or None (not differentiable).
- ``head_loss(hidden, weight, targets, *, bias=None, loss_type="nll", loss_scale=1.0, temperature=1.0,
  logit_scale=1.0, softcap=None, need_entropy=True, need_top1=True, tile_mib=1024, backend=None,
  weight_context=None) -> HeadLoss(loss, logp, entropy, is_top1)``: the scalar ``loss = Σ_i w_i · (-logp_i)`` with
  ``w_i = loss_scale`` ("nll") or ``loss_scale · p_i`` with ``p_i = exp(logp_i)`` taken as a constant ("dft", TRL's
  DFT loss); ``loss_scale`` is a float or a 0-dim tensor (``1 / num_items_in_batch``, no host sync). Only ``loss``
  carries a gradient; ``logp``, ``entropy`` and ``is_top1`` come back detached, for metrics.
- ``logp_entropy(...) -> (logp, entropy)``: ``token_stats`` without the top-1 flag (the GRPO and CGGR call).

Logits are ``z = softcap(logit_scale · (h·Wᵀ + b)) / T`` (TRL's order; the bias is added to the head output before
scaling, as ``nn.Linear`` does). ``is_top1[i]`` is ``argmax_j x_ij == target_i`` with torch's rule for ties (the first
index wins, across vocab tiles too), where ``x = h·Wᵀ + b`` is the head output as the op computes it (the GEMM's
result in the compute dtype): scale, softcap and temperature are increasing maps (the order reverses for a negative
``logit_scale``), so this is the argmax of the logits ``z`` with ties decided on ``x``, bitwise the same on every
backend.

Rows are streamed through bounded ``[rows, cols]`` tiles (cuBLAS); each tile is folded into per-row fp32 statistics:
a reference ``m``, ``s_other = Σ_{j≠y} e^(z_j-m)``, ``u = Σ_j e^(z_j-m)(z_j-r)`` with a fixed per-row ``r``, the
target logit ``z_y``, the running top-1 key and index. ``m`` is fixed before the first tile at the target's logit (one
dot product per row), so every column block of every tile folds independently in one read (the Triton fold: one
program per row and block of ``FOLD_BLOCK`` columns, then a per-row combine in block order); it moves up only where a
logit exceeds it by more than ``_OVERFLOW`` nats (60; 8 for fp16), where e^(z-m) would overflow the tile dtype or the
fp32 sums: the combine then rescales what that row wrote against the old reference (a rare path, free otherwise).
Ignored rows are not read or written by the Triton fold.

Frozen head with a gradient into ``hidden`` ("jacobian" mode): ``d logp/dh = k((1-p_y) f_y W_y - Σ_{j≠y} p_j f_j W_j)``
(``k = logit_scale/T``, ``f = 1 - tanh²`` under a softcap, else 1) is known in the forward pass. The fold overwrites
each tile with ``e^(z-m)·f`` (target column zeroed, so ``1-p_y = s_other/s`` keeps full precision for confident
tokens), which is multiplied by the weight tile into an fp32 ``[rows, H]`` accumulator: one extra GEMM per tile, and
the backward is an elementwise product with the incoming gradient (2 GEMMs in total instead of 3). The entropy gradient
``dH/dh = -k Σ p_j (z_j-μ) f_j W_j`` is accumulated the same way when asked for (``entropy_grad``; ``r`` is then the
first tile's largest logit, one more read of that tile, see ``_tile_reference``). In the per-token op, with any
entropy asked for, ``m`` and ``r`` start there instead of at the target logit, and the entropy's normalizer sums every
column in one fold (``s_all``), so a row's entropy does not depend on its target: equal rows tie, as TRL's entropy
thresholds expect (``head_loss``'s trainable path keeps the target reference: its entropy only feeds a mean metric).
Trainable head (weight or bias requires grad), per-token API: the backward recomputes each tile and accumulates
``dW`` (and ``dh``, ``db``) in fp32: 4 GEMMs in all; with ``keep_logits_mib`` large enough for the whole ``[N, V]``
logits the forward keeps them and the backward reuses them (3 GEMMs, ``N·V`` elements of memory until then).
Trainable head, ``head_loss`` (the row weights are known in the forward): row chunks that span the whole vocabulary,
as many rows as fit ``tile_mib`` (``plan_rows``); after a chunk's fold its statistics are complete, so ``dL/dz`` is
known and the gradient GEMMs follow at once: ``dh = a ⊙ (tile @ W)``, ``dW += tileᵀ @ (a ⊙ h)``, ``db += tileᵀ @ a``
with ``a_i = w_i·k/s_i`` and the target column set to ``-f_y·s_other``; 3 GEMMs, no recompute. Memory: the chunk
(``tile_mib``), ``dW`` (and ``db``) accumulated in fp32 (``4·V·H`` bytes: fp32 sums across chunks, one rounding to the
weight's dtype at the end, as one GEMM over all rows would), ``dh`` in fp32 (``4·N·H``); the backward scales them by
the loss's incoming gradient and rounds once to the parameters' dtypes.

Two backends share the loops: "torch" (any device, the reference fallback) and "triton" (CUDA; cuBLAS tiles + the
Triton fold, combine and gradient passes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from . import _checks


# Tiles beyond these sizes make cuBLAS no faster; smaller caps keep peak memory low (TRL uses 4096 x 32768).
MAX_TILE_ROWS = 4096
MAX_TILE_COLS = 32768
# Columns per Triton fold program and its warps. Another setting is measured by changing these and rerunning
# benchmarks/bench_fused_ce.py and bench_grpo_logps.py (the op's time over its GEMM floor)
FOLD_BLOCK = 4096
FOLD_WARPS = 8
_GRAD_BLOCK = 1024
# Kept logits' row stride in elements: aligned rows for any V (V = 50257 would give cuBLAS misaligned tile views)
_KEPT_ROW_ALIGN = 128
# e^(z - m) is written in the compute dtype and summed over V in fp32: a reference m no more than this many nats below
# the row's largest logit keeps both finite (fp32 and bf16 reach e^88, V·e^60·|w| stays far below; fp16 only e^11)
_OVERFLOW = {torch.float16: 8.0}
_OVERFLOW_DEFAULT = 60.0
LOSS_TYPES = ("nll", "dft")


class TokenStats(NamedTuple):
    logp: torch.Tensor  # [N] fp32, 0 on ignored rows
    entropy: torch.Tensor | None  # [N] fp32, 0 on ignored rows
    is_top1: torch.Tensor | None  # [N] bool, False on ignored rows


class HeadLoss(NamedTuple):
    loss: torch.Tensor  # 0-dim fp32, the only output with a gradient
    logp: torch.Tensor  # [N] fp32, detached
    entropy: torch.Tensor | None  # [N] fp32, detached
    is_top1: torch.Tensor | None  # [N] bool


@dataclass(frozen=True)
class OpConfig:
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    need_entropy: bool = True
    entropy_grad: bool = False
    tile_mib: int = 512
    backend: str = "torch"
    # trainable head: keep the forward's raw logits for the backward when all of [N, V] fits in this many MiB
    keep_logits_mib: int = 0
    compute_dtype: torch.dtype | None = None
    # the weight's full tensor for the backward's recompute (DeepSpeed ZeRO-3 re-gathers a partitioned head)
    weight_context: Callable[[], AbstractContextManager] | None = field(default=None, compare=False)
    need_top1: bool = False
    # whether the call builds a graph (grad mode on): autograd's needs_input_grad says True under no_grad as well
    graph: bool = True

    @property
    def k(self) -> float:
        return self.logit_scale / self.temperature

    @property
    def top1_sign(self) -> float:
        """The head output's order that the logits' argmax follows (a negative logit scale reverses it)."""
        return 1.0 if self.logit_scale > 0 else -1.0

    @property
    def overflow(self) -> float:
        return _OVERFLOW.get(self.compute_dtype, _OVERFLOW_DEFAULT)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def plan_tiles(n: int, v: int, tile_mib: int, bytes_per_elem: int) -> tuple[int, int]:
    """(rows, cols) of a logits tile whose temporaries stay within ``tile_mib``."""
    budget = max(1, tile_mib * 2**20 // bytes_per_elem)
    cols = min(v, MAX_TILE_COLS)
    rows = min(n, MAX_TILE_ROWS, max(1, budget // cols))
    if rows < 16 and budget // cols < 16:  # tiny budget: narrow the vocab tile instead of starving the GEMM of rows
        rows = min(n, 16)
        cols = max(1, min(v, budget // rows))
    return max(rows, 1), cols


def plan_rows(n: int, v: int, tile_mib: int, bytes_per_elem: int) -> int:
    """Rows of a full-vocabulary chunk (the scalar loss of a trainable head) within ``tile_mib``; at least 16 (fewer
    rows starve the GEMMs), a multiple of 64 when more fit."""
    rows = tile_mib * 2**20 // (_kept_width(v) * bytes_per_elem)
    rows = rows // 64 * 64 if rows >= 128 else rows
    return max(1, min(n, max(16, rows)))


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator without rounding the product to a 16-bit dtype first."""
    if acc.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32 (fp32 accumulation, one rounding) without a zero-filled accumulator."""
    if a.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _head_tile(tile: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``tile = h @ wᵀ (+ b)``, rounded once to the tile dtype (``nn.Linear``'s addmm)."""
    if b is None:
        torch.mm(h, w.t(), out=tile)
    else:
        torch.addmm(b, h, w.t(), out=tile)


# ------------------------------------------------------------------------------------------- per-row statistics
@dataclass
class _Stats:
    """Per-row fp32 fold state: reference ``m`` (fixed at the target logit unless a larger logit forces it up),
    ``s_other = Σ_{j≠y} e^(z_j-m)``, ``u = Σ_j e^(z_j-m)(z_j-r)`` with the fixed ``r`` (the first reference), the
    target logit ``zy``, the running top-1 key ``best`` and its index ``idx``; with an entropy asked for, ``s_all =
    Σ_j e^(z_j-m)`` over every column (target included), so the entropy never depends on which column is the target
    (see ``_tile_reference``)."""

    m: torch.Tensor
    s_other: torch.Tensor
    u: torch.Tensor
    zy: torch.Tensor
    r: torch.Tensor
    best: torch.Tensor | None
    idx: torch.Tensor | None
    s_all: torch.Tensor | None = None

    @classmethod
    def empty(cls, n: int, device: torch.device, top1: bool, entropy: bool = False) -> _Stats:
        f32 = dict(device=device, dtype=torch.float32)
        best = torch.full((n,), -math.inf, **f32) if top1 else None
        idx = torch.full((n,), -1, device=device, dtype=torch.int64) if top1 else None
        zeros = [torch.zeros(n, **f32) for _ in range(5)]
        s_all = zeros[4] if entropy else None
        return cls(zeros[0], zeros[1], zeros[2], torch.full((n,), -math.inf, **f32), zeros[3], best, idx, s_all)

    def rows(self, r0: int, r1: int) -> _Stats:
        return _Stats(*(None if t is None else t[r0:r1] for t in vars(self).values()))


def _start_rows(st: _Stats, h, weight, bias, targets, cfg: OpConfig) -> None:
    """Each row's reference before its first tile: its target logit, from one dot product per row (any value within
    ``cfg.overflow`` below the row's largest logit would do; the target's makes e_y ≈ 1). Ignored rows: 0, unused."""
    y = targets.clamp(0, weight.shape[0] - 1)  # never an out-of-range gather on CUDA
    x_y = torch.linalg.vecdot(h, weight[y].to(h.dtype)).float()  # in the tile dtype: a shift needs no precision
    if bias is not None:
        x_y += bias[y].to(h.dtype).float()
    z_y, _ = _transform(x_y, cfg)
    st.m.copy_(torch.where(targets >= 0, z_y, 0.0))
    st.r.copy_(st.m)


def _tile_reference(tile: torch.Tensor, targets: torch.Tensor, st: _Stats, cfg: OpConfig) -> None:
    """With an entropy asked for, ``m`` and ``r`` move to the first tile's largest logit (one more read of the first
    tile), for two reasons.
    - The entropy is a function of the row's logits alone: rows with the same logits and different targets must get
      the same entropy to the last bit, as the logits-based stock head gives them, because TRL thresholds entropies
      (GRPO's ``top_entropy_quantile`` keeps tokens with entropy >= a quantile, and equal rows, such as the first
      completion token of every generation of one prompt, tie there). References at the target logit make the
      rounding of ``u`` and ``s`` depend on the target, which breaks those ties and trains on other tokens.
    - The entropy gradient's operand e·(z-r)·f is rounded to the tile dtype and its GEMM result enters
      ``B - (μ - r)·C``: with r far from the softmax mean μ (the target logit of an unlikely token) that difference
      cancels the rounding's large terms badly. The first tile's largest logit sits near where the mass is."""
    key = tile.amax(1) if cfg.logit_scale > 0 else tile.amin(1)
    z, _ = _transform(key, cfg)
    valid = targets >= 0
    st.r.copy_(torch.where(valid, z, st.r))
    st.m.copy_(torch.where(valid, z, st.m))


@dataclass
class _Final:
    logp: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    log_z: torch.Tensor  # +inf on ignored rows (their recomputed p is 0)
    mu: torch.Tensor  # 0 on ignored rows
    s: torch.Tensor
    e_y: torch.Tensor


def _finish_stats(st: _Stats, targets: torch.Tensor, cfg: OpConfig) -> _Final:
    valid = targets >= 0
    e_y = torch.exp(st.zy - st.m)  # 0 for ignored rows (zy = -inf)
    s = st.s_other + e_y
    log_z = st.m + torch.log(s)
    logp = torch.where(valid, st.zy - log_z, 0.0)
    mu = torch.where(valid, st.r + st.u / s, 0.0)
    entropy = None
    if cfg.need_entropy:
        # s_all (every column in one sum) where the fold kept it: s_other + e_y rounds differently per target column
        s_ent = s if st.s_all is None else st.s_all
        entropy = torch.where(valid, (st.m + torch.log(s_ent)) - (st.r + st.u / s_ent), 0.0)
    is_top1 = valid & (st.idx == targets) if st.idx is not None else None
    return _Final(logp, entropy, is_top1, torch.where(valid, log_z, math.inf), mu, s, e_y)


# ---------------------------------------------------------------------------------------------------- torch folds
def _transform(x: torch.Tensor, cfg: OpConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z and dz/d(scaled x) factor f (None when 1) from a raw tile, in fp32."""
    y = x.float() * cfg.logit_scale
    if cfg.softcap is None:
        return y / cfg.temperature, None
    t = torch.tanh(y / cfg.softcap)
    return t * (cfg.softcap / cfg.temperature), 1 - t * t


def _top1_torch(tile: torch.Tensor, st: _Stats, c0: int, sign: float) -> None:
    """Fold the tile's first maximum of ``sign · x`` into the running top-1 (a later tile wins only if greater)."""
    key = tile.float() if sign > 0 else -tile.float()
    arg = key.argmax(1)
    val = key.gather(1, arg[:, None]).squeeze(1)
    better = val > st.best
    st.best.copy_(torch.where(better, val, st.best))
    st.idx.copy_(torch.where(better, arg + c0, st.idx))


def _fold_torch(tile, targets, c0: int, st: _Stats, cfg: OpConfig, write: bool, e2_buf, accs) -> None:
    """Fold one tile into ``st`` (in place): the reference moves up only where a logit exceeds it by more than
    ``cfg.overflow`` (then ``accs`` rows are rescaled to it); with ``write`` overwrite ``tile`` with e·f (target column
    zeroed) and fill ``e2_buf`` with e·(z-r)·f."""
    valid = targets >= 0
    local = targets - c0
    if st.best is not None:
        _top1_torch(tile, st, c0, cfg.top1_sign)
    z, f = _transform(tile, cfg)
    cols = z.shape[1]
    tmax = z.amax(1)
    m_new = torch.where(tmax > st.m + cfg.overflow, tmax, st.m)
    resc = torch.exp(st.m - m_new)
    e = torch.where(valid[:, None], torch.exp(z - m_new[:, None]), 0.0)
    in_tile = (local >= 0) & (local < cols)
    is_t = torch.arange(cols, device=z.device)[None, :] == local[:, None]
    z_t = z.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1)
    st.zy.copy_(torch.where(in_tile, z_t, st.zy))
    e_other = e.masked_fill(is_t, 0.0)
    st.s_other.mul_(resc).add_(e_other.sum(1))
    st.u.mul_(resc).add_((e * (z - st.r[:, None])).sum(1))
    if st.s_all is not None:
        st.s_all.mul_(resc).add_(e.sum(1))
    st.m.copy_(m_new)
    for acc in accs:
        acc.mul_(resc[:, None])
    if not write:
        return
    if e2_buf is not None:
        zr = (z - st.r[:, None]) * e
        e2_buf.copy_(zr if f is None else zr * f)
    tile.copy_(e_other if f is None else e_other * f)


def _grad_tile_torch(tile, local, log_z, mu, g_logp, g_ent, cfg: OpConfig) -> None:
    """Overwrite ``tile`` with dL/d(h·Wᵀ) for the recompute backward."""
    z, f = _transform(tile, cfg)
    p = torch.exp(z - log_z[:, None])
    grad = torch.zeros_like(z)
    if g_logp is not None:
        is_t = torch.arange(z.shape[1], device=z.device)[None, :] == local[:, None]
        grad += g_logp[:, None] * (is_t.float() - p)
    if g_ent is not None:
        grad -= g_ent[:, None] * p * (z - mu[:, None])
    grad *= cfg.k
    if f is not None:
        grad *= f
    tile.copy_(grad)


# --------------------------------------------------------------------------------------------------- triton folds
def _kernels():
    """The Triton kernels, imported on first use (import stays cheap; TRITON_INTERPRET is read then)."""
    from . import _triton

    return _triton.fold_kernel, _triton.combine_kernel, _triton.grad_kernel


def _cap_args(cfg: OpConfig) -> dict:
    return dict(
        scale=float(cfg.logit_scale),
        cap=float(cfg.softcap or 1.0),
        inv_t=1.0 / float(cfg.temperature),
        HAS_CAP=cfg.softcap is not None,
    )


def _fold_triton(tile, targets, c0: int, st: _Stats, cfg: OpConfig, write: bool, e2_buf, accs) -> None:
    fold_kernel, combine_kernel, _ = _kernels()
    n, cols = tile.shape
    nb = -(-cols // FOLD_BLOCK)
    # per (row, block): m, s_other, u, top-1 key, s_all (only with an entropy asked for)
    has_sa = st.s_all is not None
    part = torch.empty((5 if has_sa else 4, n * nb), device=tile.device, dtype=torch.float32)
    psa = part[4] if has_sa else part[1]
    top1 = st.best is not None
    pidx = torch.empty(n * nb, device=tile.device, dtype=torch.int32) if top1 else part[0]
    e2 = tile if e2_buf is None else e2_buf
    assert e2.stride(0) == tile.stride(0)
    flags = dict(WRITE=write, HAS_E2=e2_buf is not None, HAS_TOP1=top1, HAS_SA=has_sa)
    fold_kernel[(n, nb)](
        tile, tile.stride(0), e2, targets, c0, st.m, st.r, st.zy, *part[:4], psa, pidx, nb, cols, cfg.top1_sign,
        cfg.overflow, **_cap_args(cfg), **flags, BLOCK=FOLD_BLOCK, num_warps=FOLD_WARPS,
    )  # fmt: skip
    acc, acc_e = (*accs, None, None)[:2]
    combine_kernel[(n,)](
        tile, tile.stride(0), e2, targets, c0, st.m, st.s_other, st.u, st.best if top1 else st.m,
        st.idx if top1 else st.m, st.s_all if has_sa else st.m, *part[:4], psa, pidx,
        st.m if acc is None else acc, st.m if acc_e is None else acc_e,
        0 if acc is None else acc.stride(0), 0 if acc is None else acc.shape[1], nb, cols, **flags,
        HAS_ACC=acc is not None, HAS_ACC_E=acc_e is not None, NB=max(16, triton_next_pow2(nb)), BLOCK=FOLD_BLOCK,
    )  # fmt: skip


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _grad_tile_triton(tile, local, log_z, mu, g_logp, g_ent, cfg: OpConfig) -> None:
    _, _, grad_kernel = _kernels()
    n, cols = tile.shape
    dummy = log_z
    grad_kernel[(n, math.ceil(cols / _GRAD_BLOCK))](
        tile, tile.stride(0), local, log_z, mu, dummy if g_logp is None else g_logp,
        dummy if g_ent is None else g_ent, cols, HAS_GL=g_logp is not None, HAS_GE=g_ent is not None,
        BLOCK=_GRAD_BLOCK, **_cap_args(cfg),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------ the loop
def _compute_dtype(hidden: torch.Tensor, cfg: OpConfig) -> torch.dtype:
    if cfg.compute_dtype is not None:
        return cfg.compute_dtype
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def _tile_bytes(cfg: OpConfig, dtype: torch.dtype, jacobian: bool) -> int:
    size = dtype.itemsize
    if cfg.backend == "triton":  # the fold works in place; the entropy operand needs a second tile
        return size + (_e2_dtype(dtype).itemsize if jacobian and cfg.entropy_grad else 0)
    return size + 6 * 4  # the torch fold keeps a handful of fp32 temporaries per element


def _e2_dtype(dtype: torch.dtype) -> torch.dtype:
    """The entropy operand e·(z-r)·f reaches e^overflow times the logits' span: past fp16's 65504, so fp32 there."""
    return torch.float32 if dtype == torch.float16 else dtype


def _kept_width(vocab: int) -> int:
    return -(-vocab // _KEPT_ROW_ALIGN) * _KEPT_ROW_ALIGN


def _keeps_logits(n_rows: int, vocab: int, dtype: torch.dtype, keep_logits_mib: int) -> bool:
    """Whether the whole ``[n_rows, vocab]`` logits in ``dtype`` fit the keep budget (0 MiB: never)."""
    return keep_logits_mib > 0 and n_rows * _kept_width(vocab) * dtype.itemsize <= keep_logits_mib * 2**20


def _logits_tile(buf, kept, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Where tile [r0:r1, c0:c1] lives: a view of the kept logits (row stride V), else of the reused buffer."""
    if kept is not None:
        return kept[r0:r1, c0:c1]
    return buf[: r1 - r0, : c1 - c0]


def _fold_fn(cfg: OpConfig) -> Callable:
    return _fold_triton if cfg.backend == "triton" else _fold_torch


@dataclass
class _Forward:
    final: _Final
    jac_logp: torch.Tensor | None
    jac_ent: torch.Tensor | None
    kept: torch.Tensor | None  # the raw logits [N, V] for the backward (trainable head within the keep budget)


def _forward(hidden, weight, bias, targets, cfg: OpConfig, jacobian: bool, keep: bool = False) -> _Forward:
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    dtype = _compute_dtype(hidden, cfg)
    rows, cols = plan_tiles(n_rows, vocab, cfg.tile_mib, _tile_bytes(cfg, dtype, jacobian))
    fold = _fold_fn(cfg)
    st = _Stats.empty(n_rows, dev, cfg.need_top1, entropy=cfg.need_entropy)
    jac_logp = torch.zeros((n_rows, width), device=dev, dtype=torch.float32) if jacobian else None
    jac_ent = torch.zeros((n_rows, width), device=dev, dtype=torch.float32) if jacobian and cfg.entropy_grad else None
    # kept: the stats fold only reads its tile, so the GEMM writes straight into the tensor the backward reuses
    kept = torch.empty((n_rows, _kept_width(vocab)), device=dev, dtype=dtype)[:, :vocab] if keep else None
    buf = None if keep else torch.empty((min(rows, n_rows), cols), device=dev, dtype=dtype)
    # zeros: the Triton fold never writes an ignored row, which must still be finite for the GEMM
    e2_full = torch.zeros(buf.shape, device=dev, dtype=_e2_dtype(dtype)) if jac_ent is not None else None
    for r0 in range(0, n_rows, rows):
        r1 = min(r0 + rows, n_rows)
        h = hidden[r0:r1].to(dtype)
        tg = targets[r0:r1]
        st_rows = st.rows(r0, r1)
        _start_rows(st_rows, h, weight, bias, tg, cfg)
        accs = tuple(a[r0:r1] for a in (jac_logp, jac_ent) if a is not None)
        for c0 in range(0, vocab, cols):
            c1 = min(c0 + cols, vocab)
            w = weight[c0:c1].to(dtype)
            tile = _logits_tile(buf, kept, r0, r1, c0, c1)
            _head_tile(tile, h, w, None if bias is None else bias[c0:c1].to(dtype))
            e2 = None if e2_full is None else e2_full[: r1 - r0, : c1 - c0]
            if c0 == 0 and (cfg.need_entropy or e2 is not None):
                _tile_reference(tile, tg, st_rows, cfg)
            fold(tile, tg, c0, st_rows, cfg, jacobian, e2, accs if c0 > 0 else ())  # nothing to rescale yet at c0 0
            if jacobian:
                _addmm_fp32(accs[0], tile, w)
                if e2 is not None:
                    _addmm_fp32(accs[1], e2, w)
    final = _finish_stats(st, targets, cfg)
    if jacobian:
        _finish_jacobians(jac_logp, jac_ent, weight, targets, st, final, cfg, dtype)
    return _Forward(final, jac_logp, jac_ent, kept)


def _target_factor(zy: torch.Tensor, cfg: OpConfig) -> torch.Tensor:
    """f at the target (1 without a softcap; 1 - tanh², tanh = z·T/cap); 1 on ignored rows (zy = -inf)."""
    if cfg.softcap is None:
        return torch.ones_like(zy)
    return 1 - (torch.nan_to_num(zy, neginf=0.0) * (cfg.temperature / cfg.softcap)) ** 2


def _finish_jacobians(jac_logp, jac_ent, weight, targets, st: _Stats, final: _Final, cfg, dtype) -> None:
    """Turn the accumulators into d logp/dh and d H/dh in place (0 on ignored rows)."""
    valid = targets >= 0
    w_y = weight[targets.clamp(0, weight.shape[0] - 1)].to(dtype).float()  # never an out-of-range gather on CUDA
    f_y = _target_factor(st.zy, cfg)
    inv_s = torch.where(valid, 1 / final.s, 0.0)
    if jac_ent is not None:
        # C = Σ_j e_j f_j W_j including the target; dH/dh = -k/s (B - (μ - r) C)
        c = jac_logp + (final.e_y * f_y)[:, None] * w_y
        jac_ent.sub_((final.mu - st.r)[:, None] * c).mul_((-cfg.k * inv_s)[:, None])
    coef_y = torch.where(valid, st.s_other * inv_s * f_y, 0.0) * cfg.k
    jac_logp.mul_((-cfg.k * inv_s)[:, None]).addcmul_(coef_y[:, None], w_y)


def _backward_recompute(
    hidden, weight, bias, targets, log_z, mu, g_logp, g_ent, cfg: OpConfig, need, kept=None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dh, dW, db (those ``need`` asks for) from each logits tile: ``kept`` (the forward's logits, overwritten with
    dL/dz) or recomputed."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    dtype = cfg.compute_dtype
    rows, cols = plan_tiles(n_rows, vocab, cfg.tile_mib, _tile_bytes(cfg, dtype, False))
    grad_tile = _grad_tile_triton if cfg.backend == "triton" else _grad_tile_torch
    valid = targets >= 0
    g_logp = None if g_logp is None else torch.where(valid, g_logp.float(), 0.0).contiguous()
    g_ent = None if g_ent is None else torch.where(valid, g_ent.float(), 0.0).contiguous()
    need_h, need_w, need_b = need
    f32 = dict(device=hidden.device, dtype=torch.float32)
    grad_h = torch.zeros((n_rows, width), **f32) if need_h else None
    grad_w = torch.zeros(weight.shape, **f32) if need_w else None
    grad_b = torch.zeros(vocab, **f32) if need_b else None
    buf = None if kept is not None else torch.empty((min(rows, n_rows), cols), device=hidden.device, dtype=dtype)
    for r0 in range(0, n_rows, rows):
        r1 = min(r0 + rows, n_rows)
        h = hidden[r0:r1].to(dtype)
        gl = None if g_logp is None else g_logp[r0:r1]
        ge = None if g_ent is None else g_ent[r0:r1]
        for c0 in range(0, vocab, cols):
            c1 = min(c0 + cols, vocab)
            w = weight[c0:c1].to(dtype)
            tile = _logits_tile(buf, kept, r0, r1, c0, c1)
            if kept is None:
                _head_tile(tile, h, w, None if bias is None else bias[c0:c1].to(dtype))
            grad_tile(tile, targets[r0:r1] - c0, log_z[r0:r1], mu[r0:r1], gl, ge, cfg)
            if grad_h is not None:
                _addmm_fp32(grad_h[r0:r1], tile, w)
            if grad_w is not None:
                _addmm_fp32(grad_w[c0:c1], tile.t(), h)
            if grad_b is not None:
                grad_b[c0:c1] += tile.sum(0, dtype=torch.float32)
    return grad_h, grad_w, grad_b


class LogpEntropyFunction(torch.autograd.Function):
    """See the module docstring. Inputs: hidden [N, H], weight [V, H], bias [V] or None, targets [N] (< 0: ignored,
    logp 0). Outputs: logp, entropy (or None), is_top1 (or None, not differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, cfg: OpConfig):
        ctx.set_materialize_grads(False)
        need_h, need_w, need_b = (cfg.graph and need for need in ctx.needs_input_grad[:3])
        trainable = need_w or need_b
        jacobian = need_h and not trainable
        keep = trainable and _keeps_logits(hidden.shape[0], weight.shape[0], cfg.compute_dtype, cfg.keep_logits_mib)
        with torch.autocast(hidden.device.type, enabled=False):
            out = _forward(hidden, weight, bias, targets, cfg, jacobian, keep)
        ctx.cfg = cfg
        ctx.jacobian = jacobian
        # not saved for backward: the first backward consumes it in place and drops it (a second one recomputes)
        ctx.kept_logits = out.kept
        if need_h or trainable:
            saved = [hidden, weight, bias, targets, out.final.log_z, out.final.mu]
            if jacobian:
                saved.append(out.jac_logp)
                if out.jac_ent is not None:
                    saved.append(out.jac_ent)
            ctx.save_for_backward(*saved)
        if out.final.is_top1 is not None:
            ctx.mark_non_differentiable(out.final.is_top1)
        return out.final.logp, out.final.entropy, out.final.is_top1

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_top1):
        kept, ctx.kept_logits = ctx.kept_logits, None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        hidden, weight, bias, targets, log_z, mu, *jacs = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if ctx.jacobian and (g_ent is None or len(jacs) == 2):
            if g_ent is None:  # one pass: scale in fp32, round once to hidden's dtype
                return _scaled(jacs[0], g_logp.float()[:, None], hidden.dtype), None, None, None, None
            grad = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
            if g_logp is not None:
                grad.addcmul_(g_logp.float()[:, None], jacs[0])
            grad.addcmul_(g_ent.float()[:, None], jacs[1])
            return grad.to(hidden.dtype), None, None, None, None
        # Trainable head, or an entropy gradient that the forward was not asked to prepare: recompute the tiles
        gather = ctx.cfg.weight_context
        with torch.autocast(hidden.device.type, enabled=False), gather() if gather else nullcontext():
            weight = ctx.saved_tensors[1]  # again, inside the gather: a released ZeRO-3 weight is empty outside it
            grads = _backward_recompute(
                hidden, weight, bias, targets, log_z, mu, g_logp, g_ent, ctx.cfg, need, kept=kept
            )
        del kept  # overwritten with dL/dz: its memory returns before the casts below
        grad_h, grad_w, grad_b = grads
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
        )


# -------------------------------------------------------------------------------- scalar loss, trainable head
@dataclass
class _LossForward:
    final: _Final
    loss: torch.Tensor
    grad_h: torch.Tensor | None  # fp32 [N, H]
    grad_w: torch.Tensor | None  # fp32 [V, H] (a view when the bias gradient shares its buffer)
    grad_b: torch.Tensor | None  # fp32 [V]


def _row_weights(final: _Final, targets, loss_scale: torch.Tensor, dft: bool) -> torch.Tensor:
    """w_i of ``loss = Σ w_i·(-logp_i)``: loss_scale (nll) or loss_scale·p_i as a constant (dft); 0 if ignored."""
    w = torch.where(targets >= 0, loss_scale, 0.0)
    return w * final.logp.exp() if dft else w


def _loss_forward(hidden, weight, bias, targets, loss_scale, cfg: OpConfig, dft: bool, need) -> _LossForward:
    """The loss and its gradients in one pass over row chunks that span the whole vocabulary: each chunk's statistics
    are complete after its fold, so dL/dz is known there and the two gradient GEMMs follow at once (3 GEMMs, no
    recompute). The fold writes e^(z-m)·f (target column zeroed); the target column then gets -f_y·s_other (so
    1-p_y keeps its precision) and the row factor a_i = w_i·k/s_i goes onto the GEMMs' small operands:
    dh = a ⊙ (tile @ W), dW = tileᵀ @ (a ⊙ h), db = tileᵀ @ a (one extra column of the dW GEMM)."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    dtype = cfg.compute_dtype
    need_h, need_w, need_b = need
    rows = plan_rows(n_rows, vocab, cfg.tile_mib, _tile_bytes(cfg, dtype, True))
    fold = _fold_fn(cfg)
    st = _Stats.empty(n_rows, dev, cfg.need_top1)
    buf = torch.empty((rows, _kept_width(vocab)), device=dev, dtype=dtype)[:, :vocab]
    w_c = weight.to(dtype)  # once, not per chunk (a copy only for fp32 master weights under autocast)
    b_c = None if bias is None else bias.to(dtype)
    grad_h = torch.empty((n_rows, width), device=dev, dtype=torch.float32) if need_h else None
    aug_width = (width if need_w else 0) + (8 if need_b else 0)  # the bias column padded to 16-byte rows
    grad_wb = None
    for r0 in range(0, n_rows, rows):
        r1 = min(r0 + rows, n_rows)
        h = hidden[r0:r1].to(dtype)
        tg = targets[r0:r1]
        valid = tg >= 0
        st_rows = st.rows(r0, r1)
        _start_rows(st_rows, h, weight, bias, tg, cfg)
        tile = buf[: r1 - r0]
        _head_tile(tile, h, w_c, b_c)
        fold(tile, tg, 0, st_rows, cfg, True, None, ())
        final = _finish_stats(st_rows, tg, cfg)
        a = torch.where(valid, _row_weights(final, tg, loss_scale, dft) * cfg.k / final.s, 0.0)
        target_value = torch.where(valid, -_target_factor(st_rows.zy, cfg) * st_rows.s_other, 0.0)
        tile.scatter_(1, tg.clamp(0, vocab - 1)[:, None], target_value.to(dtype)[:, None])
        if need_h:
            torch.mul(_mm_fp32(tile, w_c), a[:, None], out=grad_h[r0:r1])
        if aug_width:
            aug = torch.zeros((r1 - r0, aug_width), device=dev, dtype=dtype)
            if need_w:
                torch.mul(h, a[:, None], out=aug[:, :width])
            if need_b:
                aug[:, aug_width - 8] = a
            if grad_wb is None:  # the first chunk writes the fp32 accumulator (no zero-fill pass)
                grad_wb = _mm_fp32(tile.t(), aug)
            else:
                _addmm_fp32(grad_wb, tile.t(), aug)
    final = _finish_stats(st, targets, cfg)
    loss = -(_row_weights(final, targets, loss_scale, dft) * final.logp).sum()
    grad_w = grad_wb[:, :width] if need_w else None
    grad_b = grad_wb[:, aug_width - 8].contiguous() if need_b else None
    return _LossForward(final, loss, grad_h, grad_w, grad_b)


class HeadLossFunction(torch.autograd.Function):
    """``head_loss`` of a trainable head (module docstring): the gradients are computed in the forward and scaled by
    the loss's incoming gradient in the backward. Inputs: hidden, weight, bias or None, targets, loss_scale (0-dim
    fp32 tensor), cfg, dft. Outputs: loss, logp, entropy (or None), is_top1 (or None); only the loss differentiates."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, loss_scale, cfg: OpConfig, dft: bool):
        ctx.set_materialize_grads(False)
        need = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            out = _loss_forward(hidden, weight, bias, targets, loss_scale, cfg, dft, need)
        # held on ctx until the graph goes: a retained graph's second backward scales them again
        ctx.grads = (out.grad_h, out.grad_w, out.grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        outputs = (out.final.logp, out.final.entropy, out.final.is_top1)
        ctx.mark_non_differentiable(*(t for t in outputs if t is not None))
        return (out.loss, *outputs)

    @staticmethod
    def backward(ctx, g_loss, *_):
        if g_loss is None:
            return (None,) * 7
        grads = (_scaled(grad, g_loss.float(), dtype) for grad, dtype in zip(ctx.grads, ctx.dtypes))
        return (*grads, None, None, None, None)


def _scaled(grad: torch.Tensor | None, g: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``grad · g`` in fp32, rounded once to the parameter's ``dtype`` (one pass)."""
    if grad is None:
        return None
    return torch.mul(grad, g, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def _config(hidden, weight, bias, targets, backend, weight_context, keep_logits_mib, **options) -> OpConfig:
    """The checked ``OpConfig`` of one call (raises before any launch)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if options["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0, got {options['temperature']}")
    if options["logit_scale"] == 0:
        raise ValueError("logit_scale must be nonzero")
    backend = backend or default_backend(hidden.device)
    graph = torch.is_grad_enabled()
    trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
    keep_mib = keep_logits_mib if graph and trainable else 0
    cfg = OpConfig(backend=backend, keep_logits_mib=keep_mib, graph=graph, **options)
    cfg = replace(cfg, compute_dtype=_compute_dtype(hidden, cfg), weight_context=weight_context)
    _checks.check_inputs(hidden, weight, targets, backend, cfg.compute_dtype, bias, FOLD_BLOCK)  # before any launch
    return cfg


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    need_entropy: bool = True,
    need_top1: bool = False,
    entropy_grad: bool = False,
    tile_mib: int = 512,
    backend: str | None = None,
    keep_logits_mib: int = 0,
    weight_context: Callable[[], AbstractContextManager] | None = None,
) -> TokenStats:
    """Per-token fp32 log p(target), entropy and top-1 flag of ``softcap(logit_scale·(h·Wᵀ + b))/T`` (module
    docstring); targets < 0 give 0, 0, False.

    ``entropy_grad`` prepares the entropy gradient in the forward pass (frozen head); without it an entropy gradient
    still works, through a slower recompute. ``backend``: "torch", "triton" or None (triton on CUDA).
    ``weight_context``: entered around the backward's use of ``weight`` (to gather a partitioned one).
    ``keep_logits_mib``: trainable head only; when the ``[N, V]`` logits in the compute dtype fit in this many MiB the
    forward keeps them and the first backward reuses them instead of recomputing (one GEMM fewer).
    """
    cfg = _config(
        hidden, weight, bias, targets, backend, weight_context, keep_logits_mib, temperature=temperature,
        logit_scale=logit_scale, softcap=softcap, need_entropy=need_entropy, need_top1=need_top1,
        entropy_grad=entropy_grad, tile_mib=tile_mib,
    )  # fmt: skip
    return TokenStats(*LogpEntropyFunction.apply(hidden, weight, bias, targets.contiguous(), cfg))


def logp_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, **options
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_stats`` without the top-1 flag: (logp, entropy or None); the same keyword options."""
    stats = token_stats(hidden, weight, targets, **{**options, "need_top1": False})
    return stats.logp, stats.entropy


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    loss_type: str = "nll",
    loss_scale: float | torch.Tensor = 1.0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    need_entropy: bool = True,
    need_top1: bool = True,
    tile_mib: int = 1024,
    backend: str | None = None,
    weight_context: Callable[[], AbstractContextManager] | None = None,
) -> HeadLoss:
    """``loss = Σ_i w_i·(-logp_i)``, ``w_i = loss_scale`` ("nll") or ``loss_scale·p_i`` with ``p_i`` a constant
    ("dft"), and the detached per-token ``logp``, ``entropy``, ``is_top1`` (module docstring).

    A trainable head (weight or bias requires grad, grad mode on) takes the scalar-loss path: row chunks of the whole
    vocabulary within ``tile_mib``, the gradients computed in the forward (3 GEMMs). Otherwise the per-token op
    (frozen head: ``d logp/dh`` prepared in the forward, 2 GEMMs) and the weighted sum on top. ``weight_context``
    serves the frozen path's entropy-free backward only (the scalar path never reads the weight in its backward).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    cfg = _config(
        hidden, weight, bias, targets, backend, weight_context, 0, temperature=temperature, logit_scale=logit_scale,
        softcap=softcap, need_entropy=need_entropy, need_top1=need_top1, tile_mib=tile_mib,
    )  # fmt: skip
    scale = torch.as_tensor(loss_scale, dtype=torch.float32, device=hidden.device)
    dft = loss_type == "dft"
    targets = targets.contiguous()
    trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
    if cfg.graph and trainable:
        loss, logp, entropy, is_top1 = HeadLossFunction.apply(hidden, weight, bias, targets, scale, cfg, dft)
        return HeadLoss(loss, logp, entropy, is_top1)
    stats = LogpEntropyFunction.apply(hidden, weight, bias, targets, cfg)
    logp = stats[0]
    weights = torch.where(targets >= 0, scale, 0.0)
    if dft:
        weights = weights * logp.detach().exp()
    loss = -(logp * weights).sum()
    entropy = None if stats[1] is None else stats[1].detach()
    return HeadLoss(loss, logp.detach(), entropy, stats[2])

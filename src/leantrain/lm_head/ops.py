"""Fused per-token log-probabilities, entropies, top-1 flags and losses of an LM head without the ``[N, V]`` logits.

API (every function takes hidden ``[N, H]``, weight ``[V, H]``, integer targets ``[N]``; targets < 0 are ignored rows:
their logp and entropy are 0, ``is_top1`` False, and no gradient flows from them):

- ``token_stats(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
  need_entropy=True, need_top1=False, entropy_grad=False, tile_mib=512, backend=None, keep_logits_mib=0,
  weight_context=None) -> TokenStats(logp, entropy, is_top1)``: fp32 ``logp`` [N] (differentiable into hidden, weight
  and bias), fp32 ``entropy`` [N] or None, bool ``is_top1`` [N] or None (not differentiable).
- ``head_loss(hidden, weight, targets, *, bias=None, loss_type="nll", loss_scale=1.0, <the same head and tile
  options>) -> HeadLoss(loss, logp, entropy, is_top1)``: the scalar ``loss = Σ_i w_i · (-logp_i)`` with
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

Rows are streamed through bounded ``[rows, cols]`` tiles; each tile is folded into per-row online statistics in fp32
(running max ``m``, ``s_other = Σ_{j≠y} e^(z_j-m)``, ``u = Σ_j e^(z_j-m)(z_j-r)`` with a fixed per-row reference
``r``, the target logit ``z_y``, the running top-1 value and index).

Frozen head with a gradient into ``hidden`` ("jacobian" mode): ``d logp/dh = k((1-p_y) f_y W_y - Σ_{j≠y} p_j f_j W_j)``
(``k = logit_scale/T``, ``f = 1 - tanh²`` under a softcap, else 1) is known in the forward pass. Each tile's
``e^(z-m)·f`` (target column zeroed, so ``1-p_y = s_other/s`` keeps full precision for confident tokens) is multiplied
by the weight tile into an fp32 ``[rows, H]`` accumulator: one extra GEMM per tile, and the backward is an elementwise
product with the incoming gradient (2 GEMMs in total instead of 3). The entropy gradient
``dH/dh = -k Σ p_j (z_j-μ) f_j W_j`` is accumulated the same way when asked for (``entropy_grad``).
Trainable head (weight or bias requires grad): the backward recomputes each tile and accumulates ``dW`` (and ``dh``,
``db``) in fp32: 4 GEMMs in all. With ``keep_logits_mib`` large enough for the whole ``[N, V]`` logits in the compute
dtype, the forward writes its tiles into one kept tensor instead and the backward reuses them (3 GEMMs, ``N·V``
elements of memory until then).

Two backends share the loop: "torch" (any device, the reference fallback) and "triton" (CUDA; cuBLAS tile + one Triton
pass per tile that folds statistics and writes the GEMM operand in place).
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
_BLOCK = 1024
# Kept logits' row stride in elements: aligned rows for any V (V = 50257 would give cuBLAS misaligned tile views)
_KEPT_ROW_ALIGN = 128
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

    @property
    def k(self) -> float:
        return self.logit_scale / self.temperature

    @property
    def top1_sign(self) -> float:
        """The head output's order that the logits' argmax follows (a negative logit scale reverses it)."""
        return 1.0 if self.logit_scale > 0 else -1.0


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


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator without rounding the product to a 16-bit dtype first."""
    if acc.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _head_tile(tile: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``tile = h @ wᵀ (+ b)``, rounded once to the tile dtype (``nn.Linear``'s addmm)."""
    if b is None:
        torch.mm(h, w.t(), out=tile)
    else:
        torch.addmm(b, h, w.t(), out=tile)


# ------------------------------------------------------------------------------------------- per-row statistics
@dataclass
class _Stats:
    """Per-row fp32 fold state (see the module docstring); ``best``/``idx``: running top-1 key and index."""

    m: torch.Tensor
    s_other: torch.Tensor
    u: torch.Tensor
    zy: torch.Tensor
    r: torch.Tensor
    best: torch.Tensor | None
    idx: torch.Tensor | None

    @classmethod
    def empty(cls, n: int, device: torch.device, top1: bool) -> _Stats:
        f32 = dict(device=device, dtype=torch.float32)
        best = torch.full((n,), -math.inf, **f32) if top1 else None
        idx = torch.full((n,), -1, device=device, dtype=torch.int64) if top1 else None
        full = [torch.full((n,), -math.inf, **f32) for _ in range(3)]
        return cls(full[0], torch.zeros(n, **f32), torch.zeros(n, **f32), full[1], full[2], best, idx)

    def rows(self, r0: int, r1: int) -> _Stats:
        return _Stats(*(None if t is None else t[r0:r1] for t in vars(self).values()))


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


def _fold_torch(tile, local, st: _Stats, cfg: OpConfig, jacobian: bool, e2_buf, c0: int) -> torch.Tensor | None:
    """Fold one tile into the statistics ``st`` (in place); in jacobian mode overwrite ``tile`` with e·f (target
    column zeroed), fill ``e2_buf`` with e·(z-r)·f and return the per-row rescale factor."""
    if st.best is not None:
        _top1_torch(tile, st, c0, cfg.top1_sign)
    z, f = _transform(tile, cfg)
    cols = z.shape[1]
    m_new = torch.maximum(st.m, z.amax(1))
    resc = torch.exp(st.m - m_new)
    st.r.copy_(torch.where(torch.isinf(st.r), m_new, st.r))
    e = torch.exp(z - m_new[:, None])
    in_tile = (local >= 0) & (local < cols)
    is_t = torch.arange(cols, device=z.device)[None, :] == local[:, None]
    z_t = z.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1)
    st.zy.copy_(torch.where(in_tile, z_t, st.zy))
    e_other = e.masked_fill(is_t, 0.0)
    st.s_other.mul_(resc).add_(e_other.sum(1))
    st.u.mul_(resc).add_((e * (z - st.r[:, None])).sum(1))
    st.m.copy_(m_new)
    if not jacobian:
        return None
    ef = e_other if f is None else e_other * f
    if e2_buf is not None:
        zr = (z - st.r[:, None]) * e
        e2_buf.copy_(zr if f is None else zr * f)
    tile.copy_(ef)
    return resc


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

    return _triton.stats_kernel, _triton.jacobian_kernel, _triton.grad_kernel


def _cap_args(cfg: OpConfig) -> dict:
    return dict(
        scale=float(cfg.logit_scale),
        cap=float(cfg.softcap or 1.0),
        inv_t=1.0 / float(cfg.temperature),
        HAS_CAP=cfg.softcap is not None,
    )


def _top1_args(st: _Stats, c0: int, cfg: OpConfig) -> dict:
    has = st.best is not None
    return dict(
        best_ptr=st.best if has else st.m, idx_ptr=st.idx if has else st.m, col0=c0, sign=cfg.top1_sign, HAS_TOP1=has
    )


def _fold_triton(tile, local, st: _Stats, cfg: OpConfig, jacobian: bool, e2_buf, c0: int) -> torch.Tensor | None:
    stats_kernel, jacobian_kernel, _ = _kernels()
    n, cols = tile.shape
    stats = (st.m, st.s_other, st.u, st.zy, st.r)
    if not jacobian:
        stats_kernel[(n,)](
            tile, tile.stride(0), local, *stats, cols, BLOCK=_BLOCK, **_top1_args(st, c0, cfg), **_cap_args(cfg)
        )
        return None
    resc = torch.empty_like(st.m)
    e2 = e2_buf if e2_buf is not None else tile
    if e2_buf is not None:
        assert e2_buf.stride(0) == tile.stride(0)
    jacobian_kernel[(n,)](
        tile, tile.stride(0), e2, local, *stats, resc, cols,
        HAS_E2=e2_buf is not None, BLOCK=_BLOCK, **_top1_args(st, c0, cfg), **_cap_args(cfg),
    )  # fmt: skip
    return resc


def _grad_tile_triton(tile, local, log_z, mu, g_logp, g_ent, cfg: OpConfig) -> None:
    _, _, grad_kernel = _kernels()
    n, cols = tile.shape
    dummy = log_z
    grad_kernel[(n, math.ceil(cols / _BLOCK))](
        tile, tile.stride(0), local, log_z, mu, dummy if g_logp is None else g_logp,
        dummy if g_ent is None else g_ent, cols, HAS_GL=g_logp is not None, HAS_GE=g_ent is not None,
        BLOCK=_BLOCK, **_cap_args(cfg),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------ the loop
def _compute_dtype(hidden: torch.Tensor, cfg: OpConfig) -> torch.dtype:
    if cfg.compute_dtype is not None:
        return cfg.compute_dtype
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def _tile_bytes(cfg: OpConfig, dtype: torch.dtype, jacobian: bool) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    if cfg.backend == "triton":  # the fold works in place; the entropy operand needs a second tile
        return size * (2 if jacobian and cfg.entropy_grad else 1)
    return size + 6 * 4  # the torch fold keeps a handful of fp32 temporaries per element


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


@dataclass
class _Forward:
    logp: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    log_z: torch.Tensor
    mu: torch.Tensor
    jac_logp: torch.Tensor | None
    jac_ent: torch.Tensor | None
    kept: torch.Tensor | None  # the raw logits [N, V] for the backward (trainable head within the keep budget)


def _forward(hidden, weight, bias, targets, cfg: OpConfig, jacobian: bool, keep: bool = False) -> _Forward:
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    dtype = _compute_dtype(hidden, cfg)
    rows, cols = plan_tiles(n_rows, vocab, cfg.tile_mib, _tile_bytes(cfg, dtype, jacobian))
    fold = _fold_triton if cfg.backend == "triton" else _fold_torch
    st = _Stats.empty(n_rows, dev, cfg.need_top1)
    jac_logp = torch.zeros((n_rows, width), device=dev, dtype=torch.float32) if jacobian else None
    jac_ent = torch.zeros((n_rows, width), device=dev, dtype=torch.float32) if jacobian and cfg.entropy_grad else None
    # kept: the stats fold only reads its tile, so the GEMM writes straight into the tensor the backward reuses
    kept = torch.empty((n_rows, _kept_width(vocab)), device=dev, dtype=dtype)[:, :vocab] if keep else None
    buf = None if keep else torch.empty((min(rows, n_rows), cols), device=dev, dtype=dtype)
    e2_full = torch.empty_like(buf) if jac_ent is not None else None
    for r0 in range(0, n_rows, rows):
        r1 = min(r0 + rows, n_rows)
        h = hidden[r0:r1].to(dtype)
        st_rows = st.rows(r0, r1)
        for c0 in range(0, vocab, cols):
            c1 = min(c0 + cols, vocab)
            w = weight[c0:c1].to(dtype)
            tile = _logits_tile(buf, kept, r0, r1, c0, c1)
            _head_tile(tile, h, w, None if bias is None else bias[c0:c1].to(dtype))
            e2 = None if e2_full is None else e2_full[: r1 - r0, : c1 - c0]
            resc = fold(tile, targets[r0:r1] - c0, st_rows, cfg, jacobian, e2, c0)
            if jacobian:
                acc = jac_logp[r0:r1]
                acc.mul_(resc[:, None])
                _addmm_fp32(acc, tile, w)
                if e2 is not None:
                    acc_e = jac_ent[r0:r1]
                    acc_e.mul_(resc[:, None])
                    _addmm_fp32(acc_e, e2, w)
    valid = targets >= 0
    e_y = torch.exp(st.zy - st.m)  # 0 for ignored rows (zy = -inf)
    s = st.s_other + e_y
    log_z = st.m + torch.log(s)
    logp = torch.where(valid, st.zy - log_z, 0.0)
    mu = st.r + st.u / s
    entropy = torch.where(valid, log_z - mu, 0.0) if cfg.need_entropy else None
    is_top1 = valid & (st.idx == targets) if cfg.need_top1 else None
    if jacobian:
        _finish_jacobians(jac_logp, jac_ent, weight, targets, valid, st, s, e_y, mu, cfg, dtype)
    return _Forward(logp, entropy, is_top1, log_z, mu, jac_logp, jac_ent, kept)


def _finish_jacobians(jac_logp, jac_ent, weight, targets, valid, st: _Stats, s, e_y, mu, cfg, dtype) -> None:
    """Turn the accumulators into d logp/dh and d H/dh in place (0 on ignored rows)."""
    w_y = weight[targets.clamp(0, weight.shape[0] - 1)].to(dtype).float()  # never an out-of-range gather on CUDA
    f_y = torch.ones_like(st.zy)
    if cfg.softcap is not None:  # f = 1 - tanh², tanh = z·T/cap
        f_y = 1 - (torch.nan_to_num(st.zy, neginf=0.0) * (cfg.temperature / cfg.softcap)) ** 2
    inv_s = torch.where(valid, 1 / s, 0.0)
    if jac_ent is not None:
        # C = Σ_j e_j f_j W_j including the target; dH/dh = -k/s (B - (μ - r) C)
        c = jac_logp + (e_y * f_y)[:, None] * w_y
        jac_ent.sub_((mu - st.r)[:, None] * c).mul_((-cfg.k * inv_s)[:, None])
    coef_y = torch.where(valid, st.s_other * inv_s * f_y, 0.0) * cfg.k
    jac_logp.mul_((-cfg.k * inv_s)[:, None]).add_(coef_y[:, None] * w_y)


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
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
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
            saved = [hidden, weight, bias, targets, out.log_z, out.mu]
            if jacobian:
                saved.append(out.jac_logp)
                if out.jac_ent is not None:
                    saved.append(out.jac_ent)
            ctx.save_for_backward(*saved)
        if out.is_top1 is not None:
            ctx.mark_non_differentiable(out.is_top1)
        return out.logp, out.entropy, out.is_top1

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_top1):
        kept, ctx.kept_logits = ctx.kept_logits, None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        hidden, weight, bias, targets, log_z, mu, *jacs = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if ctx.jacobian and (g_ent is None or len(jacs) == 2):
            grad = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
            if g_logp is not None:
                grad.addcmul_(g_logp.float()[:, None], jacs[0])
            if g_ent is not None:
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


def _config(hidden, weight, bias, targets, backend, weight_context, keep_logits_mib, **options) -> OpConfig:
    """The checked ``OpConfig`` of one call (raises before any launch)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if options["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0, got {options['temperature']}")
    if options["logit_scale"] == 0:
        raise ValueError("logit_scale must be nonzero")
    backend = backend or default_backend(hidden.device)
    # nothing to keep without a graph (needs_input_grad stays True under no_grad, e.g. the old policy's log-probs)
    trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
    keep_mib = keep_logits_mib if torch.is_grad_enabled() and trainable else 0
    cfg = OpConfig(backend=backend, keep_logits_mib=keep_mib, **options)
    cfg = replace(cfg, compute_dtype=_compute_dtype(hidden, cfg), weight_context=weight_context)
    _checks.check_inputs(hidden, weight, targets, backend, cfg.compute_dtype, bias)  # before any launch
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
    loss_type: str = "nll",
    loss_scale: float | torch.Tensor = 1.0,
    **options,
) -> HeadLoss:
    """``loss = Σ_i w_i·(-logp_i)``, ``w_i = loss_scale`` ("nll") or ``loss_scale·p_i`` with ``p_i`` a constant
    ("dft"), and the detached per-token ``logp``, ``entropy``, ``is_top1`` (module docstring). ``options``: those of
    ``token_stats`` (``need_top1`` defaults to True here; no ``entropy_grad``: the entropy is a metric here)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if "entropy_grad" in options:
        raise TypeError("head_loss has no entropy gradient (its entropy is a metric): use token_stats")
    options.setdefault("need_top1", True)
    stats = token_stats(hidden, weight, targets, **options)
    logp = stats.logp
    weights = logp.detach().exp() if loss_type == "dft" else torch.ones_like(logp)
    loss = -(logp * weights).sum() * loss_scale
    entropy = None if stats.entropy is None else stats.entropy.detach()
    return HeadLoss(loss, logp.detach(), entropy, stats.is_top1)

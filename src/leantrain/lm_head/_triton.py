"""Triton passes over a cuBLAS logits tile (imported on first use, so TRITON_INTERPRET is read then)."""

import triton
import triton.language as tl


@triton.jit
def _z(x, scale, cap, inv_t, HAS_CAP: tl.constexpr):
    y = x * scale
    if HAS_CAP:
        t = 2 * tl.sigmoid(2 * y / cap) - 1
        return cap * t * inv_t, 1 - t * t
    return y * inv_t, y * 0.0 + 1.0


@triton.jit
def _top1_update(kbest, kidx, x, offs, mask, sign):
    # per lane: the first column (lanes see increasing columns) of the greatest sign·x so far
    key = tl.where(mask, x * sign, -float("inf"))
    better = key > kbest
    return tl.where(better, key, kbest), tl.where(better, offs, kidx)


@triton.jit
def _top1_store(kbest, kidx, best_ptr, idx_ptr, row, col0, n_cols):
    # the tile's first maximum replaces the running one only if greater: earlier tiles win ties, as argmax does
    tb = tl.max(kbest, axis=0)
    ti = tl.min(tl.where(kbest == tb, kidx, n_cols), axis=0)
    if tb > tl.load(best_ptr + row):
        tl.store(best_ptr + row, tb)
        tl.store(idx_ptr + row, (col0 + ti).to(tl.int64))


@triton.jit
def stats_kernel(
    tile_ptr, stride, local_ptr, m_ptr, so_ptr, u_ptr, zy_ptr, r_ptr, n_cols, best_ptr, idx_ptr, col0, sign,
    scale, cap, inv_t, HAS_CAP: tl.constexpr, HAS_TOP1: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row: online max over blocks; r is the first block's max
    row = tl.program_id(0).to(tl.int64)
    base = tile_ptr + row * stride
    local = tl.load(local_ptr + row)
    m = tl.load(m_ptr + row)
    so = tl.load(so_ptr + row)
    u = tl.load(u_ptr + row)
    r = tl.load(r_ptr + row)
    kbest = tl.full((BLOCK,), -float("inf"), tl.float32)
    kidx = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_TOP1:
            kbest, kidx = _top1_update(kbest, kidx, x, offs, mask, sign)
        z, f = _z(x, scale, cap, inv_t, HAS_CAP)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        r = tl.where(r == -float("inf"), m_new, r)
        resc = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        so = so * resc + tl.sum(tl.where(offs == local, 0.0, e), axis=0)
        u = u * resc + tl.sum(tl.where(mask, e * (z - r), 0.0), axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(so_ptr + row, so)
    tl.store(u_ptr + row, u)
    tl.store(r_ptr + row, r)
    if HAS_TOP1:
        _top1_store(kbest, kidx, best_ptr, idx_ptr, row, col0, n_cols)
    if (local >= 0) & (local < n_cols):
        zt, ft = _z(tl.load(base + local).to(tl.float32), scale, cap, inv_t, HAS_CAP)
        tl.store(zy_ptr + row, zt)


@triton.jit
def jacobian_kernel(
    tile_ptr, stride, e2_ptr, local_ptr, m_ptr, so_ptr, u_ptr, zy_ptr, r_ptr, resc_ptr, n_cols, best_ptr, idx_ptr,
    col0, sign, scale, cap, inv_t, HAS_CAP: tl.constexpr, HAS_E2: tl.constexpr, HAS_TOP1: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row: pass 1 finds the tile max, pass 2 folds the statistics and writes e·f in place
    row = tl.program_id(0).to(tl.int64)
    base = tile_ptr + row * stride
    local = tl.load(local_ptr + row)
    m = tl.load(m_ptr + row)
    tmax = -float("inf")
    kbest = tl.full((BLOCK,), -float("inf"), tl.float32)
    kidx = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_TOP1:
            kbest, kidx = _top1_update(kbest, kidx, x, offs, mask, sign)
        z, f = _z(x, scale, cap, inv_t, HAS_CAP)
        tmax = tl.maximum(tmax, tl.max(tl.where(mask, z, -float("inf")), axis=0))
    if HAS_TOP1:
        _top1_store(kbest, kidx, best_ptr, idx_ptr, row, col0, n_cols)
    m_new = tl.maximum(m, tmax)
    resc = tl.exp(m - m_new)
    r = tl.load(r_ptr + row)
    r = tl.where(r == -float("inf"), m_new, r)
    so = tl.load(so_ptr + row) * resc
    u = tl.load(u_ptr + row) * resc
    so_acc = tl.zeros((BLOCK,), tl.float32)
    u_acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        z, f = _z(x, scale, cap, inv_t, HAS_CAP)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        e_other = tl.where(offs == local, 0.0, e)
        zr = tl.where(mask, z - r, 0.0)
        so_acc += e_other
        u_acc += e * zr
        tl.store(base + offs, (e_other * f).to(tile_ptr.dtype.element_ty), mask=mask)
        if HAS_E2:
            tl.store(e2_ptr + row * stride + offs, (e * zr * f).to(e2_ptr.dtype.element_ty), mask=mask)
        if (local >= start) & (local < start + BLOCK) & (local < n_cols):
            tl.store(zy_ptr + row, tl.sum(tl.where(offs == local, z, 0.0), axis=0))
    tl.store(m_ptr + row, m_new)
    tl.store(so_ptr + row, so + tl.sum(so_acc, axis=0))
    tl.store(u_ptr + row, u + tl.sum(u_acc, axis=0))
    tl.store(r_ptr + row, r)
    tl.store(resc_ptr + row, resc)


@triton.jit
def grad_kernel(
    tile_ptr, stride, local_ptr, logz_ptr, mu_ptr, gl_ptr, ge_ptr, n_cols, scale, cap, inv_t,
    HAS_CAP: tl.constexpr, HAS_GL: tl.constexpr, HAS_GE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Overwrite one block of a recomputed tile with dL/d(h·Wᵀ)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    ptrs = tile_ptr + row * stride + offs
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z, f = _z(x, scale, cap, inv_t, HAS_CAP)
    p = tl.exp(z - tl.load(logz_ptr + row))
    g = tl.zeros((BLOCK,), tl.float32)
    if HAS_GL:
        is_t = offs == tl.load(local_ptr + row)
        g += tl.load(gl_ptr + row) * (is_t.to(tl.float32) - p)
    if HAS_GE:
        g -= tl.load(ge_ptr + row) * p * (z - tl.load(mu_ptr + row))
    g = g * f * (scale * inv_t)
    tl.store(ptrs, g.to(tile_ptr.dtype.element_ty), mask=mask)

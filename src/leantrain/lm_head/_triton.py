"""Triton passes over a cuBLAS logits tile (imported on first use, so TRITON_INTERPRET is read then).

``fold_kernel`` (one program per row and column block, every block independent: the row's reference ``m`` is fixed
before the tile) reads the block once, writes its partial statistics and, in jacobian mode, the GEMM operand
``e^(z-m)·f`` in place; ``combine_kernel`` (one program per row) folds the partials into the row's running state in
block order. A block whose logits exceed ``m + big`` (where ``e^(z-m)`` would overflow) uses its own maximum; the
combine then moves the row to the larger reference and rescales what was written against the smaller one (that row's
other blocks, its accumulators): a rare path that costs nothing when no row takes it.
"""

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
def fold_kernel(
    tile_ptr, stride, e2_ptr, tgt_ptr, col0, m_ptr, r_ptr, zy_ptr, pm_ptr, pso_ptr, pu_ptr, pbest_ptr, psa_ptr,
    pidx_ptr, nb, n_cols, sign, big, scale, cap, inv_t, HAS_CAP: tl.constexpr, WRITE: tl.constexpr,
    HAS_E2: tl.constexpr, HAS_TOP1: tl.constexpr, HAS_SA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    target = tl.load(tgt_ptr + row)
    if target >= 0:  # ignored rows: nothing read or written (their tile rows stay finite head outputs)
        local = target - col0
        m = tl.load(m_ptr + row)
        r = tl.load(r_ptr + row)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        ptrs = tile_ptr + row * stride + offs
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        z, f = _z(x, scale, cap, inv_t, HAS_CAP)
        z = tl.where(mask, z, -float("inf"))
        bmax = tl.max(z, axis=0)
        mb = tl.where(bmax > m + big, bmax, m)
        e = tl.exp(z - mb)
        is_t = offs == local
        e_other = tl.where(is_t, 0.0, e)
        zr = tl.where(mask, z - r, 0.0)
        p = row * nb + blk
        tl.store(pm_ptr + p, mb)
        tl.store(pso_ptr + p, tl.sum(e_other, axis=0))
        tl.store(pu_ptr + p, tl.sum(e * zr, axis=0))
        if HAS_SA:  # every column, target included: the entropy's normalizer, the same whichever is the target
            tl.store(psa_ptr + p, tl.sum(e, axis=0))
        if (local >= blk * BLOCK) & (local < blk * BLOCK + BLOCK) & (local < n_cols):
            tl.store(zy_ptr + row, tl.sum(tl.where(is_t, z, 0.0), axis=0))
        if HAS_TOP1:
            # the block's first maximum of sign·x (the tile value: bitwise the torch backend's key)
            key = tl.where(mask, x * sign, -float("inf"))
            kb = tl.max(key, axis=0)
            tl.store(pbest_ptr + p, kb)
            tl.store(pidx_ptr + p, tl.min(tl.where(key == kb, offs, n_cols), axis=0))
        if WRITE:
            tl.store(ptrs, (e_other * f).to(tile_ptr.dtype.element_ty), mask=mask)
            if HAS_E2:
                tl.store(e2_ptr + row * stride + offs, (e * zr * f).to(e2_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rescale_row(ptr, n, factor, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr + offs, (v * factor).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine_kernel(
    tile_ptr, stride, e2_ptr, tgt_ptr, col0, m_ptr, so_ptr, u_ptr, best_ptr, idx_ptr, sa_ptr, pm_ptr, pso_ptr,
    pu_ptr, pbest_ptr, psa_ptr, pidx_ptr, acc_ptr, acc_e_ptr, acc_stride, width, nb, n_cols, WRITE: tl.constexpr,
    HAS_E2: tl.constexpr, HAS_TOP1: tl.constexpr, HAS_SA: tl.constexpr, HAS_ACC: tl.constexpr,
    HAS_ACC_E: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(tgt_ptr + row)
    if target >= 0:
        m = tl.load(m_ptr + row)
        bo = tl.arange(0, NB)
        bmask = bo < nb
        base = row * nb
        pm = tl.load(pm_ptr + base + bo, mask=bmask, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        fac = tl.where(bmask, tl.exp(pm - m_new), 0.0)  # 1 for every block unless the reference moved
        so_t = tl.sum(fac * tl.load(pso_ptr + base + bo, mask=bmask, other=0.0), axis=0)
        u_t = tl.sum(fac * tl.load(pu_ptr + base + bo, mask=bmask, other=0.0), axis=0)
        resc = tl.exp(m - m_new)
        tl.store(so_ptr + row, tl.load(so_ptr + row) * resc + so_t)
        tl.store(u_ptr + row, tl.load(u_ptr + row) * resc + u_t)
        if HAS_SA:
            sa_t = tl.sum(fac * tl.load(psa_ptr + base + bo, mask=bmask, other=0.0), axis=0)
            tl.store(sa_ptr + row, tl.load(sa_ptr + row) * resc + sa_t)
        tl.store(m_ptr + row, m_new)
        if HAS_TOP1:
            pb = tl.load(pbest_ptr + base + bo, mask=bmask, other=-float("inf"))
            tb = tl.max(pb, axis=0)
            first = tl.min(tl.where(pb == tb, bo, NB), axis=0)  # earlier blocks win ties, as argmax does
            if tb > tl.load(best_ptr + row):
                tl.store(best_ptr + row, tb)
                tl.store(idx_ptr + row, (col0 + tl.load(pidx_ptr + base + first)).to(tl.int64))
        if m_new > m:  # rare: move what was written against a smaller reference to m_new
            if WRITE:
                for b in range(0, nb):
                    fb = tl.exp(tl.load(pm_ptr + base + b) - m_new)
                    if fb != 1.0:
                        n_b = tl.minimum(n_cols - b * BLOCK, BLOCK)
                        _rescale_row(tile_ptr + row * stride + b * BLOCK, n_b, fb, BLOCK)
                        if HAS_E2:
                            _rescale_row(e2_ptr + row * stride + b * BLOCK, n_b, fb, BLOCK)
            if HAS_ACC:
                _rescale_row(acc_ptr + row * acc_stride, width, resc, BLOCK)
            if HAS_ACC_E:
                _rescale_row(acc_e_ptr + row * acc_stride, width, resc, BLOCK)


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

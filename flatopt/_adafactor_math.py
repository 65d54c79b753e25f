"""Adafactor's array-agnostic step (the twin of ``kernels/adafactor.cu``), written once against ``xp``.

The step works on cache-sized *blocks* of the flat buffers, in three passes, so that no temporary the size of the
parameter is ever made on NumPy:

1. statistics: row sums and column sums of G² (factored) -> new R, C, r̄; or V ← β̂₂V + (1 − β̂₂)(G² + ε₁);
2. Σθ² (for RMS(θ), only when parameter scaling is on) and ΣU² (for the clip), U = G·rsqrt(R/r̄)·rsqrt(C)
   (or G/√V; unfactored, passes 1 and 2 are fused block by block);
3. U is recomputed block by block (two multiplies, cheaper than storing it), scaled by α/max(1, RMS(U)/d) (for a
   factored tensor the scale is folded into the column factor), pushed through the optional first moment, and
   θ ← θ·(1 − α·λ) − Δ.

On NumPy the sums of squares use ``einsum`` (its own loops: no temporary, no BLAS, deterministic); block partials
are added in block order.

A block is either a group of whole matrices (small matrices of an N-D tensor) or a range of rows of one matrix, and
always a contiguous range of the flat buffer.  The block layout depends only on the shape, so results are
deterministic and independent of threads.  On NumPy the block buffers are per-thread scratch (``_workspace``)
and the row/column vectors are kept in the state (never saved): after the first step of a name nothing is
allocated.  On CuPy the whole tensor is one block and every data-dependent scalar (Σθ², α, ΣU², the clip factor)
stays a 0-d device array: no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _workspace

# Elements per block on NumPy: 128 KiB of float32, so the block temporaries stay in the L2 cache.
BLOCK = 1 << 15


@dataclasses.dataclass
class Work:
    """Per-name scratch vectors of a factored step (allocated at the first step, never saved)."""

    rowv: object  # (B, r): new row statistic, then the row factor rsqrt(R / r̄)
    colv: object  # (B, c): new column statistic, then the column factor rsqrt(C)
    colpart: object  # (kmax, c): column sums of one block
    rbar: object  # (B, 1): mean of R over its rows


def factor_dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(B, r, c) of a factored shape: the last two dims are factored, the leading ones are a batch."""
    return math.prod(shape[:-2]), shape[-2], shape[-1]


@functools.lru_cache(maxsize=4096)
def blocks(bdim: int, r: int, c: int, limit: int) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """Contiguous blocks ``(lo, hi, b0, b1, i0, i1)`` of a (B, r, c) tensor: whole matrices b0:b1 (rows 0:r) when a
    matrix fits in ``limit`` elements, otherwise rows i0:i1 of matrix b0 (b1 = b0 + 1)."""
    out = []
    mat = r * c
    if mat <= limit:
        k = max(1, limit // max(mat, 1))
        for b0 in range(0, bdim, k):
            b1 = min(b0 + k, bdim)
            out.append((b0 * mat, b1 * mat, b0, b1, 0, r))
    else:
        rows = max(1, limit // c)
        for b in range(bdim):
            for i0 in range(0, r, rows):
                i1 = min(i0 + rows, r)
                out.append((b * mat + i0 * c, b * mat + i1 * c, b, b + 1, i0, i1))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def flat_blocks(n: int, limit: int) -> tuple[tuple[int, int], ...]:
    return tuple((lo, min(lo + limit, n)) for lo in range(0, n, limit))


def _limit(xp, n: int) -> int:
    return BLOCK if xp is np else max(n, 1)


def _buffers(xp, size: int, dtype) -> tuple:
    if xp is np:
        return _workspace.get(np, "adafactor.u", size, dtype), _workspace.get(np, "adafactor.sq", size, dtype)
    return xp.empty(size, dtype), xp.empty(size, dtype)


def _sumsq(xp, x, tmp):
    """Σx² of a block (``tmp`` is a scratch block of the same size; NumPy needs none: einsum writes nothing)."""
    if xp is np:
        return np.einsum("i,i->", x, x)
    xp.multiply(x, x, out=tmp)
    return xp.sum(tmp)


def _row_col_sumsq(xp, g3, rows, cols, tmp):
    """rows[b, i] = Σ_j g3[b, i, j]², cols[b, j] = Σ_i g3[b, i, j]² (``tmp``: scratch of g3's size)."""
    if xp is np:  # no temporary, no BLAS (einsum's own loops: deterministic)
        np.einsum("bij,bij->bi", g3, g3, out=rows)
        np.einsum("bij,bij->bj", g3, g3, out=cols)
        return
    s3 = tmp.reshape(g3.shape)
    xp.multiply(g3, g3, out=s3)
    xp.sum(s3, axis=2, out=rows)
    xp.sum(s3, axis=1, out=cols)


def make_work(xp, shape: tuple[int, ...], dtype) -> Work:
    bdim, r, c = factor_dims(shape)
    kmax = max(b1 - b0 for _, _, b0, b1, _, _ in blocks(bdim, r, c, _limit(xp, math.prod(shape)))) if bdim else 1
    return Work(xp.empty((bdim, r), dtype), xp.empty((bdim, c), dtype), xp.empty((kmax, c), dtype),
                xp.empty((bdim, 1), dtype))


def factored_step(xp, st, p, g, shape, *, beta: float, eps1: float, need_rms: bool, scalars) -> None:
    """One factored step.  ``scalars(ssq_p, ssq_u, n)`` returns (step scale α/max(1, RMS(U)/d), decay 1 − α·λ or
    None, beta1 or None) from Σθ² (None unless ``need_rms``) and ΣU²."""
    bdim, r, c = factor_dims(shape)
    n = p.size
    bl = blocks(bdim, r, c, _limit(xp, n))
    w = st.work
    if w is None or w.rowv.shape != (bdim, r):
        w = st.work = make_work(xp, shape, p.dtype)
    big = max(hi - lo for lo, hi, *_ in bl)
    ubuf, sqbuf = _buffers(xp, big, p.dtype)
    rowv, colv = w.rowv, w.colv
    # pass 1: row and column sums of G²
    colv.fill(0)
    for lo, hi, b0, b1, i0, i1 in bl:
        part = w.colpart[: b1 - b0]
        _row_col_sumsq(xp, g[lo:hi].reshape(b1 - b0, i1 - i0, c), rowv[b0:b1, i0:i1], part, sqbuf[: hi - lo])
        colv[b0:b1] += part
    omb = 1.0 - beta
    R = st.exp_avg_sq_row.reshape(bdim, r)
    C = st.exp_avg_sq_col.reshape(bdim, c)
    for new, old, count in ((rowv, R, c), (colv, C, r)):
        new /= count  # mean(G²) + ε₁ = mean(G² + ε₁)
        new += eps1
        old *= beta
        new *= omb
        old += new
    xp.sum(R, axis=1, keepdims=True, out=w.rbar)
    w.rbar /= r
    # factors: rowv = rsqrt(R / r̄), colv = rsqrt(C)
    xp.divide(R, w.rbar, out=rowv)
    xp.sqrt(rowv, out=rowv)
    xp.divide(1.0, rowv, out=rowv)
    xp.sqrt(C, out=colv)
    xp.divide(1.0, colv, out=colv)

    def u_block(lo, hi, b0, b1, i0, i1):
        u = ubuf[: hi - lo]
        u3 = u.reshape(b1 - b0, i1 - i0, c)
        xp.multiply(g[lo:hi].reshape(u3.shape), rowv[b0:b1, i0:i1, None], out=u3)
        u3 *= colv[b0:b1, None, :]
        return u

    def fold(step_scale):  # pass 3 then gets Ũ = (G·row factor)·(column factor·step scale) directly
        xp.multiply(colv, step_scale, out=colv)
        return True

    ssq_u, ssq_p = 0.0, (0.0 if need_rms else None)
    for b in bl:
        ssq_u, ssq_p = _block_sums(xp, u_block(*b), p[b[0]:b[1]], sqbuf[: b[1] - b[0]], ssq_u, ssq_p)
    _apply(xp, st, p, bl, u_block, scalars(ssq_p, ssq_u, n), fold)


def unfactored_step(xp, st, p, g, *, beta: float, eps1: float, need_rms: bool, scalars) -> None:
    """One unfactored step: V ← β̂₂V + (1 − β̂₂)(G² + ε₁), U = G/√V."""
    n = p.size
    bl = tuple((lo, hi) for lo, hi in flat_blocks(n, _limit(xp, n)))
    ubuf, sqbuf = _buffers(xp, max(hi - lo for lo, hi in bl), p.dtype)
    omb = 1.0 - beta
    v = st.exp_avg_sq

    def u_block(lo, hi):
        u = ubuf[: hi - lo]
        xp.sqrt(v[lo:hi], out=u)
        xp.divide(g[lo:hi], u, out=u)
        return u

    # pass 1 (with pass 2 fused: the block of V is still in cache)
    ssq_u, ssq_p = 0.0, (0.0 if need_rms else None)
    for lo, hi in bl:
        s = sqbuf[: hi - lo]
        xp.multiply(g[lo:hi], g[lo:hi], out=s)
        s += eps1
        s *= omb
        vb = v[lo:hi]
        vb *= beta
        vb += s
        ssq_u, ssq_p = _block_sums(xp, u_block(lo, hi), p[lo:hi], s, ssq_u, ssq_p)
    _apply(xp, st, p, bl, u_block, scalars(ssq_p, ssq_u, n), None)


def _block_sums(xp, u, pb, tmp, ssq_u, ssq_p):
    """Pass 2 on one block: add ΣU² and (when wanted) Σθ² of the block."""
    ssq_u = ssq_u + _sumsq(xp, u, tmp)
    if ssq_p is not None:
        ssq_p = ssq_p + _sumsq(xp, pb, tmp)
    return ssq_u, ssq_p


def _apply(xp, st, p, bl, u_block, sc, fold) -> None:
    """Pass 3: Ũ = U·step scale, the optional first moment, θ ← θ·decay − Δ, block by block."""
    step_scale, decay, beta1 = sc
    folded = fold is not None and fold(step_scale)
    m = st.exp_avg
    for b in bl:
        lo, hi = b[0], b[1]
        u = u_block(*b)
        if not folded:
            u *= step_scale  # Ũ = α·U / max(1, RMS(U)/d)
        delta = u
        if m is not None:
            mb = m[lo:hi]
            mb *= beta1
            u *= 1.0 - beta1
            mb += u
            delta = mb
        pb = p[lo:hi]
        if decay is not None:
            pb *= decay
        pb -= delta

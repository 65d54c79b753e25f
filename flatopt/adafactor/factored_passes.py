"""Adafactor's factored passes over one (B, r, c) tensor, as building blocks (array-agnostic, written once against
``xp``; the twin of the passes in ``kernels/adafactor.cu``), shared by ``flatopt.adafactor.numerics`` (Adafactor) and
``flatopt.adafactor8bit.paths`` (the 8-bit factored and CAME paths).

``FactoredPasses`` works on cache-sized *blocks* of the flat buffers, so that no temporary the size of the parameter
is ever made on NumPy:

* ``stats``: block by block, the squares S = X² of the block (scratch), row sums and column sums of S.  Fused mode:
  each row's new R_i is final as soon as its row has been summed (it depends on that row only), so the same pass
  also sums W_j = Σ_i S_ij/R_i and Σθ² (for RMS(θ)); then ``fused_ssq`` gives ΣU² = r̄·Σ_j W_j/C_j
  (U = X·rsqrt(R/r̄)·rsqrt(C), so U² = S·r̄/(R_i·C_j)) without another pass over X;
* ``factors`` (rsqrt factors from R, C), ``sums`` (ΣU² and Σθ² of another source), ``write`` (U into a buffer);
* ``apply`` / ``apply_tasks``: U formed block by block (column factor, then row factor in place), scaled (the scale
  folded into the column factor), pushed through the optional first moment, θ ← θ·decay − Δ.

On NumPy the sums use ``einsum``/``add.reduce`` loops, or for a tensor of at least ``BLAS_MIN`` elements
single-threaded BLAS GEMVs when the caller holds the BLAS at one thread; deterministic, independent of the thread
count; block partials are added in block order.  The block layout, the tasks and the phase runner are
``flatopt.core.blocks`` (every per-block reduction has its own slot, folded in block order).  Column partials of the
statistics pass are kept for a window of at most ``PARTS`` elements at a time (folded after each window), so the
extra scratch stays bounded.  On NumPy the block buffers are per-thread scratch (``core.workspace``) and the row/column
vectors are kept in the state (``Work``, never saved): after the first step of a name nothing is allocated.  On CuPy
the whole tensor is one block and every data-dependent scalar stays a 0-d device array: no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..core import blocks as _blocks
from ..core.blocks import aligned, blocks, factor_dims, fold, plan, sumsq


@dataclasses.dataclass
class Work:
    """Per-name scratch of a step (allocated at the first step, never saved)."""

    rowv: object  # (B, r): new row statistic, then the row factor rsqrt(R / r̄)
    colv: object  # (B, c): new column statistic, then the column factor rsqrt(C)
    colpart: object  # (window·kmax, c): column sums of the blocks of one pass-1 window, kmax rows per block
    rbar: object  # (B, 1): mean of R over its rows
    rowsq: object = None  # (B, r): squared row factors (for ``sums``), allocated when first used
    rsum: object = None  # (B, r): row sums of the column-scaled blocks (for ``sums``), likewise
    wpart: object = None  # like colpart: per-block Σ_i x²/R_i (fused statistics), allocated when first used
    wsum: object = None  # (B, c): W = Σ_i x²/R_i
    tile: object = None  # (B, k·c): the column factor repeated k times (NumPy, short rows; see ``TILE``)
    colf: object = None  # (B, c): a copy of the column factor (``u_source``)
    align: int = 1  # the block alignment this scratch was laid out for
    su: list = None  # ΣU² of each block
    sp: list = None  # Σθ² of each block


# NumPy: tensors of at least this many elements sum their statistics pass (row, column and weighted column sums of
# G², Σθ²) with single-threaded BLAS GEMVs/dot instead of einsum when the caller holds the BLAS at one thread
# (``flatopt.core.shards.blas_capped``; needs ``threadpoolctl``).  NumPy's einsum loops are not dispatched to AVX2 and
# scale poorly over two threads.  Re-measure: ``python -m benchmarks.threads_probe adafactor`` (figures in
# benchmarks/README.md, "Measurements behind the source's constants").  The
# choice is per tensor (its size), so a tensor's bits do not depend on what it is stepped with; a threaded BLAS
# is never called from the block tasks (its idle workers would spin against them).
BLAS_MIN = 1 << 17
# NumPy: a ufunc with a broadcast operand runs its inner loop one row at a time; for rows shorter than this many
# elements the column scaling multiplies ranges of k rows by the column factor repeated k times (``Work.tile``,
# k·c ≥ TILE) instead, which runs longer inner loops: bits unchanged (the same product per element).  Re-measure:
# ``python -m benchmarks.threads_probe scaling``.
TILE = 1 << 13

_ONES: dict = {}


def _ones(n: int, dtype):
    key = (n, np.dtype(dtype))
    if key not in _ONES:
        _ONES[key] = np.ones(n, dtype)
    return _ONES[key]


def _row_col_sumsq(xp, g3, rows, cols, s3, blas: bool = False):
    """rows[b, i] = Σ_j g3[b, i, j]², cols[b, j] = Σ_i g3[b, i, j]²; ``s3`` (scratch shaped like g3) keeps the
    squares.  NumPy: einsum and add.reduce loops, or (``blas``: the BLAS capped at one thread) GEMVs."""
    xp.multiply(g3, g3, out=s3)
    if xp is np and blas:
        if rows.flags.c_contiguous:  # np.dot releases the GIL; a matrix-vector np.matmul holds it (NumPy 2.x)
            np.dot(s3.reshape(-1, s3.shape[2]), _ones(s3.shape[2], s3.dtype), out=rows.reshape(-1))
        else:
            np.matmul(s3, _ones(s3.shape[2], s3.dtype), out=rows)
        np.matmul(_ones(s3.shape[1], s3.dtype), s3, out=cols)
        return
    if xp is np:
        np.einsum("bij->bi", s3, out=rows)
        np.add.reduce(s3, axis=1, out=cols)
        return
    xp.sum(s3, axis=2, out=rows)
    xp.sum(s3, axis=1, out=cols)


def _weighted_col_sums(xp, inv, s3, out, blas: bool = False) -> None:
    """out[b, j] = Σ_i inv[b, i]·s3[b, i, j] (``s3`` may be overwritten)."""
    if xp is np and blas:
        np.matmul(inv[:, None, :], s3, out=out[:, None, :])
        return
    if xp is np:
        np.einsum("bi,bij->bj", inv, s3, out=out)
        return
    s3 *= inv[:, :, None]
    xp.sum(s3, axis=1, out=out)


def _kmax(bl) -> int:
    return max(b[3] - b[2] for b in bl) if bl else 1


def make_work(xp, shape: tuple[int, ...], dtype, align: int = 1) -> Work:
    bdim, r, c = factor_dims(shape)
    bl = blocks(bdim, r, c, _blocks.limit(xp, math.prod(shape)), align) if bdim else ()
    kmax = _kmax(bl)
    window = max(1, min(len(bl), _blocks.PARTS // max(kmax * c, 1)))
    return Work(xp.empty((bdim, r), dtype), xp.empty((bdim, c), dtype), xp.empty((window * kmax, c), dtype),
                xp.empty((bdim, 1), dtype), su=[None] * len(bl), sp=[None] * len(bl), align=align)


class FactoredPasses:
    """The blocked passes over one factored (B, r, c) tensor, as building blocks (each a phase generator or a
    task list; see the module documentation): ``stats`` (row and column means of X²), ``factors`` (rsqrt factors
    from R, C), ``sums`` (ΣU² and Σθ² per block, U = X·row·column factor), ``write`` (U into a buffer) and
    ``apply`` (θ ← θ·decay − s·U).  ``factored_phases`` composes them for Adafactor; ``flatopt.adafactor8bit.paths`` composes
    them for the 8-bit Adafactor and CAME."""

    def __init__(self, xp, st, p, shape, align: int = 1):
        self.xp, self.p = xp, p
        bdim, r, c = self.dims = factor_dims(shape)
        limit = _blocks.limit(xp, p.size)
        w = st.work
        if w is None or w.rowv is None or w.rowv.shape != (bdim, r) or w.align != align:
            w = st.work = make_work(xp, shape, p.dtype, align)
        self.w, self.rowv, self.colv = w, w.rowv, w.colv
        self.kmax = _kmax(blocks(bdim, r, c, limit, align))
        self.window = w.colpart.shape[0] // self.kmax
        sup = _blocks.SUPER if xp is np else limit
        self.bl, self.wins, self.runs = plan(bdim, r, c, limit, self.window, _blocks.TASK, sup,
                                             align)
        self.aligned = aligned(self.bl, align)  # every block starts at a multiple of ``align``
        self.big = max(s[1] - s[0] for run in self.runs for s in run[3])
        self.shared = None if xp is np else _blocks.buffers(xp, self.big, p.dtype)  # CuPy: one block, per step
        self.ssq_u = self.ssq_p = None
        self.blas = False
        # rows per tile of the column factor (``_tiles``): NumPy row blocks of one matrix (tiles of at most n/32)
        self.k = -(-TILE // c) if xp is np and r * c > limit and 0 < c < TILE else 1

    def _bufs(self):
        return self.shared or _blocks.buffers(np, self.big, self.p.dtype)

    def stats(self, x, extra=(), *, rows=None, need_rms: bool = False, wsrc=None, xblock=None):
        """Phases: colv ← mean_i x², rowv ← mean_j x² (row sums per block; column sums per block, folded in block
        order by windows of ``PARTS`` elements); ``extra`` tasks join the first phase.

        Fused mode (``rows`` given; for U formed from x itself): each block's task calls ``rows(b0, b1, i0, i1, s)``
        with s the block's row sums (a view of rowv); it must make the rows' new statistic R from them (kept where
        the caller keeps R) and return 1/R in s.  The task then also sums W_j = Σ_i x_ij²/R_i per block, so that
        ``fused_ssq`` gives ΣU² = Σ_b r̄_b·Σ_j c_bj²·W_bj (r_i² = r̄/R_i) without another pass over x; and, with
        ``need_rms``, Σθ² per block (into ``ssq_p``).  rowv then holds 1/R, not the means.  ``wsrc(lo, hi)``
        (fused mode, ``aligned`` blocks) returns, per block, the values U is formed from instead of x (e.g. a first
        moment updated block by block in this same pass); W then sums their squares.

        ``xblock(buf, lo, hi, b0, b1, i0, i1)`` (NumPy, instead of x) makes each block's values in the task, into
        the thread's first block buffer ``buf`` or elsewhere, and returns them (flat): the statistics of values that
        are never stored whole.  It runs before the block's row sums are written into rowv, so it may read the
        rows' previous contents (e.g. their factors); the column vector is zeroed before the phase."""
        xp, bl, kmax, window, p = self.xp, self.bl, self.kmax, self.window, self.p
        _, r, c = self.dims
        w = self.w
        rowv, colv, colpart = self.rowv, self.colv, w.colpart
        fused = rows is not None
        if fused and w.wpart is None:
            w.wpart, w.wsum = xp.empty_like(colpart), xp.empty_like(colv)
        sp = w.sp

        def pass1(k0, k1, base):
            def run():
                sq = self._bufs()[1]
                for k in range(k0, k1):  # block by block (the row sums depend on the cut: keep the blocks)
                    lo, hi, b0, b1, i0, i1 = bl[k]
                    j = (k - base) * kmax
                    s3 = sq[: hi - lo].reshape(b1 - b0, i1 - i0, c)
                    xb = x[lo:hi] if xblock is None else xblock(self._bufs()[0], lo, hi, b0, b1, i0, i1)
                    _row_col_sumsq(xp, xb.reshape(s3.shape), rowv[b0:b1, i0:i1], colpart[j:j + b1 - b0], s3,
                                   self.blas)
                    if fused:
                        inv = rows(b0, b1, i0, i1, rowv[b0:b1, i0:i1])
                        if wsrc is not None:  # W from another source's squares (the statistics came from x)
                            u3 = self._bufs()[0][: hi - lo].reshape(s3.shape)
                            src = wsrc(lo, hi).reshape(s3.shape)
                            xp.multiply(src, src, out=u3)
                            s3 = u3
                        _weighted_col_sums(xp, inv, s3, w.wpart[j:j + b1 - b0], self.blas)
                    if need_rms:
                        sp[k] = np.dot(p[lo:hi], p[lo:hi]) if self.blas else sumsq(xp, p[lo:hi], sq[: hi - lo])
            return run

        colv.fill(0)
        if fused:
            w.wsum.fill(0)
        for wi, win in enumerate(self.wins):
            base = wi * window
            yield [(cost, pass1(k0, k1, base)) for cost, k0, k1, _ in win] + (list(extra) if wi == 0 else [])
            for k in range(base, min(base + window, len(bl))):  # the folds, in block order
                b0, b1 = bl[k][2], bl[k][3]
                j = (k - base) * kmax
                colv[b0:b1] += colpart[j:j + b1 - b0]
                if fused:
                    w.wsum[b0:b1] += w.wpart[j:j + b1 - b0]
        if not fused:
            rowv /= c
        colv /= r
        self.ssq_p = fold(sp, 0.0) if need_rms else None

    def fused_ssq(self):
        """ΣU² after a fused ``stats`` and ``factors``: Σ_b r̄_b·Σ_j c_bj²·W_bj."""
        xp, w = self.xp, self.w
        c2 = xp.multiply(self.colv, self.colv, out=w.wpart[: self.colv.shape[0]])
        c2 *= w.wsum
        per_b = xp.sum(c2, axis=1)
        return xp.sum(per_b * w.rbar[:, 0])

    def factors(self, R, C, rbar_floor=None) -> None:
        """rowv ← rsqrt(R/r̄), colv ← rsqrt(C), r̄ = mean of R over its rows (floored at ``rbar_floor``)."""
        xp, w = self.xp, self.w
        xp.sum(R, axis=1, keepdims=True, out=w.rbar)
        w.rbar /= self.dims[1]
        if rbar_floor is not None:
            xp.maximum(w.rbar, rbar_floor, out=w.rbar)
        xp.divide(R, w.rbar, out=self.rowv)
        xp.sqrt(self.rowv, out=self.rowv)
        xp.divide(1.0, self.rowv, out=self.rowv)
        xp.sqrt(C, out=self.colv)
        xp.divide(1.0, self.colv, out=self.colv)

    def _tiles(self) -> None:
        """Refresh ``Work.tile`` from the column factor (NumPy, rows shorter than ``TILE``): call once the column
        factor is final for a pass, before its tasks run."""
        bdim, _, c = self.dims
        k = self.k
        if k > 1:
            w = self.w
            if w.tile is None or w.tile.shape != (bdim, k * c):
                w.tile = np.empty((bdim, k * c), self.colv.dtype)
            w.tile.reshape(bdim, k, c)[...] = self.colv[:, None, :]

    def _col_scaled(self, x, out3, lo, b0, b1, i0, i1, colv=None) -> None:
        """out3 ← x[lo:lo + out3.size] (a (b1 − b0, i1 − i0, c) block) · column factor (``colv``: a copy of it, by
        default colv itself); rows of one matrix k at a time against the tiled factor (``_tiles``), the rest row by
        row."""
        c, k = self.dims[2], self.k
        colv = self.colv if colv is None else colv
        if k > 1 and b1 - b0 == 1 and i1 - i0 >= k:
            q = (i1 - i0) // k * k
            np.multiply(x[lo:lo + q * c].reshape(-1, k * c), self.w.tile[b0], out=out3[0, :q].reshape(-1, k * c))
            if q < i1 - i0:
                np.multiply(x[lo + q * c:lo + out3.size].reshape(-1, c), colv[b0], out=out3[0, q:])
            return
        self.xp.multiply(x[lo:lo + out3.size].reshape(out3.shape), colv[b0:b1, None, :], out=out3)

    def _u_block(self, x):
        """U of a (merged) block: x·column factor into the thread's first block buffer, then ·row factor in place
        (on NumPy an in-place (B, r, 1) broadcast multiply beats an out-of-place einsum or multiply; re-measure:
        ``python -m benchmarks.threads_probe scaling``)."""
        rowv, c = self.rowv, self.dims[2]
        self._tiles()

        def u_block(ubuf, lo, hi, b0, b1, i0, i1, *_):
            v3 = ubuf[: hi - lo].reshape(b1 - b0, i1 - i0, c)
            self._col_scaled(x, v3, lo, b0, b1, i0, i1)
            v3 *= rowv[b0:b1, i0:i1, None]
            return v3.reshape(-1)
        return u_block

    def sums(self, x, need_rms: bool):
        """A phase: ΣU² and, when ``need_rms``, Σθ² of each block, folded in block order into ``ssq_u`` / ``ssq_p``
        after the phase.  ΣU² = Σ_i r_i²·Σ_j (x_ij·c_j)² (row sums of the column-scaled block, weighted by the
        squared row factors): one broadcast multiply and one reduction per element instead of forming U."""
        xp, bl, p, c = self.xp, self.bl, self.p, self.dims[2]
        w = self.w
        if w.rowsq is None:  # only the unfused users need these (allocated once)
            w.rowsq, w.rsum = xp.empty_like(self.rowv), xp.empty_like(self.rowv)
        su, sp, rsum = w.su, w.sp, w.rsum
        rowsq = xp.multiply(self.rowv, self.rowv, out=w.rowsq)
        self._tiles()

        def pass2(supers):
            def run():
                vbuf, sq = self._bufs()
                for lo, hi, b0, b1, i0, i1, ka, kb in supers:
                    self._col_scaled(x, vbuf[: hi - lo].reshape(b1 - b0, i1 - i0, c), lo, b0, b1, i0, i1)
                    for k in range(ka, kb):
                        klo, khi, kb0, kb1, ki0, ki1 = bl[k]
                        v3 = vbuf[klo - lo:khi - lo].reshape(kb1 - kb0, ki1 - ki0, c)
                        rs, w2 = rsum[kb0:kb1, ki0:ki1], rowsq[kb0:kb1, ki0:ki1]
                        if xp is np:
                            np.einsum("bij,bij->bi", v3, v3, out=rs)
                            su[k] = np.einsum("bi,bi->", rs, w2)
                        else:
                            s3 = sq[: khi - klo].reshape(v3.shape)
                            xp.multiply(v3, v3, out=s3)
                            xp.sum(s3, axis=2, out=rs)
                            su[k] = xp.sum(rs * w2)
                        if need_rms:
                            sp[k] = sumsq(xp, p[klo:khi], sq[: khi - klo])
            return run

        yield [(cost, pass2(supers)) for cost, _, _, supers in self.runs]
        self.ssq_u = fold(su, 0.0)
        self.ssq_p = fold(sp, 0.0) if need_rms else None

    def u_source(self, x, then):
        """An ``xblock`` for ``stats`` over U = x·row factor·column factor (the factors as they are now; the column
        factor copied, since ``stats`` zeroes colv): U of the block into the buffer, then ``then(u, lo, hi)``, which
        returns the values to measure (NumPy)."""
        w, c = self.w, self.dims[2]
        if w.colf is None or w.colf.shape != self.colv.shape:
            w.colf = np.empty_like(self.colv)
        colf = w.colf
        np.copyto(colf, self.colv)
        self._tiles()
        rowv = self.rowv

        def block(buf, lo, hi, b0, b1, i0, i1):
            u3 = buf[: hi - lo].reshape(b1 - b0, i1 - i0, c)
            self._col_scaled(x, u3, lo, b0, b1, i0, i1, colf)
            u3 *= rowv[b0:b1, i0:i1, None]
            return then(u3.reshape(-1), lo, hi)
        return block

    def write(self, x, out) -> list:
        """Tasks: out ← x·column factor, then ·row factor in place (elementwise, any cut gives the same bits)."""
        rowv, c = self.rowv, self.dims[2]
        self._tiles()

        def run_(supers):
            def run():
                for lo, hi, b0, b1, i0, i1, *_ in supers:
                    o3 = out[lo:hi].reshape(b1 - b0, i1 - i0, c)
                    self._col_scaled(x, o3, lo, b0, b1, i0, i1)
                    o3 *= rowv[b0:b1, i0:i1, None]
            return run
        return [(cost, run_(supers)) for cost, _, _, supers in self.runs]

    def apply(self, st, x, step_scale, decay, beta1, zero_nonfinite: bool = False) -> list:
        """Tasks: θ ← θ·decay − Δ with Ũ = x·row·(column factor·step scale), Δ = Ũ or its first moment (β1)."""
        xp = self.xp
        xp.multiply(self.colv, step_scale, out=self.colv)
        return apply_tasks(xp, st, self.p, [(cost, supers) for cost, _, _, supers in self.runs], self._u_block(x),
                           self.shared, self.big, self.p.dtype, None, decay, beta1,
                           zero_nonfinite and (xp is not np or step_scale == 0))


def apply_tasks(xp, st, p, task_runs, u_block, shared, big, dtype, step_scale, decay, beta1, zero_nonfinite=False):
    """Pass 3: Ũ = U·step scale (unless folded into U: ``step_scale`` None), non-finite entries zeroed when
    ``zero_nonfinite``, the optional first moment, θ ← θ·decay − Δ, for the (merged) blocks of each run
    (elementwise: any cut gives the same bits)."""
    m = st.exp_avg if beta1 is not None else None

    def pass3(supers):
        def run():
            ubuf = (shared or _blocks.buffers(np, big, dtype))[0]
            for b in supers:
                lo, hi = b[0], b[1]
                u = u_block(ubuf, *b)
                if step_scale is not None:
                    u *= step_scale  # Ũ = α·U / max(1, RMS(U)/d)
                if zero_nonfinite:
                    xp.copyto(u, 0.0, where=~xp.isfinite(u))
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
        return run

    return [(cost, pass3(supers)) for cost, supers in task_runs]

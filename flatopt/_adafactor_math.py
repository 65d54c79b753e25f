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
allocated.

Threads: the step is written as a generator of *phases* (``factored_phases``/``unfactored_phases``).  Each phase is
a list of ``(cost, fn)`` tasks over disjoint runs of consecutive blocks (about ``TASK`` elements each) that may run
in any order on any thread; between two phases the generator does the small serial work (folds, the R/C update,
the scalars) on the caller.  Every per-block reduction result (column sums of a block, ΣU² and Σθ² of a block) is
written to its own slot, and the slots are folded afterwards in block order, exactly the serial loop's order: the
bits are the same for any number of threads and any assignment of tasks to threads.  ``run_phased`` runs the
phases of many steps together (one barrier per phase for the whole batch); ``run_serial`` runs one step inline.
Column partials of pass 1 are kept for a window of at most ``PARTS`` elements at a time (folded after each window),
so the extra scratch stays bounded.  On CuPy the whole tensor is one block and every data-dependent scalar (Σθ², α, ΣU², the clip factor)
stays a 0-d device array: no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _parallel, _workspace

# Elements per block on NumPy: 128 KiB of float32, so the block temporaries stay in the L2 cache.
BLOCK = 1 << 15
# Elements per task of a blocked pass (a run of consecutive blocks handed to one thread at a time).
TASK = 1 << 18
# Elements of a merged run of consecutive blocks for the elementwise work of passes 2 and 3 (forming U, the update):
# bits unchanged, they are per element; every reduction (row and column sums, ΣU², Σθ²) stays per block.
SUPER = 1 << 17
# Elements of pass-1 column partials kept per name at most (the window of blocks whose partials are folded at once).
PARTS = 1 << 20


@dataclasses.dataclass
class Work:
    """Per-name scratch of a step (allocated at the first step, never saved)."""

    rowv: object  # (B, r): new row statistic, then the row factor rsqrt(R / r̄)
    colv: object  # (B, c): new column statistic, then the column factor rsqrt(C)
    colpart: object  # (window·kmax, c): column sums of the blocks of one pass-1 window, kmax rows per block
    rbar: object  # (B, 1): mean of R over its rows
    su: list = None  # ΣU² of each block
    sp: list = None  # Σθ² of each block


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


@functools.lru_cache(maxsize=4096)
def runs(sizes: tuple[int, ...], k0: int, k1: int, task: int) -> tuple[tuple[int, int, int], ...]:
    """``(cost, a, b)``: blocks k0:k1 cut into runs of consecutive blocks of about ``task`` elements."""
    out = []
    a, acc = k0, 0
    for k in range(k0, k1):
        acc += sizes[k]
        if acc >= task or k == k1 - 1:
            out.append((acc, a, k + 1))
            a, acc = k + 1, 0
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _sizes(bl: tuple) -> tuple[int, ...]:
    return tuple(b[1] - b[0] for b in bl)


def _mergeable(a, b, r: int) -> bool:
    if a[1] != b[0]:
        return False
    if a[4] == 0 and a[5] == r and b[4] == 0 and b[5] == r:  # whole matrices
        return True
    return a[2] == b[2] and a[3] == b[3] and a[5] == b[4]  # rows of one matrix


@functools.lru_cache(maxsize=1024)
def plan(bdim: int, r: int, c: int, limit: int, window: int, task: int, sup: int):
    """The block schedule of a factored shape: ``(blocks, pass-1 runs per window, runs)``; a run is
    ``(cost, k0, k1, supers)`` and a super ``(lo, hi, b0, b1, i0, i1, ka, kb)`` covers blocks ka:kb (merged
    while they stay one contiguous 3-D view of at most ``sup`` elements)."""
    bl = blocks(bdim, r, c, limit)
    sizes = _sizes(bl)

    def with_supers(rs):
        out = []
        for cost, k0, k1 in rs:
            supers = []
            ka = k0
            for k in range(k0 + 1, k1 + 1):
                if k < k1 and _mergeable(bl[k - 1], bl[k], r) and bl[k][1] - bl[ka][0] <= sup:
                    continue
                a, z = bl[ka], bl[k - 1]
                supers.append((a[0], z[1], a[2], z[3], a[4], z[5], ka, k))
                ka = k
            out.append((cost, k0, k1, tuple(supers)))
        return tuple(out)

    wins = tuple(with_supers(runs(sizes, base, min(base + window, len(bl)), task))
                 for base in range(0, len(bl), window))
    return bl, wins, with_supers(runs(sizes, 0, len(bl), task))


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


def _kmax(bl) -> int:
    return max(b[3] - b[2] for b in bl) if bl else 1


def make_work(xp, shape: tuple[int, ...], dtype) -> Work:
    bdim, r, c = factor_dims(shape)
    bl = blocks(bdim, r, c, _limit(xp, math.prod(shape))) if bdim else ()
    kmax = _kmax(bl)
    window = max(1, min(len(bl), PARTS // max(kmax * c, 1)))
    return Work(xp.empty((bdim, r), dtype), xp.empty((bdim, c), dtype), xp.empty((window * kmax, c), dtype),
                xp.empty((bdim, 1), dtype), [None] * len(bl), [None] * len(bl))


def _fold(parts: list, acc):
    """acc + parts[0] + parts[1] + ... in block order (the serial loop's order)."""
    for s in parts:
        acc = acc + s
    return acc


def factored_phases(xp, st, p, g, shape, *, beta: float, eps1: float, need_rms: bool, scalars):
    """One factored step as a generator of phases (see the module documentation).  ``scalars(ssq_p, ssq_u, n)``
    returns (step scale α/max(1, RMS(U)/d), decay 1 − α·λ or None, beta1 or None) from Σθ² (None unless
    ``need_rms``) and ΣU²."""
    bdim, r, c = factor_dims(shape)
    n = p.size
    limit = _limit(xp, n)
    w = st.work
    if w is None or w.rowv is None or w.rowv.shape != (bdim, r):
        w = st.work = make_work(xp, shape, p.dtype)
    rowv, colv, colpart = w.rowv, w.colv, w.colpart
    bl0 = blocks(bdim, r, c, limit)
    kmax = _kmax(bl0)
    window = colpart.shape[0] // kmax
    bl, wins, all_runs = plan(bdim, r, c, limit, window, TASK, SUPER if xp is np else limit)
    big = max(s[1] - s[0] for run in all_runs for s in run[3])
    dtype = p.dtype
    shared = None if xp is np else _buffers(xp, big, dtype)  # CuPy: one block, allocated per step as before
    onp = xp is np

    # pass 1: row sums of G² (into rowv) and column sums of each block (into its slot of colpart), by windows
    def pass1(k0, k1, base):
        def run():
            sq = None if onp else shared[1]
            for k in range(k0, k1):  # block by block (einsum's row sums depend on the cut: keep the blocks)
                lo, hi, b0, b1, i0, i1 = bl[k]
                j = (k - base) * kmax
                _row_col_sumsq(xp, g[lo:hi].reshape(b1 - b0, i1 - i0, c), rowv[b0:b1, i0:i1],
                               colpart[j:j + b1 - b0], None if onp else sq[: hi - lo])
        return run

    colv.fill(0)
    for wi, win in enumerate(wins):
        base = wi * window
        yield [(cost, pass1(k0, k1, base)) for cost, k0, k1, _ in win]
        for k in range(base, min(base + window, len(bl))):  # the fold, in block order
            b0, b1 = bl[k][2], bl[k][3]
            j = (k - base) * kmax
            colv[b0:b1] += colpart[j:j + b1 - b0]
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

    def u_block(ubuf, lo, hi, b0, b1, i0, i1, *_):
        u = ubuf[: hi - lo]
        u3 = u.reshape(b1 - b0, i1 - i0, c)
        xp.multiply(g[lo:hi].reshape(u3.shape), rowv[b0:b1, i0:i1, None], out=u3)
        u3 *= colv[b0:b1, None, :]
        return u

    # pass 2: ΣU² and Σθ² of each block (U formed for a merged run of blocks, summed block by block)
    su, sp = w.su, w.sp

    def pass2(supers):
        def run():
            ubuf, sq = shared or _buffers(np, big, dtype)
            for s in supers:
                u = u_block(ubuf, *s)
                lo = s[0]
                for k in range(s[6], s[7]):
                    klo, khi = bl[k][0], bl[k][1]
                    su[k] = _sumsq(xp, u[klo - lo:khi - lo], sq[: khi - klo])
                    if need_rms:
                        sp[k] = _sumsq(xp, p[klo:khi], sq[: khi - klo])
        return run

    yield [(cost, pass2(supers)) for cost, _, _, supers in all_runs]
    ssq_u = _fold(su, 0.0)
    ssq_p = _fold(sp, 0.0) if need_rms else None
    step_scale, decay, beta1 = scalars(ssq_p, ssq_u, n)
    # pass 3 gets Ũ = (G·row factor)·(column factor·step scale) directly
    xp.multiply(colv, step_scale, out=colv)
    yield _apply_tasks(xp, st, p, [(cost, supers) for cost, _, _, supers in all_runs], u_block, shared, big, dtype,
                       None, decay, beta1)


def unfactored_phases(xp, st, p, g, *, beta: float, eps1: float, need_rms: bool, scalars):
    """One unfactored step as a generator of phases: V ← β̂₂V + (1 − β̂₂)(G² + ε₁), U = G/√V."""
    n = p.size
    bl = flat_blocks(n, _limit(xp, n))
    nb = len(bl)
    big = max(hi - lo for lo, hi in bl)
    dtype = p.dtype
    shared = None if xp is np else _buffers(xp, big, dtype)
    w = st.work
    if w is None or len(w.su) != nb:
        w = st.work = Work(None, None, None, None, [None] * nb, [None] * nb)
    su, sp = w.su, w.sp
    sizes = _sizes(bl)
    omb = 1.0 - beta
    v = st.exp_avg_sq

    def u_block(ubuf, lo, hi):
        u = ubuf[: hi - lo]
        xp.sqrt(v[lo:hi], out=u)
        xp.divide(g[lo:hi], u, out=u)
        return u

    # pass 1 (with pass 2 fused: the block of V is still in cache)
    def pass12(k0, k1):
        def run():
            ubuf, sq = shared or _buffers(np, big, dtype)
            for k in range(k0, k1):
                lo, hi = bl[k]
                s = sq[: hi - lo]
                xp.multiply(g[lo:hi], g[lo:hi], out=s)
                s += eps1
                s *= omb
                vb = v[lo:hi]
                vb *= beta
                vb += s
                su[k] = _sumsq(xp, u_block(ubuf, lo, hi), s)
                if need_rms:
                    sp[k] = _sumsq(xp, p[lo:hi], s)
        return run

    yield [(cost, pass12(a, b)) for cost, a, b in runs(sizes, 0, nb, TASK)]
    ssq_u = _fold(su, 0.0)
    ssq_p = _fold(sp, 0.0) if need_rms else None
    step_scale, decay, beta1 = scalars(ssq_p, ssq_u, n)
    yield _apply_tasks(xp, st, p, [(cost, bl[a:b]) for cost, a, b in runs(sizes, 0, nb, TASK)], u_block, shared, big,
                       dtype, step_scale, decay, beta1)


def _apply_tasks(xp, st, p, task_runs, u_block, shared, big, dtype, step_scale, decay, beta1) -> list:
    """Pass 3: Ũ = U·step scale (unless folded into U: ``step_scale`` None), the optional first moment,
    θ ← θ·decay − Δ, for the (merged) blocks of each run (elementwise: any cut gives the same bits)."""
    m = st.exp_avg

    def pass3(supers):
        def run():
            ubuf = (shared or _buffers(np, big, dtype))[0]
            for b in supers:
                lo, hi = b[0], b[1]
                u = u_block(ubuf, *b)
                if step_scale is not None:
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
        return run

    return [(cost, pass3(supers)) for cost, supers in task_runs]


def run_serial(phases) -> None:
    """Run one step's phases inline, in order."""
    for phase in phases:
        for _, fn in phase:
            fn()


def run_phased(steps: list, *, serial: bool = False) -> None:
    """Run the phases of many independent steps (``(name, phase generator)``) together: phase k of every step is
    one ``_parallel.run_tasks`` call (a barrier), the serial work between phases runs on the caller."""
    active = steps
    while active:
        tasks, nxt = [], []
        for name, gen in active:
            try:
                phase = next(gen)
            except StopIteration:
                continue
            except Exception as exc:
                raise _parallel.TaskError(f"parameter {name!r}: {type(exc).__name__}: {exc}") from exc
            for cost, fn in phase:
                tasks.append((cost, name, fn))
            nxt.append((name, gen))
        if tasks:
            _parallel.run_tasks(tasks, serial=serial)
        active = nxt

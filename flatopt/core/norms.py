"""The NumPy paths of the per-tensor sums of a definition with ``e.sum`` (``core/elementwise/reduce.py``: Lamb's and
Mars's norms): ``core.sqsum.sq_sum``'s blocked order, bit for bit, computed so that the sweeps which make the terms
can run on many threads (one large tensor) or for many tensors at once (a bucket of small ones).

``sqsum.sq_sum`` reads the n terms of a tensor as a zero-padded (K, G) matrix (G = nb·SQ_THREADS columns) and first
sums every column in row order: ``a[g] = x[0, g] + x[1, g] + ... + x[K-1, g]``.  Here that matrix is the *column
layout* of the flat buffer: ``full`` = n // G complete rows, then a ``tail`` row of n − full·G terms (the padding is
+0, and adding +0 to a sum of squares changes nothing, so absent terms are skipped).  A task that owns the columns
[c0, c1) sweeps rows 0, 1, ..., full − 1 and then the tail row (:func:`blocks`) and adds each row's terms to its
columns in row order (:func:`add_rows`; :func:`add_squares` squares them first): exactly ``a[c0:c1]``, whichever thread runs it.  :func:`sq_fold` finishes
the sum from ``a`` (the lane sums and the fold of the partials, ``blocks._sq_np``'s steps).  :func:`sq_rows` is
``sq_sum`` on every row of a (T, K·G) matrix of T tensors' padded squares, with a leading axis added to each step
(sequential sums only: ``add.reduce`` over a leading axis or ``add.accumulate``; never a pairwise inner loop).
tests/test_cpu_tensors.py checks them against ``sqsum.sq_sum``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from .sqsum import SQ_LANES, SQ_THREADS, cdiv as _cdiv, sq_layout


class Columns(NamedTuple):
    """The column layout of n terms: ``nb`` blocks, ``cols`` = G = nb·SQ_THREADS columns, ``full`` complete rows and
    a ``tail`` row of that many terms (0 ≤ tail < cols)."""

    nb: int
    cols: int
    full: int
    tail: int


@functools.lru_cache(maxsize=4096)
def columns(n: int) -> Columns:
    nb = sq_layout(n)[0]
    cols = nb * SQ_THREADS
    return Columns(nb, cols, n // cols, n - (n // cols) * cols)


def blocks(lay: Columns, c0: int, c1: int, chunk: int) -> list[tuple[int, int, int, int, bool]]:
    """The pieces of the flat buffer a task over columns [c0, c1) sweeps, in row order: ``(start, rows, width, col,
    first)`` = ``rows`` consecutive rows of ``width`` terms from column ``col``, starting at flat offset ``start``
    (contiguous: several rows only when the range is every column), ``first`` when they begin with row 0.  Rows
    shorter than half a chunk go several to a piece (fewer, longer NumPy calls)."""
    out = []
    cols, full = lay.cols, lay.full
    per = chunk // cols - 1 if c0 == 0 and c1 == cols else 0
    if per >= 1:
        for k in range(0, full, per):
            out.append((k * cols, min(per, full - k), cols, 0, k == 0))
    else:
        for k in range(full):
            out.extend((k * cols + a, 1, min(chunk, c1 - a), a, k == 0) for a in range(c0, c1, chunk))
    hi = min(c1, lay.tail)
    out.extend((full * cols + a, 1, min(chunk, hi - a), a, full == 0) for a in range(c0, hi, chunk))
    return out


def add_squares(acc: np.ndarray, x: np.ndarray, rows: int, first: bool, s: np.ndarray) -> None:
    """acc ← acc + x[0]² + x[1]² + ... (x: ``rows`` contiguous rows of ``acc.size`` terms), added in row order (with
    ``first``, acc ← x[0]² + x[1]² + ...); ``s``: scratch of at least (rows + 1)·acc.size elements (acc.size when
    rows is 1)."""
    w = acc.size
    if rows == 1:
        if first:
            np.multiply(x, x, acc)
        else:
            np.multiply(x, x, s[:w])
            np.add(acc, s[:w], acc)
        return
    sq = s[:(rows + 1) * w].reshape(rows + 1, w)
    if first:
        sq = sq[1:]
    else:
        sq[0] = acc
    np.multiply(x, x, sq[-rows:].reshape(-1))
    np.add.reduce(sq, axis=0, out=acc)  # over the leading axis: row order


def add_rows(acc: np.ndarray, s: np.ndarray, rows: int, first: bool) -> None:
    """acc ← acc + x[0] + x[1] + ... in row order (with ``first``, acc ← x[0] + x[1] + ...), the ``rows`` rows of
    ``acc.size`` terms x lying in ``s[w:(rows + 1)·w]`` (w = acc.size; ``s[:w]`` is free work space): the terms
    of any value, :func:`add_squares`' additions."""
    w = acc.size
    if rows == 1:
        if first:
            np.copyto(acc, s[w:2 * w])
        else:
            np.add(acc, s[w:2 * w], acc)
        return
    sq = s[:(rows + 1) * w].reshape(rows + 1, w)
    if first:
        sq = sq[1:]
    else:
        sq[0] = acc
    np.add.reduce(sq, axis=0, out=acc)  # over the leading axis: row order


def _finish(a: np.ndarray, nb: int, w: np.ndarray) -> np.ndarray:
    """The sums (T,) from the column sums a (T, nb·SQ_THREADS): ``blocks._sq_np`` from its lane sums on, and the fold
    of the partials when nb > 1, with a leading axis."""
    parts, w = _rows(a, 1, nb, w)
    if nb == 1:
        return parts[:, 0]
    t = a.shape[0]
    plen = _cdiv(nb, SQ_THREADS) * SQ_THREADS
    pb = w[:t * plen].reshape(t, plen)
    pb[:, nb:] = 0
    pb[:, :nb] = parts
    return _rows(pb, plen // SQ_THREADS, 1, w[t * plen:])[0][:, 0]


def _finish_len(t: int, nb: int) -> int:
    if nb == 1:
        return 2 * t * SQ_LANES
    plen = _cdiv(nb, SQ_THREADS) * SQ_THREADS
    return t * (2 * nb * SQ_LANES + plen + (SQ_THREADS if plen > SQ_THREADS else 0) + 2 * SQ_LANES)


def _rows(x: np.ndarray, k: int, nb: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``blocks._sq_np`` on every row of x (T, k·nb·SQ_THREADS): the (T, nb) partials and the rest of ``w``."""
    t = x.shape[0]
    g = nb * SQ_THREADS
    a = x
    if k > 1:
        a = w[:t * g].reshape(t, g)
        np.add.reduce(x.reshape(t, k, g), axis=1, out=a)  # over a leading axis: row order
        w = w[t * g:]
    b = w[:t * nb * SQ_LANES].reshape(t, nb, SQ_LANES)
    np.add.reduce(a.reshape(t, SQ_LANES, nb, SQ_LANES), axis=1, out=b)
    w = w[t * nb * SQ_LANES:]
    c = w[:t * nb * SQ_LANES].reshape(t, nb, SQ_LANES)
    np.add.accumulate(b, axis=2, out=c)  # sequential: c[..., -1] = b0 + b1 + ... in lane order
    return c[:, :, SQ_LANES - 1], w[t * nb * SQ_LANES:]


def fold_len(nb: int) -> int:
    """Elements of the work area :func:`sq_fold` needs for ``nb`` blocks."""
    return _finish_len(1, nb)


def sq_fold(a: np.ndarray, nb: int, work: np.ndarray) -> np.ndarray:
    """``sqsum.sq_sum``'s result (a 1-element view of ``work``) from the column sums ``a`` (nb·SQ_THREADS of them,
    not written); ``work`` holds ``fold_len(nb)`` free elements."""
    return _finish(a.reshape(1, -1), nb, work)


def rows_len(t: int, n: int) -> int:
    """Elements of the work area :func:`sq_rows` needs for ``t`` tensors of ``n`` elements."""
    nb, k = sq_layout(n)[:2]
    return (t * nb * SQ_THREADS if k > 1 else 0) + _finish_len(t, nb)


def sq_rows(x: np.ndarray, n: int, work: np.ndarray) -> np.ndarray:
    """``sqsum.sq_sum`` of every row of ``x`` (T, xlen of ``sq_layout(n)``: each row n terms ≥ +0, then zeros; not
    written): a (T,) view of ``work`` (``rows_len(T, n)`` free elements)."""
    nb, k, xlen = sq_layout(n)[:3]
    t = x.shape[0]
    g = nb * SQ_THREADS
    a = x
    if k > 1:
        a = work[:t * g].reshape(t, g)
        np.add.reduce(x.reshape(t, k, g), axis=1, out=a)
        work = work[t * g:]
    return _finish(a, nb, work)


def column_ranges(lay: Columns, width: int) -> list[tuple[int, int, int]]:
    """``(cost, c0, c1)``: the columns cut into ranges of ``width`` (the last shorter), ranges without a term left
    out; a range's cost is its number of terms."""
    out = []
    for c0 in range(0, lay.cols, width):
        c1 = min(c0 + width, lay.cols)
        cost = lay.full * (c1 - c0) + max(0, min(c1, lay.tail) - c0)
        if cost:
            out.append((cost, c0, c1))
    return out


# ---------------------------------------------------------------------------------------------------------
# Σ x² over several buffers in float64 (``distributed.global_norm``'s local sum): each buffer's sum in
# ``sqsum.sq_sum``'s blocked order over the terms float64(x)², then total = ((0 + S₀) + S₁) + ... in buffer order.
# NumPy sweeps the column layout in pieces of at most ``SUMSQ_CHUNK`` terms (no full-size float64 copy); CuPy runs
# ``kernels/sq_norm.cu`` (two launches per buffer, no host synchronisation).  Same bits on both, any thread count.
SUMSQ_CHUNK = 1 << 16


def sumsq64(xp, buffers) -> object:
    """Σ over ``buffers`` of Σ float64(x)² (the order above): a NumPy float64, or a 0-d float64 CuPy array."""
    bufs = [b if b.ndim == 1 else b.reshape(-1) for b in buffers if b.size]
    if xp is np:
        total = np.float64(0.0)
        for b in bufs:
            total = total + _sumsq64_np(b)
        return total
    from . import kernels  # (kernels imports the CuPy backend lazily)

    if not bufs:
        return xp.zeros((), np.float64)
    nbs = [sq_layout(b.size)[0] for b in bufs]
    out = xp.empty(1 + max(nbs), np.float64)  # total, then the partials of one buffer at a time (all written first)
    for i, (b, nb) in enumerate(zip(bufs, nbs)):
        kernels.get("sq_norm.cu", "sq64_partials", b.dtype)((nb,), (SQ_THREADS,),
                                                             (b, np.int64(b.size), np.int64(nb), out[1:]))
        kernels.get("sq_norm.cu", "sq64_fold", b.dtype)((1,), (SQ_THREADS,),
                                                        (out[1:], np.int64(nb), np.int32(i == 0), out[:1]))
    return out[0]


def _sumsq64_np(b: np.ndarray) -> np.float64:
    lay = columns(b.size)
    acc = np.zeros(lay.cols, np.float64)
    x64 = np.empty(SUMSQ_CHUNK, np.float64)
    s = np.empty(SUMSQ_CHUNK + lay.cols, np.float64)
    for start, rows, width, col, first in blocks(lay, 0, lay.cols, SUMSQ_CHUNK):
        x = x64[:rows * width]
        np.copyto(x, b[start:start + rows * width])
        add_squares(acc[col:col + width], x, rows, first, s)
    return np.float64(sq_fold(acc, lay.nb, np.empty(fold_len(lay.nb), np.float64))[0])

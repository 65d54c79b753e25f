"""The blocked sum of squares of Lamb, Mars and ``flatopt.gradients.global_norm``: one fixed order of additions on
NumPy, CuPy and CUDA (``kernels/sq_sum.cuh``), so that a norm has the same bits on every path.

Every term is a square (+0, positive, +inf or NaN), so adding +0 changes nothing and stands for an absent term.
A sum over n terms with nb blocks of SQ_THREADS threads (G = nb·SQ_THREADS threads in all) reads the terms as a
zero-padded (K, G) matrix, K = ceil(n / G) (a grid-stride loop: column g holds terms g, g + G, g + 2G, ...).
Thread t = i·L + j of block c (L = SQ_LANES, SQ_THREADS = L·L) owns column g = i·(nb·L) + c·L + j, and::

    a[g]    = x[0, g] + x[1, g] + ... + x[K-1, g]     (in order: the thread's sequential sum)
    b[c, j] = a at i = 0, 1, ..., L-1 (in order)       (the block's lane sums)
    P[c]    = b[c, 0] + b[c, 1] + ... + b[c, L-1]      (in order: the block's partial)

Pass 1 of a kernel has nb = sq_blocks(n) blocks (at most SQ_ROWS terms per thread); with nb = 1 the sum is P[0],
otherwise the fold is the same with one block over the nb partials (sq_block / sq_fold in kernels/sq_sum.cuh, pasted
into the generated kernels of a definition with a sum: core/elementwise/reduce.py).  A warp reads two runs of L consecutive elements: every byte of each 32-byte sector is used.
On NumPy each sequential sum is an ``add.reduce`` over a leading axis (the inner loop runs along the other axes:
never pairwise) or an ``add.accumulate`` (sequential by definition), so the layout above keeps the inner loops
long; elsewhere (CuPy, whose own reductions add in CUB's order, and the device stand-ins) every step is an
in-place elementwise add.  tests/test_catalogue_elementwise.py checks the two against a scalar transcription.
``core.norms`` computes the same sums on NumPy from column sums (Lamb's and Mars's threaded phases and rows).
"""

from __future__ import annotations

import functools

import numpy as np

SQ_THREADS = 256
SQ_LANES = 16
SQ_ROWS = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sq_blocks(n: int) -> int:
    """Blocks of a kernel's first pass over n terms (= partial sums): at most SQ_ROWS terms per thread."""
    return max(1, cdiv(n, SQ_ROWS * SQ_THREADS))


@functools.lru_cache(maxsize=4096)
def sq_layout(n: int) -> tuple[int, int, int, int, int]:
    """(blocks, K, padded length of the terms, length of the partials' buffer, scratch length) of ``sq_sum``."""
    nb = sq_blocks(n)
    k = max(1, cdiv(n, nb * SQ_THREADS))
    xlen = k * nb * SQ_THREADS
    plen = cdiv(nb, SQ_THREADS) * SQ_THREADS if nb > 1 else 0
    work = nb * SQ_THREADS + 2 * nb * SQ_LANES + nb + SQ_THREADS + 2 * SQ_LANES
    return nb, k, xlen, plen, xlen + plen + work


def sq_scratch(xp, n: int, dtype):
    """The zero-filled scratch of ``sq_sum`` over n terms (allocate once per name; its first n elements are free for
    other use between sums, the rest must stay as ``sq_sum`` leaves it)."""
    return xp.zeros(sq_layout(n)[4], dtype)


def _sq_np(x, k: int, nb: int, w):
    """NumPy: P (nb,) of the zero-padded terms x (k·G elements); ``w``: the free work area."""
    g = nb * SQ_THREADS
    a = x[:g]
    if k > 1:
        a = w[:g]
        np.add.reduce(x.reshape(k, g), axis=0, out=a)
    w = w[g:]
    b = w[:nb * SQ_LANES].reshape(nb, SQ_LANES)
    np.add.reduce(a.reshape(SQ_LANES, nb, SQ_LANES), axis=0, out=b)
    w = w[nb * SQ_LANES:]
    if nb == 1:
        out = w[:SQ_LANES]
        np.add.accumulate(b[0], out=out)
        return out[-1:], w[SQ_LANES:]
    bt = w[:nb * SQ_LANES].reshape(SQ_LANES, nb)
    np.copyto(bt.T, b)
    parts = w[nb * SQ_LANES:nb * SQ_LANES + nb]
    np.add.reduce(bt, axis=0, out=parts)
    return parts, w[nb * SQ_LANES + nb:]


def _sq_ops(xp, x, k: int, nb: int):
    """Elementwise operations only: P (nb,) in place (every write lands on a column at or before its sources, so
    the zero padding stays zero)."""
    g = nb * SQ_THREADS
    x2 = x.reshape(k, g)
    a = x2[0]
    for r in range(1, k):
        xp.add(a, x2[r], out=a)
    a3 = a.reshape(SQ_LANES, nb, SQ_LANES)
    b = a3[0]
    for i in range(1, SQ_LANES):
        xp.add(b, a3[i], out=b)
    for j in range(1, SQ_LANES):
        xp.add(b[:, 0], b[:, j], out=b[:, 0])
    return b[:, 0]


def sq_sum(xp, buf, n: int):
    """Σ buf[i] for i < n, buf[:n] holding squares (or any terms ≥ +0), in the blocked order above; ``buf`` is
    ``sq_scratch(xp, n, dtype)`` (the squares are overwritten).  Returns a 1-element view of ``buf``."""
    nb, k, xlen, plen, _ = sq_layout(n)
    if nb == 1 and xp is np:  # _sq_np's one-block case, with fewer Python steps (small tensors)
        a = buf[:SQ_THREADS]
        if k > 1:
            a = buf[xlen:xlen + SQ_THREADS]
            np.add.reduce(buf[:xlen].reshape(k, SQ_THREADS), axis=0, out=a)
        b = buf[xlen + SQ_THREADS:xlen + SQ_THREADS + SQ_LANES]
        np.add.reduce(a.reshape(SQ_LANES, SQ_LANES), axis=0, out=b)
        c = buf[xlen + SQ_THREADS + SQ_LANES:xlen + SQ_THREADS + 2 * SQ_LANES]
        np.add.accumulate(b, out=c)
        return c[SQ_LANES - 1:]
    x = buf[:xlen]
    if xp is np:
        parts, w = _sq_np(x, k, nb, buf[xlen + plen:])
    else:
        parts = _sq_ops(xp, x, k, nb)
    if nb == 1:
        return parts
    pb = buf[xlen:xlen + plen]
    pb[:nb] = parts  # the tail stays zero
    if xp is np:
        return _sq_np(pb, plen // SQ_THREADS, 1, w)[0]
    return _sq_ops(xp, pb, plen // SQ_THREADS, 1)

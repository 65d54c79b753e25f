"""Dense linear algebra on NumPy's BLAS where ``numpy.linalg`` is slow or allocates (NumPy only).

``numpy.linalg.qr`` computes a float32 input in float64 (``_commonType``) through the reference LAPACK bundled with
OpenBLAS, and allocates its copies at every call: much slower than ``householder_q`` on large matrices (below 2^16
elements it is the faster one, and ``householder_q`` hands such matrices to it; re-measure: ``python -m
benchmarks.run --only stiefel``, whose step is mostly this QR).  ``householder_q`` is LAPACK's algorithm
(``dgeqrf`` + ``dorgqr``: the reflectors of ``dlarfg``, the compact WY form of ``dlarft``, blocked trailing updates and the backward formation of Q by matrix
products) in the input's dtype, with every temporary in this thread's ``core.workspace`` buffers: after the first
call of a size it allocates nothing of the matrix's size.  Same reflectors, so the same Q as LAPACK's up to
rounding, column signs included (and up to the choice of basis where the input is rank-deficient).  The pivots
are read on the host, so it is not for CuPy (cuSOLVER's ``qr`` there).  ``scratch`` hands out the temporaries
of the per-tensor algorithms (Soap, Stiefel) the same way.
"""

from __future__ import annotations

import math

import numpy as np

from . import workspace

QR_BLOCK = 48  # columns per panel: the fastest of 32/48/64 on a 2048×2048 fp32 QR (``benchmarks.run --only stiefel``)


def _ws(key: str, shape: tuple, dtype):
    return workspace.get(np, "linalg_" + key, math.prod(shape), dtype).reshape(shape)


def scratch(xp, key: str, shape, dtype):
    """A scratch array for the per-tensor algorithms' matrix work: this thread's ``core.workspace`` buffer on NumPy
    (overwritten by the next user of ``key`` on this thread, so one key per live temporary; keys are global, so
    prefix them with the algorithm), a fresh pool allocation on CuPy."""
    if xp is not np:
        return xp.empty(shape, dtype)
    return workspace.get(xp, key, math.prod(shape), dtype).reshape(shape)


SMALL_QR = 1 << 16  # below this many elements numpy.linalg.qr is faster (figures: benchmarks/README.md): the
# panels' Python loop costs more than its float64 detour there; its temporaries (a few times the matrix, in float64) are allocated


def householder_q(a, out=None):
    """``(Q, diag(R))`` of the reduced Householder QR of a square or tall matrix ``a`` (not modified); Q is
    written into ``out`` when given (shape of ``a``, C-contiguous, not overlapping ``a``).  Matrices of fewer than
    ``SMALL_QR`` elements go to ``numpy.linalg.qr`` (the same LAPACK reflectors, in float64)."""
    n, p = a.shape
    dt = a.dtype
    if n * p < SMALL_QR:
        q64, r64 = np.linalg.qr(a)
        if out is None:
            out = np.empty((n, p), dt)
        out[...] = q64
        return out, np.diagonal(r64).astype(dt)
    work = _ws("a", (n, p), dt)
    work[...] = a
    rdiag = np.empty(p, dt)
    q = np.empty((n, p), dt) if out is None else out
    nblocks = -(-p // QR_BLOCK)
    ts = _ws("t", (max(nblocks, 1), QR_BLOCK, QR_BLOCK), dt)
    for b, k0 in enumerate(range(0, p, QR_BLOCK)):
        kb = min(QR_BLOCK, p - k0)
        panel = work[k0:, k0:k0 + kb]
        tau = np.zeros(kb, dt)
        for j in range(kb):  # dgeqr2 on the panel: reflectors stored below the diagonal
            x = panel[j:, j]
            alpha = float(x[0])
            xnorm = float(np.linalg.norm(x[1:])) if x.size > 1 else 0.0
            if xnorm == 0.0:  # H = I (tau = 0), R_jj = alpha
                rdiag[k0 + j] = alpha
                x[1:] = 0.0
                continue
            beta = -math.copysign(math.hypot(alpha, xnorm), alpha)
            tau[j] = (beta - alpha) / beta
            x[1:] *= 1.0 / (alpha - beta)
            x[0] = 1.0
            rdiag[k0 + j] = beta
            if j + 1 < kb:
                trail = panel[j:, j + 1:]
                w = np.matmul(x, trail, out=_ws("w", (kb - j - 1,), dt))
                w *= tau[j]
                trail -= np.multiply.outer(x, w, out=_ws("outer", trail.shape, dt))
        v = _ws("v", (n - k0, kb), dt)  # V: the panel's reflectors as a unit lower trapezoid
        v[...] = panel
        for j in range(kb):
            v[:j, j] = 0.0
            v[j, j] = 1.0
        t = ts[b, :kb, :kb]  # dlarft: H_1 ... H_kb = I - V T V^T
        t[...] = 0.0
        vtv = np.matmul(v.T, v, out=_ws("vtv", (kb, kb), dt))
        for j in range(kb):
            t[j, j] = tau[j]
            if j:
                np.matmul(t[:j, :j], vtv[:j, j], out=t[:j, j])
                t[:j, j] *= -tau[j]
        if k0 + kb < p:  # trailing update: rest <- (I - V T^T V^T) rest
            rest = work[k0:, k0 + kb:]
            _apply(v, t.T, rest, dt)
        work[k0:, k0:k0 + kb] = v  # keep V for the formation of Q (the panel's R is no longer needed)
    q[...] = 0.0
    np.fill_diagonal(q, 1.0)
    for b in reversed(range(nblocks)):  # dorgqr: Q = H_1 ... H_p [I; 0], applied block by block from the last
        k0 = b * QR_BLOCK
        kb = min(QR_BLOCK, p - k0)
        _apply(work[k0:, k0:k0 + kb], ts[b, :kb, :kb], q[k0:, k0:], dt)
    return q, rdiag


def _apply(v, t, x, dt) -> None:
    """x <- x − V·(T·(Vᵀ·x)) in place, every temporary in workspace buffers."""
    kb, cols = v.shape[1], x.shape[1]
    vtx = np.matmul(v.T, x, out=_ws("vtx", (kb, cols), dt))
    tvtx = np.matmul(t, vtx, out=_ws("tvtx", (kb, cols), dt))
    x -= np.matmul(v, tvtx, out=_ws("vtvtx", x.shape, dt))

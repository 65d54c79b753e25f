"""SOAP's per-tensor linear algebra, written once against the array module ``xp`` (NumPy or CuPy).

``Layout`` says which axes of a parameter are preconditioned and where each axis' statistic Lᵢ and basis Qᵢ
(dᵢ×dᵢ, row-major) sit in the flat ``gg``/``q`` buffers (concatenated in axis order).  ``project`` is P (multiply
axis i by Qᵢᵀ), ``project_back`` is P⁻¹ (by Qᵢ); ``gram`` is Oᵢ(G) = G₍ᵢ₎G₍ᵢ₎ᵀ; ``eigenbasis`` the first call's
``eigh``; ``refresh`` the power iteration + QR of every ``precondition_frequency``-th step (on NumPy by
``householder_q``, a blocked Householder QR on NumPy's BLAS in the parameter's dtype).

Nothing here reads a device value on the host: the permutation of ``refresh`` stays a device array, and
``xp.linalg.eigh``/``qr`` on CuPy only check cuSOLVER's status (a host read) under
``cupyx.errstate(linalg="raise")``, which flatopt never sets.  The float64 retry of a failed ``eigh`` therefore
exists on NumPy only (LAPACK raises ``LinAlgError``); on CuPy a failed float32 ``eigh`` leaves non-finite values in
Q, which detecting would take a host synchronisation per refresh.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    axes: tuple[tuple[int, int, int], ...]  # (axis, d, offset into gg/q) of every preconditioned axis
    size: int  # Σ dᵢ² over the preconditioned axes

    def factors(self, flat) -> list:
        """Per axis of ``shape``: the (d, d) view of ``flat`` for a preconditioned axis, else ``None``."""
        out = [None] * len(self.shape)
        for axis, d, off in self.axes:
            out[axis] = flat[off:off + d * d].reshape(d, d)
        return out


def make_layout(shape: tuple[int, ...], max_precond_dim: int, precondition_1d: bool) -> Layout:
    if len(shape) == 1:
        pre = (precondition_1d and shape[0] <= max_precond_dim,)
    else:
        pre = tuple(d <= max_precond_dim for d in shape)
    axes, off = [], 0
    for axis, (d, on) in enumerate(zip(shape, pre)):
        if on:
            axes.append((axis, d, off))
            off += d * d
    return Layout(tuple(shape), tuple(axes), off)


def project(xp, x, qs: list):
    """P(x): axis i multiplied by Qᵢᵀ for every preconditioned i (``tensordot`` over axis 0, cycling the axes)."""
    if len(qs) == 2:  # the common case as two products: Q_Lᵀ · x · Q_R
        ql, qr = qs
        if ql is not None:
            x = xp.matmul(ql.T, x)
        return x if qr is None else xp.matmul(x, qr)
    for q in qs:
        x = xp.moveaxis(x, 0, -1) if q is None else xp.tensordot(x, q, axes=([0], [0]))
    return x


def project_back(xp, x, qs: list):
    """P⁻¹(x): axis i multiplied by Qᵢ."""
    if len(qs) == 2:
        ql, qr = qs
        if ql is not None:
            x = xp.matmul(ql, x)
        return x if qr is None else xp.matmul(x, qr.T)
    for q in qs:
        x = xp.moveaxis(x, 0, -1) if q is None else xp.tensordot(x, q, axes=([0], [1]))
    return x


def gram(xp, g, axis: int):
    """Oᵢ(G) = G₍ᵢ₎G₍ᵢ₎ᵀ, every axis but ``axis`` contracted (``a @ a.T``: NumPy's BLAS takes its syrk path)."""
    if g.ndim == 1:
        return g[:, None] * g[None, :]
    a = xp.moveaxis(g, axis, 0).reshape(g.shape[axis], -1)
    return xp.matmul(a, a.T)


def eigenbasis(xp, stat):
    """Eigenvectors of ``stat + 1e-30·I``, columns in descending eigenvalue order, in ``stat``'s dtype (NumPy:
    retried in float64 when LAPACK fails to converge)."""
    d = stat.shape[0]
    try:
        _, vecs = xp.linalg.eigh(stat + 1e-30 * xp.eye(d, dtype=stat.dtype))
    except np.linalg.LinAlgError:
        s64 = stat.astype(np.float64)
        _, vecs = xp.linalg.eigh(s64 + 1e-30 * xp.eye(d, dtype=np.float64))
        vecs = vecs.astype(stat.dtype)
    return vecs[:, ::-1]


def refresh(xp, stats: list, bases: list, v):
    """One power iteration per preconditioned axis, in axis order: M = LᵢQᵢ, the estimated eigenvalues
    diag(QᵢᵀLᵢQᵢ) sort the columns (descending), v is permuted along axis i the same way, and Qᵢ becomes the Q of
    the reduced QR of M's permuted columns.  ``bases`` are updated in place; returns the permuted v."""
    for axis, (stat, q) in enumerate(zip(stats, bases)):
        if q is None:
            continue
        m = xp.matmul(stat, q)
        est = xp.sum(q * m, axis=0)
        perm = xp.argsort(-est)
        v = xp.take(v, perm, axis=axis)
        m = xp.take(m, perm, axis=1)
        q[...] = householder_q(m) if xp is np else xp.linalg.qr(m)[0]
    return v


QR_BLOCK = 48  # columns per panel of ``householder_q`` (measured at d = 2048, fp32: 32 0.56 s, 48 0.50 s, 64 0.55 s)


def householder_q(a):
    """The Q of the reduced QR of a square or tall NumPy matrix ``a``, in ``a``'s dtype: blocked Householder (LAPACK
    ``geqrf`` + ``orgqr``: the reflectors of ``dlarfg``, the compact WY form of ``dlarft``, trailing updates and
    the formation of Q by matrix products).  ``numpy.linalg.qr`` runs a float32 input in float64 through the
    reference LAPACK bundled with OpenBLAS: measured ~10× slower at d = 2048 than this, which is BLAS-3 except
    for the panels.  Same reflectors, so the same Q as LAPACK's up to rounding (and up to the choice of basis where
    ``a`` is rank-deficient).  NumPy only: the pivots are read on the host (CuPy uses cuSOLVER's ``qr``)."""
    n, p = a.shape
    dt = a.dtype
    a = a.copy()
    blocks = []
    for k0 in range(0, p, QR_BLOCK):
        kb = min(QR_BLOCK, p - k0)
        panel = a[k0:, k0:k0 + kb]
        v = np.zeros((n - k0, kb), dt)
        tau = np.zeros(kb, dt)
        for j in range(kb):
            x = panel[j:, j]
            alpha = float(x[0])
            xnorm = float(np.linalg.norm(x[1:])) if x.size > 1 else 0.0
            v[j, j] = 1.0
            if xnorm == 0.0:
                continue  # H = I (tau = 0)
            beta = -math.copysign(math.hypot(alpha, xnorm), alpha)
            tau[j] = (beta - alpha) / beta
            np.multiply(x[1:], 1.0 / (alpha - beta), out=v[j + 1:, j])
            if j + 1 < kb:
                vj = v[j:, j]
                trail = panel[j:, j + 1:]
                trail -= np.multiply.outer(vj, (vj @ trail) * tau[j])
        t = np.zeros((kb, kb), dt)  # H_1 ... H_kb = I - V T V^T
        vtv = v.T @ v
        for j in range(kb):
            t[j, j] = tau[j]
            if j:
                t[:j, j] = -tau[j] * (t[:j, :j] @ vtv[:j, j])
        if k0 + kb < p:
            rest = a[k0:, k0 + kb:]
            rest -= v @ (t.T @ (v.T @ rest))
        blocks.append((k0, v, t))
    q = np.eye(n, p, dtype=dt)
    for k0, v, t in reversed(blocks):
        sub = q[k0:, k0:]
        sub -= v @ (t @ (v.T @ sub))
    return q

"""SOAP's per-tensor linear algebra, written once against the array module ``xp`` (NumPy or CuPy).

``Layout`` says which axes of a parameter are preconditioned and where each axis' statistic Lᵢ and basis Qᵢ
(dᵢ×dᵢ, row-major) sit in the flat ``gg``/``q`` buffers (concatenated in axis order).  ``project`` is P (multiply
axis i by Qᵢᵀ), ``project_back`` is P⁻¹ (by Qᵢ); ``gram`` is Oᵢ(G) = G₍ᵢ₎G₍ᵢ₎ᵀ; ``eigenbasis`` the first call's
``eigh``; ``refresh`` the power iteration + QR of every ``precondition_frequency``-th step (on NumPy by
``core.linalg.householder_q``, LAPACK's blocked Householder QR on NumPy's BLAS in the parameter's dtype).  On
NumPy the temporaries of a vector or matrix step are this thread's ``core.workspace`` buffers, so such a step
allocates nothing of the parameter's size after the first (> 2-D tensors use ``tensordot``, which allocates).

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

from ..core import linalg


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


def buf(xp, key: str, shape, dtype):
    """Scratch (``core.linalg.scratch``: per-thread and reused on NumPy, one key per live temporary)."""
    return linalg.scratch(xp, "soap_" + key, shape, dtype)


def project(xp, x, qs: list, back: bool = False, keys=("pa", "pb")):
    """P(x) (axis i multiplied by Qᵢᵀ), or P⁻¹(x) with ``back`` (by Qᵢ).  A vector or a matrix: at most two
    products into the scratch ``keys`` (x itself when nothing is preconditioned); more dims: ``tensordot`` over
    axis 0 cycling the axes (allocating)."""
    if x.ndim == 1:
        q = qs[0]
        return x if q is None else xp.matmul(q if back else q.T, x, out=buf(xp, keys[0], x.shape, x.dtype))
    if x.ndim == 2:
        ql, qr = qs
        if ql is not None:
            x = xp.matmul(ql if back else ql.T, x, out=buf(xp, keys[0], x.shape, x.dtype))
        if qr is not None:
            x = xp.matmul(x, qr.T if back else qr, out=buf(xp, keys[1], x.shape, x.dtype))
        return x
    for q in qs:
        x = xp.moveaxis(x, 0, -1) if q is None else xp.tensordot(x, q, axes=([0], [1 if back else 0]))
    return x


def gram(xp, g, axis: int):
    """Oᵢ(G) = G₍ᵢ₎G₍ᵢ₎ᵀ in scratch, every axis but ``axis`` contracted (``a @ a.T``: NumPy's BLAS takes its
    syrk path)."""
    d = g.shape[axis]
    out = buf(xp, f"gram{axis}", (d, d), g.dtype)
    if g.ndim == 1:
        return xp.multiply(g[:, None], g[None, :], out=out)
    a = g if axis == 0 else xp.moveaxis(g, axis, 0)
    a = a.reshape(d, -1)
    return xp.matmul(a, a.T, out=out)


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


def refresh(xp, stats: list, bases: list, v) -> None:
    """One power iteration per preconditioned axis, in axis order: M = LᵢQᵢ, the estimated eigenvalues
    diag(QᵢᵀLᵢQᵢ) sort the columns (descending), v (in the parameter's shape) is permuted along axis i the same
    way, and Qᵢ becomes the Q of the reduced QR of M's permuted columns.  ``bases`` and ``v`` change in place."""
    for axis, (stat, q) in enumerate(zip(stats, bases)):
        if q is None:
            continue
        d = q.shape[0]
        m = xp.matmul(stat, q, out=buf(xp, "rm", (d, d), q.dtype))
        est = xp.sum(xp.multiply(q, m, out=buf(xp, "rqm", (d, d), q.dtype)), axis=0)
        perm = xp.argsort(-est)
        v[...] = _take(xp, v, perm, axis, buf(xp, "rv", v.shape, v.dtype))
        m = _take(xp, m, perm, 1, buf(xp, "rmp", (d, d), q.dtype))
        if xp is np:
            linalg.householder_q(m, out=q)
        else:
            q[...] = xp.linalg.qr(m)[0]


def _take(xp, a, idx, axis: int, out):
    """``take`` into ``out``; on NumPy with ``mode="clip"`` (the indices are a permutation), because NumPy buffers
    ``out`` in a fresh copy under the default ``mode="raise"``."""
    if xp is np:
        return np.take(a, idx, axis=axis, out=out, mode="clip")
    return xp.take(a, idx, axis=axis, out=out)

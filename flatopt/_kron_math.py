"""KronPsgd array math, written once against the array module ``xp`` (NumPy or CuPy).

A factor is ``(True, q)`` for a diagonal factor (a vector) or ``(False, Q)`` for a dense upper-triangular one;
the views point into the packed ``q`` buffer of the state, so updating a view updates the state.  Mode i of a
tensor is its axis i; ``X ×_i M`` multiplies the mode-i fibres by M (see ``reference/kron.md`` §1).  Nothing here
synchronises with the host: norms, lower bounds and guards stay 0-d device arrays.
"""

from __future__ import annotations

import math

import numpy as np

from . import _backend

SQRT_EPS_F32 = math.sqrt(float(np.finfo(np.float32).eps))  # kron_torch's damping factor, 2^-11.5 (in the fit dtype)


def factor_views(q, lay) -> list:
    out = []
    for d, is_diag, off in zip(lay.merged, lay.diag, lay.offsets):
        out.append((True, q[off:off + d]) if is_diag else (False, q[off:off + d * d].reshape(d, d)))
    return out


def _bcast(v, i: int, k: int):
    """A vector along axis i of a k-D tensor."""
    return v.reshape((-1,) + (1,) * (k - 1 - i))


def mode_mul(xp, x, m, i: int, transpose: bool = False):
    """x ×_i M (or x ×_i Mᵀ when ``transpose``)."""
    if x.ndim == 1:
        return (m.T if transpose else m) @ x
    if x.ndim == 2:
        if i == 0:
            return (m.T if transpose else m) @ x
        return x @ (m if transpose else m.T)
    y = xp.tensordot(m.T if transpose else m, x, axes=([1], [i]))
    return xp.moveaxis(y, 0, i)


_LEAF = 32
_scipy_trsm = None


def _solve_upper_t(xp, q, b):
    """Q⁻ᵀ·B for an upper-triangular Q (a forward substitution with Qᵀ), B of shape (d, n).

    CuPy: cuBLAS trsm through ``cupyx.scipy.linalg.solve_triangular``.  NumPy: ``_lower_solve``; for large
    systems (d²·n >= 2²²) SciPy's trsm when SciPy is importable (an optional accelerator, 2-4x faster there; SciPy
    is not a dependency; below that size its threaded OpenBLAS costs more than the solve)."""
    if xp is not np:
        return _backend.solve_triangular()(q, b, trans="T", lower=False, check_finite=False)
    global _scipy_trsm
    if q.shape[0] ** 2 * b.shape[1] >= 1 << 22:
        if _scipy_trsm is None:
            try:
                from scipy.linalg import solve_triangular  # noqa: PLC0415

                _scipy_trsm = solve_triangular
            except ImportError:
                _scipy_trsm = False
        if _scipy_trsm:
            return _scipy_trsm(q, b, trans="T", lower=False, check_finite=False)
    out = np.empty(b.shape, np.result_type(q, b))
    _lower_solve(q.T, b, out)
    return out


def _lower_solve(low, b, out) -> None:
    """out = L⁻¹·B for a lower-triangular L, NumPy only: a recursive blocked forward substitution (the updates are
    GEMMs); a leaf of at most 32 rows is solved by ``numpy.linalg.solve`` on its row-and-column reversal, which is
    upper triangular, so LAPACK's LU neither pivots nor eliminates (every multiplier is exactly 0) and the solve is
    exactly a triangular substitution."""
    d = low.shape[0]
    if d <= _LEAF:
        out[...] = np.linalg.solve(low[::-1, ::-1], b[::-1])[::-1]
        return
    h = (d // 2 + _LEAF - 1) // _LEAF * _LEAF
    _lower_solve(low[:h, :h], b[:h], out[:h])
    rest = b[h:] - low[h:, :h] @ out[:h]
    _lower_solve(low[h:, h:], rest, out[h:])


def apply_factors(xp, factors, h):
    """A = h ×_1 Q_1 … ×_k Q_k (diagonal factors scale their axis)."""
    k = h.ndim
    a = h
    for i, (is_diag, q) in enumerate(factors):
        a = a * _bcast(q, i, k) if is_diag else mode_mul(xp, a, q, i)
    return a


def solve_factors(xp, factors, v):
    """B̄ = V ×_1 Q_1⁻ᵀ … ×_k Q_k⁻ᵀ (diagonal factors divide their axis)."""
    k = v.ndim
    b = v
    for i, (is_diag, q) in enumerate(factors):
        if is_diag:
            b = b / _bcast(q, i, k)
            continue
        moved = xp.moveaxis(b, i, 0)
        rest = moved.shape[1:]
        sol = _solve_upper_t(xp, q, moved.reshape(q.shape[0], -1))
        b = xp.moveaxis(sol.reshape((q.shape[0],) + rest), 0, i)
    return b


def gram(xp, x, i: int, is_diag: bool):
    """Mode-i contraction of x with itself: the d_i×d_i Gram matrix, or only its diagonal."""
    others = tuple(j for j in range(x.ndim) if j != i)
    if is_diag:
        return xp.sum(x * x, axis=others) if others else x * x
    if x.ndim == 2:
        xc = xp.ascontiguousarray(x)
        return xc @ xc.T if i == 0 else xc.T @ xc
    return xp.tensordot(x, x, axes=(others, others))


def spectral_lower_bound(xp, s, amax):
    """kron_torch's cheap lower bound of ‖S‖₂ (0 where max|S| = 0): M = S/max|S|; x = the column of M with the
    largest norm (the first on ties); y = xᵀM/‖xᵀM‖; lb = ‖M·y‖·max|S|."""
    pos = amax > 0
    safe = xp.where(pos, amax, 1)
    m = s / safe
    i = xp.argmax(xp.sum(m * m, axis=0))
    x = xp.take(m, i, axis=1)
    y = x @ m
    y = y / xp.where(pos, xp.sqrt(xp.sum(y * y)), 1)
    z = m @ y
    return xp.where(pos, xp.sqrt(xp.sum(z * z)) * safe, amax)


def update_precond(xp, factors, h, v, eta: float, floor: float) -> None:
    """One Lie-group step of every factor, fitted on the pair (V, h), with A and B̄ from the old factors.

    dense:    Q ← Q − η·triu(T1 − T2)·Q / max(lb(T1 + T2), floor)
    diagonal: q ← q − η·(T1 − T2)·q / max(max|T1 + T2|, floor)
    A factor whose new value is not finite keeps its old value (decided on the device: no host sync)."""
    a = apply_factors(xp, factors, h)
    b = solve_factors(xp, factors, v)
    for i, (is_diag, q) in enumerate(factors):
        t1 = gram(xp, a, i, is_diag)
        t2 = gram(xp, b, i, is_diag)
        d = t1 - t2
        s = t1
        s += t2
        d *= eta
        amax = xp.max(xp.abs(s))
        if is_diag:
            d *= q / xp.maximum(amax, floor)
            new = q - d
        else:
            d = xp.triu(d)
            d /= xp.maximum(spectral_lower_bound(xp, s, amax), floor)
            new = q - d @ q
        q[...] = xp.where(xp.all(xp.isfinite(new)), new, q)


def balance(xp, factors) -> None:
    """Rescale the factors to the geometric mean of their max-abs values (their Kronecker product is unchanged)."""
    norms = xp.stack([xp.max(xp.abs(q)) for _, q in factors])
    gmean = xp.exp(xp.mean(xp.log(norms)))
    for j, (_, q) in enumerate(factors):
        q *= gmean / norms[j]


def precondition(xp, factors, g):
    """u = g ×_1 (Q_1ᵀQ_1) … ×_k (Q_kᵀQ_k) (diagonal factors: × q_i² along axis i).

    Per dense factor, the cheaper of Qᵀ·(Q·X) and (QᵀQ)·X (QᵀQ is a SYRK) is used."""
    k = g.ndim
    u = g
    for i, (is_diag, q) in enumerate(factors):
        if is_diag:
            u = u * _bcast(q * q, i, k)
            continue
        d = q.shape[0]
        if d < 2 * (u.size // d):  # SYRK d³/2 + d²·n < 2·d²·n
            u = mode_mul(xp, u, q.T @ q, i)
        else:
            u = mode_mul(xp, mode_mul(xp, u, q, i), q, i, transpose=True)
    return u


def clip_rms(xp, u, clip: float):
    """u ← u·min(1, clip/(RMS(u) + 1e-12)) on the device."""
    rms = xp.sqrt(xp.mean(u * u))
    u *= xp.minimum(1.0, clip / (rms + 1e-12)).astype(u.dtype)
    return u

"""KronPsgd array math, written once against the array module ``xp`` (NumPy or CuPy).

A factor is ``(True, q)`` for a diagonal factor (a vector) or ``(False, Q)`` for a dense upper-triangular one;
the views point into the packed ``q`` buffer of the state, so updating a view updates the state.  Mode i of a
tensor is its axis i; ``X ×_i M`` multiplies the mode-i fibres by M (the n-mode product of
Kolda & Bader, "Tensor Decompositions and Applications").  Nothing here
synchronises with the host: norms, lower bounds and guards stay 0-d device arrays.
"""

from __future__ import annotations

import math

import numpy as np

from ..core import backend, workspace
from . import blocked as B

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


def scratch(xp, key: str, shape, dtype, order: str = "C"):
    """A scratch array of ``shape`` in C (or F) order: a per-thread ``core.workspace`` buffer on NumPy (overwritten by
    the next user of ``key`` on this thread), a fresh pool allocation on CuPy."""
    shape = tuple(shape)
    if xp is not np:
        return xp.empty(shape, dtype, order=order)
    n = math.prod(shape)
    buf = workspace.get(xp, "kron_" + key, n, dtype)
    if order == "F" and len(shape) > 1:
        return buf.reshape(shape[::-1]).T
    return buf.reshape(shape)


def _like(xp, key: str, x, dtype=None):
    """Scratch with the memory layout NumPy gives a ufunc result on ``x`` (F order for an F-only array)."""
    f = x.ndim > 1 and x.flags.f_contiguous and not x.flags.c_contiguous
    return scratch(xp, key, x.shape, x.dtype if dtype is None else dtype, "F" if f else "C")


def _solve_upper_t(xp, q, b, key: str | None = None):
    """Q⁻ᵀ·B for an upper-triangular Q (a forward substitution with Qᵀ), B of shape (d, n).

    CuPy: cuBLAS trsm through ``cupyx.scipy.linalg.solve_triangular``.  NumPy: ``_lower_solve`` (NumPy's own BLAS
    only: SciPy's trsm, faster on its own, brings a second OpenBLAS whose idle threads spin against NumPy's and
    slow the whole step down; re-measure: ``python -m benchmarks.run --only kron``)."""
    if xp is not np:
        return backend.solve_triangular()(q, b, trans="T", lower=False, check_finite=False)
    if key is None:
        out = np.empty(b.shape, np.result_type(q, b))
    else:
        out = scratch(xp, key, b.shape, np.result_type(q.dtype, b.dtype))
    _lower_solve(q.T, b, out, key)
    return out


def _lower_solve(low, b, out, key: str | None = None, depth: int = 0) -> None:
    """out = L⁻¹·B for a lower-triangular L, NumPy only: a recursive blocked forward substitution (the updates are
    GEMMs); a leaf of at most 32 rows is one GEMM with the leaf's inverse, L⁻¹ = P·(P·L·P)⁻¹·P (P the reversal):
    P·L·P is upper triangular, so LAPACK's LU in ``numpy.linalg.inv`` neither pivots nor eliminates (every
    multiplier is exactly 0) and the inverse is its triangular inverse.  Only the 32×32 inverse is allocated (a
    ``solve`` with the leaf's 32 right-hand-side rows allocates several copies of them).
    With ``key``, the right-hand sides of the lower halves are formed in per-thread scratch (the same operations)
    instead of fresh arrays."""
    d = low.shape[0]
    if d <= _LEAF:
        np.matmul(np.linalg.inv(low[::-1, ::-1])[::-1, ::-1], b, out=out)
        return
    h = (d // 2 + _LEAF - 1) // _LEAF * _LEAF
    _lower_solve(low[:h, :h], b[:h], out[:h], key, depth + 1)
    if key is None:
        rest = b[h:] - low[h:, :h] @ out[:h]
    else:
        rest = scratch(np, f"{key}_rest{depth}", (d - h,) + out.shape[1:], out.dtype)
        np.matmul(low[h:, :h], out[:h], out=rest)
        np.subtract(b[h:], rest, out=rest)
    _lower_solve(low[h:, h:], rest, out[h:], key, depth + 1)


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


# ------------------------------------------------------------------------------------------------------------
# The same steps written into scratch (``scratch``/``_like``) for 1-D and 2-D tensors, the shapes every parameter
# has unless ``merge_dims=False``: every temporary of the parameter's or a factor's size lives in per-thread
# scratch on NumPy, so a step allocates nothing of that size after the first.  Each function performs exactly
# the operations of its allocating twin above, on operands of the same values and memory layouts, in the same
# order (``np.matmul(..., out=)`` is the same BLAS call as ``@``), so the results are the same bits.
# > 2-D tensors take the twins above.


def _mode_mul_into(xp, x, m, i: int, out, transpose: bool = False, tri: bool = False):
    """out = x ×_i M (or Mᵀ), x 1-D or 2-D (``mode_mul``'s operands); ``tri``: M is upper triangular (a factor Q),
    whose zero half the blocked product skips."""
    if x.ndim == 1 or i == 0:
        t = m.T if transpose else m
        return B.tri_mul(xp, t, x, out, left=True, lower=transpose) if tri else xp.matmul(t, x, out=out)
    t = m if transpose else m.T
    return B.tri_mul(xp, t, x, out, left=False, lower=not transpose) if tri else xp.matmul(x, t, out=out)


def _apply_factors_ws(xp, factors, h):
    k = h.ndim
    a = h
    for i, (is_diag, q) in enumerate(factors):
        out = scratch(xp, f"a{i % 2}", h.shape, np.result_type(a.dtype, q.dtype))
        if is_diag:
            xp.multiply(a, _bcast(q, i, k), out=out)
        else:
            _mode_mul_into(xp, a, q, i, out, tri=True)
        a = out
    return a


def _solve_factors_ws(xp, factors, v):
    k = v.ndim
    b = v
    for i, (is_diag, q) in enumerate(factors):
        key = f"b{i % 2}"
        if is_diag:
            out = _like(xp, key, b, np.result_type(b.dtype, q.dtype))
            xp.divide(b, _bcast(q, i, k), out=out)
            b = out
            continue
        moved = xp.moveaxis(b, i, 0)
        rest = moved.shape[1:]
        sol = _solve_upper_t(xp, q, moved.reshape(q.shape[0], -1), key if xp is np else None)
        b = xp.moveaxis(sol.reshape((q.shape[0],) + rest), 0, i)
    return b


def _gram_ws(xp, x, i: int, is_diag: bool, key: str):
    if not is_diag and x.ndim != 2:
        return gram(xp, x, i, is_diag)
    if is_diag:
        sq = _like(xp, key + "sq", x)
        xp.multiply(x, x, out=sq)
        return xp.sum(sq, axis=tuple(j for j in range(x.ndim) if j != i)) if x.ndim > 1 else sq
    xc = x
    if not x.flags.c_contiguous:  # ascontiguousarray's copy
        xc = scratch(xp, "xc", x.shape, x.dtype)
        xc[...] = x
    d = x.shape[i]
    out = scratch(xp, key, (d, d), x.dtype)
    return B.gram(xp, xc, out, rows=i == 0)


def _spectral_lower_bound_ws(xp, s, amax):
    pos = amax > 0
    safe = xp.where(pos, amax, 1)
    m = scratch(xp, "slb_m", s.shape, np.result_type(s.dtype, safe.dtype))
    xp.divide(s, safe, out=m)
    sq = scratch(xp, "abs", m.shape, m.dtype)  # the max-abs buffer, dead by now
    xp.multiply(m, m, out=sq)
    i = xp.argmax(xp.sum(sq, axis=0))
    x = xp.take(m, i, axis=1)
    y = x @ m
    y = y / xp.where(pos, xp.sqrt(xp.sum(y * y)), 1)
    z = m @ y
    return xp.where(pos, xp.sqrt(xp.sum(z * z)) * safe, amax)


def _triu_(xp, d):
    """d ← triu(d) in place."""
    if xp is not np:
        d[...] = xp.triu(d)
        return d
    for r in range(1, d.shape[0]):
        d[r, :r] = 0
    return d


def update_precond_ws(xp, factors, h, v, eta: float, floor: float) -> None:
    """``update_precond`` with its temporaries in scratch (h, v 1-D or 2-D)."""
    if h.ndim > 2:
        return update_precond(xp, factors, h, v, eta, floor)
    a = _apply_factors_ws(xp, factors, h)
    b = _solve_factors_ws(xp, factors, v)
    for i, (is_diag, q) in enumerate(factors):
        t1 = _gram_ws(xp, a, i, is_diag, "t1")
        t2 = _gram_ws(xp, b, i, is_diag, "t2")
        d = _like(xp, "d", t1, np.result_type(t1.dtype, t2.dtype))
        xp.subtract(t1, t2, out=d)
        s = t1
        s += t2
        d *= eta
        ab = _like(xp, "abs", s)
        xp.abs(s, out=ab)
        amax = xp.max(ab)
        if is_diag:
            den = xp.maximum(amax, floor)
            qs = scratch(xp, "qs", q.shape, np.result_type(q.dtype, den.dtype))
            xp.divide(q, den, out=qs)
            d *= qs
            new = scratch(xp, "t2", q.shape, np.result_type(q.dtype, d.dtype))  # t2 is dead
            xp.subtract(q, d, out=new)
        else:
            d = _triu_(xp, d)
            d /= xp.maximum(_spectral_lower_bound_ws(xp, s, amax), floor)
            new = scratch(xp, "t2", q.shape, np.result_type(d.dtype, q.dtype))  # t2 is dead
            B.upper_upper(xp, d, q, new)
            xp.subtract(q, new, out=new)
        if xp is np:
            fin = scratch(xp, "fin", new.shape, np.bool_)
            xp.isfinite(new, out=fin)
            xp.copyto(q, new, where=xp.all(fin))  # = q[...] = where(all(isfinite(new)), new, q)
        else:
            q[...] = xp.where(xp.all(xp.isfinite(new)), new, q)


def balance_ws(xp, factors) -> None:
    """``balance`` with the max-abs temporaries in scratch."""
    maxes = []
    for _, q in factors:
        ab = scratch(xp, "abs", q.shape, q.dtype)
        xp.abs(q, out=ab)
        maxes.append(xp.max(ab))
    norms = xp.stack(maxes)
    gmean = xp.exp(xp.mean(xp.log(norms)))
    for j, (_, q) in enumerate(factors):
        q *= gmean / norms[j]


def precondition_ws(xp, factors, g):
    """``precondition`` into scratch (g 1-D or 2-D; the result is a scratch array, g is not written)."""
    if g.ndim > 2:
        return precondition(xp, factors, g)
    k = g.ndim
    u = g
    for i, (is_diag, q) in enumerate(factors):
        out = scratch(xp, f"a{i % 2}", g.shape, np.result_type(u.dtype, q.dtype))
        if is_diag:
            qq = scratch(xp, "qq", q.shape, q.dtype)
            xp.multiply(q, q, out=qq)
            xp.multiply(u, _bcast(qq, i, k), out=out)
            u = out
            continue
        d = q.shape[0]
        if d < 2 * (u.size // d):  # SYRK d³/2 + d²·n < 2·d²·n
            qtq = scratch(xp, "t1", (d, d), q.dtype)  # update_precond's buffers are dead
            xp.matmul(q.T, q, out=qtq)
            _mode_mul_into(xp, u, qtq, i, out)
        else:
            mid = scratch(xp, "b0", g.shape, np.result_type(u.dtype, q.dtype))
            _mode_mul_into(xp, u, q, i, mid, tri=True)
            _mode_mul_into(xp, mid, q, i, out, transpose=True, tri=True)
        u = out
    return u


def clip_rms_ws(xp, u, clip: float):
    """``clip_rms`` with u·u in scratch."""
    sq = _like(xp, "b1", u)  # update_precond's buffer, dead by now
    xp.multiply(u, u, out=sq)
    rms = xp.sqrt(xp.mean(sq))
    u *= xp.minimum(1.0, clip / (rms + 1e-12)).astype(u.dtype)
    return u

"""KronPsgd's fused CuPy step for 1-D and 2-D preconditioner shapes (``KronPsgd.kernel_fn``; ``FLATOPT_FORCE_TWIN=1``
runs the twin, ``kron/__init__.py`` ``update``, instead).

The twin's GEMMs, triangular solves and reductions are made with the twin's own calls on the same operands
(``numerics._mode_mul_into``, ``blocked.gram`` / ``upper_upper``, cuBLAS trsm, ``sum`` / ``max`` / ``mean`` /
``argmax`` / ``take`` with ``out=``), and the elementwise work between them runs in the kernels of
``kernels/kron.cu``, each the twin's operations on one element in the twin's order: the momentum and the fitted
vector with its absolute values in one kernel, the probe (``layout.gaussian_probe``'s counter-based generator) with
the damping in one, per dense factor four (the difference/sum of the Grams, two steps of the spectral lower bound,
the division, the new factor with its non-finite flag), one commit of every factor (a factor whose new value is not
finite keeps its old value, decided on the device), and the clipping, the decay and the update of the parameter in
one.  So the result is the twin's bits.  A 1024² matrix (two dense factors) takes 53 launches on a preconditioner
update step (the twin 162) and 8 otherwise; nothing synchronises with the host.

Memory: every temporary is a per-thread ``core.workspace`` buffer (kept between steps, shared by the parameters a
thread steps, as on NumPy), with its shaped views cached, so a step allocates nothing on the stand-in; on a real GPU
the two triangular solves allocate their results (``cupyx.scipy.linalg.solve_triangular`` has no ``out=``).  Not
fused (the twin runs): > 2-D preconditioner shapes (``merge_dims=False``), a dense factor of a 1-D parameter
(``min_ndim_triangular <= 1``); the rare balancing step (about 1 % of the updates) runs the twin's ``balance_ws``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ..core import backend, kernels, workspace
from ..core.types import Array
from . import blocked as B
from . import layout as L
from . import numerics as K

FILE = "kron.cu"
_tls = threading.local()


def _buf(xp: Any, key: str, shape: tuple[int, ...], dtype: Any, order: str = "C", *, total: int = 0,
         off: int = 0) -> Any:
    """This thread's ``core.workspace`` buffer ``key`` as an array of ``shape`` (C or F order; with ``total``, the
    part at ``off`` of a buffer of ``total`` elements); the view is cached (a reshape is a CuPy call) until the buffer
    is regrown."""
    dtype = np.dtype(dtype)
    size = math.prod(shape)
    base: Any = workspace.get(xp, "kronf_" + key, total or size, dtype)
    cache = getattr(_tls, "views", None)
    if cache is None:
        cache = _tls.views = {}
    k = (id(xp), key, shape, dtype, order, total, off)
    hit = cache.get(k)
    ptr = base.data.ptr
    if hit is not None and hit[0] == ptr:
        return hit[1]
    part: Any = base[off:off + size] if total else base
    view = part.reshape(shape[::-1]).T if order == "F" and len(shape) > 1 else part.reshape(shape)
    cache[k] = (ptr, view)
    return view


def _buf_like(xp: Any, key: str, x: Any) -> Any:
    """``numerics._like``: the memory layout NumPy gives a ufunc result on ``x`` (F order for an F-only array)."""
    f = x.ndim > 1 and x.flags.f_contiguous and not x.flags.c_contiguous
    return _buf(xp, key, tuple(x.shape), x.dtype, "F" if f else "C")


def _views(st: Any) -> list[tuple[bool, Any, Any]]:
    """Per factor (diagonal, its view in ``st.q``, the view broadcast along its axis), cached on the state."""
    cached = st.views
    if cached is not None and cached[0] is st.q:
        views: list[tuple[bool, Any, Any]] = cached[1]
        return views
    lay = st.layout
    k = len(lay.merged)
    out = []
    for i, (is_diag, q) in enumerate(K.factor_views(st.q, lay)):
        out.append((is_diag, q, K._bcast(q, i, k) if is_diag else None))
    st.views = (st.q, out)
    return out


def supported(lay: Any) -> bool:
    """Whether the fused step covers this layout (else the twin runs)."""
    return len(lay.merged) == 2 or (len(lay.merged) == 1 and lay.diag[0])


def kernel_update(cfg: Any, st: Any, param: Array, grad: Array, *, t: int, lr: float) -> bool:
    """One fused step of one parameter on CuPy; False (nothing touched) where the twin must run."""
    lay = st.layout
    if lay.numel == 0:
        return True
    if not supported(lay):
        return False
    xp = backend.cupy()
    do_update, st.counter = L.decide_update(cfg, st.counter, t)
    balance = cfg.balance and do_update and len(lay.merged) > 1 and L.balance_hit(cfg.balance_seed, t)
    pdt = st.q.dtype
    shape, n = lay.merged, lay.numel
    t_double = np.int32(param.dtype == np.float64)

    def launch(name: str, size: int, args: tuple[Any, ...]) -> None:
        backend.launch(kernels.get(FILE, name, pdt), size, args)

    b1 = cfg.momentum
    h = _buf(xp, "h", shape, pdt)
    fit = h if cfg.momentum_into_precond_update else _buf(xp, "fit", shape, pdt)
    fabs = _buf(xp, "fabs", shape, pdt)
    launch("kron_momentum", n, (st.m, grad, h, fit, fabs, np.int64(n), float(b1), 1.0 - b1, 1.0 - b1**t, t_double,
                                np.int32(fit is not h), np.int32(do_update)))
    fv = _views(st)
    if balance:
        K.balance_ws(xp, [(d, q) for d, q, _ in fv])
    if do_update:
        _fit_and_update(xp, cfg, st, lay, fv, fit, fabs, launch)
        st.updates += 1
    u = _precondition(xp, fv, h)
    msq = _buf(xp, "msq", (), pdt)  # read by kron_final only with clip
    if cfg.clip is not None:
        sq = _buf(xp, "usq", shape, pdt)
        xp.multiply(u, u, out=sq)
        xp.mean(sq, out=msq)
    use_wd = cfg.weight_decay != 0 and lay.decays
    p = pdt.type
    launch("kron_final", n, (u, param, msq, np.int64(n), p(cfg.clip or 1.0), p(1e-12), np.int32(cfg.clip is not None),
                             float(cfg.weight_decay), np.int32(use_wd), -float(lr), t_double))
    return True


def _fit_and_update(xp: Any, cfg: Any, st: Any, lay: Any, fv: list[tuple[bool, Any, Any]], fit: Any, fabs: Any,
                    launch: Any) -> None:
    """The probe and the damping of ``fit``, then one Lie-group step of every factor (``numerics.update_precond``)."""
    pdt = st.q.dtype
    p = pdt.type
    shape, n = lay.merged, lay.numel
    _, key, hook = st.ctx
    mean = _buf(xp, "mean", (), pdt)
    xp.mean(fabs, out=mean)
    if hook is None:
        v = _buf(xp, "v", shape, pdt)
        base = L.probe_base(key, st.updates)
    else:
        v, base = L.probe_for(xp, st.ctx, st.updates, shape, pdt), 0
    launch("kron_probe", n, (v, fit, mean, np.int64(n), np.int64((n + 1) // 2), np.uint64(base),
                             np.int32(hook is None), np.int32(1), p(K.SQRT_EPS_F32),
                             p(2.0 * math.pi * 2.0**-24)))
    a = fit  # A = fit ×_1 Q_1 … ×_k Q_k, from the old factors
    for i, (is_diag, q, qb) in enumerate(fv):
        out = _buf(xp, f"a{i % 2}", shape, pdt)
        if is_diag:
            xp.multiply(a, qb, out=out)
        else:
            K._mode_mul_into(xp, a, q, i, out, tri=True)
        a = out
    b = v  # B̄ = V ×_1 Q_1⁻ᵀ … ×_k Q_k⁻ᵀ
    trsm: Any = backend.solve_triangular  # cuBLAS trsm, as numerics._solve_upper_t on CuPy
    for i, (is_diag, q, qb) in enumerate(fv):
        if is_diag:
            out = _buf_like(xp, f"b{i % 2}", b)
            xp.divide(b, qb, out=out)
            b = out
            continue
        sol = trsm()(q, b if i == 0 else b.T, trans="T", lower=False, check_finite=False)
        b = sol if i == 0 else sol.T
    newq = _buf(xp, "newq", (lay.qsize,), pdt)
    flags = _buf(xp, "flags", (2,), np.int32)
    bc = None
    for i, (is_diag, q, qb) in enumerate(fv):
        nw = _buf(xp, "newq", tuple(q.shape), pdt, total=lay.qsize, off=lay.offsets[i])
        flag = flags[i:i + 1]
        if is_diag:
            _diag_factor(xp, cfg, a, b, i, q, nw, flag, launch)
            continue
        if bc is None:  # numerics._gram_ws: a C-contiguous copy of a non-contiguous operand
            bc = b
            if not b.flags.c_contiguous:
                bc = _buf(xp, "bc", shape, pdt)
                bc[...] = b
        _dense_factor(xp, cfg, a, bc, i, q, nw, flag, launch)
    split = lay.offsets[1] if len(fv) > 1 else lay.qsize
    launch("kron_commit", lay.qsize, (st.q, newq, np.int64(lay.qsize), np.int64(split), flags))


def _diag_factor(xp: Any, cfg: Any, a: Any, b: Any, i: int, q: Any, nw: Any, flag: Any, launch: Any) -> None:
    pdt = q.dtype
    d = q.shape[0]
    grams = []
    for x, key in ((a, "t1"), (b, "t2")):  # numerics._gram_ws, diagonal: the sum of x * x over the other axis
        sq = _buf_like(xp, key + "sq", x)
        xp.multiply(x, x, out=sq)
        if x.ndim > 1:
            g = _buf(xp, key, (d,), pdt)
            xp.sum(sq, axis=(1 - i,), out=g)
            sq = g
        grams.append(sq)
    dd, sab, amax = _buf(xp, "d", (d,), pdt), _buf(xp, "sabs", (d,), pdt), _buf(xp, "amax", (), pdt)
    launch("kron_ds", d, (grams[0], grams[1], dd, sab, np.int64(d), np.int64(1), pdt.type(cfg.precond_lr),
                          np.int32(0), flag))
    xp.max(sab, out=amax)
    launch("kron_diag_new", d, (q, dd, amax, pdt.type(cfg.eps), nw, np.int64(d), flag))


def _dense_factor(xp: Any, cfg: Any, a: Any, b: Any, i: int, q: Any, nw: Any, flag: Any, launch: Any) -> None:
    pdt = q.dtype
    p = pdt.type
    d = q.shape[0]
    dsq = (d, d)
    t1, t2 = _buf(xp, "t1", dsq, pdt), _buf(xp, "t2", dsq, pdt)
    B.gram(xp, a, t1, rows=i == 0)
    B.gram(xp, b, t2, rows=i == 0)
    dd, sab, amax = _buf(xp, "d", dsq, pdt), _buf(xp, "sabs", dsq, pdt), _buf(xp, "amax", (), pdt)
    launch("kron_ds", d * d, (t1, t2, dd, sab, np.int64(d * d), np.int64(d), p(cfg.precond_lr), np.int32(1), flag))
    xp.max(sab, out=amax)
    s = t1  # numerics._spectral_lower_bound_ws on S = T1 + T2
    mm, sq = _buf(xp, "slb_m", dsq, pdt), _buf(xp, "slb_sq", dsq, pdt)
    launch("kron_slb_m", d * d, (s, amax, mm, sq, np.int64(d * d)))
    col, idx = _buf(xp, "col", (d,), pdt), _buf(xp, "idx", (), np.int64)
    xp.sum(sq, axis=0, out=col)
    xp.argmax(col, out=idx)
    x, y, z, w = (_buf(xp, k, (d,), pdt) for k in ("x", "y", "z", "w"))
    xp.take(mm, idx, axis=1, out=x)
    xp.matmul(x, mm, out=y)
    ysum, zsum = _buf(xp, "ysum", (), pdt), _buf(xp, "zsum", (), pdt)
    xp.multiply(y, y, out=w)
    xp.sum(w, out=ysum)
    launch("kron_slb_y", d, (y, amax, ysum, np.int64(d)))
    xp.matmul(mm, y, out=z)
    xp.multiply(z, z, out=w)
    xp.sum(w, out=zsum)
    launch("kron_dense_div", d * d, (dd, amax, zsum, p(cfg.eps), np.int64(d * d)))
    B.upper_upper(xp, dd, q, nw)
    launch("kron_dense_new", d * d, (q, nw, np.int64(d * d), flag))


def _precondition(xp: Any, fv: list[tuple[bool, Any, Any]], h: Any) -> Any:
    """``numerics.precondition_ws``: u = h ×_1 (Q_1ᵀQ_1) … ×_k (Q_kᵀQ_k) into this thread's buffers."""
    pdt = h.dtype
    shape = tuple(h.shape)
    u = h
    for i, (is_diag, q, qb) in enumerate(fv):
        out = _buf(xp, f"a{i % 2}", shape, pdt)
        if is_diag:
            qq = _buf(xp, "qq", tuple(qb.shape), pdt)
            xp.multiply(qb, qb, out=qq)
            xp.multiply(u, qq, out=out)
        else:
            d = q.shape[0]
            if d < 2 * (u.size // d):  # SYRK d³/2 + d²·n < 2·d²·n
                qtq = _buf(xp, "t1", (d, d), pdt)
                xp.matmul(q.T, q, out=qtq)
                K._mode_mul_into(xp, u, qtq, i, out)
            else:
                mid = _buf(xp, "b0", shape, pdt)
                K._mode_mul_into(xp, u, q, i, mid, tri=True)
                K._mode_mul_into(xp, mid, q, i, out, transpose=True, tri=True)
        u = out
    return u

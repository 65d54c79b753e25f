"""The non-APOLLO update paths of ``Adafactor8Bit`` (private): factored, CAME, unfactored (Adafactor- and
Adam-style) and SGD, plus the helpers the APOLLO path shares (α, the gradient copy, the clip, the m EMA).

Formulas: ``reference/adafactor8bit.md`` §4–§5 (the original's pure-PyTorch path, float32).  Each path is a
generator of *phases* (``flatopt._blocks``): the factored paths (Adafactor and CAME) are
composed from Adafactor's own blocked passes (``FactoredPasses``: row/column statistics, factors, ΣU², apply) with
the 8-bit factor EMA (lerp, requantized) plugged in; the elementwise states (V, m) are updated over ranges aligned
to the codec blocks (``_a8_state.ema_range``), so ranges run on any thread and every reduction is folded in range
order: the bits do not depend on the threads.  The exact float32 EMA drives the step; only the stored copy is
requantized.

Differences in float32 rounding from the original (all within its float32 noise; codes still equal): the row and
column sums are per block (einsum) rather than torch's reductions, and the clip and step scale are folded into one
multiplier (θ ← θ·decay − s·U rather than θ·decay + (−α/clip)·U).  ``lag_norm`` (the original: CUDA only) is
honoured on every backend for the non-APOLLO paths: the clip and the Fira factor of step t use step t − 1's norm
(no clip at t = 1); a non-finite norm is carried over as 0.

Data-dependent scalars (α, norms, clip denominators, the Fira factor) are 0-d arrays of the parameter's array
module, so on CuPy they stay on the device (no host synchronisation); on CuPy a path is one range / one block.
"""

from __future__ import annotations

import math

import numpy as np

from . import _a8_state as S
from . import _adafactor_math as fm
from . import _blocks
from . import _fira, _workspace, quant

F32 = np.float32


def eps1_of(cfg) -> float:
    return 1e-30 if cfg.eps[0] is None else float(cfg.eps[0])


def ws(xp, key, n):
    return _workspace.get(xp, key, n, np.float32)


def grad32(xp, cfg, g, *, nan_to_zero=False, writable=True):
    """The float32 gradient (negated when ``maximize``); ``g`` itself is never written.  A float32 ``g`` is used
    as is when the caller only reads it (``writable=False``) and no sanitising is needed."""
    if xp is np and nan_to_zero and g.dtype == np.float32 and not cfg.maximize and not writable:
        if np.isfinite(np.add.reduce(g)):  # host check (NumPy only): a non-finite entry makes the sum non-finite
            return g
    elif not writable and not nan_to_zero and g.dtype == np.float32 and not cfg.maximize:
        return g
    out = ws(xp, "g32", g.size)
    if cfg.maximize:
        xp.negative(g, out=out, casting="same_kind")
    else:
        out[...] = g
    if nan_to_zero:
        xp.copyto(out, F32(0.0), where=~xp.isfinite(out))
    return out


def norm(xp, x):
    return xp.sqrt(xp.dot(x, x)).astype(np.float32)


def alpha_rho(xp, cfg, p, t: int, lr):
    """(α, ρ): ρ = scale·(min(lr, 1/√t) if relative_step else lr), α = ρ·max(RMS(p), eps2) if scale_parameter."""
    base, scale = lr
    rho = F32(scale * (min(base, 1.0 / math.sqrt(t)) if cfg.relative_step else base))
    if not cfg.scale_parameter:
        return rho, rho  # a NumPy float32 scalar: a kernel argument on CuPy, no upload
    rms = xp.sqrt(xp.dot(p, p)).astype(np.float32) / F32(math.sqrt(p.size))
    return xp.maximum(rms, F32(cfg.eps[1])) * rho, rho


def clip_(xp, u, d: float) -> None:
    if d > 0:
        xp.divide(u, xp.maximum(norm(xp, u) / F32(math.sqrt(u.size)) / F32(d), F32(1.0)), out=u)


def m_ema(xp, st, slot, x, beta1, tmp):
    """The first-moment EMA m ← lerp(m, x, 1 − β1); requantizes the stored codes, returns the exact values."""
    return S.ema(xp, st, slot, x, 1.0 - beta1, floor=0.0)


# ------------------------------------------------------------------------------------ the stepped paths
# Elements per task of the elementwise (flat) passes on NumPy (rounded up to whole codec blocks).
TASK = 1 << 16


def update(xp, cfg, st, p, g, *, t: int, lr, shape) -> None:
    """One non-APOLLO step of Adafactor8Bit on the flat buffers ``p`` (in place) and ``g`` (all phases inline)."""
    _blocks.run_serial(phases(xp, cfg, st, p, g, t=t, lr=lr, shape=shape))


def phases(xp, cfg, st, p, g, *, t: int, lr, shape):
    """One non-APOLLO step as a generator of phases of independent tasks (``flatopt._blocks``): lists of
    ``(cost, fn)`` over disjoint ranges, with the small serial work (factor EMAs, scalars) between them.  Every
    reduction is per range and folded in range order, so the bits do not depend on the threads.  Full-size
    scratch (the update, an exact quantized first moment) is the calling thread's workspace: run one such step
    at a time (``Adafactor8Bit`` does)."""
    n = p.size
    if n == 0:
        return
    sgd = S.is_sgd(cfg)
    adam = (not cfg.factored) and cfg.beta2 is not None and cfg.beta3 is None
    b = 0.0 if sgd else (1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay))
    sc = Scalars(xp, cfg, st, n, t, lr, adam=adam, sgd=sgd)
    if cfg.beta3 is not None and cfg.beta1 is not None and len(shape) >= 2 and cfg.factored:
        yield from _came_path(xp, cfg, st, p, g, b, sc, shape)
    elif not sgd and len(shape) >= 2 and cfg.factored:
        yield from _factored(xp, cfg, st, p, g, b, sc, shape)
    else:
        yield from _flat(xp, cfg, st, p, g, b, sc, sgd=sgd, adam=adam)


class Scalars:
    """The step's scalars: ρ, α = ρ·max(RMS(θ), eps2) (RMS before decay) with the bias corrections, the decay
    factor 1 − c·λ, and the step scale s with θ ← θ·decay − s·U: s = α·f/max(1, ‖U‖/(√n·d)) (f the Fira factor;
    no clip for d = 0; ``lag_norm``: the previous step's ‖U‖ and Fira factor), negated for ``maximize`` when U is
    formed from the raw gradient.  0-d arrays of ``xp`` where data-dependent (no host synchronisation on CuPy)."""

    def __init__(self, xp, cfg, st, n, t, lr, *, adam, sgd):
        self.xp, self.cfg, self.st, self.n = xp, cfg, st, n
        base, scale = lr
        self.rho = F32(scale * (min(base, 1.0 / math.sqrt(t)) if cfg.relative_step else base))
        self.mult, eps1 = None, eps1_of(cfg)
        self.eps_denom = eps1 if adam else 0.0
        if cfg.beta1 is not None and not cfg.relative_step and not sgd:
            if (adam if cfg.bias_correction is None else cfg.bias_correction):
                bc1 = 1.0 - cfg.beta1**t
                if cfg.beta2 is not None:
                    bc2 = 1.0 - cfg.beta2**t
                    self.mult = ("mul", F32(math.sqrt(bc2) / bc1))
                    self.eps_denom = eps1 * math.sqrt(bc2) if adam else self.eps_denom
                else:
                    self.mult = ("div", F32(bc1))

    def alpha(self, ssq_p):
        xp, cfg = self.xp, self.cfg
        alpha = self.rho
        if cfg.scale_parameter:
            rms = xp.sqrt(xp.asarray(ssq_p, dtype=np.float32)) / F32(math.sqrt(self.n))
            alpha = xp.maximum(rms, F32(cfg.eps[1])) * self.rho
        if self.mult is not None:
            alpha = alpha * self.mult[1] if self.mult[0] == "mul" else alpha / self.mult[1]
        return alpha

    def decay(self, alpha):
        cfg = self.cfg
        if cfg.weight_decay == 0:
            return None
        c = alpha if cfg.scale_weight_decay else self.rho
        return F32(1.0) - c * F32(cfg.weight_decay)

    def step_scale(self, alpha, ssq_u, *, d: float, negate: bool = False):
        """s (see the class doc) from ΣU² (None when neither the clip nor Fira needs it)."""
        xp, cfg, st = self.xp, self.cfg, self.st
        fira = cfg.enable_fira_for_adafactor
        if not fira and not d > 0:
            s = alpha
        else:
            nrm = xp.sqrt(xp.asarray(ssq_u, dtype=np.float32))
            bad = ~xp.isfinite(nrm)
            if fira:  # the limiter reads a non-finite norm as 0 (and the update is dropped below)
                nrm = xp.where(bad, F32(0.0), nrm)
            if cfg.lag_norm:  # the previous step's norm and Fira factor; this step's are kept for the next
                used = st.prev_update_norm.reshape(()).copy()
                st.prev_update_norm[...] = xp.where(bad, F32(0.0), nrm)  # a non-finite norm is not carried over
                if fira:
                    f = st.lag_fira_scale.reshape(()).copy()
                    st.lag_fira_scale[...] = _fira.factor(xp, st.fira_prev, nrm, cfg.fira_margin)
                nrm = used
            elif fira:
                f = _fira.factor(xp, st.fira_prev, nrm, cfg.fira_margin)
            s = alpha * f if fira else alpha
            if d > 0:
                s = s / xp.maximum(nrm / F32(math.sqrt(self.n) * d), F32(1.0))
            if fira:  # an update whose norm is not finite is dropped (U's non-finite entries are zeroed too)
                s = xp.where(bad, F32(0.0), s)
        return -s if negate else s


def _ranges(xp, n: int, align: int):
    """``(cost, lo, hi)`` ranges of about ``TASK`` elements starting at multiples of ``align`` (CuPy: one)."""
    if xp is not np:
        return ((n, 0, n),)
    step = max(1, -(-TASK // align)) * align
    return tuple((min(lo + step, n) - lo, lo, min(lo + step, n)) for lo in range(0, n, step))


def _src_chunk(xp, cfg, g, lo, hi):
    """g[lo:hi], negated into per-thread scratch for ``maximize`` (``g`` is never written)."""
    if not cfg.maximize:
        return g[lo:hi]
    out = _workspace.get(xp, "a8.negg", hi - lo, np.float32)
    xp.negative(g[lo:hi], out=out, casting="same_kind")
    return out


def _m_tasks(xp, cfg, st, g):
    """The first moment m ← lerp(m, g, 1 − β1) over aligned ranges (tasks) and the array of its exact values:
    the float32 state itself, or (quantized) the calling thread's full-size workspace."""
    n = g.size
    exact = st.m if st.m is not None else ws(xp, "a8.m_exact", n)

    def task(lo, hi):
        def run():
            S.ema_range(xp, st, "m", lo, hi, _src_chunk(xp, cfg, g, lo, hi), 1.0 - cfg.beta1, exact[lo:hi],
                        floor=0.0)
        return run

    return exact, [(c, task(lo, hi)) for c, lo, hi in _ranges(xp, n, S.align(st))]


def _factored(xp, cfg, st, p, g, b, sc, shape):
    """Factored second moment through Adafactor's blocked passes (``_adafactor_math.FactoredPasses``) with the
    original's factor EMA (lerp; requantized) and r̄ floor; Adam-style momentum (EMA of G, then normalised)."""
    momentum = cfg.beta1 is not None
    # a quantized m is updated block by block inside the statistics pass when the blocks meet its codec blocks
    fp = fm.FactoredPasses(xp, st, p, shape, align=cfg.m_block_size if momentum and st.m is None else 1)
    if not momentum:  # U from G: ΣU² fused into the statistics pass
        yield from _fused_stats(xp, cfg, st, fp, g, b)
        src, ssq_u = g, fp.fused_ssq()
    elif fp.aligned:  # m ← lerp(m, G, 1 − β1) per block in the same pass, ΣU² from m fused too
        src = st.m if st.m is not None else ws(xp, "a8.m_exact", p.size)

        def m_block(lo, hi):
            return S.ema_range(xp, st, "m", lo, hi, _src_chunk(xp, cfg, g, lo, hi), 1.0 - cfg.beta1, src[lo:hi],
                               floor=0.0)

        yield from _fused_stats(xp, cfg, st, fp, g, b, wsrc=m_block)
        ssq_u = fp.fused_ssq()
    else:
        src, extra = _m_tasks(xp, cfg, st, g)
        yield from fp.stats(g, extra)
        R, C = _ema_factors(xp, st, fp, ("row_var", "col_var"), b, eps1_of(cfg))
        fp.factors(R, C, rbar_floor=F32(eps1_of(cfg)))
        yield from fp.sums(src, cfg.scale_parameter)
        ssq_u = fp.ssq_u
    alpha = sc.alpha(fp.ssq_p)
    s = sc.step_scale(alpha, ssq_u, d=cfg.d, negate=cfg.maximize and cfg.beta1 is None)
    yield fp.apply(st, src, s, sc.decay(alpha), None, zero_nonfinite=cfg.enable_fira_for_adafactor)


def _fused_stats(xp, cfg, st, fp, g, b, wsrc=None):
    """Phases: the factor statistics of G with the row EMA done block by block inside the pass (``FactoredPasses``'
    fused mode: ΣU² and Σθ² come out of the same pass; ``wsrc``: U's source per block, see ``stats``), then the
    column EMA and the factors."""
    eps1 = eps1_of(cfg)
    bdim, r, c = fp.dims
    floor = quant.al_floor(eps1)
    R = S.load(xp, st, "row_var").reshape(bdim, r)  # exact values, updated block by block below

    def rows(b0, b1, i0, i1, sums):  # R ← lerp(R, mean_j G² + ε₁, b) for these rows; sums ← 1/R
        sums /= F32(c)
        sums += F32(eps1)
        rb = R[b0:b1, i0:i1]
        S.lerp_(xp, rb, sums, b, _workspace.get(xp, "a8.rows", sums.size, np.float32).reshape(sums.shape))
        return xp.divide(F32(1.0), rb, out=sums)

    yield from fp.stats(g, rows=rows, need_rms=cfg.scale_parameter, wsrc=wsrc)
    S.store(xp, st, "row_var", R.reshape(-1), floor=floor)
    fp.colv += F32(eps1)
    C = S.ema(xp, st, "col_var", fp.colv.reshape(-1), b, floor=floor).reshape(bdim, c)
    fp.factors(R, C, rbar_floor=F32(eps1))


def _ema_factors(xp, st, fp, slots, w, add):
    """(R, C) ← lerp((R, C), (fp.rowv, fp.colv) + add, w), requantized; the exact values, shaped (B, r), (B, c)."""
    bdim, r, c = fp.dims
    floor = quant.al_floor(eps1_of(st.cfg))
    fp.rowv += F32(add)
    fp.colv += F32(add)
    rv = S.ema(xp, st, slots[0], fp.rowv.reshape(-1), w, floor=floor)
    cv = S.ema(xp, st, slots[1], fp.colv.reshape(-1), w, floor=floor)
    return rv.reshape(bdim, r), cv.reshape(bdim, c)


def _came_path(xp, cfg, st, p, g, b, sc, shape):
    """CAME (factored, β1 and β3) through the same blocked passes: U = G·rsqrt(R/r̄)·rsqrt(C) clipped by RMS(U)/d;
    m ← lerp(m, U, 1 − β1); res = (U − m)² + eps_came; confidence factors ← lerp(·, row/column means of res, 1 − β3);
    step m·rsqrt(c_row/c̄)·rsqrt(c_col) (no second clip; Fira optional).  Full-size scratch: U (then U − m) and,
    for a quantized m, its exact values."""
    n = p.size
    eps1 = eps1_of(cfg)
    fp = fm.FactoredPasses(xp, st, p, shape)
    yield from _fused_stats(xp, cfg, st, fp, g, b)
    alpha = sc.alpha(fp.ssq_p)
    if cfg.d > 0:  # fold 1/max(1, RMS(U)/d) into the column factor
        rms = xp.sqrt(xp.asarray(fp.fused_ssq(), dtype=np.float32)) / F32(math.sqrt(n))
        xp.divide(fp.colv, xp.maximum(rms / F32(cfg.d), F32(1.0)), out=fp.colv)
    if cfg.maximize:
        xp.negative(fp.colv, out=fp.colv)
    u_all = ws(xp, "a8.u", n)
    yield fp.write(g, u_all)
    m_all = st.m if st.m is not None else ws(xp, "a8.m_exact", n)

    def moment(lo, hi):
        def run():
            u = u_all[lo:hi]
            m = S.ema_range(xp, st, "m", lo, hi, u, 1.0 - cfg.beta1, m_all[lo:hi], floor=0.0)
            xp.subtract(u, m, out=u)  # U − m: its square is the instability
        return run

    yield [(c, moment(lo, hi)) for c, lo, hi in _ranges(xp, n, S.align(st))]
    yield from fp.stats(u_all)
    CR, CC = _ema_factors(xp, st, fp, ("conf_row", "conf_col"), 1.0 - cfg.beta3, cfg.eps_came)
    fp.factors(CR, CC, rbar_floor=F32(eps1))
    ssq = None
    if cfg.enable_fira_for_adafactor:
        yield from fp.sums(m_all, False)
        ssq = fp.ssq_u
    s = sc.step_scale(alpha, ssq, d=0.0)
    yield fp.apply(st, m_all, s, sc.decay(alpha), None, zero_nonfinite=cfg.enable_fira_for_adafactor)


def _flat(xp, cfg, st, p, g, b, sc, *, sgd: bool, adam: bool):
    """The elementwise paths over aligned ranges: unfactored Adafactor-style (v ← lerp(v, g² + ε₁, b),
    u = g·rsqrt(max(v, ε₁²))), Adam-style (u = g/(√v + eps)), SGD; with β1 either Adam-style momentum
    (u from m) or, for the "momentum-only" rule, m ← EMA of the clipped u (then no second clip).

    Phase 1: V (and m) EMA, U into a full-size buffer, ΣU² and Σθ² per range; [phase 2, momentum-only: m ← EMA of
    U·clip, ΣM² for Fira]; last phase: θ ← θ·decay − s·U.  Without a data-dependent scalar (d = 0, no Fira, no
    parameter scaling: the AdamW-style presets) phase 1 updates θ itself and there is no other phase."""
    n = p.size
    eps1 = eps1_of(cfg)
    eps_sq = F32(max(eps1 * eps1, quant.FLT_MIN))
    mo1d = (not adam) if cfg.momentum_only_1d is None else cfg.momentum_only_1d
    mo1d = mo1d and cfg.beta1 is not None and not sgd
    rng = _ranges(xp, n, S.align(st))
    nr = len(rng)
    need_norm = cfg.d > 0 or cfg.enable_fira_for_adafactor
    # no data-dependent scalar (no clip, Fira or parameter scaling): each range is updated in the same pass
    one_pass = not (need_norm or mo1d or cfg.scale_parameter)
    u_all = None if one_pass else ws(xp, "a8.u", n)
    su, sp = [None] * nr, [None] * nr
    v_floor = quant.al_floor(eps1)
    eps_g2 = 0.0 if adam else eps1
    if one_pass:
        alpha = sc.alpha(None)
        s1, decay1 = sc.step_scale(alpha, None, d=0.0), sc.decay(alpha)

    def second_moment(lo, hi, x):
        if st.variance is None and not sgd:
            return S.ema_range(xp, st, "variance", lo, hi, x, b, ws(xp, "a8.v", hi - lo), floor=v_floor,
                               square=True, add=eps_g2)
        v = st.variance[lo:hi]  # float32: v·(1 − b) + b·g² (+ b·eps1), the original's order
        tmp = _workspace.get(xp, "a8.t1", hi - lo, np.float32)
        xp.multiply(v, F32(1.0 - b), out=v)
        xp.multiply(x, F32(b), out=tmp)
        xp.multiply(tmp, x, out=tmp)
        xp.add(v, tmp, out=v)
        if eps_g2 > 0:
            xp.add(v, F32(b * eps_g2), out=v)
        return v

    def normalise(v, src, out):  # out = src/(√v + eps) (Adam-style) or src·rsqrt(max(v, eps1²))
        if adam:
            xp.sqrt(v, out=out)
            xp.add(out, F32(sc.eps_denom), out=out)
            if cfg.beta1 is not None and not mo1d:
                xp.divide(F32(1.0), out, out=out)
                xp.multiply(src, out, out=out)
            else:
                xp.divide(src, out, out=out)
        else:
            xp.maximum(v, eps_sq, out=out)
            xp.sqrt(out, out=out)
            xp.divide(F32(1.0), out, out=out)
            xp.multiply(src, out, out=out)
        return out

    def pass1(k, lo, hi):
        def run():
            x = _src_chunk(xp, cfg, g, lo, hi)
            u = _workspace.get(xp, "a8.uc", hi - lo, np.float32) if one_pass else u_all[lo:hi]
            if sgd:
                if cfg.beta1 is not None:
                    m = _m_range(lo, hi, x)
                    xp.divide(m, F32(1.0 - cfg.beta1), out=u)
                else:
                    u[...] = x
            else:
                v = second_moment(lo, hi, x)
                src = x if (cfg.beta1 is None or mo1d) else _m_range(lo, hi, x)
                normalise(v, src, u)
            if one_pass:  # θ ← θ·decay − s·U now
                u *= s1
                pb = p[lo:hi]
                if decay1 is not None:
                    pb *= decay1
                pb -= u
                return
            if need_norm or mo1d:
                su[k] = _blocks.sumsq(xp, u, None)
            if cfg.scale_parameter:
                sp[k] = _blocks.sumsq(xp, p[lo:hi], None)
        return run

    def _m_range(lo, hi, x):
        out = st.m[lo:hi] if st.m is not None else _workspace.get(xp, "a8.mx", hi - lo, np.float32)
        return S.ema_range(xp, st, "m", lo, hi, x, 1.0 - cfg.beta1, out, floor=0.0)

    yield [(c, pass1(k, lo, hi)) for k, (c, lo, hi) in enumerate(rng)]
    if one_pass:
        return
    ssq_p = _blocks.fold(sp, F32(0.0)) if cfg.scale_parameter else None
    d = cfg.d
    if mo1d:  # u ← u / max(1, RMS(u)/d); m ← lerp(m, u, 1 − β1); the step is m (no second clip)
        clip = xp.maximum(xp.sqrt(xp.asarray(_blocks.fold(su, F32(0.0)), dtype=np.float32)) / F32(math.sqrt(n)) / F32(d),
                          F32(1.0)) if d > 0 else None

        def pass2(k, lo, hi):
            def run():
                u = u_all[lo:hi]
                if clip is not None:
                    xp.divide(u, clip, out=u)
                m = _m_range(lo, hi, u)
                if m is not u:
                    u[...] = m
                if cfg.enable_fira_for_adafactor:
                    su[k] = _blocks.sumsq(xp, u, None)
            return run

        yield [(c, pass2(k, lo, hi)) for k, (c, lo, hi) in enumerate(rng)]
        d = 0.0
    ssq_u = _blocks.fold(su, F32(0.0)) if (d > 0 or cfg.enable_fira_for_adafactor) else None
    alpha = sc.alpha(ssq_p)
    s = sc.step_scale(alpha, ssq_u, d=d)
    yield fm.apply_tasks(xp, st, p, [(c, ((lo, hi),)) for c, lo, hi in rng], lambda _, lo, hi: u_all[lo:hi],
                         (None, None), 0, np.float32, s, sc.decay(alpha), None,
                         cfg.enable_fira_for_adafactor and (xp is not np or s == 0))

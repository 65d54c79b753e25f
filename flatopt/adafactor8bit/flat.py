"""The elementwise (unfactored) paths of ``Adafactor8Bit`` (private): Adafactor-style, Adam-style and SGD, as phases
over ranges aligned to the codec blocks (``flatopt.core.blocks``); see ``flat_phases``."""

from __future__ import annotations

import math

import numpy as np

from . import state as S
from ..adafactor.factored_passes import apply_tasks
from ..core import blocks, workspace
from . import quant
from .common import F32, eps1_of, ranges, src_chunk, ws


def flat_phases(xp, cfg, st, p, g, b, sc, *, sgd: bool, adam: bool):
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
    rng = ranges(xp, n, S.align(st))
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
        tmp = workspace.get(xp, "a8.t1", hi - lo, np.float32)
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
            x = src_chunk(xp, cfg, g, lo, hi)
            u = workspace.get(xp, "a8.uc", hi - lo, np.float32) if one_pass else u_all[lo:hi]
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
                su[k] = blocks.sumsq(xp, u, None)
            if cfg.scale_parameter:
                sp[k] = blocks.sumsq(xp, p[lo:hi], None)
        return run

    def _m_range(lo, hi, x):
        out = st.m[lo:hi] if st.m is not None else workspace.get(xp, "a8.mx", hi - lo, np.float32)
        return S.ema_range(xp, st, "m", lo, hi, x, 1.0 - cfg.beta1, out, floor=0.0)

    yield [(c, pass1(k, lo, hi)) for k, (c, lo, hi) in enumerate(rng)]
    if one_pass:
        return
    ssq_p = blocks.fold(sp, F32(0.0)) if cfg.scale_parameter else None
    d = cfg.d
    if mo1d:  # u ← u / max(1, RMS(u)/d); m ← lerp(m, u, 1 − β1); the step is m (no second clip)
        clip = xp.maximum(xp.sqrt(xp.asarray(blocks.fold(su, F32(0.0)), dtype=np.float32)) / F32(math.sqrt(n)) / F32(d),
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
                    su[k] = blocks.sumsq(xp, u, None)
            return run

        yield [(c, pass2(k, lo, hi)) for k, (c, lo, hi) in enumerate(rng)]
        d = 0.0
    ssq_u = blocks.fold(su, F32(0.0)) if (d > 0 or cfg.enable_fira_for_adafactor) else None
    alpha = sc.alpha(ssq_p)
    s = sc.step_scale(alpha, ssq_u, d=d)
    yield apply_tasks(xp, st, p, [(c, ((lo, hi),)) for c, lo, hi in rng], lambda _, lo, hi: u_all[lo:hi],
                         (None, None), 0, np.float32, s, sc.decay(alpha), None,
                         cfg.enable_fira_for_adafactor and (xp is not np or s == 0))

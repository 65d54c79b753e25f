"""APOLLO's low-rank direction U_low (as in adafactor8bit 0.4.6), used by
``flatopt.adafactor8bit.apollo``: from G_low, the low-rank moments (v_low and m_low, or the factorised row/column variances, and
CAME's confidence) and U_low.  ``direction`` runs the whole-slot array-agnostic form (``_low_rank_direction``) on
CuPy and for APOLLO + CAME without factorisation; on NumPy the other paths run the same arithmetic over ranges of
whole codec blocks (and whole rows, for the factorised ones) on the threads, their whole-tensor means and sums
folded in range order, so the bits do not depend on the thread count.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import state as S
from ..core import blocks, parallel
from . import came as _came, quant
from .common import F32, clip_, m_ema, ranges, sumsq, ws

# Elements per row-range task of APOLLO's full-size passes (G's statistics, θ's update) and of the factorised
# low-rank ranges: twice the elementwise ``adafactor8bit.common.TASK`` (longer NumPy calls hand the GIL over less often).
# Re-measure: ``python -m benchmarks.threads_probe sizes``.
TASK = 1 << 18


def direction(xp, cfg, st, glow, upd_low, tmp, b: float, t: int, threads: bool, *, row_norms: bool):
    """U_low into ``upd_low`` (flat), updating the low-rank moments; ``row_norms`` asks for (‖U_low,i‖²,
    ‖G_low,i‖²) of the rows of G_low, returned when the range tasks measured them (else None)."""
    came = cfg.beta3 is not None and cfg.beta1 is not None
    if xp is np and (cfg.apollo_factorize or not came):
        ranged = _factorized_direction_ranges if cfg.apollo_factorize else _plain_direction_ranges
        return ranged(cfg, st, glow, upd_low, tmp, b, t, threads, row_norms=row_norms)
    _low_rank_direction(xp, cfg, st, glow, upd_low.reshape(glow.shape), tmp, b, t)
    return None


def row_tasks(xp, rows: int, cols: int, fn, threads: bool, task: int | None = None) -> None:
    """fn(i0, i1) over row ranges of about ``task`` elements (cut by the shape alone, so every reduction a range
    makes is folded in the same order whatever the threads), on the threads when ``threads`` (NumPy; the caller
    must not itself be a worker task), else inline; CuPy: one range."""
    if xp is not np:
        fn(0, rows)
        return
    step = max(1, (TASK if task is None else task) // max(cols, 1))
    tasks = [((min(i + step, rows) - i) * cols, "apollo", functools.partial(fn, i, min(i + step, rows)))
             for i in range(0, rows, step)]
    parallel.run_tasks(tasks, serial=not threads)


def _low_rank_direction(xp, cfg, st, glow, out, tmp, b: float, t: int) -> None:
    """The low-rank adaptive direction U_low (written into ``out``), updating the low-rank moments."""
    lr_, lc_ = glow.shape
    flat, o = glow.reshape(-1), out.reshape(-1)
    ae = F32(cfg.apollo_eps)
    if cfg.apollo_factorize:
        g2 = xp.multiply(glow, glow, out=tmp.reshape(lr_, lc_))
        rm = (g2.mean(axis=-1) + F32(quant.FLT_MIN)).astype(np.float32)
        cm = (g2.mean(axis=-2) + F32(quant.FLT_MIN)).astype(np.float32)
        rv, cv = _factor_emas(xp, st, rm, cm, b, t)
        if cfg.beta1 is not None and cfg.beta3 is not None:
            rbar = xp.maximum(rv.mean(), F32(quant.FLT_MIN))
            u = xp.multiply(glow, (F32(1.0) / xp.sqrt(rv / rbar))[:, None], out=tmp.reshape(lr_, lc_))
            xp.multiply(u, (F32(1.0) / xp.sqrt(cv))[None, :], out=u)
            clip_(xp, tmp, cfg.d)
            m = m_ema(xp, st, "m_low", tmp, cfg.beta1, o)
            _came.factored_confidence(xp, cfg, st, tmp, m, (1, lr_, lc_), o, lo_rank=True,
                                      mean_floor=quant.FLT_MIN)
            return
        vest = (rv[:, None] * cv[None, :]) / xp.maximum(rv.mean(), ae)
        src = m_ema(xp, st, "m_low", flat, cfg.beta1, tmp) if cfg.beta1 is not None else flat
        xp.divide(src.reshape(lr_, lc_), xp.sqrt(vest) + ae, out=out)
        return
    v = S.ema(xp, st, "v_low", flat, b, square=True, first=t == 1, floor=quant.al_floor(cfg.apollo_eps))
    if cfg.beta3 is not None and cfg.beta1 is not None:
        eps_sq = max(cfg.apollo_eps**2, quant.FLT_MIN)
        xp.maximum(v, F32(eps_sq), out=tmp)
        xp.sqrt(tmp, out=tmp)
        xp.divide(F32(1.0), tmp, out=tmp)
        xp.multiply(flat, tmp, out=tmp)
        clip_(xp, tmp, cfg.d)
        m = m_ema(xp, st, "m_low", tmp, cfg.beta1, o)
        _came.elementwise_confidence(xp, cfg, st, tmp, m, o, eps_sq=eps_sq)
        return
    src = m_ema(xp, st, "m_low", flat, cfg.beta1, o) if cfg.beta1 is not None else flat
    xp.sqrt(v, out=tmp)
    xp.add(tmp, ae, out=tmp)
    xp.divide(src, tmp, out=o)


def _row_norms(glow, o, want: bool, step: int):
    """(‖U_low,i‖², ‖G_low,i‖², fn(lo, hi) that measures the rows of a flat range) when ``want`` and every range
    (starting at multiples of ``step`` elements) covers whole rows; else (None, None, a no-op)."""
    rows, cols = glow.shape
    if not want or step % cols:
        return None, None, lambda lo, hi: None
    un2, gn2 = np.empty(rows, np.float32), np.empty(rows, np.float32)
    um = o.reshape(rows, cols)

    def measure(lo, hi):
        i0, i1 = lo // cols, hi // cols
        np.einsum("ij,ij->i", um[i0:i1], um[i0:i1], out=un2[i0:i1])
        np.einsum("ij,ij->i", glow[i0:i1], glow[i0:i1], out=gn2[i0:i1])

    return un2, gn2, measure


def _plain_direction_ranges(cfg, st, glow, o, tmp, b: float, t: int, threads: bool, *, row_norms: bool = False):
    """NumPy, the plain path (no factorization, no CAME): v ← EMA of G_low², m ← EMA of G_low, U_low = m/(√v + ε)
    over ranges aligned to the codec blocks, on the threads when ``threads`` (elementwise, blockwise codecs: the
    same bits as the whole-slot ``_low_rank_direction``).  With ``row_norms``, when the ranges cover whole rows,
    each range also measures its rows of U_low and G_low: returns (‖U_low,i‖², ‖G_low,i‖²), else None."""
    flat = glow.reshape(-1)
    n, ae = flat.size, F32(cfg.apollo_eps)
    cuts = ranges(np, n, S.align(st))
    un2, gn2, measure = _row_norms(glow, o, row_norms, cuts[0][2])
    vx = ws(np, "a_vlow", n) if st.v_low is None else None  # exact values of a quantized state
    mx = ws(np, "a_mlow", n) if cfg.beta1 is not None and st.m_low is None else None
    floor = quant.al_floor(cfg.apollo_eps)

    def task(lo, hi):
        v = S.ema_range(np, st, "v_low", lo, hi, flat[lo:hi], b, None if vx is None else vx[lo:hi], floor=floor,
                        square=True, first=t == 1)
        src = flat[lo:hi]
        if cfg.beta1 is not None:
            src = S.ema_range(np, st, "m_low", lo, hi, src, 1.0 - cfg.beta1, None if mx is None else mx[lo:hi],
                              floor=0.0)
        tb = tmp[lo:hi]
        np.sqrt(v, out=tb)
        np.add(tb, ae, out=tb)
        np.divide(src, tb, out=o[lo:hi])
        measure(lo, hi)

    parallel.run_tasks([(c, "apollo", functools.partial(task, lo, hi)) for c, lo, hi in cuts], serial=not threads)
    return None if un2 is None else (un2, gn2)


def _factorized_direction_ranges(cfg, st, glow, o, tmp, b: float, t: int, threads: bool, *,
                                 row_norms: bool = False):
    """NumPy, ``apollo_factorize`` (the whole-slot ``_low_rank_direction`` on ranges, on the threads when
    ``threads``): the row and column means of G_low² + FLT_MIN over row ranges (row means as NumPy's ``mean`` of
    each row; column sums folded in range order), the float32 factor EMAs, then over ranges of whole rows and whole
    codec blocks of m_low m ← EMA of G_low and U_low = m/(√V̂ + ε) with V̂ = row·col/max(mean(row), ε) — with CAME
    (``_came_ranges``) the same passes split where the clip and the confidence need a whole-tensor sum.  With
    ``row_norms`` each last range also measures its rows (returns (‖U_low,i‖², ‖G_low,i‖²), else None)."""
    lr_, lc_ = glow.shape
    n, ae = glow.size, F32(cfg.apollo_eps)
    g2 = tmp.reshape(lr_, lc_)

    def stats(i0, i1):
        x = np.multiply(glow[i0:i1], glow[i0:i1], out=g2[i0:i1])
        return x.mean(axis=-1), np.add.reduce(x, axis=0)

    rm, cm = _row_col_means(stats, lr_, lc_, threads)
    rv, cv = _factor_emas(np, st, np.add(rm, F32(quant.FLT_MIN)), np.add(cm, F32(quant.FLT_MIN)), b, t)
    flat = glow.reshape(-1)
    mx = ws(np, "a_mlow", n) if cfg.beta1 is not None and st.m_low is None else None
    unit = math.lcm(S.align(st), lc_) // lc_  # rows that fill whole codec blocks of m_low
    step = max(unit, TASK // lc_ // unit * unit)
    un2, gn2, measure = _row_norms(glow, o, row_norms, step * lc_)

    def over_rows(fn):
        parallel.run_tasks([((min(i + step, lr_) - i) * lc_, "apollo", functools.partial(fn, i, min(i + step, lr_)))
                             for i in range(0, lr_, step)], serial=not threads)

    def m_ema(i0, i1, x):
        lo, hi = i0 * lc_, i1 * lc_
        return S.ema_range(np, st, "m_low", lo, hi, x, 1.0 - cfg.beta1, None if mx is None else mx[lo:hi],
                           floor=0.0)

    if cfg.beta3 is not None and cfg.beta1 is not None:
        _came_ranges(cfg, st, glow, o, g2, rv, cv, m_ema, over_rows, measure)
    else:
        den = np.maximum(rv.mean(), ae)

        def task(i0, i1):
            lo, hi = i0 * lc_, i1 * lc_
            src = flat[lo:hi] if cfg.beta1 is None else m_ema(i0, i1, flat[lo:hi])
            vb = g2[i0:i1]
            np.multiply(rv[i0:i1, None], cv[None, :], out=vb)
            np.divide(vb, den, out=vb)
            np.sqrt(vb, out=vb)
            np.add(vb, ae, out=vb)
            np.divide(src.reshape(i1 - i0, lc_), vb, out=o[lo:hi].reshape(i1 - i0, lc_))
            measure(lo, hi)

        over_rows(task)
    return None if un2 is None else (un2, gn2)


def _row_col_means(stats, rows: int, cols: int, threads: bool):
    """(row means, column means) of a rows×cols matrix from ``stats(i0, i1) -> (row means, column sums)`` over row
    ranges; the column sums folded in range order."""
    rm, parts = np.empty(rows, np.float32), {}

    def task(i0, i1):
        rm[i0:i1], parts[i0] = stats(i0, i1)

    row_tasks(np, rows, cols, task, threads)
    return rm, blocks.fold_keyed(parts) / F32(rows)


def _came_ranges(cfg, st, glow, o, u, rv, cv, m_ema, over_rows, measure) -> None:
    """APOLLO + CAME with ``apollo_factorize`` over row ranges (``_factorized_direction_ranges``): U = G_low·rsqrt(
    row/r̄)·rsqrt(col) into ``u``, its RMS clip by d (a whole-tensor Σu², from per-range sums folded in order),
    m ← EMA of U, res = (U − m)² + eps_came with its row and column means, the confidence EMAs and factors
    (``adafactor8bit.came.confidence_factors``), U_low = m·rsqrt(c_row/c̄)·rsqrt(c_col)."""
    lr_, lc_ = glow.shape
    rbar = np.maximum(rv.mean(), F32(quant.FLT_MIN))
    inv_r, inv_c = F32(1.0) / np.sqrt(rv / rbar), F32(1.0) / np.sqrt(cv)
    sums = {}

    def scaled(i0, i1):
        ub = np.multiply(glow[i0:i1], inv_r[i0:i1, None], out=u[i0:i1])
        np.multiply(ub, inv_c[None, :], out=ub)
        if cfg.d > 0:
            sums[i0] = sumsq(np, ub.reshape(-1))

    over_rows(scaled)
    clip = None
    if cfg.d > 0:
        rms = np.sqrt(blocks.fold_keyed(sums)).astype(np.float32) / F32(math.sqrt(u.size))
        clip = np.maximum(rms / F32(cfg.d), F32(1.0))
    res_row, col_parts, ms = np.empty(lr_, np.float32), {}, {}

    def residual(i0, i1):
        ub = u[i0:i1]
        if clip is not None:
            np.divide(ub, clip, out=ub)
        ms[i0] = m = m_ema(i0, i1, ub.reshape(-1)).reshape(i1 - i0, lc_)
        _came.residual(np, cfg, ub, m)
        ub.mean(axis=-1, out=res_row[i0:i1])
        col_parts[i0] = np.add.reduce(ub, axis=0)

    over_rows(residual)
    res_col = blocks.fold_keyed(col_parts) / F32(lr_)
    inv_row, inv_col = _came.confidence_factors(np, cfg, st, res_row, res_col, (1, lr_, lc_), lo_rank=True,
                                                mean_floor=quant.FLT_MIN)

    def update(i0, i1):
        ob = o[i0 * lc_:i1 * lc_].reshape(i1 - i0, lc_)
        np.multiply(ms[i0], inv_row[0, i0:i1, None], out=ob)
        np.multiply(ob, inv_col[0, None, :], out=ob)
        measure(i0 * lc_, i1 * lc_)

    over_rows(update)


def _factor_emas(xp, st, rm, cm, b: float, t: int):
    """``apollo_factorize``'s float32 row and column EMAs (b·x at t = 1, then (1 − b)·v + b·x), updated in place."""
    rv, cv = st.row_var_low, st.col_var_low
    for v, x in ((rv, rm), (cv, cm)):
        if t == 1:
            xp.multiply(x, F32(b), out=v)
        else:
            xp.multiply(v, F32(1.0 - b), out=v)
            xp.add(v, x * F32(b), out=v)
    return rv, cv

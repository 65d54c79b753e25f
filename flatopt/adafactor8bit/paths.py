"""The non-APOLLO update paths of ``Adafactor8Bit`` (private): the dispatch, factored and CAME here; unfactored
(Adafactor- and Adam-style) and SGD in ``adafactor8bit.flat``; the step's scalars and the helpers the APOLLO path shares in
``adafactor8bit.common``.

Formulas: those of the Python package adafactor8bit 0.4.6 (its pure-PyTorch path, float32).  Each path is a
generator of *phases* (``flatopt.core.blocks``): the factored paths (Adafactor and CAME) are
composed from Adafactor's own blocked passes (``FactoredPasses``: row/column statistics, factors, ΣU², apply) with
the 8-bit factor EMA (lerp, requantized) plugged in; the elementwise states (V, m) are updated over ranges aligned
to the codec blocks (``adafactor8bit.state.ema_range``), so ranges run on any thread and every reduction is folded in range
order: the bits do not depend on the threads.  The exact float32 EMA drives the step; only the stored copy is
requantized.

Differences in float32 rounding from the original (all within its float32 noise; codes still equal): the row and
column sums are per block (einsum, or single-threaded BLAS GEMVs for tensors of ``adafactor.factored_passes.BLAS_MIN``
elements or more while the BLAS is held at one thread) rather than torch's reductions, and the clip and step scale are folded into one
multiplier (θ ← θ·decay − s·U rather than θ·decay + (−α/clip)·U).  ``lag_norm`` (the original: CUDA only) is
honoured on every backend for the non-APOLLO paths: the clip and the Fira factor of step t use step t − 1's norm
(no clip at t = 1); a non-finite norm is carried over as 0.

Data-dependent scalars (α, norms, clip denominators, the Fira factor) are 0-d arrays of the parameter's array
module, so on CuPy they stay on the device (no host synchronisation); on CuPy a path is one range / one block.
This is the twin of the fused CUDA steps (``adafactor8bit.fused``), which replace it on CuPy where they apply.
"""

from __future__ import annotations

import math

import numpy as np

from . import state as S
from ..adafactor.factored_passes import BLAS_MIN, FactoredPasses
from ..core import blocks, workspace
from . import quant
from .common import F32, Scalars, eps1_of, ranges, src_chunk, ws
from .flat import flat_phases


def update(xp, cfg, st, p, g, *, t: int, lr, shape, blas: bool = False) -> None:
    """One non-APOLLO step of Adafactor8Bit on the flat buffers ``p`` (in place) and ``g`` (all phases inline)."""
    blocks.run_serial(phases(xp, cfg, st, p, g, t=t, lr=lr, shape=shape, blas=blas))


def phases(xp, cfg, st, p, g, *, t: int, lr, shape, blas: bool = False):
    """One non-APOLLO step as a generator of phases of independent tasks (``flatopt.core.blocks``): lists of
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
        yield from _came_path(xp, cfg, st, p, g, b, sc, shape, blas)
    elif not sgd and len(shape) >= 2 and cfg.factored:
        yield from _factored(xp, cfg, st, p, g, b, sc, shape, blas)
    else:
        yield from flat_phases(xp, cfg, st, p, g, b, sc, sgd=sgd, adam=adam)


def _m_tasks(xp, cfg, st, g):
    """The first moment m ← lerp(m, g, 1 − β1) over aligned ranges (tasks) and the array of its exact values:
    the float32 state itself, or (quantized) the calling thread's full-size workspace."""
    n = g.size
    exact = st.m if st.m is not None else ws(xp, "a8.m_exact", n)

    def task(lo, hi):
        def run():
            S.ema_range(xp, st, "m", lo, hi, src_chunk(xp, cfg, g, lo, hi), 1.0 - cfg.beta1, exact[lo:hi],
                        floor=0.0)
        return run

    return exact, [(c, task(lo, hi)) for c, lo, hi in ranges(xp, n, S.align(st))]


def _factored(xp, cfg, st, p, g, b, sc, shape, blas=False):
    """Factored second moment through Adafactor's blocked passes (``adafactor.factored_passes.FactoredPasses``) with the
    original's factor EMA (lerp; requantized) and r̄ floor; Adam-style momentum (EMA of G, then normalised)."""
    momentum = cfg.beta1 is not None
    # a quantized m is updated block by block inside the statistics pass when the blocks meet its codec blocks
    fp = FactoredPasses(xp, st, p, shape, align=cfg.m_block_size if momentum and st.m is None else 1)
    fp.blas = blas and xp is np and p.size >= BLAS_MIN  # GEMV sums (the caller holds the BLAS at one thread)
    if not momentum:  # U from G: ΣU² fused into the statistics pass
        yield from _fused_stats(xp, cfg, st, fp, g, b)
        src, ssq_u = g, fp.fused_ssq()
    elif fp.aligned:  # m ← lerp(m, G, 1 − β1) per block in the same pass, ΣU² from m fused too
        src = st.m if st.m is not None else ws(xp, "a8.m_exact", p.size)

        def m_block(lo, hi):
            return S.ema_range(xp, st, "m", lo, hi, src_chunk(xp, cfg, g, lo, hi), 1.0 - cfg.beta1, src[lo:hi],
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
        S.lerp_(xp, rb, sums, b, workspace.get(xp, "a8.rows", sums.size, np.float32).reshape(sums.shape))
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


def _came_path(xp, cfg, st, p, g, b, sc, shape, blas=False):
    """CAME (factored, β1 and β3) through the same blocked passes: U = G·rsqrt(R/r̄)·rsqrt(C) clipped by RMS(U)/d;
    m ← lerp(m, U, 1 − β1); res = (U − m)² + eps_came; confidence factors ← lerp(·, row/column means of res, 1 − β3);
    step m·rsqrt(c_row/c̄)·rsqrt(c_col) (no second clip; Fira optional).  On NumPy, when the blocks start at whole
    codec blocks of m, U, its m update, U − m and the statistics of (U − m)² are made block by block in one pass
    (U − m never stored); otherwise U (then U − m) is written whole first.  Full-size scratch: that U and, for a
    quantized m, its exact values."""
    n = p.size
    eps1 = eps1_of(cfg)
    fp = FactoredPasses(xp, st, p, shape, align=cfg.m_block_size if xp is np and st.m is None else 1)
    fp.blas = blas and xp is np and p.size >= BLAS_MIN  # GEMV sums (the caller holds the BLAS at one thread)
    yield from _fused_stats(xp, cfg, st, fp, g, b)
    alpha = sc.alpha(fp.ssq_p)
    if cfg.d > 0:  # fold 1/max(1, RMS(U)/d) into the column factor
        rms = xp.sqrt(xp.asarray(fp.fused_ssq(), dtype=np.float32)) / F32(math.sqrt(n))
        xp.divide(fp.colv, xp.maximum(rms / F32(cfg.d), F32(1.0)), out=fp.colv)
    if cfg.maximize:
        xp.negative(fp.colv, out=fp.colv)
    m_all = st.m if st.m is not None else ws(xp, "a8.m_exact", n)

    def residual(u, lo, hi):  # m ← lerp(m, U, 1 − β1) for U[lo:hi]; U − m (its square is the instability)
        m = S.ema_range(xp, st, "m", lo, hi, u, 1.0 - cfg.beta1, m_all[lo:hi], floor=0.0)
        return xp.subtract(u, m, out=u)

    if xp is np and fp.aligned:
        yield from fp.stats(None, xblock=fp.u_source(g, residual))
    else:
        u_all = ws(xp, "a8.u", n)
        yield fp.write(g, u_all)
        yield [(c, lambda lo=lo, hi=hi: residual(u_all[lo:hi], lo, hi)) for c, lo, hi in ranges(xp, n, S.align(st))]
        yield from fp.stats(u_all)
    CR, CC = _ema_factors(xp, st, fp, ("conf_row", "conf_col"), 1.0 - cfg.beta3, cfg.eps_came)
    fp.factors(CR, CC, rbar_floor=F32(eps1))
    ssq = None
    if cfg.enable_fira_for_adafactor:
        yield from fp.sums(m_all, False)
        ssq = fp.ssq_u
    s = sc.step_scale(alpha, ssq, d=0.0)
    yield fp.apply(st, m_all, s, sc.decay(alpha), None, zero_nonfinite=cfg.enable_fira_for_adafactor)

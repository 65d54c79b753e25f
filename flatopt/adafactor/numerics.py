"""Adafactor's array-agnostic step (the twin of ``kernels/adafactor.cu``), written once against ``xp``.

Factored (``factored_phases``), two passes over G, composed from ``flatopt.adafactor.factored_passes``:

1. statistics, block by block: row and column sums of G²; each row's new R_i is final as soon as its row has been
   summed, so the same pass also sums W_j = Σ_i G²_ij/R_i and Σθ² (for RMS(θ), when parameter scaling is on).
   Then C, r̄ and the factors, and ΣU² = r̄·Σ_j W_j/C_j without another pass over G;
2. U is formed block by block (column factor, then row factor), scaled by α/max(1, RMS(U)/d) (folded into the
   column factor), pushed through the optional first moment, and θ ← θ·(1 − α·λ) − Δ.

Unfactored (``unfactored_phases``): V ← β̂₂V + (1 − β̂₂)(G² + ε₁) with ΣU² and Σθ² in the same pass, then the update.

Both are generators of phases of block tasks (``flatopt.core.blocks``: bits independent of the threads).  On NumPy
nothing is allocated after the first step of a name; on CuPy the whole tensor is one block and every data-dependent
scalar (Σθ², α, ΣU², the clip factor) stays a 0-d device array: no host synchronisation.
"""

from __future__ import annotations

import math

import numpy as np

from ..core import blocks
from ..core.blocks import block_sizes, flat_blocks, fold, runs, sumsq
from .factored_passes import BLAS_MIN, FactoredPasses, Work, apply_tasks


def step_sizes(cfg, t: int, lr: float) -> tuple[float, float]:
    """(ρ, β̂₂) of step t; ``lr`` is the driver's rate: lr·lr_scale (manual) or lr_scale (relative step)."""
    if cfg.lr is None:
        lr *= min(1e-6 * t if cfg.warmup_init else 1e-2, 1.0 / math.sqrt(t))
    beta = cfg.beta2 if cfg.beta2 is not None else 1.0 - float(t) ** cfg.beta2_decay
    return lr, beta


def st_shape(st, p) -> tuple[int, int, int]:
    """The (B, r, c) view of a factored state (from its row and column lengths and n)."""
    nr, nc, n = st.exp_avg_sq_row.size, st.exp_avg_sq_col.size, p.size
    # n = B·r·c, nr = B·r, nc = B·c  =>  B = nr·nc / n
    b = nr * nc // n
    return (b, nr // b, nc // b)


def factored_phases(xp, st, p, g, shape, *, beta: float, eps1: float, need_rms: bool, scalars, blas: bool = False):
    """One factored step of Adafactor as a generator of phases (see the module documentation):
    R ← β̂₂R + (1 − β̂₂)(mean_j G² + ε₁), C likewise, U = G·rsqrt(R/r̄)·rsqrt(C); ``scalars(ssq_p, ssq_u, n)``
    returns (step scale α/max(1, RMS(U)/d), decay 1 − α·λ or None, beta1 or None) from Σθ² (None unless
    ``need_rms``) and ΣU².  ``blas`` (NumPy, the caller holds the BLAS at one thread): a tensor of at least
    ``BLAS_MIN`` elements makes its statistics-pass sums as GEMVs and Σθ² as a dot (see ``BLAS_MIN``)."""
    fp = FactoredPasses(xp, st, p, shape)
    fp.blas = blas and xp is np and p.size >= BLAS_MIN
    bdim, r, c = fp.dims
    omb = 1.0 - beta
    R, C = st.exp_avg_sq_row.reshape(bdim, r), st.exp_avg_sq_col.reshape(bdim, c)

    def rows(b0, b1, i0, i1, s):  # R ← β̂₂R + (1 − β̂₂)·(mean_j G² + ε₁) for these rows; s ← 1/R
        s /= c  # mean(G²) + ε₁ = mean(G² + ε₁)
        s += eps1
        s *= omb
        rb = R[b0:b1, i0:i1]
        rb *= beta
        rb += s
        return xp.divide(1.0, rb, out=s)

    yield from fp.stats(g, rows=rows, need_rms=need_rms)
    fp.colv += eps1
    C *= beta
    fp.colv *= omb
    C += fp.colv
    fp.factors(R, C)
    step_scale, decay, beta1 = scalars(fp.ssq_p, fp.fused_ssq(), p.size)
    yield fp.apply(st, g, step_scale, decay, beta1)


def unfactored_phases(xp, st, p, g, *, beta: float, eps1: float, need_rms: bool, scalars):
    """One unfactored step as a generator of phases: V ← β̂₂V + (1 − β̂₂)(G² + ε₁), U = G/√V."""
    n = p.size
    bl = flat_blocks(n, blocks.limit(xp, n))
    nb = len(bl)
    big = max(hi - lo for lo, hi in bl)
    dtype = p.dtype
    shared = None if xp is np else blocks.buffers(xp, big, dtype)
    w = st.work
    if w is None or len(w.su) != nb:
        w = st.work = Work(None, None, None, None, su=[None] * nb, sp=[None] * nb)
    su, sp = w.su, w.sp
    sizes = block_sizes(bl)
    omb = 1.0 - beta
    v = st.exp_avg_sq

    def u_block(ubuf, lo, hi):
        u = ubuf[: hi - lo]
        xp.sqrt(v[lo:hi], out=u)
        xp.divide(g[lo:hi], u, out=u)
        return u

    # pass 1 (with pass 2 fused: the block of V is still in cache)
    def pass12(k0, k1):
        def run():
            ubuf, sq = shared or blocks.buffers(np, big, dtype)
            for k in range(k0, k1):
                lo, hi = bl[k]
                s = sq[: hi - lo]
                xp.multiply(g[lo:hi], g[lo:hi], out=s)
                s += eps1
                s *= omb
                vb = v[lo:hi]
                vb *= beta
                vb += s
                su[k] = sumsq(xp, u_block(ubuf, lo, hi), s)
                if need_rms:
                    sp[k] = sumsq(xp, p[lo:hi], s)
        return run

    yield [(cost, pass12(a, b)) for cost, a, b in runs(sizes, 0, nb, blocks.TASK)]
    ssq_u = fold(su, 0.0)
    ssq_p = fold(sp, 0.0) if need_rms else None
    step_scale, decay, beta1 = scalars(ssq_p, ssq_u, n)
    tasks = [(cost, bl[a:b]) for cost, a, b in runs(sizes, 0, nb, blocks.TASK)]
    yield apply_tasks(xp, st, p, tasks, u_block, shared, big,
                       dtype, step_scale, decay, beta1)

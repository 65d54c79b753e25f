"""Adafactor's fused CUDA path (``kernels/adafactor.cu``); the array-agnostic twin is ``adafactor.numerics``.

Up to eight small launches per step on the current stream, no host synchronisation: every data-dependent scalar
(Σθ², α, ΣU², the clip factor) is computed by ``af_scalars`` into a 2-element device array read by ``af_apply``.
Temporaries come from CuPy's memory pool (no cudaMalloc once warm).
"""

from __future__ import annotations

import numpy as np

from ..core import backend, kernels
from .numerics import st_shape, step_sizes

THREADS = 256  # AF_THREADS in the .cu file
MAX_PARTIALS = 1024  # fixed upper bound of the reduction grid (the grid depends on n only: deterministic)
MAX_GRID = 1 << 20


def kernel_step(cfg, st, p, g, *, t: int, lr: float) -> bool:
    cp = backend.cupy()
    n = p.size
    if n == 0:
        return True
    rho, beta = step_sizes(cfg, t, lr)
    dt = p.dtype.type
    i64 = np.int64

    def k(name):
        return kernels.get("adafactor.cu", name, p.dtype)

    nparts = min((n + THREADS - 1) // THREADS, MAX_PARTIALS)
    scal = cp.empty(2, p.dtype)
    factored = st.exp_avg_sq is None
    if factored:  # the twin's fused statistics (factored_passes.FactoredPasses.stats / fused_ssq): see the .cu file
        b, r, c = st_shape(st, p)
        buf = cp.empty(nparts + b * r + 2 * b * c + b, p.dtype)
        p_parts = buf[:nparts]
        rows = buf[nparts:nparts + b * r]
        cols = buf[nparts + b * r:nparts + b * r + b * c]
        wsum = buf[nparts + b * r + b * c:nparts + b * r + 2 * b * c]
        u_parts = buf[nparts + b * r + 2 * b * c:]  # ΣU² of each matrix
        k("af_row_sumsq")((min(b * r, MAX_GRID),), (THREADS,), (g, i64(b * r), i64(c), rows))
        ema = k("af_ema")
        # rows: the row sums, then 1/R (the new R), which weighs W = Σ_i G²/R_i
        backend.launch(ema, b * r, (st.exp_avg_sq_row, rows, i64(b * r), dt(c), dt(cfg.eps1), dt(beta),
                                     dt(1.0 - beta), np.int32(1)), THREADS)
        backend.launch(k("af_col_sumsq"), b * c, (g, rows, i64(b), i64(r), i64(c), cols, wsum), THREADS)
        backend.launch(ema, b * c, (st.exp_avg_sq_col, cols, i64(b * c), dt(r), dt(cfg.eps1), dt(beta),
                                     dt(1.0 - beta), np.int32(0)), THREADS)
        # rows and cols now receive the factors rsqrt(R / r̄) and rsqrt(C); u_parts r̄_b·Σ_j c_bj²·W_bj
        k("af_factors")((min(b, MAX_GRID),), (THREADS,), (st.exp_avg_sq_row, st.exp_avg_sq_col, wsum, i64(b),
                                                          i64(r), i64(c), rows, cols, u_parts))
        rfac, cfac, v = rows, cols, g  # v unused
        nu = b
    else:
        r = c = 1
        parts = cp.empty(2 * nparts, p.dtype)
        p_parts, u_parts = parts[:nparts], parts[nparts:]
        v = st.exp_avg_sq
        backend.launch(k("af_v_update"), n, (g, v, i64(n), dt(cfg.eps1), dt(beta), dt(1.0 - beta)), THREADS)
        k("af_u_partials")((nparts,), (THREADS,), (g, v, i64(n), u_parts))
        rfac = cfac = g  # unused
        nu = nparts
    scale = bool(cfg.scale_parameter)
    if scale:
        k("af_sumsq_partials")((nparts,), (THREADS,), (p, i64(n), p_parts))
    k("af_scalars")((1,), (THREADS,), (p_parts, np.int32(nparts), u_parts, i64(nu), i64(n), dt(rho),
                                       dt(cfg.eps2), dt(cfg.clip_threshold), dt(cfg.weight_decay),
                                       np.int32(scale), scal))
    has_m = st.exp_avg is not None
    b1 = cfg.beta1 if has_m else 0.0
    backend.launch(k("af_apply"), n, (p, g, rfac, cfac, v, st.exp_avg if has_m else p, i64(n), i64(r), i64(c),
                                       np.int32(factored), scal, dt(b1), dt(1.0 - b1), np.int32(has_m),
                                       np.int32(cfg.weight_decay != 0)), THREADS)
    return True

"""Adafactor's fused CUDA path (``kernels/adafactor.cu``); the array-agnostic twin is ``adafactor.numerics``.

Seven small launches per step on the current stream, no host synchronisation: every data-dependent scalar
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
    parts = cp.empty(2 * nparts, p.dtype)
    p_parts, u_parts = parts[:nparts], parts[nparts:]
    scal = cp.empty(2, p.dtype)
    factored = st.exp_avg_sq is None
    if factored:
        b, r, c = st_shape(st, p)
        rows, cols = cp.empty(b * r, p.dtype), cp.empty(b * c, p.dtype)
        k("af_row_sumsq")((min(b * r, MAX_GRID),), (THREADS,), (g, i64(b * r), i64(c), rows))
        backend.launch(k("af_col_sumsq"), b * c, (g, i64(b), i64(r), i64(c), cols), THREADS)
        ema = k("af_ema")
        backend.launch(ema, b * r, (st.exp_avg_sq_row, rows, i64(b * r), dt(c), dt(cfg.eps1), dt(beta),
                                     dt(1.0 - beta)), THREADS)
        backend.launch(ema, b * c, (st.exp_avg_sq_col, cols, i64(b * c), dt(r), dt(cfg.eps1), dt(beta),
                                     dt(1.0 - beta)), THREADS)
        # rows and cols now receive the factors rsqrt(R / r̄) and rsqrt(C)
        k("af_factors")((min(b, MAX_GRID),), (THREADS,), (st.exp_avg_sq_row, st.exp_avg_sq_col, i64(b), i64(r),
                                                          i64(c), rows, cols))
        rfac, cfac, v = rows, cols, g  # v unused
    else:
        r = c = 1
        v = st.exp_avg_sq
        backend.launch(k("af_v_update"), n, (g, v, i64(n), dt(cfg.eps1), dt(beta), dt(1.0 - beta)), THREADS)
        rfac = cfac = g  # unused
    scale = bool(cfg.scale_parameter)
    if scale:
        k("af_sumsq_partials")((nparts,), (THREADS,), (p, i64(n), p_parts))
    k("af_u_partials")((nparts,), (THREADS,), (g, rfac, cfac, v, i64(n), i64(r), i64(c), np.int32(factored),
                                               u_parts))
    k("af_scalars")((1,), (THREADS,), (p_parts, np.int32(nparts), u_parts, np.int32(nparts), i64(n), dt(rho),
                                       dt(cfg.eps2), dt(cfg.clip_threshold), dt(cfg.weight_decay),
                                       np.int32(scale), scal))
    has_m = st.exp_avg is not None
    b1 = cfg.beta1 if has_m else 0.0
    backend.launch(k("af_apply"), n, (p, g, rfac, cfac, v, st.exp_avg if has_m else p, i64(n), i64(r), i64(c),
                                       np.int32(factored), scal, dt(b1), dt(1.0 - b1), np.int32(has_m),
                                       np.int32(cfg.weight_decay != 0)), THREADS)
    return True

"""Muon's fused CuPy step: the twin's GEMMs, with the elementwise work between them in the kernels of
``kernels/muon.cu`` (``Muon.kernel_fn``; ``FLATOPT_FORCE_TWIN=1`` runs the twin instead).

Per step, for ns_steps = k: one kernel for the momentum rule and X∘X, the sum of squares (the twin's own CuPy
reduction ``y.sum()``, into the state's 0-d buffer), one kernel for the normalisation, then per Newton–Schulz
iteration the twin's three GEMMs (the same ``matmul`` calls) and two kernels: B = (A·A)·c + A·b and
Y = B·X + X·a; the last iteration's second kernel also applies the decay and the update to the parameter.
3 + 5k launches (28 at the default k = 5; the twin issues 10 + 8k), no host synchronisation, no allocation after
the name's first step.  Every kernel performs the twin's operations on one element in the twin's order (see the
.cu file), and the GEMMs and the sum are the twin's calls on the same operands, so the result is the twin's bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import backend, kernels
from ..core.types import Array
from .numerics import gram, shape_scale, work

FILE = "muon.cu"


def kernel_update(cfg: Any, st: Any, p: Array, g: Array, *, t: int, lr: float) -> bool:
    """The fused step of one matrix on CuPy (always taken: returns True)."""
    xp = backend.cupy()
    w = work(xp, st, p)
    r, c = st.shape
    n = p.size
    dt = p.dtype.type

    def k(name: str) -> Any:
        return kernels.get(FILE, name, p.dtype)

    mu = cfg.momentum
    backend.launch(k("muon_momentum"), n, (st.momentum_buffer, g, w.x, w.y, np.int64(n), dt(mu), dt(1.0 - mu),
                                           np.int32(cfg.momentum_convention == "ema"), np.int32(cfg.nesterov)))
    w.y.sum(out=w.sumsq)
    backend.launch(k("muon_normalize"), n, (w.x, w.sumsq, np.int64(n), dt(cfg.eps),
                                            np.int32(cfg.eps_mode == "clamp")))
    a, b, cc = (dt(v) for v in cfg.ns_coefficients)
    kk = w.a.size
    x, y, xm, ym = w.x, w.y, w.xm, w.ym
    wide = r <= c
    for it in range(cfg.ns_steps):
        gram(xp, xm, w.a, wide)
        xp.matmul(w.a, w.a, out=w.b)
        backend.launch(k("muon_ns_b"), kk, (w.b, w.a, np.int64(kk), b, cc))
        if wide:
            xp.matmul(w.b, xm, out=ym)
        else:
            xp.matmul(xm, w.b, out=ym)
        if it + 1 < cfg.ns_steps:
            backend.launch(k("muon_ns_combine"), n, (y, x, np.int64(n), a))
            x, y, xm, ym = y, x, ym, xm
        else:
            use_wd = cfg.weight_decay != 0
            decay = dt(1.0 - lr * cfg.weight_decay) if use_wd else dt(1.0)
            backend.launch(k("muon_ns_final"), n, (p, y, x, np.int64(n), a, decay,
                                                   dt(-lr * shape_scale(cfg, st.shape)), np.int32(use_wd)))
    return True

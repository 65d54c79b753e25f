"""Muon's shared pieces of the twin and the fused step: the lr-adjust factor and the per-name work buffers
(private; the public names are re-exported by ``flatopt.muon``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..core import backend as _backend
from ..core.types import Array


def shape_scale(cfg: Any, shape: tuple[int, ...]) -> float:
    """The lr-adjust factor s of ``cfg.adjust_lr`` for a stored (rows, cols) shape."""
    r, c = shape
    if cfg.adjust_lr == "original":
        fan_out, fan_in = (r, c) if cfg.layout == "out_in" else (c, r)
        return math.sqrt(max(1.0, fan_out / fan_in))
    if cfg.adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(r, c))
    return 1.0


@dataclasses.dataclass
class Work:
    """The work buffers of a name (allocated at its first step, never saved): the flat X and Y (r·c), their (r, c)
    views, the min(r, c)² matrices A and B, and a 0-d sum of squares (the fused path's ``out=``)."""

    x: Array
    y: Array
    xm: Array
    ym: Array
    a: Array
    b: Array
    sumsq: Array


def work(xp: Any, st: Any, p: Array) -> Work:
    """The state's work buffers on ``p``'s backend (allocated once)."""
    w: Work | None = st.work
    if w is None or _backend.backend_name(w.x) != _backend.backend_name(p):
        r, c = st.shape
        k = min(r, c)
        x, y = xp.empty_like(p), xp.empty_like(p)
        w = st.work = Work(x, y, x.reshape(r, c), y.reshape(r, c), xp.empty((k, k), p.dtype),
                           xp.empty((k, k), p.dtype), xp.zeros((), p.dtype))
    return w


def gram(xp: Any, xm: Array, out: Array, wide: bool) -> None:
    """The Gram matrix X·Xᵀ (wide) or Xᵀ·X in one call: NumPy's BLAS computes it by syrk (half the work of the row
    blocks, and faster than them: ``python -m benchmarks.run --only muon``)."""
    if wide:
        xp.matmul(xm, xm.T, out=out)
    else:
        xp.matmul(xm.T, xm, out=out)

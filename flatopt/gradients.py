"""Helpers on lists of flat gradient buffers: global norm, clipping by global norm, an all-finite check.

They work on NumPy and CuPy alike and never synchronise with the host on CuPy: results are 0-d device arrays
that you may pass on (``clip_by_global_norm`` scales on the device).  Reading one on the host (``float(norm)``,
``bool(ok)``) is the caller's one deliberate synchronisation per iteration, outside any optimizer step.

The "check finite gradients, then skip consistently" workflow::

    ok = flatopt.gradients.all_finite(grads)           # one reduction over every buffer
    if bool(ok):                                       # host decision, once per iteration
        flatopt.gradients.clip_by_global_norm(grads, max_norm=1.0)
        opt.step_batch(items)                          # every parameter stepped ...
    # ... or none: no moment, no decay, no step count changes for any parameter

Unlike rlx-optim's ``l2_norm``, non-finite values are not skipped: a NaN or Inf anywhere makes the norm NaN or Inf
and ``all_finite`` False, so they are reported instead of silently ignored.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .core import backend
from .core.types import Array

__all__ = ["global_norm", "all_finite", "clip_by_global_norm"]


def _xp(buffers: Sequence[Array]) -> Any:
    if not buffers:
        raise ValueError("expected at least one buffer")
    return backend.array_module(*buffers)


def global_norm(buffers: Sequence[Array]) -> Array:
    """√(Σ over every buffer of Σ x²), accumulated in float64; a 0-d array on the buffers' backend."""
    xp = _xp(buffers)
    total = xp.zeros((), xp.float64)
    for b in buffers:
        b64 = b.reshape(-1)
        total = total + xp.dot(b64, b64) if b64.dtype == xp.float64 else total + _sumsq64(xp, b64)
    return xp.sqrt(total)


def _sumsq64(xp: Any, b: Array, chunk: int = 1 << 16) -> Array:
    """Σ x² of a float32 buffer in float64: chunked on NumPy so no full-size float64 copy is made; one cast and
    one dot on CuPy (a pooled temporary; a host loop of small launches would cost more)."""
    if xp is not np:
        c = b.astype(xp.float64)
        return xp.dot(c, c)
    acc = xp.zeros((), xp.float64)
    for lo in range(0, b.size, chunk):
        c = b[lo : lo + chunk].astype(xp.float64)
        acc = acc + xp.dot(c, c)
    return acc


def all_finite(buffers: Sequence[Array]) -> Array:
    """True (a 0-d bool array) when no buffer holds a NaN or an infinity."""
    xp = _xp(buffers)
    ok = xp.ones((), bool)
    for b in buffers:
        if b.dtype == xp.float32:
            # float32 values summed in float64 cannot overflow (3.4e38 × 2^63 < 1.8e308): the sum is finite
            # exactly when every element is; no bool temporary of the buffer's size
            ok = xp.logical_and(ok, xp.isfinite(b.sum(dtype=xp.float64)))
        else:
            ok = xp.logical_and(ok, xp.isfinite(b).all())
    return ok


def clip_by_global_norm(buffers: Sequence[Array], max_norm: float, eps: float = 1e-6) -> Array:
    """Scale every buffer in place by min(1, max_norm / (norm + eps)) (``torch.nn.utils.clip_grad_norm_``
    semantics); return the norm before clipping.  These are *your* gradient buffers: optimizers never write
    gradients, this helper does so only because you ask it to.  With a non-finite norm the buffers become
    non-finite too: check ``all_finite`` first."""
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm!r}")
    xp = _xp(buffers)
    norm = global_norm(buffers)
    coef = xp.minimum(max_norm / (norm + eps), 1.0)
    for b in buffers:
        b *= coef.astype(b.dtype)
    return norm

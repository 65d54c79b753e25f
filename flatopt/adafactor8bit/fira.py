"""The Fira norm-growth limiter (Chen et al., "Fira"; as in adafactor8bit 0.4.6 ``_compute_fira_scale``).

Given the norm n of this step's update direction (non-finite → 0) and the previous, already limited norm ``prev``::

    prev < 1e-6 (first call or reset):  f = 1,                                   prev ← n
    otherwise:                          f = 1 / (max(n/(prev + 1e-8), 1 + margin)/(1 + margin)),   prev ← n·f

so the update norm may grow by at most a factor (1 + margin) per step (margin = ``fira_margin``, 0.01 ⇔ Fira's
γ = 1.01).  ``prev`` is a one-element float32 array (device-resident on CuPy; initialised to −1, which takes the
reset branch, exactly like the original's "no previous norm" case), and everything is computed with array
operations: no host synchronisation.  Reference Fira writes the factor as (1 + margin)/max(ratio, 1 + margin); the
original's float32 order is kept here.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


def init(xp):
    """A fresh limiter state (takes the reset branch on its first call)."""
    return xp.full(1, -1.0, np.float32)


def factor(xp, prev, norm, margin: float):
    """The limiter factor f (a float32 0-d array) for the update norm ``norm``; updates ``prev`` in place."""
    norm = xp.asarray(norm, dtype=np.float32).reshape(())
    norm = xp.where(xp.isfinite(norm), norm, _F32(0.0))
    p = prev.reshape(())
    reset = p < _F32(1e-6)
    ratio = norm / (p + _F32(1e-8))
    one_m = _F32(1.0 + margin)
    lim = xp.maximum(ratio, one_m) / one_m
    f = xp.where(reset, _F32(1.0), _F32(1.0) / lim).astype(np.float32)
    prev[...] = xp.where(reset, norm, norm * f)
    return f

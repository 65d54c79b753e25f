"""The ``d8``/``d4`` encoder's nearest-entry search on NumPy as a table look-up (private to ``flatopt.adafactor8bit.quant``).

``nearest(x, map)`` — the nearest map entry (ties to the upper one, the differences in float32), nudged to
keep the sign of x — is a non-decreasing step function of x: the ``searchsorted`` bucket rises with x, inside a
bucket ``fl(x − lo) < fl(hi − x)`` holds up to one point and fails after it (float32 rounding is monotone), and
the sign nudge only moves the codes next to 0 outwards.  So over the floats that share their upper 16 bits (a
contiguous run of values of one sign) it takes at most a few values.  ``table(map)`` evaluates the exact function
at both ends of each of the 65,536 runs; where it differs by one it finds the threshold T (the smallest value of
the run with the higher code) by bisection over the run's bit patterns.  Then, for every finite x::

    code(x) = base[bits(x) >> 16] + (x >= thr[bits(x) >> 16])

(thr = +inf where the run has one code).  Runs where the code changes more than once (none for the d8 and d4
maps; checked when the table is built) and the non-finite runs are flagged and take the exact search.
The look-up replaces a per-element search by one gather (re-measure: ``python -m benchmarks.threads_probe codec``).
tests/test_codec.py checks the table against the exact search on the map's entries, the midpoints between them ± a
few ulps, zeros, denormals and random values, and — opt-in, ``FLATOPT_EXHAUSTIVE=1``, minutes — on every float32 in
[−1, 1] (2,130,706,434 values per map).
"""

from __future__ import annotations

import functools

import numpy as np

_RUNS = 1 << 16


@functools.lru_cache(maxsize=4)
def table(mp_bytes: bytes):
    """(base uint8, thr float32, flagged bool) for the float32 map whose bytes are ``mp_bytes``."""

    mp = np.frombuffer(mp_bytes, np.float32)
    runs = np.arange(_RUNS, dtype=np.uint32)
    negative = runs >= 0x8000
    first = runs << np.uint32(16)  # the run's bit patterns: first … first + 0xFFFF

    def value(rank):  # the run's values in increasing order: rank 0 is its smallest value
        bits = np.where(negative, first + np.uint32(0xFFFF) - rank, first + rank).astype(np.uint32)
        return bits.view(np.float32)

    def code(x):
        with np.errstate(invalid="ignore"):
            return nearest(np, x, mp).astype(np.int64)

    lo = np.zeros(_RUNS, np.uint32)
    hi = np.full(_RUNS, 0xFFFF, np.uint32)
    a, b = code(value(lo)), code(value(hi))
    finite = (runs & np.uint32(0x7F80)) != np.uint32(0x7F80)  # exponent not all ones
    step = finite & (b == a + 1)
    flagged = ~finite | (b > a + 1)
    # bisection: the smallest rank whose code is b (only the runs with one step matter)
    for _ in range(16):
        mid = (lo + hi) // np.uint32(2)
        up = code(value(mid)) == b
        hi = np.where(step & up, mid, hi)
        lo = np.where(step & ~up, mid + np.uint32(1), lo)
    thr = np.where(step, value(hi), np.float32(np.inf)).astype(np.float32)
    base = np.where(flagged, 0, a).astype(np.uint8)
    return base, thr, flagged


def nearest_into(x, mp, out, scratch) -> None:
    """out[...] = nearest(x, mp) for the float32 ``x`` (NumPy), by the table; ``scratch(key, n, dtype)``
    hands out per-thread buffers."""
    base, thr, flagged = table(mp.tobytes())
    n = x.size
    key = scratch("lut_key", n, np.intp)
    np.right_shift(x.view(np.uint32), np.uint32(16), out=key, casting="unsafe")
    np.take(base, key, out=out, mode="clip")  # (indices < 2¹⁶; mode="raise" would buffer ``out``)
    t = scratch("lut_thr", n, np.float32)
    np.take(thr, key, out=t, mode="clip")
    ge = scratch("lut_ge", n, np.bool_)
    np.greater_equal(x, t, out=ge)
    np.add(out, ge, out=out, casting="unsafe")
    bad = scratch("lut_bad", n, np.bool_)
    np.take(flagged, key, out=bad, mode="clip")
    if bad.any():  # non-finite x (or a run with several codes): the exact search there

        idx = np.flatnonzero(bad)
        with np.errstate(invalid="ignore"):
            out[idx] = nearest(np, x[idx], mp)


def nearest(xp, x, mp):
    """The exact search the table reproduces (any array module): index of the nearest map entry (ties to the upper one), then nudged to keep the sign of x."""
    last = mp.size - 1
    i = xp.clip(xp.searchsorted(mp, x), 0, last)
    prev = xp.maximum(i - 1, 0)
    i = xp.where(xp.abs(x - mp[prev]) < xp.abs(x - mp[i]), prev, i)
    sx = xp.sign(x)
    flip = (sx != xp.sign(mp[i])) & (sx != 0)
    i = xp.where(flip & (sx > 0) & (i < last), i + 1, i)
    return xp.where(flip & (sx < 0) & (i > 0), i - 1, i)

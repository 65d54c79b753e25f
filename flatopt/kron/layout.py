"""KronPsgd bookkeeping that runs on the host: factor layout, update schedule, balance draws, probe generator.

Everything here is a pure function of the configuration, the parameter's shape and name, and the per-name
counters kept in ``KronPsgdState`` (step ``t``, schedule ``counter``, preconditioner ``updates``), so it is
deterministic under the threaded ``step_batch`` and resumes exactly from a ``state_dict``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import random
import threading

import numpy as np

from . import numerics


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one parameter is seen by the preconditioner."""

    merged: tuple[int, ...]  # the shape the math works on (>= 1-D)
    diag: tuple[bool, ...]  # per merged dim: diagonal (vector) factor instead of a dense triangular one
    offsets: tuple[int, ...]  # start of each factor in the packed ``q`` buffer
    qsize: int  # total floats of the packed factors
    init_scale: float  # each factor starts as init_scale * I (or * ones)
    numel: int
    decays: bool  # weight decay applies (the original shape has ndim >= 2)


def merge_shape(shape: tuple[int, ...], enabled: bool, rule: str) -> tuple[int, ...]:
    """The 2-D view a > 2-D tensor is preconditioned as (0-d parameters become 1-element vectors).

    ``rule="square"``: among every split ``(prod(shape[:s]), prod(shape[s:]))`` the one with the smallest
    larger side (the most square; ties go to the later split).  ``rule="kron_torch"``: kron_torch 0.3.3's choice
    between the two splits ``[prod(shape[:-1]), shape[-1]]`` and ``[shape[0], prod(shape[1:])]`` by the *signed*
    difference of their sides (e.g. (64, 3, 3, 3) -> 576 x 3 although 64 x 27 is more square)."""
    if len(shape) == 0:
        return (1,)
    if len(shape) <= 2 or not enabled:
        return tuple(shape)
    if rule == "kron_torch":
        s1 = (math.prod(shape[:-1]), shape[-1])
        s2 = (shape[0], math.prod(shape[1:]))
        return s1 if (s1[1] - s1[0]) <= (s2[1] - s2[0]) else s2
    best = None
    for s in range(len(shape) - 1, 0, -1):
        cand = (math.prod(shape[:s]), math.prod(shape[s:]))
        if best is None or max(cand) < max(best):
            best = cand
    return best


def make_layout(cfg, shape: tuple[int, ...]) -> Layout:
    merged = merge_shape(shape, cfg.merge_dims, cfg.merge_rule)
    k = len(merged)
    diag = [False] * k
    mode = cfg.memory_save_mode
    if k > 1 and mode in ("one_diag", "smart_one_diag"):
        largest = max(range(k), key=lambda i: (merged[i], i))  # ties: the later dim (kron_torch's argsort)
        srt = sorted(merged)
        if mode == "one_diag" or srt[-1] > srt[-2]:
            diag[largest] = True
    elif mode == "all_diag":
        diag = [True] * k
    diag = tuple(
        diag[i] or d == 1 or d > cfg.max_size_triangular or k < cfg.min_ndim_triangular for i, d in enumerate(merged)
    )
    offsets, off = [], 0
    for d, is_diag in zip(merged, diag):
        offsets.append(off)
        off += d if is_diag else d * d
    return Layout(
        merged=tuple(merged),
        diag=diag,
        offsets=tuple(offsets),
        qsize=off,
        init_scale=float(cfg.precond_init_scale) ** (1.0 / k),
        numel=math.prod(merged),
        decays=len(shape) >= 2,
    )


def init_factors(xp, lay: Layout, dtype):
    """The packed factor buffer: init_scale * I per dense factor, init_scale * ones per diagonal one."""
    q = xp.zeros(lay.qsize, dtype)
    for d, is_diag, off in zip(lay.merged, lay.diag, lay.offsets):
        if is_diag:
            q[off:off + d] = lay.init_scale
        else:
            q[off:off + d * d].reshape(d, d)[...] = xp.eye(d, dtype=dtype) * lay.init_scale
    return q


# --------------------------------------------------------------------------------------------- the schedule
def decide_update(cfg, counter: int, t: int) -> tuple[bool, int]:
    """(do_update, new counter) for step ``t`` (1-based) of one parameter, kron_torch 0.3.3's deterministic rule:
    counter += 1; update iff counter >= 1/p(t - 1); reset the counter on an update.  The schedule
    p(n) = clamp(max_p * exp(-decay * (n - flat_start)), min_p, max_p) is evaluated in float32 as kron_torch does;
    a constant ``update_probability`` p is compared in float64 (Python float), also as kron_torch does."""
    counter += 1
    if cfg.update_probability is not None:
        do = counter >= 1.0 / float(cfg.update_probability)
    else:
        f = np.float32
        max_p, min_p, decay, flat = (f(x) for x in cfg.prob_schedule)
        with np.errstate(over="ignore"):
            p = max_p * np.exp(-decay * (f(t - 1) - flat))
        p = min(max(p, min_p), max_p)
        do = bool(f(counter) >= f(1.0) / p)
    return do, (0 if do else counter)


_BALANCE_P = 0.01  # kron_torch balances "about every 100 updates"
# Memory must not grow with the step count: each seed keeps a few cursors into its stream (the generator, the draws
# made, the hits among the last _WINDOW draws), not a record of every hit.  Parameters that step together share one
# cursor; one that lags further behind (added late, or ``reset``) gets a cursor of its own, advanced with it.
_WINDOW = 1 << 12
_CURSORS = 4  # per seed, least recently used dropped first (a dropped one is regenerated from the seed if needed)
_draws: dict[int, list] = {}  # seed -> cursors [Random, draws made, deque of the 1-based steps whose draw < 0.01]
_draws_lock = threading.Lock()


def balance_hit(seed: int, t: int) -> bool:
    """Whether the t-th output of ``random.Random(seed)`` is below 0.01 (kron_torch draws one per ``step()``).

    A pure function of (seed, t), extended lazily under a lock and shared by every parameter and optimizer: safe
    under threads, nothing to save (the position in the stream is the name's step count), and held in memory that
    does not grow with ``t``."""
    with _draws_lock:
        cursors = _draws.setdefault(seed, [])
        ahead = None
        for k, cur in enumerate(cursors):
            if cur[1] - _WINDOW < t <= cur[1]:
                cursors.append(cursors.pop(k))
                return t in cur[2]
            if cur[1] < t and (ahead is None or cur[1] > ahead[1]):
                ahead = cur
        if ahead is None:
            ahead = [random.Random(seed), 0, collections.deque()]
            if len(cursors) >= _CURSORS:
                cursors.pop(0)
        else:
            cursors.remove(ahead)
        cursors.append(ahead)
        rng, made, hits = ahead
        while made < t:
            made += 1
            if rng.random() < _BALANCE_P:
                hits.append(made)
        while hits and hits[0] <= made - _WINDOW:
            hits.popleft()
        ahead[1] = made
        return t in hits


# ----------------------------------------------------------------------------------------- the probe V
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def stream_key(seed: int, name: str) -> bytes:
    """A stable (unsalted) key of the per-name probe stream."""
    return hashlib.blake2b(f"{int(seed)}\x00{name}".encode(), digest_size=16).digest()


def probe_base(key: bytes, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(index.to_bytes(8, "little"), key=key, digest_size=8).digest(), "little")


def _buf(xp, key, n, dtype, scratch):
    if not scratch:
        return xp.empty(n, dtype)
    return numerics.scratch(xp, key, (n,), dtype)


def gaussian_probe(xp, key: bytes, index: int, shape: tuple[int, ...], dtype, *, scratch: bool = False):
    """Update ``index`` of the stream ``key``: N(0, 1) samples of ``shape``, drawn on the array's own device.

    Counter-based: pair j takes the splitmix64 output of (base + (j + 1)·golden), base = blake2b(key, index);
    its top 24 bits give u1 in (0, 1], bits 8..31 give u2 in [0, 1); Box–Muller gives r·cos(2πu2) (first half of
    the samples) and r·sin(2πu2) (second half).  Identical integer work on NumPy and CuPy, no state but ``index``,
    no host synchronisation.  ``scratch=True``: every array, the result included, is per-thread scratch
    (``kron.numerics.scratch``, valid until the next probe on this thread) instead of a fresh allocation."""
    n = math.prod(shape)
    m = (n + 1) // 2
    dt = np.dtype(dtype).type
    u64 = np.dtype(np.uint64)
    z = _buf(xp, "pz", m, u64, scratch)
    w = _buf(xp, "pw", m, u64, scratch)
    if m:  # z = 1, 2, ..., m (doubling: exact integer adds, no arange temporary)
        z[0] = 1
        k = 1
        while k < m:
            c = min(k, m - k)
            xp.add(z[:c], np.uint64(k), out=z[k:k + c])
            k += c
    z *= _GOLDEN
    z += np.uint64(probe_base(key, index))
    xp.right_shift(z, np.uint64(30), out=w)
    z ^= w
    z *= _C1
    xp.right_shift(z, np.uint64(27), out=w)
    z ^= w
    z *= _C2
    xp.right_shift(z, np.uint64(31), out=w)
    z ^= w
    r = _buf(xp, "pr", m, dtype, scratch)
    theta = _buf(xp, "pt", m, dtype, scratch)
    xp.right_shift(z, np.uint64(40), out=w)
    r[...] = w
    xp.right_shift(z, np.uint64(8), out=w)
    xp.bitwise_and(w, np.uint64(0xFFFFFF), out=w)
    theta[...] = w
    del z, w
    r += dt(1.0)
    r *= dt(2.0**-24)
    xp.log(r, out=r)
    r *= dt(-2.0)
    xp.sqrt(r, out=r)
    theta *= dt(2.0 * math.pi * 2.0**-24)
    out = _buf(xp, "pv", 2 * m, dtype, scratch)
    xp.cos(theta, out=out[:m])
    xp.sin(theta, out=out[m:])
    out[:m] *= r
    out[m:] *= r
    return out[:n].reshape(shape)


def probe_for(xp, ctx: tuple, index: int, shape: tuple[int, ...], dtype):
    """Probe ``index`` of a parameter whose context is ``(name, stream key, hook)``: the injected ``hook(name,
    shape, index)`` when there is one (copied onto the parameter's backend), else ``gaussian_probe`` in per-thread
    scratch (valid until the next probe drawn on this thread)."""
    name, key, hook = ctx
    if hook is None:
        return gaussian_probe(xp, key, index, shape, dtype, scratch=True)
    v = xp.asarray(hook(name, shape, index), dtype=dtype)
    if v.shape != tuple(shape):
        raise ValueError(f"probe for {name!r} must have shape {tuple(shape)}, got {v.shape}")
    return v.copy()

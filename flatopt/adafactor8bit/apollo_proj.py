"""APOLLO's projector (as in adafactor8bit 0.4.6), used by ``flatopt.adafactor8bit.apollo``: the seeds, their
refresh, and the matrix P drawn from a seed.

``ApolloProjector(proj_fn, next_seed)`` is the documented hook for exact comparisons (a testing aid):
``proj_fn(seed, shape) -> array`` returns the *unscaled* N(0, 1) matrix and ``next_seed(seed) -> int`` advances a
seed; ``proj_fn`` may be called from a flatopt worker thread (one call at a time per parameter).

Defaults — on NumPy: the Box–Muller transform of float32 uniforms; P's flat (row-major) elements are cut into
blocks of ``PROJ_BLOCK``, block b drawn from PCG64 seeded with (seed, b) (``_draw_block``), so the blocks are drawn
on all threads and P does not depend on the thread count.  On CuPy: CuPy's generator.  Neither is bit-compatible
with the original's torch generators (nor with each other); tests inject torch-generated P and the original's
``next_seed``.  Why not ``default_rng(seed).standard_normal`` (the first default, replaced before any release):
its float32 ziggurat is sequential and took 3.4–4.9 ms for a 256×1024 P on this project's machine (torch's
``randn``: 1.8 ms), on the step's critical path; the blocked Box–Muller draw takes 1.2–1.5 ms on one thread and
is shared by all of them (``python -m benchmarks.threads_probe apollo``).  A snapshot saved with the first default
continues with the new P for its seed, as after a refresh (moments are not reset on a refresh either).

P is regenerated every step (into per-thread scratch) unless ``apollo_cache_proj`` (then it is kept in memory,
never in the checkpoint, and rebuilt from the seed after a load).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..core import workspace

F32 = np.float32


# Elements of P per independently seeded block of the default NumPy draw (a shape-only cut: the blocks are drawn on
# any threads in any order and give the same P).
PROJ_BLOCK = 1 << 16


def _draw_block(seed: int, b: int, out, scale: float) -> None:
    """Block ``b`` of the default NumPy projection, scaled by ``scale`` (1/√r), into the flat float32 ``out``: the
    Box–Muller transform of float32 uniforms u (multiples of 2⁻²⁴ in [0, 1)) from PCG64 seeded with (seed, b):
    with h = ⌈n/2⌉ pairs (u_i, u_{h+i}), ρ_i = √(−2·ln(1 − u_i))·scale, out_i = ρ_i·cos(2π·u_{h+i}) and
    out_{h+i} = ρ_i·sin(2π·u_{h+i}) (float32 throughout; |z| ≤ √(2·ln 2²⁴) ≈ 5.77)."""
    n = out.size
    h = (n + 1) // 2
    u = workspace.get(np, "a8.apollo_u", 2 * h, np.float32)
    np.random.default_rng((seed, b)).random(2 * h, dtype=np.float32, out=u)
    rho, ang = u[:h], u[h:]
    np.subtract(F32(1.0), rho, out=rho)  # (0, 1]: no log(0)
    np.log(rho, out=rho)
    np.multiply(rho, F32(-2.0 * scale * scale), out=rho)
    np.sqrt(rho, out=rho)
    np.multiply(ang, F32(2.0 * math.pi), out=ang)
    lo, hi = out[:h], out[h:]
    np.cos(ang, out=lo)
    np.multiply(lo, rho, out=lo)
    np.sin(ang[:n - h], out=hi)
    np.multiply(hi, rho[:n - h], out=hi)


def _default_next_seed(seed: int) -> int:
    return int(np.random.default_rng(seed).integers(0, 2**63 - 1))


class ApolloProjector:
    """Seeded APOLLO projection matrices with an injectable source (see the module docstring)."""

    def __init__(self, proj_fn=None, next_seed=None):
        self.proj_fn = proj_fn
        self.next_seed = next_seed or _default_next_seed

    def refresh(self, st, t: int, gap: int) -> bool:
        if t - st.last_proj_step >= gap:
            st.current_proj_seed = int(st.apollo_seed)
            st.apollo_seed = int(self.next_seed(st.current_proj_seed))
            st.last_proj_step = t
            st.proj = None
            return True
        return False

    def prepare(self, xp, st, rank: int, r_: int, c_: int, right: bool, cache: bool):
        """``(pt, jobs)``: Pᵀ (C×r for "right", r×R for "left"; float32, a transposed view of P/√r) and the
        callables that fill it — independent of each other, to run on any threads before ``pt`` is read (none
        when the cached P is current).  Call ``keep`` after they ran."""
        if st.proj is not None and st.proj[0] == st.current_proj_seed:
            return st.proj[1], []
        shape = (rank, c_) if right else (r_, rank)
        n = shape[0] * shape[1]
        if cache:  # kept in the state: its own memory
            buf = xp.empty(n, np.float32)
        else:  # the caller's scratch, drawn every step
            buf = workspace.get(xp, "a8.apollo_p", n, np.float32)
        seed, scale = st.current_proj_seed, 1.0 / math.sqrt(rank)
        if self.proj_fn is None and xp is np:
            jobs = [functools.partial(_draw_block, seed, b, buf[lo:lo + PROJ_BLOCK], scale)
                    for b, lo in enumerate(range(0, n, PROJ_BLOCK))]
        else:
            def draw():
                if self.proj_fn is not None:
                    raw = self.proj_fn(seed, shape)
                else:
                    raw = xp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)
                if tuple(raw.shape) != shape:  # (assigning would broadcast a wrong shape silently)
                    raise ValueError(f"apollo_proj_fn returned an array of shape {tuple(raw.shape)}, expected {shape}")
                m = buf.reshape(shape)
                m[...] = xp.asarray(raw, dtype=np.float32)  # a copy: never write into a caller's array
                xp.divide(m, F32(math.sqrt(rank)), out=m)

            jobs = [draw]
        return buf.reshape(shape).T, jobs

    @staticmethod
    def keep(st, pt, cache: bool) -> None:
        if cache:
            st.proj = (st.current_proj_seed, pt)

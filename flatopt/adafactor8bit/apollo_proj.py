"""APOLLO's projector (as in adafactor8bit 0.4.6), used by ``flatopt.adafactor8bit.apollo``: the seeds, their
refresh, and the matrix P drawn from a seed.

``ApolloProjector(proj_fn, next_seed)`` is the documented hook for exact comparisons (a testing aid):
``proj_fn(seed, shape) -> array`` returns the *unscaled* N(0, 1) matrix and ``next_seed(seed) -> int`` advances a
seed; ``proj_fn`` may be called from a flatopt worker thread (one call at a time per parameter).

Default draw (``draw``): P is a function of (seed, shape) alone, computed with the same bits on NumPy and CuPy, so a
checkpoint moved between backends continues with the same P (the seed changes with the step at each refresh).  Its
flat (row-major) element i is the 32-bit word i of a counter-based generator: word 2k + j (j = 0 low, 1 high half)
of SplitMix64's k-th output for the seed, mix64(mix64(seed) + (k + 1)·φ) (φ = 0x9E3779B97F4A7C15; integer ops
only, which every backend computes alike).  The word w becomes a normal deviate through a table of the inverse normal
CDF (``_tables``): with k = w >> 16 and f = w & 0xFFFF, z = T_k + f·D_k, T_k = Φ⁻¹((k + ½)/2¹⁶)·s and D_k =
(T_{k+1} − T_k)·2⁻¹⁶·s in float32 (s = 1/√r, D_last = 0): one gather, one multiply and one add, each correctly
rounded on both backends (no transcendental function, whose last bits differ between NumPy and CUDA).  So P is
N(0, 1)/√r up to the linear interpolation of Φ⁻¹ between 2¹⁶ quantiles, truncated at |z| ≤ Φ⁻¹(1 − 2⁻¹⁷) ≈ 4.32
(mass 1.5e-5 beyond).  The table (512 KiB per rank) is built once on the host and uploaded once per device
(``core.backend.device_constant``).  On NumPy the elements are cut into blocks of ``PROJ_BLOCK`` drawn on any threads
(any cut gives the same bits).  It costs about as much as the blocked Box–Muller draw it replaces (PCG64 float32
uniforms; CuPy drew from its own ``RandomState``, a new cuRAND generator every step, so the backends differed) and
less than ``default_rng(seed).standard_normal``; re-measure: ``python -m benchmarks.threads_probe apollo``.
Neither default is bit-compatible with the original's torch generators; tests inject torch-generated P and the original's ``next_seed``.  A snapshot saved with an earlier default
continues with the new P for its seed, as after a refresh (moments are not reset on a refresh either).

P is regenerated every step (into per-thread scratch) unless ``apollo_cache_proj`` (then it is kept in memory,
never in the checkpoint, and rebuilt from the seed after a load).  On a device the fused APOLLO step draws it in one
kernel launch (``draw_kernel``: the same bits, no generator object, no host synchronisation); the twin with CuPy
operations.
"""

from __future__ import annotations

import functools
import math
import threading
from statistics import NormalDist

import numpy as np

from ..core import backend, kernels, workspace

F32 = np.float32


# Elements of P per block of the default NumPy draw (a shape-only cut: the blocks are drawn on any threads in any
# order and give the same P as one draw of the whole).
PROJ_BLOCK = 1 << 16

_MASK = (1 << 64) - 1
_PHI = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = {k: np.uint64(k) for k in (_PHI, _M1, _M2, 27, 30, 31)}
_BITS = 16  # 2¹⁶ quantiles in the table
_COUNTERS = np.arange(PROJ_BLOCK // 2 + 1, dtype=np.uint64)  # 0, 1, ... (read-only, shared by the NumPy blocks)
_COUNTERS.setflags(write=False)
_tables_host: dict = {}
_tables_lock = threading.Lock()


def _mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2⁶⁴)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _host_table(scale: float) -> np.ndarray:
    """The interleaved float32 pairs (T_k, D_k) of the module documentation, as uint64 (one gather per element)."""
    with _tables_lock:
        tab = _tables_host.get(scale)
        if tab is None:
            q = _tables_host.get("quantiles")
            if q is None:  # Φ⁻¹ at the 2¹⁶ midpoints, odd-symmetric by construction (half of them computed)
                nd, half = NormalDist(), 1 << (_BITS - 1)
                hi = np.array([nd.inv_cdf((half + k + 0.5) / (1 << _BITS)) for k in range(half)], np.float64)
                q = _tables_host["quantiles"] = np.concatenate([-hi[::-1], hi])
            pairs = np.empty((q.size, 2), np.float32)
            pairs[:, 0] = q * scale
            pairs[:-1, 1] = (q[1:] - q[:-1]) * (scale * 2.0**-_BITS)
            pairs[-1, 1] = 0.0
            tab = _tables_host[scale] = pairs.view(np.uint64).reshape(-1)
    return tab


def draw(xp, seed: int, lo: int, out, scale: float) -> None:
    """Elements lo, lo + 1, ... (``out.size`` of them) of the flat default projection of ``seed``, scaled by
    ``scale`` (1/√r), into the float32 ``out`` (see the module documentation; the same bits on every backend and for
    every cut)."""
    n = out.size
    if n == 0:
        return
    k0 = lo // 2
    h = (lo + n + 1) // 2 - k0  # 64-bit outputs covering the words lo .. lo + n - 1
    z = workspace.get(xp, "a8.apollo_z", h, np.uint64)
    t = workspace.get(xp, "a8.apollo_t", h, np.uint64)
    src = _COUNTERS[:h] if xp is np and h <= _COUNTERS.size else xp.arange(h, dtype=np.uint64)
    xp.multiply(src, _U64[_PHI], out=z)
    xp.add(z, np.uint64((_mix64(int(seed) & _MASK) + (k0 + 1) * _PHI) & _MASK), out=z)
    xp.right_shift(z, _U64[30], out=t)
    xp.bitwise_xor(z, t, out=z)
    xp.multiply(z, _U64[_M1], out=z)
    xp.right_shift(z, _U64[27], out=t)
    xp.bitwise_xor(z, t, out=z)
    xp.multiply(z, _U64[_M2], out=z)
    xp.right_shift(z, _U64[31], out=t)
    xp.bitwise_xor(z, t, out=z)
    w = z.view(np.uint32)[lo - 2 * k0:lo - 2 * k0 + n]  # little-endian: word 2k is the low half (NumPy and CUDA)
    k = workspace.get(xp, "a8.apollo_k", n, np.int64)
    f = workspace.get(xp, "a8.apollo_f", n, np.float32)
    xp.right_shift(w, np.uint32(_BITS), out=k, casting="unsafe")
    xp.bitwise_and(w, np.uint32((1 << _BITS) - 1), out=f, casting="unsafe")
    g = workspace.get(xp, "a8.apollo_g", n, np.uint64)
    tab = _host_table(scale) if xp is np else backend.device_constant(
        xp, ("flatopt.apollo_normal", scale), lambda: _host_table(scale))
    xp.take(tab, k, out=g)
    td = g.view(np.float32).reshape(n, 2)
    xp.multiply(f, td[:, 1], out=f)
    xp.add(td[:, 0], f, out=out)


_shaped = threading.local()


def shaped_ws(xp, key: str, shape: tuple[int, int]):
    """(flat, 2-D view) of ``shape`` of the calling thread's float32 workspace ``key`` (``core.workspace``), the view
    made once per buffer and shape (a device's reshape is a call per step otherwise); the views of a buffer the
    workspace has replaced are dropped."""
    flat = workspace.get(xp, key, shape[0] * shape[1], np.float32)
    cache = getattr(_shaped, "views", None)
    if cache is None:
        cache = _shaped.views = {}
    ptr = flat.data.ptr if xp is not np else flat.__array_interface__["data"][0]
    k = (key, id(xp), 0 if xp is np else xp.cuda.Device().id)
    hit = cache.get(k)
    if hit is None or hit[0] != ptr:
        hit = cache[k] = (ptr, {})
    view = hit[1].get(shape)
    if view is None:
        view = hit[1][shape] = flat.reshape(shape)
    return flat, view


def draw_kernel(xp, seed: int, out, scale: float) -> None:
    """The whole default projection of ``seed`` into the float32 device array ``out`` in one launch of
    ``kernels/apollo8bit.cu`` ``ap_draw`` (the bits of ``draw``: the same integer operations, gather, multiply and
    add; no generator object, no host synchronisation)."""
    n = out.size
    if n == 0:
        return
    tab = backend.device_constant(xp, ("flatopt.apollo_normal", scale), lambda: _host_table(scale))
    base = np.uint64((_mix64(int(seed) & _MASK) + _PHI) & _MASK)
    k = kernels.get("apollo8bit.cu", "ap_draw", np.float32)
    backend.launch(k, n, (out, tab, np.int64(n), base))


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

    def prepare(self, xp, st, rank: int, r_: int, c_: int, right: bool, cache: bool, *, fused: bool = False):
        """``(pt, jobs)``: Pᵀ (C×r for "right", r×R for "left"; float32, a transposed view of P/√r) and the
        callables that fill it — independent of each other, to run on any threads before ``pt`` is read (none
        when the cached P is current).  Call ``keep`` after they ran.  ``fused`` (a device): the default draw is
        one kernel launch (``draw_kernel``, the same bits)."""
        if st.proj is not None and st.proj[0] == st.current_proj_seed:
            return st.proj[1], []
        shape = (rank, c_) if right else (r_, rank)
        n = shape[0] * shape[1]
        mat = None
        if cache:  # kept in the state: its own memory
            buf = xp.empty(n, np.float32)
        elif fused:  # the caller's scratch, drawn every step (its 2-D view made once)
            buf, mat = shaped_ws(xp, "a8.apollo_p", shape)
        else:
            buf = workspace.get(xp, "a8.apollo_p", n, np.float32)
        seed, scale = st.current_proj_seed, 1.0 / math.sqrt(rank)
        if self.proj_fn is None and fused:
            jobs = [functools.partial(draw_kernel, xp, seed, buf, scale)]
        elif self.proj_fn is None:  # the default draw: NumPy in blocks (on any threads), a device in one
            step = PROJ_BLOCK if xp is np else max(n, 1)
            jobs = [functools.partial(draw, xp, seed, lo, buf[lo:lo + step], scale) for lo in range(0, n, step)]
        else:
            def draw_injected():
                raw = self.proj_fn(seed, shape)
                if tuple(raw.shape) != shape:  # (assigning would broadcast a wrong shape silently)
                    raise ValueError(f"apollo_proj_fn returned an array of shape {tuple(raw.shape)}, expected {shape}")
                m = buf.reshape(shape)
                m[...] = xp.asarray(raw, dtype=np.float32)  # a copy: never write into a caller's array
                xp.divide(m, F32(math.sqrt(rank)), out=m)

            jobs = [draw_injected]
        return (buf.reshape(shape) if mat is None else mat).T, jobs

    @staticmethod
    def keep(st, pt, cache: bool) -> None:
        if cache:
            st.proj = (st.current_proj_seed, pt)

"""What an optimizer class binds from a definition: ``update`` (the compiled C pass on NumPy when the library is
built, else the NumPy/CuPy path), ``kernel_update`` (the per-tensor CUDA kernel) and ``multi`` (the multi-tensor
launch), every one driven by the same instruction list of the flag set in use."""

from __future__ import annotations

import functools
import math
import struct
import threading
from typing import Any

import numpy as np

from .. import kernels, native
from ..multi_tensor import MultiTensor
from . import emit, lower_numpy, trace as tr
from .define import Definition

GENERATED_DIR = "generated"


def cuda_file(d: Definition) -> str:
    return f"{GENERATED_DIR}/{d.name}.cu"


def _scalars(d: Definition, cfg: Any, t: int, lr: float) -> dict:
    return _scalars_keyed(d, cfg, t, lr, math.copysign(1.0, lr))


@functools.lru_cache(maxsize=256)
def _scalars_keyed(d: Definition, cfg: Any, t: int, lr: float, sign: float) -> dict:
    """Cached on the value and the sign of lr (``-0.0 == 0.0``, but ``-lr`` differs in its bits)."""
    return {k: float(v) for k, v in d.scalars_fn(cfg, t, lr).items()}


def _packed(d: Definition, cfg: Any, t: int, lr: float) -> bytes:
    return _packed_keyed(d, cfg, t, lr, math.copysign(1.0, lr))


@functools.lru_cache(maxsize=256)
def _packed_keyed(d: Definition, cfg: Any, t: int, lr: float, sign: float) -> bytes:
    sc = _scalars(d, cfg, t, lr)
    return struct.pack(f"{len(d.scalar_names)}d", *(sc[k] for k in d.scalar_names))


@functools.lru_cache(maxsize=256)
def _cast(d: Definition, cfg: Any, t: int, lr: float, dtype: Any, sign: float) -> dict:
    dt = np.dtype(dtype).type
    return {k: dt(v) for k, v in _scalars(d, cfg, t, lr).items()}


@functools.lru_cache(maxsize=None)
def plan(d: Definition, fs: int) -> lower_numpy.Plan:
    return lower_numpy.allocate(d.program_at(fs))


@functools.lru_cache(maxsize=None)
def _runner(d: Definition, fs: int, xp: Any) -> lower_numpy.Runner:
    return lower_numpy.Runner(plan(d, fs), xp, d.arrays)


@functools.lru_cache(maxsize=256)
def _prepared(d: Definition, cfg: Any, t: int, lr: float, dtype: Any, xp: Any, sign: float) -> tuple:
    """(the straight-line function of this step's flag set, its scalars of the dtype, its boolean scratch count)."""
    r = _runner(d, d.flags_of(cfg, t), xp)
    return r.run, _cast(d, cfg, t, lr, dtype, sign), r.plan.bools


def scratch_needed(d: Definition) -> int:
    """The float scratch buffers the NumPy path needs (the largest over the flag sets)."""
    return max(plan(d, d.index(f)).scratch for f in d.flag_sets())


_tls = threading.local()


def _bools(xp: Any, k: int, n: int) -> list:
    """``k`` boolean scratch buffers of ``n`` elements, kept per thread (allocated once per size)."""
    if k == 0:
        return []
    cache = getattr(_tls, "bools", None)
    if cache is None:
        cache = _tls.bools = {}
    bufs = cache.get((xp, n))
    if bufs is None or len(bufs) < k:
        bufs = cache[(xp, n)] = [xp.empty(n, bool) for _ in range(k)]
    return bufs


def numpy_update(d: Definition, xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float,
                 scratch: list) -> None:
    """The NumPy/CuPy path alone (the reference), in pieces of the scratch's length (every pass of a piece then
    finds its operands in the cache: the driver's scratch is chunk-sized)."""
    fn, sc, nb = _prepared(d, cfg, t, lr, p.dtype, xp, math.copysign(1.0, lr))
    arrays, n, dt = (p, g, *d.state_arrays(st, p)), p.size, p.dtype.type
    if not scratch or n <= scratch[0].size:
        fn(arrays, sc, scratch, _bools(xp, nb, n) if nb else (), dt)
        return
    k = scratch[0].size
    for lo in range(0, n, k):
        m = min(k, n - lo)
        fn(tuple(a[lo:lo + m] for a in arrays), sc, scratch if m == k else [b[:m] for b in scratch],
           _bools(xp, nb, m) if nb else (), dt)


def native_update(d: Definition, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float) -> bool:
    """The compiled C pass; False (nothing touched) when it cannot run."""
    return native.gen_step(d.name, d.flags_of(cfg, t), (p, g, *d.state_arrays(st, p)), _packed(d, cfg, t, lr))


def bind(d: Definition):
    """``(update, kernel_update, multi_tensor, scratch_buffers)`` for the optimizer class."""

    def update(xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float, scratch: list) -> None:
        if xp is np and native_update(d, cfg, st, p, g, t=t, lr=lr):
            return
        numpy_update(d, xp, cfg, st, p, g, t=t, lr=lr, scratch=scratch)

    update.takes_ranges = True  # type: ignore[attr-defined]  # (core.hooks.Hooks.ranges: numpy_update cuts)

    def kernel_update(cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float) -> bool:
        fs = d.flags_of(cfg, t)
        prog = d.program_at(fs)
        n = p.size
        if n == 0:
            return True
        k = kernels.get(cuda_file(d), emit.cuda_name(d, fs, "step"), p.dtype)
        arrays = dict(zip(d.arrays, (p, g, *d.state_arrays(st, p))))
        used = [arrays[a] for a in _used(d, fs)]
        sc = _scalars(d, cfg, t, lr)
        grid = min(math.ceil(n / (emit.THREADS * emit.ELEMS)), 65535 * 8)
        k((grid,), (emit.THREADS,), (*used, np.int64(n), *(sc[s] for s in prog.scalars)))
        return True

    def multi_args(cfg: Any, t: int, dt: Any) -> tuple:
        fs = d.flags_of(cfg, t)
        doubles, plain, numbers = _multi(d, cfg, t, fs)
        return (*(numbers[w] for w in doubles), *(numbers[k] for k in plain))

    def pick(cfg: Any, t: int) -> str:
        return emit.cuda_name(d, d.flags_of(cfg, t), "multi")

    multi = MultiTensor(cuda_file(d), emit.cuda_name(d, 0, "multi"), d.state_arrays, multi_args, pick=pick)
    return update, kernel_update, multi, scratch_needed(d)


@functools.lru_cache(maxsize=None)
def _used(d: Definition, fs: int) -> tuple:
    prog = d.program_at(fs)
    written = {n for n, _ in prog.outputs}
    return tuple(a for a in d.arrays if a in written or a in prog.reads)


@functools.lru_cache(maxsize=None)
def generated_shape(d: Definition) -> tuple:
    """The scalars' shape the CUDA source was generated from (the example config)."""
    return tr.trace_scalars(d.scalars_fn, d.example, 1)[0]


@functools.lru_cache(maxsize=256)
def _multi(d: Definition, cfg: Any, t: int, fs: int) -> tuple:
    shape, numbers = tr.trace_scalars(d.scalars_fn, cfg, t)
    if shape != generated_shape(d):
        raise RuntimeError(f"{d.name}.scalars derives its lr-dependent scalars with other operations for {cfg!r} "
                           f"than for the example config the kernels were generated from")
    doubles, plain = emit.multi_params(d, d.program_at(fs), shape)
    return doubles, plain, dict(numbers)

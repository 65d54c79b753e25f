"""What an optimizer class binds from a definition: ``update`` (the compiled C pass on NumPy when the library is
built, else the NumPy/CuPy path), ``kernel_update`` (the per-tensor CUDA kernels) and ``multi_tensor`` (the
multi-tensor launch), every one driven by the same instruction list of the flag set in use.  A definition with a sum
(``reduce.py``) binds the whole-tensor forms of ``bind_reduce``; a flag set without a sum runs the plain paths in
them.  ``lr``, wherever a derived path receives it, is ``(lr, *host values)`` for a definition with ``host``."""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import numpy as np

from .. import backend, blocks, cpu_plan, kernels, native
from .. import sqsum
from ..multi_tensor import MultiTensor
from . import emit, lower_numpy, reduce, trace as tr
from .define import Definition

GENERATED_DIR = "generated"


def cuda_file(d: Definition) -> str:
    return f"{GENERATED_DIR}/{d.name}.cu"


class Values:
    """One step's flag set ``fs`` and scalars: ``sc`` by name in double, ``packed`` (the C pass's struct) and
    ``cast(dtype)`` (NumPy scalars of the dtype, as NumPy rounds a Python float against an array)."""

    def __init__(self, d: Definition, cfg: Any, t: int, lr: float, hv: tuple):
        self.fs = d.flags_of(cfg, t, hv)
        self.sc = {k: float(v) for k, v in d.scalars_fn(cfg, t, lr, *hv).items()}
        self.packed = struct.pack(f"{len(d.scalar_names)}d", *(self.sc[k] for k in d.scalar_names))
        self._cast: dict = {}

    def cast(self, dtype: Any) -> dict:
        out = self._cast.get(dtype)
        if out is None:  # (two threads may both make it: the same values)
            dt = np.dtype(dtype).type
            out = self._cast[dtype] = {k: dt(v) for k, v in self.sc.items()}
        return out


def values(d: Definition, cfg: Any, t: int, lr: Any) -> Values:
    """The ``Values`` of a step (``lr``: as the derived paths receive it)."""
    lr, hv = (lr[0], tuple(lr[1:])) if d.host else (lr, ())
    return _values(d, cfg, t, lr, math.copysign(1.0, lr), hv)


@functools.lru_cache(maxsize=256)
def _values(d: Definition, cfg: Any, t: int, lr: float, sign: float, hv: tuple) -> Values:
    """Cached on the value and the sign of lr (``-0.0 == 0.0``, but ``-lr`` differs in its bits)."""
    return Values(d, cfg, t, lr, hv)


@functools.lru_cache(maxsize=None)
def plan(d: Definition, fs: int) -> lower_numpy.Plan:
    return lower_numpy.allocate(d.program_at(fs))


@functools.lru_cache(maxsize=None)
def _runner(d: Definition, fs: int, xp: Any) -> lower_numpy.Runner:
    return lower_numpy.Runner(plan(d, fs), xp, d.arrays)


@functools.lru_cache(maxsize=None)
def scratch_needed(d: Definition) -> int:
    """The float scratch buffers the NumPy path needs (the largest over the flag sets without a sum: the chunked
    elementwise path's; over all of them when every flag set sums)."""
    return max(plan(d, d.index(f)).scratch for f in d.plain_flag_sets() or d.flag_sets())


def numpy_update(d: Definition, xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any,
                 scratch: list) -> None:
    """The NumPy/CuPy path alone (the reference), in pieces of the scratch's length (every pass of a piece then
    finds its operands in the cache: the driver's scratch is chunk-sized)."""
    v = values(d, cfg, t, lr)
    r = _runner(d, v.fs, xp)
    sc, nb, dt = v.cast(p.dtype), r.plan.bools, p.dtype.type
    arrays, n = (p, g, *d.state_arrays(st, p)), p.size
    if not scratch or n <= scratch[0].size:
        r.run(arrays, sc, scratch, lower_numpy.bool_scratch(xp, nb, n) if nb else (), dt)
        return
    k = scratch[0].size
    for lo in range(0, n, k):
        m = min(k, n - lo)
        r.run(tuple(a[lo:lo + m] for a in arrays), sc, scratch if m == k else [b[:m] for b in scratch],
              lower_numpy.bool_scratch(xp, nb, m) if nb else (), dt)


def native_update(d: Definition, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any) -> bool:
    """The compiled C pass; False (nothing touched) when it cannot run."""
    v = values(d, cfg, t, lr)
    return native.gen_step(d.name, v.fs, (p, g, *d.state_arrays(st, p)), v.packed)


def kernel_update(d: Definition, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any) -> bool:
    """The per-tensor kernels: the step of a flag set without a sum; else per reduction level its partials and its
    fold, then the map (``st.work``: one level's partials and every fold's result, allocated once per name).  No host
    synchronisation."""
    n = p.size
    if n == 0:
        return True
    v = values(d, cfg, t, lr)
    arrays = dict(zip(d.arrays, (p, g, *d.state_arrays(st, p))))
    grid = min(math.ceil(n / (emit.THREADS * emit.ELEMS)), 65535 * 8)
    src, n64 = cuda_file(d), np.int64(n)
    launches = _kernels(d, v.fs)
    if len(launches) == 1:  # a flag set without a sum
        name, used, own = launches[0]
        kernels.get(src, name, p.dtype)((grid,), (emit.THREADS,), (*(arrays[a] for a in used), n64,
                                                                    *(v.sc[s] for s in own)))
        return True
    sp = d.split_at(v.fs)
    nb = sqsum.sq_blocks(n)
    buf = reduce.work(st, sp.width * nb + len(sp.folds), p.dtype, backend.cupy())
    parts, scal = buf[:sp.width * nb], buf[sp.width * nb:]
    nb64, threads = np.int64(nb), (sqsum.SQ_THREADS,)
    for level in range(len(sp.levels)):  # a level after the first reads the earlier folds from scal
        (pname, used, own), (fname, _, fown) = launches[2 * level:2 * level + 2]
        kernels.get(src, pname, p.dtype)((nb,), threads, (*(arrays[a] for a in used), n64,
                                                          *(v.sc[s] for s in own), parts, *((scal,) if level else ())))
        kernels.get(src, fname, p.dtype)((1,), threads, (parts, nb64, *(v.sc[s] for s in fown), scal))
    name, used, own = launches[-1]
    kernels.get(src, name, p.dtype)((grid,), (emit.THREADS,), (*(arrays[a] for a in used), n64,
                                                                *(v.sc[s] for s in own), scal))
    return True


@functools.lru_cache(maxsize=None)
def _kernels(d: Definition, fs: int) -> tuple:
    """The per-tensor kernels of flag set ``fs`` in launch order, each ``(name, the arrays it takes, its scalars
    from the host)``: the step alone without a sum; else per level its partials and its fold (the folds' values it
    reads come from ``scal``), then the map."""
    sp = d.split_at(fs)
    if sp is None:
        prog = d.program_at(fs)
        return ((emit.cuda_name(d, fs, "step"), tuple(emit.used(d, prog)), prog.scalars),)

    def kernel(kind: str, prog: tr.Program, takes_arrays: bool = True) -> tuple:
        return (emit.cuda_name(d, fs, kind), tuple(emit.used(d, prog)) if takes_arrays else (),
                tuple(s for s in prog.scalars if s not in sp.folds))

    levels = [(kernel(f"partials{level or ''}", lv.reduce), kernel(f"fold{level or ''}", lv.fold, False))
              for level, lv in enumerate(sp.levels)]
    return (*(k for pair in levels for k in pair), kernel("map", sp.map))


@functools.lru_cache(maxsize=None)
def generated_shape(d: Definition) -> tuple:
    """The scalars' shape the CUDA source was generated from (the example config)."""
    return tr.trace_scalars(d.scalars_fn, d.example, 1, d.example_host)[0]


@functools.lru_cache(maxsize=256)
def _launch(d: Definition, cfg: Any, t: int, host: tuple = ()) -> tuple:
    """``MultiTensor.kernels`` of a definition: ``((kernel, args), None)`` for a flag set without a sum, else the
    map's, then per reduction level the partials' and the fold's; the args of a kernel: its double numbers, then its
    dtype scalars (``emit.multi_params``; a fold's values come from ``scal``), by name."""
    shape, numbers = tr.trace_scalars(d.scalars_fn, cfg, t, host)
    if shape != generated_shape(d):
        raise RuntimeError(f"{d.name}.scalars derives its lr-dependent scalars with other operations for {cfg!r} "
                           f"than for the example config the kernels were generated from")
    numbers = dict(numbers)
    fs = d.flags_of(cfg, t, host)
    sp = d.split_at(fs)

    def kernel(kind: str, prog: tr.Program) -> tuple:
        doubles, plain = emit.multi_params(d, prog, shape)
        return emit.cuda_name(d, fs, kind), tuple(numbers[w] for w in doubles + plain)

    if sp is None:
        return kernel("multi", d.program_at(fs)), None
    levels = tuple((kernel(f"partials{level or ''}_multi", lv.reduce), kernel(f"fold{level or ''}_multi", lv.fold))
                   for level, lv in enumerate(sp.levels))
    return kernel("map_multi", sp.map), levels


def _multi_tensor(d: Definition) -> MultiTensor:
    splits = [sp for sp in (d.split_at(d.index(f)) for f in d.flag_sets()) if sp is not None]
    sums = max((sp.width for sp in splits), default=0)
    folds = max((len(sp.folds) for sp in splits), default=0)
    return MultiTensor(cuda_file(d), d.state_arrays, functools.partial(_launch, d), sums, folds)


def bind(d: Definition):
    """``(update, kernel_update, multi_tensor, scratch_buffers)`` for the optimizer class."""

    def update(xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any, scratch: list) -> None:
        if xp is np and native_update(d, cfg, st, p, g, t=t, lr=lr):
            return
        numpy_update(d, xp, cfg, st, p, g, t=t, lr=lr, scratch=scratch)

    update.takes_ranges = True  # type: ignore[attr-defined]  # (core.hooks.Hooks.ranges: numpy_update cuts)
    return update, functools.partial(kernel_update, d), _multi_tensor(d), scratch_needed(d)


class _Slices:
    """A state whose slots are the slices [a, b) of another's (what ``Definition.state_arrays`` reads)."""

    def __init__(self, d: Definition, arrays: tuple, a: int, b: int):
        for name, x in zip(d.slots, arrays):
            setattr(self, name, x[a:b])


def _plain_range(d: Definition, cfg: Any, st: Any, p: Any, g: Any, t: int, lr: Any, chunk: int, lo: int,
                 hi: int) -> None:
    """Elements [lo, hi) of a flag set without a sum: the elementwise step per chunk (the C pass or NumPy)."""
    sts = d.state_arrays(st, p)
    scr = cpu_plan.scratch(p.dtype, scratch_needed(d), chunk)
    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        view = _Slices(d, sts, a, b)
        if not native_update(d, cfg, view, p[a:b], g[a:b], t=t, lr=lr):
            numpy_update(d, np, cfg, view, p[a:b], g[a:b], t=t, lr=lr, scratch=[x[:b - a] for x in scr])


def bind_reduce(d: Definition) -> dict:
    """What the optimizer class of a definition with a sum (``reduce.py``) binds: ``update_fn`` (a whole tensor),
    ``np_phases_fn`` (NumPy: phases of tasks on the threads), ``np_rows_fn`` (NumPy: small tensors as rows),
    ``kernel_fn`` and ``multi_tensor`` (three launches per group)."""

    def np_phases(cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any, chunk: int):
        v = values(d, cfg, t, lr)
        if d.split_at(v.fs) is None:
            yield [(hi - lo, functools.partial(_plain_range, d, cfg, st, p, g, t, lr, chunk, lo, hi))
                   for lo, hi in cpu_plan.ranges(p.size, chunk)]
            return
        yield from reduce.np_phases(d, v.fs, (p, g, *d.state_arrays(st, p)), st, v.cast(p.dtype), v.packed, chunk)

    def np_rows(cfg: Any, st: Any, P: Any, G: Any, *, t: int, lr: Any, work: dict) -> None:
        v = values(d, cfg, t, lr)
        if d.split_at(v.fs) is None:  # (scratch_needed: the same count for every flag set without a sum)
            bufs = work.get("plain")
            if bufs is None:
                bufs = work["plain"] = [np.empty_like(P) for _ in range(scratch_needed(d))]
            numpy_update(d, np, cfg, st, P, G, t=t, lr=lr, scratch=bufs)
            return
        reduce.np_rows(d, v.fs, (P, G, *d.state_arrays(st, P)), v.cast(P.dtype), work)

    def update(xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any, scratch: list) -> None:
        """One step on a whole flat buffer (not elementwise: a sum needs all of it)."""
        if xp is np:
            blocks.run_serial(np_phases(cfg, st, p, g, t=t, lr=lr, chunk=reduce.CHUNK))
            return
        v = values(d, cfg, t, lr)
        if d.split_at(v.fs) is None:  # the scratch of xp_update's (per thread and stream), not a per-name area
            numpy_update(d, xp, cfg, st, p, g, t=t, lr=lr, scratch=reduce.scratch(xp, scratch_needed(d), p.size,
                                                                                   p.dtype))
            return
        reduce.xp_update(d, v.fs, xp, (p, g, *d.state_arrays(st, p)), st, v.cast(p.dtype))

    return dict(update_fn=update, np_phases_fn=np_phases, np_rows_fn=np_rows,
                kernel_fn=functools.partial(kernel_update, d), multi_tensor=_multi_tensor(d))


@functools.lru_cache(maxsize=None)
def _reduce_bound(d: Definition) -> dict:
    return bind_reduce(d)


def configure(opt: Any, d: Definition) -> None:
    """Bind an optimizer built on ``d`` to its configuration: with ``cautious`` on, the step sums over each tensor
    (the mask's count), so the optimizer is not elementwise and runs the reduce-then-map forms of ``d``
    (``bind_reduce``: whole tensors, NumPy phases and rows); otherwise nothing changes.  Decided at construction:
    ``load_state_dict`` keeps the object's ``cautious`` (``core/driver.py``)."""
    if not getattr(opt.config, "cautious", False):
        return
    b = _reduce_bound(d)
    update, kernel = b["update_fn"], b["kernel_fn"]
    opt.elementwise = False
    opt.scratch_buffers = 0  # the whole-tensor forms keep their work area in the state
    opt.multi_tensor = b["multi_tensor"]
    opt.np_phases_fn, opt.np_rows_fn = b["np_phases_fn"], b["np_rows_fn"]

    def update_hook(xp: Any, st: Any, p: Any, g: Any, *, t: int, lr: float, scratch: list) -> None:
        update(xp, opt.config, st, p, g, t=t, lr=lr, scratch=scratch)

    def kernel_hook(st: Any, p: Any, g: Any, *, t: int, lr: float) -> bool:
        return kernel(opt.config, st, p, g, t=t, lr=lr)

    opt.hooks = opt.hooks.replace(update=update_hook, kernel_update=kernel_hook)

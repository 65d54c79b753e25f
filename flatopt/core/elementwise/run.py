"""What an optimizer class binds from a definition: ``update`` (the compiled C pass on NumPy when the library is
built, else the NumPy/CuPy path), ``kernel_update`` (the per-tensor CUDA kernel) and ``multi`` (the multi-tensor
launch), every one driven by the same instruction list of the flag set in use."""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import numpy as np

from .. import backend, blocks, cpu_plan, kernels, native
from .. import sqsum
from ..multi_tensor import MultiTensor, Norms
from . import emit, lower_numpy, reduce, trace as tr
from .define import Definition

GENERATED_DIR = "generated"


def cuda_file(d: Definition) -> str:
    return f"{GENERATED_DIR}/{d.name}.cu"


def split(d: Definition, lr: Any) -> tuple[float, tuple]:
    """``(lr, host values)`` of what the derived paths receive as ``lr`` (a tuple for a definition with ``host``)."""
    if d.host:
        return lr[0], tuple(lr[1:])
    return lr, ()


def _scalars(d: Definition, cfg: Any, t: int, lr: float, hv: tuple = ()) -> dict:
    return _scalars_keyed(d, cfg, t, lr, math.copysign(1.0, lr), hv)


@functools.lru_cache(maxsize=256)
def _scalars_keyed(d: Definition, cfg: Any, t: int, lr: float, sign: float, hv: tuple) -> dict:
    """Cached on the value and the sign of lr (``-0.0 == 0.0``, but ``-lr`` differs in its bits)."""
    return {k: float(v) for k, v in d.scalars_fn(cfg, t, lr, *hv).items()}


def _packed(d: Definition, cfg: Any, t: int, lr: float, hv: tuple = ()) -> bytes:
    return _packed_keyed(d, cfg, t, lr, math.copysign(1.0, lr), hv)


@functools.lru_cache(maxsize=256)
def _packed_keyed(d: Definition, cfg: Any, t: int, lr: float, sign: float, hv: tuple) -> bytes:
    sc = _scalars(d, cfg, t, lr, hv)
    return struct.pack(f"{len(d.scalar_names)}d", *(sc[k] for k in d.scalar_names))


@functools.lru_cache(maxsize=256)
def _cast(d: Definition, cfg: Any, t: int, lr: float, dtype: Any, sign: float, hv: tuple = ()) -> dict:
    dt = np.dtype(dtype).type
    return {k: dt(v) for k, v in _scalars(d, cfg, t, lr, hv).items()}


@functools.lru_cache(maxsize=None)
def plan(d: Definition, fs: int) -> lower_numpy.Plan:
    return lower_numpy.allocate(d.program_at(fs))


@functools.lru_cache(maxsize=None)
def _runner(d: Definition, fs: int, xp: Any) -> lower_numpy.Runner:
    return lower_numpy.Runner(plan(d, fs), xp, d.arrays)


@functools.lru_cache(maxsize=256)
def _prepared(d: Definition, cfg: Any, t: int, lr: float, dtype: Any, xp: Any, sign: float, hv: tuple) -> tuple:
    """(the straight-line function of this step's flag set, its scalars of the dtype, its boolean scratch count)."""
    r = _runner(d, d.flags_of(cfg, t, hv), xp)
    return r.run, _cast(d, cfg, t, lr, dtype, sign, hv), r.plan.bools


def scratch_needed(d: Definition) -> int:
    """The float scratch buffers the NumPy path needs (the largest over the flag sets without a sum: the chunked
    elementwise path's; over all of them when every flag set sums)."""
    return max(plan(d, d.index(f)).scratch for f in d.plain_flag_sets() or d.flag_sets())


def numpy_update(d: Definition, xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float,
                 scratch: list) -> None:
    """The NumPy/CuPy path alone (the reference), in pieces of the scratch's length (every pass of a piece then
    finds its operands in the cache: the driver's scratch is chunk-sized)."""
    lr, hv = split(d, lr)
    fn, sc, nb = _prepared(d, cfg, t, lr, p.dtype, xp, math.copysign(1.0, lr), hv)
    arrays, n, dt = (p, g, *d.state_arrays(st, p)), p.size, p.dtype.type
    if not scratch or n <= scratch[0].size:
        fn(arrays, sc, scratch, lower_numpy.bool_scratch(xp, nb, n) if nb else (), dt)
        return
    k = scratch[0].size
    for lo in range(0, n, k):
        m = min(k, n - lo)
        fn(tuple(a[lo:lo + m] for a in arrays), sc, scratch if m == k else [b[:m] for b in scratch],
           lower_numpy.bool_scratch(xp, nb, m) if nb else (), dt)


def native_update(d: Definition, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float) -> bool:
    """The compiled C pass; False (nothing touched) when it cannot run."""
    lr, hv = split(d, lr)
    return native.gen_step(d.name, d.flags_of(cfg, t, hv), (p, g, *d.state_arrays(st, p)),
                           _packed(d, cfg, t, lr, hv))


def bind(d: Definition):
    """``(update, kernel_update, multi_tensor, scratch_buffers)`` for the optimizer class."""

    def update(xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: float, scratch: list) -> None:
        if xp is np and native_update(d, cfg, st, p, g, t=t, lr=lr):
            return
        numpy_update(d, xp, cfg, st, p, g, t=t, lr=lr, scratch=scratch)

    update.takes_ranges = True  # type: ignore[attr-defined]  # (core.hooks.Hooks.ranges: numpy_update cuts)

    def kernel_update(cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any) -> bool:
        lr, hv = split(d, lr)
        return _plain_kernel(d, d.flags_of(cfg, t, hv), cfg, st, p, g, t, lr, hv)

    def multi_args(cfg: Any, t: int, dt: Any, host: tuple = ()) -> tuple:
        fs = d.flags_of(cfg, t, host)
        doubles, plain, numbers = _multi(d, cfg, t, fs, host)
        return (*(numbers[w] for w in doubles), *(numbers[k] for k in plain))

    def pick(cfg: Any, t: int, host: tuple = ()) -> str:
        return emit.cuda_name(d, d.flags_of(cfg, t, host), "multi")

    multi = MultiTensor(cuda_file(d), emit.cuda_name(d, 0, "multi"), d.state_arrays, multi_args, pick=pick,
                        aligned_flag=True)
    return update, kernel_update, multi, scratch_needed(d)


def _grid(n: int) -> int:
    return min(math.ceil(n / (emit.THREADS * emit.ELEMS)), 65535 * 8)


def _plain_kernel(d: Definition, fs: int, cfg: Any, st: Any, p: Any, g: Any, t: int, lr: float,
                  hv: tuple = ()) -> bool:
    """The per-tensor kernel of a flag set without a sum."""
    n = p.size
    if n == 0:
        return True
    prog = d.program_at(fs)
    k = kernels.get(cuda_file(d), emit.cuda_name(d, fs, "step"), p.dtype)
    arrays = dict(zip(d.arrays, (p, g, *d.state_arrays(st, p))))
    used = [arrays[a] for a in _used(d, fs)]
    sc = _scalars(d, cfg, t, lr, hv)
    k((_grid(n),), (emit.THREADS,), (*used, np.int64(n), *(sc[s] for s in prog.scalars)))
    return True


def _reduce_kernel(d: Definition, fs: int, cfg: Any, st: Any, p: Any, g: Any, t: int, lr: float,
                   hv: tuple = ()) -> bool:
    """The per-tensor kernels of a flag set with a sum: per reduction level its partials and its fold, then the map
    (``st.work``: one level's partials and every fold's result, allocated once per name); no host
    synchronisation."""
    n = p.size
    if n == 0:
        return True
    sp = d.split_at(fs)
    nb = sqsum.sq_blocks(n)
    k = max(len(lv.sums) for lv in sp.levels)
    buf = reduce.work(st, k * nb + len(sp.folds), p.dtype, backend.cupy())
    parts, scal = buf[:k * nb], buf[k * nb:]
    arrays = dict(zip(d.arrays, (p, g, *d.state_arrays(st, p))))
    sc = _scalars(d, cfg, t, lr, hv)
    src = cuda_file(d)

    def used(prog: tr.Program) -> list:
        written = {a for a, _ in prog.outputs}
        return [arrays[a] for a in d.arrays if a in written or a in prog.reads]

    threads = (sqsum.SQ_THREADS,)
    for level, lv in enumerate(sp.levels):
        tag = str(level or "")
        kernels.get(src, emit.cuda_name(d, fs, "partials" + tag), p.dtype)((nb,), threads, (
            *used(lv.reduce), np.int64(n), *(sc[s] for s in lv.reduce.scalars if s not in sp.folds), parts,
            *((scal,) if level else ())))
        kernels.get(src, emit.cuda_name(d, fs, "fold" + tag), p.dtype)((1,), threads, (
            parts, np.int64(nb), *(sc[s] for s in lv.fold.scalars if s not in sp.folds), scal))
    own = [s for s in sp.map.scalars if s not in sp.folds]
    kernels.get(src, emit.cuda_name(d, fs, "map"), p.dtype)((_grid(n),), (emit.THREADS,), (
        *used(sp.map), np.int64(n), *(sc[s] for s in own), scal))
    return True


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
    """What the optimizer class of a definition with a sum (``reduce.py``) binds: ``update_fn``, ``np_phases_fn``,
    ``np_rows_fn`` (a flag set without a sum runs the plain elementwise step in each).  A definition with ``host``
    values receives ``lr`` as ``(lr, *host values)`` in each, as ``bind``'s functions do; its multi-tensor launch
    takes them per group (``host=``)."""

    def sc_of(cfg: Any, t: int, lr: float, dtype: Any, hv: tuple) -> dict:
        return _cast(d, cfg, t, lr, dtype, math.copysign(1.0, lr), hv)

    def np_phases(cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any, chunk: int):
        lr_hv = lr
        lr, hv = split(d, lr)
        fs = d.flags_of(cfg, t, hv)
        if d.split_at(fs) is None:
            yield [(hi - lo, functools.partial(_plain_range, d, cfg, st, p, g, t, lr_hv, chunk, lo, hi))
                   for lo, hi in cpu_plan.ranges(p.size, chunk)]
            return
        yield from reduce.np_phases(d, fs, (p, g, *d.state_arrays(st, p)), st, sc_of(cfg, t, lr, p.dtype, hv),
                                    _packed(d, cfg, t, lr, hv), chunk)

    def np_rows(cfg: Any, st: Any, P: Any, G: Any, *, t: int, lr: Any, work: dict) -> None:
        lr_hv = lr
        lr, hv = split(d, lr)
        fs = d.flags_of(cfg, t, hv)
        if d.split_at(fs) is None:
            bufs = work.get(("plain", fs))
            if bufs is None:
                bufs = work[("plain", fs)] = [np.empty_like(P) for _ in range(scratch_needed(d))]
            numpy_update(d, np, cfg, st, P, G, t=t, lr=lr_hv, scratch=bufs)
            return
        reduce.np_rows(d, fs, (P, G, *d.state_arrays(st, P)), sc_of(cfg, t, lr, P.dtype, hv), work)

    def update(xp: Any, cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any, scratch: list) -> None:
        """One step on a whole flat buffer (not elementwise: a sum needs all of it)."""
        if xp is np:
            blocks.run_serial(np_phases(cfg, st, p, g, t=t, lr=lr, chunk=reduce.CHUNK))
            return
        lr_hv = lr
        lr, hv = split(d, lr)
        fs = d.flags_of(cfg, t, hv)
        if d.split_at(fs) is None:
            k, n = scratch_needed(d), p.size
            w = reduce.work(st, max(1, k) * n, p.dtype, xp)
            numpy_update(d, xp, cfg, st, p, g, t=t, lr=lr_hv, scratch=[w[j * n:(j + 1) * n] for j in range(k)])
            return
        reduce.xp_update(d, fs, xp, (p, g, *d.state_arrays(st, p)), st, sc_of(cfg, t, lr, p.dtype, hv))

    def kernel_update(cfg: Any, st: Any, p: Any, g: Any, *, t: int, lr: Any) -> bool:
        lr, hv = split(d, lr)
        fs = d.flags_of(cfg, t, hv)
        if d.split_at(fs) is None:
            return _plain_kernel(d, fs, cfg, st, p, g, t, lr, hv)
        return _reduce_kernel(d, fs, cfg, st, p, g, t, lr, hv)

    def map_args(cfg: Any, t: int, dt: Any, host: tuple = ()) -> tuple:
        fs = d.flags_of(cfg, t, host)
        sp = d.split_at(fs)
        doubles, plain, numbers = _multi(d, cfg, t, fs, host, "map" if sp is not None else None)
        return (*(numbers[w] for w in doubles), *(numbers[k] for k in plain))

    def partial_args(cfg: Any, t: int, dt: Any, host: tuple = (), level: int = 0) -> tuple:
        sc = _scalars(d, cfg, t, 0.0, host)  # the reduce phase reads no lr-dependent scalar (emit refuses one)
        sp = d.split_at(d.flags_of(cfg, t, host))
        return tuple(sc[s] for s in sp.levels[level].reduce.scalars if s not in sp.folds)

    def fold_args(cfg: Any, t: int, dt: Any, host: tuple = (), level: int = 0) -> tuple:
        doubles, plain, numbers = _multi(d, cfg, t, d.flags_of(cfg, t, host), host, level)
        return (*(numbers[w] for w in doubles), *(numbers[k] for k in plain))

    def pick(cfg: Any, t: int, host: tuple = ()) -> str:
        fs = d.flags_of(cfg, t, host)
        return emit.cuda_name(d, fs, "map_multi" if d.split_at(fs) is not None else "multi")

    def pick_norms(cfg: Any, t: int, host: tuple = ()) -> tuple | None:
        fs = d.flags_of(cfg, t, host)
        sp = d.split_at(fs)
        if sp is None:
            return None
        tags = [str(level or "") for level in range(len(sp.levels))]
        return tuple((emit.cuda_name(d, fs, f"partials{x}_multi"), emit.cuda_name(d, fs, f"fold{x}_multi")) for x in tags)

    splits = [sp for sp in (d.split_at(d.index(f)) for f in d.flag_sets()) if sp is not None]
    norms = Norms(max(len(lv.sums) for sp in splits for lv in sp.levels), max(len(sp.folds) for sp in splits),
                  pick_norms, partial_args, fold_args)
    multi = MultiTensor(cuda_file(d), pick(d.example, 1, d.example_host), d.state_arrays, map_args, norms=norms,
                        pick=pick,
                        aligned_flag=True)
    return dict(update_fn=update, np_phases_fn=np_phases, np_rows_fn=np_rows, kernel_fn=kernel_update,
                multi_tensor=multi)


@functools.lru_cache(maxsize=None)
def _used(d: Definition, fs: int) -> tuple:
    prog = d.program_at(fs)
    written = {n for n, _ in prog.outputs}
    return tuple(a for a in d.arrays if a in written or a in prog.reads)


@functools.lru_cache(maxsize=None)
def generated_shape(d: Definition) -> tuple:
    """The scalars' shape the CUDA source was generated from (the example config)."""
    return tr.trace_scalars(d.scalars_fn, d.example, 1, d.example_host)[0]


@functools.lru_cache(maxsize=256)
def _multi(d: Definition, cfg: Any, t: int, fs: int, hv: tuple = (), part: str | int | None = None) -> tuple:
    """(double arguments, dtype scalars, their values) of a multi-tensor kernel: the flag set's, or with ``part``
    ("map", or a level's number for its fold) that part of its split; ``hv``: the definition's host values."""
    shape, numbers = tr.trace_scalars(d.scalars_fn, cfg, t, hv)
    if shape != generated_shape(d):
        raise RuntimeError(f"{d.name}.scalars derives its lr-dependent scalars with other operations for {cfg!r} "
                           f"than for the example config the kernels were generated from")
    sp = d.split_at(fs)
    prog = d.program_at(fs) if part is None else sp.map if part == "map" else sp.levels[part].fold
    doubles, plain = emit.multi_params(d, prog, shape)
    return doubles, plain, dict(numbers)


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
    update, kernel = b["update_fn"], b.get("kernel_fn")
    opt.elementwise = False
    opt.scratch_buffers = 0  # the whole-tensor forms keep their work area in the state
    opt.multi_tensor = b.get("multi_tensor")
    opt.np_phases_fn, opt.np_rows_fn = b["np_phases_fn"], b["np_rows_fn"]

    def update_hook(xp: Any, st: Any, p: Any, g: Any, *, t: int, lr: float, scratch: list) -> None:
        update(xp, opt.config, st, p, g, t=t, lr=lr, scratch=scratch)

    def kernel_hook(st: Any, p: Any, g: Any, *, t: int, lr: float) -> bool:
        return kernel is not None and kernel(opt.config, st, p, g, t=t, lr=lr)

    opt.hooks = opt.hooks.replace(update=update_hook, kernel_update=kernel_hook)

"""The driver's path for 16-bit parameters and mixed gradients, generic for every algorithm (``core.precision``).

A batch that holds a float16/bfloat16 parameter, a gradient of another dtype than its parameter, or names stepped
as 16-bit before (or any batch under a ``writeback`` other than ``"nearest"``) is *lowered*:

1. every item is validated on the caller's buffers (dtypes, the name's dtype so far, the write-back policy,
   aliasing) before anything changes;
2. each 16-bit parameter becomes a float32 working copy: the calling thread's scratch (``core.workspace``, one arena
   per backend, device, dtype and role) holding ``f32(p)`` (``"nearest"``, ``"stochastic"``) or ``f32(p) + f32(c)``
   (``"kahan"``), or the float32 master copy itself (``"master"``; a new name's is made from the parameter); a
   gradient of another dtype than the working parameter (float32, or float64 for a float64 parameter) is converted
   into scratch of its own (the caller's gradient is never written);
3. the driver's own ``step_batch`` runs on the working items (validating them again: a refusal there changes
   nothing, the write-back buffers of new names are installed only after it);
4. each working copy is written back into its parameter (``core.precision``; ``t`` is the name's step count after
   this step; the element index is the one in the whole parameter: ``element_offsets`` of the driver gives the
   offset of a range that a rank of ``flatopt.distributed`` steps).

Steps 2 and 4 run in chunks (every element's result depends on its value and index alone, so any split gives the
same bits): of ``CHUNK`` elements on NumPy, as tasks on the threads (``core.parallel``), and of ``GPU_CHUNK`` in order
on CuPy (each chunk is some twenty small kernel launches: larger chunks launch fewer).  The working items are new
arrays at each call, so a step plan built from them (``core.step_plan``) is never re-used: the driver treats them as
it treats a batch of fresh arrays at every step.

``LowParam`` is what the driver keeps per 16-bit name beside its slot (whose ``dtype`` is the working dtype, float32):
the parameter's dtype name and its write-back buffer (``comp``: Kahan's compensation in the parameter's dtype;
``master``: float32).  In a snapshot the name's ``dtype`` is the parameter's, and the buffers are
``precision.kahan/<name>`` and ``precision.master/<name>``; ``extra["precision"]`` records a policy other than the
default (a snapshot of another policy is refused, with the reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import IncompatibleStateError
from . import backend as _backend, workspace
from .precision import LOWP_NAMES, Precision, is_lowp, random_words, round_nearest, round_stochastic, stream_base
from .precision import widen, work_dtype
from .types import Array, OptimizerState, OptItem
from .parallel import run_tasks
from .validate import as_item, check_batch_aliasing, check_item

CHUNK = 1 << 16  # elements per write-back chunk on NumPy (bounds the temporaries of the rounding)
GPU_CHUNK = 1 << 20  # on CuPy (the rounding's temporaries: at most 50 bytes per element of a chunk)
_PLAIN = (np.dtype(np.float32), np.dtype(np.float64))
BUFFERS = {"kahan": "precision.kahan", "master": "precision.master"}


@dataclasses.dataclass
class LowParam:
    """What the driver keeps per 16-bit parameter name (see the module doc)."""

    dtype: str  # "float16" or "bfloat16"
    comp: Array | None = None  # "kahan": the compensation, in the parameter's dtype
    master: Array | None = None  # "master": the float32 master copy


def needed(opt: Any, items: Sequence[Any]) -> bool:
    """Whether ``items`` take the lowered path (module doc); ``False`` for a malformed batch (the driver's own
    validation then says what is wrong)."""
    if opt.precision.writeback != "nearest":
        return True
    known = opt._lowp  # noqa: SLF001 - the driver's map
    f32, f64 = _PLAIN
    try:
        for i, it in enumerate(items):
            if type(it) is not OptItem:
                it = as_item(i, it)
            pd = it.param.dtype
            if (pd is not f32 and pd is not f64 and pd not in _PLAIN) or (
                    it.grad.dtype is not pd and it.grad.dtype != pd) or (known and it.name in known):
                return True
    except Exception:  # noqa: BLE001 - a malformed item
        return False
    return False


def _check(opt: Any, items: Sequence[Any]) -> list[OptItem]:
    """Step 1 of the module doc; the items as ``OptItem``."""
    policy = opt.precision
    out = []
    seen: set[str] = set()
    for i, it in enumerate(items):
        it = as_item(i, it)
        check_item(it.name, it.shape, it.param, it.grad, lowp=True)
        dt = it.param.dtype
        rec = opt._lowp.get(it.name)  # noqa: SLF001 - the driver's map
        slot = opt._slots.get(it.name)  # noqa: SLF001 - the driver's map
        had = rec.dtype if rec is not None else (slot.dtype.name if slot is not None else None)
        if had is not None and had != dt.name:
            raise TypeError(f"parameter {it.name!r}: dtype {dt} differs from the dtype {had} its state was created "
                            f"with")
        exact = opt._plain_writeback_exact  # noqa: SLF001 - the driver's flag (Adafactor8Bit's original option)
        if policy.writeback != "nearest" and not is_lowp(dt) and not exact:
            raise ValueError(f"parameter {it.name!r}: writeback={policy.writeback!r} applies to float16/bfloat16 "
                             f"parameters, got a {dt} parameter (its write-back is exact: step it with "
                             f"writeback='nearest', e.g. in another optimizer)")
        if it.name in seen:
            raise ValueError(f"parameter {it.name!r} appears twice in one step_batch")
        seen.add(it.name)
        out.append(it)
    if len(out) > 1:
        check_batch_aliasing(out)
    return out


def _device(a: Any) -> Any:
    return a.device if _backend.backend_name(a) == "cupy" else contextlib.nullcontext()


def _arenas(sizes: list[tuple[Any, np.dtype, int, str]]) -> list[Array | None]:
    """One scratch view per entry ``(like, dtype, n, role)`` (``None`` for an entry whose ``like`` is ``None``), cut
    from one per-thread arena per (backend, device, dtype, role)."""
    totals: dict[Any, int] = {}
    first: dict[Any, Any] = {}
    keys: list[Any] = []
    for like, dtype, n, role in sizes:
        if like is None:
            keys.append(None)
            continue
        backend = _backend.backend_name(like)
        k = (backend, like.device.id if backend == "cupy" else None, dtype, role)
        first.setdefault(k, like)
        keys.append((k, totals.get(k, 0)))
        totals[k] = totals.get(k, 0) + n
    bufs = {}
    for k, total in totals.items():
        like = first[k]
        with _device(like):
            bufs[k] = workspace.get(_backend.array_module(like), f"precision.{k[3]}", total, k[2])
    return [None if kk is None else bufs[kk[0]][kk[1]:kk[1] + n] for (_, _, n, _), kk in zip(sizes, keys)]


def _lower(opt: Any, items: list[OptItem], fill: bool) -> tuple[list[OptItem], list[Any]]:
    """Step 2 of the module doc: ``(working items, jobs)``; a job is ``(item, working param, record, new)`` for a
    16-bit parameter (``new``: the record is to be installed).  ``fill=False`` only shapes the working items (for
    ``validate_batch``: scratch on the parameter's backend, also in place of a master copy, which is neither made nor
    moved)."""
    policy = opt.precision.writeback
    needs = []
    recs: list[tuple[LowParam | None, bool]] = []
    for it in items:
        p, g = it.param, it.grad
        wd = work_dtype(p.dtype)
        rec, new = None, False
        if is_lowp(p.dtype):
            rec = opt._lowp.get(it.name)  # noqa: SLF001 - the driver's map
            if rec is None:
                rec, new = LowParam(p.dtype.name), True
        own = rec is not None and policy == "master" and fill  # the master copy is the working parameter
        needs.append((p if rec is not None and not own else None, wd, p.size, "param"))
        needs.append((g if g.dtype != wd else None, wd, g.size, "grad"))
        recs.append((rec, new))
    views = _arenas(needs)
    work, jobs, fills = [], [], []
    for k, it in enumerate(items):
        wp, wg = views[2 * k], views[2 * k + 1]
        rec, new = recs[k]
        comp = None
        if rec is not None and policy == "master" and fill:
            if new:
                with _device(it.param):
                    wp = rec.master = _backend.array_module(it.param).empty(it.param.size, np.float32)
            else:
                wp = rec.master = _backend.to_backend(rec.master, it.param)
        elif rec is not None and policy == "kahan" and not new and fill:
            comp = rec.comp = _backend.to_backend(rec.comp, it.param)
        if rec is None:
            wp = it.param
        elif policy != "master" or new:
            fills.append((it, it.param, wp, comp))
        if wg is None:
            wg = it.grad
        else:
            fills.append((it, it.grad, wg, None))
        work.append(OptItem(it.name, it.shape, wp, wg))
        if rec is not None:
            jobs.append((it, wp, rec, new))
    if fill:
        _over_chunks([(it, src.size, functools.partial(_widen, src, dst, comp)) for it, src, dst, comp in fills])
    return work, jobs


def _widen(src: Array, dst: Array, comp: Array | None, lo: int, hi: int) -> None:
    """``dst[lo:hi]`` = ``src[lo:hi]`` widened, plus the widened ``comp[lo:hi]`` where given (Kahan's p + c)."""
    xp = _backend.array_module(src)
    widen(xp, src[lo:hi], dst[lo:hi])
    if comp is not None:
        wc = workspace.get(xp, "precision.comp", hi - lo, np.float32)
        widen(xp, comp[lo:hi], wc)
        xp.add(dst[lo:hi], wc, out=dst[lo:hi])


def _over_chunks(work: list[tuple[OptItem, int, Callable[[int, int], None]]]) -> None:
    """Run ``fn(lo, hi)`` over the chunks of each ``(item, n, fn)``: on NumPy as tasks of ``CHUNK`` elements on the
    threads (each chunk is a pure function of its elements and indices: any split gives the same bits), on CuPy in
    chunks of ``GPU_CHUNK`` in order with the item's device current."""
    tasks = []
    for it, n, fn in work:
        if _backend.backend_name(it.param) == "cupy":
            with it.param.device:
                for lo in range(0, n, GPU_CHUNK):
                    fn(lo, min(n, lo + GPU_CHUNK))
            continue
        tasks += [(min(n, lo + CHUNK) - lo, it.name, functools.partial(fn, lo, min(n, lo + CHUNK)))
                  for lo in range(0, n, CHUNK)]
    run_tasks(tasks)


def _write_chunk(writeback: str, base: int, off: int, wp: Array, p: Array, comp: Array | None, lo: int,
                 hi: int) -> None:
    """Step 4 of the module doc on elements ``lo:hi`` of one parameter (``off``: the index of its element 0 in the
    whole parameter, for the random draw)."""
    xp = _backend.array_module(p)
    w, out = wp[lo:hi], p[lo:hi]
    if writeback == "stochastic":
        words = workspace.get(xp, "precision.words", hi - lo, np.uint64)
        random_words(xp, base, off + lo, words, workspace.get(xp, "precision.words_tmp", hi - lo, np.uint64))
        round_stochastic(xp, w, out, words)
    else:
        round_nearest(xp, w, out)
    if comp is not None:
        back = workspace.get(xp, "precision.back", hi - lo, np.float32)
        bad = workspace.get(xp, "precision.back_bad", hi - lo, np.bool_)
        widen(xp, out, back)
        xp.isfinite(back, out=bad)
        xp.logical_not(bad, out=bad)
        xp.subtract(w, back, out=back)  # exact where out is finite
        xp.copyto(back, np.float32(0), where=bad)
        round_nearest(xp, back, comp[lo:hi])


def _write_back(opt: Any, jobs: list[Any]) -> None:
    """Step 4 of the module doc, then the new names' records installed."""
    policy: Precision = opt.precision
    work = []
    for it, wp, rec, new in jobs:
        p = it.param
        if policy.writeback == "kahan" and (new or rec.comp is None):
            with _device(p):
                rec.comp = _backend.array_module(p).zeros(p.size, p.dtype)
        t = opt._slots[it.name].t  # noqa: SLF001 - the driver's t, after this step
        base = stream_base(policy.seed, it.name, t)
        comp = rec.comp if policy.writeback == "kahan" else None
        off = opt.element_offsets.get(it.name, 0)
        work.append((it, p.size, functools.partial(_write_chunk, policy.writeback, base, off, wp, p, comp)))
    _over_chunks(work)
    for it, _, rec, new in jobs:
        if new:
            opt._lowp[it.name] = rec  # noqa: SLF001 - the driver's map


def step(opt: Any, items: Sequence[Any], run: Callable[[list[OptItem]], None]) -> None:
    """The lowered ``step_batch`` (module doc); ``run`` is the driver's own on float32/float64 items."""
    checked = _check(opt, items)
    work, jobs = _lower(opt, checked, fill=True)
    run(work)
    _write_back(opt, jobs)


def validate(opt: Any, items: Sequence[Any], check: Callable[[list[OptItem]], Any]) -> None:
    """What the lowered ``step_batch`` would raise for bad input, changing nothing."""
    work, _ = _lower(opt, _check(opt, items), fill=False)
    check(work)


# ---------------------------------------------------------------------- conversions outside a step
def carried(opt: Any, name: str, p: Array) -> Array:
    """The float32 value the 16-bit parameter ``name`` (buffer ``p``) carries, for an in-place conversion of it by
    an algorithm (ScheduleFreeAdamW's ``eval``/``train``): the master copy itself (``"master"``), else new memory
    holding ``f32(p)`` plus, under ``"kahan"``, ``f32(c)``.  :func:`store` writes it back."""
    rec = opt._lowp[name]  # noqa: SLF001 - the driver's map
    if rec.master is not None:
        rec.master = _backend.to_backend(rec.master, p)
        return rec.master
    with _device(p):
        w = _backend.array_module(p).empty(p.size, np.float32)
    comp = None
    if rec.comp is not None:
        comp = rec.comp = _backend.to_backend(rec.comp, p)
    _over_chunks([(OptItem(name, (p.size,), p, p), p.size, functools.partial(_widen, p, w, comp))])
    return w


def store(opt: Any, name: str, w: Array, p: Array) -> None:
    """``p`` = ``w`` (from :func:`carried`, converted) rounded to nearest, and Kahan's compensation ``c`` =
    nearest(``w - f32(p)``): no random draw is spent outside a step."""
    rec = opt._lowp[name]  # noqa: SLF001 - the driver's map
    fn = functools.partial(_write_chunk, "nearest", 0, 0, w, p, rec.comp)
    _over_chunks([(OptItem(name, (p.size,), p, p), p.size, fn)])


# --------------------------------------------------------------------------------------------- snapshots
def nbytes(opt: Any) -> int:
    recs = opt._lowp.values()  # noqa: SLF001 - the driver's map
    return sum(a.nbytes for r in recs for a in (r.comp, r.master) if a is not None)


def to_snapshot(opt: Any, state: OptimizerState) -> OptimizerState:
    """``state`` (the driver's snapshot) with the 16-bit names' dtypes, their write-back buffers and the policy."""
    lowp = opt._lowp  # noqa: SLF001 - the driver's map
    if not lowp and opt.precision == Precision():
        return state
    params, buffers = dict(state.params), dict(state.buffers)
    for name in sorted(lowp):
        rec = lowp[name]
        params[name] = {**params[name], "dtype": rec.dtype}
        for kind, prefix in BUFFERS.items():
            arr = getattr(rec, "comp" if kind == "kahan" else "master")
            if arr is not None:
                buffers[f"{prefix}/{name}"] = arr.copy()
    extra = state.extra
    if opt.precision != Precision():
        extra = {**extra, "precision": opt.precision.to_dict()}
    return dataclasses.replace(state, params=params, buffers=buffers, extra=extra)


def from_snapshot(opt: Any, state: OptimizerState) -> tuple[OptimizerState, dict[str, LowParam]]:
    """``(the snapshot as the driver's own restore reads it, the 16-bit names' records)``; changes nothing;
    :class:`IncompatibleStateError` (the reason) for another policy or a missing or malformed write-back buffer."""
    policy = opt.precision
    raw = state.extra.get("precision")
    try:
        theirs = Precision() if raw is None else Precision.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise IncompatibleStateError(f"snapshot extra['precision']: {exc}") from None
    if theirs != policy:
        raise IncompatibleStateError(f"the snapshot was written under {theirs!r}, this optimizer has {policy!r} "
                                     f"(another write-back keeps other buffers and other bits; no conversion)")
    params, buffers = dict(state.params), dict(state.buffers)
    recs = {}
    for name, meta in state.params.items():
        dtype = meta.get("dtype") if isinstance(meta, dict) else None
        if dtype not in LOWP_NAMES:
            continue
        rec = LowParam(dtype)
        prefix = BUFFERS.get(policy.writeback)
        if prefix is not None:
            key = f"{prefix}/{name}"
            arr = buffers.pop(key, None)
            n = int(np.prod(meta.get("shape", ()), dtype=np.int64))
            want = dtype if policy.writeback == "kahan" else "float32"
            if arr is None or arr.shape != (n,) or arr.dtype.name != want:
                got = "missing" if arr is None else f"shape {arr.shape}, dtype {arr.dtype}"
                raise IncompatibleStateError(f"parameter {name!r}: write-back buffer {key!r} must be {want} of "
                                             f"shape ({n},) under writeback={policy.writeback!r}, got {got}")
            setattr(rec, "comp" if policy.writeback == "kahan" else "master", arr.copy())
        params[name] = {**meta, "dtype": "float32"}
        recs[name] = rec
    extra = {k: v for k, v in state.extra.items() if k != "precision"}
    return dataclasses.replace(state, params=params, buffers=buffers, extra=extra), recs

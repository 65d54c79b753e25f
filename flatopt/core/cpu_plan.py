"""The NumPy execution plan of ``step_batch`` for the per-parameter driver (``core.driver.PerParamOptimizer._run``).

* **Large items** of an elementwise algorithm run in cache-sized chunks (``core.driver.CHUNK`` elements): every ufunc
  pass of ``update`` then finds its operands in the L2 cache.  Consecutive chunks are grouped into tasks of about
  ``TASK`` elements, which ``core.parallel.run_tasks`` spreads over the threads; one task costs one Python call and
  one scratch look-up, not one per chunk.  An update that takes whole ranges (``Hooks.ranges``: a generated
  algorithm, whose compiled pass streams each array once and needs no cache-sized chunks) gets tasks of ``RANGE``
  elements instead, one call each; its NumPy path cuts them into chunks itself.
* **Small items** (at most ``SMALL`` elements) of an elementwise algorithm are *bucketed*: the items of one batch
  that share a dtype, a step count ``t``, a learning rate and their scalar state fields are packed and updated
  with one call of ``update`` per chunk instead of ~14 ufunc calls each.  Their state lives packed in a bucket
  arena (each name's state arrays are views into it), so only the params and grads move: the grads and params are
  gathered with one ``numpy.concatenate(..., out=)`` each and the params scattered back with one copy each.  A
  bucket's plan (arena views, packed buffers) is built once for a given list of names and re-used while the batch
  keeps that composition; nothing is allocated per step after that.
* **Per-tensor algorithms** (non-elementwise): with the NumPy hooks of ``core.cpu_tensors`` (Lamb, Mars) small
  items of one size are bucketed as rows of (T, n) arenas and every other item runs its phases on the threads;
  otherwise each item is one task, the whole buffer.

Every path performs, per element, exactly the operations of ``update`` on that element with that item's
scalars, so the bits equal the serial ``step`` loop and unchunked execution.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import numpy as np

from . import cpu_tensors, shards, workspace

# Items of at most this many elements are bucketed (per-call overhead dominates below it).
SMALL = 1 << 13
# Elements per bucket at most (each bucket is one task, so large groups of small items still use the threads).
BUCKET = 1 << 18
# Elements per task of a large item (about one thread's share of work worth a hand-off; a multiple of CHUNK).
TASK = 1 << 18
# Elements per task of a large item whose update takes whole ranges (``Hooks.ranges``: the compiled pass, one call
# per task, or the NumPy path cutting it into chunks itself).  Longer tasks cost fewer calls; shorter ones leave
# less work to one thread while the others wait at the end of a step.  Re-measure: ``python -m
# benchmarks.threads_probe ranges``.
RANGE = 1 << 20
# Bucket plans kept per optimizer (one per distinct composition of small items in recent batches).
MAX_PLANS = 32


class Entry(NamedTuple):
    """One NumPy item of a batch as the planner sees it (state created, ``t`` advanced)."""

    index: int  # its position in the batch (where a kept task finds its arrays in a later step)
    name: str
    param: Any
    grad: Any
    slot: Any  # its core.slots.Slot
    lr: Any  # what the algorithm's update receives as ``lr`` (the driver's effective lr)
    group: Any  # items of one group value may share a bucket: the lr, or the lr_scale for kept tasks (StaticPlan)


class Refill(NamedTuple):
    """Where a kept task (:class:`StaticPlan`) finds its arrays, ``t`` and lr in a later step."""

    index: int | list[int]  # the batch position of its item, or of each item of its bucket
    slot: Any  # the (first) item's slot: its ``t``
    group: Any  # the lr_scale its lr is derived from


class Task(NamedTuple):
    """A unit of NumPy work of one step: ``(cost, name, fn)`` is what ``core.parallel.run_tasks`` takes."""

    cost: int  # about its number of elements
    name: str  # the parameter (or bucket) an error names
    fn: Callable[[], None]
    refill: Refill


def _is_np(x) -> bool:
    return isinstance(x, np.ndarray)


def ranges(n: int, chunk: int) -> list:
    """``[(lo, hi)]``: ``range(n)`` cut into tasks of about ``TASK`` elements (whole chunks)."""
    per = max(1, TASK // chunk) * chunk
    return [(lo, min(lo + per, n)) for lo in range(0, n, per)]


def chunk_views(state, n: int, chunk: int) -> list:
    """``[(lo, hi, state_view)]`` over ``range(n)`` in pieces of ``chunk``: the 1-D state arrays of size ``n``
    sliced, everything else passed as is."""
    names = [f.name for f in dataclasses.fields(state)
             if _is_np(getattr(state, f.name)) and getattr(state, f.name).ndim == 1
             and getattr(state, f.name).size == n]
    views = []
    for lo in range(0, max(n, 1), chunk):
        hi = min(lo + chunk, n)
        views.append((lo, hi, dataclasses.replace(state, **{k: getattr(state, k)[lo:hi] for k in names})))
    return views


# ----------------------------------------------------------------------------------------------- scratch
_SCRATCH_KEYS = [f"cpu_plan.chunk{i}" for i in range(8)]


def scratch(dtype: np.dtype, k: int, chunk: int) -> list:
    """``k`` chunk-sized scratch buffers of ``dtype``: this thread's ``core.workspace`` buffers (one key each, so
    they do not overlap), allocated once per thread and grown on demand."""
    keys = _SCRATCH_KEYS if k <= len(_SCRATCH_KEYS) else [f"cpu_plan.chunk{i}" for i in range(k)]
    return [workspace.get(np, keys[i], chunk, dtype) for i in range(k)]


def _run_views(opt, views, p, g, t, lr, chunk) -> None:
    """``update`` on ``views`` (pieces of state) with the matching slices of ``p`` and ``g``, with ``chunk``-sized
    scratch (a view longer than it: ``Hooks.ranges``, the update cuts it)."""
    upd = opt.hooks.update
    full = scratch(p.dtype, opt.scratch_buffers, chunk)
    for lo, hi, st in views:
        n = hi - lo
        upd(np, st, p[lo:hi], g[lo:hi], t=t, lr=lr, scratch=full if n >= chunk else [b[:n] for b in full])


class RangeTask:
    """Consecutive chunks of one large item."""

    __slots__ = ("opt", "views", "p", "g", "t", "lr", "chunk")

    def __init__(self, opt, views, p, g, t, lr, chunk):
        self.opt, self.views, self.p, self.g, self.t, self.lr, self.chunk = opt, views, p, g, t, lr, chunk

    def __call__(self) -> None:
        _run_views(self.opt, self.views, self.p, self.g, self.t, self.lr, self.chunk)


# ------------------------------------------------------------------------------------------------ buckets
def bucket_key(slot):
    """What must agree for two small items to share a bucket (besides ``t`` and ``lr``), or ``None`` when the
    state cannot be packed (every field: ``cpu_tensors.state_key``)."""
    return cpu_tensors.state_key(slot)


class BucketPlan(cpu_tensors.PackedPlan):
    """Packed storage for one list of small items: state arenas (the slots' state arrays become views into
    them), packed param/grad buffers, and chunk views of the packed state."""

    def __init__(self, slots: list, sizes: list, chunk: int):
        self.slots = slots
        n = sum(sizes)
        dtype = slots[0].dtype
        st0 = slots[0].state
        fields = [f.name for f in dataclasses.fields(st0) if _is_np(getattr(st0, f.name))]
        arenas = {}
        for name in fields:
            arena = np.empty(n, dtype)
            views = []
            lo = 0
            for s, k in zip(slots, sizes):
                view = arena[lo:lo + k]
                view[...] = getattr(s.state, name)
                views.append(view)
                lo += k
            for s, view in zip(slots, views):
                setattr(s.state, name, view)
            arenas[name] = arena
        for s in slots:
            s.home = self
            s.chunk_views = None
        self.p = np.empty(n, dtype)
        self.g = np.empty(n, dtype)
        self.p_views = []
        lo = 0
        for k in sizes:
            self.p_views.append(self.p[lo:lo + k])
            lo += k
        self.size = n
        self.views = chunk_views(dataclasses.replace(st0, **arenas), n, chunk)
        self.chunk = chunk


class BucketTask(cpu_tensors.PackedTask):
    """Gather the params and grads of a bucket, update the packed buffers, scatter the params back."""

    __slots__ = ()

    def __call__(self) -> None:
        plan = self.plan
        np.concatenate(self.params, out=plan.p)
        np.concatenate(self.grads, out=plan.g)
        _run_views(self.opt, plan.views, plan.p, plan.g, self.t, self.lr, plan.chunk)
        copyto = np.copyto
        for dst, src in zip(self.params, plan.p_views):
            copyto(dst, src)


def _plan_for(opt, slots: list, sizes: list, chunk: int, factory=BucketPlan):
    cache = opt.plan_cache
    plans = cache.bucket_plans
    key = (chunk, *map(id, slots))  # the plan holds its slots, so these ids stay theirs
    plan = plans.get(key)
    if plan is None or not plan.valid():
        plans.pop(key, None)
        while len(plans) >= MAX_PLANS:
            plans.pop(next(iter(plans)))
        plan = plans[key] = factory(slots, sizes, chunk)
        cache.bucket_epoch += 1  # (StaticPlan.valid)
    return plan


# --------------------------------------------------------------------------------------------- the tasks
# Runs ``tasks``' list: the phases of the per-tensor algorithms' large items on the threads too (core.cpu_tensors).
run_tasks = cpu_tensors.run


def run_for(opt, tasks: list) -> None:
    """Run ``opt``'s NumPy tasks of one step: on the threads (serially when ``opt.threaded`` is False), and, when
    ``opt.blas_bound``, with the BLAS held at one thread (``core.shards``' process-wide cap, shared with every other
    holder), so that its GEMMs' bits depend neither on the BLAS thread count nor on what other threads do."""
    with shards.blas_capped(opt.blas_bound):
        run_tasks(tasks, serial=not opt.threaded)


def tasks(opt, items: list, chunk: int) -> list:
    """``(cost, name, fn)`` tasks for the NumPy ``(item, slot, lr)`` triples of one batch (state already created,
    ``t`` already advanced)."""
    entries = [Entry(i, it.name, it.param, it.grad, slot, lr, lr) for i, (it, slot, lr) in enumerate(items)]
    return [task[:3] for task in _make(opt, entries, chunk)]


def _make(opt, entries: list[Entry], chunk: int) -> list[Task]:
    """The tasks of ``entries``: items of one ``group`` value (and bucket key and ``t``) may share a bucket."""
    if not opt.elementwise:
        return _tensor_tasks(opt, entries, chunk)
    out = []
    groups: dict = {}
    for entry in entries:
        slot = entry.slot
        if entry.param.size <= SMALL and len(entries) > 1 and bucket_key(slot) is not None:
            groups.setdefault((slot.bucket_key, slot.t, entry.group), []).append(entry)
            continue
        out.extend(_large_tasks(opt, entry, chunk))
    for members in groups.values():
        if len(members) == 1:
            out.extend(_large_tasks(opt, members[0], chunk))
            continue
        start, acc = 0, 0
        for k, entry in enumerate(members):
            acc += entry.param.size
            if acc >= BUCKET or k == len(members) - 1:
                out.append(_bucket_task(opt, members[start:k + 1], chunk))
                start, acc = k + 1, 0
    return out


def _tensor_tasks(opt, entries: list[Entry], chunk: int) -> list[Task]:
    """``_make`` for a per-tensor algorithm: small items of one size share a ``cpu_tensors.RowsPlan`` when the
    algorithm has ``np_rows_fn``; every other item is a ``PhasedTask`` (with ``np_phases_fn``) or a whole task."""
    out = []
    rows = opt.np_rows_fn is not None and len(entries) > 1
    total = sum(e.param.size for e in entries)
    groups: dict = {}
    for entry in entries:
        slot, n = entry.slot, entry.param.size
        if rows and 0 < n <= SMALL and cpu_tensors.rows_key(slot) is not None:
            groups.setdefault((slot.bucket_key, n, slot.t, entry.group), []).append(entry)
        else:
            out.append(_whole_task(opt, entry, chunk, split=4 * n > total))
    for members in groups.values():
        start, acc = 0, 0
        for k, entry in enumerate(members):
            acc += entry.param.size
            if acc >= BUCKET or k == len(members) - 1:
                part = members[start:k + 1]
                out.append(_rows_task(opt, part, chunk) if len(part) > 1 else _whole_task(opt, part[0], chunk))
                start, acc = k + 1, 0
    return out


def _whole_task(opt, e: Entry, chunk: int, split: bool = False) -> Task:
    slot = e.slot
    if opt.np_phases_fn is not None:
        fn: Any = cpu_tensors.PhasedTask(opt, slot.state, e.param, e.grad, slot.t, e.lr, chunk, split)
    else:
        fn = _WholeTask(opt, slot.state, e.param, e.grad, slot.t, e.lr)
    return Task(e.param.size, e.name, fn, Refill(e.index, slot, e.group))


def _bucket_name(part: list[Entry]) -> str:
    return f"{part[0].name} .. {part[-1].name} (a bucket of {len(part)} small parameters)"


def _rows_task(opt, part: list[Entry], chunk: int) -> Task:
    e0 = part[0]
    params = [e.param for e in part]
    plan = _plan_for(opt, [e.slot for e in part], [p.size for p in params], chunk, cpu_tensors.RowsPlan)
    task = cpu_tensors.RowsTask(opt, plan, params, [e.grad for e in part], e0.slot.t, e0.lr)
    return Task(plan.size, _bucket_name(part), task, Refill([e.index for e in part], e0.slot, e0.group))


def _bucket_task(opt, part: list[Entry], chunk: int) -> Task:
    e0 = part[0]
    if len(part) == 1:
        slot, n = e0.slot, e0.param.size
        return Task(n, e0.name, RangeTask(opt, _slot_views(slot, n, chunk), e0.param, e0.grad, slot.t, e0.lr, chunk),
                    Refill(e0.index, slot, e0.group))
    params = [e.param for e in part]
    plan = _plan_for(opt, [e.slot for e in part], [p.size for p in params], chunk)
    task = BucketTask(opt, plan, params, [e.grad for e in part], e0.slot.t, e0.lr)
    return Task(plan.size, _bucket_name(part), task, Refill([e.index for e in part], e0.slot, e0.group))


def _slot_views(slot, n: int, chunk: int) -> list:
    views = slot.chunk_views
    if views is None or views[-1][1] != n or views[0][1] != min(chunk, n):  # (a changed CHUNK re-cuts them)
        views = slot.chunk_views = chunk_views(slot.state, n, chunk)
    return views


def _large_tasks(opt, e: Entry, chunk: int) -> list[Task]:
    p, g, slot, lr = e.param, e.grad, e.slot, e.lr
    n = p.size
    if opt.hooks.ranges:  # one range per task (one call of the compiled pass)
        views, per = _slot_views(slot, n, max(RANGE, chunk)), 1
    else:
        views, per = _slot_views(slot, n, chunk), max(1, TASK // chunk)
    t = slot.t
    refill = Refill(e.index, slot, e.group)
    if len(views) <= per:
        return [Task(n, e.name, RangeTask(opt, views, p, g, t, lr, chunk), refill)]
    out = []
    for k in range(0, len(views), per):
        part = views[k:k + per]
        out.append(Task(part[-1][1] - part[0][0], e.name, RangeTask(opt, part, p, g, t, lr, chunk), refill))
    return out


class StaticPlan:
    """The NumPy tasks of one batch composition, kept for the steps that repeat it (``core.step_plan``): built with
    :func:`_make` once, items grouped by lr_scale rather than lr (the same buckets whenever the base lr is not 0);
    each step only fills in the tasks' arrays, ``t`` and lr.  ``valid()`` is False once a bucket plan of another
    composition has taken over some of these slots (their state arrays moved: rebuild)."""

    def __init__(self, opt, entries: list[Entry], chunk: int):
        """``entries``: the batch's NumPy items with ``group`` = their lr_scale and ``lr`` the effective lr of it
        (state created, ``t`` advanced)."""
        made = _make(opt, entries, chunk)
        self.epoch = opt.plan_cache.bucket_epoch
        self.run_list = [task[:3] for task in made]
        self.fill = [(task.fn, task.refill) for task in made]
        for fn, _ in self.fill:
            _clear(fn)

    def valid(self, opt) -> bool:
        return opt.plan_cache.bucket_epoch == self.epoch

    def run(self, opt, params: list, grads: list) -> None:
        """One step: ``params``/``grads`` are this call's arrays in item order (``t`` already advanced)."""
        lrs = {}
        try:
            for fn, (idx, slot, scale) in self.fill:
                lr = lrs.get(scale)
                if lr is None:
                    lr = lrs[scale] = opt.hooks.effective_lr(scale)
                fn.t, fn.lr = slot.t, lr
                if type(idx) is list:
                    fn.params = [params[i] for i in idx]
                    fn.grads = [grads[i] for i in idx]
                elif type(fn) is _WholeTask or type(fn) is cpu_tensors.PhasedTask:
                    fn.st, fn.p, fn.g = slot.state, params[idx], grads[idx]
                else:
                    fn.p, fn.g = params[idx], grads[idx]
            run_for(opt, self.run_list)
        finally:
            for fn, _ in self.fill:  # hold no reference to the caller's arrays between steps
                _clear(fn)


def _clear(fn) -> None:
    if type(fn) is BucketTask or type(fn) is cpu_tensors.RowsTask:
        fn.params = fn.grads = None
    else:
        fn.p = fn.g = None


class _WholeTask:
    __slots__ = ("opt", "st", "p", "g", "t", "lr")

    def __init__(self, opt, st, p, g, t, lr):
        self.opt, self.st, self.p, self.g, self.t, self.lr = opt, st, p, g, t, lr

    def __call__(self) -> None:
        self.opt.hooks.update(np, self.st, self.p, self.g, t=self.t, lr=self.lr, scratch=[])

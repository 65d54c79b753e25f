"""The NumPy plan of the per-tensor algorithms whose step needs a whole-tensor reduction (Lamb's trust ratio, Mars's
clip of c), for ``core.cpu_plan``.

Such an algorithm (``elementwise = False``) may provide two NumPy forms of its ``update``, bit for bit the same:

* ``np_phases_fn(cfg, state, p, g, *, t, lr, chunk)``: a generator of *phases* (lists of ``(cost, fn)`` tasks over
  disjoint ranges, with the serial work between them, such as the fold of a norm, done by the generator:
  ``core.blocks``' convention).  A tensor that is not bucketed becomes a :class:`PhasedTask`.  One that holds more
  than a quarter of the batch's elements is *split*: :func:`run` runs phase k of every split tensor together with the
  batch's other tasks in one ``core.parallel.run_tasks`` call, so a large tensor uses every thread.  The others run
  their phases inline, one task each (a tensor's later sweeps then find its arrays still in the cache, which is
  faster than splitting every tensor; re-measure: ``python -m benchmarks.run --only lamb,mars``).
* ``np_rows_fn(cfg, state, P, G, *, t, lr, work)``: the update of T tensors of n elements at once: ``P``, ``G`` and
  the state's persistent arrays are (T, n) arrays whose row i is tensor i, every reduction is per row
  (``core.norms.sq_rows``), ``work`` is a dict the function may keep scratch in (it belongs to the bucket).  Small
  items of one size, dtype, ``t`` and lr (at most ``cpu_plan.SMALL`` elements) share a :class:`RowsPlan`: their
  persistent state arrays become rows of (T, n) arenas, their params and grads are gathered into packed (T, n)
  buffers, and the params scattered back; one call instead of ~40 NumPy calls per tensor.

Reductions of both forms add in the order of the serial ``update``, so the bits do not depend on the threads, the
batch, or the chunk size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from . import blocks, parallel
from .slots import persistent_fields


def state_key(slot: Any, fields: Callable[[Any], Any] = dataclasses.fields) -> Any:
    """What must agree for two small items to share packed storage (besides their size or ``t`` and lr), or
    ``None`` when the state's ``fields`` cannot be packed (an array that is not a 1-D NumPy array of the parameter's
    size and dtype, an unhashable scalar).  Cached on the slot (an optimizer always asks with the same fields)."""
    key = slot.bucket_key
    if key is None:
        n = 1
        for d in slot.shape:
            n *= d
        parts: list = [slot.dtype.str]
        for f in fields(slot.state):
            v = getattr(slot.state, f.name)
            if isinstance(v, np.ndarray):
                if v.ndim != 1 or v.size != n or v.dtype != slot.dtype:
                    key = False
                    break
                parts.append(f.name)
            elif v is not None:
                try:
                    hash(v)
                except TypeError:
                    key = False
                    break
                parts.append((f.name, v))
            else:
                parts.append((f.name, None))
        else:
            key = tuple(parts)
        slot.bucket_key = key
    return key or None


def rows_key(slot: Any) -> Any:
    """:func:`state_key` over the persistent fields: the scratch fields (``persist: False``) stay per slot."""
    return state_key(slot, persistent_fields)


class PackedPlan:
    """What every packed plan shares (this module's rows, ``cpu_plan.BucketPlan``): its slots point back at it
    (``slot.home``) while it is the storage of their state."""

    slots: list

    def valid(self) -> bool:
        return all(s.home is self for s in self.slots)


class PackedTask:
    """A task over a packed plan: gather the params and grads, update the packed buffers, scatter the params back
    (``__call__`` in the subclasses)."""

    __slots__ = ("opt", "plan", "params", "grads", "t", "lr")

    def __init__(self, opt, plan, params, grads, t, lr):
        self.opt, self.plan, self.params, self.grads, self.t, self.lr = opt, plan, params, grads, t, lr


class RowsPlan(PackedPlan):
    """Packed storage for T small items of n elements: (T, n) arenas of the persistent state arrays (each slot's
    arrays become rows of them), packed (T, n) param and grad buffers, and the algorithm's scratch (``work``)."""

    def __init__(self, slots: list, sizes: list, chunk: int):
        self.slots = slots
        t, n = len(slots), sizes[0]
        dtype = slots[0].dtype
        st0 = slots[0].state
        arenas: dict = {}
        for f in persistent_fields(st0):
            if not isinstance(getattr(st0, f.name), np.ndarray):
                continue
            arena = np.empty((t, n), dtype)
            for i, s in enumerate(slots):
                arena[i] = getattr(s.state, f.name)
            for i, s in enumerate(slots):
                setattr(s.state, f.name, arena[i])
            arenas[f.name] = arena
        scratch = {f.name: None for f in dataclasses.fields(st0) if not f.metadata.get("persist", True)}
        self.state = dataclasses.replace(st0, **scratch, **arenas)
        for s in slots:
            s.home = self
            s.chunk_views = None
        self.p = np.empty((t, n), dtype)
        self.g = np.empty((t, n), dtype)
        self.p_flat, self.g_flat = self.p.reshape(-1), self.g.reshape(-1)
        self.p_rows = list(self.p)
        self.size = t * n
        self.work: dict = {}


class RowsTask(PackedTask):
    """Gather the params and grads of a :class:`RowsPlan`, update the rows, scatter the params back."""

    __slots__ = ()

    def __call__(self) -> None:
        plan = self.plan
        np.concatenate(self.params, out=plan.p_flat)
        np.concatenate(self.grads, out=plan.g_flat)
        opt = self.opt
        opt.np_rows_fn(opt.config, plan.state, plan.p, plan.g, t=self.t, lr=self.lr, work=plan.work)
        copyto = np.copyto
        for dst, src in zip(self.params, plan.p_rows):
            copyto(dst, src)


class PhasedTask:
    """One tensor's ``np_phases_fn``: with ``split`` :func:`run` spreads each phase's tasks over the threads;
    otherwise (or called as a plain task) it runs every phase inline, one task for the whole tensor."""

    __slots__ = ("opt", "st", "p", "g", "t", "lr", "chunk", "split")

    def __init__(self, opt, st, p, g, t, lr, chunk, split=True):
        self.opt, self.st, self.p, self.g, self.t, self.lr, self.chunk = opt, st, p, g, t, lr, chunk
        self.split = split

    def phases(self) -> Any:
        opt = self.opt
        return opt.np_phases_fn(opt.config, self.st, self.p, self.g, t=self.t, lr=self.lr, chunk=self.chunk)

    def __call__(self) -> None:
        blocks.run_serial(self.phases())


def run(tasks: Sequence[tuple[int, str, Callable[[], None]]], *, serial: bool = False) -> None:
    """Run a batch's ``(cost, name, fn)`` tasks: the plain ones and the first phase of every :class:`PhasedTask` in
    one ``core.parallel.run_tasks`` call, then each later phase of the phased ones together (one barrier each)."""
    steps = [(name, fn.phases()) for _, name, fn in tasks if type(fn) is PhasedTask and fn.split]
    if not steps:
        parallel.run_tasks(tasks, serial=serial)
        return
    blocks.run_phased(steps, serial=serial, first=[task for task in tasks
                                                   if type(task[2]) is not PhasedTask or not task[2].split])

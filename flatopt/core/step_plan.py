"""The step plan: what ``step_batch`` derives from its items, built once per batch composition and re-used.

In a training loop the same buffers come back every step.  A :class:`StepPlan` records, for one batch that passed
the full validation (``PerParamOptimizer._check_items``) and whose states exist:

* the identity of the batch: the names, the normalised shapes, the ``id`` of every param and grad array (each held
  by a weak reference whose callback marks the plan dead when the array is freed, so an ``id`` cannot be re-used by
  another array while the plan is alive), and the attributes of those arrays that can change in place;
* what the full validation derived from it: the slots, each name's ``lr_scale``, the largest ``lr_scale`` per dtype;
* the execution: the NumPy tasks (``core.cpu_plan.StaticPlan``: chunks and buckets) and, on CuPy, the multi-tensor
  groups with their device tables (``core.multi_tensor.Group``) and the items left to ``core.gpu_run``.

:meth:`StepPlan.matches` decides in a few C-level passes over the items (``map``/``operator`` getters and list
comparisons, no Python loop per item) whether a new call is the same batch, re-reading what can change for the
same array object:

* NumPy arrays: ``shape``, ``strides`` and ``dtype`` (all three can be reassigned in place) of params and grads,
  and ``flags.writeable`` of params (it can be toggled); ``resize`` changes the shape (a same-size resize does not
  move the buffer).  Size, contiguity and ``ndim`` follow from shape, strides and dtype; the backend, the buffer's
  address and param/grad overlap are fixed for an array object;
* CuPy arrays: ``shape`` (CuPy's only writable one of these; ``strides``, ``dtype``, ``device`` and ``data`` are
  read-only);
* the shapes given in the items: equal to the plan's and, unless they are the very tuple objects of the last call,
  tuples of plain ``int``s (so a ``64.0`` that compares equal to ``64`` still goes through the full validation);
* ``lr_scale``: a mapping (or none) is fixed at construction; a callable is called again for every name and the
  values compared (a changed value goes through the full validation and rebuilds the plan);
* the base learning rate (``set_lr``) times the largest ``lr_scale`` of each dtype must stay finite in it;
* the configuration object and ``_lr_scale`` are the plan's (``load_state_dict``/``reset`` drop every plan).

Anything that does not match falls back to the full validation, which raises for a bad item before anything
changes, and then builds a plan (or re-uses one whose identity turns out equal).  The plan holds no reference to
the caller's arrays between calls (weak references only), so it keeps no old gradient alive.  A batch that brings
fresh gradient arrays every step cannot re-use a plan: on NumPy, once a plan was dropped without ever being re-used,
the composition runs the full path without a plan for the next ``MAX_SKIPS`` calls (then tries again); on CuPy the
plan is rebuilt every step (one table upload and allocation, still far cheaper than a launch per tensor).

Step counts: every plan step advances its slots' ``t``.  The grouping by ``t`` (buckets on NumPy, multi-tensor
groups on CuPy) is kept while the slots advance together, which :meth:`StepPlan.run` knows without looking at them
when no other step of this optimizer ran since the plan's last step; otherwise it compares their ``t`` with the
plan's and rebuilds the grouping if the differences between them changed.
"""

from __future__ import annotations

import itertools
import weakref
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from . import backend, cpu_plan, gpu_run
from . import multi_tensor as mt
from .types import OptItem

item_name, _SHAPE, _PARAM, _GRAD = (itemgetter(i) for i in range(4))
_NP_ATTRS = attrgetter("shape", "strides", "dtype")
_CP_ATTRS = attrgetter("shape")
_WRITEABLE = attrgetter("flags.writeable")
# Plans kept per optimizer (one per batch composition: e.g. the groups a router steps separately).
MAX_PLANS = 8
# A NumPy batch whose plan was never re-used (other arrays each call) runs without one for this many calls.
MAX_SKIPS = 16


def _exact_shapes(shapes: list) -> bool:
    """Every shape a tuple of plain ints (values are compared separately)."""
    return set(map(type, shapes)) <= {tuple} and set(map(type, itertools.chain.from_iterable(shapes))) <= {int}


class StepPlan:
    def __init__(self, opt, checked: list, slots: list, chunk: int):
        """``checked``: ``_check_items``' ``(item, shape, backend, scale)`` per item; ``slots``: their slots (the
        states exist); ``chunk``: the NumPy chunk size (``core.driver.CHUNK``)."""
        self.chunk = chunk
        self.hits = self.skips = 0
        self.lowered = False  # built from the working items of a batch with 16-bit buffers (core.lowp)
        items = [c[0] for c in checked]
        self.n = len(items)
        self.names = [it.name for it in items]
        self.shapes = [c[1] for c in checked]
        self.shape_objs = list(map(_SHAPE, items))
        self.shape_ids = list(map(id, self.shape_objs)) if _exact_shapes(self.shape_objs) else None
        params, grads = [it.param for it in items], [it.grad for it in items]
        self.refs = watch(self, itertools.chain(params, grads))
        self.pids, self.gids = list(map(id, params)), list(map(id, grads))
        self.numpy = [i for i, c in enumerate(checked) if c[2] == "numpy"]
        self.all_numpy = len(self.numpy) == self.n
        self.all_cupy = not self.numpy
        if self.all_cupy:
            self.attrs = list(map(_CP_ATTRS, params + grads))
        else:
            self.attrs = list(map(_NP_ATTRS, params + grads))
        self.np_params = itemgetter(*self.numpy) if len(self.numpy) > 1 else None
        self.config = opt.config
        # the driver's validated lr_scale callable and what the caller gave (the plan mirrors the driver's checks:
        # core.step_plan is the driver's own plan, the one module besides it that reads them)
        self.lr_scale_fn = opt._lr_scale  # noqa: SLF001 - see the comment above
        spec = opt._lr_scale_spec  # noqa: SLF001 - see the comment above
        self.scale_callable = spec is not None and callable(spec)
        self.scales = [c[3] for c in checked]
        self.max_scale: dict = {}
        for c in checked:
            dt = c[0].param.dtype
            self.max_scale[dt] = max(self.max_scale.get(dt, 0.0), c[3])
        self.slots = slots
        self.custom_run = opt.hooks.run
        self._build_exec(opt, params, grads)

    # ------------------------------------------------------------------------------------------ identity
    def matches(self, opt, items, names: list) -> bool:
        """Whether ``items`` (whose names are ``names``, already compared equal to the plan's) is this plan's batch,
        every check of the full validation that could change still passing (never raises for a bad item: any doubt
        is a mismatch)."""
        scale_fn = opt._lr_scale  # noqa: SLF001 - see __init__
        if self.dead or opt.config is not self.config or scale_fn is not self.lr_scale_fn:
            return False
        shapes = list(map(_SHAPE, items))
        if shapes != self.shapes:
            return False
        ids = list(map(id, shapes))
        if ids != self.shape_ids:
            if not _exact_shapes(shapes):
                return False
            self.shape_ids, self.shape_objs = ids, shapes  # (the tuples are kept: their ids stay theirs)
        params, grads = list(map(_PARAM, items)), list(map(_GRAD, items))
        if list(map(id, params)) != self.pids or list(map(id, grads)) != self.gids:
            return False
        if list(map(_CP_ATTRS if self.all_cupy else _NP_ATTRS, params + grads)) != self.attrs:
            return False
        if self.numpy:
            if self.all_numpy:
                if not all(map(_WRITEABLE, params)):
                    return False
            elif self.np_params is not None:
                if not all(map(_WRITEABLE, self.np_params(params))):
                    return False
            elif not params[self.numpy[0]].flags.writeable:
                return False
        if self.scale_callable:
            scales = list(map(self.lr_scale_fn, names))
            if scales != self.scales or bool in set(map(type, scales)):
                return False
        lr = opt.lr or 0.0
        for dt, s in self.max_scale.items():
            if not lr * s <= _DTYPE_MAX[dt]:
                return False
        self.params, self.grads = params, grads  # for run(); dropped there
        return True

    # ------------------------------------------------------------------------------------------ execution
    def _build_exec(self, opt, params: list, grads: list) -> None:
        """The NumPy tasks, the multi-tensor groups and the per-item CuPy rest, from the slots' current ``t``."""
        self.t_ref = [s.t for s in self.slots]
        self.cpu = self.groups = None
        self.gpu_rest: list = []
        if self.custom_run:
            return
        cpu_entries, gpu_items = [], []
        for i, slot in enumerate(self.slots):
            if slot.backend == "cupy":
                gpu_items.append(i)
            else:
                scale = self.scales[i]
                cpu_entries.append(cpu_plan.Entry(i, self.names[i], params[i], grads[i], slot,
                                                  opt.hooks.effective_lr(scale), scale))
        self.gpu_all = gpu_items
        if cpu_entries:  # (grouped by t: only the differences between the slots' t matter, see run())
            self.cpu = cpu_plan.StaticPlan(opt, cpu_entries, self.chunk)
        spec = opt.multi_tensor
        by_class: dict = {}
        for i in gpu_items:
            p = params[i]
            if spec is not None and p.size:
                by_class.setdefault((p.device.id, p.dtype, self.slots[i].t), []).append(i)
            else:
                self.gpu_rest.append(i)
        self.groups = []
        for (_, _, t), idx in by_class.items():
            if len(idx) == 1:
                self.gpu_rest.extend(idx)
                continue
            members = [(params[i], grads[i], self.slots[i], self.scales[i]) for i in idx]
            self.groups.append((self.slots[idx[0]], mt.Group(spec, members, mt.CHUNK)))
        self.gpu_rest.sort()
        self.epoch = opt.plan_cache.serial

    def run(self, opt, items) -> None:
        """One step of the batch ``matches`` accepted."""
        params, grads = self.params, self.grads
        self.params = self.grads = None
        slots = self.slots
        if self.custom_run:
            self.custom_run(list(zip(map(_as_item, items), slots, self.scales)))
            return
        rebuild = self.cpu is not None and not self.cpu.valid(opt)
        if not rebuild and self.epoch != opt.plan_cache.serial - 1:  # another step ran since ours
            base = self.t_ref
            d = slots[0].t - base[0]
            rebuild = any(s.t - b != d for s, b in zip(slots, base))
        if rebuild:
            self._build_exec(opt, params, grads)
        self.epoch = opt.plan_cache.serial
        for s in slots:
            s.t += 1
        if self.cpu is not None:
            self.cpu.run(opt, params, grads)
        if self.groups or self.gpu_rest:
            twin = backend.force_twin()
            rest = self.gpu_rest
            if self.groups:
                if twin:  # FLATOPT_FORCE_TWIN: every CuPy item runs its twin
                    rest = self.gpu_all
                else:
                    base_lr = opt.lr if opt.lr is not None else 0.0
                    for slot, group in self.groups:
                        group.launch(opt.config, slot.t, base_lr)
            if rest:
                gpu_run.run_gpu(opt, [(_as_item(items[i]), slots[i], opt.hooks.effective_lr(self.scales[i]))
                                      for i in rest])


def watch(plan, arrays) -> list:
    """Weak references to ``arrays`` that set ``plan.dead`` when one of them is freed (so that an ``id`` cannot be
    re-used by another array while the plan is alive); ``plan.dead`` starts False.  Keep the returned list."""
    plan.dead = False
    ref = weakref.ref(plan)

    def died(_, ref=ref):
        p = ref()
        if p is not None:
            p.dead = True

    return [weakref.ref(a, died) for a in arrays]


class DeviceTable:
    """Named int64 host arrays uploaded as one device array on the current stream when a plan is built (async,
    through CuPy's pinned staging), with a device view per name; :meth:`order` makes the current stream wait for the
    upload the first time the table is used on another stream."""

    def __init__(self, cp, parts: dict):
        stream = cp.cuda.get_current_stream()
        host = np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts.values()])
        self.table = cp.asarray(host)
        self.uploaded = stream.record()
        self.streams = {stream.ptr}
        self.views, at = {}, 0
        for name, part in parts.items():
            size = np.asarray(part).size
            self.views[name] = self.table[at:at + size]
            at += size

    def order(self, cp) -> None:
        stream = cp.cuda.get_current_stream()
        if stream.ptr not in self.streams:  # uploaded on another stream: order after it
            stream.wait_event(self.uploaded)
            self.streams.add(stream.ptr)


def _as_item(it):
    return it if type(it) is OptItem else OptItem(*it)


_DTYPE_MAX = {np.dtype(t): float(np.finfo(t).max) for t in (np.float32, np.float64)}


"""The one per-parameter driver every algorithm plugs into.

An algorithm supplies a frozen config dataclass, a per-parameter state dataclass, ``init`` and an array-agnostic
``update`` (and optionally a fused CUDA kernel).  The driver owns everything else: validation before any mutation,
the name -> state map (created lazily, recording shape, dtype and backend), the per-name step count ``t``,
``set_lr``/``lr_scale``, ``state_dict``/``load_state_dict``, chunked and threaded execution on NumPy, and the
GPU fast-path dispatch.

Per-parameter state dataclass conventions: every field is an array (NumPy or CuPy), ``None``, or a JSON scalar.
Fields whose ``dataclasses.field(metadata={"persist": False})`` are scratch and are not saved.

Devices (CuPy): a parameter's state is created on the parameter's device (``with param.device:`` around ``init``,
whatever device is current), and every step runs with the parameter's device current (``core.gpu_run``), so what an
algorithm allocates lazily (scratch, workspaces, tables) lands there too.  A parameter given on another device than
the one its state lives on is refused (``ValueError`` naming the parameter and both devices, nothing changed; a
gradient on another device than its parameter is refused by ``core.validate.check_item``): a state is never moved
from one GPU to another silently.  To move a parameter to another GPU: ``reset(name)`` (fresh state), or
``state_dict()`` then ``load_state_dict`` (a loaded state follows its parameter to its device at the next step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import re
import sys
import textwrap
import threading
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import numpy as np

from ..errors import IncompatibleStateError
from . import backend as _backend, cpu_plan, gpu_run, lowp, step_plan
from .hooks import Hooks
from .plan_cache import PlanCache
from .precision import Precision, check_precision
from . import slots as slotlib
from .slots import Slot as _Slot, config_from_dict as config_from_dict, config_to_dict as config_to_dict  # re-exported
from .slots import persistent_fields as persistent_fields  # noqa: F401 - re-exported
from .slots import is_array as _is_array
from .types import FORMAT_VERSION, Array, DecayMask, JSONDict, LrScale, OptimizerState, OptItem
from .validate import as_item as _as_item, check_batch_aliasing, check_item, check_items_arg, check_lr
from .validate import check_snapshot, check_snapshot_fields

# Elementwise algorithms process NumPy buffers in chunks of this many elements, so that all the temporaries of
# one chunk stay near the core (and the chunks can be spread over threads); much shorter chunks make two threads
# hand NumPy's GIL to each other too often, much longer ones leave the cache.  128K is the better or an equal choice
# with two threads, the default.  Re-measure: ``python -m benchmarks.threads_probe sizes`` (64K against 128K; the
# figures are in benchmarks/README.md).  The bits do not depend on it (elementwise passes; the norms' sums
# keep core.blocks' own order).  A compiled CPU pass (core/native.py) that streams each array once takes longer
# ranges instead (``Hooks.ranges``, core.cpu_plan.RANGE); a hand-written one takes these chunks, one call each.
# core/cpu_plan.py turns a batch into tasks (chunked large items, bucketed small ones).
CHUNK = 1 << 17

# The largest finite value of each parameter dtype: the effective learning rate must be finite in it.
_DTYPE_MAX = {np.dtype(t): float(np.finfo(t).max) for t in (np.float32, np.float64)}


class PerParamOptimizer:
    """Base class of the optimizers whose parameters are updated independently (SGD, AdamW, Adafactor,
    Adafactor8Bit, KronPsgd, Muon): it implements the ``flatopt.Optimizer`` protocol once — validation before
    mutation, lazy name-keyed state with a step count per name, ``set_lr``/``lr_scale``, ``state_dict`` /
    ``load_state_dict``, threads on NumPy and the fused-kernel dispatch on CuPy — around an algorithm's update.

    Subclasses set ``algorithm`` (a stable id), ``config_cls``, ``init_fn`` and ``update_fn`` (optionally
    ``kernel_fn``), and change anything else the driver does for them through ``self.hooks`` (``core.hooks``);
    elementwise algorithms set ``elementwise = True`` and then receive contiguous chunks of the
    param, grad and state arrays plus chunk-sized scratch buffers.  ``matters`` lists the config fields that must
    agree for a snapshot to load (everything else is a hyper-parameter the current object keeps).
    """

    algorithm: ClassVar[str]
    config_cls: ClassVar[type]
    elementwise: ClassVar[bool] = False
    scratch_buffers: ClassVar[int] = 0  # chunk-sized scratch buffers an elementwise update needs
    matters: ClassVar[tuple[str, ...]] = ()
    threaded: ClassVar[bool] = True  # False: step_batch runs items serially (e.g. BLAS already uses the cores)
    # True: the NumPy steps are BLAS-bound (GEMMs, LAPACK) and run with the BLAS held at one thread in every mode
    # (core.shards' cap), so that their bits do not depend on the BLAS thread count or on other threads' work
    blas_bound: ClassVar[bool] = False
    multi_tensor: ClassVar[Any] = None  # core.multi_tensor.MultiTensor: one CuPy launch for many tensors
    # NumPy forms of a per-tensor update (core/cpu_tensors.py): phases for the threads, rows for buckets of small items
    np_phases_fn: ClassVar[Callable[..., Any] | None] = None
    np_rows_fn: ClassVar[Callable[..., None] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__doc__")
        # help(cls): the class's signature line, then its module's update rule and defaults, then the shared arguments
        if own and re.search(r"module\s+doc", own):
            cls.__doc__ = class_doc(cls, own, has_decay=any(f.name == "weight_decay"
                                                              for f in dataclasses.fields(cls.config_cls)))

    def __init__(self, config: Any, *, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        self.config = config
        # the precision policy (core.precision) and the 16-bit names' write-back records (core.lowp)
        self.precision = check_precision(precision)
        self._lowp: dict[str, lowp.LowParam] = {}
        # True: a float32/float64 parameter under another write-back than "nearest" is stepped as it is (exact)
        # instead of refused (Adafactor8Bit's stochastic_round_writeback, as the original)
        self._plain_writeback_exact = False
        # name -> the index, in the whole parameter, of element 0 of the buffers given for it (a rank of
        # flatopt.distributed steps a range of a parameter): the stochastic write-back draws by that global index
        self.element_offsets: dict[str, int] = {}
        self._lr = float(config.lr) if getattr(config, "lr", None) is not None else None
        self._slots: dict[str, _Slot] = {}
        self._lr_scale = _make_lr_scale(lr_scale)
        self._lr_scale_spec = lr_scale
        self._decay = _make_decay_mask(weight_decay_mask, config, type(self).__name__)
        self._decay_spec = weight_decay_mask
        self._no_decay: tuple[Any, Any] | None = None  # (config, the same with weight_decay 0)
        self.iteration = 0
        self.last_load_notes: list[str] = []
        self._lock = threading.RLock()
        self.plan_cache = PlanCache()  # every plan and cache derived from batches (core.plan_cache)
        # the extension points (core.hooks): an algorithm replaces fields in its __init__, never a driver method
        self.hooks: Hooks[Any] = Hooks(init=self._init_named, update=self._update, effective_lr=self._effective_lr,
                                       kernel_update=self._kernel_update, check_shape=self._check_shape,
                                       ranges=getattr(getattr(type(self), "update_fn", None), "takes_ranges", False))

    # ----------------------------------------------------------------------------------------------- hooks
    # An algorithm module provides ``init(xp, cfg, shape, dtype) -> State``, the array-agnostic
    # ``update(xp, cfg, state, param, grad, *, t, lr, scratch)`` and optionally the fused CUDA
    # ``kernel_update(cfg, state, param, grad, *, t, lr) -> bool`` (False: use the twin); the class binds them.
    # The methods below are the driver's defaults of ``self.hooks`` (core.hooks): the driver calls the hooks.
    init_fn: ClassVar[Callable[..., Any]]
    update_fn: ClassVar[Callable[..., None]]
    kernel_fn: ClassVar[Callable[..., bool] | None] = None

    def _init(self, xp: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        return type(self).init_fn(xp, self.config, shape, dtype)

    def _init_named(self, name: str, xp: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """Fresh state for parameter ``name`` (the default ``hooks.init``: ``_init``)."""
        return self._init(xp, shape, dtype)

    def _update(self, xp: Any, state: Any, param: Array, grad: Array, *, t: int, lr: float,
                scratch: list[Array]) -> None:
        type(self).update_fn(xp, self.config, state, param, grad, t=t, lr=lr, scratch=scratch)

    def _kernel_update(self, state: Any, param: Array, grad: Array, *, t: int, lr: float) -> bool:
        kernel = type(self).kernel_fn
        return kernel is not None and kernel(self.config, state, param, grad, t=t, lr=lr)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise for a shape the algorithm cannot handle (before anything is touched)."""

    def _extra_state(self) -> JSONDict:
        return {}

    def _check_extra(self, extra: JSONDict) -> None:
        """Raise (``TypeError``/``ValueError``/:class:`IncompatibleStateError`, naming the field) when a snapshot's
        ``extra`` (without the driver's ``lr``) is not what ``_load_extra`` takes; called before anything changes."""

    def _load_extra(self, extra: JSONDict) -> None:
        """Install the optimizer-wide state of a snapshot that passed ``_check_extra`` (must not fail)."""

    # ------------------------------------------------------------------------------------------ public API
    @property
    def lr(self) -> float | None:
        """The base learning rate (``None`` where the algorithm derives its own, e.g. Adafactor's relative step)."""
        return self._lr

    def set_lr(self, lr: float) -> None:
        """Set the base learning rate used from the next step on (``lr_scale(name)`` still multiplies it)."""
        self._lr = check_lr(lr)

    def lr_scale(self, name: str) -> float:
        """The learning-rate multiplier of ``name``: from the ``lr_scale=`` mapping (missing names: 1.0) or
        callable given at construction; 1.0 without one."""
        return self._lr_scale(name)

    def decays(self, name: str) -> bool:
        """Whether ``name`` gets weight decay: from the ``weight_decay_mask=`` mapping (missing names: True) or
        callable given at construction; True without one.  An excluded name steps exactly as with
        ``weight_decay=0``."""
        return self._decay is None or _decays(self._decay, name)

    def end_iteration(self) -> None:
        """Count one training iteration (saved in ``state_dict``); per-name step counts advance inside ``step``."""
        self.iteration += 1

    def step(self, name: str, shape: tuple[int, ...], param: Array, grad: Array) -> None:
        """Update ``param`` (flat, contiguous, ``prod(shape)`` elements, float16/bfloat16/float32/float64) in place
        from ``grad`` (same size and backend, any of these dtypes; never written; 16-bit buffers: ``core.lowp``).
        Bad input raises ``ValueError``/``TypeError`` naming the parameter, with nothing changed.  The same as
        ``step_batch([OptItem(name, shape, param, grad)])``."""
        self.step_batch([OptItem(name, shape, param, grad)])

    def step_batch(self, items: Sequence[OptItem]) -> None:
        """Update every item's parameter in place: bit for bit what ``step`` on each item in order gives.

        Every item is validated before any buffer or state changes; the same name twice is an error.  On NumPy
        large items are split in cache-sized chunks and spread over threads and small ones are bucketed; on CuPy
        the fused kernels run without host synchronisation.  Thread-safe: one optimizer's calls are serialised."""
        with self._lock:
            if type(items) is not list:
                items = check_items_arg(items, type(self).__name__)
            if self._decay is not None:
                self._step_masked(items)
            else:
                self._step_batch(items)

    def _step_masked(self, items: Sequence[OptItem]) -> None:
        """``step_batch`` under a ``weight_decay_mask``: the excluded names step as one sub-batch with this config's
        ``weight_decay`` set to 0 (every path reads ``self.config`` while it runs: NumPy, the compiled pass, the CUDA
        kernels and multi-tensor launches), the others as another with it unchanged; the whole batch is validated
        first.  Items are independent, so the bits are those of ``step`` on each item in order."""
        try:
            names = [step_plan.item_name(it) for it in items]
            if not all(type(n) is str for n in names):
                raise TypeError
        except Exception:  # noqa: BLE001 - a malformed item: the validation says what is wrong
            self.validate_batch(items)
            raise
        flags = [_decays(self._decay, n) for n in names]
        if all(flags):
            self._step_batch(items)
            return
        if any(flags):
            self.validate_batch(items)
            self._step_batch([it for it, f in zip(items, flags) if f])
        with self._without_decay():
            self._step_batch([it for it, f in zip(items, flags) if not f])

    @contextlib.contextmanager
    def _without_decay(self) -> Iterator[None]:
        """``self.config`` with ``weight_decay = 0`` inside the block (under ``self._lock``)."""
        saved = self.config
        if self._no_decay is None or self._no_decay[0] is not saved:
            self._no_decay = (saved, dataclasses.replace(saved, weight_decay=0.0))
        self.config = self._no_decay[1]
        try:
            yield
        finally:
            self.config = saved

    def _step_batch(self, items: Sequence[OptItem], lowered: bool = False) -> None:
        """``step_batch`` of ``items`` (a list or tuple) under ``self._lock``; a batch with 16-bit buffers or mixed
        gradients runs as its float32/float64 working items (``core.lowp``; ``lowered``: these are they).  A cached
        plan is only ever built from, and matches, working or plain items."""
        self.plan_cache.serial += 1
        plan = self._find_plan(items, lowered)
        if plan is None and not lowered and lowp.needed(self, items):
            lowp.step(self, items, functools.partial(self._step_batch, lowered=True))
            return
        if plan is None:
            if not self._plannable:
                prepared = (self.hooks.prepare or self._prepare)(items)
                if prepared:
                    self._execute(prepared)
                return
            checked = self._check_items(items)
            prepared = self._create_states(checked)
            if not prepared:
                return
            plan = self._plan_for(checked, prepared)
            if plan is None:
                self._execute(prepared)
                return
            plan.lowered = lowered
            plan.params = [c[0].param for c in checked]
            plan.grads = [c[0].grad for c in checked]
        plan.run(self, items)

    # ------------------------------------------------------------------------------------------ step plans
    @property
    def _plannable(self) -> bool:
        """Whether batches may be cached as step plans (``core.step_plan``): the driver's own validation and
        preparation (no ``hooks.prepare``), which the plan's checks mirror."""
        return self.hooks.prepare is None

    def _execute(self, prepared: list[Any]) -> None:
        """Run the prepared ``(item, slot, lr_scale)`` entries: ``hooks.run`` where the algorithm replaced the
        driver's execution, else ``_run``."""
        (self.hooks.run or self._run)(prepared)

    def _find_plan(self, items: Sequence[Any], lowered: bool = False) -> Any:
        """The cached plan ``items`` repeat, or ``None`` (then the full path runs); ``lowered``: of working items
        (``core.lowp``), whose plans the caller's own items never match, nor the reverse."""
        plans = self.plan_cache.step_plans
        if not plans or len(items) < 2:
            return None
        try:
            names = list(map(step_plan.item_name, items))
            plan = plans.get(tuple(names))
            if plan is not None and plan.lowered == lowered and plan.matches(self, items, names):
                plan.hits += 1
                return plan
        except Exception:  # noqa: BLE001 - a malformed item: the full validation says what is wrong
            return None
        return None

    def _plan_for(self, checked: list[Any], prepared: list[Any]) -> Any:
        """A plan for the batch that just passed validation (re-used when an equal one exists), or ``None``."""
        if len(checked) < 2 or not self._plannable:
            return None
        plans = self.plan_cache.step_plans
        key = tuple(c[0].name for c in checked)
        old = plans.pop(key, None)
        if old is not None and not old.hits and not old.groups and old.skips < step_plan.MAX_SKIPS:
            # this composition came back with other arrays before its plan was ever re-used (e.g. fresh gradient
            # arrays every step): on NumPy a plan would cost more than it saves; try again after MAX_SKIPS calls
            # (on CuPy a new table is still far cheaper than a launch per tensor)
            old.skips += 1
            plans[key] = old
            return None
        while len(plans) >= step_plan.MAX_PLANS:
            plans.pop(next(iter(plans)))
        plan = plans[key] = step_plan.StepPlan(self, checked, [p[1] for p in prepared], CHUNK)
        return plan

    def _forget_plans(self) -> None:
        self.plan_cache.forget()

    def reset(self, name: str) -> None:
        """Forget the state of ``name`` (its next step starts from fresh state, e.g. after a shape change)."""
        with self._lock:
            self._slots.pop(name, None)
            self._lowp.pop(name, None)
            self._forget_plans()

    def state_names(self) -> list[str]:
        """The names that have state (stepped at least once), sorted.  Thread-safe (waits for a running step)."""
        with self._lock:
            return sorted(self._slots)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held (persistent arrays).  Thread-safe (waits for a running step)."""
        with self._lock:
            total = 0
            for slot in self._slots.values():
                for f in persistent_fields(slot.state):
                    v = getattr(slot.state, f.name)
                    if _is_array(v):
                        total += v.nbytes
            return total + lowp.nbytes(self)

    # --------------------------------------------------------------------------------------- preparation
    def _check_items(self, items: Sequence[OptItem]) -> list[Any]:
        """Validate every item (nothing is touched); return ``(item, shape, backend, lr_scale)`` per item."""
        items = [it if isinstance(it, OptItem) else _as_item(i, it) for i, it in enumerate(items)]
        seen: set[str] = set()
        checked = []
        for it in items:
            shape, backend = check_item(it.name, it.shape, it.param, it.grad)
            if it.name in seen:
                raise ValueError(f"parameter {it.name!r} appears twice in one step_batch")
            seen.add(it.name)
            slot = self._slots.get(it.name)
            if slot is not None:
                if slot.shape != shape:
                    raise ValueError(
                        f"parameter {it.name!r}: shape {shape} differs from the shape {slot.shape} its state was "
                        f"created with (call reset({it.name!r}) to start it afresh)"
                    )
                if slot.dtype != it.param.dtype:
                    raise TypeError(
                        f"parameter {it.name!r}: dtype {it.param.dtype} differs from the dtype {slot.dtype} its "
                        f"state was created with"
                    )
                if slot.pinned and slot.backend != backend:
                    raise TypeError(f"parameter {it.name!r}: state lives on {slot.backend}, got {backend} arrays")
                if slot.pinned and slot.device is not None and it.param.device.id != slot.device:
                    raise ValueError(
                        f"parameter {it.name!r}: the parameter is on GPU {it.param.device.id}, its state lives on GPU "
                        f"{slot.device} (states are not moved between GPUs: reset({it.name!r}) to start afresh, "
                        f"or load a state_dict)")
            self.hooks.check_shape(it.name, shape)
            scale = self._lr_scale(it.name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not (
                math.isfinite(scale) and math.copysign(1.0, scale) > 0  # (>= 0, and not -0.0: see check_lr)
            ):
                raise ValueError(f"parameter {it.name!r}: lr_scale must be finite and >= 0 (not -0.0), got {scale!r}")
            if not (self._lr or 0.0) * scale <= _DTYPE_MAX[it.param.dtype]:
                raise ValueError(f"parameter {it.name!r}: lr · lr_scale = {self._lr!r} · {scale!r} is not finite "
                                 f"in {it.param.dtype}")
            checked.append((it, shape, backend, float(scale)))
        if len(checked) > 1:
            check_batch_aliasing([c[0] for c in checked], self.plan_cache.alias)
        return checked

    def validate_batch(self, items: Sequence[OptItem]) -> None:
        """Raise what ``step_batch(items)`` would raise for bad input, changing nothing (routers use it to
        validate every group before any group mutates)."""
        with self._lock:
            if type(items) is not list:
                items = check_items_arg(items, type(self).__name__)
            plan = self._find_plan(items)
            if plan is not None:
                plan.params = plan.grads = None
                return
            if lowp.needed(self, items):
                lowp.validate(self, items, self._check_items)
                return
            self._check_items(items)

    def _prepare(self, items: Sequence[OptItem]) -> list[Any]:
        """Validate every item, then create missing states serially (in item order)."""
        return self._create_states(self._check_items(items))

    def _create_states(self, checked: list[Any]) -> list[Any]:
        """``(item, slot, scale)`` per ``_check_items`` entry, creating missing states serially (in item order)."""
        prepared = []
        for it, shape, backend, scale in checked:
            slot = self._slots.get(it.name)
            if slot is None:
                slot = self._new_slot(it.name, shape, it.param, backend)
            elif not slot.pinned:
                self._move_state(slot, it.param)
            prepared.append((it, slot, scale))
        return prepared

    def _new_slot(self, name: str, shape: tuple[int, ...], like: Array, backend: str) -> _Slot:
        """A fresh slot for ``name`` whose state is created on ``like``'s device (its backend ``backend``)."""
        xp = _backend.array_module(like)
        on_gpu = backend == "cupy"
        with like.device if on_gpu else contextlib.nullcontext():
            state = self.hooks.init(name, xp, shape, like.dtype)
        slot = self._slots[name] = _Slot(shape, like.dtype, backend, 0, state,
                                         device=like.device.id if on_gpu else None)
        return slot

    def _move_state(self, slot: _Slot, like: Array) -> None:
        for f in dataclasses.fields(slot.state):
            v = getattr(slot.state, f.name)
            if _is_array(v):
                setattr(slot.state, f.name, _backend.to_backend(v, like))
        slot.backend = _backend.backend_name(like)
        slot.device = like.device.id if slot.backend == "cupy" else None
        slot.pinned = True
        slot.chunk_views = None
        slot.home = None
        slot.bucket_key = None

    # ------------------------------------------------------------------------------------------ execution
    def _effective_lr(self, scale: float) -> float:
        return (self._lr if self._lr is not None else 0.0) * scale

    def _run(self, prepared: list[Any]) -> None:
        """The driver's execution (``hooks.run`` replaces it; a replacement may still call it)."""
        cpu: list[Any] = []
        gpu: list[Any] = []
        effective_lr = self.hooks.effective_lr
        for it, slot, scale in prepared:
            slot.t += 1
            lr = effective_lr(scale)
            if slot.backend == "cupy":
                gpu.append((it, slot, lr))
            else:
                cpu.append((it, slot, lr))
        if cpu:
            # chunked large items, bucketed small ones: see core/cpu_plan.py
            cpu_plan.run_for(self, cpu_plan.tasks(self, cpu, CHUNK))
        if gpu:
            gpu_run.run_gpu(self, gpu)

    # ---------------------------------------------------------------------------------------- checkpoints
    def _config_key(self) -> JSONDict:
        d = config_to_dict(self.config)
        return {k: d[k] for k in self.matters}

    def _config_dict(self) -> JSONDict:
        d = config_to_dict(self.config)
        if "lr" in d:
            d["lr"] = self._lr
        return d

    def state_dict(self) -> OptimizerState:
        """A complete snapshot (arrays copied, on the backend they live on); ``extra["lr"]`` is the learning rate in
        effect (what ``set_lr`` last set), training state that ``load_state_dict`` restores."""
        with self._lock:
            params, buffers = slotlib.snapshot(self._slots)
            extra = self._extra_state()
            if self._lr is not None:
                extra = {**extra, "lr": self._lr}
            return lowp.to_snapshot(self, OptimizerState(
                algorithm=self.algorithm,
                config=self._config_dict(),
                config_key=self._config_key(),
                step=self.iteration,
                params=params,
                buffers=buffers,
                extra=extra,
            ))

    def load_state_dict(self, state: OptimizerState, *, restore_hparams: bool = False, strict: bool = False) -> bool:
        """Restore a snapshot exactly, or return ``False`` with nothing changed when it belongs to another
        algorithm, format version, a configuration that matters, holds a state that does not fit, or is malformed
        in any field (a wrong type or range: nothing is converted); the reason (naming the parameter or field) is
        then ``last_load_notes[0]``, and ``strict=True`` raises it as :class:`~flatopt.errors.IncompatibleStateError`
        instead.  A path or a dict is a ``TypeError`` (read files with ``flatopt.load``).

        The learning rate in effect when the snapshot was taken (what ``set_lr`` last set, ``extra["lr"]``) is
        training state and is restored, as are the step counts and every algorithm's counters.  Constructor
        hyper-parameters that differ (betas, weight decay, ...) stay those of this object unless
        ``restore_hparams``; ``last_load_notes`` says what differed and what was kept or restored.  A snapshot
        without ``extra["lr"]`` (written before it was recorded) leaves the learning rate as it is (a note says
        so when the snapshot's configuration had another one), unless ``restore_hparams``."""
        check_snapshot(state, type(self).__name__)
        with self._lock:
            try:
                check_origin(state, self.algorithm)
                check_snapshot_fields(state)
                state, low = lowp.from_snapshot(self, state)  # the 16-bit names' records apart (core.lowp)
                extra = {k: v for k, v in state.extra.items() if k != "lr"}
                try:
                    self._check_extra(extra)
                except (TypeError, ValueError) as exc:
                    raise IncompatibleStateError(f"snapshot field 'extra': {exc}") from None
                slots, notes = self._build_from_state(state)
                config, lr, notes = self._hparams_from_state(state, notes, restore_hparams)
            except IncompatibleStateError as exc:
                self.last_load_notes = [str(exc)]
                if strict:
                    raise
                return False
            # everything checked: install it all (nothing below can fail)
            self.config = config
            self._lr = lr
            self._slots = slots
            self._lowp = low
            self._forget_plans()
            self.iteration = int(state.step)
            self._load_extra(extra)
            self.last_load_notes = notes
            return True

    def _hparams_from_state(self, state: OptimizerState, notes: list[str],
                            restore_hparams: bool) -> tuple[Any, float | None, list[str]]:
        """``(config, lr, notes)`` a load installs (nothing changed): the snapshot's lr in effect where recorded;
        with ``restore_hparams`` the snapshot's configuration too; :class:`IncompatibleStateError` for a
        configuration this algorithm refuses."""
        config, lr = self.config, self._lr
        recorded = "lr" in state.extra
        if restore_hparams:
            try:
                config = config_from_dict(self.config_cls, state.config)
                if not recorded:
                    lr = state.config.get("lr", lr)
                    lr = None if lr is None else check_lr(lr, "snapshot config['lr']")
            except (TypeError, ValueError) as exc:
                raise IncompatibleStateError(f"snapshot field 'config' does not make a "
                                             f"{self.config_cls.__name__}: {exc}") from None
            if getattr(config, "cautious", None) != getattr(self.config, "cautious", None):
                # bound at construction (core/elementwise/run.py `configure`): kept, like a field that matters
                config = dataclasses.replace(config, cautious=self.config.cautious)
                was = state.config.get("cautious", False)
                notes = [*(n for n in notes if not n.startswith("cautious: ")),
                         f"cautious: kept {self.config.cautious!r} (snapshot had {was!r}; fixed at construction)"]
            cur = self._config_dict()
            differ = {k: v for k, v in state.config.items() if k in cur and cur[k] != v and k != "cautious"}
            notes = [n for n in notes if not any(n.startswith(f"{k}: kept ") for k in differ)] + [
                f"{k}: restored {v!r} from the snapshot (this object had {cur[k]!r})" for k, v in differ.items()]
        if recorded:
            lr = float(state.extra["lr"])
            notes = [n for n in notes if not n.startswith("lr: ")]
            if lr != self._lr:
                notes.append(f"lr: set to {lr!r}, the learning rate in effect when the snapshot was taken (this "
                             f"object had {self._lr!r})")
        return config, lr, notes

    def _build_from_state(self, state: OptimizerState) -> tuple[dict[str, _Slot], list[str]]:
        """``(slots, notes)`` for ``state``, changing nothing; :class:`IncompatibleStateError` when it does not fit."""
        check_compatible(state, self.algorithm, self._config_key())
        slots = slotlib.restore(state.params, state.buffers,
                               lambda name, shape, dtype: self.hooks.init(name, np, shape, dtype),
                               self.hooks.check_shape)
        cur = self._config_dict()
        notes = [
            f"{k}: kept {cur[k]!r} (snapshot had {v!r})" for k, v in state.config.items() if k in cur and cur[k] != v
        ]
        return slots, notes


def check_origin(state: OptimizerState, algorithm: str) -> None:
    """:class:`IncompatibleStateError` when ``state`` is of another algorithm or format version."""
    if state.algorithm != algorithm:
        raise IncompatibleStateError(f"the snapshot is of algorithm {state.algorithm!r}, this optimizer is "
                                     f"{algorithm!r}")
    if state.format_version != FORMAT_VERSION:
        raise IncompatibleStateError(f"the snapshot has format version {state.format_version!r}, this flatopt "
                                     f"reads {FORMAT_VERSION}")


def check_compatible(state: OptimizerState, algorithm: str, config_key: Any) -> None:
    """:class:`IncompatibleStateError` when ``state`` is of another algorithm or format version, or its config key
    (the configuration fields that matter) differs from ``config_key`` (the message names each field)."""
    check_origin(state, algorithm)
    theirs = state.config_key
    if theirs != config_key:
        if isinstance(theirs, Mapping) and isinstance(config_key, Mapping):
            diff = [f"{k!r} (snapshot {theirs.get(k, '<absent>')!r}, here {config_key.get(k, '<absent>')!r})"
                    for k in sorted(set(theirs) | set(config_key), key=str) if theirs.get(k) != config_key.get(k)]
        else:
            diff = [f"(snapshot {theirs!r}, here {config_key!r})"]
        raise IncompatibleStateError("the configuration that decides the state's layout differs: config field "
                                     + "; ".join(diff))


COMMON_KEYWORDS = ("lr_scale", "weight_decay_mask", "precision")  # every optimizer's, described by _COMMON_ARGS
_COMMON_ARGS = (
    "Keyword arguments of every optimizer: ``lr_scale`` (default None: 1.0 for every name), a mapping name -> "
    "float (names not in it: 1.0) or a callable name -> float that multiplies the learning rate of that "
    "parameter.{decay}  Both are construction configuration, checked when given and not saved in checkpoints.  "
    "``precision`` (default None: ``flatopt.Precision()``, round-to-nearest write-back of float16/bfloat16 "
    "parameters, float32 states) is the precision policy (``flatopt.Precision``: ``writeback`` 'nearest', "
    "'stochastic', 'kahan' or 'master', ``state``, ``seed``), the same for every optimizer; it is recorded in "
    "checkpoints, and a snapshot of another policy is refused."
)
_DECAY_ARG = (
    "  ``weight_decay_mask`` (default None: every name decays), a mapping name -> bool (names not in it: True) or "
    "a callable name -> bool; a name it excludes steps exactly as with ``weight_decay=0`` (no decay on biases "
    "and norms: ``weight_decay_mask=lambda n: not n.endswith('.bias')``)."
)


def class_doc(cls: type, own: str, *, has_decay: bool) -> str:
    """``cls``'s docstring for ``help()``: its own (the signature line that points at the module doc; a leading
    ````Name(...)```` is replaced by :func:`signature_line`, so that the defaults are written once, in the config
    the constructor's defaults refer to), then its module's docstring (the update rule, the deviations), then the
    keyword arguments every optimizer shares."""
    module = sys.modules.get(cls.__module__)
    text = inspect.cleandoc(getattr(module, "__doc__", None) or "")
    common = textwrap.fill(_COMMON_ARGS.format(decay=_DECAY_ARG if has_decay else ""), 116)
    own = re.sub(r"see the\s+module\s+doc(string)?", "see below", inspect.cleandoc(own))
    head = f"``{cls.__name__}("
    first, _, rest = own.partition("\n\n")
    if first.startswith(head) and ")``" in first:
        first = f"``{signature_line(cls)}``" + first[first.index(")``") + 3:]
        own = "\n\n".join(part for part in (textwrap.fill(first.replace("\n", " "), 116), rest) if part)
    return "\n\n".join(part for part in (own, text, common) if part)


def signature_line(cls: type) -> str:
    """``Name(arg=default, ..., *, kw=default, **rest)`` from ``cls``'s constructor, without the keyword arguments
    every optimizer shares (``lr_scale``, ``weight_decay_mask``, ``precision``: described after it)."""
    parts: list[str] = []
    star = False
    for p in list(inspect.signature(cls).parameters.values()):
        if p.name in COMMON_KEYWORDS:
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"{cls.__name__}({', '.join(parts)})"


def _make_decay_mask(spec: DecayMask, config: Any, owner: str) -> Any:
    """The validated ``weight_decay_mask``: ``None``, a dict name -> bool, or a callable."""
    if spec is None:
        return None
    if not any(f.name == "weight_decay" for f in dataclasses.fields(config)):
        raise TypeError(f"{owner} has no weight_decay: weight_decay_mask does not apply")
    if isinstance(spec, Mapping):
        table = {}
        for k, v in spec.items():
            if not isinstance(k, str):
                raise TypeError(f"weight_decay_mask: names must be str, got {k!r}")
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"weight_decay_mask[{k!r}] must be a bool (True: decay), got {v!r}")
            table[k] = bool(v)
        return table
    if callable(spec):
        return spec
    raise TypeError(f"weight_decay_mask must be a mapping name -> bool or a callable, got {type(spec).__name__}")


def _decays(mask: Any, name: str) -> bool:
    """Whether ``mask`` (from ``_make_decay_mask``, not None) lets ``name`` decay."""
    if type(mask) is dict:
        return bool(mask.get(name, True))
    out = mask(name)
    if not isinstance(out, (bool, np.bool_)):
        raise TypeError(f"parameter {name!r}: weight_decay_mask returned {out!r}, not a bool")
    return bool(out)


def _make_lr_scale(spec: LrScale) -> Callable[[str], float]:
    if spec is None:
        return lambda name: 1.0
    if callable(spec):
        return spec
    if isinstance(spec, Mapping):
        table = {}
        for k, v in spec.items():
            table[str(k)] = check_lr(v, f"lr_scale[{k!r}]")
        return lambda name: table.get(name, 1.0)
    raise TypeError(f"lr_scale must be a mapping name -> float or a callable, got {type(spec).__name__}")

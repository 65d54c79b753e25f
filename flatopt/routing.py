"""Routing parameters to sub-optimizers by name (and shape): one reusable composition piece.

A :class:`Router` holds named :class:`Group` s, each an optimizer plus a :class:`Select` or (explicit names, glob
patterns, or a predicate on ``(name, shape)``).  The **first** group whose selector matches a parameter owns it;
a parameter that no group matches is an error (add a catch-all group, ``Select.all()``, as the last one to route
"everything else").  The router is itself an :class:`flatopt.Optimizer`::

    from flatopt import AdamW, Muon
    from flatopt.routing import Group, Router, Select
    opt = Router([
        Group("muon", Muon(lr=0.02), Select(names=["h0.w", "h1.w"])),
        Group("adamw", AdamW(lr=3e-4), Select.all(), lr_ratio=0.015),
    ])
    opt.step_batch(items)          # every item checked against every group first, then each group steps

Semantics
---------
* ``step_batch(items)`` first validates **every** item against **every** group (duplicate names, overlapping
  buffers across groups, unrouted names, and each group's own ``validate_batch``), and only then lets the groups
  mutate: one bad item leaves all groups and all buffers untouched.  Group optimizers must provide
  ``validate_batch(items)`` (every :class:`flatopt.PerParamOptimizer` does) that raises what their ``step_batch``
  would raise for bad input and changes nothing.
* With ``concurrent=True`` the groups' ``step_batch`` run at the same time on threads (the router's own pool,
  separate from the element pool, so nesting cannot deadlock) when at least two groups have enough work
  (``cost``); groups touch disjoint parameters and state, so the result is bit-identical to the serial loop.
  CuPy batches run serially on the calling thread (one host thread keeps a GPU busy; each group's driver uses its
  own streams).
* ``set_lr(lr)`` sets each group's lr to ``lr · lr_ratio`` (groups with ``lr_ratio=None`` keep theirs);
  ``step_batch(items, lrs={"group": lr})`` overrides lrs for one call only.  ``lr_scale(name)`` is the owning
  group's.  ``end_iteration()`` reaches every group.
* ``state_dict()`` combines the groups' snapshots into one versioned :class:`flatopt.OptimizerState`: buffers are
  ``"<group>.<slot>/<name>"``, ``params[name]["group"]`` records the owner, ``extra["groups"]`` each group's
  algorithm/config/step/extra, and ``config_key`` the grouping (group names, algorithms, selector descriptions
  and the groups' own keys).  ``load_state_dict`` returns ``False`` and changes nothing for another grouping (or
  a parameter this router would send to another group), then loads the groups one by one and rolls back the ones
  already loaded if a later one refuses.  ``try_load_state_dict`` raises :class:`IncompatibleState` with the reason.
"""

from __future__ import annotations

import fnmatch
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .core import backend, parallel
from .core.types import FORMAT_VERSION, Array, JSONDict, OptimizerState, OptItem
from .core.validate import as_item, check_batch_aliasing, check_items_arg, check_lr, check_shape, check_snapshot
from .core.validate import check_snapshot_fields
from .errors import IncompatibleStateError

__all__ = ["Group", "IncompatibleState", "Router", "RoutingError", "Select"]


class RoutingError(ValueError):
    """A parameter no group selects, a duplicate name, or an invalid router definition."""


class IncompatibleState(IncompatibleStateError):
    """A snapshot that does not belong to this router (another grouping, group algorithm or configuration); an
    :class:`flatopt.errors.IncompatibleStateError` (hence a ``ValueError``)."""


class Select:
    """Which parameters a group takes: explicit ``names``, glob ``patterns`` (``fnmatch``, case-sensitive), and/or a
    ``predicate(name, shape) -> bool``; a parameter matches if any of the given criteria matches.  A predicate is
    code, so give it a stable ``description``: it goes into the checkpoint key (a different description refuses
    to load)."""

    def __init__(self, names: Sequence[str] = (), patterns: Sequence[str] = (),
                 predicate: Callable[[str, tuple[int, ...]], bool] | None = None, description: str | None = None,
                 *, everything: bool = False) -> None:
        if isinstance(names, str) or isinstance(patterns, str):
            raise TypeError("Select: names and patterns must be sequences of str, not a single str")
        self.names = frozenset(names)
        self.patterns = tuple(patterns)
        self.predicate = predicate
        self.everything = everything
        if predicate is not None and description is None:
            description = getattr(predicate, "__qualname__", repr(predicate))
        self.description = description
        if not (self.names or self.patterns or predicate or everything):
            raise RoutingError("Select: give names, patterns, a predicate, or use Select.all()")

    @classmethod
    def all(cls) -> Select:
        """Matches every parameter (a catch-all, normally the last group)."""
        return cls(everything=True)

    def matches(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether this selector takes parameter ``name`` of ``shape``: ``all()``, a listed name, a glob pattern
        (``fnmatch``, case-sensitive), or the predicate ``predicate(name, shape)``."""
        if self.everything or name in self.names:
            return True
        if any(fnmatch.fnmatchcase(name, p) for p in self.patterns):
            return True
        return bool(self.predicate(name, shape)) if self.predicate is not None else False

    def describe(self) -> JSONDict:
        """A JSON-able description (names, patterns, the predicate's ``description``), stored in checkpoints so
        that a snapshot only loads into the same grouping."""
        return {"all": self.everything, "names": sorted(self.names), "patterns": list(self.patterns),
                "predicate": self.description}


@dataclass
class Group:
    """A named group: ``optimizer`` steps the parameters ``select`` matches.  ``lr_ratio``: ``set_lr(lr)`` gives
    this group ``lr · lr_ratio`` (``None``: ``set_lr`` leaves it alone).  ``cost(shape)``: work estimate used to
    decide whether running groups concurrently pays (default: number of elements)."""

    name: str
    optimizer: Any  # a flatopt.Optimizer that also has validate_batch(items) and an ``lr`` property
    select: Select
    lr_ratio: float | None = 1.0
    cost: Callable[[tuple[int, ...]], int] | None = None


class Router:
    """Routes parameters to groups of optimizers; see the module doc."""

    def __init__(self, groups: Sequence[Group], *, algorithm: str = "routed", concurrent: bool = True,
                 min_concurrent_cost: int = parallel.PARALLEL_MIN_COST) -> None:
        if not groups:
            raise RoutingError("Router: at least one group is needed")
        seen: set[str] = set()
        for g in groups:
            if not isinstance(g, Group):
                raise TypeError(f"Router: expected Group objects, got {type(g).__name__}")
            if not isinstance(g.name, str) or not g.name or "/" in g.name or "." in g.name:
                raise RoutingError(f"Router: group name {g.name!r} must be a non-empty str without '/' or '.'")
            if g.name in seen:
                raise RoutingError(f"Router: group name {g.name!r} is used twice")
            seen.add(g.name)
            if not callable(getattr(g.optimizer, "validate_batch", None)):
                raise TypeError(f"Router: group {g.name!r}: the optimizer needs validate_batch(items) (validation "
                                f"without mutation), which {type(g.optimizer).__name__} lacks")
            if g.lr_ratio is not None:
                check_lr(g.lr_ratio, f"group {g.name!r} lr_ratio")
        self.groups = list(groups)
        self._by_name = {g.name: g for g in self.groups}
        self.algorithm = algorithm
        self.concurrent = concurrent
        self.min_concurrent_cost = min_concurrent_cost
        self.iteration = 0
        self._lr: float | None = None
        self.last_load_notes: list[str] = []
        self._lock = threading.RLock()

    # -------------------------------------------------------------------------------------------- routing
    def route(self, name: str, shape: tuple[int, ...]) -> str:
        """The name of the group that owns ``name`` (first match); :class:`RoutingError` when none does."""
        for g in self.groups:
            if g.select.matches(name, shape):
                return g.name
        raise RoutingError(f"parameter {name!r} (shape {shape}) matches no group of "
                           f"{[g.name for g in self.groups]}; add a catch-all group (Select.all())")

    def split(self, items: Sequence[OptItem]) -> dict[str, list[OptItem]]:
        """Validate ``items`` against every group (nothing changes) and return them by group, in item order."""
        if type(items) is not list:
            items = check_items_arg(items, type(self).__name__)
        items = [as_item(i, it) for i, it in enumerate(items)]
        by_group: dict[str, list[OptItem]] = {g.name: [] for g in self.groups}
        seen: set[str] = set()
        for it in items:
            if not isinstance(it.name, str) or not it.name:
                raise TypeError(f"parameter name must be a non-empty str, got {it.name!r}")
            if it.name in seen:
                raise RoutingError(f"parameter {it.name!r} appears twice in one step_batch")
            seen.add(it.name)
            by_group[self.route(it.name, check_shape(it.name, it.shape))].append(it)
        for g in self.groups:
            if by_group[g.name]:
                g.optimizer.validate_batch(by_group[g.name])
        if len(items) > 1 and sum(1 for v in by_group.values() if v) > 1:
            check_batch_aliasing(items)  # across groups: concurrent groups must not share memory
        return by_group

    def validate_batch(self, items: Sequence[OptItem]) -> None:
        """Raise what ``step_batch(items)`` would raise for bad input, changing nothing."""
        with self._lock:
            self.split(items)

    # ----------------------------------------------------------------------------------------- protocol
    def step(self, name: str, shape: tuple[int, ...], param: Array, grad: Array) -> None:
        """One parameter, routed to the first group whose selector takes it: ``step_batch([OptItem(...)])``."""
        self.step_batch([OptItem(name, shape, param, grad)])

    def step_batch(self, items: Sequence[OptItem], *, lrs: Mapping[str, float] | None = None) -> None:
        """Route every item to the first group whose selector takes it and step each group's items with that
        group's optimizer: bit for bit what stepping each item in order gives.  Every item is validated (in its
        group's optimizer too) before anything changes; a name no group takes is a ``RoutingError``.  Groups run
        concurrently on NumPy when both hold enough work.  ``lrs={group: lr}`` overrides a group's learning rate
        for this call only."""
        with self._lock:
            by_group = self.split(items)
            overrides: dict[str, float] = {}
            for gname, lr in (lrs or {}).items():
                if gname not in self._by_name:
                    raise RoutingError(f"lrs: no group named {gname!r}")
                overrides[gname] = check_lr(lr, f"lr of group {gname!r}")
                if self._by_name[gname].optimizer.lr is None:
                    raise RoutingError(f"lrs: group {gname!r} has no manual lr to override")
            self.run_groups(by_group, overrides)

    def run_groups(self, by_group: Mapping[str, list[OptItem]], lrs: Mapping[str, float] | None = None) -> None:
        """Step already validated items (from :meth:`split`), groups concurrently when it pays."""
        work = [(self._by_name[n], its) for n, its in by_group.items() if its]
        if not work:
            return
        lrs = lrs or {}

        def job(g: Group, its: list[OptItem]) -> Callable[[], None]:
            def run() -> None:
                if g.name in lrs:
                    old = g.optimizer.lr
                    g.optimizer.set_lr(lrs[g.name])
                    try:
                        g.optimizer.step_batch(its)
                    finally:
                        g.optimizer.set_lr(old)
                else:
                    g.optimizer.step_batch(its)
            return run

        jobs = [job(g, its) for g, its in work]
        costs = sorted((sum((g.cost or math.prod)(tuple(it.shape)) for it in its) for g, its in work), reverse=True)
        gpu = any(backend.is_cupy_array(it.param) for _, its in work for it in its)
        if not self.concurrent or gpu or len(jobs) < 2 or costs[1] < self.min_concurrent_cost:
            for j in jobs:
                j()
            return
        # core.parallel's group pool: the groups' optimizers use its task pool inside (sharing it could deadlock)
        parallel.run_jobs(jobs, parallel.group_pool())

    def end_iteration(self) -> None:
        """Count one iteration here and in every group's optimizer."""
        with self._lock:
            self.iteration += 1
            for g in self.groups:
                g.optimizer.end_iteration()

    @property
    def lr(self) -> float | None:
        """The base learning rate last given to ``set_lr`` (or at construction)."""
        return self._lr

    def set_lr(self, lr: float) -> None:
        """Give every group with an ``lr_ratio`` the learning rate ``lr * lr_ratio``; groups without one keep
        their own."""
        lr = check_lr(lr)
        with self._lock:
            for g in self.groups:
                if g.lr_ratio is not None:
                    g.optimizer.set_lr(lr * g.lr_ratio)
            self._lr = lr

    def lr_scale(self, name: str) -> float:
        """The owning group's ``lr_scale(name)`` (a predicate selector is asked with ``shape=None``; one that
        raises for it does not match); 1.0 when no group takes the name."""
        for g in self.groups:
            sel = g.select
            hit = sel.everything or name in sel.names or any(fnmatch.fnmatchcase(name, p) for p in sel.patterns)
            if not hit and sel.predicate is not None:
                try:
                    hit = bool(sel.predicate(name, None))  # type: ignore[arg-type]  # documented: shape=None here
                except Exception:  # noqa: BLE001 - a shape-dependent predicate cannot answer without a shape
                    hit = False
            if hit:
                scale: float = g.optimizer.lr_scale(name)
                return scale
        return 1.0

    # -------------------------------------------------------------------------------------- checkpoints
    def config_key(self) -> JSONDict:
        """The grouping a snapshot must match to load: each group's name, algorithm and selector."""
        return {"groups": [{"name": g.name, "algorithm": getattr(g.optimizer, "algorithm", type(g.optimizer).__name__),
                            "select": g.select.describe()} for g in self.groups]}

    def state_dict(self) -> OptimizerState:
        """One snapshot of every group's optimizer (each parameter tagged with its group) and the grouping."""
        with self._lock:
            params: dict[str, JSONDict] = {}
            buffers: dict[str, Array] = {}
            groups: dict[str, JSONDict] = {}
            configs: dict[str, JSONDict] = {}
            keys: dict[str, JSONDict] = {}
            for g in self.groups:
                st = g.optimizer.state_dict()
                for name, meta in st.params.items():
                    params[name] = {**meta, "group": g.name}
                for key, v in st.buffers.items():
                    buffers[f"{g.name}.{key}"] = v
                groups[g.name] = {"algorithm": st.algorithm, "step": st.step, "extra": st.extra,
                                  "format_version": st.format_version}
                configs[g.name] = st.config
                keys[g.name] = st.config_key
            key = self.config_key()
            key["group_keys"] = keys
            extra: JSONDict = {"groups": groups}
            if self._lr is not None:
                extra["lr"] = self._lr  # the base lr last given to set_lr (each group's own is in its extra)
            return OptimizerState(algorithm=self.algorithm, config={"groups": configs}, config_key=key,
                                  step=self.iteration, params=params, buffers=buffers, extra=extra)

    def split_state(self, state: OptimizerState) -> dict[str, OptimizerState]:
        """The per-group snapshots inside a combined one; :class:`IncompatibleState` when it is not this router's."""
        if not isinstance(state, OptimizerState):
            raise IncompatibleState(f"not an OptimizerState: {type(state).__name__}")
        if state.algorithm != self.algorithm or state.format_version != FORMAT_VERSION:
            raise IncompatibleState(f"snapshot of {state.algorithm!r} (format {state.format_version}), this is "
                                    f"{self.algorithm!r} (format {FORMAT_VERSION})")
        key = dict(state.config_key) if isinstance(state.config_key, Mapping) else {}
        if key.get("groups") != self.config_key()["groups"]:
            raise IncompatibleState("snapshot has another grouping (group names, algorithms or selectors)")
        try:
            parts = {}
            for g in self.groups:
                info = state.extra["groups"][g.name]
                parts[g.name] = OptimizerState(
                    algorithm=info["algorithm"], config=state.config["groups"][g.name],
                    config_key=key["group_keys"][g.name], step=info["step"], params={}, buffers={},
                    extra=info["extra"], format_version=info["format_version"])
            for name, meta in state.params.items():
                gname = meta["group"]
                if self.route(name, tuple(meta["shape"])) != gname:
                    raise IncompatibleState(f"parameter {name!r} belongs to group {gname!r} in the snapshot but "
                                            f"to {self.route(name, tuple(meta['shape']))!r} here")
                parts[gname].params[name] = {k: v for k, v in meta.items() if k != "group"}
            for bkey, v in state.buffers.items():
                gname, rest = bkey.split(".", 1)
                owner = state.params.get(rest.split("/", 1)[1], {}).get("group")
                if owner != gname:
                    raise IncompatibleState(f"buffer {bkey!r} is not stored under its parameter's group")
                parts[gname].buffers[rest] = v
        except IncompatibleState:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise IncompatibleState(f"malformed routed snapshot ({type(exc).__name__}: {exc})") from None
        return parts

    def try_load_state_dict(self, state: OptimizerState) -> None:
        """Load a combined snapshot or raise :class:`IncompatibleState` (nothing changed)."""
        with self._lock:
            parts = self.split_state(state)
            try:  # the router's own fields, before any group changes
                check_snapshot_fields(OptimizerState(state.algorithm, {}, {}, state.step,
                                                     extra={"lr": state.extra["lr"]} if "lr" in state.extra else {}))
            except IncompatibleStateError as exc:
                raise IncompatibleState(str(exc)) from None
            backups: list[tuple[Group, OptimizerState]] = []
            for g in self.groups:
                before = g.optimizer.state_dict()
                if g.optimizer.load_state_dict(parts[g.name]) is not True:
                    why = "; ".join(getattr(g.optimizer, "last_load_notes", None) or ["configuration or shapes differ"])
                    for og, ob in reversed(backups):
                        og.optimizer.load_state_dict(ob)
                    raise IncompatibleState(f"group {g.name!r} ({parts[g.name].algorithm}) refused its part of the "
                                            f"snapshot: {why}")
                backups.append((g, before))
            self.iteration = int(state.step)
            if "lr" in state.extra:
                self._lr = float(state.extra["lr"])

    def load_state_dict(self, state: OptimizerState, *, strict: bool = False) -> bool:
        """``try_load_state_dict`` that answers ``False`` (nothing changed) with the reason in
        ``last_load_notes`` instead of raising; ``strict=True`` raises :class:`IncompatibleState`.  A path or a
        dict is a ``TypeError`` (read files with ``flatopt.load``)."""
        check_snapshot(state, type(self).__name__)
        try:
            self.try_load_state_dict(state)
        except IncompatibleState as exc:
            self.last_load_notes = [str(exc)]
            if strict:
                raise
            return False
        self.last_load_notes = []
        return True

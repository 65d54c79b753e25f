"""MuonAdamW: Muon on an explicit list of matrices, AdamW on every other parameter, with strict safety semantics.

The ``MuonAdamW`` of the Rust crate ruda-optim 0.21.13 (a fork of Burn's optimizers; its ``try_step_with_lrs``,
``try_step_or_skip``, ``try_load_record`` and error names) translated to names and flat buffers:

* **Explicit manifest.**  ``MuonAdamW(params={name: shape or (shape, dtype)}, muon_names=[...])`` fixes every
  parameter's shape, dtype (``None``: any accepted dtype, fixed by its first step), and role once.  Roles are never
  guessed from rank (embeddings and output heads are 2-D too); :func:`propose_muon_names` *proposes* a list you
  can inspect and pass explicitly.  Construction raises (creating nothing) on invalid configs or ratio, an empty
  Muon group, a duplicate, an unknown name, or a Muon selection that is not a non-empty 2-D matrix.
* **Validate, then commit.**  ``try_step_with_lrs(muon_lr, adamw_lr, params, grads)`` (or ``(…, items)``) checks
  the learning rates (finite, ≥ 0, finite in float32, also lr·s and lr·λ), every name, shape, dtype, backend and
  buffer, the tied aliases, and both groups' own checks, **before** either group changes any state or buffer.
  It is not a device transaction: CUDA faults surface asynchronously.
* **Missing gradient = no-op**: a name absent from ``grads``/the batch, or an item with ``grad=None``, gets no
  momentum or moment update, no weight decay and no state.
* **Tied parameters** (``aliases={alias: name}``): one update and one state per name; the alias and the name
  must be given the same param memory, whether or not each comes with a gradient, and the same grad memory when
  both do (else :class:`~flatopt.errors.TiedParameterMismatch`, nothing changed).
  The same name twice in one batch is an error (as for every flatopt optimizer).
* ``try_step_or_skip(..., skip_update=True)`` returns at once: no validation, no change.  The caller decides the
  skip consistently on every replica and unscales/finite-checks gradients before a non-skipped step (no step
  scans values).
* **Protocol**: ``step``/``step_batch`` use ``lr`` for Muon and ``lr · adamw_lr_ratio`` for AdamW; ``set_lr``
  sets both; ``lr_scale`` (a mapping or callable over the manifest names) is honoured by both groups.
  ``end_iteration`` only counts iterations.
* **Records**: ``state_dict()`` holds version 1, the config key ``"muon-adamw-v1:" + canonical JSON`` of the whole
  configuration (lr excluded; momentum convention, ε, NS settings, layout, all AdamW settings, the ratio), the
  manifest, Muon buffers ``muon.momentum_buffer/<name>`` and AdamW ``adamw.m|v/<name>`` with their step counts.
  ``try_load_record`` refuses, with a specific :class:`~flatopt.errors.IncompatibleRecord` subclass and no change,
  another version, convention, configuration, manifest, Muon selection or role assignment, or a state that does
  not fit; ``load_state_dict`` returns ``False`` in those cases (the reason is in ``last_load_error``).
* **Threads**: ``step_batch`` runs the Muon and AdamW groups concurrently (:class:`flatopt.routing.Router`) and
  Muon's matrices on ``muon_workers`` persistent threads with a fixed, cost-balanced matrix → thread assignment;
  bit-identical to the serial loop.  On CuPy everything runs on the calling thread without host synchronisation.
  A matrix is always orthogonalised whole (never a shard of it).

AdamW half defaults: Keller Jordan's auxiliary Adam (betas (0.9, 0.95), eps 1e-10, weight_decay 0), the pairing the
0.015 ratio was chosen for; the standalone :class:`flatopt.AdamW` keeps torch's defaults.  Muon half defaults:
:class:`flatopt.Muon`'s ("ema" convention, "original" lr-adjust).  The ``lr`` fields of the two configs are
ignored: ``lr`` and ``adamw_lr_ratio`` set the group learning rates.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeAlias

import numpy as np

from . import checks as _checks
from .. import errors as E
from ..core.driver import class_doc, config_to_dict
from ..core.precision import Precision
from ..core.types import Array, DecayMask, LrScale, OptimizerState, OptItem
from ..core.validate import as_item, check_items_arg, check_lr, check_snapshot
from ..adamw import AdamW, AdamWConfig
from . import Muon, MuonConfig, _cost
from ..routing import Group, IncompatibleState, Router, Select

RECORD_VERSION = _checks.RECORD_VERSION
KEY_PREFIX = "muon-adamw-v1:"
KELLER_AUX_ADAMW = AdamWConfig(betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
_F32_MAX = float(np.finfo(np.float32).max)

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

ShapeSpec: TypeAlias = "Sequence[int] | tuple[Sequence[int], DTypeLike]"
"""A ``params`` entry of :class:`MuonAdamW`: a shape, or ``(shape, dtype)`` (dtype float32 or float64)."""


def propose_muon_names(params: Mapping[str, ShapeSpec],
                       exclude: Sequence[str] = ("embed", "wte", "wpe", "head")) -> list[str]:
    """A *proposal* (sorted) of 2-D, non-empty parameters whose name contains none of ``exclude``; review it and
    pass it explicitly as ``muon_names`` (MuonAdamW never infers roles itself)."""
    out = []
    for name, spec in params.items():
        shape = _checks.split_spec(name, spec)[0]
        if len(shape) == 2 and min(shape) > 0 and not any(x in name for x in exclude):
            out.append(name)
    return sorted(out)


class MuonAdamW:
    """``MuonAdamW(params, muon_names, *, lr=0.02, muon=None, adamw=None, adamw_lr_ratio=0.015, aliases=None,
    lr_scale=None, concurrent=True, muon_workers=None, weight_decay_mask=None, precision=None)``: see the module
    doc (``muon_workers``: see :class:`flatopt.Muon`'s ``workers``; ``weight_decay_mask`` and ``precision`` apply to
    both halves)."""

    algorithm = "muon_adamw"

    def __init__(self, params: Mapping[str, ShapeSpec], muon_names: Sequence[str], *, lr: float = 0.02,
                 muon: MuonConfig | Mapping[str, Any] | None = None,
                 adamw: AdamWConfig | Mapping[str, Any] | None = None,
                 adamw_lr_ratio: float = 0.015, aliases: Mapping[str, str] | None = None,
                 lr_scale: LrScale = None, concurrent: bool = True, muon_workers: int | None = None,
                 weight_decay_mask: DecayMask = None, precision: Precision | None = None) -> None:
        mcfg: MuonConfig = _checks.make_config(MuonConfig, muon, MuonConfig(), "muon")
        acfg: AdamWConfig = _checks.make_config(AdamWConfig, adamw, KELLER_AUX_ADAMW, "adamw")
        try:
            lr = check_lr(lr)
            ratio = check_lr(adamw_lr_ratio, "adamw_lr_ratio")
        except (TypeError, ValueError) as exc:
            raise E.InvalidConfig(str(exc)) from None
        if ratio > _F32_MAX or lr > _F32_MAX or lr * ratio > _F32_MAX:
            raise E.InvalidConfig(f"lr {lr!r} and adamw_lr_ratio {ratio!r} must be finite in float32")
        if not isinstance(params, Mapping) or not params:
            raise E.InvalidConfig("params must be a non-empty mapping name -> shape (or (shape, dtype))")
        manifest: dict[str, tuple[tuple[int, ...], np.dtype[Any] | None]] = {}
        for name, spec in params.items():
            if not isinstance(name, str) or not name:
                raise E.InvalidConfig(f"parameter names must be non-empty str, got {name!r}")
            manifest[name] = _checks.split_spec(name, spec)
        self._aliases: dict[str, str] = {}
        for alias, target in (aliases or {}).items():
            if alias in manifest or alias in self._aliases:
                raise E.DuplicateParameter(f"alias {alias!r} is also a parameter name (or listed twice)")
            if target not in manifest:
                raise E.UnknownParameter(f"alias {alias!r} points to {target!r}, which is not in params")
            self._aliases[alias] = target
        if isinstance(muon_names, str):
            raise E.InvalidConfig("muon_names must be a sequence of names, not a single str")
        muon_names = list(muon_names)
        if not muon_names:
            raise E.EmptyMuonGroup("muon_names is empty: list the hidden 2-D matrices for Muon explicitly")
        selected: list[str] = []
        for n in muon_names:
            canon = self._aliases.get(n, n)
            if canon not in manifest:
                raise E.UnknownParameter(f"muon_names: {n!r} is not in params")
            if canon in selected:
                raise E.DuplicateParameter(f"muon_names: {n!r} is listed twice (or with one of its aliases)")
            shape = manifest[canon][0]
            if len(shape) != 2:
                raise E.ExpectedMatrix(f"muon_names: {n!r} has shape {shape}; Muon takes 2-D matrices only")
            if min(shape) == 0:
                raise E.EmptyMatrix(f"muon_names: {n!r} has the empty shape {shape}")
            selected.append(canon)
        try:
            self._muon = Muon(**{**config_to_dict(mcfg), "lr": lr}, lr_scale=lr_scale, workers=muon_workers,
                              weight_decay_mask=weight_decay_mask, precision=precision)
            self._adamw = AdamW(**{**config_to_dict(acfg), "lr": lr * ratio}, lr_scale=lr_scale,
                                weight_decay_mask=weight_decay_mask, precision=precision)
        except (TypeError, ValueError) as exc:
            raise E.InvalidConfig(str(exc)) from None
        self._muon.assign_shards([(n, manifest[n][0]) for n in sorted(selected)])
        self._manifest = manifest
        self._muon_set = frozenset(selected)
        self._lr, self._ratio = lr, ratio
        self.precision = self._muon.precision  # the same policy in both groups
        self._lr_scale = self._muon._lr_scale  # noqa: SLF001 - the same validated callable for both groups
        self._router = Router([
            Group("muon", self._muon, Select(names=sorted(selected)), lr_ratio=1.0, cost=_cost),
            Group("adamw", self._adamw, Select.all(), lr_ratio=ratio),
        ], algorithm=self.algorithm, concurrent=concurrent)
        self._dtypes: dict[str, str] = {}  # name -> the dtype name of its first step
        self.last_load_error: E.IncompatibleRecord | None = None
        self.last_load_notes: list[str] = []
        cfg = {"muon": {k: v for k, v in config_to_dict(mcfg).items() if k != "lr"},
               "adamw": {k: v for k, v in config_to_dict(acfg).items() if k != "lr"}, "adamw_lr_ratio": ratio}
        self._config = cfg
        self._key = KEY_PREFIX + json.dumps(cfg, sort_keys=True)

    # --------------------------------------------------------------------------------------- inspection
    @property
    def lr(self) -> float:
        """The Muon learning rate; AdamW's is ``lr * adamw_lr_ratio``."""
        return self._lr

    @property
    def adamw_lr_ratio(self) -> float:
        """AdamW's learning rate as a fraction of Muon's (fixed at construction)."""
        return self._ratio

    @property
    def muon(self) -> Muon:
        """The inner ``Muon`` optimizer of the Muon group (for inspection; step through this object)."""
        return self._muon

    @property
    def adamw(self) -> AdamW:
        """The inner ``AdamW`` optimizer of the AdamW group (for inspection; step through this object)."""
        return self._adamw

    def manifest(self) -> list[list[Any]]:
        """Sorted ``[name, shape, role, dtype or "any"]`` rows, then ``["alias", alias, name]`` rows."""
        rows = [[n, list(s), "muon" if n in self._muon_set else "adamw", dt.name if dt is not None else "any"]
                for n, (s, dt) in sorted(self._manifest.items())]
        return rows + [["alias", a, t] for a, t in sorted(self._aliases.items())]

    def muon_parameter_count(self) -> int:
        """Number of distinct parameters routed to Muon (not matrix elements)."""
        return len(self._muon_set)

    def muon_state_count(self) -> int:
        """Number of Muon-group parameters that have state (stepped at least once)."""
        return len(self._muon.state_names())

    def adamw_state_count(self) -> int:
        """Number of AdamW-group parameters that have state (stepped at least once)."""
        return len(self._adamw.state_names())

    def lr_scale(self, name: str) -> float:
        """The learning-rate multiplier of ``name`` (an alias answers for its target), honoured by both groups."""
        return self._lr_scale(self._aliases.get(name, name))

    def decays(self, name: str) -> bool:
        """Whether ``name`` gets weight decay (``weight_decay_mask``, the same for both groups; an alias answers for
        its target)."""
        return self._muon.decays(self._aliases.get(name, name))

    @property
    def iteration(self) -> int:
        """Iterations counted by ``end_iteration`` (saved in ``state_dict``)."""
        return self._router.iteration

    def state_names(self) -> list[str]:
        """The parameters that have state (stepped at least once) in either group, sorted (canonical names)."""
        with self._router._lock:  # noqa: SLF001 - the Router this object owns: one lock for both halves
            return sorted(self._muon.state_names() + self._adamw.state_names())

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held by both groups (persistent arrays)."""
        with self._router._lock:  # noqa: SLF001 - the Router this object owns: one lock for both halves
            return self._muon.state_nbytes() + self._adamw.state_nbytes()

    def reset(self, name: str) -> None:
        """Forget the state of ``name`` (an alias: its target's) in its group: its next step starts from fresh
        state.  A name outside the manifest is :class:`~flatopt.errors.UnknownParameter`."""
        canon = self._aliases.get(name, name)
        if canon not in self._manifest:
            raise E.UnknownParameter(f"parameter {name!r} is not in the manifest")
        with self._router._lock:  # noqa: SLF001 - the Router this object owns: one lock for both halves
            (self._muon if canon in self._muon_set else self._adamw).reset(canon)

    # ------------------------------------------------------------------------------------------- stepping
    def set_lr(self, lr: float) -> None:
        """Muon gets ``lr``, AdamW ``lr · adamw_lr_ratio``."""
        lr = check_lr(lr)
        if lr > _F32_MAX or lr * self._ratio > _F32_MAX:
            raise E.InvalidLearningRate(f"lr {lr!r} is not finite in float32")
        self._router.set_lr(lr)
        self._lr = lr

    def end_iteration(self) -> None:
        """Count one iteration (saved in ``state_dict``); neither group has an optimizer-wide schedule."""
        self._router.end_iteration()

    def step(self, name: str, shape: tuple[int, ...], param: Array, grad: Array) -> None:
        """One parameter: ``step_batch([OptItem(name, shape, param, grad)])``."""
        self.step_batch([OptItem(name, shape, param, grad)])

    def step_batch(self, items: Sequence[OptItem]) -> None:
        """The Optimizer protocol's step: ``try_step_with_lrs(lr, lr * adamw_lr_ratio, items)``.  Items with
        ``grad=None`` are not stepped; an alias must come with its target's buffers; everything is validated
        before either group changes anything, and the two groups then run concurrently."""
        if type(items) is not list:
            items = check_items_arg(items, type(self).__name__)
        self.try_step_with_lrs(self._lr, self._lr * self._ratio, items)

    def try_step_or_skip(self, muon_lr: float, adamw_lr: float,
                         params: Sequence[OptItem] | Mapping[str, Array],
                         grads: Mapping[str, Array | None] | None = None, *, skip_update: bool) -> None:
        """``skip_update=True``: return at once (no validation, no change); otherwise ``try_step_with_lrs``."""
        if skip_update:
            return
        self.try_step_with_lrs(muon_lr, adamw_lr, params, grads)

    def try_step_with_lrs(self, muon_lr: float, adamw_lr: float, params: Sequence[OptItem] | Mapping[str, Array],
                          grads: Mapping[str, Array | None] | None = None) -> None:
        """Step Muon with ``muon_lr`` and AdamW with ``adamw_lr``.  ``params``: a sequence of ``OptItem`` (grad
        ``None`` = missing), or a mapping name → param buffer with ``grads`` a mapping name → grad (names without
        a gradient are not stepped).  Everything is validated before anything changes (module doc)."""
        lrs: dict[str, float] = {}
        for what, v in (("muon_lr", muon_lr), ("adamw_lr", adamw_lr)):
            try:
                lrs[what] = check_lr(v, what)
            except (TypeError, ValueError) as exc:
                raise E.InvalidLearningRate(str(exc)) from None
            if lrs[what] > _F32_MAX:
                raise E.InvalidLearningRate(f"{what} {v!r} is not finite in float32")
        items = self._items(params, grads)
        with self._router._lock:  # noqa: SLF001 - one step at a time, validation and commit together
            live, by_group = self._check(items, lrs["muon_lr"])
            over: dict[str, float] = {}
            if lrs["muon_lr"] != self._muon.lr:
                over["muon"] = lrs["muon_lr"]
            if lrs["adamw_lr"] != self._adamw.lr:
                over["adamw"] = lrs["adamw_lr"]
            for it in live:
                self._dtypes.setdefault(it.name, it.param.dtype.name)
            self._router.run_groups(by_group, over)

    def validate_batch(self, items: Sequence[OptItem]) -> None:
        """Raise what ``step_batch(items)`` would raise for bad input, changing nothing."""
        with self._router._lock:  # noqa: SLF001 - the Router this object owns: one lock for both halves
            self._check(self._items(items, None), self._lr)

    def _check(self, items: list[OptItem], muon_lr: float) -> tuple[list[OptItem], dict[str, list[OptItem]]]:
        live = _checks.validate_items(self, items, muon_lr)
        try:
            return live, self._router.split(live)
        except E.MuonError:
            raise
        except (TypeError, ValueError) as exc:
            cls = E.DTypeMismatch if "dtype" in str(exc) else E.InvalidStep
            raise cls(str(exc)) from exc

    def _items(self, params: Sequence[OptItem] | Mapping[str, Array],
               grads: Mapping[str, Array | None] | None) -> list[OptItem]:
        if grads is None:
            if isinstance(params, Mapping):
                raise TypeError("try_step_with_lrs: give grads with a params mapping (or a sequence of OptItem)")
            if type(params) is not list:
                params = check_items_arg(params, type(self).__name__)
            return [as_item(i, it) for i, it in enumerate(params)]
        if not isinstance(params, Mapping) or not isinstance(grads, Mapping):
            raise TypeError("try_step_with_lrs: params and grads must both be mappings name -> buffer")
        for name in grads:
            if name not in params:
                raise E.UnusedGradients(f"gradient for {name!r}, which is not among the params given")
        out = []
        for name, p in params.items():
            canon = self._aliases.get(name, name)
            if canon not in self._manifest:
                raise E.UnknownParameter(f"parameter {name!r} is not in the manifest")
            out.append(OptItem(name, self._manifest[canon][0], p, grads.get(name)))
        return out

    # ---------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> OptimizerState:
        """A versioned record of both groups (Muon momentum buffers, AdamW moments, step counts), the manifest and
        the configuration key that ``try_load_record`` checks."""
        with self._router._lock:  # noqa: SLF001 - the Router this object owns: one lock for both halves
            st = self._router.state_dict()
            st.config = {**st.config, **self._config, "lr": self._lr}
            st.extra["lr"] = self._lr  # the lr in effect (training state: load_state_dict restores it)
            st.config_key = {**st.config_key, "version": RECORD_VERSION, "record": self._key,
                             "momentum_convention": self._muon.config.momentum_convention,
                             "manifest": self.manifest()}
            return st

    def try_load_record(self, state: OptimizerState) -> None:
        """Restore a compatible record exactly, or raise a specific :class:`~flatopt.errors.IncompatibleRecord`
        (nothing changed).  The learning rate in effect when the record was taken (``set_lr``'s) is training state
        and is restored (the AdamW group's follows through the fixed ratio); a record without it leaves the lr as it
        is."""
        _checks.check_record(self, state)
        try:
            self._router.try_load_state_dict(state)
        except IncompatibleState as exc:
            raise E.StateMismatch(str(exc)) from None
        if "lr" in state.extra:  # (checked by the router before anything changed)
            self._lr = self._router._lr = float(state.extra["lr"])  # noqa: SLF001 - the Router this object owns

    def load_state_dict(self, state: OptimizerState, *, strict: bool = False) -> bool:
        """``try_load_record`` that answers ``False`` instead of raising (the exception: ``last_load_error``, its
        message: ``last_load_notes``); ``strict=True`` raises it (an :class:`~flatopt.errors.IncompatibleRecord`,
        also an :class:`~flatopt.errors.IncompatibleStateError`).  A path or a dict is a ``TypeError`` (read files
        with ``flatopt.load``)."""
        check_snapshot(state, type(self).__name__)
        try:
            self.try_load_record(state)
        except E.IncompatibleRecord as exc:
            self.last_load_error = exc
            self.last_load_notes = [str(exc)]
            if strict:
                raise
            return False
        self.last_load_error = None
        self.last_load_notes = []
        self._dtypes = {n: m["dtype"] for n, m in state.params.items()}
        return True




MuonAdamW.__doc__ = class_doc(MuonAdamW, MuonAdamW.__doc__ or "", has_decay=True)  # help(): the module doc too

"""MuonAdamW's checks, kept apart from the class: manifest entries, step validation (before any mutation) and
record validation (before any load).  Functions take the ``MuonAdamW`` as ``self``."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from ..core import backend
from .. import errors as E
from ..core.types import FORMAT_VERSION, OptimizerState, OptItem
from ..core.precision import LOWP_NAMES
from ..core.lowp import BUFFERS
from ..core.validate import LOWP_DTYPE_NAMES, check_item, check_shape, check_snapshot_fields
from . import shape_scale

RECORD_VERSION = 1
_F32_MAX = float(np.finfo(np.float32).max)


def split_spec(name, spec) -> tuple[tuple[int, ...], np.dtype | None]:
    dtype = None
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (tuple, list)):
        spec, dtype = spec
    try:
        shape = check_shape(name, spec)
        dtype = None if dtype is None else np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise E.InvalidConfig(f"manifest entry {name!r}: {exc}") from None
    if dtype is not None and dtype.name not in LOWP_DTYPE_NAMES:
        raise E.InvalidConfig(f"manifest entry {name!r}: dtype must be float16, bfloat16, float32 or float64, got "
                              f"{dtype}")
    return shape, dtype


def make_config(cls, value, defaults, what):
    try:
        if value is None:
            return defaults
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return dataclasses.replace(defaults, **value)
    except (TypeError, ValueError) as exc:
        raise E.InvalidConfig(f"{what}: {exc}") from None
    raise E.InvalidConfig(f"{what} must be a {cls.__name__} or a mapping of its fields, got {type(value).__name__}")


def validate_items(self, items: list[OptItem], muon_lr: float) -> list[OptItem]:
    """Every manifest check of a step (``self`` is the MuonAdamW; nothing is changed); return the items to step:
    canonical names, tied aliases folded into one item, missing gradients dropped."""
    seen: set[str] = set()
    canon_items: dict[str, OptItem] = {}
    tied_params: dict[str, tuple[str, object]] = {}  # canonical name -> (first name given, its param buffer)
    for it in items:
        name = it.name
        if not isinstance(name, str) or not name:
            raise E.InvalidBuffer(f"parameter name must be a non-empty str, got {name!r}")
        if name in seen:
            raise E.DuplicateParameter(f"parameter {name!r} appears twice in one step")
        seen.add(name)
        canon = self._aliases.get(name, name)
        if canon not in self._manifest:
            raise E.UnusedGradients(f"parameter {name!r} is not in the manifest (its gradient would be unused)")
        mshape, mdtype = self._manifest[canon]
        try:
            shape = check_shape(name, it.shape)
        except (TypeError, ValueError) as exc:
            raise E.ModelChanged(str(exc)) from None
        if shape != mshape:
            raise E.ModelChanged(f"parameter {name!r}: shape {shape} differs from the manifest's {mshape}")
        grad = it.grad
        arrays = (it.param,) if grad is None else (it.param, grad)
        try:
            backends = {backend.backend_name(a) for a in arrays}
        except TypeError as exc:
            raise E.InvalidBuffer(f"parameter {name!r}: {exc}") from None
        if len(backends) > 1 or ("cupy" in backends and grad is not None and it.param.device != grad.device):
            raise E.DeviceMismatch(f"parameter {name!r}: param and grad live on different backends/devices")
        want = mdtype.name if mdtype is not None else self._dtypes.get(canon)
        dt = getattr(it.param, "dtype", None)
        if want is not None and dt is not None and dt.name in LOWP_DTYPE_NAMES and dt.name != want:
            raise E.DTypeMismatch(f"parameter {name!r}: param dtype {dt} differs from {want}")
        n = math.prod(mshape)
        for what, a in (("param", it.param), ("grad", grad)):
            if a is not None and getattr(a, "size", n) != n:
                raise E.ShapeMismatch(f"parameter {name!r}: {what} has {a.size} elements, shape {mshape} needs {n}")
        # Tied names share one param buffer, with or without a gradient (a stale copy would never be updated).
        first, first_param = tied_params.setdefault(canon, (name, it.param))
        if first_param is not it.param and not same_memory(first_param, it.param):
            raise E.TiedParameterMismatch(f"parameter {name!r} is tied to {canon!r} but was given another param "
                                          f"buffer than {first!r} (tied names must share the same memory)")
        if grad is None:
            continue  # missing gradient: no-op (the param itself was checked above)
        try:
            check_item(name, mshape, it.param, grad, lowp=True)
        except TypeError as exc:
            raise (E.DTypeMismatch if "dtype" in str(exc) else E.InvalidBuffer)(str(exc)) from None
        except ValueError as exc:
            raise E.InvalidBuffer(str(exc)) from None
        if canon in self._muon_set:
            scale = self._lr_scale(canon)
            eff = muon_lr * scale if isinstance(scale, (int, float)) and math.isfinite(scale) else 0.0
            wd = self._muon.config.weight_decay
            if not (eff * shape_scale(self._muon.config, mshape) <= _F32_MAX and eff * wd <= _F32_MAX):
                raise E.InvalidLearningRate(f"parameter {name!r}: lr·s or lr·weight_decay overflows float32")
        prev = canon_items.get(canon)
        if prev is None:
            canon_items[canon] = OptItem(canon, mshape, it.param, grad)
        elif not same_memory(prev.grad, grad):
            raise E.TiedParameterMismatch(f"parameter {name!r} is tied to {canon!r} but was given another grad "
                                          f"buffer (tied names must share the same memory)")
    return list(canon_items.values())


def check_record(self, state: OptimizerState) -> None:
    """The record checks of ``try_load_record`` (version, convention, config key, manifest, roles, states)."""
    if not isinstance(state, OptimizerState):
        raise E.RecordVersionMismatch(f"not an OptimizerState: {type(state).__name__}")
    key = state.config_key if isinstance(state.config_key, Mapping) else {}
    if state.algorithm != self.algorithm:
        raise E.RecordVersionMismatch(f"the snapshot is of algorithm {state.algorithm!r}, this optimizer is "
                                      f"{self.algorithm!r} (a {type(self).__name__})")
    if state.format_version != FORMAT_VERSION or key.get("version") != RECORD_VERSION:
        raise E.RecordVersionMismatch(f"record of {state.algorithm!r} version {key.get('version')!r} (format "
                                      f"version {state.format_version}); this is {self.algorithm!r} "
                                      f"v{RECORD_VERSION} (format version {FORMAT_VERSION})")
    try:
        check_snapshot_fields(state)
    except E.IncompatibleStateError as exc:
        raise E.StateMismatch(f"malformed record: {exc}") from None
    mine = self._muon.config.momentum_convention
    if key.get("momentum_convention") != mine:
        raise E.ConventionMismatch(f"record uses momentum convention {key.get('momentum_convention')!r}, this "
                                   f"optimizer {mine!r}: the buffers differ by the factor 1 − momentum")
    if key.get("record") != self._key:
        raise E.ConfigMismatch(f"record config key differs:\n  record: {key.get('record')!r}\n  here:   {self._key!r}")
    rows, want = key.get("manifest"), self.manifest()
    if rows != want:
        def strip(rs):  # the manifest without the roles
            return [[r[0], r[1], r[3]] if r[0] != "alias" else r for r in rs]

        try:
            same_params = strip(rows) == strip(want)
        except (TypeError, IndexError, KeyError):
            same_params = False
        if same_params:
            raise E.GroupingMismatch("record routes other parameters to Muon (the Muon selection differs)")
        raise E.ManifestMismatch("record manifest (names, shapes, dtypes or aliases) differs")
    _check_states(self, state)


def _check_states(self, state: OptimizerState) -> None:
    slots = {"muon": ("momentum_buffer",), "adamw": ("m", "v", "vmax") if self._adamw.config.amsgrad else ("m", "v")}
    expected = set()
    for name, meta in state.params.items():
        if not isinstance(meta, Mapping) or name not in self._manifest:
            raise E.StateMismatch(f"record holds a state for {name!r}, which is not a manifest parameter")
        role = "muon" if name in self._muon_set else "adamw"
        if meta.get("group") != role:
            raise E.RoleMismatch(f"record stores {name!r} as {meta.get('group')!r}; here it is {role!r}")
        mshape, mdtype = self._manifest[name]
        try:
            shape, dtype, t = tuple(meta["shape"]), str(meta["dtype"]), int(meta["t"])
        except (KeyError, TypeError, ValueError):
            raise E.StateMismatch(f"record state of {name!r} is malformed") from None
        if shape != mshape or (mdtype is not None and dtype != mdtype.name) or dtype not in LOWP_DTYPE_NAMES or t < 1:
            raise E.StateMismatch(f"record state of {name!r}: shape {shape}, dtype {dtype}, t {t} do not fit "
                                  f"the manifest ({mshape}, {mdtype or 'any'}) or t < 1")
        work = "float64" if dtype == "float64" else "float32"  # the states of a 16-bit parameter: float32
        for s in slots[role]:
            k = f"{role}.{s}/{name}"
            v = state.buffers.get(k)
            if v is None or getattr(v, "shape", None) != (math.prod(mshape),) or v.dtype.name != work:
                raise E.StateMismatch(f"record buffer {k!r} is missing or does not fit {name!r}")
            expected.add(k)
        if dtype in LOWP_NAMES and self.precision.writeback in BUFFERS:
            expected.add(f"{role}.{BUFFERS[self.precision.writeback]}/{name}")  # (checked by the group's load)
    extra = set(state.buffers) - expected
    if extra:
        other = sorted(extra)[0]
        cls = E.RoleMismatch if other.split(".", 1)[0] in ("muon", "adamw") else E.StateMismatch
        raise cls(f"record buffer {other!r} does not belong to any parameter in that role")


def same_memory(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if backend.backend_name(a) != backend.backend_name(b) or a.dtype != b.dtype or a.size != b.size:
        return False
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return a.data.ptr == b.data.ptr and a.device == b.device

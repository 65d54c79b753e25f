"""What the driver keeps per parameter name, and how it becomes a snapshot and back.

``Slot`` holds a name's shape, dtype, backend, step count and the algorithm's state dataclass.  ``snapshot``
turns the slots into the ``params``/``buffers`` of an ``OptimizerState`` (arrays copied, names sorted);
``restore`` checks a snapshot against fresh templates of the algorithm's state and builds new slots, or raises
:class:`~flatopt.errors.IncompatibleStateError` naming what does not fit (so a failed load changes nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import IncompatibleStateError
from . import backend as _backend


@dataclasses.dataclass
class Slot:
    """What the driver keeps per parameter name."""

    shape: tuple[int, ...]
    dtype: np.dtype
    backend: str  # "numpy" or "cupy"
    t: int
    state: Any  # the algorithm's state dataclass
    pinned: bool = True  # False right after load_state_dict: arrays may still move to the param's backend
    chunk_views: list | None = None  # cached per-chunk views of the state (elementwise algorithms)
    home: Any = None  # the bucket plan (core.cpu_plan.BucketPlan) whose arenas hold this state, if any
    bucket_key: Any = None  # cached core.cpu_plan.bucket_key (False: cannot be bucketed)
    device: int | None = None  # CuPy: the id of the device its arrays were created on (None: unknown, or NumPy)


def snapshot(slots: dict[str, Slot]) -> tuple[dict, dict]:
    """``(params, buffers)`` of every slot: metadata and JSON scalars per name, arrays keyed "<field>/<name>"."""
    params, buffers = {}, {}
    for name in sorted(slots):
        slot = slots[name]
        meta = {"shape": list(slot.shape), "dtype": slot.dtype.name, "t": slot.t}
        for f in persistent_fields(slot.state):
            v = getattr(slot.state, f.name)
            if is_array(v):
                buffers[f"{f.name}/{name}"] = v.copy()
            elif v is not None:
                meta[f.name] = v
        params[name] = meta
    return params, buffers


def restore(params: Mapping, buffers: Mapping, template: Callable[[str, tuple, np.dtype], Any],
            check_shape: Callable[[str, tuple], None]) -> dict[str, Slot]:
    """New slots from a snapshot's ``params``/``buffers``; :class:`~flatopt.errors.IncompatibleStateError` naming
    the parameter when an entry is malformed, a shape is refused, an array is missing or does not match the fresh
    ``template(name, shape, dtype)``, or a buffer is left over (nothing is changed: the caller installs the slots)."""
    slots: dict[str, Slot] = {}
    used = set()
    for name, meta in params.items():
        try:
            shape = tuple(int(d) for d in meta["shape"])
            dtype = np.dtype(meta["dtype"])
            t = int(meta["t"])
        except Exception as exc:  # noqa: BLE001 - any malformed entry means "does not fit"
            raise IncompatibleStateError(f"parameter {name!r}: malformed snapshot entry "
                                         f"({type(exc).__name__}: {exc})") from None
        try:
            check_shape(name, shape)
        except Exception as exc:  # noqa: BLE001 - a shape this algorithm refuses
            raise IncompatibleStateError(f"parameter {name!r}: shape {shape} refused ({exc})") from None
        tmpl = template(name, shape, dtype)
        kw = {}
        backend = None
        for f in persistent_fields(tmpl):
            tv = getattr(tmpl, f.name)
            key = f"{f.name}/{name}"
            if is_array(tv):
                v = buffers.get(key)
                if not is_array(v):
                    raise IncompatibleStateError(f"parameter {name!r}: buffer {key!r} is missing from the snapshot")
                if v.shape != tv.shape or v.dtype != tv.dtype:
                    raise IncompatibleStateError(
                        f"parameter {name!r}: buffer {key!r} has shape {v.shape} and dtype {v.dtype}, this optimizer "
                        f"needs {tv.shape} and {tv.dtype} for shape {shape}")
                backend = _backend.backend_name(v)
                kw[f.name] = v.copy()
                used.add(key)
            elif tv is None and buffers.get(key) is not None:
                raise IncompatibleStateError(f"parameter {name!r}: the snapshot holds buffer {key!r}, which this "
                                             f"optimizer's configuration does not keep")
            else:
                kw[f.name] = _scalar(name, f.name, meta.get(f.name, tv), tv)
        slots[name] = Slot(shape, dtype, backend or "numpy", t, dataclasses.replace(tmpl, **kw), pinned=False)
    left = sorted(set(buffers) - used)
    if left:
        raise IncompatibleStateError(f"buffer {left[0]!r} of the snapshot belongs to no parameter it describes")
    return slots


def _scalar(name: str, field: str, value: Any, fresh: Any) -> Any:
    """A per-parameter scalar of the snapshot, of the JSON type the fresh state holds there (an int where it holds
    an int, never a bool, None or a str for it; a float may be written as an int); a field fresh states leave
    ``None`` takes any JSON scalar.  :class:`~flatopt.errors.IncompatibleStateError` otherwise."""
    if value is fresh or fresh is None and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    if isinstance(fresh, bool):
        ok = isinstance(value, bool)
    elif isinstance(fresh, (int, np.integer)):
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    elif isinstance(fresh, (float, np.floating)):
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    elif isinstance(fresh, str):
        ok = isinstance(value, str)
    else:
        ok = False
    if not ok:
        raise IncompatibleStateError(f"parameter {name!r}: snapshot field {field!r} must be a "
                                     f"{type(fresh).__name__} (as a fresh state holds), got {value!r}")
    return type(fresh)(value) if isinstance(fresh, float) else value


def persistent_fields(state: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(state) if f.metadata.get("persist", True)]


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or _backend.is_cupy_array(x)


def config_to_dict(config: Any) -> dict:
    def conv(v):
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    # an option added later (``cautious``) is written only when on: off reads as it did before the option existed
    return {f.name: conv(getattr(config, f.name)) for f in dataclasses.fields(config)
            if not (f.name in LATER_OPTIONS and getattr(config, f.name) is False)}


LATER_OPTIONS = frozenset({"cautious"})  # config fields absent from older snapshots and config keys when off


def config_from_dict(cls: type, d: Mapping) -> Any:
    current = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in current}
    return cls(**kwargs)

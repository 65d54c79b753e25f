"""Input validation shared by every optimizer: everything is checked before anything is written."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import weakref
from typing import Any, Mapping

import numpy as np

from ..errors import IncompatibleStateError as _Bad
from . import backend as _backend
from .precision import DTYPE_NAMES as LOWP_DTYPE_NAMES  # (re-exported) the dtypes of the lowered path, core.lowp
from .types import OptimizerState, OptItem

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if type(shape) is tuple:  # fast path: a tuple of non-negative Python ints is returned as is
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"parameter {name!r}: shape must be a sequence of ints, got {shape!r}") from None
    out = []
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"parameter {name!r}: shape {shape!r} must hold non-negative ints")
        out.append(int(d))
    return tuple(out)


def _address_range(a: Any) -> tuple[int, int]:
    if isinstance(a, np.ndarray):
        start = a.__array_interface__["data"][0]
    else:
        start = int(a.data.ptr)
    return start, start + a.nbytes


def check_array(name: str, what: str, a: Any, lowp: bool = False) -> str:
    """Validate one flat buffer; return its backend name.  ``lowp``: float16 and bfloat16 are accepted too (the
    driver's lowered path, ``core.lowp``)."""
    try:
        backend = _backend.backend_name(a)
    except TypeError as exc:
        raise TypeError(f"parameter {name!r}: {what} {exc}") from None
    if a.ndim != 1:
        raise ValueError(f"parameter {name!r}: {what} must be a 1-D flat buffer, got {a.ndim}-D shape {a.shape}")
    if lowp:
        if a.dtype.name not in LOWP_DTYPE_NAMES or a.dtype.kind not in "fV":
            raise TypeError(f"parameter {name!r}: {what} dtype {a.dtype} is not accepted: a parameter or gradient "
                            f"is float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64")
    elif a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"parameter {name!r}: {what} dtype must be float32 or float64, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"parameter {name!r}: {what} must be contiguous (got a strided view)")
    if not (a.flags.aligned if backend == "numpy" else _address_range(a)[0] % a.dtype.itemsize == 0):
        raise ValueError(f"parameter {name!r}: {what} is not aligned to its {a.dtype.itemsize}-byte elements "
                         f"(a view at an odd byte offset; copy it into an array of its own)")
    return backend


def check_item(name: Any, shape: Any, param: Any, grad: Any, lowp: bool = False) -> tuple[tuple[int, ...], str]:
    """Validate one (name, shape, param, grad); return the normalised shape and the backend name.  ``lowp`` (the
    driver's lowered path, ``core.lowp``): 16-bit buffers are accepted, and a gradient may have another dtype than
    its parameter."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"parameter name must be a non-empty str, got {name!r}")
    shape = check_shape(name, shape)
    pb = check_array(name, "param", param, lowp)
    gb = check_array(name, "grad", grad, lowp)
    if pb != gb:
        raise TypeError(f"parameter {name!r}: param is a {pb} array but grad is a {gb} array")
    if pb == "cupy" and param.device != grad.device:
        raise ValueError(f"parameter {name!r}: param and grad live on different GPUs")
    if param.dtype != grad.dtype and not lowp:
        raise TypeError(f"parameter {name!r}: param dtype {param.dtype} differs from grad dtype {grad.dtype}")
    n = math.prod(shape)
    if param.size != n:
        raise ValueError(f"parameter {name!r}: param has {param.size} elements but shape {shape} needs {n}")
    if grad.size != n:
        raise ValueError(f"parameter {name!r}: grad has {grad.size} elements but shape {shape} needs {n}")
    if pb == "numpy" and not param.flags.writeable:
        raise ValueError(f"parameter {name!r}: param is read-only")
    # (np.may_share_memory compares the same address bounds, in C)
    if n and (np.may_share_memory(param, grad) if pb == "numpy" else _overlap(_address_range(param),
                                                                              _address_range(grad))):
        raise ValueError(f"parameter {name!r}: param and grad share memory")
    return shape, pb


def check_items_arg(items: Any, owner: str) -> Any:
    """The ``items`` argument of ``step_batch``/``validate_batch`` as a list or tuple of items: one ``OptItem``, a
    mapping or a str (common slips: each would be read as a sequence of names) are a ``TypeError`` saying what is
    expected; any other iterable becomes a list."""
    if isinstance(items, OptItem):
        raise TypeError(f"{owner}.step_batch takes a list of OptItem, got one OptItem ({items.name!r}): pass "
                        f"[item], or call step(name, shape, param, grad)")
    if isinstance(items, (Mapping, str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{owner}.step_batch takes a list of OptItem(name, shape, param, grad), got a "
                        f"{type(items).__name__}")
    return items if isinstance(items, tuple) else list(items)


def as_item(index: int, item: Any) -> OptItem:
    """Item ``index`` of a batch as an ``OptItem`` (a 4-sequence is accepted); a ``TypeError`` says what is wrong."""
    if isinstance(item, OptItem):
        return item
    if isinstance(item, (str, bytes, Mapping)) or not isinstance(item, (tuple, list)) or len(item) != 4:
        raise TypeError(f"step_batch: item {index} must be an OptItem(name, shape, param, grad) (or such a "
                        f"4-tuple), got {type(item).__name__} {_short(item)}")
    return OptItem(*item)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def check_batch_aliasing(items: list, cache: list | None = None) -> None:
    """No param of one item may overlap any other param or grad of the batch (that would race in threads).

    ``cache`` (a list the caller keeps between batches) remembers, by weak reference, the arrays of the last batch
    that passed: a batch of the very same array objects in the same order passes again without looking up a
    thousand addresses (an ndarray's buffer cannot move while it is alive)."""
    if cache is not None:
        if len(cache) == 2 * len(items) and _same_arrays(cache, items):
            return
        cache.clear()
    spans = []
    for i, it in enumerate(items):
        if it.param.size:
            spans.append((*_address_range(it.param), i, True))
        if it.grad.size:
            spans.append((*_address_range(it.grad), i, False))
    spans.sort()
    reach_end, reach = -1, None  # the span reaching furthest so far
    for start, end, i, is_param in spans:
        if reach is not None and start < reach_end and reach[0] != i and (is_param or reach[1]):
            other = items[reach[0]].name
            raise ValueError(f"parameters {other!r} and {items[i].name!r}: buffers overlap in memory")
        if end > reach_end:
            reach_end, reach = end, (i, is_param)
    if cache is not None and all(isinstance(it.param, np.ndarray) for it in items):
        cache.extend(weakref.ref(a) for it in items for a in (it.param, it.grad))


def _same_arrays(refs: list, items: list) -> bool:
    k = 0
    for it in items:
        if refs[k]() is not it.param or refs[k + 1]() is not it.grad:
            return False
        k += 2
    return True


# The largest learning rate flatopt accepts: the largest finite float32.  Kernels and the NumPy paths cast the
# learning rate to the parameter's dtype, and float32 is the narrowest dtype flatopt steps, so a larger lr would be
# inf inside the step.  (A finite lr whose *product* with an update, a weight decay or an lr_scale overflows is
# not rejected at construction; see ``check_lr``.)
LR_MAX = float(np.finfo(np.float32).max)


def check_real(owner: str | None, field: str, value: Any) -> float:
    """The one rule every hyper-parameter obeys: a real, finite number (not a bool); returned as a float.

    ``inf``, ``-inf`` and ``nan`` are refused with a ``ValueError`` naming ``owner: field``; a non-number (a str,
    a bool, None) with a ``TypeError``.  :func:`check_range` and :func:`check_lr` build on it, so every bound,
    open or closed, is a bound on a finite number."""
    what = f"{owner}: {field}" if owner else field
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{what} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return v


def normalize_numbers(config: Any) -> None:
    """Make every number of the dataclass ``config`` a Python number, in place (its ``__post_init__`` calls this
    first): a NumPy scalar becomes its Python scalar (``np.float32(0.9)`` -> ``0.8999999761581421``), and an int in a
    field annotated ``float`` (or a tuple of floats) a float.  So a hyper-parameter never carries a NumPy dtype into
    the arithmetic or the kernel arguments derived from it (NEP 50: ``1.0 - np.float32(b)`` stays float32)."""
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        new = _python_number(v, _FLOAT_FIELD.fullmatch(ann) is not None)
        if isinstance(v, tuple):
            new = tuple(_python_number(x, _FLOAT_TUPLE.fullmatch(ann) is not None) for x in v)
        if new is not v and (type(new) is not type(v) or new != v):
            object.__setattr__(config, f.name, new)


_FLOAT_FIELD = re.compile(r"float(\s*\|\s*None)?|Optional\[float\]")
_FLOAT_TUPLE = re.compile(r"tuple\[float(,\s*(float|\.\.\.))*\](\s*\|\s*None)?")


def _python_number(v: Any, as_float: bool) -> Any:
    if isinstance(v, np.generic) and isinstance(v, (np.floating, np.integer, np.bool_)):
        v = v.item()
    if as_float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    return v


def check_lr(lr: Any, what: str = "lr", owner: str | None = None) -> float:
    """A learning rate (or a learning-rate factor): finite, ``>= 0`` and at most :data:`LR_MAX` (float32's largest
    value); the error names ``owner: what``.

    What a finite but absurd value does: an lr up to ``LR_MAX`` is accepted; where its product with another
    factor is known without looking at the data it is checked too (the driver refuses, per parameter and before
    anything changes, an ``lr · lr_scale(name)`` that is not finite in that parameter's dtype; Muon refuses an
    ``lr · s`` or ``lr · weight_decay`` that overflows float32).  A product with the *update* (lr = 1e30 times a
    gradient of 1e10) depends on values flatopt never scans inside a step (no host synchronisation): it overflows to
    ``±inf`` in the parameters, exactly as ``torch.optim`` does.  Check gradients with ``flatopt.gradients``.

    ``-0.0`` is refused as the negative number it is: its sign would reach ``-lr`` and the decay factors, where the
    compiled passes, the twins and the per-step scalar caches (keyed on values, where ``-0.0 == 0.0``) could not all
    agree."""
    v = check_range(owner, what, lr, 0.0, LR_MAX)
    if v == 0.0 and math.copysign(1.0, v) < 0:
        raise ValueError(f"{owner + ': ' if owner else ''}{what} must be >= 0, got -0.0 (a negative zero; use 0.0)")
    return v


def check_range(owner: str | None, field: str, value: Any, lo: float, hi: float, *, lo_open=False,
                hi_open=False) -> float:
    """A real, finite hyper-parameter (:func:`check_real`) in [lo, hi] (bounds open where asked; ``math.inf`` as a
    bound means "no bound", never "inf is allowed"); a clear error naming it otherwise."""
    v = check_real(owner, field, value)
    if not ((v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)):
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        what = f"{owner}: {field}" if owner else field
        raise ValueError(f"{what} must be in {lb}{lo:g}, {hi:g}{rb}, got {value!r}")
    return v


def check_snapshot(state: Any, owner: str) -> None:
    """``load_state_dict`` takes an ``OptimizerState``: a path or a plain dict (a common mistake) is a ``TypeError``
    that says how to get one (``flatopt.load(path)``), as is any other object."""
    if isinstance(state, OptimizerState):
        return
    if isinstance(state, (str, bytes, os.PathLike)):
        raise TypeError(f"{owner}.load_state_dict takes an OptimizerState, got the path {state!r}: read the file "
                        f"with flatopt.load(path) and pass what it returns")
    if isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict takes an OptimizerState, got a {type(state).__name__}: use what "
                        f"state_dict() returned, or flatopt.load(path) for a file written by flatopt.save")
    raise TypeError(f"{owner}.load_state_dict takes an OptimizerState (from state_dict() or flatopt.load(path)), "
                    f"got {type(state).__name__}")


# How deep a snapshot's JSON fields (config, config_key, per-parameter metadata, extra) may nest: far beyond what
# any optimizer writes (a Router of Routers stays under 10), low enough that no later walk of them (equality,
# json.dumps) can reach the recursion limit.
SNAPSHOT_MAX_DEPTH = 64


def check_snapshot_fields(state: OptimizerState) -> None:
    """Every field of a snapshot has the type and range a snapshot of any optimizer has, or
    :class:`~flatopt.errors.IncompatibleStateError` names the field (nothing is converted: ``"7"`` or ``2.5`` for
    an int is refused, as is ``True``).  ``step`` an int >= 0; ``config`` a dict with str keys; ``params`` a dict
    name -> dict with ``shape`` (a list of ints >= 0), ``dtype`` (float16, bfloat16, float32 or float64) and ``t``
    (an int >= 0: a state created by e.g. Sophia's ``update_hessian`` has not stepped yet); ``buffers`` a dict str
    -> array;
    ``extra`` a dict with str keys (its ``lr``, the learning rate in effect, as ``set_lr`` takes it).  What an
    algorithm keeps inside these (its scalar state, its extra counters, the buffers' shapes) is checked by the
    optimizer that loads it."""
    if not isinstance(state.algorithm, str):
        raise _Bad(f"snapshot field 'algorithm' must be a str, got {state.algorithm!r}")
    if not _is_int(state.format_version):
        raise _Bad(f"snapshot field 'format_version' must be an int, got {state.format_version!r}")
    if not _is_int(state.step) or state.step < 0:
        raise _Bad(f"snapshot field 'step' must be an int >= 0, got {state.step!r}")
    for field in ("config", "params", "buffers", "extra"):
        value = getattr(state, field)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Bad(f"snapshot field {field!r} must be a dict with str keys, got {_short(value)}")
    for field in ("config", "config_key", "params", "extra"):
        if _depth(getattr(state, field)) > SNAPSHOT_MAX_DEPTH:
            raise _Bad(f"snapshot field {field!r} nests deeper than {SNAPSHOT_MAX_DEPTH} levels")
    for name, meta in state.params.items():
        where = f"snapshot params[{name!r}]"
        if not name:
            raise _Bad("snapshot field 'params' holds an empty parameter name")
        if not isinstance(meta, dict):
            raise _Bad(f"{where} must be a dict, got {_short(meta)}")
        shape = meta.get("shape")
        if not isinstance(shape, (list, tuple)) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _Bad(f"{where}['shape'] must be a list of ints >= 0, got {_short(shape)}")
        dtype = meta.get("dtype")
        if not isinstance(dtype, str) or dtype not in LOWP_DTYPE_NAMES:
            raise _Bad(f"{where}['dtype'] must be 'float16', 'bfloat16', 'float32' or 'float64', got "
                       f"{_short(dtype)}")
        t = meta.get("t")
        if not _is_int(t) or t < 0:
            raise _Bad(f"{where}['t'] (its step count) must be an int >= 0, got {_short(t)}")
    for key, value in state.buffers.items():
        if not (isinstance(value, np.ndarray) or _backend.is_cupy_array(value)):
            raise _Bad(f"snapshot buffer {key!r} must be an array, got {_short(value)}")
    if "lr" in state.extra:
        try:
            check_lr(state.extra["lr"], "snapshot extra['lr'] (the learning rate in effect)")
        except (TypeError, ValueError) as exc:
            raise _Bad(str(exc)) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _depth(value: Any) -> int:
    """How deep dicts and lists nest in ``value`` (an explicit stack: no recursion whatever the depth)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, (list, tuple)):
            continue
        if d > deepest:
            deepest = d
            if deepest > SNAPSHOT_MAX_DEPTH:
                return deepest
        stack.extend((x, d + 1) for x in v)
    return deepest

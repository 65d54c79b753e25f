"""Input validation shared by every optimizer: everything is checked before anything is written."""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from . import backend as _backend

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


def check_array(name: str, what: str, a: Any) -> str:
    """Validate one flat buffer; return its backend name."""
    try:
        backend = _backend.backend_name(a)
    except TypeError as exc:
        raise TypeError(f"parameter {name!r}: {what} {exc}") from None
    if a.ndim != 1:
        raise ValueError(f"parameter {name!r}: {what} must be a 1-D flat buffer, got {a.ndim}-D shape {a.shape}")
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"parameter {name!r}: {what} dtype must be float32 or float64, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"parameter {name!r}: {what} must be contiguous (got a strided view)")
    return backend


def check_item(name: Any, shape: Any, param: Any, grad: Any) -> tuple[tuple[int, ...], str]:
    """Validate one (name, shape, param, grad); return the normalised shape and the backend name."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"parameter name must be a non-empty str, got {name!r}")
    shape = check_shape(name, shape)
    pb = check_array(name, "param", param)
    gb = check_array(name, "grad", grad)
    if pb != gb:
        raise TypeError(f"parameter {name!r}: param is a {pb} array but grad is a {gb} array")
    if pb == "cupy" and param.device != grad.device:
        raise ValueError(f"parameter {name!r}: param and grad live on different GPUs")
    if param.dtype != grad.dtype:
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


def check_lr(lr: Any, what: str = "lr") -> float:
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
        raise TypeError(f"{what} must be a real number, got {lr!r}")
    lr = float(lr)
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {lr!r}")
    return lr


def check_range(owner: str, field: str, value: Any, lo: float, hi: float, *, lo_open=False, hi_open=False) -> float:
    """A real hyper-parameter in [lo, hi] (bounds open where asked); a clear error naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{owner}: {field} must be a real number, got {value!r}")
    v = float(value)
    ok = math.isfinite(v) or (hi == math.inf and v == math.inf and not hi_open)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"{owner}: {field} must be in {lb}{lo}, {hi}{rb}, got {value!r}")
    return v

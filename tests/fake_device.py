"""A NumPy-backed stand-in for CuPy's array module, for tests on machines without a GPU.

``xp = FakeDevice()`` is not ``numpy``, so flatopt takes its CuPy branches (one block per pass, data-dependent
scalars kept as 0-d arrays); every array it returns is a :class:`DeviceArray`, which refuses the conversions that
would synchronise a real device with the host (``bool``, ``float``, ``int``, ``item``, ``tolist``): a step that
runs here without :class:`HostSync` keeps its scalars on the device.  Every module function and ufunc call is
checked against CuPy 14's real signature (``tests/cuda_emu/cupy_api.py``: ``einsum(out=)`` is a ``TypeError`` as on
CuPy, a name CuPy lacks an ``AttributeError``).  What it cannot check: CUDA kernels (run the twins:
``use_cuda_kernel=False`` / ``FLATOPT_FORCE_TWIN=1``), the execution on streams (its streams only record
``record``/``wait_event`` calls and which one is current), and CuPy's array methods; for those, and for a
stand-in whose arrays are not NumPy arrays, see ``tests/cuda_emu/fakecupy.py`` (the emulated GPU of test_gpu.py).
"""

from __future__ import annotations

import threading

import numpy as np

from .cuda_emu import cupy_api


class HostSync(AssertionError):
    """A device value was read on the host."""


class DeviceArray(np.ndarray):
    def __array_wrap__(self, obj, context=None, return_scalar=False):  # 0-d results stay arrays (CuPy's rule)
        return np.asarray(obj).view(DeviceArray)

    def _sync(self, *_a, **_k):
        raise HostSync("a device value was read on the host")

    __bool__ = __float__ = __int__ = __complex__ = item = tolist = _sync


def _wrap(r):
    if isinstance(r, np.ndarray):
        return r.view(DeviceArray)
    if isinstance(r, np.generic):
        return np.asarray(r).view(DeviceArray)
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    return r


class _Device:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, stream):
        self.stream = stream


class _Stream:
    """A stream that records what is asked of it (``record``, ``wait_event``) and is current inside ``with``."""

    def __init__(self, null=False, non_blocking=False):
        self.null, self.non_blocking, self.calls = null, non_blocking, []
        self.ptr = 0 if null else id(self)  # CuPy's handle (core.workspace keys its buffers by stream)

    def __enter__(self):
        _current.stack = getattr(_current, "stack", []) + [self]
        return self

    def __exit__(self, *exc):
        _current.stack = _current.stack[:-1]
        return False

    def record(self, event=None):
        ev = _Event(self)
        self.calls.append(("record", ev))
        return ev

    def wait_event(self, event):
        self.calls.append(("wait", event))


_current = threading.local()
NULL_STREAM = _Stream(null=True)


class _Cuda:
    Stream = _Stream

    @staticmethod
    def Device(_i=None):  # noqa: N802 - CuPy's name
        return _Device()

    @staticmethod
    def get_current_stream(_device_id=-1):
        stack = getattr(_current, "stack", [])
        return stack[-1] if stack else NULL_STREAM


class FakeDevice:
    """The array module (see the module documentation)."""

    cuda = _Cuda()
    ndarray = DeviceArray

    def __getattr__(self, name):
        if not name.startswith("__") and not cupy_api.has(name):
            raise AttributeError(f"module 'cupy' has no attribute {name!r} (real CuPy 14 lacks it)")
        obj = getattr(np, name)
        if callable(obj) and not isinstance(obj, type):
            def call(*a, **k):
                cupy_api.check(name, a, k)
                return _wrap(obj(*a, **k))
            call.__name__ = name
            return call
        return obj

    def asnumpy(self, a):
        return np.asarray(a).view(np.ndarray).copy()


def solve_triangular(a, b, trans=0, lower=False, check_finite=True):
    """``cupyx.scipy.linalg.solve_triangular`` for the stand-in (a dense solve: tests only)."""
    a = np.asarray(a).view(np.ndarray)
    a = np.tril(a) if lower else np.triu(a)
    if trans in ("T", 1):
        a = a.T
    return _wrap(np.linalg.solve(a.astype(np.float64), np.asarray(b).view(np.ndarray).astype(np.float64)).astype(b.dtype))

"""A CuPy stand-in as strict as CuPy 14, backed by NumPy, whose fused kernels run on the CUDA emulator.

:func:`install` puts it in ``sys.modules`` as ``cupy`` (and ``cupyx.scipy.linalg``) and into ``flatopt.core.backend``,
so flatopt takes its CuPy path unchanged: its arrays are :class:`ndarray` (not NumPy arrays), ``RawModule`` /
``get_function`` compile nothing but hand out the emulator's kernels (``emu.py``), and flatopt's own launch code
(``core.kernels.get``, ``core.backend.launch``, the direct ``kernel(grid, block, args)`` calls) runs.

Strictness (what real CuPy rejects, this rejects):

* every module function, ufunc, ufunc method and ``ndarray`` method is checked against CuPy 14's real signature
  (``cupy_api.py``; e.g. ``einsum(out=)`` raises ``TypeError``), and a name real CuPy lacks is an ``AttributeError``;
* a NumPy array is not a device array: mixing one into a ufunc, operator or function raises ``TypeError``, and
  ``numpy.asarray(device_array)`` raises ``TypeError`` (CuPy forbids the implicit conversion);
* ``empty`` / ``empty_like`` memory is poisoned (all bytes 0xff: NaN for floats), so a read of uninitialised memory
  shows up.

``exp2``, ``log2``, ``log``, ``cos`` and ``sin`` compute with the emulated kernels' math library (the C library's
``exp2f``/``log2``/``logf``/``cosf``/``sinf`` and their double versions): on a GPU, CuPy's ufuncs and the kernels
share CUDA's, whereas NumPy's SIMD ``exp2`` differs from glibc's in the last bit for about 20% of float32 inputs, which
would make a kernel-vs-twin comparison fail for the emulator's sake.

Counting (:data:`stats`): operations (one per CuPy call that computes on the device: ufunc, reduction, copy, fill,
operator...), fused kernel launches (``emu.stats``), host synchronisations (``get``, ``asnumpy``, ``item``, ``float``,
``bool``..., ``synchronize``), stream and event calls, allocations.  :func:`forbid_sync` turns a host
synchronisation into :class:`HostSync`.  Streams and events are recorded, not simulated: kernels run in issue
order, one at a time (a legal schedule), so a missing event cannot be detected here.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
import types

import numpy as np

from . import cupy_api, emu


class HostSync(RuntimeError):
    """A device value was read on the host while :func:`forbid_sync` was active."""


class Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.ops = 0
        self.syncs = 0
        self.sync_sites: list[str] = []
        self.allocs = 0
        self.stream_calls = 0
        self.launches_at_reset = emu.stats.launches
        # seconds spent inside the stand-in's CuPy calls (its signature checks and the NumPy arithmetic standing in
        # for device work: GEMMs, ufuncs, reductions, copies, solves): benchmarks.gpu_host subtracts it to time
        # flatopt's own host side (its time model adds a real CuPy call's cost per launch instead)
        self.call_s = 0.0

    @property
    def launches(self):
        """Fused kernel launches since the last reset."""
        return emu.stats.launches - self.launches_at_reset


stats = Stats()
_forbid = threading.local()


@contextlib.contextmanager
def forbid_sync():
    old = getattr(_forbid, "on", False)
    _forbid.on = True
    try:
        yield
    finally:
        _forbid.on = old


def _sync(what):
    if getattr(_forbid, "on", False):
        raise HostSync(f"a device value was read on the host ({what})")
    stats.syncs += 1
    f = sys._getframe(2)  # noqa: SLF001
    stats.sync_sites.append(f"{what} at {f.f_code.co_filename}:{f.f_lineno}")


# ------------------------------------------------------------------------------------------------------------
# wrapping and unwrapping
# ------------------------------------------------------------------------------------------------------------


def _unwrap(x, outs, what):
    if isinstance(x, ndarray):
        outs[id(x._a)] = x
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"{what}: Unsupported type <class 'numpy.ndarray'> (a host array given to CuPy)")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, outs, what) for v in x)
    return x


def _wrap(r, outs):
    if isinstance(r, np.ndarray):
        w = outs.get(id(r))
        if w is not None and w._a is r:
            return w
        return ndarray._of(r)
    if isinstance(r, np.generic):  # CuPy never returns NumPy scalars: 0-d device arrays
        return ndarray._of(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v, outs) for v in r)
    if isinstance(r, list):
        return [_wrap(v, outs) for v in r]
    return r


def _call(qualname, fn, args, kwargs, *, host_ok=False):
    t0 = time.perf_counter()
    try:
        return _call_timed(qualname, fn, args, kwargs, host_ok)
    finally:
        stats.call_s += time.perf_counter() - t0


def _call_timed(qualname, fn, args, kwargs, host_ok):
    cupy_api.check(qualname, args, kwargs)
    outs: dict = {}
    if host_ok:
        a = tuple(x._a if isinstance(x, ndarray) else x for x in args)
        k = {n: (v._a if isinstance(v, ndarray) else v) for n, v in kwargs.items()}
    else:
        a = _unwrap(tuple(args), outs, f"cupy.{qualname}")
        k = {n: _unwrap(v, outs, f"cupy.{qualname}") for n, v in kwargs.items()}
    stats.ops += 1
    return _wrap(fn(*a, **k), outs)


def _poison(a: np.ndarray) -> np.ndarray:
    if a.size:
        (a if a.flags.c_contiguous else a.T).view(np.uint8).reshape(-1).fill(0xFF)
    return a


# ------------------------------------------------------------------------------------------------------------
# devices, streams, events, memory
# ------------------------------------------------------------------------------------------------------------


class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise RuntimeError("cudaErrorInvalidDevice: the emulated machine has one device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def synchronize(self):
        _sync("Device.synchronize")

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        stats.stream_calls += 1
        self.recorded = True

    def synchronize(self):
        _sync("Event.synchronize")

    @property
    def done(self):
        _sync("Event.done")
        return True


_streams = threading.local()


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.non_blocking = non_blocking
        self.device_id = 0
        self.ptr = 0 if null else id(self)

    def __enter__(self):
        stack = _streams.__dict__.setdefault("stack", [])
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _streams.stack.pop()
        return False

    def record(self, event=None):
        stats.stream_calls += 1
        ev = event or Event()
        ev.recorded = True
        return ev

    def wait_event(self, event):
        stats.stream_calls += 1
        if not isinstance(event, Event) or not event.recorded:
            raise RuntimeError("wait_event on an event that was never recorded")

    def synchronize(self):
        _sync("Stream.synchronize")

    def use(self):
        return self


Stream.null = Stream(null=True)


def get_current_stream(device_id=-1):
    stack = getattr(_streams, "stack", None)
    return stack[-1] if stack else Stream.null


class _Runtime:
    @staticmethod
    def getDeviceCount():  # noqa: N802 - CuPy's name
        return 1


class _Memory:
    def __init__(self, ptr):
        self.ptr = ptr


class MemoryPointer:
    def __init__(self, ptr):
        self.ptr = ptr
        self.device_id = 0


# ------------------------------------------------------------------------------------------------------------
# kernels: RawModule -> the emulator
# ------------------------------------------------------------------------------------------------------------


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            raise NotImplementedError("the stand-in emulates flatopt's RawModule(code=...) sources only")
        m = re.match(r'#line 1 "([^"]+)"', code)
        if not m:
            raise ValueError("the stand-in maps a RawModule to a .cu file through its leading #line directive")
        self.filename = m.group(1).replace("\\", "/").rsplit("/", 1)[-1]
        self.name_expressions = tuple(name_expressions or ())
        self.options = tuple(options)

    def get_function(self, name):
        if name not in self.name_expressions:
            raise KeyError(f"{name!r} is not one of the RawModule's name_expressions (CuPy: nvrtcGetLoweredName "
                           f"fails)")
        return emu.get(self.filename, name)


# ------------------------------------------------------------------------------------------------------------
# ndarray
# ------------------------------------------------------------------------------------------------------------

_OWN = {"_a", "__class__", "__dict__"}


def _binop(ufunc_name, reflected=False, inplace=False):
    uf = getattr(np, ufunc_name)

    def op(self, other):
        if isinstance(other, np.ndarray):
            raise TypeError(f"Unsupported type <class 'numpy.ndarray'> (operand of {ufunc_name})")
        if not isinstance(other, (ndarray, int, float, complex, bool, np.generic)):
            return NotImplemented
        o = other._a if isinstance(other, ndarray) else other
        stats.ops += 1
        t0 = time.perf_counter()
        if inplace:
            uf(self._a, o, out=self._a)
        else:
            r = uf(o, self._a) if reflected else uf(self._a, o)
        stats.call_s += time.perf_counter() - t0
        return self if inplace else ndarray._of(np.asarray(r))

    return op


class ndarray:  # noqa: N801 - CuPy's name
    """A device array: NumPy storage behind CuPy's interface (no implicit conversion to NumPy)."""

    __slots__ = ("_a", "__weakref__")
    _cuda_emu_device_array = True
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = _poison(np.empty(shape, dtype, order=order))
        stats.allocs += 1

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        obj = object.__new__(cls)
        obj._a = a
        return obj

    # --- attributes
    def _set_shape(self, shape):  # CuPy's setter: an in-place reshape without copy (strides, dtype: read-only)
        self._a.shape = shape

    shape = property(lambda self: self._a.shape, _set_shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T))
    device = property(lambda self: Device(0))
    data = property(lambda self: MemoryPointer(self._a.__array_interface__["data"][0]))
    base = property(lambda self: None if self._a.base is None else ndarray._of(np.asarray(self._a.base)))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"fakecupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    # --- host transfers (synchronise)
    def get(self, stream=None, order="C", out=None, blocking=True):
        _sync("ndarray.get")
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("ndarray.set takes a numpy.ndarray")
        self._a[...] = arr

    def item(self):
        _sync("ndarray.item")
        return self._a.item()

    def tolist(self):
        _sync("ndarray.tolist")
        return self._a.tolist()

    def __float__(self):
        _sync("float()")
        return float(self._a)

    def __int__(self):
        _sync("int()")
        return int(self._a)

    def __bool__(self):
        _sync("bool()")
        return bool(self._a)

    def __index__(self):
        _sync("index()")
        return self._a.__index__()

    def __complex__(self):
        _sync("complex()")
        return complex(self._a)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    # --- indexing
    def __getitem__(self, key):
        key = _unwrap(key, {}, "ndarray.__getitem__")
        r = self._a[key]
        if isinstance(r, np.ndarray) and np.shares_memory(r, self._a) is False and r.size:
            stats.ops += 1  # advanced indexing: a gather
        return ndarray._of(np.asarray(r)) if not isinstance(r, np.ndarray) else ndarray._of(r)

    def __setitem__(self, key, value):
        key = _unwrap(key, {}, "ndarray.__setitem__")
        if isinstance(value, np.ndarray):
            raise TypeError("Unsupported type <class 'numpy.ndarray'> (assigning a host array into a device array)")
        stats.ops += 1
        t0 = time.perf_counter()
        self._a[key] = value._a if isinstance(value, ndarray) else value
        stats.call_s += time.perf_counter() - t0

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # --- every other method: CuPy's signature, NumPy's computation
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if not cupy_api.has(f"ndarray.{name}"):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (real CuPy 14 lacks it)")
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr, {})

        def method(*args, **kwargs):
            return _call(f"ndarray.{name}", attr, args, kwargs)

        return method

    # --- operators (CuPy's ufuncs)
    __add__, __radd__, __iadd__ = _binop("add"), _binop("add", True), _binop("add", inplace=True)
    __sub__, __rsub__, __isub__ = _binop("subtract"), _binop("subtract", True), _binop("subtract", inplace=True)
    __mul__, __rmul__, __imul__ = _binop("multiply"), _binop("multiply", True), _binop("multiply", inplace=True)
    __truediv__, __rtruediv__ = _binop("true_divide"), _binop("true_divide", True)
    __itruediv__ = _binop("true_divide", inplace=True)
    __floordiv__, __rfloordiv__ = _binop("floor_divide"), _binop("floor_divide", True)
    __mod__, __rmod__ = _binop("remainder"), _binop("remainder", True)
    __pow__, __rpow__, __ipow__ = _binop("power"), _binop("power", True), _binop("power", inplace=True)
    __matmul__, __rmatmul__ = _binop("matmul"), _binop("matmul", True)
    __and__, __rand__, __iand__ = _binop("bitwise_and"), _binop("bitwise_and", True), _binop("bitwise_and", inplace=True)
    __or__, __ror__, __ior__ = _binop("bitwise_or"), _binop("bitwise_or", True), _binop("bitwise_or", inplace=True)
    __xor__, __rxor__ = _binop("bitwise_xor"), _binop("bitwise_xor", True)
    __lshift__, __rshift__ = _binop("left_shift"), _binop("right_shift")
    __lt__, __le__, __gt__, __ge__ = _binop("less"), _binop("less_equal"), _binop("greater"), _binop("greater_equal")
    __eq__, __ne__ = _binop("equal"), _binop("not_equal")
    __hash__ = None

    def __neg__(self):
        stats.ops += 1
        return ndarray._of(np.asarray(-self._a))

    def __pos__(self):
        return self

    def __abs__(self):
        stats.ops += 1
        return ndarray._of(np.asarray(abs(self._a)))

    def __invert__(self):
        stats.ops += 1
        return ndarray._of(np.asarray(~self._a))

    # NumPy functions on device arrays: CuPy dispatches them to itself (NEP 13/18)
    def __array_ufunc__(self, uf, method, *inputs, **kwargs):
        target = getattr(module, uf.__name__)
        if method != "__call__":
            target = getattr(target, method)
        return target(*inputs, **kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        name = func.__name__
        if not cupy_api.has(name):
            return NotImplemented
        return getattr(module, name)(*args, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------------------------


_DEVICE_MATH = ("exp2", "log2", "log", "cos", "sin")  # computed with the emulated kernels' math library


class _Ufunc:
    def __init__(self, name):
        self.__name__ = self.name = name
        self._np = getattr(np, name)
        self.nin, self.nout = self._np.nin, self._np.nout

    def __call__(self, *args, **kwargs):
        if self.name in _DEVICE_MATH and args and isinstance(args[0], ndarray):
            x = np.array(args[0]._a)  # before an out= that aliases it is written
            r = _call(self.name, self._np, args, kwargs)
            if isinstance(r, ndarray):
                emu.devmath(self.name, x, r._a)  # the kernels' math library, as on a device
            return r
        return _call(self.name, self._np, args, kwargs)

    def __getattr__(self, method):
        if method.startswith("_") or not cupy_api.has(f"{self.name}.{method}"):
            raise AttributeError(f"cupy.{self.name} has no attribute {method!r}")
        fn = getattr(self._np, method)
        return lambda *a, **k: _call(f"{self.name}.{method}", fn, a, k)

    def __repr__(self):
        return f"<ufunc 'cupy_{self.name}' (stand-in)>"


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    cupy_api.check("asarray", (a,), dict(dtype=dtype, order=order, copy=copy, blocking=blocking))
    if isinstance(a, ndarray):
        r = np.asarray(a._a, dtype=dtype, order=order)
        return a if r is a._a else ndarray._of(r)
    stats.allocs += 1
    stats.ops += 1
    return ndarray._of(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    cupy_api.check("array", (obj,), dict(dtype=dtype, copy=copy, order=order, subok=subok, ndmin=ndmin,
                                         blocking=blocking))
    src = obj._a if isinstance(obj, ndarray) else obj
    stats.allocs += 1
    stats.ops += 1
    return ndarray._of(np.array(src, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C"):
    cupy_api.check("empty", (shape,), dict(dtype=dtype, order=order))
    stats.allocs += 1
    return ndarray._of(_poison(np.empty(shape, dtype, order=order)))


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    cupy_api.check("empty_like", (prototype,), dict(dtype=dtype, order=order, subok=subok, shape=shape))
    if not isinstance(prototype, ndarray):
        raise TypeError("cupy.empty_like: Unsupported type (a host array)")
    stats.allocs += 1
    return ndarray._of(_poison(np.empty_like(prototype._a, dtype=dtype, order=order, shape=shape)))


_CREATION_HOST_OK = {"zeros", "ones", "full", "arange", "eye", "linspace", "identity", "tri"}


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if not cupy_api.has(name):
            raise AttributeError(f"module 'cupy' has no attribute {name!r} (real CuPy 14 lacks it)")
        obj = getattr(np, name, None)
        if obj is None:
            raise AttributeError(f"the stand-in does not implement cupy.{name}")
        if isinstance(obj, np.ufunc):
            uf = _Ufunc(name)
            self.__dict__[name] = uf
            return uf
        if isinstance(obj, type) or not callable(obj):
            return obj
        host_ok = name in _CREATION_HOST_OK

        def fn(*args, **kwargs):
            return _call(name, obj, args, kwargs, host_ok=host_ok)

        fn.__name__ = name
        self.__dict__[name] = fn
        return fn


module = _Module("cupy", __doc__)
module.__file__ = __file__
module.ndarray = ndarray
ndarray.__module__ = "cupy"
for _name in ("asarray", "array", "asnumpy", "empty", "empty_like", "RawModule", "get_current_stream"):
    setattr(module, _name, globals()[_name])
cuda = types.ModuleType("cupy.cuda")
cuda.Device, cuda.Stream, cuda.Event = Device, Stream, Event
cuda.get_current_stream = get_current_stream
cuda.runtime = _Runtime()
module.cuda = cuda


class _RandomState:
    """``cupy.random.RandomState`` (a NumPy generator here: CuPy's curand stream differs from NumPy's anyway)."""

    def __init__(self, seed=None, method=None):
        if seed is not None and not isinstance(seed, (int, np.integer)):
            raise TypeError("seed must be an integer")
        self._rs = np.random.RandomState(None if seed is None else int(seed) % (1 << 32))

    def standard_normal(self, size=None, dtype=float):
        stats.ops += 1
        return ndarray._of(np.asarray(self._rs.standard_normal(size).astype(dtype)))


random = types.ModuleType("cupy.random")
random.RandomState = _RandomState
module.random = random


def _solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=False):
    t0 = time.perf_counter()
    a_, b_ = a._a, b._a
    a_ = np.tril(a_) if lower else np.triu(a_)
    if unit_diagonal:
        np.fill_diagonal(a_, 1)
    if trans in ("T", 1, "C", 2):
        a_ = a_.T
    stats.ops += 1
    r = np.linalg.solve(a_.astype(np.float64), b_.astype(np.float64)).astype(b_.dtype)
    stats.call_s += time.perf_counter() - t0
    return ndarray._of(r)


# cupy.linalg: the functions flatopt calls (SOAP's eigenbasis, Stiefel's and SOAP's QR), held to CuPy's signatures;
# computed by NumPy's LAPACK in the input's dtype (cuSOLVER's results differ in rounding and, for eigenvectors, in
# sign: the tests that compare with NumPy allow for both), no host synchronisation.
linalg = types.ModuleType("cupy.linalg")
for _name in ("eigh", "qr", "norm"):
    def _linalg_fn(*args, _name=_name, **kwargs):
        def run(*a, **k):
            out = getattr(np.linalg, _name)(*a, **k)
            cast = a[0].dtype if _name != "norm" else None  # NumPy may widen a float32 QR; CuPy keeps the dtype
            if isinstance(out, tuple):
                return tuple(o.astype(cast, copy=False) if cast is not None else o for o in out)
            return out.astype(cast, copy=False) if cast is not None else out
        return _call(f"linalg.{_name}", run, args, kwargs)
    _linalg_fn.__name__ = _name
    setattr(linalg, _name, _linalg_fn)
module.linalg = linalg

cupyx = types.ModuleType("cupyx")
cupyx.scipy = types.ModuleType("cupyx.scipy")
cupyx.scipy.linalg = types.ModuleType("cupyx.scipy.linalg")
cupyx.scipy.linalg.solve_triangular = _solve_triangular


@contextlib.contextmanager
def _allow_synchronize(allow):
    """cupyx.allow_synchronize(allow): inside ``allow_synchronize(False)`` a host synchronisation raises."""
    if allow:
        yield
    else:
        with forbid_sync():
            yield


cupyx.allow_synchronize = _allow_synchronize

_MODULES = {"cupy": module, "cupy.cuda": cuda, "cupy.random": random, "cupy.linalg": linalg, "cupyx": cupyx,
            "cupyx.scipy": cupyx.scipy,
            "cupyx.scipy.linalg": cupyx.scipy.linalg}


@contextlib.contextmanager
def installed():
    """``cupy`` is the stand-in inside the block (sys.modules and ``flatopt.core.backend``); restored afterwards."""
    from flatopt.core import backend as _backend  # noqa: PLC0415
    from flatopt.core import workspace as _workspace  # noqa: PLC0415

    # flatopt caches device buffers by device id (0 here, as for tests/fake_device.FakeDevice): the per-thread
    # workspace of this thread and the uploaded device constants (quantization maps, APOLLO's normal table) must not
    # leak between the two stand-ins
    saved = {k: sys.modules.get(k) for k in _MODULES}
    saved_cupy, saved_modules = _backend._cupy, dict(_backend._modules)  # noqa: SLF001
    saved_constants = dict(_backend._constants)  # noqa: SLF001
    sys.modules.update(_MODULES)
    _backend._cupy = module  # noqa: SLF001
    _backend._modules.clear()  # noqa: SLF001
    _backend._constants.clear()  # noqa: SLF001
    _workspace.clear()
    try:
        yield module
    finally:
        _workspace.clear()
        _backend._constants.clear()  # noqa: SLF001
        _backend._constants.update(saved_constants)  # noqa: SLF001
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        _backend._cupy = saved_cupy  # noqa: SLF001
        _backend._modules.clear()  # noqa: SLF001
        _backend._modules.update(saved_modules)  # noqa: SLF001


def device_or_emulated():
    """The body of a module-scoped autouse fixture (tests/test_gpu.py, tests/test_multi_tensor.py): the real GPU
    when one answers; otherwise CuPy is this stand-in and the kernels run on the emulator."""
    import pytest  # noqa: PLC0415 - test-only helper

    from flatopt.core import backend as _backend  # noqa: PLC0415

    if _backend.gpu_available():
        yield "gpu"
        return
    why = emu.available()
    if why:
        pytest.skip(f"no CUDA device answers and {why}")
    with installed():
        yield "emulated"

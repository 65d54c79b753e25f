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
synchronisation into :class:`HostSync`.

Devices (:data:`NDEVICES` of them, as on a two-GPU machine without peer access): ``cupy.cuda.Device(i)``, a current
device per thread (``with Device(1):`` restores the previous one on exit, ``Device.use()``), a current stream per
thread and per device (``with stream:`` raises for a stream of another device), ``Stream.null`` the legacy default
stream of whatever device is current.  Every array remembers the device it was allocated on (``a.device``,
``a.data.device_id``; a view, its base's).  A CuPy operation that combines an array of another device than the current
one raises ``ValueError`` (CuPy without peer access), and a fused kernel launch given such an array, directly or as an
address in a ``const long long*`` table (flatopt's multi-tensor tables), raises :class:`IllegalAddress` (real CUDA:
``cudaErrorIllegalAddress``, which kills the process's context, or silent peer traffic).

Streams and events: kernels and operations run at once, in issue order, one at a time (a legal schedule of any set
of streams), so a missing event never changes a result here.  The happens-before race detector (``hazards.py``,
:func:`race_detector`) sees it: every operation and launch reports the memory it reads and writes on its stream, and
an access not ordered after a conflicting one is a hazard.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import re
import sys
import threading
import time
import types
import weakref

import numpy as np

from . import cupy_api, emu
from .hazards import detector, null_key

NDEVICES = 2  # devices of the emulated machine (no peer access between them)


class HostSync(RuntimeError):
    """A device value was read on the host while :func:`forbid_sync` was active."""


class IllegalAddress(emu.EmulatorError):
    """A kernel was launched with the memory of another device than the current one (cudaErrorIllegalAddress)."""


class CUDARuntimeError(RuntimeError):
    """``cupy_backends.cuda.api.runtime.CUDARuntimeError``."""


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


def _call(qualname, fn, args, kwargs, *, host_ok=False, nin=None, self_arr=None):
    t0 = time.perf_counter()
    try:
        if self_arr is not None:  # a method: the array itself is an operand (CuPy runs a copy on the array's device,
            # anything else on the current device)
            if qualname == "ndarray.copy":
                with Device(_alloc(self_arr._a).dev):
                    return _call_timed(qualname, fn, (self_arr, *args), kwargs, host_ok, nin, method=True)
            return _call_timed(qualname, fn, (self_arr, *args), kwargs, host_ok, nin, method=True)
        return _call_timed(qualname, fn, args, kwargs, host_ok, nin)
    finally:
        stats.call_s += time.perf_counter() - t0


def _call_timed(qualname, fn, args, kwargs, host_ok, nin=None, method=False):
    if method:  # fn is the bound NumPy method: the array was prepended for the checks only
        self_arr, args = args[0], args[1:]
    cupy_api.check(qualname, args, kwargs)
    outs: dict = {}
    if method:
        outs[id(self_arr._a)] = self_arr
    if host_ok:
        a = tuple(x._a if isinstance(x, ndarray) else x for x in args)
        k = {n: (v._a if isinstance(v, ndarray) else v) for n, v in kwargs.items()}
    else:
        a = _unwrap(tuple(args), outs, f"cupy.{qualname}")
        k = {n: _unwrap(v, outs, f"cupy.{qualname}") for n, v in kwargs.items()}
    view = qualname in _NO_KERNEL or qualname.replace("ndarray.", "") in _NO_KERNEL
    if outs and not view:
        _same_device([w._a for w in outs.values()], f"cupy.{qualname}")
    stats.ops += 1
    r = _wrap(fn(*a, **k), outs)
    if detector.enabled and not view:
        written = [k.get("out")]
        if nin is not None:
            written.extend(a[nin:])
        for i in _INPLACE.get(qualname, ()):
            written.append(self_arr._a if i == -1 else a[i] if i < len(a) else None)
        _record_call(qualname, [w._a for w in outs.values()], written, r)
    return r


# CuPy calls that launch nothing (views, metadata) and calls that write into an argument (its index)
_NO_KERNEL = {"reshape", "ravel", "view", "transpose", "squeeze", "swapaxes", "moveaxis", "expand_dims",
              "broadcast_to", "atleast_1d", "atleast_2d", "atleast_3d", "shares_memory", "may_share_memory",
              "result_type", "can_cast", "get_array_module", "split", "array_split", "tolist", "item"}
_INPLACE = {"copyto": (0,), "ndarray.fill": (-1,), "ndarray.sort": (-1,), "putmask": (0,), "place": (0,),
            "put": (0,)}


def _arrays_in(x, into):
    if isinstance(x, ndarray):
        into.append(x._a)
    elif isinstance(x, np.ndarray):
        into.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _arrays_in(v, into)
    return into


def _record_call(what, inputs, written, result):
    """The accesses of one CuPy operation on the current stream: its inputs read, its outputs (``written``, and every
    result that is not a view of an input: a new allocation) written."""
    writes = _arrays_in(written, [])
    owners = {id(_owner(x)) for x in inputs}
    for x in _arrays_in(result, []):
        if id(_owner(x)) not in owners:
            writes.append(x)
    _op([x for x in inputs], writes, what)


def _poison(a: np.ndarray) -> np.ndarray:
    if a.size:
        (a if a.flags.c_contiguous else a.T).view(np.uint8).reshape(-1).fill(0xFF)
    return a


# ------------------------------------------------------------------------------------------------------------
# devices, streams, events, memory
# ------------------------------------------------------------------------------------------------------------


_dev_tls = threading.local()


def _current_device() -> int:
    return getattr(_dev_tls, "id", 0)


class Device:
    def __init__(self, device=None):
        self.id = _current_device() if device is None else int(device)
        if not 0 <= self.id < NDEVICES:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal (the emulated machine has "
                                   f"{NDEVICES} devices)")

    def __enter__(self):  # CuPy: the previous device is restored on exit
        _dev_tls.__dict__.setdefault("stack", []).append(_current_device())
        _dev_tls.id = self.id
        return self

    def __exit__(self, *exc):
        _dev_tls.id = _dev_tls.stack.pop()
        return False

    def use(self):
        _dev_tls.id = self.id

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def synchronize(self):
        _sync("Device.synchronize")
        if detector.enabled:
            detector.host_wait_device(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False
        self.clock = None

    def record(self, stream=None):
        stats.stream_calls += 1
        stream = get_current_stream() if stream is None else stream
        self.recorded = True
        self.clock = detector.record(stream._hb()) if detector.enabled else None

    def synchronize(self):
        _sync("Event.synchronize")
        if detector.enabled:
            detector.host_wait(self.clock)

    @property
    def done(self):
        _sync("Event.done")
        if detector.enabled:
            detector.host_wait(self.clock)
        return True


_streams = threading.local()
_stream_serial = itertools.count(1)


def _stream_stack(device: int) -> list:
    stacks = _streams.__dict__.setdefault("stacks", {})
    return stacks.setdefault(device, [])


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.non_blocking = non_blocking
        self.device_id = -1 if null else _current_device()  # CuPy's null stream: the current device's
        self.ptr = 0 if null else id(self)
        self._key = None if null else next(_stream_serial)
        if not null:
            detector.stream(self._key, self.device_id, "nonblocking" if non_blocking else "blocking")

    def _hb(self) -> int:
        """The race detector's key of this stream (the null stream: the current device's)."""
        return null_key(_current_device()) if self._key is None else self._key

    def __enter__(self):
        dev = _current_device()
        if self.device_id not in (-1, dev):
            raise RuntimeError(f"the current device is {dev}, the stream's is {self.device_id} (CuPy: with stream: "
                               f"needs the stream's device current)")
        _stream_stack(dev).append(self)
        _streams.__dict__.setdefault("entered", []).append(dev)
        return self

    def __exit__(self, *exc):
        _stream_stack(_streams.entered.pop()).pop()
        return False

    def record(self, event=None):
        ev = event or Event()
        ev.record(self)
        return ev

    def wait_event(self, event):
        stats.stream_calls += 1
        if not isinstance(event, Event) or not event.recorded:
            raise RuntimeError("wait_event on an event that was never recorded")
        if detector.enabled:
            detector.wait(self._hb(), event.clock)

    def synchronize(self):
        _sync("Stream.synchronize")
        if detector.enabled:
            detector.host_wait_stream(self._hb())

    def use(self):
        return self


Stream.null = Stream(null=True)
for _d in range(NDEVICES):
    detector.stream(null_key(_d), _d, "null")


def get_current_stream(device_id=-1):
    stack = _stream_stack(_current_device() if device_id == -1 else device_id)
    return stack[-1] if stack else Stream.null


class _Runtime:
    @staticmethod
    def getDeviceCount():  # noqa: N802 - CuPy's name
        return NDEVICES

    @staticmethod
    def getDevice():  # noqa: N802 - CuPy's name
        return _current_device()

    @staticmethod
    def setDevice(device):  # noqa: N802 - CuPy's name
        Device(device).use()


class _Memory:
    def __init__(self, ptr):
        self.ptr = ptr


class MemoryPointer:
    def __init__(self, ptr, device_id):
        self.ptr = ptr
        self.device_id = device_id


# ------------------------------------------------------------------------------------------------------------
# allocations: the device each array's memory lives on, the allocating stream, the race detector's accesses
# ------------------------------------------------------------------------------------------------------------


class _Alloc:
    __slots__ = ("serial", "dev", "stream", "lo", "hi")

    def __init__(self, serial, dev, stream, lo, hi):
        self.serial, self.dev, self.stream, self.lo, self.hi = serial, dev, stream, lo, hi


_allocs: dict[int, _Alloc] = {}  # id(the NumPy array owning the memory) -> its allocation
_starts: dict[int, _Alloc] = {}  # an allocation's first address -> it (addresses held in device tables)
_alloc_serial = itertools.count(1)


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _alloc(a: np.ndarray) -> _Alloc:
    """The allocation holding ``a``'s memory: an unknown owner is a new allocation on the current device and stream
    (every device array is made by a stand-in call running there)."""
    o = _owner(a)
    rec = _allocs.get(id(o))
    if rec is None:
        lo = o.__array_interface__["data"][0]
        stream = get_current_stream()._hb()
        rec = _allocs[id(o)] = _Alloc(next(_alloc_serial), _current_device(), stream, lo, lo + o.nbytes)
        if o.nbytes:
            _starts[lo] = rec
        weakref.finalize(o, _released, id(o), rec)
        if detector.enabled:
            detector.allocated(rec.serial, rec.lo, rec.hi, stream)
    return rec


def _released(oid, rec):
    if _allocs.get(oid) is rec:
        del _allocs[oid]
    if _starts.get(rec.lo) is rec:
        del _starts[rec.lo]
    if detector.enabled:
        detector.released(rec.serial, rec.lo, rec.hi, rec.stream)


def _span(a: np.ndarray) -> tuple[int, int]:
    lo = hi = a.__array_interface__["data"][0]
    if a.size == 0:
        return lo, lo
    for n, st in zip(a.shape, a.strides):
        if st >= 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return lo, hi + a.itemsize


def _same_device(arrays, what):
    """CuPy's check on the arrays of an operation: all on the current device (no peer access here)."""
    cur = _current_device()
    for x in arrays:
        d = _alloc(x).dev
        if d != cur:
            raise ValueError(f"{what}: the device where the array resides ({d}) is different from the current device "
                             f"({cur}). Peer access is unavailable between these devices.")


def _op(reads, writes, what, stream=None, extra=()):
    """Report one stream operation's accesses to the race detector (when it is on)."""
    if not detector.enabled:
        return
    acc = list(extra)
    written = set()
    for arrs, w in ((writes, True), (reads, False)):
        for x in arrs:
            a = (_alloc(x).serial, *_span(x))
            if a not in written:  # (an operand also written is one write)
                acc.append((*a, w))
                if w:
                    written.add(a)
    detector.access((get_current_stream() if stream is None else stream)._hb(), acc, what)


@contextlib.contextmanager
def race_detector():
    """Run the block under the happens-before race detector (``hazards.py``); yields it (``.hazards``: the
    conflicting accesses found, empty when every one was ordered)."""
    if detector.enabled:
        raise RuntimeError("the race detector is already on")
    detector.reset()
    detector.enabled = True
    try:
        yield detector
    finally:
        detector.enabled = False


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
        path = m.group(1).replace("\\", "/")  # the file's name relative to flatopt/kernels (generated/x.cu)
        self.filename = path.rsplit("/kernels/", 1)[-1] if "/kernels/" in path else path.rsplit("/", 1)[-1]
        self.name_expressions = tuple(name_expressions or ())
        self.options = tuple(options)

    def get_function(self, name):
        if name not in self.name_expressions:
            raise KeyError(f"{name!r} is not one of the RawModule's name_expressions (CuPy: nvrtcGetLoweredName "
                           f"fails)")
        fn = _functions.get((self.filename, name))
        if fn is None:
            fn = _functions[(self.filename, name)] = Function(emu.get(self.filename, name))
        return fn


_functions: dict = {}
_ADDRESS_MIN = 1 << 32  # a word of a device table at or above this may be an address (sizes and indices are far below)


class Function:
    """A RawKernel function: the emulator's kernel, launched on the current device and stream.  Before the launch,
    every array argument (and every allocation a ``const long long*`` argument holds the first address of: the
    multi-tensor tables) must live on the current device, and the race detector gets the launch's accesses (a pointer
    to const is read, any other pointer read and written)."""

    def __init__(self, kernel):
        self.kernel = kernel
        lib = emu.build()[kernel.filename]
        name, _, ctype = kernel.expr.partition("<")
        ro = getattr(lib, f"emu_{name}__{ctype.rstrip('>').strip()}_ro")
        ro.restype = ctypes.c_char_p
        self.readonly = tuple(x == "1" for x in ro().decode().split(","))

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        cur = _current_device()
        reads, writes, held_acc = [], [], []
        for i, a in enumerate(args if isinstance(args, (tuple, list)) else ()):
            if not isinstance(a, ndarray):
                continue
            rec = _alloc(a._a)
            if rec.dev != cur:
                raise IllegalAddress(f"{self.kernel.expr} argument {i}: an array of device {rec.dev} launched on "
                                     f"device {cur} (cudaErrorIllegalAddress)")
            ro = i < len(self.readonly) and self.readonly[i]
            (reads if ro else writes).append(a._a)
            if ro and a.dtype == np.int64 and a.size:
                for w in a._a[a._a >= _ADDRESS_MIN].tolist():
                    held = _starts.get(w)
                    if held is None:
                        continue
                    if held.dev != cur:
                        raise IllegalAddress(f"{self.kernel.expr} argument {i}: a table holding the address of an "
                                             f"array of device {held.dev}, launched on device {cur} "
                                             f"(cudaErrorIllegalAddress)")
                    held_acc.append((held.serial, held.lo, held.hi, True))
        _op(reads, writes, f"kernel {self.kernel.expr}", extra=held_acc)
        return self.kernel(grid, block, args, shared_mem=shared_mem,
                           enable_cooperative_groups=enable_cooperative_groups)



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
        ins = [self._a, o] if isinstance(other, ndarray) else [self._a]
        _same_device(ins, f"cupy.{ufunc_name}")
        stats.ops += 1
        t0 = time.perf_counter()
        if inplace:
            uf(self._a, o, out=self._a)
        else:
            r = uf(o, self._a) if reflected else uf(self._a, o)
        stats.call_s += time.perf_counter() - t0
        out = self if inplace else ndarray._of(np.asarray(r))
        _op(ins, [out._a], f"cupy.{ufunc_name}")
        return out

    return op


class ndarray:  # noqa: N801 - CuPy's name
    """A device array: NumPy storage behind CuPy's interface (no implicit conversion to NumPy)."""

    __slots__ = ("_a", "__weakref__")
    _cuda_emu_device_array = True
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = _poison(np.empty(shape, dtype, order=order))
        _alloc(self._a)
        stats.allocs += 1

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        obj = object.__new__(cls)
        obj._a = a
        _alloc(a)  # a new allocation on the current device, or a view of a known one
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
    device = property(lambda self: Device(_alloc(self._a).dev))
    data = property(lambda self: MemoryPointer(self._a.__array_interface__["data"][0], _alloc(self._a).dev))
    base = property(lambda self: None if self._a.base is None else ndarray._of(np.asarray(self._a.base)))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"fakecupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    # --- host transfers (synchronise)
    def _to_host(self, what, stream=None):
        """A device-to-host copy on ``stream`` (CuPy: on the array's device), then the host waits for it."""
        _sync(what)
        if detector.enabled:
            with Device(_alloc(self._a).dev):
                s = get_current_stream() if stream is None else stream
                _op([self._a], [], what, stream=s)
                detector.host_wait_stream(s._hb())

    def get(self, stream=None, order="C", out=None, blocking=True):
        self._to_host("ndarray.get", stream)
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("ndarray.set takes a numpy.ndarray")
        _same_device([self._a], "ndarray.set")
        self._a[...] = arr
        _op([], [self._a], "ndarray.set", stream=stream)

    def item(self):
        self._to_host("ndarray.item")
        return self._a.item()

    def tolist(self):
        self._to_host("ndarray.tolist")
        return self._a.tolist()

    def __float__(self):
        self._to_host("float()")
        return float(self._a)

    def __int__(self):
        self._to_host("int()")
        return int(self._a)

    def __bool__(self):
        self._to_host("bool()")
        return bool(self._a)

    def __index__(self):
        self._to_host("index()")
        return self._a.__index__()

    def __complex__(self):
        self._to_host("complex()")
        return complex(self._a)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    # --- indexing
    def __getitem__(self, key):
        keys: dict = {}
        key = _unwrap(key, keys, "ndarray.__getitem__")
        r = self._a[key]
        if isinstance(r, np.generic):  # integer indices: CuPy returns a 0-d view, not a copy
            r = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        if not isinstance(r, np.ndarray) or _owner(r) is not _owner(self._a):  # advanced indexing: a gather
            ins = [self._a, *(w._a for w in keys.values())]
            _same_device(ins, "ndarray.__getitem__")
            r = np.asarray(r)
            if r.size:
                stats.ops += 1
            out = ndarray._of(r)
            _op(ins, [r], "ndarray.__getitem__ (gather)")
            return out
        return ndarray._of(r)

    def __setitem__(self, key, value):
        keys: dict = {}
        key = _unwrap(key, keys, "ndarray.__setitem__")
        if isinstance(value, np.ndarray):
            raise TypeError("Unsupported type <class 'numpy.ndarray'> (assigning a host array into a device array)")
        ins = [w._a for w in keys.values()] + ([value._a] if isinstance(value, ndarray) else [])
        _same_device([self._a, *ins], "ndarray.__setitem__")
        stats.ops += 1
        t0 = time.perf_counter()
        self._a[key] = value._a if isinstance(value, ndarray) else value
        stats.call_s += time.perf_counter() - t0
        if detector.enabled:
            target = self._a[key] if not keys else self._a
            _op(ins, [target if isinstance(target, np.ndarray) and _owner(target) is _owner(self._a) else self._a],
                "ndarray.__setitem__")

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
            return _call(f"ndarray.{name}", attr, args, kwargs, self_arr=self)

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
        _same_device([self._a], "cupy.__neg__")
        stats.ops += 1
        out = ndarray._of(np.asarray(-self._a))
        _op([self._a], [out._a], "cupy.__neg__")
        return out

    def __pos__(self):
        return self

    def __abs__(self):
        _same_device([self._a], "cupy.__abs__")
        stats.ops += 1
        out = ndarray._of(np.asarray(abs(self._a)))
        _op([self._a], [out._a], "cupy.__abs__")
        return out

    def __invert__(self):
        _same_device([self._a], "cupy.__invert__")
        stats.ops += 1
        out = ndarray._of(np.asarray(~self._a))
        _op([self._a], [out._a], "cupy.__invert__")
        return out

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
            r = _call(self.name, self._np, args, kwargs, nin=self.nin)
            if isinstance(r, ndarray):
                emu.devmath(self.name, x, r._a)  # the kernels' math library, as on a device
            return r
        return _call(self.name, self._np, args, kwargs, nin=self.nin)

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
        if r is a._a:
            return a
        _same_device([a._a], "cupy.asarray")
        out = ndarray._of(r if _owner(r) is not _owner(a._a) else r.copy())
        _op([a._a], [out._a], "cupy.asarray")
        return out
    stats.allocs += 1
    stats.ops += 1
    out = ndarray._of(np.array(a, dtype=dtype, order=order or "K", copy=True))
    _op([], [out._a], "cupy.asarray (host to device)")
    return out


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    cupy_api.check("array", (obj,), dict(dtype=dtype, copy=copy, order=order, subok=subok, ndmin=ndmin,
                                         blocking=blocking))
    src = obj._a if isinstance(obj, ndarray) else obj
    stats.allocs += 1
    stats.ops += 1
    out = ndarray._of(np.array(src, dtype=dtype, copy=True, order=order, ndmin=ndmin))
    _op([src] if isinstance(obj, ndarray) else [], [out._a], "cupy.array")  # (a peer copy from another device)
    return out


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape, dtype=float, order="C"):
    cupy_api.check("empty", (shape,), dict(dtype=dtype, order=order))
    stats.allocs += 1
    return ndarray._of(_poison(np.empty(shape, dtype, order=order)))  # (no access: the memory is not written)


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
        out = ndarray._of(np.asarray(self._rs.standard_normal(size).astype(dtype)))
        _op([], [out._a], "cupy.random.standard_normal")
        return out


random = types.ModuleType("cupy.random")
random.RandomState = _RandomState
module.random = random


def _solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=False):
    t0 = time.perf_counter()
    a_, b_ = a._a, b._a
    _same_device([a_, b_], "cupyx.scipy.linalg.solve_triangular")
    a_ = np.tril(a_) if lower else np.triu(a_)
    if unit_diagonal:
        np.fill_diagonal(a_, 1)
    if trans in ("T", 1, "C", 2):
        a_ = a_.T
    stats.ops += 1
    r = np.linalg.solve(a_.astype(np.float64), b_.astype(np.float64)).astype(b_.dtype)
    stats.call_s += time.perf_counter() - t0
    out = ndarray._of(r)
    _op([a._a, b._a], [r], "cupyx.scipy.linalg.solve_triangular")
    return out


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

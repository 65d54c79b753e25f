"""The one module that knows CuPy.

Everything else asks this module which array module (``numpy`` or ``cupy``) an array belongs to, how to move
arrays between the two, and how to compile and launch CUDA sources.  CuPy is imported lazily, and only when an
array that is not a NumPy array is seen (or a GPU helper is called), so ``import flatopt`` needs NumPy alone.

Environment switches
--------------------
``FLATOPT_FORCE_TWIN=1``
    Never launch the fused CUDA kernels; run the array-agnostic twin (the same math written against ``cupy``
    ufuncs) instead.  Used by the kernel-vs-twin parity tests and for debugging.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = [
    "array_module",
    "is_cupy_array",
    "backend_name",
    "to_numpy",
    "to_backend",
    "flat_view",
    "cupy",
    "gpu_available",
    "force_twin",
    "nvrtc_compile",
    "raw_module",
    "raw_function",
    "launch",
    "device_constant",
    "solve_triangular",
    "nccl",
]

_cupy = None
_cupy_lock = threading.Lock()


def cupy() -> Any:
    """Import and return the ``cupy`` module (raises ``ImportError`` with a hint when it is not installed)."""
    global _cupy
    if _cupy is None:
        with _cupy_lock:
            if _cupy is None:
                try:
                    import cupy as _cp  # noqa: PLC0415 - the one lazy CuPy import of the package
                except ImportError as exc:  # pragma: no cover - depends on the machine
                    raise ImportError(
                        "flatopt needs CuPy for GPU arrays: pip install 'flatopt[cuda12]' or 'flatopt[cuda13]'"
                    ) from exc
                _cupy = _cp
    return _cupy


def solve_triangular():
    """``cupyx.scipy.linalg.solve_triangular`` (GPU triangular solves for KronPsgd)."""
    cupy()
    from cupyx.scipy.linalg import solve_triangular as fn  # noqa: PLC0415

    return fn


def nccl():
    """``cupy.cuda.nccl`` (the NCCL bindings, for flatopt.distributed on GPUs)."""
    cupy()
    from cupy.cuda import nccl as mod  # noqa: PLC0415

    return mod


def is_cupy_array(a: Any) -> bool:
    """True for a ``cupy.ndarray``; never imports CuPy for an object that cannot be one."""
    if isinstance(a, np.ndarray):
        return False
    mod = type(a).__module__
    if not mod.startswith("cupy"):
        return False
    if "cupy" not in sys.modules:  # an object from a cupy module implies cupy is imported
        return False
    return isinstance(a, sys.modules["cupy"].ndarray)


def backend_name(a: Any) -> str:
    """``"numpy"`` or ``"cupy"``; ``TypeError`` for anything else."""
    if isinstance(a, np.ndarray):
        return "numpy"
    if is_cupy_array(a):
        return "cupy"
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(a).__module__}.{type(a).__name__}")


def array_module(*arrays: Any):
    """The array module shared by ``arrays``; ``TypeError`` when they mix NumPy and CuPy or are not arrays."""
    names = {backend_name(a) for a in arrays}
    if len(names) > 1:
        raise TypeError("mixed NumPy and CuPy arrays: " + ", ".join(sorted(names)))
    if names == {"cupy"}:
        return cupy()
    return np


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy array with the values of ``a`` (a copy for CuPy arrays; ``a`` itself for NumPy arrays)."""
    if isinstance(a, np.ndarray):
        return a
    if is_cupy_array(a):
        return a.get()
    return np.asarray(a)


def flat_view(a: Any):
    """A 1-D C-contiguous view of the NumPy or CuPy array ``a`` that shares its memory, or ``ValueError`` when
    none exists (a transposed, Fortran-ordered or sliced array: ``reshape(-1)`` would silently copy it).
    ``TypeError`` for anything that is not a NumPy or CuPy array."""
    name = backend_name(a)
    if not a.flags.c_contiguous:
        order = "Fortran-ordered (or transposed)" if a.flags.f_contiguous else "strided (sliced or transposed)"
        raise ValueError(f"array of shape {tuple(a.shape)} is {order}: it has no 1-D view, and reshape(-1) would "
                         f"copy it (an optimizer would then update the copy); make the parameter C-contiguous "
                         f"(e.g. allocate it with flatopt.pack) and keep that array")
    if name == "numpy" and _NUMPY_RESHAPE_COPY:
        return a.reshape(-1, copy=False)  # raises rather than copy (NumPy >= 2.1)
    view = a.reshape(-1)
    start = view.__array_interface__["data"][0] if name == "numpy" else view.data.ptr
    if view.size and start != (a.__array_interface__["data"][0] if name == "numpy" else a.data.ptr):
        raise ValueError(f"array of shape {tuple(a.shape)}: reshape(-1) made a copy")  # (never for C order)
    return view


_NUMPY_RESHAPE_COPY = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 1)


def to_backend(a: Any, like: Any):
    """``a`` on the backend (and device) of ``like``; ``a`` itself when it is already there."""
    if backend_name(like) == "numpy":
        return to_numpy(a)
    cp = cupy()
    if is_cupy_array(a) and a.device == like.device:
        return a
    with like.device:
        return cp.asarray(to_numpy(a) if is_cupy_array(a) else a)


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    try:
        cp = cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return False


def force_twin() -> bool:
    """True when ``FLATOPT_FORCE_TWIN`` asks to run the array-agnostic twins instead of the fused kernels."""
    return os.environ.get("FLATOPT_FORCE_TWIN", "0") not in ("", "0", "false", "False")


# ---------------------------------------------------------------------------------------------------------
# CUDA sources: compilation (also without a GPU) and cached modules
# ---------------------------------------------------------------------------------------------------------

# --fmad=false: no fused multiply-add contraction, so a kernel rounds exactly like its twin (one ufunc per op).
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false")


def nvrtc_compile(source: str, filename: str, name_expressions: list[str], arch: str = "compute_80") -> dict:
    """Compile ``source`` with NVRTC (CuPy's bindings; no GPU needed) and return the lowered names.

    Used by the test that every ``.cu`` file compiles on machines without a GPU.  Raises ``RuntimeError`` with
    the NVRTC log (whose ``#line`` directives point into the ``.cu`` file) when compilation fails.
    """
    cupy()  # make sure the bindings are importable with a helpful message
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed on {filename}:\n{nvrtc.getProgramLog(prog)}") from exc
        return {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)


_modules: dict[tuple, Any] = {}
_modules_lock = threading.Lock()


def raw_module(key: tuple, source: str, name_expressions: list[str]):
    """A cached ``cupy.RawModule`` per (key, device): compiled once, thread-safe."""
    cp = cupy()
    full_key = (key, cp.cuda.Device().id)
    mod = _modules.get(full_key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(full_key)
            if mod is None:
                mod = cp.RawModule(code=source, options=NVRTC_OPTIONS, name_expressions=name_expressions)
                for expr in name_expressions:  # compile now, not lazily inside a worker thread
                    mod.get_function(expr)
                _modules[full_key] = mod
    return mod


def raw_function(key: tuple, source: str, name_expressions, name: str):
    """The kernel ``name`` of ``raw_module(key, ...)`` on the current device, looked up once and cached (thread-safe):
    CuPy's ``RawModule.get_function`` builds a new ``RawKernel`` and resolves the function on every call.  Kept in the
    modules' cache, so whatever resets that cache resets these too."""
    cp = cupy()
    full = ("function", key, name, cp.cuda.Device().id)
    fn = _modules.get(full)
    if fn is None:
        mod = raw_module(key, source, list(name_expressions))
        with _modules_lock:
            fn = _modules.get(full)
            if fn is None:
                fn = _modules[full] = mod.get_function(name)
    return fn


def launch(kernel, n: int, args: tuple, block: int = 256) -> None:
    """Launch a 1-D elementwise kernel over ``n`` elements on the current stream (no host synchronisation)."""
    if n == 0:
        return
    grid = min((n + block - 1) // block, 65535 * 8)
    kernel((grid,), (block,), args)


# ---------------------------------------------------------------------------------------------------------
# Read-only device constants (tables uploaded once per device and read by kernels on any stream)
# ---------------------------------------------------------------------------------------------------------


class _Constant:
    __slots__ = ("array", "event", "host")

    def __init__(self, array, event, host):
        self.array, self.event, self.host = array, event, host


_constants: dict[tuple, _Constant] = {}
_constants_lock = threading.Lock()


def device_constant(xp, key, make):
    """The device copy of the host array ``make()`` on ``xp``'s current device, uploaded once per (key, device) and
    ordered before every read of it, on any stream.

    The first caller (under a lock: one upload however many threads ask) uploads on a stream of its own and records
    an event after the copy; every call makes the caller's current stream wait for that event (a device-side wait,
    no host synchronisation; a no-op on the device once the copy is done, about a microsecond of host time).  So a
    kernel on a worker's non-blocking stream never reads a half-copied table.  (Not ``Event.done``: a query of the
    device that the strict CuPy stand-in counts as a host synchronisation.)
    """
    full = (key, id(xp), xp.cuda.Device().id)  # (id: the tests' CuPy stand-ins are array modules too)
    c = _constants.get(full)
    if c is None:
        with _constants_lock:
            c = _constants.get(full)
            if c is None:
                host = np.ascontiguousarray(make())
                stream = xp.cuda.Stream(non_blocking=True)
                with stream:
                    arr = xp.asarray(host)
                    event = stream.record()
                c = _constants[full] = _Constant(arr, event, host)
    xp.cuda.get_current_stream().wait_event(c.event)
    return c.array

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

import hashlib
import json
import os
import sys
import threading
from pathlib import Path
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
    "nvrtc_build",
    "nvrtc_compile",
    "device_arch",
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
                check_cupy_version(getattr(_cp, "__version__", ""))
                _cupy = _cp
    return _cupy


MIN_CUPY = (14, 0)


def check_cupy_version(version: str) -> None:
    """``ImportError`` unless ``version`` is CuPy >= 14: CuPy 13 differs where flatopt relies on CuPy 14
    (``cupy.sign(nan)`` is 0 there, so the Lion and Sophia twins would skip an update their kernels poison; a Python
    bool is packed as int64), and it is what the tests' stand-in models."""
    parts = version.split(".")[:2]
    try:
        found = tuple(int("".join(ch for ch in x if ch.isdigit()) or "-1") for x in parts)
    except ValueError:  # pragma: no cover - a version string CuPy never had
        found = ()
    if len(found) < 2 or found < MIN_CUPY:
        raise ImportError(f"flatopt needs CuPy >= {MIN_CUPY[0]} (found cupy {version or 'of unknown version'}): "
                          f"pip install 'flatopt[cuda12]' or 'flatopt[cuda13]' (cupy-cuda12x / cupy-cuda13x >= 14)")


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
# -ftz=false: float32 subnormals are kept (not flushed to zero), as on the CPU.  (NVRTC's default; said explicitly
# because CuPy's RawModule(code=...) appends -ftz=true after the caller's options and NVRTC takes the last one: that
# is why flatopt compiles its sources itself, ``raw_module``.  CuPy's own ufuncs, which the twins run on a GPU, are
# still compiled with -ftz=true and flush subnormals.)
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "-ftz=false")


def nvrtc_build(source: str, filename: str, name_expressions: list[str], arch: str) -> tuple[bytes, dict]:
    """Compile ``source`` with NVRTC (CuPy's bindings; no GPU needed) with :data:`NVRTC_OPTIONS` and nothing else,
    for ``arch`` (``"sm_90"``: a cubin; ``"compute_90"``: PTX).  Returns (image, {name expression: lowered name}).

    Raises ``RuntimeError`` with the NVRTC log (whose ``#line`` directives point into the ``.cu`` file) when
    compilation fails."""
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
        image = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        return bytes(image), {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)


def nvrtc_compile(source: str, filename: str, name_expressions: list[str], arch: str = "compute_80") -> dict:
    """The lowered names of ``nvrtc_build`` (the test that every ``.cu`` file compiles on machines without a GPU)."""
    return nvrtc_build(source, filename, name_expressions, arch)[1]


def device_arch(cp) -> str:
    """NVRTC's target for the current device: its ``sm_XY`` (a cubin, as CuPy builds: PTX of a newer NVRTC may not
    load on an older driver) when NVRTC knows it, else PTX for the newest architecture NVRTC knows below it."""
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

    cc = int(cp.cuda.Device().compute_capability)
    known = [a for a in nvrtc.getSupportedArchs() if a <= cc]
    if cc in known:
        return f"sm_{cc}"
    return f"compute_{max(known) if known else cc}"


def _cache_dir() -> str:
    root = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    return os.path.join(root, "flatopt")


def _build_cached(source: str, filename: str, name_expressions: list[str], arch: str) -> tuple[bytes, dict]:
    """``nvrtc_build``, through a disk cache beside CuPy's kernel cache (``CUPY_CACHE_DIR``), keyed by the source, the
    options, the architecture and the NVRTC version.  The cache is hostile input: its directory is used only when it
    is private to this user (``native_cache.open_private_dir``: another user's or a swappable directory is refused),
    an entry is read without following links and only when it is this user's, and its image must match the sha256
    recorded with it; anything else (an unwritable, refused or damaged cache) only costs the compile."""
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415
    from . import native_cache  # noqa: PLC0415

    key = hashlib.sha256(repr((source, NVRTC_OPTIONS, arch, nvrtc.getVersion(), sorted(name_expressions)))
                         .encode()).hexdigest()
    try:
        dfd = native_cache.open_private_dir(Path(_cache_dir()))
    except (OSError, native_cache.Unsafe):
        return nvrtc_build(source, filename, name_expressions, arch)
    try:
        found = _read_entry(native_cache.read_blob(dfd, key + ".bin"), name_expressions)
        if found is not None:
            return found
        image, mapping = nvrtc_build(source, filename, name_expressions, arch)
        head = json.dumps({"names": mapping, "sha256": hashlib.sha256(image).hexdigest()}).encode()
        try:
            native_cache.write_blob(dfd, key + ".bin", head + b"\n" + image)
        except OSError:
            pass
        return image, mapping
    finally:
        os.close(dfd)


def _read_entry(blob: bytes | None, name_expressions: list[str]) -> tuple[bytes, dict] | None:
    """(image, names) of a cache entry whose header is well-formed and whose image has the recorded sha256."""
    if not blob:
        return None
    head, _, image = blob.partition(b"\n")
    try:
        meta = json.loads(head)
        mapping, digest = meta["names"], meta["sha256"]
    except (ValueError, TypeError, KeyError):
        return None
    if (not isinstance(mapping, dict) or sorted(mapping) != sorted(name_expressions)
            or not all(isinstance(v, str) for v in mapping.values())
            or hashlib.sha256(image).hexdigest() != digest):
        return None
    return image, mapping


class _Module:
    """A module flatopt compiled (``nvrtc_build``) and loaded (``cupy.cuda.function.Module``), looked up by name
    expression as a ``cupy.RawModule``."""

    __slots__ = ("module", "mapping")

    def __init__(self, module, mapping):
        self.module, self.mapping = module, mapping

    def get_function(self, expr: str):
        return self.module.get_function(self.mapping[expr])


def _load_module(cp, source: str, filename: str, name_expressions: list[str]):
    function = getattr(cp.cuda, "function", None)
    if function is None:  # a CuPy stand-in without NVRTC access (the tests' emulator runs RawModule(code=...))
        return cp.RawModule(code=source, options=NVRTC_OPTIONS, name_expressions=name_expressions)
    image, mapping = _build_cached(source, filename, name_expressions, device_arch(cp))
    mod = function.Module()
    mod.load(image)
    return _Module(mod, mapping)


_modules: dict[tuple, Any] = {}
_modules_lock = threading.Lock()


def raw_module(key: tuple, source: str, name_expressions: list[str]):
    """The module of ``source`` per (key, device), compiled once (thread-safe) with :data:`NVRTC_OPTIONS` alone
    (not through ``cupy.RawModule``, which would add -ftz=true) and looked up like a ``cupy.RawModule``."""
    cp = cupy()
    full_key = (key, cp.cuda.Device().id)
    mod = _modules.get(full_key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(full_key)
            if mod is None:
                mod = _load_module(cp, source, "/".join(map(str, key)), name_expressions)
                for expr in name_expressions:  # compile now, not lazily inside a worker thread
                    mod.get_function(expr)
                _modules[full_key] = mod
    return mod


class Packed:
    """A kernel whose scalar arguments are converted to their parameters' NumPy types before CuPy packs them (CuPy
    packs a scalar at its own width: a Python float as a double, a NumPy float32 in 4 bytes, and the device reads
    ``sizeof(parameter)``).  Called like ``cupy.RawKernel``.  A float given for an integer parameter is refused."""

    __slots__ = ("fn", "name", "types", "scalars")

    def __init__(self, fn, name: str, types: tuple):
        self.fn, self.name, self.types = fn, name, types
        self.scalars = tuple((i, t) for i, t in enumerate(types) if t is not None)

    def __call__(self, grid, block, args, **kwargs):
        if len(args) != len(self.types):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.types)} parameters")
        out = None
        for i, t in self.scalars:
            a = args[i]
            if type(a) is not t:
                if out is None:
                    out = list(args)
                out[i] = self._convert(i, a, t)
        return self.fn(grid, block, args if out is None else tuple(out), **kwargs)

    def _convert(self, i: int, a, t):
        if not isinstance(a, (int, float, np.generic)):
            return a  # an array (a pointer parameter's) or None: CuPy's to check
        if isinstance(a, (float, np.floating)) and not issubclass(t, np.floating):
            raise TypeError(f"{self.name}: argument {i} is a float ({a!r}) for an integer parameter")
        return t(a)


def raw_function(key: tuple, source: str, name_expressions, name: str, param_types: tuple | None = None):
    """The kernel ``name`` of ``raw_module(key, ...)`` on the current device, looked up once and cached (thread-safe):
    CuPy's ``RawModule.get_function`` builds a new ``RawKernel`` and resolves the function on every call.  Kept in the
    modules' cache, so whatever resets that cache resets these too.  With ``param_types`` (the NumPy scalar type of
    each parameter, None for a pointer) the kernel is a :class:`Packed`."""
    cp = cupy()
    full = ("function", key, name, cp.cuda.Device().id)
    fn = _modules.get(full)
    if fn is None:
        mod = raw_module(key, source, list(name_expressions))
        with _modules_lock:
            fn = _modules.get(full)
            if fn is None:
                fn = mod.get_function(name)
                if param_types is not None:
                    fn = Packed(fn, name, param_types)
                _modules[full] = fn
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

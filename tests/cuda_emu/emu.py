"""Build and launch flatopt's CUDA kernels on the CPU (test code; the execution model is in ``cuda_emu.h``).

Every ``flatopt/kernels/*.cu`` compiles UNCHANGED with g++ (``-std=c++20 -ffp-contract=off -O1 -include
cuda_emu.h``) into one shared library per file, with an ``extern "C"`` wrapper per template instantiation generated
from the loader's kernel list (``flatopt.core.kernels.KERNELS`` x float, double).  The libraries are built once into a
temporary folder keyed by a hash of the sources, the header and this file, the files compiled in parallel.

A launch (:class:`Kernel`, called like ``cupy.RawKernel``) packs its arguments as CuPy does
(``cupy/cuda/function.pyx: _pointer``: a device array is its data pointer, a NumPy scalar keeps its dtype, a Python
``int`` becomes int64, a ``float`` float64, ``None`` a null pointer) and fails on any mismatch with the kernel's
parameter types (kind, width, pointee dtype, a host array, a non-contiguous array).  Every array argument is
copied into a fenced region (a ``PROT_NONE`` page right after its end, or right before its start: :data:`FENCE`;
the bytes between the data and the far guard page are a canary checked after the launch), so an out-of-bounds
access ends the launch with an error naming the argument; arguments that overlap
in memory share one fenced copy (aliasing preserved).  Blocks and threads run forward, reverse or in a seeded
random order, chosen per launch from a counter (see :data:`SCHEDULES`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emu.h"
FLAGS = ("-std=c++20", "-ffp-contract=off", "-O1", "-fPIC", "-shared", "-fno-gnu-unique", "-fvisibility=hidden",
         "-fno-strict-aliasing", "-w")
CTYPE_NAMES = {"float": np.dtype(np.float32), "double": np.dtype(np.float64)}
# Which side of every array argument touches its guard page: "end" (reads and writes past the end fault; writes
# before the start hit a checked canary), "start" (the reverse), or "alternate": the end on three launches of four,
# the start on every fourth (overruns, the common bug, are caught at once; underruns within a few launches).
FENCE = "alternate"
# (block order, thread order): 0 forward, 1 reverse, 2 seeded random; launch k uses SCHEDULES[k % len]
SCHEDULES = ((0, 0), (1, 1), (2, 2), (2, 1), (1, 2))


class EmulatorError(RuntimeError):
    """A kernel launch that real CUDA would not run correctly (bad argument, divergence, out-of-bounds...).  Not an
    AssertionError, so that a test marked xfail(raises=AssertionError) for a numerical defect still fails on it."""


class LAUNCH(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("block_order", ctypes.c_int),
                ("thread_order", ctypes.c_int), ("seed", ctypes.c_ulonglong), ("switches", ctypes.c_longlong),
                ("fault_addr", ctypes.c_void_p), ("error", ctypes.c_char * 1024)]


def available() -> str | None:
    """None when the emulator can run here, else why not."""
    if platform.machine() not in ("x86_64", "AMD64") or os.name != "posix":
        return "the CUDA emulator needs Linux x86-64"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "the CUDA emulator needs g++ (C++20)"
    return None


def _kernels_module():
    from flatopt.core import kernels  # noqa: PLC0415

    return kernels


def _cache_key() -> str:
    k = _kernels_module()
    h = hashlib.sha256()
    for path in (HEADER, Path(__file__)):
        h.update(path.read_bytes())
    h.update(repr(sorted(k.KERNELS.items())).encode())
    h.update(repr(FLAGS).encode())
    for name in sorted(k.KERNELS):
        h.update(name.encode() + (k.KERNEL_DIR / name).read_bytes())
    for header in sorted(k.KERNEL_DIR.glob("*.cuh")):  # included by the .cu files
        h.update(header.name.encode() + header.read_bytes())
    return h.hexdigest()[:20]


def _wrapper_source(kernels: tuple[str, ...], cu_path: Path) -> str:
    lines = [f'#include "{cu_path}"', ""]
    for kern in kernels:
        for ctype in CTYPE_NAMES:
            lines.append(f"CUDA_EMU_EXPORT({kern}, {ctype})")
    return "\n".join(lines) + "\n"


def _compile(cu_path: Path, kernels: tuple[str, ...], out_dir: Path) -> Path:
    stem = ("generated_" if cu_path.parent.name == "generated" else "") + cu_path.name.replace(".", "_")
    lib = out_dir / (stem + ".so")
    if lib.exists():
        return lib
    tag = f"{os.getpid()}_{threading.get_ident()}"
    src = out_dir / f"{stem}_emu_{tag}.cpp"
    src.write_text(_wrapper_source(kernels, cu_path.resolve()))
    tmp = out_dir / f"{stem}_{tag}.so.tmp"
    cmd = [os.environ.get("CXX", "g++"), *FLAGS, "-include", str(HEADER), "-o", str(tmp), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise EmulatorError(f"g++ failed on {cu_path.name}:\n{' '.join(cmd)}\n{res.stderr[-6000:]}")
    os.replace(tmp, lib)  # atomic: concurrent sessions share the cache
    return lib


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    _register_shared(lib, path)
    return lib


_libs: dict = {}
_build_lock = threading.Lock()


def _out_dir(key: str) -> Path:
    out = Path(tempfile.gettempdir()) / f"flatopt-cuda-emu-{key}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def build() -> dict:
    """The emulated libraries, one per flatopt .cu file (compiled once per content hash, in parallel; loaded once
    per process)."""
    with _build_lock:
        k = _kernels_module()
        files = sorted(k.KERNELS)
        if all(f in _libs for f in files):
            return _libs
        out = _out_dir(_cache_key())
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as ex:
            paths = list(ex.map(lambda f: _compile(k.KERNEL_DIR / f, k.KERNELS[f], out), files))
        for f, p in zip(files, paths):
            _libs[f] = _load(p)
        return _libs


def build_file(cu_path, kernels: tuple[str, ...]) -> ctypes.CDLL:
    """An emulated library for any .cu file of ``template <typename T>`` kernels (the emulator's self-test)."""
    cu_path = Path(cu_path)
    h = hashlib.sha256(HEADER.read_bytes() + Path(__file__).read_bytes() + cu_path.read_bytes()
                       + repr((tuple(kernels), FLAGS)).encode()).hexdigest()[:20]
    with _build_lock:
        key = ("file", str(cu_path), h)
        if key not in _libs:
            _libs[key] = _load(_compile(cu_path, tuple(kernels), _out_dir(h)))
        return _libs[key]


def _register_shared(lib, path: Path) -> None:
    """Tell the library where its ``__shared__`` variables are (function-local statics of the .cu's functions,
    from ``nm``), so that it poisons them before every block."""
    res = subprocess.run(["nm", "-C", "-S", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    syms = {}
    for line in res.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and len(parts[2]) == 1:
            syms.setdefault(parts[3], (int(parts[0], 16), int(parts[1], 16), parts[2]))
    anchor = next(n for n in syms if n.startswith("emu_") and n.endswith("_sig"))
    base = ctypes.cast(getattr(lib, anchor), ctypes.c_void_p).value - syms[anchor][0]
    lib.emu_shared_region.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    found = 0
    for name, (addr, size, kind) in syms.items():
        if kind in "bBdDvV" and re.fullmatch(r"[A-Za-z_]\w*(<[^()]*>)?\(.*\)::\w+", name):
            lib.emu_shared_region(base + addr, size)
            found += 1
    lib._cuda_emu_shared = found


# ------------------------------------------------------------------------------------------------------------
# argument packing (CuPy's rules) and checking against the kernel's parameter types
# ------------------------------------------------------------------------------------------------------------

_PTR_DTYPES = {"pf4": np.float32, "pf8": np.float64, "pu1": np.uint8, "pi1": np.int8, "pu2": np.uint16,
               "pi2": np.int16, "pi4": np.int32, "pu4": np.uint32, "pi8": np.int64, "pu8": np.uint64}


def _scalar_code(dt: np.dtype) -> str:
    kind = {"f": "f", "i": "i", "u": "u", "b": "b"}.get(dt.kind, "?")
    return f"{kind}{dt.itemsize}"


class _Stats:
    def __init__(self):
        self.launches = 0
        self.switches = 0
        self.by_kernel: dict[str, int] = {}


stats = _Stats()
_launch_lock = threading.Lock()  # one launch at a time: a legal schedule of any set of streams
_counter = [0]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = os.sysconf("SC_PAGE_SIZE")
CANARY = 0xA5
_PROT_NONE, _PROT_RW, _MAP = 0, 3, 0x02 | 0x20  # MAP_PRIVATE | MAP_ANONYMOUS


class _Fence:
    """``nbytes`` of read-write memory with a PROT_NONE page right after (``at_end``) or right before it."""

    def __init__(self, nbytes: int, at_end: bool):
        data_pages = max(1, -(-nbytes // PAGE))
        self.size = (data_pages + 2) * PAGE
        self.base = _libc.mmap(None, self.size, _PROT_RW, _MAP, -1, 0)
        if self.base in (None, ctypes.c_void_p(-1).value):
            raise MemoryError("mmap failed")
        _libc.mprotect(self.base, PAGE, _PROT_NONE)
        _libc.mprotect(self.base + (data_pages + 1) * PAGE, PAGE, _PROT_NONE)
        first = self.base + PAGE
        self.ptr = first + data_pages * PAGE - nbytes if at_end else first
        self.nbytes = nbytes
        # the mapped bytes between the data and the far guard page: a canary, checked after the launch
        self.slack = (first, self.ptr - first) if at_end else (first + nbytes, data_pages * PAGE - nbytes)
        if self.slack[1]:
            ctypes.memset(self.slack[0], CANARY, self.slack[1])

    def slack_written(self) -> int:
        """Bytes of the canary a kernel overwrote (an out-of-bounds write the guard page did not catch)."""
        if not self.slack[1]:
            return 0
        raw = np.frombuffer(ctypes.string_at(*self.slack), np.uint8)
        return int(np.count_nonzero(raw != CANARY))

    def free(self):
        _libc.munmap(self.base, self.size)


def _is_device_array(a) -> bool:
    return getattr(type(a), "_cuda_emu_device_array", False)


class Kernel:
    """One instantiation ``kernel<T>`` of a .cu file, callable like ``cupy.RawKernel``."""

    def __init__(self, filename: str, expr: str, lib=None):
        name, _, ctype = expr.partition("<")
        ctype = ctype.rstrip(">").strip()
        lib = build()[filename] if lib is None else lib
        self.name, self.expr, self.filename = name, expr, filename
        self._fn = getattr(lib, f"emu_{name}__{ctype}")
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(LAUNCH), ctypes.POINTER(ctypes.c_void_p)]
        sig = getattr(lib, f"emu_{name}__{ctype}_sig")
        sig.restype = ctypes.c_char_p
        self.params = tuple(sig().decode().split(","))
        # None: no __launch_bounds__ (flatopt's kernels; the emulator's own self-test kernels may take 1024)
        self.max_threads = launch_bounds(filename).get(name) if filename in _kernels_module().KERNELS else 1024

    def __repr__(self):
        return f"<emulated kernel {self.expr} of {self.filename}>"

    def __call__(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        if not isinstance(grid, tuple) or not isinstance(block, tuple):
            raise TypeError(f"{self.expr}: grid and block must be tuples (CuPy's Function.__call__), got "
                            f"{type(grid).__name__} and {type(block).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{self.expr}: args must be a tuple")
        if shared_mem:
            raise EmulatorError(f"{self.expr}: dynamic shared memory is not emulated")
        if len(args) != len(self.params):
            raise EmulatorError(f"{self.expr}: {len(args)} arguments for {len(self.params)} parameters")
        dims = []
        for what, d in (("grid", grid), ("block", block)):
            if not 1 <= len(d) <= 3 or not all(isinstance(x, (int, np.integer)) and int(x) >= 1 for x in d):
                raise EmulatorError(f"{self.expr}: invalid {what} {d}")
            dims.append([int(x) for x in d] + [1] * (3 - len(d)))
        if dims[0][0] > 2**31 - 1 or dims[1][0] > 1024 or np.prod(dims[1]) > 1024:
            raise EmulatorError(f"{self.expr}: launch out of CUDA's limits: grid {grid}, block {block}")
        if np.prod(dims[1]) > (self.max_threads or UNBOUNDED_THREADS):
            raise EmulatorError(f"{self.expr}: block {block} exceeds its __launch_bounds__({self.max_threads}) (CUDA: "
                                f"too many resources requested for launch)" if self.max_threads else
                                f"{self.expr}: block {block} of more than {UNBOUNDED_THREADS} threads for a kernel "
                                f"without __launch_bounds__ (ptxas may give it more registers than an SM holds)")
        with _launch_lock:
            k = _counter[0]
            _counter[0] += 1
            self._launch(k, dims, args)

    def _launch(self, k, dims, args):
        packed, arrays = [], []  # arrays: (index, array)
        for i, (a, code) in enumerate(zip(args, self.params)):
            where = f"{self.expr} argument {i} (parameter type {code})"
            if _is_device_array(a):
                if not code.startswith("p"):
                    raise EmulatorError(f"{where}: a device array passed for a scalar parameter")
                arr = a._a  # noqa: SLF001 - the stand-in's storage
                if not arr.flags.c_contiguous:
                    raise EmulatorError(f"{where}: a non-contiguous array (shape {arr.shape}, strides {arr.strides})")
                if code != "pv" and np.dtype(_PTR_DTYPES.get(code, "V1")) != arr.dtype:
                    raise EmulatorError(f"{where}: an array of dtype {arr.dtype}")
                arrays.append((i, arr))
                packed.append(None)
                continue
            if isinstance(a, np.ndarray):
                raise EmulatorError(f"{where}: a host NumPy array (CuPy raises TypeError: Unsupported type)")
            if a is None:
                if not code.startswith("p"):
                    raise EmulatorError(f"{where}: None (a null pointer) passed for a scalar parameter")
                packed.append(ctypes.create_string_buffer(8))  # a zero pointer value (passed by address)
                continue
            if isinstance(a, np.generic):
                val = np.asarray(a)
            elif isinstance(a, (bool, int)):  # CuPy: Python int (and bool, an int) -> int64
                val = np.asarray(a, dtype=np.int64)
            elif isinstance(a, float):
                val = np.asarray(a, dtype=np.float64)
            else:
                raise EmulatorError(f"{where}: unsupported type {type(a).__name__} (CuPy raises TypeError)")
            got = _scalar_code(val.dtype)
            if got != code:
                raise EmulatorError(f"{where}: got {type(a).__name__} packed as {got} ({val.dtype}, "
                                    f"{val.dtype.itemsize} bytes)")
            packed.append(ctypes.create_string_buffer(val.tobytes(), 16))
        # fenced copies, one per group of overlapping arrays
        at_end = FENCE == "end" or (FENCE == "alternate" and k % 4 != 3)
        spans = sorted(((arr.__array_interface__["data"][0], arr.nbytes, i) for i, arr in arrays))
        groups = []  # [start, end, [indices]]
        for start, nb, i in spans:
            if groups and start < groups[-1][1] and nb:
                groups[-1][1] = max(groups[-1][1], start + nb)
                groups[-1][2].append((i, start))
            else:
                groups.append([start, start + nb, [(i, start)]])
        fences, ptrs = [], {}
        try:
            for start, end, members in groups:
                f = _Fence(end - start, at_end)
                fences.append((f, start, members))
                if end > start:
                    ctypes.memmove(f.ptr, start, end - start)
                for i, s in members:
                    ptrs[i] = f.ptr + (s - start)
            argv = (ctypes.c_void_p * len(args))()
            holders = []
            for i, p in enumerate(packed):
                if p is None:
                    h = ctypes.c_void_p(ptrs[i])
                    holders.append(h)
                    argv[i] = ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                else:
                    argv[i] = ctypes.cast(p, ctypes.c_void_p)
            launch = LAUNCH()
            launch.grid[:] = dims[0]
            launch.block[:] = dims[1]
            launch.block_order, launch.thread_order = SCHEDULES[k % len(SCHEDULES)]
            launch.seed = 0x5EED0000 + k
            rc = self._fn(ctypes.byref(launch), argv)
            stats.launches += 1
            stats.switches += launch.switches
            stats.by_kernel[self.expr] = stats.by_kernel.get(self.expr, 0) + 1
            if rc != 0:
                msg = launch.error.decode(errors="replace")
                if launch.fault_addr:
                    msg += self._which(launch.fault_addr, fences, args)
                raise EmulatorError(f"{self.expr} (grid {tuple(dims[0])}, block {tuple(dims[1])}): {msg}")
            for f, start, members in fences:
                bad = f.slack_written()
                if bad:
                    side = "before the start of" if at_end else "past the end of"
                    raise EmulatorError(f"{self.expr} (grid {tuple(dims[0])}, block {tuple(dims[1])}): out-of-bounds "
                                        f"write of {bad} bytes {side} argument {', '.join(str(i) for i, _ in members)}")
            for f, start, _ in fences:
                if f.nbytes:
                    ctypes.memmove(start, f.ptr, f.nbytes)
        finally:
            for f, _, _ in fences:
                f.free()

    @staticmethod
    def _which(addr, fences, args):
        for f, _, members in fences:
            if f.base <= addr < f.base + f.size:
                rel = addr - f.ptr
                names = ", ".join(str(i) for i, _ in members)
                side = "past the end of" if rel >= f.nbytes else "before the start of"
                return f" -- {abs(rel - f.nbytes) if rel >= f.nbytes else -rel} bytes {side} argument {names}"
        return ""


_kernel_cache: dict[tuple[str, str], Kernel] = {}


# the most threads per block of a kernel without __launch_bounds__: 255 registers (ptxas' maximum) x 256 fit in 64K
UNBOUNDED_THREADS = 256


def launch_bounds(filename: str) -> dict[str, int]:
    """{kernel: its ``__launch_bounds__`` maximum of threads per block} of a .cu file (a number or a ``#define``d
    name of one)."""
    text = _kernels_module().source(filename)
    defines = dict(re.findall(r"^#define (\w+) (\d+)\b", text, re.M))
    return {name: int(defines.get(bound, bound))
            for bound, name in re.findall(r"__launch_bounds__\((\w+)(?:,\s*\w+)?\)\s*(\w+)\s*\(", text)}


def get(filename: str, expr: str) -> Kernel:
    key = (filename, expr)
    kern = _kernel_cache.get(key)
    if kern is None:
        kern = _kernel_cache[key] = Kernel(filename, expr)
    return kern


_DEVMATH = {("exp2", "float32"): 0, ("exp2", "float64"): 1, ("log2", "float32"): 2, ("log2", "float64"): 3,
            ("log", "float32"): 4, ("log", "float64"): 5, ("cos", "float32"): 6, ("cos", "float64"): 7,
            ("sin", "float32"): 8, ("sin", "float64"): 9}


def devmath(name: str, x: np.ndarray, out: np.ndarray) -> bool:
    """``out[...] = name(x)`` with the emulated device's math library (the kernels' exp2f / log2); False when the
    function or dtype is not one of the device functions emulated here."""
    fn = _DEVMATH.get((name, out.dtype.name))
    if fn is None:
        return False
    lib = next(iter(build().values()))
    src = np.ascontiguousarray(np.broadcast_to(x, out.shape), dtype=out.dtype)
    dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
    lib.emu_devmath.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    lib.emu_devmath(fn, src.ctypes.data, dst.ctypes.data, src.size)
    if dst is not out:
        out[...] = dst
    return True

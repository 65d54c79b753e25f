"""The compiled CPU passes: an elementwise update fused into one pass over memory, bit-identical to its NumPy twin.

NumPy runs an update as a dozen or more ufunc passes over each cache-sized chunk; one compiled loop does the same
operations per element in registers, so a step costs little more than reading and writing its arrays once.
Measured on a 2-vCPU AMD EPYC, two threads, one 16M float32 buffer (``python -m benchmarks.threads_probe native``,
settled in-process A/B): AdamW 14.9 -> 7.6 ms, Lion 14.1 -> 5.8 ms, QHAdamW 19.1 -> 7.7 ms, Sophia 18.2 -> 6.1 ms,
Lamb 27.1 -> 15.8 ms, Mars 26.4 -> 13.3 ms; Lion's pass runs at the memory floor (two NumPy adds that read p, g, m
and write p, m once: 5.8-6.5 ms).  ``kernels/cpu/elementwise.c`` keeps each twin's operations and their order,
compiled without FMA contraction or fast-math, so every element gets the twin's bits (``tests/test_native.py``).

The source is compiled on first use with the system's C compiler (``cc``, or ``FLATOPT_CC``) into a cache
directory (``FLATOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/flatopt``, else ``~/.cache/flatopt``, else a per-user
temporary one; a directory others can write into is refused), keyed by the source, the flags and the compiler's
version: 1.8 s with gcc 12 on 2 cores (the probe above prints it), once per machine.  Without a compiler, when the
build fails, or with ``FLATOPT_NATIVE=0``, the NumPy twins run: the same bits, slower.  ``status()`` says which and
why.  This module is the only one that knows the library; an algorithm calls ``step`` (or ``columns``) and falls
back to its twin when it returns False.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "elementwise.c"
# No -ffast-math and no FMA contraction: each operation rounds as NumPy's ufunc does (the twin's bits).
FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-fvisibility=hidden")
# elementwise entry -> its arrays (p, g, state...; Lamb's apply: p, u): (dt, arrays..., n, scalars, flags)
ENTRIES = {"adam": 4, "lion": 3, "qhadamw": 4, "nadamw": 4, "radam": 4, "sophia": 4, "sgd": 3, "mars": 5,
           "lamb_apply": 2}
# the norms' first phases (core/norms.py), entry -> (arrays, column accumulators):
# (dt, arrays..., accumulators..., rows, w, scalars, flags)
COLUMNS = {"mars_columns": (2, 1), "lamb_columns": (5, 2)}
_DT = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib": {entry: bound function} or None, "why": a line


def _cache_dirs() -> list[Path]:
    """Where the library may be built, in order: FLATOPT_CACHE_DIR, else the user cache, then a per-user temporary
    directory."""
    env = os.environ.get("FLATOPT_CACHE_DIR")
    if env:
        return [Path(env)]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    out = [Path(tempfile.gettempdir()) / f"flatopt-{uid}"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        out.insert(0, (Path(xdg) if xdg else Path.home() / ".cache") / "flatopt")
    except (RuntimeError, KeyError):  # no home directory (a bare service account): the temporary one alone
        pass
    return out


def _private(d: Path) -> bool:
    """``d`` exists (made with mode 0700 if not) and only this user can write into it: a library loaded from it
    cannot have been planted by someone else."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not hasattr(os, "getuid"):  # pragma: no cover - not POSIX
        return True
    st = d.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _compile(exe: str, lib: Path) -> str | None:
    """Build ``lib`` from SOURCE (atomically: concurrent processes share the cache); None, or why it failed."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        res = subprocess.run([exe, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0:
            return f"{Path(exe).name} failed on {SOURCE.name}: {res.stderr.strip()[-500:]}"
        os.replace(tmp, lib)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(handle: Any) -> dict[str, Any]:
    """{entry: its function, with its argument types}."""
    fns = {}
    sizes, tail = [ctypes.c_int64], [ctypes.c_void_p, ctypes.c_int]
    for name, k in [*ENTRIES.items(), *((n, k + a) for n, (k, a) in COLUMNS.items())]:
        fn = getattr(handle, f"flatopt_{name}")
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * k + sizes * (2 if name in COLUMNS else 1) + tail
        fn.restype = ctypes.c_int
        fns[name] = fn
    return fns


def _build() -> tuple[Any, str]:
    """(the loaded library, where it lies) or (None, why not)."""
    if os.environ.get("FLATOPT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by FLATOPT_NATIVE"
    cc = os.environ.get("FLATOPT_CC", "cc")
    exe = shutil.which(cc)
    if exe is None:
        return None, f"no C compiler {cc!r} on PATH (set FLATOPT_CC)"
    why = "no private, writable cache directory"
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                                         platform.machine().encode()])).hexdigest()[:20]
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    for d in _cache_dirs():
        try:
            if not _private(d):
                why = f"{d} is writable by others"
                continue
            lib = d / f"elementwise-{key}.so"
            if not lib.exists():
                failed = _compile(exe, lib)
                if failed:
                    return None, failed
            return _bind(ctypes.CDLL(str(lib))), str(lib)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    return None, why


def _lib() -> Any:
    lib = _state.get("lib", _lock)
    if lib is not _lock:
        return lib
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _build()
        return _state["lib"]


def status() -> tuple[bool, str]:
    """(whether the compiled passes run, the library's path or why not)."""
    return _lib() is not None, _state["why"]


def reset() -> None:
    """Forget the loaded library (tests: rebuild under another environment)."""
    with _lock:
        _state.clear()


@functools.lru_cache(maxsize=64)
def _scalars(values: tuple[float, ...]) -> Any:
    return (ctypes.c_double * len(values))(*values)


def step(name: str, arrays: Sequence[np.ndarray], scalars: tuple[float, ...], flags: int) -> bool:
    """Run the compiled pass ``name`` on ``arrays`` (``ENTRIES``: p, g and the state), contiguous NumPy arrays of one
    dtype and size; False (nothing touched) when it cannot (no library, another dtype or layout): the caller runs
    its twin."""
    n = arrays[0].size
    return _call(name, arrays, [n] * len(arrays), (n,), scalars, flags)


def columns(name: str, arrays: Sequence[np.ndarray], accs: Sequence[np.ndarray], rows: int, w: int,
            scalars: tuple[float, ...], flags: int) -> bool:
    """Run the first phase ``name`` of a norm (``core.norms``): ``arrays`` hold ``rows`` contiguous rows of ``w``
    terms, each accumulator ``w`` column sums (bit 0 of ``flags``: the first rows, which replace the sums); False
    (nothing touched) when it cannot: the caller runs its twin."""
    return _call(name, (*arrays, *accs), [rows * w] * len(arrays) + [w] * len(accs), (rows, w), scalars, flags)


def _call(name: str, arrays: Sequence[np.ndarray], sizes: Sequence[int], extents: tuple[int, ...],
          scalars: tuple[float, ...], flags: int) -> bool:
    fns = _lib()
    dtype = arrays[0].dtype
    dt = _DT.get(dtype)
    if fns is None or dt is None:
        return False
    for a, size in zip(arrays, sizes):
        if a.dtype != dtype or not a.flags.c_contiguous or a.size != size:
            return False
    rc = fns[name](dt, *[a.__array_interface__["data"][0] for a in arrays], *extents,
                   _scalars(tuple(map(float, scalars))), int(flags))
    if rc != 0:  # pragma: no cover - the dtype is checked above
        raise RuntimeError(f"flatopt_{name} returned {rc}")
    return True

"""The compiled CPU passes: an elementwise update fused into one pass over memory, bit-identical to its NumPy twin.

NumPy runs an update as a dozen or more ufunc passes over each cache-sized chunk; one compiled loop does the same
operations per element in registers, so a step costs little more than reading and writing its arrays once (the
memory floor).  Re-measure against the NumPy twins and that floor: ``python -m benchmarks.threads_probe native``.
``kernels/generated/elementwise.c`` (generated from the definitions, ``core/elementwise``) keeps each NumPy path's
operations and their order, compiled without FMA contraction or fast-math, so every element gets its bits
(``tests/test_native.py``),
except that a NaN may carry another sign or payload (a vectorised loop may pass on the other NaN operand): it is
NaN exactly where the twin's is.

The source is compiled on first use with the system's C compiler (``cc``, or ``FLATOPT_CC``) into a cache
directory (``FLATOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/flatopt``, else ``~/.cache/flatopt``, else a fresh private
temporary one), keyed by the source, the flags and the compiler's version: a few seconds once per machine (the probe
above prints it).  ``core/native_cache.py`` builds and opens it: a directory another user could
swap or write into is refused, processes starting together compile once, and a library is loaded only after its
bytes match the digest in its name (a damaged one is rebuilt).  Without a compiler, when the build fails, or with
``FLATOPT_NATIVE=0``, the NumPy twins run: the same bits, slower.  ``status()`` says which and why, and never
raises.  This module is the only one that knows the library's entries; ``core.elementwise.run`` calls ``gen_step``
(or, for a step with a sum, ``gen_columns`` and ``gen_map``) and falls back to the NumPy path when it returns False.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import native_cache

# the loops generated from the definitions (core/elementwise)
GENERATED = Path(__file__).resolve().parent.parent / "kernels" / "generated" / "elementwise.c"
# No -ffast-math and no FMA contraction: each operation rounds as NumPy's ufunc does (the twin's bits).
FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-fvisibility=hidden")
_DT = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib": {entry: bound function} or None, "why": a line


def _sources() -> tuple[Path]:
    return (GENERATED,)


def _compiler(exe: str) -> Any:
    """``compile_to(path, pass_fds)`` for ``native_cache.load``: builds the library at ``path``; None, or why it
    failed."""
    def compile_to(path: str, fds: tuple[int, ...]) -> str | None:
        res = subprocess.run([exe, *FLAGS, "-o", path, *map(str, _sources()), "-lm"], capture_output=True, text=True,
                             timeout=native_cache.COMPILE_TIMEOUT_S, pass_fds=fds)
        if res.returncode != 0:
            return f"{Path(exe).name} failed on {' and '.join(s.name for s in _sources())}: {res.stderr.strip()[-500:]}"
        return None
    return compile_to


def _bind(handle: Any) -> dict[str, Any]:
    """{entry: its function, with its argument types}: (dt, flag set, arrays, n, struct of named doubles), or for a
    reduce phase (dt, flag set, arrays, column sums, rows, w, first, struct)."""
    fns = {}
    for name in re.findall(r"\bint flatopt_gen_(\w+)\(", GENERATED.read_text()):
        fn = getattr(handle, f"flatopt_gen_{name}")
        extent = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int] if re.search(r"_columns\d*$", name) \
            else [ctypes.c_int64]
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, *extent, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        fns["gen_" + name] = fn
    return fns


def _build() -> tuple[Any, str]:
    """(the loaded library, where it lies) or (None, why not)."""
    if os.environ.get("FLATOPT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by FLATOPT_NATIVE"
    cc = os.environ.get("FLATOPT_CC", "cc")
    exe = shutil.which(cc)
    if exe is None:
        return None, f"no C compiler {cc!r} on PATH (set FLATOPT_CC)"
    if not os.path.isdir("/proc/self/fd"):  # pragma: no cover - Linux has it
        return None, "no /proc/self/fd: the library is only loaded through its checked descriptor"
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256(b"\0".join([*(src.read_bytes() for src in _sources()), " ".join(FLAGS).encode(),
                                         version.encode(), platform.machine().encode()])).hexdigest()[:20]
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    why = "no private, writable cache directory"
    for d, temporary in native_cache.default_dirs():
        try:
            dfd = native_cache.open_private_dir(d)
            try:
                handle, name = native_cache.load(dfd, key, _compiler(exe))
            finally:
                os.close(dfd)
            return _bind(handle), str(d / name) + (" (a private temporary directory, removed once loaded)"
                                                   if temporary else "")
        except native_cache.Unsafe as exc:
            why = f"refused: {exc}"
        except RuntimeError as exc:  # the compiler failed: another directory would not help
            return None, str(exc)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            if temporary:
                native_cache.remove_temporary(d)
    return None, why


def _lib() -> Any:
    lib = _state.get("lib", _lock)
    if lib is not _lock:
        return lib
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["why"] = _build()
            except Exception as exc:  # noqa: BLE001 - whatever happens, the twins run and status() says why
                _state["lib"], _state["why"] = None, f"{type(exc).__name__}: {exc}"
        return _state["lib"]


def status() -> tuple[bool, str]:
    """(whether the compiled passes run, the library's path or why not)."""
    return _lib() is not None, _state["why"]


def reset() -> None:
    """Forget the loaded library (tests: rebuild under another environment)."""
    with _lock:
        _state.clear()


@functools.lru_cache(maxsize=64)
def _scalars(packed: bytes) -> Any:
    """The C array of the doubles packed in ``packed``: keyed on their bits, not their values (``-0.0 == 0.0``)."""
    return (ctypes.c_double * (len(packed) // 8)).from_buffer_copy(packed)


def gen_step(algo: str, fs: int, arrays: Sequence[np.ndarray], packed: bytes) -> bool:
    """Run the generated loop of ``algo`` for flag set ``fs`` (``core/elementwise``) on ``arrays`` (its definition's
    p, g and slots; a stand-in for a slot the flag set does not use), ``packed``: its scalars struct; False (nothing
    touched) when it cannot: the caller runs the NumPy path."""
    return _gen(f"gen_{algo}", fs, arrays, arrays[0].size, packed)


def gen_columns(algo: str, fs: int, arrays: Sequence[np.ndarray], accs: Sequence[np.ndarray], rows: int, w: int,
                first: bool, packed: bytes, level: int = 0) -> bool:
    """Run the generated reduce phase of ``algo``'s flag set ``fs`` (``core/elementwise/reduce.py``) on ``rows``
    contiguous rows of ``w`` elements of ``arrays`` (the definition's p, g and slots), adding each summand's rows
    into its ``w`` column sums ``accs`` in row order (``first``: they replace the sums); False (nothing touched)
    when it cannot: the caller runs the NumPy path.  ``level``: which reduction level (entry ``_columns<level>``
    after the first)."""
    return _gen(f"gen_{algo}_columns{level or ''}", fs, arrays, rows * w, packed, (accs, w), (rows, w, int(first)))


def gen_map(algo: str, fs: int, arrays: Sequence[np.ndarray], packed: bytes) -> bool:
    """Run the generated map phase of ``algo``'s flag set ``fs`` on ``arrays``; ``packed``: the definition's
    scalars then the fold's, as doubles.  False (nothing touched) when it cannot."""
    return _gen(f"gen_{algo}_map", fs, arrays, arrays[0].size, packed)


def _gen(entry: str, fs: int, arrays: Sequence[np.ndarray], n: int, packed: bytes, accs: tuple = ((), 0),
         extent: tuple | None = None) -> bool:
    """``accs``: (the column sums, their length); ``extent``: the arguments that replace n (a reduce phase's)."""
    fns = _lib()
    fn = None if fns is None else fns.get(entry)
    dtype = arrays[0].dtype
    dt = _DT.get(dtype)
    if fn is None or dt is None:
        return False
    for group, size in ((arrays, n), accs):
        if any(a.dtype != dtype or not a.flags.c_contiguous or not a.flags.aligned or a.size != size for a in group):
            return False
    ptrs = [(ctypes.c_void_p * len(group))(*[a.__array_interface__["data"][0] for a in group])
            for group in (arrays, accs[0]) if len(group)]
    if fn(dt, fs, *ptrs, *(extent or (n,)), _scalars(packed)) != 0:
        raise RuntimeError(f"flatopt_{entry} has no loop for flag set {fs}")
    return True

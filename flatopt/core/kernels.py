"""The one cached loader of the package's CUDA sources (``flatopt/kernels/*.cu``).

Each ``.cu`` file holds ``template <typename T>`` kernels; the loader compiles a file once per device (thread-safe,
through ``core.backend.raw_module``), instantiated for ``float`` and ``double``, with a ``#line`` directive so that
compiler errors point into the ``.cu`` file (its path written with forward slashes: in a ``#line`` file name, the
backslashes of a Windows path would begin escapes, ``\\U`` a universal-character name, which NVRTC rejects).
``KERNELS`` names the template kernels of every file: the CI test that compiles every source without a GPU uses the
same list, so what is tested is what runs.

Scalar arguments are packed at the width of the kernel's parameter (:func:`param_types`, read from the kernel's
signature in its source).  CuPy packs each scalar at its own width (a Python float as a double, a NumPy float32 in
4 bytes) and the device reads ``sizeof(parameter)`` bytes, so a NumPy float32 given to a ``double`` parameter would
be read as about 5e-315.  Every launch goes through :func:`get`, so no call site can pack a scalar at another width.
"""

from __future__ import annotations

import functools
import re
from typing import Any
from pathlib import Path

import numpy as np

from . import backend

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"

# file -> template kernels it defines
KERNELS: dict[str, tuple[str, ...]] = {
    "adafactor.cu": ("af_stats_multi", "af_cols_multi", "af_colfold_multi", "af_factors_multi", "af_scalars_multi",
                     "af_apply_multi"),
    "adafactor8bit.cu": ("a8_al_ema", "a8_m_ema", "a8f_rows", "a8f_col_parts", "a8f_col_fin", "a8f_al_encode",
                         "a8f_factors", "a8f_scalars", "a8f_usq_rows", "a8f_apply", "a8f_m_step", "a8f_flat_u",
                         "a8f_flat_apply", "a8f_rows_seg", "a8f_cols_seg", "a8f_colfin_seg", "a8f_encode_seg",
                         "a8f_factors_seg", "a8f_scalars_seg", "a8f_apply_seg", "a8f_flat_u_seg", "a8f_flat_apply_seg"),
    "adam.cu": ("adam_step", "adam_multi"),
    "adamw.cu": ("adamw_step", "adamw_multi"),
    "apollo8bit.cu": ("ap_draw", "ap_grad", "ap_lowrank", "ap_scalars", "ap_apply"),
    "kron.cu": ("kron_momentum", "kron_probe", "kron_ds", "kron_slb_m", "kron_slb_y", "kron_dense_div",
                "kron_dense_new", "kron_diag_new", "kron_commit", "kron_final"),
    "lion.cu": ("lion_step", "lion_multi"),
    "muon.cu": ("muon_momentum", "muon_normalize", "muon_ns_b", "muon_ns_combine", "muon_ns_final"),
    "nadamw.cu": ("nadamw_step", "nadamw_multi"),
    "qhadamw.cu": ("qhadamw_step", "qhadamw_multi"),
    "radam.cu": ("radam_step", "radam_multi"),
    "sgd.cu": ("sgd_step", "sgd_multi"),
    "sq_norm.cu": ("sq64_partials", "sq64_fold"),
    "sophia.cu": ("sophia_step", "sophia_multi"),
}


def _generated() -> dict[str, tuple[str, ...]]:
    """The generated sources (``kernels/generated/*.cu``, written by ``core/elementwise``) and their kernels."""
    out = {}
    for path in sorted((KERNEL_DIR / "generated").glob("*.cu")):
        names = re.findall(r"__global__ void __launch_bounds__\(\d+(?:, \d+)?\) (\w+)\(", path.read_text())
        out[f"generated/{path.name}"] = tuple(names)
    return out


KERNELS.update(_generated())

CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.M)


@functools.lru_cache(maxsize=None)
def source(filename: str) -> str:
    """The file's text for NVRTC, with ``#line`` directives, and each ``#include "x.cuh"`` of a header beside it
    pasted in (NVRTC is given no include path; g++, the CPU emulator, resolves the include itself)."""
    path = KERNEL_DIR / filename

    def paste(m: re.Match[str]) -> str:
        header = KERNEL_DIR / m.group(1)
        line = path.read_text().count("\n", 0, m.start()) + 2
        return f'#line 1 "{_line_name(header)}"\n{header.read_text()}\n#line {line} "{_line_name(path)}"'

    return f'#line 1 "{_line_name(path)}"\n' + _INCLUDE.sub(paste, path.read_text())


def _line_name(path) -> str:
    """``path`` as a ``#line`` file name: forward slashes (the name is a string literal, where a Windows path's
    backslashes would be escapes), and any quote or backslash left escaped."""
    return path.as_posix().replace("\\", "\\\\").replace('"', '\\"')


def name_expressions(filename: str) -> list[str]:
    return list(_names(filename))


@functools.lru_cache(maxsize=None)
def _names(filename: str) -> tuple[str, ...]:
    return tuple(f"{k}<{c}>" for k in KERNELS[filename] for c in CTYPES.values())


def get(filename: str, kernel: str, dtype: Any) -> Any:
    """The compiled ``kernel<T>`` of ``filename`` for ``dtype`` on the current device: built once per (file, kernel,
    dtype, device) and cached (``core.backend.raw_function``), not per launch.  Called like ``cupy.RawKernel``; each
    scalar argument is converted to its parameter's type first (:func:`param_types`)."""
    ctype = CTYPES[np.dtype(dtype)]
    return backend.raw_function(("flatopt", filename), source(filename), _names(filename), f"{kernel}<{ctype}>",
                                param_types(filename, kernel, ctype))


# C scalar types of kernel parameters -> the NumPy scalar type CuPy packs at that width
SCALARS: dict[str, type] = {"float": np.float32, "double": np.float64, "int": np.int32, "unsigned int": np.uint32,
                            "long long": np.int64, "unsigned long long": np.uint64, "bool": np.bool_,
                            "unsigned char": np.uint8, "char": np.int8, "short": np.int16}
_KERNEL = re.compile(r"template\s*<\s*typename\s+(\w+)\s*>\s*__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                     r"(\w+)\s*\(([^)]*)\)")


@functools.lru_cache(maxsize=None)
def param_types(filename: str, kernel: str, ctype: str) -> tuple[type | None, ...]:
    """The NumPy scalar type of each parameter of ``kernel<ctype>`` in ``filename`` (None for a pointer), read from
    its signature: what each launch argument is packed as."""
    for m in _KERNEL.finditer(source(filename)):
        if m.group(2) != kernel:
            continue
        out: list[type | None] = []
        for param in m.group(3).split(","):
            if "*" in param:
                out.append(None)
                continue
            words = [w for w in param.split()[:-1] if w not in ("const", "__restrict__", "volatile")]
            base = " ".join(ctype if w == m.group(1) else w for w in words)
            if base not in SCALARS:
                raise ValueError(f"{filename}: {kernel}: parameter {param.strip()!r} has no known scalar type")
            out.append(SCALARS[base])
        return tuple(out)
    raise KeyError(f"{filename} defines no template kernel {kernel!r}")

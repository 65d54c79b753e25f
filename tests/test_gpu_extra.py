"""The GPU extras bring what CuPy needs on a pip-only machine (gpu-review H4, M4), and an old CuPy is refused.

* ``cuda12`` / ``cuda13``: CuPy >= 14 with its ``ctk`` extra (CUDA headers for CuPy's own kernels, NVRTC, cuBLAS,
  cuSOLVER: without them CuPy 14 raises "Failed to find CUDA headers" at the first compile and ``cupy.matmul`` cannot
  load cuBLAS); ``distributed-cuda12`` / ``-cuda13`` add NCCL.
* The clean-venv probe installs the extra (about 1.3 GB of CUDA wheels) and is therefore opt-in:
  ``FLATOPT_PROBE_GPU_EXTRA=1 python -m pytest tests/test_gpu_extra.py``; it is skipped where the package index
  cannot be reached.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flatopt.core import backend

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra, cupy", [("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x"),
                                         ("distributed-cuda12", "cupy-cuda12x"),
                                         ("distributed-cuda13", "cupy-cuda13x")])
def test_gpu_extras_bring_cupy_14_with_the_cuda_wheels(extra, cupy):
    reqs = _extras()[extra]
    assert f"{cupy}[ctk]>=14" in reqs, reqs
    if extra.startswith("distributed"):
        assert f"nvidia-nccl-{extra[-6:].replace('uda', 'u')}" in reqs, reqs


def test_test_extra_does_not_pull_the_cuda_toolkit_wheels():
    """The test extra needs NVRTC only (it compiles the sources); the ctk wheels are ~1.3 GB."""
    reqs = _extras()["test"]
    assert not any("[ctk]" in r for r in reqs) and any(r.startswith("nvidia-cuda-nvrtc") for r in reqs), reqs


@pytest.mark.parametrize("version", ["13.6.0", "12.3.0", "14.0.0rc1"])
def test_old_cupy_is_refused_at_import(version, monkeypatch):
    fake = types.ModuleType("cupy")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(backend, "_cupy", None)
    if version.startswith("14"):
        assert backend.cupy() is fake
    else:
        with pytest.raises(ImportError, match=rf"CuPy >= 14 \(found cupy {re.escape(version)}\)"):
            backend.cupy()


_PROBE = r"""
import os, sys
import cupy, cupyx.scipy.linalg  # cuBLAS / cuSOLVER bindings load
from cupy._core import core
core.assemble_cupy_compiler_options(())  # CuPy 14 raises "Failed to find CUDA headers" without them
from cupy.cuda import nccl
assert tuple(int(x) for x in cupy.__version__.split(".")[:1]) >= (14,), cupy.__version__
print("ok", cupy.__version__, nccl.available)
"""


@pytest.mark.skipif(os.environ.get("FLATOPT_PROBE_GPU_EXTRA") != "1",
                    reason="downloads ~1.3 GB of CUDA wheels: set FLATOPT_PROBE_GPU_EXTRA=1 to run")
@pytest.mark.parametrize("extra", ["distributed-cuda13"])
def test_gpu_extra_installs_in_a_clean_venv(extra, tmp_path):
    """A fresh venv with only ``flatopt[extra]``: CuPy imports ``cupyx.scipy.linalg`` and finds CUDA headers with no
    CUDA toolkit in sight (CUDA_PATH points at an empty folder)."""
    reach = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "cupy-cuda13x"], capture_output=True,
                           text=True, timeout=60)
    if reach.returncode != 0:
        pytest.skip(f"no package index reachable: {reach.stderr.strip()[-200:]}")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    out = subprocess.run([py, "-m", "pip", "install", "--quiet", f"{ROOT}[{extra}]"], capture_output=True, text=True,
                         timeout=3600)
    assert out.returncode == 0, out.stderr[-2000:]
    (tmp_path / "no-cuda").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA")}
    env.update(CUDA_PATH=str(tmp_path / "no-cuda"), PATH=str(venv / "bin") + ":/usr/bin:/bin")
    run = subprocess.run([py, "-c", _PROBE], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-2000:]

"""The backend dispatch: importing flatopt needs only NumPy; mixed inputs are refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import flatopt
from flatopt.core import backend


def test_import_does_not_import_cupy():
    code = "import sys, numpy as np, flatopt\n" \
           "o = flatopt.AdamW(); w = np.ones(4, np.float32); o.step('w', (4,), w, w.copy())\n" \
           "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_only_backend_module_mentions_cupy_imports():
    import pathlib
    import re

    root = pathlib.Path(flatopt.__file__).parent
    pattern = re.compile(r"^\s*(import cupy|from cupy)", re.M)
    offenders = [p.name for p in root.rglob("*.py") if p.relative_to(root).as_posix() != "core/backend.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_array_module_and_errors():
    a = np.zeros(3, np.float32)
    assert backend.array_module(a, a) is np
    with pytest.raises(TypeError, match="numpy.ndarray or cupy.ndarray"):
        backend.array_module([1.0, 2.0])


@pytest.mark.usefixtures("gpu_or_emulated")
def test_mixed_numpy_cupy_refused():
    cp = backend.cupy()
    with pytest.raises(TypeError, match="param is a numpy array but grad is a cupy array"):
        flatopt.AdamW().step("w", (3,), np.zeros(3, np.float32), cp.zeros(3, np.float32))


def test_protocol_and_public_types():
    assert isinstance(flatopt.SGD(0.1), flatopt.Optimizer)
    item = flatopt.OptItem("w", (2,), np.zeros(2), np.zeros(2))
    assert item.name == "w" and item.shape == (2,)
    assert not isinstance(object(), flatopt.Optimizer)

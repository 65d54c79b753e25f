"""The GPU-path defects of issue #18 (``../shared/reference/gpu-audit.md`` §1.4, §3), each pinned without a GPU:
through the NumPy stand-in of CuPy (``tests/fake_device.py``), CuPy's installed Python API (it imports without a
GPU), and the host-side logic of the CuPy execution (streams and events recorded by a small fake).  The kernels
themselves are compared with their twins by ``tests/test_gpu.py`` (on a GPU, or on the emulator)."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

import flatopt
from flatopt.core import backend as _backend

from . import fake_device
from .helpers import rng_arrays
from .test_device_paths import XP, _device_steps, _numpy_steps


@pytest.fixture(autouse=True)
def _twins(monkeypatch):
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "1")  # no CUDA kernels on the stand-in


def _cupy_or_skip():
    try:
        return _backend.cupy()
    except ImportError:
        pytest.skip("cupy is not installed")


# ------------------------------------------------------------------------------------------ D3: einsum(out=)
def test_the_stand_in_einsum_takes_the_keywords_of_the_installed_cupy():
    cp = _cupy_or_skip()
    src = re.sub(r"#.*", "", inspect.getsource(cp.einsum))  # (its source has a commented-out casting pop)
    accepted = set(re.findall(r"kwargs\.pop\(\s*'(\w+)'", src))
    assert "if kwargs:" in src and "raise TypeError" in src  # every other keyword is rejected
    assert accepted == set(fake_device.EINSUM_KWARGS)
    with pytest.raises(TypeError):
        XP.einsum("i,i->", XP.ones(2), XP.ones(2), out=XP.empty(()))


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (24, 24)])
def test_apollo_steps_on_the_device_branch_for_every_orientation(shape):
    """rows ≥ cols ("right") measured G's channel norms with ``einsum(out=)``: TypeError at step 1 on CuPy."""
    cfg = dict(apollo_rank=4, enable_fira_for_apollo=True, min_8bit_size=0, block_size=128, m_block_size=32,
               use_cuda_kernel=False, groups=[("*", {})])
    params = {"w": (shape, rng_arrays(0, shape, scale=0.1))}
    dev = _device_steps(flatopt.Adafactor8Bit(**cfg), params, 2, np.float32)
    host = _numpy_steps(flatopt.Adafactor8Bit(**cfg), params, 2)
    assert np.all(np.isfinite(dev["w"]))
    assert dev["w"].shape == host["w"].shape

"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from .cuda_emu import fakecupy


@pytest.fixture
def gpu_or_emulated():
    """The real GPU when one answers; otherwise CuPy is the stand-in of tests/cuda_emu and the kernels run on its
    emulator, so that CI (which has no GPU) executes the GPU tests too.  Use as
    ``@pytest.mark.usefixtures("gpu_or_emulated")``."""
    yield from fakecupy.device_or_emulated()

"""16-bit parameters on CuPy (the real GPU where one answers, else the stand-in of tests/cuda_emu): the lowered path
(core/lowp.py) gives NumPy's bits, with no host synchronisation inside a step."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

import flatopt
from flatopt import OptItem, Precision

from .cuda_emu import fakecupy
from .helpers import assert_bits_equal, assert_states_equal
from .test_precision import LOWP, MODES, make


@pytest.mark.usefixtures("gpu_or_emulated")
@pytest.mark.parametrize("gpu_chunk", [None, 256])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_cupy_gives_the_numpy_bits(dtype, mode, gpu_chunk, monkeypatch):
    """The lowered path on CuPy (the fused kernels on the float32 working copies, the write-back with CuPy
    operations): the same bits as on NumPy, and the same snapshot; also with CuPy's write-back chunks cut small
    (``gpu_chunk``: the 1320 elements of "a" in six chunks, NumPy's in one)."""
    from flatopt.core import backend, lowp

    if gpu_chunk is not None:
        monkeypatch.setattr(lowp, "GPU_CHUNK", gpu_chunk)

    cp = backend.cupy()
    shapes = {"a": (40, 33), "b": (17,)}
    host = {n: np.random.default_rng(i).standard_normal(math.prod(s)).astype(np.float32).astype(dtype)
            for i, (n, s) in enumerate(shapes.items())}
    grads = [{n: np.random.default_rng(10 + k).standard_normal(p.size).astype(np.float32).astype(dtype)
              for n, p in host.items()} for k in range(3)]
    on_host = make(flatopt.AdamW, Precision(mode, seed=2), lr=1e-2)
    on_dev = make(flatopt.AdamW, Precision(mode, seed=2), lr=1e-2)
    dev = {n: cp.asarray(p) for n, p in host.items()}
    assert backend.backend_name(dev["a"]) == "cupy"
    emulated = cp is fakecupy.module
    for k, g in enumerate(grads):
        on_host.step_batch([OptItem(n, shapes[n], host[n], g[n]) for n in shapes])
        items = [OptItem(n, shapes[n], dev[n], cp.asarray(g[n])) for n in shapes]
        with fakecupy.forbid_sync() if emulated and k else contextlib.nullcontext():  # no host sync in a step
            on_dev.step_batch(items)
    for n in shapes:
        assert_bits_equal(dev[n], host[n], n)
    a, b = on_dev.state_dict(), on_host.state_dict()
    a = flatopt.OptimizerState(**{**a.__dict__, "buffers": {k: backend.to_numpy(v) for k, v in a.buffers.items()}})
    assert_states_equal(a, b)


@pytest.mark.usefixtures("gpu_or_emulated")
@pytest.mark.parametrize("mode", ["kahan", "master"])
def test_validate_batch_after_a_resume_onto_cupy(mode):
    """A snapshot's write-back buffers load as NumPy arrays and move to the parameter's backend at its next step:
    ``validate_batch`` before that step accepts the CuPy items (it validates working copies on their backend)."""
    from flatopt.core import backend

    cp = backend.cupy()
    host = np.random.default_rng(0).standard_normal(40).astype(np.float16)
    opt = make(flatopt.AdamW, Precision(mode), lr=1e-2)
    opt.step("a", (40,), host, host.copy())
    fresh = make(flatopt.AdamW, Precision(mode), lr=1e-2)
    assert fresh.load_state_dict(opt.state_dict())
    dev, g = cp.asarray(host), cp.asarray(host)
    fresh.validate_batch([OptItem("a", (40,), dev, g)])
    fresh.step("a", (40,), dev, g)
    opt.step("a", (40,), host, host.copy())
    assert_bits_equal(dev, host, "a")

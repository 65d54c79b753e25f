"""The CuPy branches of every optimizer, run without a GPU on ``tests/fake_device.FakeDevice`` (NumPy arrays that
refuse host reads): each algorithm's twin steps with ``xp`` not NumPy — one block per pass, every data-dependent
scalar a 0-d device array — and must (1) never read a device value on the host and (2) agree with the NumPy
driver.  The CUDA kernels themselves, streams and CuPy's API are covered by tests/test_gpu.py on a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flatopt
from flatopt.core import backend as _backend
from flatopt.kron import layout

from . import fake_device
from .helpers import grads_for, make_params, rng_arrays
from .registry import REGISTRY
from .test_adafactor8bit import CONFIGS as A8_CONFIGS
from .test_adafactor8bit import PATHS as A8_PATHS

XP = fake_device.FakeDevice()
SKIP = {"muon_adamw": "a composite of Muon and AdamW, whose twins are covered by their own entries"}
@pytest.fixture(autouse=True)
def _twins(monkeypatch):
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "1")  # no CUDA kernels on the stand-in
    monkeypatch.setattr(_backend, "solve_triangular", lambda: fake_device.solve_triangular)


def _device_steps(opt, params, steps, dtype):
    """``steps`` iterations of the twin on the stand-in, the driver's per-name state and step count by hand."""
    dev = {n: (s, XP.asarray(p.copy())) for n, (s, p) in params.items()}
    states = {}
    for it in range(steps):
        grads = grads_for(params, it)
        for n, (s, p) in sorted(dev.items()):
            if n not in states:
                states[n] = opt.hooks.init(n, XP, s, np.dtype(dtype))
                if hasattr(states[n], "ctx"):  # KronPsgd: its probe stream, as its driver sets it
                    states[n].ctx = (n, layout.stream_key(opt.config.seed, n), opt._hook)
            lr = opt.hooks.effective_lr(opt.lr_scale(n))
            if hasattr(opt, "step_lr"):  # per-parameter host numbers (ScheduleFreeAdamW), advanced as its driver does
                lr = opt.step_lr(states[n], it + 1, lr)
            opt.hooks.update(XP, states[n], p, XP.asarray(grads[n]), t=it + 1, lr=lr,
                             scratch=[XP.empty_like(p) for _ in range(opt.scratch_buffers)])
    return {n: XP.asnumpy(p) for n, (_, p) in dev.items()}


def _numpy_steps(opt, params, steps):
    params = {n: (s, p.copy()) for n, (s, p) in params.items()}
    for it in range(steps):
        grads = grads_for(params, it)
        for n, (s, p) in sorted(params.items()):
            opt.step(n, s, p, grads[n])
    return {n: p for n, (_, p) in params.items()}


# Measured max |device − NumPy| / max|θ| after 3 steps: ≤ 6.3e-8 everywhere except CAME, 4.6e-6 (its confidence
# divides by (U − m)², which amplifies the block-vs-whole rounding of U); bounds ~8× and ~2× above.
TOL = {"came": 1e-5}


def _compare(a, b, what):
    tol = TOL.get(what, 5e-7)
    for n in a:  # one block here, several blocks on NumPy for large shapes: float32 rounding only
        scale = max(float(np.max(np.abs(b[n]))), 1e-30)
        assert float(np.max(np.abs(a[n] - b[n]))) <= tol * scale, (what, n)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registry_twins_run_on_the_device_branch(name):
    if name in SKIP:
        pytest.skip(SKIP[name])
    spec = REGISTRY[name]
    params = make_params(spec.shapes)
    _compare(_device_steps(spec.make(), params, 3, np.float32), _numpy_steps(spec.make(), params, 3), name)


@pytest.mark.parametrize("name", sorted(set(A8_CONFIGS) | set(A8_PATHS)))
def test_adafactor8bit_paths_on_the_device_branch(name):
    """Every Adafactor8Bit path (quantized with small blocks, which do not divide the rows) on a tensor that NumPy
    cuts into several ranges and blocks; the stand-in runs it as one."""
    cfg = dict(A8_CONFIGS.get(name, A8_PATHS.get(name)), block_size=384, m_block_size=96, min_8bit_size=0,
               use_cuda_kernel=False)
    shape = (3, 101, 157) if not cfg.get("apollo_rank") else (303, 157)
    params = {"w": (shape, rng_arrays(0, shape, scale=0.1)), "b": ((157,), rng_arrays(1, (157,), scale=0.1))}
    assert math.prod(shape) > (1 << 15)
    _compare(_device_steps(flatopt.Adafactor8Bit(**cfg), params, 3, np.float32),
             _numpy_steps(flatopt.Adafactor8Bit(**cfg), params, 3), name)  # APOLLO: the default P, on both


def test_the_stand_in_catches_a_host_read():
    x = XP.ones(3, np.float32)
    with pytest.raises(fake_device.HostSync):
        float(XP.sum(x))
    with pytest.raises(fake_device.HostSync):
        bool(XP.max(x) > 0)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_driver_hands_device_items_to_the_gpu_runner(name, monkeypatch):
    """Each ``_run`` (the driver's and the overrides: Adafactor, Adafactor8Bit, Muon) sends the items whose state
    lives on a device to ``core.gpu_run.run_gpu`` with their advanced step count, and steps none of them itself."""
    from flatopt import OptItem
    from flatopt.core import gpu_run, slots

    if name in SKIP:
        pytest.skip(SKIP[name])
    spec = REGISTRY[name]
    opt = spec.make()
    shape = (4, 3)
    p, g = rng_arrays(0, shape), rng_arrays(1, shape)
    before = p.copy()
    state = opt.hooks.init("w", np, shape, np.dtype(np.float32))
    slot = slots.Slot(shape=shape, dtype=np.dtype(np.float32), backend="cupy", t=0, state=state)
    seen = []
    monkeypatch.setattr(gpu_run, "run_gpu", lambda o, items: seen.extend((o, it.name, s.t) for it, s, _ in items))
    opt._execute([(OptItem("w", shape, p, g), slot, 1.0)])
    assert seen == [(opt, "w", 1)]
    np.testing.assert_array_equal(p, before)

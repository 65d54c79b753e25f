"""Several GPUs in one process, and stream ordering, on the CuPy stand-in (``tests/cuda_emu``: two devices without
peer access, a launch or operation given memory of another device than the current one fails, and a happens-before
race detector over every kernel and CuPy operation).

* H1 (``shared/reference/gpu-review.md``): every registry optimizer steps a batch whose parameters live on device 1
  while device 0 is current, bit for bit as on device 0, with every state array (scratch included) on device 1; a
  parameter given on another device than its state is refused before anything changes.
* S1: an item that raises inside a ``step_batch`` worker still joins the other workers' streams into the caller's.
* L4: the per-thread workspace is per stream.
* The streams test and the error paths run under the race detector with 0 hazards, and removing any one of flatopt's
  waits makes the detector report hazards while the results stay bit-identical.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flatopt import OptItem
from flatopt.core import backend

from .cuda_emu import emu, fakecupy
from .helpers import assert_bits_equal, grads_for, make_for, make_params
from .registry import REGISTRY

NAMES = sorted(REGISTRY)


@pytest.fixture(scope="module", autouse=True)
def stand_in():
    """Always the stand-in (its two devices and its race detector), also where a real GPU answers."""
    why = emu.available()
    if why:
        pytest.skip(why)
    with fakecupy.installed() as cp:
        yield cp


def _on(params, device):
    cp = backend.cupy()
    with cp.cuda.Device(device):
        return {n: (s, cp.asarray(p)) for n, (s, p) in params.items()}


def _steps(opt, params, steps, *, batch=True, start=0):
    """``steps`` iterations, each gradient on its parameter's device (the current device stays what it is)."""
    cp = backend.cupy()
    for it in range(start, start + steps):
        host = grads_for({n: (s, backend.to_numpy(p)) for n, (s, p) in params.items()}, it)
        grads = {}
        for n, g in host.items():
            with params[n][1].device:
                grads[n] = cp.asarray(g)
        items = [OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())]
        if batch:
            opt.step_batch(items)
        else:
            for item in items:
                opt.step(*item)
        opt.end_iteration()


def _state_devices(opt):
    devs = set()
    parts = (opt.muon, opt.adamw) if hasattr(opt, "muon") else (opt,)  # MuonAdamW composes two
    for slot in (s for o in parts for s in o._slots.values()):  # noqa: SLF001
        for f in dataclasses.fields(slot.state):
            v = getattr(slot.state, f.name)
            if backend.is_cupy_array(v):
                devs.add(v.device.id)
    return devs


# ---------------------------------------------------------------------------------------------------------------- H1
@pytest.mark.parametrize("name", NAMES)
def test_a_batch_on_device_1_steps_as_on_device_0(name):
    """States, scratch, workspaces and tables of a device-1 batch are made on device 1 although device 0 is current
    (before: on device 0, so the first fused launch or CuPy operation got memory of the other device)."""
    spec = REGISTRY[name]
    base = make_params(spec.shapes)
    ref, dev1 = _on(base, 0), _on(base, 1)
    opt0, opt1 = make_for(spec, ref), make_for(spec, dev1)
    for opt, params in ((opt0, ref), (opt1, dev1)):
        _steps(opt, params, 2)  # batches (multi-tensor groups, worker streams, segmented plans)
        _steps(opt, params, 1, batch=False, start=2)  # one item at a time
    assert backend.cupy().cuda.Device().id == 0
    for n in base:
        assert dev1[n][1].device.id == 1
        assert_bits_equal(ref[n][1], dev1[n][1], n)
    assert _state_devices(opt1) <= {1} and _state_devices(opt0) <= {0}  # (SGD without momentum, Stiefel: none)


@pytest.mark.parametrize("name", NAMES)
def test_a_parameter_on_another_device_than_its_state_is_refused(name):
    spec = REGISTRY[name]
    base = make_params(spec.shapes)
    params = _on(base, 0)
    opt = make_for(spec, params)
    _steps(opt, params, 1)
    before = opt.state_dict()
    moved = _on({n: (s, backend.to_numpy(p)) for n, (s, p) in params.items()}, 1)
    first = sorted(moved)[0]
    mixed = dict(params, **{first: moved[first]})  # one parameter now on device 1, its state on device 0
    kept = {n: backend.to_numpy(p).copy() for n, (_, p) in mixed.items()}
    with pytest.raises(ValueError, match=rf"parameter '{first}'.*GPU 1.*GPU 0"):
        _steps(opt, mixed, 1)
    for n, (_, p) in mixed.items():
        assert_bits_equal(p, kept[n], n)
    after = opt.state_dict()
    assert after.params == before.params
    for k in before.buffers:
        assert_bits_equal(after.buffers[k], before.buffers[k], k)

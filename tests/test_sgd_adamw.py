"""SGD and AdamW: an independent float64 reference from the formulas, and conformance with torch.optim."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flatopt

from .helpers import rng_arrays

SHAPES = [(7,), (4, 3), (2, 3, 4), (70001,)]  # the last spans several chunks (the NumPy path is chunked)
EPS = {np.float32: np.finfo(np.float32).eps, np.float64: np.finfo(np.float64).eps}


def lr_schedule(step: int) -> float:
    return 0.02 * (0.5 + step) / (1 + step)  # changes every step: exercises set_lr


def ref_adamw(p, grads, lr_of, betas, eps, weight_decay, amsgrad):
    wd = weight_decay
    """torch.optim.AdamW, written from its documentation, in float64."""
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        lr = lr_of(t - 1)
        g = g.astype(np.float64)
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        vh = (vmax if amsgrad else v) / (1 - b2**t)
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(vh) + eps)
    return p


def ref_sgd(p, grads, lr_of, momentum, dampening, nesterov, weight_decay):
    wd = weight_decay
    p = p.astype(np.float64).copy()
    buf = None
    for i, g in enumerate(grads):
        g = g.astype(np.float64) + wd * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr_of(i) * g
    return p


ADAMW_CONFIGS = [
    dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False),
    dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False),
    dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, amsgrad=True),
]
SGD_CONFIGS = [
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
    dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.01),
    dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0),
    dict(momentum=0.5, dampening=0.3, nesterov=False, weight_decay=0.1),
]
STEPS = 6


def _run_flatopt(opt, p, grads, shape):
    p = p.copy()
    for i, g in enumerate(grads):
        opt.set_lr(lr_schedule(i))
        opt.step("w", shape, p, g)
    return p


def _tolerance(dtype, p_ref, steps):
    # each step rounds the parameter once (plus a few ulps inside the update, whose size is ~lr):
    # the error grows at most linearly in the number of steps, in ulps of the parameter's magnitude
    return 4 * steps * EPS[dtype] * max(1.0, float(np.max(np.abs(p_ref))))


def _data(shape, dtype):
    p = rng_arrays(1, shape, dtype)
    grads = [rng_arrays(10 + i, shape, dtype, scale=10.0 ** (i % 3 - 1)) for i in range(STEPS)]
    return p, grads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", ADAMW_CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_adamw_matches_float64_reference(shape, cfg, dtype):
    p, grads = _data(shape, dtype)
    got = _run_flatopt(flatopt.AdamW(lr=1.0, **cfg), p, grads, shape)
    want = ref_adamw(p, grads, lr_schedule, **cfg)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(dtype, want, STEPS))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", SGD_CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_sgd_matches_float64_reference(shape, cfg, dtype):
    p, grads = _data(shape, dtype)
    got = _run_flatopt(flatopt.SGD(lr=1.0, **cfg), p, grads, shape)
    want = ref_sgd(p, grads, lr_schedule, **cfg)
    # the momentum buffer sums gradients of size up to ~10: scale the tolerance by it
    scale = max(1.0, max(float(np.max(np.abs(g))) for g in grads) / (1 - cfg["momentum"]))
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(dtype, want, STEPS) * scale)


def _torch_run(torch_opt_cls, p, grads, shape, **kw):
    torch = pytest.importorskip("torch")
    tp = torch.nn.Parameter(torch.from_numpy(p.reshape(shape).copy()))
    opt = torch_opt_cls([tp], lr=lr_schedule(0), **kw)
    for i, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = lr_schedule(i)
        tp.grad = torch.from_numpy(g.reshape(shape).copy())
        opt.step()
    return tp.detach().numpy().reshape(-1)


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", ADAMW_CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_adamw_matches_torch(shape, cfg, dtype, impl):
    torch = pytest.importorskip("torch")
    p, grads = _data(shape, dtype)
    flags = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    want = _torch_run(torch.optim.AdamW, p, grads, shape, **cfg, **flags)
    got = _run_flatopt(flatopt.AdamW(lr=1.0, **cfg), p, grads, shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(dtype, want, STEPS))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", SGD_CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_sgd_matches_torch(shape, cfg, dtype):
    torch = pytest.importorskip("torch")
    p, grads = _data(shape, dtype)
    want = _torch_run(torch.optim.SGD, p, grads, shape, foreach=False, **cfg)
    got = _run_flatopt(flatopt.SGD(lr=1.0, **cfg), p, grads, shape)
    scale = max(1.0, max(float(np.max(np.abs(g))) for g in grads) / (1 - cfg["momentum"]))
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(dtype, want, STEPS) * scale)


def test_adamw_single_tensor_torch_agreement_is_tight():
    """Same operation order as torch's single-tensor path: within one ulp of the largest parameter."""
    torch = pytest.importorskip("torch")
    shape = (4096,)
    p, grads = _data(shape, np.float32)
    want = _torch_run(torch.optim.AdamW, p, grads, shape, foreach=False, weight_decay=0.01)
    got = _run_flatopt(flatopt.AdamW(lr=1.0, weight_decay=0.01), p, grads, shape)
    diff = np.abs(got - want).max()
    assert diff <= np.spacing(np.abs(want).max()), diff


def test_hyperparameters_validated():
    for bad in (dict(lr=-1.0), dict(lr=float("nan")), dict(betas=(1.0, 0.9)), dict(betas=(0.9,)),
                dict(eps=-1.0), dict(weight_decay=-0.1), dict(amsgrad=1)):
        with pytest.raises((ValueError, TypeError)):
            flatopt.AdamW(**bad)
    for bad in (dict(lr=-1.0), dict(lr=0.1, momentum=1.5), dict(lr=0.1, nesterov=True),
                dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), dict(lr=0.1, weight_decay=-1)):
        with pytest.raises((ValueError, TypeError)):
            flatopt.SGD(**bad)


def test_defaults_are_torchs():
    c = flatopt.AdamW().config
    assert (c.lr, c.betas, c.eps, c.weight_decay, c.amsgrad) == (1e-3, (0.9, 0.999), 1e-8, 1e-2, False)
    s = flatopt.SGD(0.1).config
    assert (s.momentum, s.dampening, s.nesterov, s.weight_decay) == (0.0, 0.0, False, 0.0)


def test_per_name_step_counts():
    """A parameter that gets no gradient is not stepped: its bias correction restarts nowhere."""
    opt = flatopt.AdamW(lr=0.1, weight_decay=0.0)
    a, b = np.ones(3, np.float32), np.ones(3, np.float32)
    g = np.full(3, 0.5, np.float32)
    for _ in range(3):
        opt.step("a", (3,), a, g)
        opt.end_iteration()
    opt.step("b", (3,), b, g)
    assert opt.state_dict().params["a"]["t"] == 3
    assert opt.state_dict().params["b"]["t"] == 1
    # first Adam step moves each coordinate by lr exactly (m̂/√v̂ = sign(g))
    np.testing.assert_allclose(b, 1 - 0.1, rtol=1e-6)
    assert math.isclose(opt.iteration, 3)

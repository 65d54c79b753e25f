"""Adafactor: an independent float64 reference from the paper, the rlx-optim defects D1–D3, the documented
conventions, and conformance with torch.optim.Adafactor, HF transformers' Adafactor and adafactor8bit's
pure-PyTorch path (each skipped when absent).

Tolerances.  float64 runs agree with the float64 reference to rounding (1e-12 relative to the update).  A float32
run differs from the exact result by the rounding of θ at each step (≤ 2 ulps: the decay and the subtraction) plus
a relative error of the update itself: about 30 roundings (the square, two sums reduced pairwise or over ≤ 64 rows,
the EMA, the divisions, two square roots, the two sums of squares behind RMS(θ) and RMS(U), the scalings).  Hence
|θ_f32 − θ_exact| ≤ Σ_t (2·ε·max|θ| + 64·ε·max|Δ_t|), ε = 2⁻²³; two float32 implementations differ by at most
twice that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import flatopt
from flatopt.core import backend, blocks

from .helpers import assert_bits_equal, rng_arrays

STEPS = 6
SHAPES = [(), (1,), (7,), (16, 12), (40, 3), (3, 40), (1, 9), (9, 1), (2, 5, 6), (2, 1, 3, 4)]
ORACLE_SHAPES = [(1,), (7,), (16, 12), (40, 3), (3, 40), (1, 9), (9, 1), (2, 5, 6)]


# --------------------------------------------------------------------------------------- float64 reference
def reference(shape, theta0, grads, *, lr=None, beta2_decay=-0.8, eps1=1e-30, eps2=1e-3, clip_threshold=1.0,
              weight_decay=0.0, beta1=None, beta2=None, scale_parameter=None, warmup_init=False, factored=True,
              rho_fn=None):
    """Shazeer & Stern, Algorithms 4/5 (row and column *sums*, V̂ = R·Cᵀ / 1ᵀR), relative step, update clip, HF's
    first moment and decoupled decay (adafactor.md §4.3), in float64.  Returns (θ, Σ_t max|Δ_t|)."""
    scale = (lr is None) if scale_parameter is None else scale_parameter
    th = np.asarray(theta0, np.float64).reshape(shape)
    fac = factored and len(shape) >= 2
    R = C = V = None
    M = np.zeros_like(th)
    total = 0.0
    for t, g in enumerate(grads, 1):
        G = np.asarray(g, np.float64).reshape(shape)
        if rho_fn is not None:
            rho = rho_fn(t)
        elif lr is None:
            rho = min(1e-6 * t if warmup_init else 1e-2, 1 / math.sqrt(t))
        else:
            rho = lr
        alpha = rho * max(eps2, math.sqrt(np.mean(th**2))) if scale else rho
        b = beta2 if beta2 is not None else 1.0 - t**beta2_decay
        S = G**2 + eps1
        if fac:
            rs, cs = S.sum(axis=-1), S.sum(axis=-2)  # sums, as in the paper
            R = rs * (1 - b) if R is None else b * R + (1 - b) * rs
            C = cs * (1 - b) if C is None else b * C + (1 - b) * cs
            Vhat = R[..., :, None] * C[..., None, :] / R.sum(axis=-1)[..., None, None]
        else:
            V = S * (1 - b) if V is None else b * V + (1 - b) * S
            Vhat = V
        U = G / np.sqrt(Vhat)
        U = U / max(1.0, math.sqrt(np.mean(U**2)) / clip_threshold)
        D = alpha * U
        if beta1 is not None:
            M = beta1 * M + (1 - beta1) * D
            D = M
        th = th - alpha * weight_decay * th - D
        total += float(np.max(np.abs(D)))
    return th.reshape(-1), total


def f32_bound(theta, delta_total, steps, factor=1.0):
    eps = float(np.finfo(np.float32).eps)
    return factor * (steps * 2 * eps * float(np.max(np.abs(theta), initial=0.0)) + 64 * eps * delta_total)


def data(shape, dtype, seed=0, steps=STEPS, scale=0.05):
    theta = rng_arrays(seed, shape, dtype, scale=scale)
    grads = [rng_arrays(seed + 100 + k, shape, dtype) for k in range(steps)]
    return theta, grads


def run_flat(opt, shape, theta, grads, name="w"):
    p = theta.copy()
    for g in grads:
        opt.step(name, shape, p, g)
        opt.end_iteration()
    return p


CONFIGS = {
    "default": {},
    "manual": {"lr": 0.02},
    "manual_beta1_wd": {"lr": 0.02, "beta1": 0.9, "weight_decay": 0.1},
    "fixed_beta2": {"beta2": 0.999},
    "decay_clip_wd": {"beta2_decay": -0.5, "clip_threshold": 0.5, "weight_decay": 0.05},
    "manual_scaled_beta1": {"lr": 0.01, "scale_parameter": True, "beta1": 0.5},
    "relative_unscaled": {"scale_parameter": False},
    "warmup": {"warmup_init": True},
    "unfactored": {"factored": False, "clip_threshold": 2.0},
    "large_eps1": {"eps1": 1e-2, "eps2": 0.5},
}


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_float64_reference(cfg, shape, dtype):
    kw = CONFIGS[cfg]
    theta, grads = data(shape, dtype)
    got = run_flat(flatopt.Adafactor(**kw), shape, theta, grads)
    ref, dtot = reference(shape, theta, grads, **kw)
    err = float(np.max(np.abs(got - ref), initial=0.0))
    if dtype == np.float64:
        assert err <= 1e-12 * max(dtot, 1e-30) + 4 * STEPS * 2.2e-16 * np.max(np.abs(ref)), err
    else:
        assert err <= f32_bound(ref, dtot, STEPS), (err, f32_bound(ref, dtot, STEPS))


@pytest.mark.parametrize("shape", [(3, 400, 300), (2, 140000), (140000, 2), (300000,), (10000, 5, 6)], ids=str)
def test_blocked_paths_match_reference(shape):
    """Row blocks of large matrices, groups of small matrices and flat blocks of long vectors."""
    assert math.prod(shape) > blocks.BLOCK
    theta, grads = data(shape, np.float64, steps=3)
    got = run_flat(flatopt.Adafactor(beta1=0.9, weight_decay=0.01), shape, theta, grads)
    ref, dtot = reference(shape, theta, grads, beta1=0.9, weight_decay=0.01)
    assert np.max(np.abs(got - ref)) <= 1e-12 * dtot + 1e-15


def test_single_block_layout_of_the_cupy_twin(monkeypatch):
    """The CuPy twin runs the whole tensor as one block; on NumPy the same code must give the blocked result."""
    shape = (3, 400, 300)
    assert math.prod(shape) > blocks.BLOCK
    theta, grads = data(shape, np.float64, steps=3)
    blocked = run_flat(flatopt.Adafactor(beta1=0.9), shape, theta, grads)
    monkeypatch.setattr(blocks, "BLOCK", 1 << 40)
    whole = run_flat(flatopt.Adafactor(beta1=0.9), shape, theta, grads)
    ref, dtot = reference(shape, theta, grads, beta1=0.9)
    assert np.max(np.abs(whole - ref)) <= 1e-12 * dtot and np.max(np.abs(whole - blocked)) <= 1e-12 * dtot


# ------------------------------------------------------------------------------- D1, D2, D3 (optimizer-trait §4)
def _first_update(shape, g, **kw):
    """θ₀ − θ₁ for a manual lr of 1 and no scaling: the clipped U itself."""
    p = np.zeros(math.prod(shape))
    flatopt.Adafactor(lr=1.0, **kw).step("w", shape, p, g)
    return -p


def test_d1_normalisation_is_by_the_mean_of_the_row_means():
    r, c = 8, 5
    g = rng_arrays(3, (r, c), np.float64)
    G = g.reshape(r, c)
    vhat = np.outer((G**2).mean(1), (G**2).mean(0)) / (G**2).mean()
    # clip_threshold 1e30: no clipping (a non-finite hyper-parameter is refused)
    u = _first_update((r, c), g, clip_threshold=1e30).reshape(r, c)
    np.testing.assert_allclose(u, G / np.sqrt(vhat), rtol=1e-13)
    rms = math.sqrt(np.mean(u**2))
    assert 0.9 < rms < 1.2  # rlx-optim's sum normalisation gives √8 times more (2.9)
    # rank-1 G² gives V̂ = G² exactly, so U = sign(G)
    a, b = np.array([1.0, -2.0, 3.0, 0.5]), np.array([0.3, -1.0, 2.0])
    u1 = _first_update((4, 3), np.outer(a, b).reshape(-1), clip_threshold=1e30)
    np.testing.assert_allclose(u1, np.sign(np.outer(a, b)).reshape(-1), rtol=1e-14)


@pytest.mark.parametrize("d", [2.0, 0.5, 1.0])
def test_d2_clip_divides_by_rms_over_d(d):
    a, b = np.array([1.0, -2.0, 3.0, 0.5]), np.array([0.3, -1.0, 2.0])
    g = (np.outer(a, b) * 1.7).reshape(-1)  # U = sign(G), RMS(U) = 1
    u = _first_update((4, 3), g, clip_threshold=d)
    expected = np.sign(g) / max(1.0, 1.0 / d)  # d = 2 leaves it, d = 0.5 halves it (rlx: the other way round)
    np.testing.assert_allclose(u, expected, rtol=1e-14)


@pytest.mark.parametrize("kw", [{}, {"lr": 0.01}, {"lr": 0.01, "scale_parameter": True}, {"beta1": 0.9}])
def test_d3_set_lr_scales_the_next_step(kw):
    shape = (6, 5)
    outs = []
    for lr in (0.004, 0.002):
        opt = flatopt.Adafactor(**kw)
        p = rng_arrays(0, shape, np.float64)
        opt.step("w", shape, p, rng_arrays(1, shape, np.float64))
        opt.set_lr(lr)
        start = p.copy()
        opt.step("w", shape, p, rng_arrays(2, shape, np.float64))
        outs.append(start - p)
    if "beta1" in kw:  # Δ = β1·M + (1 − β1)·Ũ: only the new part halves
        assert not np.allclose(outs[1], outs[0] / 2)
    else:
        np.testing.assert_allclose(outs[1], outs[0] / 2, rtol=1e-9)
    if True:  # ρ = lr from the next step, with the scaling resolved at construction
        theta = rng_arrays(0, shape, np.float64)
        grads = [rng_arrays(1, shape, np.float64), rng_arrays(2, shape, np.float64)]
        base = kw.get("lr")
        ref, _ = reference(shape, theta, grads, rho_fn=lambda t: (base if base else min(1e-2, 1 / math.sqrt(t)))
                           if t == 1 else 0.002, scale_parameter=kw.get("scale_parameter", base is None),
                           beta1=kw.get("beta1"))
        opt = flatopt.Adafactor(**kw)
        p = theta.copy()
        opt.step("w", shape, p, grads[0])
        opt.set_lr(0.002)
        opt.step("w", shape, p, grads[1])
        np.testing.assert_allclose(p, ref, rtol=1e-12)


def test_set_lr_none_returns_to_relative_step():
    shape = (4, 3)
    theta, grads = data(shape, np.float64, steps=3)
    opt = flatopt.Adafactor()
    opt.set_lr(0.5)
    assert opt.lr == 0.5
    opt.set_lr(None)
    assert opt.lr is None
    got = run_flat(opt, shape, theta, grads)
    np.testing.assert_allclose(got, reference(shape, theta, grads)[0], rtol=1e-12)
    with pytest.raises(ValueError):
        opt.set_lr(-1.0)
    with pytest.raises(TypeError):
        opt.set_lr("0.1")


def test_lr_scale_multiplies_rho_and_decay():
    shape = (5, 4)
    theta, grads = data(shape, np.float64, steps=3)
    got = run_flat(flatopt.Adafactor(weight_decay=0.5, lr_scale={"w": 0.25}), shape, theta, grads)
    ref, _ = reference(shape, theta, grads, weight_decay=0.5, scale_parameter=True,
                       rho_fn=lambda t: 0.25 * min(1e-2, 1 / math.sqrt(t)))
    np.testing.assert_allclose(got, ref, rtol=1e-12)


# ----------------------------------------------------------------------------------------- the API promises
def test_defaults_builders_and_scale_resolution():
    opt = flatopt.Adafactor()
    c = opt.config
    assert (c.lr, c.beta2_decay, c.eps1, c.eps2) == (None, -0.8, 1e-30, 1e-3)
    assert (c.clip_threshold, c.weight_decay) == (1.0, 0.0)
    assert (c.beta1, c.beta2, c.scale_parameter, c.warmup_init, c.factored) == (None, None, True, False, True)
    m = opt.with_lr(1e-3)
    assert m.lr == 1e-3 and m.config.scale_parameter is False and opt.lr is None
    assert m.with_lr(None).config.scale_parameter is True
    w = m.with_weight_decay(0.1)
    assert w.config.weight_decay == 0.1 and w.lr == 1e-3 and w.config.scale_parameter is False
    forced = flatopt.Adafactor(scale_parameter=True).with_lr(1e-3)
    assert forced.config.scale_parameter is True
    assert flatopt.Adafactor(warmup_init=True).with_lr(0.1).config.warmup_init is False
    scaled = flatopt.Adafactor(lr_scale={"a": 0.5}).with_lr(0.1)
    assert scaled.lr_scale("a") == 0.5
    opt.set_lr(0.1)  # set_lr never toggles the scaling resolved at construction
    assert opt.config.scale_parameter is True and opt.with_weight_decay(0.1).config.scale_parameter is True


@pytest.mark.parametrize("bad", [
    {"lr": -1.0}, {"lr": float("nan")}, {"beta2_decay": 0.1}, {"eps1": -1.0}, {"eps2": -1e-3},
    {"clip_threshold": 0.0}, {"weight_decay": -0.1}, {"beta1": 1.0}, {"beta2": -0.1}, {"beta2": 1.0},
    {"scale_parameter": 1}, {"warmup_init": True, "lr": 0.1}, {"factored": "yes"},
])
def test_validation_names_the_field(bad):
    with pytest.raises((ValueError, TypeError)) as info:
        flatopt.Adafactor(**bad)
    assert any(k in str(info.value) for k in bad)


def test_state_slots_and_layout():
    opt = flatopt.Adafactor(beta1=0.9)
    for name, shape in (("m", (2, 3, 4)), ("v", (5,)), ("s", ())):
        opt.step(name, shape, rng_arrays(0, shape), rng_arrays(1, shape))
    st = opt.state_dict()
    assert st.algorithm == "adafactor"
    assert sorted(st.buffers) == ["exp_avg/m", "exp_avg/s", "exp_avg/v", "exp_avg_sq/s", "exp_avg_sq/v",
                                  "exp_avg_sq_col/m", "exp_avg_sq_row/m"]
    assert st.buffers["exp_avg_sq_row/m"].shape == (6,) and st.buffers["exp_avg_sq_col/m"].shape == (8,)
    assert st.params["m"]["t"] == 1 and st.params["m"]["shape"] == [2, 3, 4]
    assert opt.state_nbytes() == 4 * (6 + 8 + 24 + 5 + 5 + 1 + 1)
    # a factored snapshot does not load into an unfactored optimizer (nor the other way round)
    assert flatopt.Adafactor(factored=False, beta1=0.9).load_state_dict(st) is False
    assert flatopt.Adafactor().load_state_dict(st) is False  # no exp_avg slot without beta1
    assert flatopt.Adafactor(beta1=0.5).load_state_dict(st) is True


def test_zero_gradient_and_zero_parameter():
    shape = (4, 3)
    p = np.zeros(12, np.float32)
    opt = flatopt.Adafactor()
    opt.step("w", shape, p, np.zeros(12, np.float32))  # S = eps1 > 0 in float32: U = 0, nothing moves
    assert not np.any(p)
    g = rng_arrays(1, shape)
    opt.step("w", shape, p, g)  # RMS(θ) = 0: α = ρ·eps2
    ref, _ = reference(shape, np.zeros(12), [np.zeros(12), g])
    np.testing.assert_allclose(p, ref, rtol=1e-5)
    assert np.all(np.isfinite(p)) and np.any(p)


def test_nan_gradient_propagates_as_documented():
    p = rng_arrays(0, (3, 4))
    g = rng_arrays(1, (3, 4))
    g[5] = np.nan
    opt = flatopt.Adafactor()
    opt.step("w", (3, 4), p, g)
    assert np.isnan(p).any() and np.isnan(opt.state_dict().buffers["exp_avg_sq_row/w"]).any()


def test_deterministic_and_no_allocation_after_first_step():
    import tracemalloc

    for shape in ((512, 384), (200_000,), (300, 4, 50)):
        theta, grads = data(shape, np.float32, steps=3)
        a = run_flat(flatopt.Adafactor(beta1=0.9, weight_decay=0.1), shape, theta, grads)
        b = run_flat(flatopt.Adafactor(beta1=0.9, weight_decay=0.1), shape, theta, grads)
        assert_bits_equal(a, b, str(shape))
        opt = flatopt.Adafactor(beta1=0.9, weight_decay=0.1)
        p = theta.copy()
        for _ in range(2):
            opt.step("w", shape, p, grads[0])
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            for _ in range(3):
                opt.step("w", shape, p, grads[1])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak - base < 64 * 1024, (shape, peak - base)


# ------------------------------------------------------------------------------------------- conformance
def _torch_run(make_opt, shape, theta, grads):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.from_numpy(theta.reshape(shape).copy()))
    opt = make_opt([p])
    for g in grads:
        p.grad = torch.from_numpy(g.reshape(shape).copy())
        opt.step()
    return p.detach().numpy().reshape(-1).copy()


def _compare(shape, dtype, flat_kw, oracle, steps=STEPS):
    theta, grads = data(shape, dtype, steps=steps)
    got = run_flat(flatopt.Adafactor(**flat_kw), shape, theta, grads)
    want = _torch_run(oracle, shape, theta, grads)
    ref, dtot = reference(shape, theta, grads, **flat_kw)
    err = float(np.max(np.abs(got - want)))
    if dtype == np.float64:
        bound = 1e-11 * dtot + 8 * STEPS * 2.2e-16 * np.max(np.abs(ref))
    else:
        bound = f32_bound(ref, dtot, steps, factor=2.0)
    assert err <= bound, (err, bound)
    return err / dtot


TORCH_CASES = {
    # torch's lr is the cap of ρ = min(lr, 1/√t) and its eps1 is not added to G²: eps1 = 1e-30 makes that moot
    "relative": ({}, dict(lr=1e-2, eps=(1e-30, 1e-3))),
    "manual_scaled": (dict(lr=1e-3, scale_parameter=True, clip_threshold=2.0, beta2_decay=-0.5),
                      dict(lr=1e-3, eps=(1e-30, 1e-3), d=2.0, beta2_decay=-0.5)),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
@pytest.mark.parametrize("shape", ORACLE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("foreach", [False, True])
def test_conforms_to_torch_optim_adafactor(case, shape, dtype, foreach):
    torch = pytest.importorskip("torch")
    flat_kw, torch_kw = TORCH_CASES[case]
    _compare(shape, dtype, flat_kw, lambda ps: torch.optim.Adafactor(ps, **torch_kw, foreach=foreach))


def test_weight_decay_convention_differs_from_torch_as_documented():
    """torch decays θ(1 − lr·λ) with its hyper-parameter lr; flatopt (HF) θ(1 − α·λ) with the step size α.  One step
    from the same θ: equal once λ is converted by lr/α, different otherwise."""
    torch = pytest.importorskip("torch")
    shape = (16, 12)
    theta, grads = data(shape, np.float64, steps=1)
    alpha = 1e-2 * max(1e-3, math.sqrt(np.mean(theta**2)))
    want = _torch_run(lambda ps: torch.optim.Adafactor(ps, lr=1e-2, eps=(1e-30, 1e-3), weight_decay=0.5),
                      shape, theta, grads)
    same = run_flat(flatopt.Adafactor(weight_decay=0.5 * 1e-2 / alpha), shape, theta, grads)
    np.testing.assert_allclose(same, want, rtol=1e-12)
    assert not np.allclose(run_flat(flatopt.Adafactor(weight_decay=0.5), shape, theta, grads), want, rtol=1e-6)


def test_first_moment_is_hf_not_adafactor8bit():
    """adafactor8bit's beta1 is an EMA of G normalised afterwards; flatopt follows HF (EMA of the scaled update)."""
    a8 = pytest.importorskip("adafactor8bit")
    shape = (16, 12)
    theta, grads = data(shape, np.float32)
    ours = run_flat(flatopt.Adafactor(beta1=0.9), shape, theta, grads)
    theirs = _torch_run(lambda ps: a8.Adafactor8Bit(ps, quantize=False, use_cuda_kernel=False, beta1=0.9),
                        shape, theta, grads)
    ref, _ = reference(shape, theta, grads, beta1=0.9)
    assert np.max(np.abs(ours - ref)) < 0.01 * np.max(np.abs(theirs - ref))


HF_CASES = {
    "relative": ({}, dict(lr=None, relative_step=True, scale_parameter=True)),
    "warmup": ({"warmup_init": True}, dict(lr=None, relative_step=True, scale_parameter=True, warmup_init=True)),
    "manual_beta1_wd": (dict(lr=0.02, beta1=0.9, weight_decay=0.1),
                        dict(lr=0.02, relative_step=False, scale_parameter=False, beta1=0.9, weight_decay=0.1)),
    "manual_scaled_clip": (dict(lr=0.01, scale_parameter=True, clip_threshold=0.5, beta2_decay=-0.5),
                           dict(lr=0.01, relative_step=False, scale_parameter=True, clip_threshold=0.5,
                                decay_rate=-0.5)),
    "relative_beta1_wd": (dict(beta1=0.8, weight_decay=0.05),
                          dict(lr=None, relative_step=True, scale_parameter=True, beta1=0.8, weight_decay=0.05)),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
@pytest.mark.parametrize("shape", ORACLE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conforms_to_hf_transformers_adafactor(case, shape, dtype):
    hf = pytest.importorskip("transformers.optimization")
    flat_kw, hf_kw = HF_CASES[case]
    _compare(shape, dtype, flat_kw, lambda ps: hf.Adafactor(ps, **hf_kw))


A8_CASES = {
    # adafactor8bit's relative_step uses ρ = min(lr, 1/√t) with lr = 1e-2 (HF's rule); decay p(1 − α·λ) first
    "default": ({}, {}),
    "weight_decay": ({"weight_decay": 0.05}, {"weight_decay": 0.05}),
    "fixed_beta2": ({"beta2": 0.999}, {"beta2": 0.999}),
    "manual_clip": (dict(lr=0.02, clip_threshold=0.5, beta2_decay=-0.5),
                    dict(lr=0.02, relative_step=False, scale_parameter=False, d=0.5, beta2_decay=-0.5)),
}


@pytest.mark.parametrize("case", sorted(A8_CASES))
@pytest.mark.parametrize("shape", ORACLE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32])
def test_conforms_to_adafactor8bit_pytorch_path(case, shape, dtype):
    a8 = pytest.importorskip("adafactor8bit")
    flat_kw, a8_kw = A8_CASES[case]
    _compare(shape, dtype, flat_kw,
             lambda ps: a8.Adafactor8Bit(ps, quantize=False, use_cuda_kernel=False, **a8_kw))


# ---------------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.usefixtures("gpu_or_emulated")  # the GPU, else the emulated device (tests/conftest.py)


def _gpu_run(shape, kw, theta, grads, twin, monkeypatch):
    cp = backend.cupy()
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "1" if twin else "0")
    opt = flatopt.Adafactor(**kw)
    p = cp.asarray(theta)
    for g in grads:
        opt.step("w", shape, p, cp.asarray(g))
    return cp.asnumpy(p), {k: cp.asnumpy(v) for k, v in opt.state_dict().buffers.items()}


GPU_SHAPES = [(7,), (1,), (16, 12), (3, 40), (9, 1), (2, 5, 6), (300, 257), (100_000,)]
GPU_CONFIGS = ["default", "manual_beta1_wd", "fixed_beta2", "decay_clip_wd", "unfactored"]


@gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_kernel_matches_twin_and_numpy(cfg, shape, dtype, monkeypatch):
    kw = CONFIGS[cfg]
    theta, grads = data(shape, dtype, steps=4)
    k_p, k_st = _gpu_run(shape, kw, theta, grads, False, monkeypatch)
    t_p, t_st = _gpu_run(shape, kw, theta, grads, True, monkeypatch)
    n_p = run_flat(flatopt.Adafactor(**kw), shape, theta, grads)
    ref, dtot = reference(shape, theta, grads, **kw)
    bound = f32_bound(ref, dtot, 4, factor=2.0) if dtype == np.float32 else 1e-11 * dtot + 1e-15
    for got in (k_p, t_p):
        assert np.max(np.abs(got - n_p)) <= bound
    # the statistics agree to the rounding of their reductions (sums over ≤ 300 terms in another order, 4 EMA
    # steps: ≤ 4·300·ε relative to the largest entry)
    tol = 4 * 300 * float(np.finfo(dtype).eps)
    for k in t_st:
        np.testing.assert_allclose(k_st[k], t_st[k], rtol=tol, atol=tol * float(np.max(np.abs(t_st[k]))))
    # the kernels' reductions are deterministic: a second run gives the same bits
    k2_p, _ = _gpu_run(shape, kw, theta, grads, False, monkeypatch)
    assert_bits_equal(k_p, k2_p, "kernel rerun")


@gpu
def test_gpu_step_does_not_synchronise(monkeypatch):
    cp = backend.cupy()
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    opt = flatopt.Adafactor(beta1=0.9, weight_decay=0.1)
    shape = (256, 384)
    p = cp.asarray(rng_arrays(0, shape))
    g = cp.asarray(rng_arrays(1, shape))
    opt.step("w", shape, p, g)  # compile and allocate
    cp.cuda.Device().synchronize()
    import cupyx

    with cupyx.allow_synchronize(False):
        opt.step("w", shape, p, g)
    cp.cuda.Device().synchronize()


# ------------------------------------------------------------------------------------------------ threads
@pytest.mark.parametrize("cfg", ["default", "manual_beta1_wd", "unfactored"])
def test_bits_independent_of_thread_count(cfg, monkeypatch):
    """The blocked passes of one large matrix (and of a batch) run on the threads; every reduction is folded in
    block order, so FLATOPT_NUM_THREADS=1 and =2 give the same bits, for ``step`` and ``step_batch`` alike."""
    # (1024, 1024): one matrix cut into many tasks per pass; (64, 40000): rows wider than a block, several
    # pass-1 windows (PARTS made small); a 3-D tensor of small matrices; vectors.
    monkeypatch.setattr(blocks, "PARTS", 1 << 18)
    shapes = [(1024, 1024), (64, 40000), (40, 24, 96), (300_000,), (96,)]
    items = [(f"w{i}", s, *data(s, np.float32, seed=10 * i, steps=3)) for i, s in enumerate(shapes)]
    results = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("FLATOPT_NUM_THREADS", threads)
        for mode in ("step", "step_batch"):
            opt = flatopt.Adafactor(**CONFIGS[cfg])
            ps = [theta.copy() for _, _, theta, _ in items]
            for k in range(3):
                if mode == "step":
                    for (name, shape, _, grads), p in zip(items, ps):
                        opt.step(name, shape, p, grads[k])
                else:
                    opt.step_batch([(name, shape, p, grads[k]) for (name, shape, _, grads), p in zip(items, ps)])
                opt.end_iteration()
            results[threads, mode] = (ps, opt.state_dict().buffers)
    ref_ps, ref_buf = results["1", "step"]
    for key, (ps, buf) in results.items():
        for (name, *_), a, b in zip(items, ref_ps, ps):
            assert_bits_equal(a, b, f"{cfg} {key} {name}")
        assert sorted(buf) == sorted(ref_buf)
        for k in ref_buf:
            assert_bits_equal(ref_buf[k], buf[k], f"{cfg} {key} {k}")


def test_blas_sums_of_large_tensors_match_the_einsum_sums(monkeypatch):
    """With the BLAS held at one thread (threadpoolctl), a tensor of >= BLAS_MIN elements sums its statistics by
    GEMV/dot; the same steps with the cap unavailable use einsum; both agree with the float64 reference."""
    pytest.importorskip("threadpoolctl")
    from flatopt.adafactor import factored_passes as fm
    from flatopt.core import shards

    shape = (512, 512)
    assert math.prod(shape) >= fm.BLAS_MIN
    theta, grads = data(shape, np.float32, steps=3)
    calls = []
    orig = fm.FactoredPasses.stats

    def spy(self, *a, **k):
        calls.append(self.blas)
        return orig(self, *a, **k)

    monkeypatch.setattr(fm.FactoredPasses, "stats", spy)
    got_blas = run_flat(flatopt.Adafactor(), shape, theta, grads)
    assert calls and all(calls), "the GEMV sums were not used"
    monkeypatch.setattr(shards, "cap_enter", lambda: False)
    calls.clear()
    got_einsum = run_flat(flatopt.Adafactor(), shape, theta, grads)
    assert calls and not any(calls)
    ref, dtot = reference(shape, theta.astype(np.float64), [g.astype(np.float64) for g in grads])
    for got in (got_blas, got_einsum):  # both within float32 round-off of the float64 reference
        assert np.max(np.abs(got - ref)) <= f32_bound(ref, dtot, 3)

"""The elementwise catalogue algorithms (Adam, NAdamW, RAdam, QHAdamW, Lion, Lamb, Mars, Sophia): an independent
float64 reference written from the formulas of ``reference/catalogue.md``, and conformance with the reference
implementations it names (each skips cleanly when its package is absent).

Tolerances.  Everything is measured relative to the accumulated update, err = ‖Δθ_flatopt − Δθ_ref‖ / ‖Δθ_ref‖,
Δθ = θ_STEPS − θ_0, over STEPS = 10 steps with an lr that changes every step.
* float32 vs an oracle or the float64 reference: 1e-5.  One step of any of these rules is at most ~15 roundings of
  relative size 2^-24 = 6e-8 each, so its update is off by at most ~1e-6 relative.  The parameter's own rounding
  (p + Δ, half an ulp of p per step) adds |p|·6e-8 per step against steps of size ~η: with |p| ~ 0.1 and
  η ~ 1e-2 here, ~6e-7 per step, ~2e-6 over 10 steps as a random walk, vs the float64 reference (an oracle rounds p
  the same way unless the two updates straddle a rounding boundary).  1e-5 leaves a margin of 5-10x and is far
  below what a real bug costs (a misplaced decay or ε, a skipped step: 7e-4 to 1).  With |p| ~ 1 the rounding of p
  alone reaches 2e-5 on RAdam's small rectified steps: the bound is relative to the update, so the test keeps the
  update large relative to ulp(p).
* Lion: 1e-6 (its update is ±η or 0: a miss is a sign flip, 1e-2 on one element).
* float64 flatopt vs the float64 reference: 1e-10 (the same rule, rounded 2^-53 per operation).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import flatopt

SHAPES = [(6, 5), (7,), (2, 3, 4)]  # a matrix, a vector, a 3-D tensor
BIG = (70001,)  # spans several NumPy chunks
STEPS = 10


def lr_of(step: int, base: float = 1e-2) -> float:
    return base * (0.5 + step) / (1 + step)  # changes every step: exercises set_lr


def data(shape, seed, dtype=np.float32, gscale=1.0):
    r = np.random.default_rng(seed)
    n = math.prod(shape)
    p = (r.standard_normal(n) * 0.1).astype(dtype)  # weights of a typical layer's size: see the module doc
    grads = [(r.standard_normal(n) * gscale).astype(dtype) for _ in range(STEPS)]
    return p, grads


def run_flatopt(opt, shape, p, grads, lr_base=1e-2, hook=None):
    p = p.copy()
    for i, g in enumerate(grads):
        opt.set_lr(lr_of(i, lr_base))
        if hook is not None:
            hook(opt, i, shape)
        opt.step("w", shape, p, g)
        opt.end_iteration()
    return p


def run_torch(opt_cls, shape, p, grads, lr_base=1e-2, step_kwargs=None, hook=None, **kw):
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.from_numpy(p.copy()).reshape(shape))
    opt = opt_cls([w], lr=lr_of(0, lr_base), **kw)
    for i, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = lr_of(i, lr_base)
        w.grad = torch.from_numpy(g.copy()).reshape(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step(**(step_kwargs or {}))
            if hook is not None:
                hook(opt, w, i)
    return w.detach().numpy().reshape(-1).copy()


def rel_err(p0, got, ref):
    d_ref = np.asarray(ref, np.float64) - np.asarray(p0, np.float64)
    d_got = np.asarray(got, np.float64) - np.asarray(p0, np.float64)
    return float(np.linalg.norm(d_got - d_ref) / np.linalg.norm(d_ref))


# ------------------------------------------------------------------------------- float64 references
def ref_adam(p, grads, lr_base, betas, eps, weight_decay, amsgrad=False, **_):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64) + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        mh, vh = m / (1 - b1**t), (vmax if amsgrad else v) / (1 - b2**t)
        p = p - lr * mh / (np.sqrt(vh) + eps)
    return p


def ref_nadamw(p, grads, lr_base, betas, eps, weight_decay, **_):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64)
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mbar = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        p = p - lr * mbar / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def ref_radam(p, grads, lr_base, betas, eps, weight_decay, decoupled_weight_decay=False, threshold=5.0, **_):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    b1, b2 = betas
    rho_inf = 2 / (1 - b2) - 1
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64)
        if decoupled_weight_decay:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        rho_t = rho_inf - 2 * t * b2**t / bc2
        if rho_t > threshold:
            r = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            p = p - lr * (m / bc1) * (math.sqrt(bc2) / (np.sqrt(v) + eps)) * r
        else:
            p = p - lr * m / bc1
    return p


def ref_qhadamw(p, grads, lr_base, betas, nus, eps, weight_decay, **_):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    (b1, b2), (nu1, nu2) = betas, nus
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64)
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1**t), v / (1 - b2**t)
        p = p - lr * (nu1 * mh + (1 - nu1) * g) / (np.sqrt(nu2 * vh + (1 - nu2) * g * g) + eps)
    return p


def ref_lion(p, grads, lr_base, betas, weight_decay, **_):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64)
        p = p * (1 - lr * weight_decay)
        p = p - lr * np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    return p


# ----------------------------------------------------------------------------------------- the cases
# name -> (flatopt class, float64 reference, oracle runner or None, tolerance vs oracle, configurations)
def _torch_opt(name):
    def run(shape, p, grads, lr_base, cfg):
        torch = pytest.importorskip("torch")
        cls = getattr(torch.optim, name)
        kw = dict(cfg)
        if name == "NAdam":
            kw.update(momentum_decay=float("inf"), decoupled_weight_decay=True)
        kw.pop("threshold", None)
        return run_torch(cls, shape, p, grads, lr_base, foreach=False, **kw)

    return run


def _qhoptim(shape, p, grads, lr_base, cfg):
    qh = pytest.importorskip("qhoptim.pyt")
    return run_torch(qh.QHAdamW, shape, p, grads, lr_base, **cfg)


def _lion_pytorch(shape, p, grads, lr_base, cfg):
    lion = pytest.importorskip("lion_pytorch")
    return run_torch(lion.Lion, shape, p, grads, lr_base, use_triton=False, decoupled_weight_decay=False, **cfg)


CASES = {
    "Adam": (flatopt.Adam, ref_adam, _torch_opt("Adam"), 1e-5, [
        dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False),
        dict(betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=False),
        dict(betas=(0.85, 0.95), eps=1e-6, weight_decay=0.05, amsgrad=True),
    ]),
    "NAdamW": (flatopt.NAdamW, ref_nadamw, _torch_opt("NAdam"), 1e-5, [
        dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
        dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ]),
    "RAdam": (flatopt.RAdam, ref_radam, _torch_opt("RAdam"), 1e-5, [
        dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        dict(betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1),  # ρ_t > 5 from t = 4: both branches
        dict(betas=(0.8, 0.9), eps=1e-2, weight_decay=0.1, decoupled_weight_decay=True),  # pins ε's placement
    ]),
    "QHAdamW": (flatopt.QHAdamW, ref_qhadamw, _qhoptim, 1e-5, [
        dict(betas=(0.995, 0.999), nus=(0.7, 1.0), eps=1e-8, weight_decay=1e-2),
        dict(betas=(0.8, 0.99), nus=(0.6, 0.8), eps=1e-6, weight_decay=0.1),
    ]),
    "Lion": (flatopt.Lion, ref_lion, _lion_pytorch, 1e-6, [
        dict(betas=(0.9, 0.99), weight_decay=0.0),
        dict(betas=(0.8, 0.95), weight_decay=0.5),
    ]),
}
PARAMS = [(algo, i) for algo, case in CASES.items() for i in range(len(case[4]))]


@pytest.mark.parametrize("algo, i", PARAMS)
@pytest.mark.parametrize("shape", SHAPES + [BIG], ids=str)
def test_matches_float64_reference(algo, i, shape):
    cls, ref, _, _, configs = CASES[algo]
    cfg = configs[i]
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-5)):
        p0, grads = data(shape, 1, dtype)
        got = run_flatopt(cls(**cfg), shape, p0, grads)
        want = ref(p0, grads, 1e-2, **cfg)
        err = rel_err(p0, got, want)
        assert err <= tol, (algo, cfg, dtype, err)


@pytest.mark.parametrize("algo, i", PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_oracle(algo, i, shape):
    cls, _, oracle, tol, configs = CASES[algo]
    cfg = configs[i]
    p0, grads = data(shape, 2)
    want = oracle(shape, p0, grads, 1e-2, cfg)
    got = run_flatopt(cls(**cfg), shape, p0, grads)
    err = rel_err(p0, got, want)
    assert err <= tol, (algo, cfg, err)


def test_radam_threshold_4_reproduces_rlx_optim_step_5():
    """At β2 = 0.999, ρ_5 = 4.996: threshold 5 takes an SGD-momentum step at t = 5, threshold 4 a rectified one."""
    shape = (7,)
    p0, grads = data(shape, 3)
    grads = grads[:5]
    cfg = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for thr in (4.0, 5.0):
        got = run_flatopt(flatopt.RAdam(threshold=thr, **cfg), shape, p0, grads)
        assert rel_err(p0, got, ref_radam(p0, grads, 1e-2, threshold=thr, **cfg)) <= 1e-5
    a = run_flatopt(flatopt.RAdam(threshold=4.0, **cfg), shape, p0, grads)
    b = run_flatopt(flatopt.RAdam(threshold=5.0, **cfg), shape, p0, grads)
    assert rel_err(p0, a, b) > 1e-2


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9,)), dict(eps=-1.0),
                                 dict(weight_decay=float("nan"))])
@pytest.mark.parametrize("algo", sorted(CASES))
def test_config_is_validated(algo, bad):
    cls = CASES[algo][0]
    if algo == "Lion" and "eps" in bad:
        bad = dict(weight_decay=-1.0)
    with pytest.raises((ValueError, TypeError), match=cls.__name__):
        cls(**bad)


def test_specific_fields_are_validated():
    with pytest.raises(ValueError, match="QHAdamW: nus\\[0\\]"):
        flatopt.QHAdamW(nus=(1.5, 1.0))
    with pytest.raises(TypeError, match="QHAdamW: nus"):
        flatopt.QHAdamW(nus=0.7)
    with pytest.raises(ValueError, match="RAdam: threshold"):
        flatopt.RAdam(threshold=3.0)
    with pytest.raises(TypeError, match="RAdam: decoupled_weight_decay"):
        flatopt.RAdam(decoupled_weight_decay=1)
    with pytest.raises(TypeError, match="Adam: amsgrad"):
        flatopt.Adam(amsgrad="yes")


def test_defaults_follow_the_catalogue():
    assert flatopt.Adam().config == flatopt.Adam(1e-3, (0.9, 0.999), 1e-8, 0.0, False).config
    assert flatopt.NAdamW().config == flatopt.NAdamW(1e-3, (0.9, 0.999), 1e-8, 1e-2).config
    assert flatopt.RAdam().config == flatopt.RAdam(1e-3, (0.9, 0.999), 1e-8, 0.0, False, 5.0).config
    assert flatopt.QHAdamW().config == flatopt.QHAdamW(1e-3, (0.995, 0.999), (0.7, 1.0), 1e-8, 1e-2).config
    assert flatopt.Lion().config == flatopt.Lion(1e-4, (0.9, 0.99), 0.0).config


def test_state_bytes_per_param():
    n = 1000
    expect = {flatopt.Adam(): 8, flatopt.Adam(amsgrad=True): 12, flatopt.NAdamW(): 8, flatopt.RAdam(): 8,
              flatopt.QHAdamW(): 8, flatopt.Lion(): 4}
    for opt, bpp in expect.items():
        opt.step("w", (n,), np.zeros(n, np.float32), np.ones(n, np.float32))
        assert opt.state_nbytes() == bpp * n, type(opt).__name__

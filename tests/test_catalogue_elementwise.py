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


def ref_lamb(p, grads, lr_base, betas, eps, weight_decay, **_):
    """optax.lamb(eps_root=0) in float64: scale_by_adam, add_decayed_weights, scale_by_trust_ratio, -lr."""
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + weight_decay * p
        phi, psi = np.linalg.norm(p), np.linalg.norm(u)
        r = phi / psi if phi > 0 and psi > 0 else 1.0
        p = p - lr * r * u
    return p


def ref_mars(p, grads, lr_base, betas, eps, weight_decay, gamma, clip_c=True, **_):
    """The official MARS-AdamW ``update_fn`` (approximate mode), transcribed in float64."""
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    last = np.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        lr, g = lr_of(t - 1, lr_base), g.astype(np.float64)
        c = (g - last) * (gamma * (b1 / (1 - b1))) + g
        norm = np.linalg.norm(c)
        if clip_c and norm > 1:
            c = c / norm
        m = b1 * m + (1 - b1) * c
        v = b2 * v + (1 - b2) * c * c
        denom = np.sqrt(v) / math.sqrt(1 - b2**t) + eps
        p = p * (1 - lr * weight_decay) - lr * (m / (1 - b1**t)) / denom
        last = g
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


def _pytorch_optimizer_mars(shape, p, grads, lr_base, cfg):
    po = pytest.importorskip("pytorch_optimizer")
    kw = {k: v for k, v in cfg.items() if k != "clip_c"}
    return run_torch(po.MARS, shape, p, grads, lr_base, mars_type="adamw", optimize_1d=True, weight_decouple=True,
                     fixed_decay=False, ams_bound=False, cautious=False, foreach=False, **kw)


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
CASES.update({
    # optax/jax are not installed (and pytorch-optimizer's Lamb is another algorithm): the float64 transcription
    # of optax's chain is the reference
    "Lamb": (flatopt.Lamb, ref_lamb, None, 1e-5, [
        dict(betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2),
        dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        dict(betas=(0.85, 0.95), eps=1e-3, weight_decay=0.0, _gscale=1e-2),
    ]),
    # pytorch-optimizer adds ε before dividing by √(1 − β2^t): compared at ε = 1e-12 (catalogue §9)
    "Mars": (flatopt.Mars, ref_mars, _pytorch_optimizer_mars, 1e-5, [
        dict(betas=(0.95, 0.99), eps=1e-12, weight_decay=0.0, gamma=0.025),
        dict(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1, gamma=0.05),
        dict(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1, gamma=0.05, _gscale=1e-2),  # ||c|| < 1: no clip
        dict(betas=(0.95, 0.99), eps=1e-8, weight_decay=0.05, gamma=0.025, _no_oracle=True),
        dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, gamma=0.025, clip_c=False, _no_oracle=True),
    ]),
})


def _split(cfg):
    """(constructor kwargs, gradient scale, oracle applicable)."""
    kw = {k: v for k, v in cfg.items() if not k.startswith("_")}
    return kw, cfg.get("_gscale", 1.0), not cfg.get("_no_oracle", False)


PARAMS = [(algo, i) for algo, case in CASES.items() for i in range(len(case[4]))]
ORACLE_PARAMS = [(algo, i) for algo, i in PARAMS if CASES[algo][2] is not None and _split(CASES[algo][4][i])[2]]


@pytest.mark.parametrize("algo, i", PARAMS)
@pytest.mark.parametrize("shape", SHAPES + [BIG], ids=str)
def test_matches_float64_reference(algo, i, shape):
    cls, ref, _, _, configs = CASES[algo]
    cfg, gscale, _ = _split(configs[i])
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-5)):
        p0, grads = data(shape, 1, dtype, gscale)
        got = run_flatopt(cls(**cfg), shape, p0, grads)
        want = ref(p0, grads, 1e-2, **cfg)
        err = rel_err(p0, got, want)
        assert err <= tol, (algo, cfg, dtype, err)


@pytest.mark.parametrize("algo, i", ORACLE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_oracle(algo, i, shape):
    cls, _, oracle, tol, configs = CASES[algo]
    cfg, gscale, _ = _split(configs[i])
    p0, grads = data(shape, 2, np.float32, gscale)
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
    with pytest.raises(ValueError, match="Mars: gamma"):
        flatopt.Mars(gamma=-0.1)
    with pytest.raises(TypeError, match="Mars: clip_c"):
        flatopt.Mars(clip_c=None)
    with pytest.raises(ValueError, match="Sophia: rho"):
        flatopt.Sophia(rho=-1.0)
    with pytest.raises(TypeError, match="Adam: amsgrad"):
        flatopt.Adam(amsgrad="yes")


def test_defaults_follow_the_catalogue():
    assert flatopt.Adam().config == flatopt.Adam(1e-3, (0.9, 0.999), 1e-8, 0.0, False).config
    assert flatopt.NAdamW().config == flatopt.NAdamW(1e-3, (0.9, 0.999), 1e-8, 1e-2).config
    assert flatopt.RAdam().config == flatopt.RAdam(1e-3, (0.9, 0.999), 1e-8, 0.0, False, 5.0).config
    assert flatopt.QHAdamW().config == flatopt.QHAdamW(1e-3, (0.995, 0.999), (0.7, 1.0), 1e-8, 1e-2).config
    assert flatopt.Lion().config == flatopt.Lion(1e-4, (0.9, 0.99), 0.0).config
    assert flatopt.Lamb().config == flatopt.Lamb(1e-3, (0.9, 0.999), 1e-6, 1e-2).config
    assert flatopt.Mars().config == flatopt.Mars(3e-3, (0.95, 0.99), 1e-8, 0.0, 0.025, True).config
    assert flatopt.Sophia().config == flatopt.Sophia(1e-4, (0.965, 0.99), 0.04, 1e-1, 1e-15).config


def test_state_bytes_per_param():
    n = 1000
    expect = {flatopt.Adam(): 8, flatopt.Adam(amsgrad=True): 12, flatopt.NAdamW(): 8, flatopt.RAdam(): 8,
              flatopt.QHAdamW(): 8, flatopt.Lion(): 4, flatopt.Lamb(): 8, flatopt.Mars(): 12, flatopt.Sophia(): 8}
    for opt, bpp in expect.items():
        opt.step("w", (n,), np.zeros(n, np.float32), np.ones(n, np.float32))
        assert opt.state_nbytes() == bpp * n, type(opt).__name__


# ---------------------------------------------------------------------------------------------- Sophia
HESS_EVERY = 3  # update_hessian after steps 0, 3, 6, 9 (the official cadence is 10; shorter to exercise it)


def _sophia_hhat_grads(shape, seed, dtype=np.float32):
    r = np.random.default_rng(seed + 1000)
    n = math.prod(shape)
    return [(r.standard_normal(n) * 30).astype(dtype) for _ in range(STEPS)]  # ĝ large: ratios below the clip


def ref_sophia(p, grads, ghats, lr_base, betas, rho, weight_decay, eps=1e-15):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    h = np.zeros_like(p)
    b1, b2 = betas
    for i, g in enumerate(grads):
        lr, g = lr_of(i, lr_base), g.astype(np.float64)
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        p = p - lr * np.sign(m) * np.minimum(np.abs(m) / (rho * h + eps), 1)
        if i % HESS_EVERY == 0:
            gh = ghats[i].astype(np.float64)
            h = b2 * h + (1 - b2) * gh * gh
    return p


def run_sophia(opt, shape, p, grads, ghats):
    p = p.copy()
    for i, g in enumerate(grads):
        opt.set_lr(lr_of(i))
        opt.step("w", shape, p, g)
        if i % HESS_EVERY == 0:
            opt.update_hessian("w", shape, ghats[i] * ghats[i])
        opt.end_iteration()
    return p


SOPHIA_CONFIGS = [dict(betas=(0.965, 0.99), rho=0.04, weight_decay=0.1),
                  dict(betas=(0.9, 0.9), rho=0.05, weight_decay=0.2)]


@pytest.mark.parametrize("cfg", SOPHIA_CONFIGS, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [BIG], ids=str)
def test_sophia_matches_float64_reference(cfg, shape):
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-5)):
        p0, grads = data(shape, 4, dtype)
        ghats = _sophia_hhat_grads(shape, 4, dtype)
        got = run_sophia(flatopt.Sophia(**cfg), shape, p0, grads, ghats)
        err = rel_err(p0, got, ref_sophia(p0, grads, ghats, 1e-2, **cfg))
        assert err <= tol, (cfg, dtype, err)


@pytest.mark.parametrize("cfg", SOPHIA_CONFIGS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sophia_matches_sophia_opt(cfg, shape):
    """sophia-opt's SophiaG (= the official code), stepped with bs=1 and given p.grad = ĝ before update_hessian();
    flatopt gets ĥ = ĝ⊙ĝ."""
    so = pytest.importorskip("sophia_opt")
    torch = pytest.importorskip("torch")
    p0, grads = data(shape, 5)
    ghats = _sophia_hhat_grads(shape, 5)

    def hook(opt, w, i):
        if i % HESS_EVERY == 0:
            w.grad = torch.from_numpy(ghats[i].copy()).reshape(shape)
            opt.update_hessian()

    want = run_torch(so.SophiaG, shape, p0, grads, step_kwargs=dict(bs=1), hook=hook, **cfg)
    got = run_sophia(flatopt.Sophia(**cfg), shape, p0, grads, ghats)
    # ratio = min(|m|/(ρh + ε), 1): some elements clipped, some not (both branches are compared)
    err = rel_err(p0, got, want)
    assert err <= 1e-5, (cfg, err)


def test_sophia_update_hessian_validates_and_keeps_t(tmp_path):
    opt = flatopt.Sophia(lr=1e-2)
    h = np.full(12, 4.0, np.float32)
    with pytest.raises(ValueError, match="'w'.*12 elements"):
        opt.update_hessian("w", (5,), h)
    with pytest.raises(TypeError, match="'w'.*float32 or float64"):
        opt.update_hessian("w", (12,), h.astype(np.int32))
    with pytest.raises(TypeError, match="name"):
        opt.update_hessian("", (12,), h)
    assert opt.state_names() == []
    opt.update_hessian("w", (3, 4), h)  # a new name: state with t = 0
    assert opt._slots["w"].t == 0  # noqa: SLF001
    np.testing.assert_array_equal(opt._slots["w"].state.h, (1 - 0.99) * h)  # noqa: SLF001
    with pytest.raises(ValueError, match="'w'.*shape"):
        opt.update_hessian("w", (4, 3), h)
    with pytest.raises(TypeError, match="'w'.*dtype"):
        opt.update_hessian("w", (3, 4), h.astype(np.float64))
    assert np.all(h == 4.0)  # ĥ never written
    # resume through a file, bit for bit, Hessian EMA included
    p, g = data((3, 4), 6)
    a = p.copy()
    opt.step("w", (3, 4), a, g[0])
    opt.update_hessian("w", (3, 4), g[1] * g[1])
    flatopt.save(tmp_path / "s.npz", opt)
    fresh = flatopt.Sophia(lr=1e-2)
    assert fresh.load_state_dict(flatopt.load(tmp_path / "s.npz"))
    b = a.copy()
    for k in range(2, 6):
        opt.step("w", (3, 4), a, g[k])
        fresh.step("w", (3, 4), b, g[k])
        opt.update_hessian("w", (3, 4), g[k] * g[k])
        fresh.update_hessian("w", (3, 4), g[k] * g[k])
    assert a.tobytes() == b.tobytes()


def test_sophia_update_hessian_reaches_bucketed_state():
    """Small items share a packed arena in step_batch: update_hessian writes through to it."""
    shapes = {f"b{i}": (8,) for i in range(4)}
    params = {n: data(s, 10 + i)[0] for i, (n, s) in enumerate(shapes.items())}
    a, b = flatopt.Sophia(lr=1e-2), flatopt.Sophia(lr=1e-2)
    pa = {n: p.copy() for n, p in params.items()}
    pb = {n: p.copy() for n, p in params.items()}
    for k in range(4):
        grads = {n: data(s, 100 * k + i)[1][0] for i, (n, s) in enumerate(shapes.items())}
        a.step_batch([flatopt.OptItem(n, shapes[n], pa[n], grads[n]) for n in shapes])
        for n in shapes:
            b.step(n, shapes[n], pb[n], grads[n])
        for n in shapes:
            a.update_hessian(n, shapes[n], grads[n] * grads[n] * 100)
            b.update_hessian(n, shapes[n], grads[n] * grads[n] * 100)
    for n in shapes:
        assert pa[n].tobytes() == pb[n].tobytes(), n


def test_lamb_trust_ratio_is_one_for_a_zero_parameter():
    """φ = ‖θ‖ = 0 (and no decay): r = 1, the step is the plain bias-corrected Adam direction."""
    p = np.zeros(6, np.float32)
    g = np.arange(1, 7, dtype=np.float32)
    flatopt.Lamb(lr=0.1, weight_decay=0.0, eps=0.0).step("w", (6,), p, g)
    np.testing.assert_allclose(p, -0.1 * np.ones(6), rtol=1e-6)


# ---------------------------------------------------------------------------------------------- Lamb/Mars norms
def _sq_reference(x, nb):
    """A scalar transcription of the blocked order (core/sqsum.py, kernels/sq_sum.cuh): the nb partials."""
    from flatopt.core import sqsum

    n, lanes, threads = x.size, sqsum.SQ_LANES, sqsum.SQ_THREADS
    g = nb * threads
    zero = x.dtype.type(0)
    parts = []
    for c in range(nb):
        a = []
        for t in range(threads):
            i, j = divmod(t, lanes)
            s = zero
            for e in range(i * nb * lanes + c * lanes + j, n, g):  # the thread's grid-stride loop
                s = s + x[e]
            a.append(s)
        b = []
        for j in range(lanes):
            s = a[j]
            for i in range(1, lanes):
                s = s + a[i * lanes + j]
            b.append(s)
        s = b[0]
        for j in range(1, lanes):
            s = s + b[j]
        parts.append(s)
    return np.array(parts, x.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lamb_mars_blocked_sumsq_order(dtype):
    """``sqsum.sq_sum`` (the Lamb and Mars twins' norms) adds in the kernels' order: its NumPy path (reduce/accumulate
    over leading axes) and its elementwise path (CuPy's) against a scalar transcription, over one block, several
    blocks and a fold over more than one row of partials; the scratch stays reusable (a second sum, same bits)."""
    import types

    from flatopt.core import sqsum

    rng = np.random.default_rng(5)
    elementwise = types.SimpleNamespace(add=np.add)  # not numpy: the in-place elementwise path
    for n in (0, 1, 2, 17, 256, 257, 4095, 4097, 5 * 4096 + 77, 257 * 4096 + 3):
        x = (rng.standard_normal(n) ** 2).astype(dtype)
        nb = sqsum.sq_blocks(n)
        want = None
        if n < 30000:  # the transcription is slow; the largest (258 partials: a fold over 2 rows) checks the paths
            parts = _sq_reference(x, nb)
            want = np.asarray(parts[0] if nb == 1 else _sq_reference(parts, 1)[0], dtype).tobytes()
        got = []
        for xp in (np, elementwise):
            buf = sqsum.sq_scratch(np, n, dtype)
            for _ in range(2):
                buf[:n] = x
                got.append(sqsum.sq_sum(xp, buf, n)[0].tobytes())
        if want is None:
            want = got[0]
            assert np.frombuffer(want, dtype)[0] == pytest.approx(np.sum(x, dtype=np.float64), rel=1e-5)
        assert got == [want] * 4, n

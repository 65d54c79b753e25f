"""``cautious=True`` on the elementwise algorithms (``core/elementwise``: ``e.cautious`` in each step, the flag of
the ``Cautious`` config base, the mask's count by the reduce stage): an independent float64 reference of every
algorithm, conformance with pytorch-optimizer's ``Lion(cautious=True)``, ``ADOPT(cautious=True)``,
``AdEMAMix(cautious=True)`` and ``MARS(cautious=True)``, the NumPy forms (phases of one large
tensor, rows of small ones, one whole tensor on the device stand-in) against the serial step bit for bit, the
non-cautious program unchanged, checkpoints without the field, and bad input.

Mars with clip_c and cautious sums twice in order (the mask's count follows the clip's norm: two reduction levels,
``core/elementwise/reduce.py``).  Sophia and ScheduleFreeAdamW have no cautious reference
implementation: their float64 references below apply ``apply_cautious`` to the direction their docstrings name.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import flatopt
from flatopt.core.elementwise.define import REGISTRY, Definition

from .fake_device import FakeDevice
from .registry import FLAG_SPACE, flag_cases

CASES = {cid: c for cid, c in flag_cases().items() if "cautious" in c.labels}


def _caution(u, g):
    """pytorch-optimizer 4.1.0 ``apply_cautious``, in float64: mask = (u·g > 0); u · mask · numel/(Σ mask + 1)."""
    mask = (u * g > 0).astype(np.float64)
    return u * (mask * (u.size / (mask.sum() + 1)))


def _moments(c, g, m, v):
    b1, b2 = c["betas"][:2]
    m[...] = b1 * m + (1 - b1) * g
    v[...] = b2 * v + (1 - b2) * g * g


def _ref_step(algo, c, p, g, st, t, lr):
    """One step of ``algo`` (its module docstring's rule) with the cautious mask on its direction, in float64."""
    wd = c.get("weight_decay", 0.0)
    if algo == "sgd":
        gd = g + wd * p
        d = gd
        if c["momentum"]:
            st["buf"][...] = gd if t == 1 else c["momentum"] * st["buf"] + (1 - c["dampening"]) * gd
            d = gd + c["momentum"] * st["buf"] if c["nesterov"] else st["buf"]
        p -= lr * _caution(d, gd)
        return
    if algo == "sophia":
        b1 = c["betas"][0]
        p *= 1 - lr * wd
        st["m"][...] = b1 * st["m"] + (1 - b1) * g
        ratio = np.minimum(np.abs(st["m"]) / (st["h"] * c["rho"] + c["eps"]), 1.0)
        p -= lr * _caution(np.sign(st["m"]) * ratio, g)
        return
    if algo == "adopt":
        b1, b2 = c["betas"]
        if c["decoupled"]:
            p *= 1 - lr * wd
        else:
            g = g + wd * p
        if t == 1:
            st["v"] += g * g
            return
        n = np.clip(g / np.maximum(np.sqrt(st["v"]), c["eps"]), -t ** 0.25, t ** 0.25)
        st["m"][...] = b1 * st["m"] + (1 - b1) * n
        p -= lr * _caution(st["m"], n)
        st["v"][...] = b2 * st["v"] + (1 - b2) * g * g
        return
    if algo == "ademamix":
        b1, b2, b3 = c["betas"]
        alpha, big_t = c["alpha"], c["t_alpha_beta3"]
        if big_t is not None:
            alpha = min(t * alpha / big_t, alpha)
            lb1, lb3 = math.log(b1), math.log(b3)
            b3 = min(math.exp(lb1 * lb3 / ((1 - t / big_t) * lb3 + (t / big_t) * lb1)), b3)
        p *= 1 - lr * wd
        _moments(c, g, st["m"], st["v"])
        st["m_slow"][...] = b3 * st["m_slow"] + (1 - b3) * g
        u = _caution(st["m"], g) / (1 - b1 ** t) + alpha * st["m_slow"]
        p -= lr * u / (np.sqrt(st["v"] / (1 - b2 ** t)) + c["eps"])
        return
    if algo == "lamb":
        b1, b2 = c["betas"]
        _moments(c, g, st["m"], st["v"])
        u = (st["m"] / (1 - b1 ** t)) / (np.sqrt(st["v"] / (1 - b2 ** t)) + c["eps"]) + wd * p
        phi, psi = np.linalg.norm(p), np.linalg.norm(u)
        r = phi / psi if phi > 0 and psi > 0 else 1.0
        p -= lr * _caution(r * u, g)  # apply_cautious on the final update
        return
    if algo == "schedulefree_adamw":
        b1, b2 = c["betas"]
        sched = t / c["warmup_steps"] if t - 1 < c["warmup_steps"] else 1.0
        st["v"][...] = b2 * st["v"] + (1 - b2) * g * g
        u = _caution(g / (np.sqrt(st["v"] / (1 - b2 ** t)) + c["eps"]), g) + wd * p
        if t == 1:
            st["z"][...] = p
        st["lr_max"] = max(lr * sched, st.get("lr_max", -1.0))
        weight = t ** c["r"] * st["lr_max"] ** c["weight_lr_power"]
        st["weight_sum"] = st.get("weight_sum", 0.0) + weight
        ckp1 = weight / st["weight_sum"]
        p[...] = (1 - ckp1) * p + ckp1 * st["z"] + lr * sched * (b1 * (1 - ckp1) - 1) * u
        st["z"] -= lr * sched * u
        return
    if algo == "mars":
        b1, b2 = c["betas"]
        cc = g + (g - st["g_prev"]) * (c["gamma"] * b1 / (1 - b1))
        if c["clip_c"]:
            cc = cc / max(np.linalg.norm(cc), 1.0)
        st["m"][...] = b1 * st["m"] + (1 - b1) * cc
        st["v"][...] = b2 * st["v"] + (1 - b2) * cc * cc
        p *= 1 - lr * wd
        p -= lr / (1 - b1 ** t) * _caution(st["m"], g) / (np.sqrt(st["v"] / (1 - b2 ** t)) + c["eps"])
        st["g_prev"][...] = g
        return
    if algo == "lion":
        b1, b2 = c["betas"]
        p *= 1 - lr * wd
        u = np.sign(b1 * st["m"] + (1 - b1) * g)
        p -= lr * _caution(u, g)
        st["m"][...] = b2 * st["m"] + (1 - b2) * g
        return
    b1, b2 = c["betas"][:2]
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    decoupled = algo in ("adamw", "nadamw", "qhadamw") or (algo == "radam" and c["decoupled_weight_decay"])
    if decoupled:
        p *= 1 - lr * wd
    else:
        g = g + wd * p
    m, v = st["m"], st["v"]
    _moments(c, g, m, v)
    if algo in ("adam", "adamw"):
        src = v
        if c["amsgrad"]:
            st["vmax"][...] = src = np.maximum(st["vmax"], v)
        p -= lr / bc1 * _caution(m / (np.sqrt(src / bc2) + c["eps"]), g)
    elif algo == "nadamw":
        d = np.sqrt(v / bc2) + c["eps"]
        p -= _caution(lr * ((1 - b1) / bc1 * g / d + b1 / (1 - b1 ** (t + 1)) * m / d), g)
    elif algo == "qhadamw":
        nu1, nu2 = c["nus"]
        n = m * nu1 / bc1 + (1 - nu1) * g
        d = np.sqrt(v * nu2 / bc2 + (1 - nu2) * g * g) + c["eps"]
        p -= lr * _caution(n / d, g)
    elif algo == "radam":
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2 ** t / bc2
        if rho > c["threshold"]:
            r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            p -= lr * r * math.sqrt(bc2) / bc1 * _caution(m / (np.sqrt(v) + c["eps"]), g)
        else:
            p -= lr / bc1 * _caution(m, g)
    else:  # pragma: no cover - a new algorithm with the flag needs its reference here
        raise AssertionError(f"no cautious reference for {algo}")


def test_every_elementwise_definition_has_the_flag():
    """The flag comes from the definitions: every registered definition whose config derives from ``Cautious`` has
    it last, its cautious flag sets sum (the mask's count) and its others do not; the flag space offers it."""
    have = {name for name, d in REGISTRY.items() if d.cautious}
    assert have >= {"sgd", "adam", "adamw", "nadamw", "radam", "qhadamw", "lion", "sophia", "adopt", "ademamix",
                    "schedulefree_adamw", "lamb", "mars"}
    for name in have:
        d = REGISTRY[name]
        assert d.flag_names[-1] == "cautious"
        for f in d.flag_sets():
            if not f["cautious"]:
                continue
            # the mask's count and the element count: two sums more (Adopt's first step only sets v: no direction)
            extra = 0 if name == "adopt" and f["first"] else 2
            off = {**f, "cautious": False}
            n_sums = [sum(i.op == "sum" for i in d.program(x).instrs) for x in (f, off)]
            assert n_sums[0] - n_sums[1] == extra, (name, f, n_sums)
            assert (d.split_at(d.index(f)) is not None) == (extra > 0 or d.split_at(d.index(off)) is not None)
        assert "cautious" in FLAG_SPACE[name].options


def test_reduction_levels_of_lamb_and_mars():
    """The levels the docstrings and docs/algorithms.md state (each level a partials and a fold launch, then the
    map): Lamb one with or without the mask (its count is a sum of the norms' reduce phase); Mars two with clip_c
    and cautious (the count follows ‖c‖), one with either alone, none (the plain elementwise step) without both."""
    def levels(d, **f):
        sp = d.split_at(d.index(f))
        return 0 if sp is None else len(sp.levels)

    lamb, mars = REGISTRY["lamb"], REGISTRY["mars"]
    for wd in (False, True):
        assert [levels(lamb, wd=wd, cautious=c) for c in (False, True)] == [1, 1]
        assert [levels(mars, wd=wd, clip=clip, cautious=c) for clip in (False, True) for c in (False, True)] == [
            0, 1, 1, 2]


@pytest.mark.parametrize("cid", sorted(CASES))
def test_float64_reference(cid):
    case = CASES[cid]
    opt = case.make()
    c = dataclasses.asdict(opt.config)
    lr = c["lr"]
    rng = np.random.default_rng(7)
    n = 257
    p = rng.standard_normal(n)
    st = {"m": np.zeros(n), "v": np.zeros(n), "vmax": np.zeros(n), "buf": np.zeros(n), "m_slow": np.zeros(n),
          "h": np.zeros(n), "z": np.zeros(n), "g_prev": np.zeros(n)}
    want = p.copy()
    if case.algorithm == "sophia":  # a Hessian estimate, so that the clip min(|m|/(h·ρ + ε), 1) is not always 1
        h_hat = rng.random(n) * 4.0
        opt.update_hessian("w", (n,), h_hat)
        st["h"] = (1 - c["betas"][1]) * h_hat
    for t in range(1, max(4, case.space.min_steps + 2)):
        g = rng.standard_normal(n)
        opt.step("w", (n,), p, g)
        _ref_step(case.algorithm, c, want, g.copy(), st, t, lr)
        np.testing.assert_allclose(p, want, rtol=1e-11, atol=1e-13, err_msg=f"{cid} step {t}")


def test_lion_matches_pytorch_optimizer():
    """pytorch-optimizer's ``Lion(cautious=True)`` in float32: the same mask and scale (exact to the bit without
    weight decay on small tensors); torch forms p + (−lr)·u in its ``add_(u, alpha=−lr)`` kernel, flatopt rounds
    u·scale, then ·(−lr), then the sum, so a step may differ by a rounding of |p| and one of lr·scale: 2 ulp of
    max|p| per step."""
    torch = pytest.importorskip("torch")
    po = pytest.importorskip("pytorch_optimizer")
    rng = np.random.default_rng(3)
    for n, wd in ((7, 0.0), (1000, 0.1), (70_000, 0.1)):
        p0 = rng.standard_normal(n).astype(np.float32)
        opt = flatopt.Lion(lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, cautious=True)
        tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        ref = po.Lion([tp], lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, cautious=True, foreach=False)
        p = p0.copy()
        steps = 6
        for _ in range(steps):
            g = rng.standard_normal(n).astype(np.float32)
            g[:2] = 0.0  # an update against a zero gradient is masked
            opt.step("w", (n,), p, g)
            tp.grad = torch.from_numpy(g.copy())
            ref.step()
        got, want = p, tp.detach().numpy()
        tol = steps * 2 * np.spacing(np.float32(np.abs(want).max()))
        assert np.abs(got - want).max() <= tol, (n, np.abs(got - want).max(), tol)
        # and it is not plain Lion
        plain = flatopt.Lion(lr=1e-2, betas=(0.9, 0.99), weight_decay=wd)
        q = p0.copy()
        rng2 = np.random.default_rng(0)
        g = rng2.standard_normal(n).astype(np.float32)
        plain.step("w", (n,), q, g)
        c1 = flatopt.Lion(lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, cautious=True)
        r = p0.copy()
        c1.step("w", (n,), r, g)
        assert not np.array_equal(q, r)


@pytest.mark.parametrize("algo", ["adopt", "ademamix"])
@pytest.mark.parametrize("n", [7, 1000, 70_001])
def test_matches_pytorch_optimizer(algo, n):
    """pytorch-optimizer's ``ADOPT(cautious=True)`` (m masked against the clipped normalised gradient) and
    ``AdEMAMix(cautious=True)`` (the fast momentum masked against g before its bias correction) in float32, with the
    measure and the data of ``tests/test_catalogue_elementwise.py`` (the relative error of the accumulated update
    over 10 steps at a changing lr).  Tolerance 1e-5, that file's bound for both without the option (≤ ~20 and
    ~25 roundings of 2^-24 per step, torch's multiply-adds and float32 ``sqrt``) plus the mask's four roundings
    (1/(count + 1), ·numel, mask·scale, u·(mask·scale): the same operations as torch's ``apply_cautious``), ≤ 30
    units of 2^-24 = 1.8e-6 per step.  The mask itself is exact (the count of float32 ones is exact below 2^24) unless
    u·g straddles 0 within those roundings; with these seeds no element does (a flip would cost ~1/√n, above 1e-5)."""
    cat = pytest.importorskip("tests.test_catalogue_elementwise")
    po = pytest.importorskip("pytorch_optimizer")
    shape = (n,)
    cfgs = {"adopt": [dict(betas=(0.9, 0.9999), eps=1e-6, weight_decay=0.0),
                      dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.5),  # L2: n has the signs of g + λ·p
                      dict(betas=(0.85, 0.95), eps=1e-6, weight_decay=0.05, decoupled=True)],
            "ademamix": [dict(betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=0.0),
                         dict(betas=(0.8, 0.99, 0.999), alpha=2.0, t_alpha_beta3=6, eps=1e-8, weight_decay=0.1)]}
    for i, cfg in enumerate(cfgs[algo]):
        p0, grads = cat.data(shape, 100 + i)
        for g in grads:
            g[:2] = 0.0  # a direction against a zero gradient is masked
        if algo == "adopt":
            kw = dict(cfg)
            got = cat.run_flatopt(flatopt.Adopt(cautious=True, **kw), shape, p0, grads)
            want = cat.run_torch(po.ADOPT, shape, p0, grads, weight_decouple=kw.pop("decoupled", False),
                                 fixed_decay=False, foreach=False, cautious=True, **kw)
            plain = cat.run_flatopt(flatopt.Adopt(**cfg), shape, p0, grads)
        else:
            got = cat.run_flatopt(flatopt.AdEMAMix(cautious=True, **cfg), shape, p0, grads)
            want = cat.run_torch(po.AdEMAMix, shape, p0, grads, weight_decouple=True, fixed_decay=False,
                                 foreach=False, cautious=True, **cfg)
            plain = cat.run_flatopt(flatopt.AdEMAMix(**cfg), shape, p0, grads)
        err = cat.rel_err(p0, got, want)
        assert err <= 1e-5, (algo, n, cfg, err)
        assert cat.rel_err(p0, plain, want) > 1e-3, (algo, n, cfg)  # the option changes the steps


@pytest.mark.parametrize("shape", [(7,), (6, 5), (2, 3, 4)], ids=str)
def test_mars_matches_pytorch_optimizer(shape):
    """pytorch-optimizer's ``MARS(mars_type="adamw", optimize_1d=True, cautious=True)``: its mask is on the new
    momentum m (after the clip of c) against g, normalised by numel/(count + 1), before the division by the
    denominator, as flatopt's step (two reduction levels: ‖c‖, then the count).  The data, the configurations at
    ε = 1e-12 (pytorch-optimizer adds ε before dividing by √(1 − β2^t)) and the shapes of the plain Mars oracle test
    in ``tests/test_catalogue_elementwise.py``, with its bound 1e-5 relative to the accumulated update: Mars is ≤ ~15
    roundings of 2^-24 per step, and the mask adds the four of ``apply_cautious`` (1/(count + 1), ·numel,
    mask·scale, m·(mask·scale)) in torch's order, ≤ ~20 units of 6e-8 = 1.2e-6 per step.  The mask is exact (a
    count of float32 ones) unless m·g straddles 0 within those roundings; with these seeds no element does (a flip
    costs ~1/√n).  The oracle's ``foreach`` path clamps ‖c‖ as flatopt does; its per-parameter path (used here)
    branches on ‖c‖ > 1 on the host: the same value."""
    cat = pytest.importorskip("tests.test_catalogue_elementwise")
    po = pytest.importorskip("pytorch_optimizer")
    cfgs = [dict(betas=(0.95, 0.99), eps=1e-12, weight_decay=0.0, gamma=0.025),
            dict(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1, gamma=0.05),
            dict(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1, gamma=0.05, _gscale=1e-2)]  # ‖c‖ < 1: no clip
    for i, cfg in enumerate(cfgs):
        kw = {k: v for k, v in cfg.items() if not k.startswith("_")}
        p0, grads = cat.data(shape, 2, np.float32, cfg.get("_gscale", 1.0))
        for g in grads:
            g.reshape(-1)[:2] = 0.0  # a direction against a zero gradient is masked
        got = cat.run_flatopt(flatopt.Mars(cautious=True, **kw), shape, p0, grads)
        want = cat.run_torch(po.MARS, shape, p0, grads, 1e-2, mars_type="adamw", optimize_1d=True,
                             weight_decouple=True, fixed_decay=False, ams_bound=False, cautious=True, foreach=False,
                             **kw)
        plain = cat.run_flatopt(flatopt.Mars(**kw), shape, p0, grads)
        assert cat.rel_err(p0, got, want) <= 1e-5, (shape, cfg, cat.rel_err(p0, got, want))
        assert cat.rel_err(p0, plain, want) > 1e-3, (shape, cfg)  # the option changes the steps


def _batch(dt, seed, shapes):
    rng = np.random.default_rng(seed)
    out = []
    for k, shape in enumerate(shapes):
        size = math.prod(shape)
        p, g = rng.standard_normal(size).astype(dt), rng.standard_normal(size).astype(dt)
        if size > 2:
            g[:3] = [0.0, -0.0, np.inf if k == 0 else 1e-40]
        out.append((f"w{k}", shape, p, g))
    return out


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("cid", sorted(CASES))
def test_numpy_forms_and_device_twin_match_the_serial_step(cid, dt):
    """step_batch (small tensors as rows of one array, a large one in phases on the threads) and the whole-tensor
    form on the device stand-in give the serial step's bits; without the flag the optimizer stays elementwise."""
    case = CASES[cid]
    shapes = [(64,)] * 4 + [(3, 5), (1,), (300_017,)]
    serial, batch, dev = case.make(), case.make(), case.make()
    assert not serial.elementwise and case.make(cautious=False).elementwise == (case.algorithm not in ("lamb", "mars"))
    items = _batch(dt, 1, shapes)
    ps = {n: p.copy() for n, _, p, _ in items}
    pb = {n: p.copy() for n, _, p, _ in items}
    for t in range(max(2, case.space.min_steps + 1)):
        items = _batch(dt, 10 + t, shapes)
        with np.errstate(all="ignore"):
            for n, shape, _, g in items:
                serial.step(n, shape, ps[n], g)
            batch.step_batch([flatopt.OptItem(n, shape, pb[n], g) for n, shape, _, g in items])
        for n in ps:
            assert ps[n].tobytes() == pb[n].tobytes(), (cid, n, t)
    # the device twin (core/elementwise/reduce.py xp_update) on FakeDevice arrays, one tensor
    fd = FakeDevice()
    n, shape = "w6", shapes[-1]
    p0 = _batch(dt, 1, shapes)[-1][2]
    ph, pd = p0.copy(), fd.asarray(p0.copy())
    host = case.make()
    st_h = host.hooks.init(n, np, shape, np.dtype(dt))
    st_d = dev.hooks.init(n, fd, shape, np.dtype(dt))
    with np.errstate(all="ignore"):
        for t in range(1, 3):
            g = _batch(dt, 10 + t, shapes)[-1][3]
            lr_h, lr_d = host.config.lr, dev.config.lr
            if hasattr(host, "step_lr"):  # ScheduleFreeAdamW: (lr, its averaging weight), advancing host numbers
                lr_h, lr_d = host.step_lr(st_h, t, lr_h), dev.step_lr(st_d, t, lr_d)
            host.hooks.update(np, st_h, ph, g, t=t, lr=lr_h, scratch=[])
            dev.hooks.update(fd, st_d, pd, fd.asarray(g), t=t, lr=lr_d, scratch=[])
    assert ph.tobytes() == fd.asnumpy(pd).tobytes(), cid


@pytest.mark.parametrize("algo", sorted(a for a, d in REGISTRY.items() if d.cautious))
def test_without_the_flag_nothing_changes(algo):
    """The flag appended last: every flag set without it keeps its index and its instruction list (the snapshots of
    the generated C and CUDA hold the same statements), and its kernels are the only ones generated."""
    d = REGISTRY[algo]
    plain = d.plain_flag_sets()
    for f in d.flag_sets():
        if not f["cautious"]:
            assert d.index(f) < 1 << (len(d.flag_names) - 1)
            if algo not in ("lamb", "mars"):  # Lamb and Mars sum without the flag too (their norms)
                assert f in plain and not any(i.op == "sum" for i in d.program(f).instrs)
            assert not any(i.op == "cast" for i in d.program(f).instrs)  # no mask


def test_snapshot_without_the_field_loads_and_continues():
    """A checkpoint written before the flag existed (no ``cautious`` in its config) loads into a non-cautious
    optimizer and continues bit for bit; into a cautious one it loads, and the object keeps its flag."""
    rng = np.random.default_rng(5)
    p = rng.standard_normal(100).astype(np.float32)
    a = flatopt.AdamW(lr=1e-2)
    for _ in range(2):
        a.step("w", (100,), p, rng.standard_normal(100).astype(np.float32))
    old = a.state_dict()
    assert "cautious" not in old.config  # off is written as before the flag existed
    assert flatopt.AdamW(lr=1e-2, cautious=True).state_dict().config["cautious"] is True
    b = flatopt.AdamW(lr=1e-2)
    assert b.load_state_dict(old, restore_hparams=True), b.last_load_notes
    q = p.copy()
    g = rng.standard_normal(100).astype(np.float32)
    a.step("w", (100,), p, g)
    b.step("w", (100,), q, g)
    assert p.tobytes() == q.tobytes()
    c = flatopt.AdamW(lr=1e-2, cautious=True)
    assert c.load_state_dict(old, restore_hparams=True), c.last_load_notes
    assert c.config.cautious is True and any(n.startswith("cautious: kept True") for n in c.last_load_notes)


@pytest.mark.parametrize("cls", [space.cls for space in FLAG_SPACE.values()
                                 if "cautious" in space.options])
def test_bad_flag_is_refused(cls):
    with pytest.raises(TypeError, match="cautious must be a bool"):
        cls(lr=1e-3, cautious=1)
    with pytest.raises(TypeError, match="cautious must be a bool"):
        cls.config_cls(lr=1e-3, cautious="yes")


def test_step_without_the_config_base_is_refused():
    """``e.cautious`` in a step whose config lacks the field is a clear error, not a silent identity."""

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        lr: float = 0.1

    def step(e, p, g, *, s, f):
        return dict(p=p + e.cautious(g, g) * s.neg_lr)

    d = Definition("cautious_bad", step, scalars=lambda cfg, t, lr: dict(neg_lr=-lr),
                        flags=lambda cfg, t: {}, flag_names=(), slots=(), example=Cfg(), register=False)
    with pytest.raises(TypeError, match="e.cautious needs the flag 'cautious'"):
        d.program_at(0)


@pytest.mark.parametrize("lib", ["native", "numpy"])
def test_schedulefree_eval_and_train_unchanged(lib, monkeypatch, tmp_path):
    """ScheduleFreeAdamW(cautious=True): its steps are the reduce-then-map forms (no elementwise scratch), while
    ``eval``/``train`` stay the elementwise conversions with their own scratch: the same bits as a plain optimizer
    holding the same state, with the compiled pass and on the NumPy path (FLATOPT_NATIVE=0)."""
    from flatopt.core import native  # noqa: PLC0415

    if lib == "numpy":
        monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("FLATOPT_NATIVE", "0")
        native.reset()
    try:
        rng = np.random.default_rng(11)
        n = 70_001
        y = rng.standard_normal(n).astype(np.float32)
        a = flatopt.ScheduleFreeAdamW(lr=1e-2, weight_decay=0.01, cautious=True)
        for _ in range(3):
            a.step("w", (n,), y, rng.standard_normal(n).astype(np.float32))
        b = flatopt.ScheduleFreeAdamW(lr=1e-2, weight_decay=0.01)
        assert b.load_state_dict(a.state_dict()), b.last_load_notes
        ya, yb = y.copy(), y.copy()
        for mode in ("eval", "train"):
            getattr(a, mode)({"w": ya})
            getattr(b, mode)({"w": yb})
            assert ya.tobytes() == yb.tobytes(), mode
        assert not np.array_equal(ya, y)  # the round trip is not exact: the conversions ran
    finally:
        monkeypatch.undo()
        native.reset()

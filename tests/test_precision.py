"""16-bit parameters and gradients and the precision policy (flatopt/core/precision.py, flatopt/core/lowp.py).

Each write-back mode is checked against an emulation built from the float32 optimizer and independent roundings
(ml_dtypes' and NumPy's casts, a per-element pure-Python form of the documented stochastic recipe), and for AdamW
and SGD against a float64 reference of the update rule; the stochastic rounding's unbiasedness is a statistical
test; its bits are checked for step ≡ step_batch, thread counts and save/load/continue.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import flatopt
from flatopt import OptItem, Precision
from flatopt.core import precision as prec
from flatopt.errors import IncompatibleStateError

from .helpers import assert_bits_equal, assert_states_equal, grads_for, make_for, step_items
from .registry import REGISTRY

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
LOWP = (BF16, F16)
MODES = ("nearest", "stochastic", "kahan", "master")


def make(cls, precision=None, **kw):
    """An optimizer of ``cls`` under ``precision``, through its public ``precision=`` keyword."""
    return cls(precision=precision, **kw)


ALGOS = {
    "adamw": (lambda p: make(flatopt.AdamW, p, lr=1e-2, weight_decay=0.1), (40, 33)),
    "sgd": (lambda p: make(flatopt.SGD, p, lr=0.05, momentum=0.9), (40, 33)),
    "muon": (lambda p: make(flatopt.Muon, p, lr=0.02), (24, 20)),
    "adafactor": (lambda p: make(flatopt.Adafactor, p), (24, 20)),
}


def data(shape, dtype, steps, seed=0):
    r = np.random.default_rng(seed)
    n = math.prod(shape)
    p = r.standard_normal(n).astype(np.float32).astype(dtype)
    gs = [r.standard_normal(n).astype(np.float32).astype(dtype) for _ in range(steps)]
    return p, gs


def f32(a):
    return a.astype(np.float32)


# ------------------------------------------------------------------------------------------ independent rounding
def sr_reference(w: np.ndarray, dtype, seed: int, name: str, t: int) -> np.ndarray:
    """The documented stochastic recipe, per element in Python ints and floats (slow; small arrays)."""
    mask = (1 << 64) - 1

    def mix(z):
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & mask
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    h = 0xCBF29CE484222325
    for byte in name.encode():
        h = ((h ^ byte) * 0x100000001B3) & mask
    base = mix(seed ^ mix(h ^ mix(t)))
    out = np.empty(w.size, dtype)
    big = float(ml_dtypes.finfo(dtype).max) if dtype == BF16 else 65504.0
    for i, x in enumerate(w.astype(np.float32)):
        u = mix((base + (i + 1) * 0x9E3779B97F4A7C15) & mask) >> 32
        if not np.isfinite(x):
            out[i] = x
            continue
        b = int(np.float32(x).view(np.uint32))
        if dtype == BF16:
            v = np.array([(b + (u >> 16)) >> 16], np.uint16).view(BF16)[0]
            v = np.float32(v)
        else:
            a = abs(float(x))
            if a >= 2.0**-14:
                m = (int(np.float32(a).view(np.uint32)) + (u >> 19)) & ~0x1FFF
                v = float(np.uint32(m).view(np.float32))
            else:
                y = a * 2.0**24
                q = math.floor(y)
                v = (q + (u < (y - q) * 2.0**32)) * 2.0**-24
            v = math.copysign(v, x)
        if not math.isfinite(v) or abs(v) > big:
            v = math.copysign(big, x)
        out[i] = v
    return out


def emulate(make_opt, mode, dtype, p0, grads, shape, seed=0, name="w"):
    """What the lowered path must give: the float32 optimizer on a float32 working copy, then the write-back."""
    opt = make_opt(None)
    p = p0.copy()
    comp = np.zeros(p.size, dtype)
    master = f32(p0)
    for t, g in enumerate(grads, 1):
        w = master if mode == "master" else f32(p) + (f32(comp) if mode == "kahan" else 0)
        opt.step(name, shape, w, f32(g))
        if mode == "stochastic":
            p = sr_reference(w, dtype, seed, name, t)
        else:
            p = w.astype(dtype)
        if mode == "kahan":
            comp = np.where(np.isfinite(f32(p)), w - f32(p), 0).astype(np.float32).astype(dtype)
    return p, comp, master, opt


def run(opt, p, grads, shape, name="w"):
    for g in grads:
        opt.step(name, shape, p, g)
    return p


# ------------------------------------------------------------------------------------------------ the policy
@pytest.mark.parametrize("kw, exc, match", [
    (dict(writeback="fast"), ValueError, "writeback"),
    (dict(writeback=None), ValueError, "writeback"),
    (dict(state="bfloat16"), ValueError, "not implemented yet"),
    (dict(state="8bit"), ValueError, "not implemented yet"),
    (dict(state="al8"), ValueError, "not implemented yet"),
    (dict(state={"m": "8bit"}), ValueError, "not implemented yet"),
    (dict(state="float16"), ValueError, "state"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1 << 63), ValueError, "seed"),
    (dict(seed=True), TypeError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
])
def test_policy_refuses(kw, exc, match):
    with pytest.raises(exc, match=match):
        Precision(**kw)


def test_policy_is_frozen_and_checked_by_the_driver():
    p = Precision("kahan", seed=np.int64(7))
    assert type(p.seed) is int and p == Precision.from_dict(p.to_dict())
    with pytest.raises(AttributeError):
        p.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match="precision"):
        flatopt.PerParamOptimizer.__init__(flatopt.SGD(lr=0.1), flatopt.SGD(lr=0.1).config, precision="stochastic")


# ------------------------------------------------------------------------------------------------ roundings
def _specials(dtype):
    big = float(ml_dtypes.finfo(dtype).max)
    r = np.random.default_rng(1)
    x = np.concatenate([r.standard_normal(5000) * 10.0 ** r.integers(-45, 39, 5000),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, big, -big, big * 1.001, 1e-42, -1e-45, 2.0**-14,
                         2.0**-24, 3 * 2.0**-26]])
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_nearest_is_the_cast(dtype):
    w = _specials(dtype)
    out = np.empty(w.size, dtype)
    prec.round_nearest(np, w, out)
    with np.errstate(over="ignore"):
        want = w.astype(dtype)
    nan = np.isnan(f32(want))
    assert np.array_equal(np.isnan(f32(out)), nan)
    assert_bits_equal(out[~nan], want[~nan], "round to nearest even")
    back = np.empty(w.size, np.float32)
    prec.widen(np, out, back)
    assert np.array_equal(back[~nan], f32(out)[~nan])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_stochastic_bits_are_the_documented_recipe(dtype):
    w = _specials(dtype)[::10].copy()
    w = np.concatenate([w, _specials(dtype)[-13:]])
    words = np.empty(w.size, np.uint64)
    prec.random_words(np, prec.stream_base(5, "layer.0.w", 3), 0, words, np.empty_like(words))
    out = np.empty(w.size, dtype)
    prec.round_stochastic(np, w, out, words)
    want = sr_reference(w, dtype, 5, "layer.0.w", 3)
    nan = np.isnan(w)
    assert np.isnan(f32(out)[nan]).all()
    assert_bits_equal(out[~nan], want[~nan], "stochastic rounding")
    # a finite value never becomes infinite; ±inf stays
    assert np.isfinite(f32(out)[np.isfinite(w)]).all()
    assert np.array_equal(f32(out)[np.isinf(w)], w[np.isinf(w)])


def _straddling(dtype):
    """Values strictly between two neighbouring 16-bit values: around 1, a negative one, near zero (float16's
    subnormals and below its smallest one; bfloat16's float32 subnormals) and just below the largest finite."""
    fi = ml_dtypes.finfo(dtype)
    big = float(fi.max)
    below_big = float(np.nextafter(np.array(big, dtype), np.array(0, dtype)))
    vals = [1.0 + 0.3 * float(fi.eps), -(2.0 + 0.71 * 2 * float(fi.eps)), below_big + 0.37 * (big - below_big)]
    if dtype == F16:
        vals += [0.3 * 2.0**-24, 7.6 * 2.0**-24, 2.0**-14 + 0.55 * 2.0**-24]
    else:
        vals += [1e-39, -3.3e-40]
    return vals


def _binomial_outside(n, p, lo, hi):
    """P(X < lo or X > hi) for X ~ Binomial(n, p), summed exactly (log-space terms; the tails decay fast)."""
    def pmf(k):
        return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                        + k * math.log(p) + (n - k) * math.log1p(-p))
    total = 0.0
    for ks in (range(lo - 1, -1, -1), range(hi + 1, n + 1)):
        for k in ks:
            term = pmf(k)
            total += term
            if term < 1e-30:
                break
    return total


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_stochastic_rounding_is_unbiased(dtype):
    """Each value, repeated over N elements (independent words), rounds to one of its two neighbours, up with
    probability frac; the count of ups is within 6 standard deviations of N·frac (then so is the mean of the results
    within 6 standard deviations of the value).  Were the words i.i.d. uniform, a false failure would have the
    probability of the binomial tail outside that band, computed exactly here: below 2.5e-9 per value (the normal
    approximation's 2e-9 underestimates it) and 1.5e-8 for one dtype's values (both asserted below)."""
    n = 40000
    false_failure = 0.0
    for k, x in enumerate(_straddling(dtype)):
        w = np.full(n, x, np.float32)
        x = float(w[0])
        lo = np.array(x, np.float32).astype(dtype)
        if abs(float(lo)) > abs(x):  # the nearest was away from zero: the neighbour toward zero
            lo = np.nextafter(lo, np.array(0, dtype))
        hi = np.nextafter(lo, np.array(math.copysign(np.inf, x), dtype))
        frac = (abs(x) - abs(float(lo))) / (abs(float(hi)) - abs(float(lo)))
        assert 0.05 < frac < 0.95, (x, frac)
        words = np.empty(n, np.uint64)
        prec.random_words(np, prec.stream_base(11, f"v{k}", 1), 0, words, np.empty_like(words))
        out = np.empty(n, dtype)
        prec.round_stochastic(np, w, out, words)
        got = f32(out)
        assert np.isin(got, [f32(lo), f32(hi)]).all(), x
        ups = int((got == f32(hi)).sum())
        sd = math.sqrt(n * frac * (1 - frac))
        band = (math.ceil(n * frac - 6 * sd), math.floor(n * frac + 6 * sd))
        assert band[0] <= ups <= band[1], (x, ups, n * frac, sd)
        tail = _binomial_outside(n, frac, *band)
        assert tail < 2.5e-9, (x, tail)  # the docstring's rate
        false_failure += tail
    assert false_failure < 1.5e-8


def test_float16_overflow_saturates_under_stochastic_only():
    w = np.array([65519.0, 65520.0, 1e6, -3e38, np.inf, -np.inf], np.float32)
    words = np.zeros(w.size, np.uint64) + np.uint64(0xFFFFFFFF)  # always up
    out = np.empty(w.size, F16)
    prec.round_stochastic(np, w, out, words)
    assert f32(out).tolist() == [65504.0, 65504.0, 65504.0, -65504.0, np.inf, -np.inf]
    near = np.empty(w.size, F16)
    prec.round_nearest(np, w, near)
    assert f32(near).tolist() == [65504.0, np.inf, np.inf, -np.inf, np.inf, -np.inf]


# ---------------------------------------------------------------------------------------- the modes, per algorithm
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", sorted(ALGOS))
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_mode_is_the_float32_step_then_the_write_back(algo, mode, dtype):
    make_opt, shape = ALGOS[algo]
    p0, grads = data(shape, dtype, 4)
    gs = [g.copy() for g in grads]
    opt = make_opt(Precision(mode, seed=9))
    p = run(opt, p0.copy(), grads, shape)
    for g, g0 in zip(grads, gs):
        assert_bits_equal(g, g0, "grad untouched")
    want, comp, master, ref = emulate(make_opt, mode, dtype, p0, gs, shape, seed=9)
    assert_bits_equal(p, want, f"{algo} {mode}")
    if mode == "kahan":
        assert_bits_equal(opt._lowp["w"].comp, comp, "compensation")  # noqa: SLF001
    if mode == "master":
        assert_bits_equal(opt._lowp["w"].master, master, "master")  # noqa: SLF001
    assert opt.state_nbytes() == ref.state_nbytes() + p.size * {"kahan": 2, "master": 4}.get(mode, 0)


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_write_back_chunks_draw_by_the_index_in_the_parameter(mode, dtype, monkeypatch):
    """The write-back cut into small chunks (1320 elements in seven, on two threads): the same bits as the emulation,
    whose stochastic draw is by the element's index in the whole parameter."""
    from flatopt.core import lowp

    monkeypatch.setattr(lowp, "CHUNK", 200)
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "2")
    make_opt, shape = ALGOS["adamw"]
    p0, grads = data(shape, dtype, 3)
    p = run(make_opt(Precision(mode, seed=9)), p0.copy(), [g.copy() for g in grads], shape)
    want, _, _, _ = emulate(make_opt, mode, dtype, p0, grads, shape, seed=9)
    assert_bits_equal(p, want, f"{mode} in chunks")

def _adamw64(p, grads, lr=1e-2, wd=0.1, b1=0.9, b2=0.999, eps=1e-8):
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        p *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def _sgd64(p, grads, lr=0.05, mom=0.9):
    p = p.astype(np.float64)
    buf = None
    for g in grads:
        g = g.astype(np.float64)
        buf = g if buf is None else mom * buf + g
        p -= lr * buf
    return p


@pytest.mark.parametrize("algo, ref", [("adamw", _adamw64), ("sgd", _sgd64)])
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_master_and_kahan_follow_the_float64_reference(algo, ref, dtype):
    """The master copy tracks the float64 update rule to float32 accuracy, the parameter is its nearest 16-bit
    value; with Kahan, p + c carries the same information (within a 16-bit ulp of c's rounding)."""
    make_opt, shape = ALGOS[algo]
    p0, grads = data(shape, dtype, 6)
    want = ref(f32(p0), [f32(g) for g in grads])
    opt = make_opt(Precision("master"))
    p = run(opt, p0.copy(), grads, shape)
    master = opt._lowp["w"].master  # noqa: SLF001
    np.testing.assert_allclose(master, want, rtol=2e-5, atol=2e-6)
    assert_bits_equal(p, master.astype(dtype))
    opt = make_opt(Precision("kahan"))
    p = run(opt, p0.copy(), grads, shape)
    total = f32(p).astype(np.float64) + f32(opt._lowp["w"].comp)  # noqa: SLF001
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert np.all(np.abs(total - want) <= 2 * eps * eps * np.abs(want) + 2e-5 * (np.abs(want) + 1))
    opt = make_opt(Precision("nearest"))
    p = run(opt, p0.copy(), grads, shape)
    np.testing.assert_allclose(f32(p), want, rtol=6 * eps, atol=6 * eps)  # each step within half an ulp


def test_mixed_gradients_are_widened_and_never_written():
    p0, grads = data((50,), np.float32, 3)
    bgrads = [g.astype(BF16) for g in grads]
    a = flatopt.AdamW(lr=1e-2)
    pa = run(a, p0.copy(), [g.copy() for g in bgrads], (50,))
    b = flatopt.AdamW(lr=1e-2)
    pb = run(b, p0.copy(), [f32(g) for g in bgrads], (50,))
    assert_bits_equal(pa, pb, "bf16 grads into a float32 parameter")
    assert a.state_dict().params["w"]["dtype"] == "float32"
    p64 = p0.astype(np.float64)
    c = flatopt.SGD(lr=0.1)
    run(c, p64, [g.astype(np.float16) for g in grads], (50,))
    d = flatopt.SGD(lr=0.1)
    want = run(d, p0.astype(np.float64), [g.astype(np.float16).astype(np.float64) for g in grads], (50,))
    assert_bits_equal(p64, want, "float16 grads into a float64 parameter")
    # float32 gradients into a bfloat16 parameter
    sgd = (lambda p: make(flatopt.SGD, p, lr=0.1))
    e = sgd(None)
    pe = run(e, p0.astype(BF16), grads, (50,))
    assert_bits_equal(pe, emulate(sgd, "nearest", BF16, p0.astype(BF16), grads, (50,))[0])
    assert e.state_dict().params["w"]["dtype"] == "bfloat16"


# --------------------------------------------------------------------------------------------- reproducibility
def _batch(dtype, seed=0):
    r = np.random.default_rng(seed)
    shapes = {"big": (600, 500), "a": (7, 5), "b": (33,), "c": (4, 4, 4)}
    ps = {n: r.standard_normal(math.prod(s)).astype(np.float32).astype(dtype) for n, s in shapes.items()}
    gs = [{n: r.standard_normal(p.size).astype(np.float32).astype(dtype) for n, p in ps.items()} for _ in range(3)]
    return shapes, ps, gs


def _steps(opt, shapes, ps, gs, batch):
    for g in gs:
        if batch:
            opt.step_batch([OptItem(n, shapes[n], ps[n], g[n]) for n in shapes])
        else:
            for n in shapes:
                opt.step(n, shapes[n], ps[n], g[n])


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_bits_same_for_step_batch_threads_and_resume(mode, monkeypatch, tmp_path):
    shapes, p0, gs = _batch(BF16)
    results = []
    for threads, batch in [(1, False), (1, True), (2, True), (3, True)]:
        monkeypatch.setenv("FLATOPT_NUM_THREADS", str(threads))
        opt = make(flatopt.AdamW, Precision(mode, seed=3), lr=1e-2)
        ps = {n: p.copy() for n, p in p0.items()}
        _steps(opt, shapes, ps, gs, batch)
        results.append((ps, opt.state_dict()))
    # save after 1 step, load into a fresh optimizer, continue
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "2")
    opt = make(flatopt.AdamW, Precision(mode, seed=3), lr=1e-2)
    ps = {n: p.copy() for n, p in p0.items()}
    _steps(opt, shapes, ps, gs[:1], True)
    fresh = make(flatopt.AdamW, Precision(mode, seed=3), lr=1e-2)
    flatopt.save(tmp_path / "s.npz", opt)
    assert fresh.load_state_dict(flatopt.load(tmp_path / "s.npz")), fresh.last_load_notes
    _steps(fresh, shapes, ps, gs[1:], True)
    results.append((ps, fresh.state_dict()))
    ref_ps, ref_state = results[0]
    for ps, state in results[1:]:
        for n in shapes:
            assert_bits_equal(ps[n], ref_ps[n], n)
        assert_states_equal(state, ref_state)
    other = make(flatopt.AdamW, Precision(mode, seed=4), lr=1e-2)
    ps = {n: p.copy() for n, p in p0.items()}
    _steps(other, shapes, ps, gs, True)
    assert any(ps[n].tobytes() != ref_ps[n].tobytes() for n in shapes) or mode == "kahan"


def test_snapshot_of_another_policy_is_refused_with_the_reason():
    shapes, p0, gs = _batch(F16)
    opt = make(flatopt.SGD, Precision("kahan"), lr=0.1, momentum=0.9)
    ps = {n: p.copy() for n, p in p0.items()}
    _steps(opt, shapes, ps, gs[:1], True)
    snap = opt.state_dict()
    assert snap.params["a"]["dtype"] == "float16" and "precision.kahan/a" in snap.buffers
    for other in (Precision("master"), Precision("kahan", seed=1), None):
        o = make(flatopt.SGD, other, lr=0.1, momentum=0.9)
        before = o.state_dict()
        assert not o.load_state_dict(snap)
        assert "precision" in o.last_load_notes[0].lower() or "Precision" in o.last_load_notes[0]
        assert_states_equal(o.state_dict(), before)
        with pytest.raises(IncompatibleStateError, match="Precision"):
            o.load_state_dict(snap, strict=True)
    broken = flatopt.OptimizerState(**{**snap.__dict__, "buffers": {k: v for k, v in snap.buffers.items()
                                                                      if k != "precision.kahan/a"}})
    o = make(flatopt.SGD, Precision("kahan"), lr=0.1, momentum=0.9)
    assert not o.load_state_dict(broken) and "precision.kahan/a" in o.last_load_notes[0]


# ------------------------------------------------------------------------------------------------ the stall
def test_round_to_nearest_stalls_where_the_others_keep_pace():
    """SGD, lr·grad = 1e-4 per step on parameters near 1 (half a bfloat16 ulp there is 2**-9 ≈ 2e-3): round to
    nearest never moves; stochastic (the parameter), Kahan (parameter + compensation) and master (its
    copy; the parameter is its nearest) follow the float32
    run."""
    n, steps = 4096, 200
    p0 = (1.0 + np.random.default_rng(0).random(n) * 0.5).astype(BF16)
    g = np.full(n, 0.1, BF16)
    ref = f32(p0)
    sgd = flatopt.SGD(lr=1e-3)
    for _ in range(steps):
        sgd.step("w", (n,), ref, f32(g))
    moved = float(np.mean(f32(p0) - ref))
    assert 0.019 < moved < 0.021
    for mode in MODES:
        opt = make(flatopt.SGD, Precision(mode, seed=1), lr=1e-3)
        p = p0.copy()
        for _ in range(steps):
            opt.step("w", (n,), p, g)
        rec = opt._lowp["w"]  # noqa: SLF001
        now = rec.master if mode == "master" else f32(p) + (f32(rec.comp) if mode == "kahan" else 0)
        got = float(np.mean(f32(p0) - now))
        if mode != "stochastic":  # (kahan, master: the parameter is the nearest to what it carries)
            assert np.all(np.abs(f32(p) - now) <= 2.0**-8 * np.abs(now))
        if mode == "nearest":
            assert got == 0.0
        elif mode == "stochastic":
            assert abs(got - moved) < 0.1 * moved, got  # mean of 4096 unbiased roundings
        else:
            assert abs(got - moved) < 0.05 * moved, (mode, got)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("pdt, gdt, match", [
    (np.int32, np.int32, "param dtype int32 is not accepted.*bfloat16"),
    (np.complex64, np.complex64, "param dtype complex64 is not accepted"),
    ("float8_e4m3fn", "float8_e4m3fn", "param dtype float8_e4m3fn is not accepted"),
    (np.float32, np.int16, "grad dtype int16 is not accepted"),
    (BF16, "float8_e5m2", "grad dtype float8_e5m2 is not accepted"),
])
def test_refused_dtypes_change_nothing(pdt, gdt, match):
    pdt = getattr(ml_dtypes, pdt) if isinstance(pdt, str) else pdt
    gdt = getattr(ml_dtypes, gdt) if isinstance(gdt, str) else gdt
    opt = make(flatopt.AdamW, None, lr=1e-2)
    good_p, good_g = np.ones(5, BF16), np.ones(5, BF16)
    opt.step("ok", (5,), good_p, good_g)
    before = opt.state_dict()
    p, g = np.ones(6, pdt), np.ones(6, gdt)
    snap_p = good_p.copy()
    with pytest.raises(TypeError, match=f"'w'.*{match}"):
        opt.step_batch([OptItem("ok", (5,), good_p, good_g), OptItem("w", (6,), p, g)])
    with pytest.raises(TypeError, match=match):
        opt.validate_batch([OptItem("w", (6,), p, g)])
    assert_bits_equal(good_p, snap_p)
    assert_states_equal(opt.state_dict(), before)


def test_refused_policy_combinations_change_nothing():
    opt = make(flatopt.SGD, Precision("stochastic"), lr=0.1)
    b = np.ones(4, BF16)
    opt.step("b", (4,), b, np.ones(4, BF16))
    before, b0 = opt.state_dict(), b.copy()
    x = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="'x'.*writeback='stochastic'.*float32"):
        opt.step_batch([OptItem("b", (4,), b, np.ones(4, BF16)), OptItem("x", (3,), x, np.ones(3, np.float32))])
    assert_bits_equal(b, b0)
    assert (x == 1).all()
    # a name keeps its dtype: bfloat16 then float16 or float32
    for p in (np.ones(4, F16), np.ones(4, np.float32)):
        with pytest.raises(TypeError, match="'b'.*differs from the dtype bfloat16"):
            opt.step("b", (4,), p, np.ones(4, BF16))
    plain = make(flatopt.SGD, None, lr=0.1)
    plain.step("y", (4,), np.ones(4, np.float32), np.ones(4, np.float32))
    with pytest.raises(TypeError, match="'y'.*differs from the dtype float32"):
        plain.step("y", (4,), np.ones(4, BF16), np.ones(4, BF16))
    # the inner validation (a shape the state was not made for) also changes nothing, write-back buffers included
    km = make(flatopt.SGD, Precision("master"), lr=0.1)
    km.step("b", (4,), np.ones(4, BF16), np.ones(4, BF16))
    before = km.state_dict()
    with pytest.raises(ValueError, match="'b'.*shape"):
        km.step_batch([OptItem("n", (2,), np.ones(2, BF16), np.ones(2, BF16)),
                       OptItem("b", (2, 2, 1), np.ones(4, BF16), np.ones(4, BF16))])
    assert_states_equal(km.state_dict(), before)
    assert km.state_names() == ["b"] and sorted(km._lowp) == ["b"]  # noqa: SLF001
    assert opt.state_dict().extra["precision"] == {"writeback": "stochastic", "state": "float32", "seed": 0}
    del before


# ------------------------------------------------------------------------------------------- the contract, 16-bit
def _lowered(spec, dtype, mode):
    """A fresh optimizer of ``spec`` under ``mode`` (its public ``precision=`` keyword) and 16-bit parameters of
    its shapes."""
    params = {f"p{i}": (s, np.random.default_rng(i).standard_normal(math.prod(s)).astype(np.float32).astype(dtype))
              for i, s in enumerate(spec.shapes)}
    return make_for(spec, params, precision=Precision(mode, seed=5)), params


def _lowp_grads(params, it):
    return {n: g.astype(params[n][1].dtype) for n, g in grads_for(params, it).items()}


def _run16(opt, params, steps, start=0, batch=False):
    for it in range(start, start + steps):
        grads = _lowp_grads(params, it)
        items = [OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())]
        for g in grads.values():
            g.flags.writeable = False  # any write into a gradient raises
        step_items(opt, items, batch)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_algorithm_steps_16bit_parameters(name, dtype, mode, tmp_path):
    """In place, gradients untouched, finite; step_batch ≡ serial; save (through a file), load, continue: bit for
    bit."""
    spec = REGISTRY[name]
    opt, params = _lowered(spec, dtype, mode)
    assert opt.precision == Precision(mode, seed=5)
    start = {n: p.copy() for n, (_, p) in params.items()}
    _run16(opt, params, 2)
    assert any(not np.array_equal(p, start[n]) for n, (_, p) in params.items())
    assert all(np.isfinite(f32(p)).all() for _, p in params.values())
    batched = {n: (s, start[n].copy()) for n, (s, _) in params.items()}
    other, _ = _lowered(spec, dtype, mode)
    _run16(other, batched, 2, batch=True)
    for n in params:
        assert_bits_equal(batched[n][1], params[n][1], f"{name} {n}: step_batch vs serial")
    flatopt.save(tmp_path / "s.npz", opt)
    fresh, _ = _lowered(spec, dtype, mode)
    assert fresh.load_state_dict(flatopt.load(tmp_path / "s.npz")), fresh.last_load_notes
    _run16(opt, params, 2, start=2, batch=True)
    _run16(fresh, batched, 2, start=2, batch=True)
    for n in params:
        assert_bits_equal(batched[n][1], params[n][1], f"{name} {n}: resumed")
    assert_states_equal(fresh.state_dict(), opt.state_dict())



def test_plans_of_working_items_and_of_plain_items_do_not_mix():
    """The same float32 parameters stepped by step_batch with bfloat16 gradients (lowered: working items) and with
    float32 ones (a cached plan), alternately and re-using the arrays: every step is the one of widened gradients."""
    shapes = {"a": (300,), "b": (7, 3), "c": (5,)}
    r = np.random.default_rng(2)
    p0 = {n: r.standard_normal(math.prod(s)).astype(np.float32) for n, s in shapes.items()}
    g16 = {n: r.standard_normal(p.size).astype(np.float32).astype(BF16) for n, p in p0.items()}
    g32 = {n: r.standard_normal(p.size).astype(np.float32) for n, p in p0.items()}
    opt, ref = flatopt.AdamW(lr=1e-2), flatopt.AdamW(lr=1e-2)
    ps, qs = {n: p.copy() for n, p in p0.items()}, {n: p.copy() for n, p in p0.items()}
    for k in range(6):
        gs = g16 if k % 3 else g32
        opt.step_batch([OptItem(n, shapes[n], ps[n], gs[n]) for n in shapes])
        ref.step_batch([OptItem(n, shapes[n], qs[n], f32(gs[n])) for n in shapes])
        for n in shapes:
            assert_bits_equal(ps[n], qs[n], f"step {k} {n}")


def test_reset_and_malformed_policy_in_a_snapshot():
    opt = make(flatopt.SGD, Precision("master"), lr=0.1)
    opt.step("b", (4,), np.ones(4, BF16), np.ones(4, BF16))
    assert opt.state_nbytes() == 16
    snap = opt.state_dict()
    bad = flatopt.OptimizerState(**{**snap.__dict__, "extra": {**snap.extra, "precision": "master"}})
    fresh = make(flatopt.SGD, Precision("master"), lr=0.1)
    assert not fresh.load_state_dict(bad) and "extra['precision']" in fresh.last_load_notes[0]
    assert fresh.state_names() == []
    assert fresh.load_state_dict(snap)
    with pytest.raises(TypeError, match="'b'.*differs from the dtype bfloat16"):  # the loaded name keeps its dtype
        fresh.step("b", (4,), np.ones(4, F16), np.ones(4, F16))
    opt.reset("b")
    assert opt.state_nbytes() == 0 and opt.state_names() == []
    opt.step("b", (4,), np.ones(4, F16), np.ones(4, F16))  # afresh, with another dtype
    assert opt.state_dict().params["b"]["dtype"] == "float16"


# ------------------------------------------------------------------------------- ScheduleFreeAdamW's conversions
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_schedulefree_eval_train_convert_the_carried_value(mode, dtype):
    """eval/train of 16-bit parameters convert the float32 value the parameter carries (the master copy, p + c, or
    p) as the float32 optimizer converts it, then write it back to nearest (Kahan: with the new compensation)."""
    shape = (37, 29)
    p0, grads = data(shape, dtype, 3, seed=4)

    def make_sf(precision):
        return make(flatopt.ScheduleFreeAdamW, precision, lr=1e-2, warmup_steps=1)

    opt = make_sf(Precision(mode))
    p = run(opt, p0.copy(), grads, shape)
    ep, comp, master, ref = emulate(make_sf, mode, dtype, p0, grads, shape)
    assert_bits_equal(p, ep)
    w = master if mode == "master" else f32(ep) + (f32(comp) if mode == "kahan" else 0)
    rec = opt._lowp["w"]  # noqa: SLF001
    for conv in ("eval", "train"):
        before = p.copy()
        getattr(opt, conv)({"w": p})
        getattr(ref, conv)({"w": w})
        assert not np.array_equal(f32(p), f32(before)), conv  # the conversion moved the parameter
        assert_bits_equal(p, w.astype(dtype), f"{conv}: the parameter is the nearest of the converted value")
        if mode == "master":
            assert_bits_equal(rec.master, w, f"{conv}: the master copy converts as a float32 parameter")
        if mode == "kahan":
            c = np.where(np.isfinite(f32(p)), w - f32(p), 0).astype(np.float32).astype(dtype)
            assert_bits_equal(rec.comp, c, f"{conv}: compensation")
            w = f32(p) + f32(c)
        elif mode != "master":
            w = f32(p)
    assert opt.mode == "train"
    with pytest.raises(TypeError, match="'w'.*float32 differs from the dtype"):
        opt.eval({"w": f32(p)})
    assert_bits_equal(p, w.astype(dtype))


def test_muon_adamw_applies_the_policy_to_both_halves():
    """One policy for both groups: each half steps as the standalone optimizer under it; the snapshot holds both
    halves' Kahan buffers, and a snapshot of another policy is refused with the reason."""
    shapes = {"w": (12, 10), "b": (10,)}
    pol = Precision("kahan", seed=2)
    opt = flatopt.MuonAdamW({"w": ((12, 10), "bfloat16"), "b": (10,)}, ["w"], adamw_lr_ratio=0.5, precision=pol)
    assert opt.muon.precision == opt.adamw.precision == opt.precision == pol
    muon = flatopt.Muon(**{k: v for k, v in opt.muon.config.__dict__.items()}, precision=pol)
    adamw = flatopt.AdamW(**{k: v for k, v in opt.adamw.config.__dict__.items()}, precision=pol)
    r = np.random.default_rng(0)
    ps = {n: r.standard_normal(math.prod(s)).astype(np.float32).astype(BF16) for n, s in shapes.items()}
    qs = {n: p.copy() for n, p in ps.items()}
    for k in range(3):
        gs = {n: r.standard_normal(p.size).astype(np.float32).astype(BF16) for n, p in ps.items()}
        opt.step_batch([OptItem(n, shapes[n], ps[n], gs[n]) for n in shapes])
        muon.step("w", shapes["w"], qs["w"], gs["w"])
        adamw.step("b", shapes["b"], qs["b"], gs["b"])
    for n in shapes:
        assert_bits_equal(ps[n], qs[n], n)
    snap = opt.state_dict()
    assert {"muon.precision.kahan/w", "adamw.precision.kahan/b"} <= set(snap.buffers)
    fresh = flatopt.MuonAdamW({"w": ((12, 10), "bfloat16"), "b": (10,)}, ["w"], adamw_lr_ratio=0.5, precision=pol)
    assert fresh.load_state_dict(snap), fresh.last_load_notes
    assert_states_equal(fresh.state_dict(), snap)
    other = flatopt.MuonAdamW({"w": ((12, 10), "bfloat16"), "b": (10,)}, ["w"], adamw_lr_ratio=0.5,
                              precision=Precision("master"))
    assert not other.load_state_dict(snap) and "kahan" in other.last_load_notes[0]
    assert other.state_names() == []
    with pytest.raises(flatopt.errors.DTypeMismatch, match="'w'.*float32 differs from bfloat16"):
        opt.step("w", shapes["w"], f32(ps["w"]), f32(gs["w"]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_lowered_steps_allocate_no_chunk_temporaries(mode, dtype, monkeypatch):
    """After the first steps, a lowered step_batch takes its working copies, gradients, random words and rounding
    temporaries from scratch: what it allocates stays far below one chunk's float32 temporaries (NumPy's own ufunc
    buffers aside)."""
    import tracemalloc

    from flatopt.core.lowp import CHUNK
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "1")
    n = 3 * CHUNK + 5
    r = np.random.default_rng(1)
    opt = make(flatopt.AdamW, Precision(mode), lr=1e-3)
    items = [OptItem(f"p{i}", (n,), r.standard_normal(n).astype(np.float32).astype(dtype),
                     r.standard_normal(n).astype(np.float32).astype(dtype)) for i in range(2)]
    for _ in range(2):
        opt.step_batch(items)
    tracemalloc.start()
    try:
        opt.step_batch(items)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < CHUNK * 4, (mode, dtype, peak)

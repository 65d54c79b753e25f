"""flatopt.schedules against three references, step by step, over the warm-up, the boundaries and past the end:

* torch.optim.lr_scheduler (the CPU oracle): a torch optimizer on a dummy parameter, ``get_last_lr()`` read before
  each ``optimizer.step()``, the scheduler stepped after it, as torch documents;
* optax's documented formulas: optax needs JAX, which is not installed here, so the formulas of
  ``optax/schedules/_schedule.py`` and ``_join.py`` (optax 0.2.x docstrings and code) are written out below in plain
  Python floats — the conventions (step 0, boundaries, the one-step shift of optax's warm-up) are what is checked;
* independent float64 formulas written from each schedule's definition (vectorised NumPy over all steps, another
  operation order than the module's), including the formula the warm-up example used before it had schedules.

torch's schedulers update the lr recursively (each step multiplies the last), so they agree to ~1e-15 relative,
not bit for bit; optax's formulas (another operation order: end + (start − end)·u) to an ulp or two, and this module
hits both ends of each transition exactly (tested).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import flatopt
from flatopt import schedules as S

REL = 1e-13


def values(sched, n):
    return np.array([sched(s) for s in range(n)])


def assert_close(got, want, rel=REL, abs_=0.0):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rel, atol=abs_)


# ---- torch: the scheduler's lr for each optimizer step ----

def torch_lrs(make, n, base):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    sched = make(opt, torch.optim.lr_scheduler)
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return np.array(out)


# ---- optax 0.2.x formulas (optax/schedules/_schedule.py, _join.py), written out without JAX ----

def optax_constant(value):
    return lambda count: value


def optax_polynomial(init_value, end_value, power, transition_steps, transition_begin=0):
    if transition_steps <= 0:
        return lambda count: init_value

    def schedule(count):
        count = min(max(count - transition_begin, 0), transition_steps)
        frac = 1 - count / transition_steps
        return (init_value - end_value) * (frac**power) + end_value
    return schedule


def optax_linear(init_value, end_value, transition_steps):
    return optax_polynomial(init_value, end_value, 1, transition_steps)


def optax_cosine_decay(init_value, decay_steps, alpha=0.0, exponent=1.0):
    def schedule(count):
        count = min(count, decay_steps)
        cosine_decay = 0.5 * (1 + math.cos(math.pi * count / decay_steps))
        return init_value * ((1 - alpha) * cosine_decay**exponent + alpha)
    return schedule


def optax_join(schedules, boundaries):
    def schedule(step):
        output = schedules[0](step)
        for boundary, sched in zip(boundaries, schedules[1:]):
            output = output if step < boundary else sched(step - boundary)
        return output
    return schedule


def optax_warmup_cosine_decay(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return optax_join([optax_linear(init_value, peak_value, warmup_steps),
                       optax_cosine_decay(peak_value, decay_steps - warmup_steps, alpha)], [warmup_steps])


def optax_piecewise_constant(init_value, boundaries_and_scales):
    def schedule(count):
        v = init_value
        for threshold, scale in sorted(boundaries_and_scales.items()):
            indicator = max(0.0, float(np.sign(threshold - count)))
            v = v * indicator + (1 - indicator) * scale * v
        return v
    return schedule


def optax_values(fn, n):
    return np.array([fn(s) for s in range(n)], np.float64)


# ---- the schedules, one by one ----

def test_constant():
    s = S.constant(3e-4)
    assert_close(values(s, 50), torch_lrs(lambda o, L: L.ConstantLR(o, factor=1.0), 50, 3e-4))
    assert_close(values(s, 50), optax_values(optax_constant(3e-4), 50))
    assert s(0) == s(10**12) == 3e-4 and type(s(0)) is float
    assert S.constant(0)(5) == 0.0


@pytest.mark.parametrize("w", [1, 2, 5, 30])
def test_linear_warmup(w):
    peak, n = 3e-3, 3 * w + 5
    s = S.linear_warmup(peak, w)
    got = values(s, n)
    if w > 1:
        assert_close(got, torch_lrs(lambda o, L: L.LinearLR(o, 1 / w, 1.0, w - 1), n, peak))
    ref = peak * np.minimum(np.arange(1, n + 1, dtype=np.float64), w) / w  # first update moves: peak/W at step 0
    assert_close(got, ref)
    assert s(0) == peak / w and s(w - 1) == peak and s(w) == peak and s(10**9) == peak
    # optax's warm-up (linear_schedule(0, peak, W)) is one step behind: its step s+1 is our step s
    assert_close(got, optax_values(lambda c: optax_linear(0.0, peak, w)(c + 1), n))
    assert optax_linear(0.0, peak, w)(0) == 0.0


@pytest.mark.parametrize("start,end", [(1e-2, 1e-3), (1e-3, 5e-3), (2e-3, 2e-3)])
def test_linear(start, end):
    t, n, base = 20, 30, max(start, end)
    s = S.linear(start, end, t)
    got = values(s, n)
    assert_close(got, torch_lrs(lambda o, L: L.LinearLR(o, start / base, end / base, t), n, base))
    assert_close(got, optax_values(optax_linear(start, end, t), n))
    steps = np.arange(n, dtype=np.float64)
    assert_close(got, start + (end - start) * np.clip(steps / t, 0, 1))
    assert s(0) == start and s(t) == end and s(t + 1) == end and s(10**12) == end


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0, 3.0])
def test_polynomial(power):
    t, n, peak = 25, 40, 1e-2
    s = S.polynomial(peak, 0.0, t, power)
    got = values(s, n)
    assert_close(got, torch_lrs(lambda o, L: L.PolynomialLR(o, total_iters=t, power=power), n, peak),
                 abs_=1e-15 * peak)
    assert_close(got, optax_values(optax_polynomial(peak, 0.0, power, t), n))
    with_end = S.polynomial(peak, 1e-4, t, power)
    frac = np.clip(np.arange(n, dtype=np.float64) / t, 0, 1)
    assert_close(values(with_end, n), 1e-4 + (peak - 1e-4) * (1 - frac) ** power)
    assert_close(values(with_end, n), optax_values(optax_polynomial(peak, 1e-4, power, t), n))
    assert s(0) == peak and s(t) == 0.0 and s(t + 7) == 0.0 and with_end(t) == 1e-4


def _cosine_ref(peak, total, warmup, floor, n):
    """The definition, vectorised: linear warm-up peak·(s+1)/W, then half a cosine from peak (step W) to floor."""
    s = np.arange(n, dtype=np.float64)
    frac = np.clip((s - warmup) / (total - warmup), 0.0, 1.0)
    decay = floor + (peak - floor) * (np.cos(np.pi * frac) + 1.0) / 2.0
    return np.where(s < warmup, peak * (s + 1.0) / max(warmup, 1), decay)


@pytest.mark.parametrize("floor", [0.0, 3e-4])
def test_cosine_without_warmup(floor):
    peak, t = 3e-3, 40
    s = S.cosine(peak, t, floor=floor)
    got = values(s, 2 * t + 5)
    torch_ref = torch_lrs(lambda o, L: L.CosineAnnealingLR(o, T_max=t, eta_min=floor), 2 * t + 5, peak)
    assert_close(got[: t + 1], torch_ref[: t + 1], abs_=1e-15 * peak)
    assert got[0] == peak and got[t] == floor and (got[t:] == floor).all()
    assert torch_ref[2 * t] == pytest.approx(peak)  # torch's cosine is periodic past T_max; ours holds the floor
    assert_close(got, optax_values(optax_cosine_decay(peak, t, alpha=floor / peak), 2 * t + 5), abs_=1e-18)
    assert_close(got, _cosine_ref(peak, t, 0, floor, 2 * t + 5), abs_=1e-18)


@pytest.mark.parametrize("w,t", [(1, 10), (5, 40), (30, 300), (39, 40)])
def test_cosine_with_warmup(w, t):
    peak, floor, n = 3e-3, 3e-4, t + 10
    s = S.cosine(peak, t, warmup_steps=w, floor=floor)
    got = values(s, n)
    if w > 1:
        make = lambda o, L: L.SequentialLR(o, [L.LinearLR(o, 1 / w, 1.0, w - 1),  # noqa: E731
                                              L.CosineAnnealingLR(o, t - w, floor)], milestones=[w])
        assert_close(got[: t + 1], torch_lrs(make, t + 1, peak), abs_=1e-15 * peak)
    assert_close(got, _cosine_ref(peak, t, w, floor, n), abs_=1e-18)
    opt = optax_values(optax_warmup_cosine_decay(0.0, peak, w, t, floor), n + 1)
    assert_close(got[w:], opt[w:n], abs_=1e-18)  # the same from step W on ...
    assert_close(got[:w], opt[1 : w + 1], abs_=1e-18)  # ... and its warm-up one step behind
    assert s(w - 1) == peak and s(w) == peak and s(t) == floor and s(t + 1) == floor and s(10**12) == floor
    assert got[0] == peak / w


def test_cosine_is_what_the_warmup_example_used_before():
    """examples/warmup_clip_skip.py had its own lr_at; the schedule it uses now gives the same values (to an ulp:
    the floor is weighted instead of factored out)."""
    def lr_at(step, peak, warmup, total):
        if step < warmup:
            return peak * (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    for steps, warmup in [(300, 30), (100, 30), (31, 30)]:
        s = S.cosine(3e-3, steps, warmup_steps=warmup, floor=0.1 * 3e-3)
        ref = [lr_at(k, 3e-3, warmup, steps) for k in range(steps)]
        assert_close(values(s, steps), ref, rel=1e-15)
        assert [s(k) for k in range(warmup)] == ref[:warmup]  # the warm-up bit for bit


def _wsd_ref(peak, total, decay_steps, warmup, floor, shape, n):
    s = np.arange(n, dtype=np.float64)
    x = np.clip((s - (total - decay_steps)) / decay_steps, 0.0, 1.0)
    f = {"linear": 1.0 - x, "cosine": (1.0 + np.cos(np.pi * x)) / 2.0, "sqrt": 1.0 - np.sqrt(x)}[shape]
    out = floor + (peak - floor) * f
    return np.where(s < warmup, peak * (s + 1.0) / max(warmup, 1), out)


@pytest.mark.parametrize("decay", ["linear", "cosine", "sqrt"])
@pytest.mark.parametrize("w,t,d", [(10, 100, 20), (0, 50, 10), (5, 25, 20), (1, 30, 1)])
def test_wsd(decay, w, t, d):
    peak, floor, n = 1e-2, 1e-3, t + 10
    s = S.wsd(peak, t, decay_steps=d, warmup_steps=w, floor=floor, decay=decay)
    got = values(s, n)
    assert_close(got, _wsd_ref(peak, t, d, w, floor, decay, n), abs_=1e-18)
    assert s(t - d) == peak and s(t) == floor and s(t + 1) == floor and s(10**12) == floor
    if w:
        assert s(0) == peak / w and s(w - 1) == peak
    if t - d > w:
        assert s(w) == peak and s(t - d - 1) == peak
    # torch: warm-up, constant, then LinearLR / CosineAnnealingLR / LambdaLR(1 - sqrt) for the decay
    last = {"linear": lambda o, L: L.LinearLR(o, 1.0, floor / peak, d),
            "cosine": lambda o, L: L.CosineAnnealingLR(o, d, floor),
            "sqrt": lambda o, L: L.LambdaLR(o, lambda k: (floor + (peak - floor) * (1 - math.sqrt(min(k, d) / d)))
                                            / peak)}[decay]
    phases = []  # (scheduler, length); a 1-step warm-up is already peak at step 0: part of the constant phase
    if w > 1:
        phases.append((lambda o, L: L.LinearLR(o, 1 / w, 1.0, w - 1), w))
    if t - d > (w if w > 1 else 0):
        phases.append((lambda o, L: L.ConstantLR(o, factor=1.0, total_iters=0), t - d - (w if w > 1 else 0)))
    milestones = np.cumsum([n for _, n in phases]).tolist()
    phases.append((last, None))
    make = last if len(phases) == 1 else \
        lambda o, L: L.SequentialLR(o, [p(o, L) for p, _ in phases], milestones=milestones)  # noqa: E731
    assert_close(got[: t + 1], torch_lrs(make, t + 1, peak), abs_=1e-15 * peak)
    if decay == "linear":  # optax has no WSD; its join of linear pieces is the same from step W on
        opt = optax_join([optax_linear(0.0, peak, w), optax_constant(peak), optax_linear(peak, floor, d)],
                         [w, t - d])
        assert_close(got[w:], optax_values(opt, n)[w:], abs_=1e-18)


@pytest.mark.parametrize("w", [1, 4, 4000])
def test_inverse_sqrt(w):
    """Vaswani et al. 2017, eq. (3): lrate = d_model^-0.5 · min(step_num^-0.5, step_num · warmup_steps^-1.5), with
    step_num = s + 1 and peak = (d_model · W)^-0.5."""
    d_model, n = 512, 3 * w + 50
    peak = (d_model * w) ** -0.5
    s = S.inverse_sqrt(peak, w)
    got = values(s, n)
    num = np.arange(1, n + 1, dtype=np.float64)
    assert_close(got, d_model**-0.5 * np.minimum(num**-0.5, num * float(w) ** -1.5))
    # torch has no built-in (LambdaLR: this checks the step convention only)
    make = lambda o, L: L.LambdaLR(o, lambda k: min((k + 1) / w, (w / (k + 1)) ** 0.5))  # noqa: E731
    assert_close(got, torch_lrs(make, n, peak))
    assert s(w - 1) == pytest.approx(peak, rel=1e-15) and got.argmax() == w - 1
    assert s(4 * w - 1) == pytest.approx(peak / 2, rel=1e-15) and s(0) == pytest.approx(peak / w, rel=1e-15)
    assert 0 < s(10**12) < s(10**6)


def test_piecewise_constant():
    vals, bounds, n = [1e-2, 1e-3, 1e-4], [10, 25], 40
    s = S.piecewise_constant(vals, bounds)
    got = values(s, n)
    assert_close(got, np.array(vals)[np.searchsorted(bounds, np.arange(n), side="right")])
    gamma = 0.1
    assert_close(values(S.piecewise_constant([1e-2, 1e-2 * gamma, 1e-2 * gamma**2], bounds), n),
                 torch_lrs(lambda o, L: L.MultiStepLR(o, bounds, gamma), n, 1e-2))
    assert_close(values(S.piecewise_constant([0.25 * 1e-2, 1e-2], [7]), 20),
                 torch_lrs(lambda o, L: L.ConstantLR(o, factor=0.25, total_iters=7), 20, 1e-2))
    opt = optax_piecewise_constant(vals[0], {10: vals[1] / vals[0], 25: vals[2] / vals[1]})
    assert_close(got, optax_values(opt, n))
    assert s(0) == vals[0] and s(9) == vals[0] and s(10) == vals[1] and s(25) == vals[2] and s(10**12) == vals[2]
    assert S.piecewise_constant([5e-3], [])(100) == 5e-3
    assert S.piecewise_constant(np.array([2.0, 1.0]), np.array([3]))(3) == 1.0


def test_join_restarts_each_piece_at_its_boundary():
    peak, w, d, n = 1e-2, 5, 20, 40
    s = S.join([S.linear_warmup(peak, w), S.polynomial(peak, 0.0, d, 2.0)], [w])
    got = values(s, n)
    make = lambda o, L: L.SequentialLR(o, [L.LinearLR(o, 1 / w, 1.0, w - 1),  # noqa: E731
                                          L.PolynomialLR(o, total_iters=d, power=2.0)], milestones=[w])
    assert_close(got, torch_lrs(make, n, peak), abs_=1e-15 * peak)
    opt = optax_join([lambda c: optax_linear(0.0, peak, w)(c + 1), optax_polynomial(peak, 0.0, 2.0, d)], [w])
    assert_close(got, optax_values(opt, n))
    three = S.join([S.constant(1.0), S.linear(2.0, 0.0, 4), S.constant(3.0)], [2, 10])
    assert [three(k) for k in range(12)] == [1.0, 1.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0]
    nested = S.join([three, S.constant(9.0)], [11])
    assert [nested(k) for k in (0, 2, 10, 11, 10**9)] == [1.0, 2.0, 3.0, 9.0, 9.0]
    user = S.join([S.Schedule(lambda k: 1.0 / (k + 1)), S.constant(0.0)], [3])
    assert [user(k) for k in range(4)] == [1.0, 0.5, 1 / 3, 0.0]


def test_multiply_by_a_constant():
    base = S.cosine(1e-2, 30, warmup_steps=3, floor=1e-3)
    for scaled in (0.5 * base, base * 0.5, np.float64(0.5) * base, base * np.float32(0.5)):
        assert isinstance(scaled, S.Schedule)
        assert [scaled(k) for k in range(40)] == [0.5 * base(k) for k in range(40)]
    make = lambda o, L: L.SequentialLR(o, [L.LinearLR(o, 1 / 3, 1.0, 2),  # noqa: E731
                                          L.CosineAnnealingLR(o, 27, 0.5e-3)], milestones=[3])
    assert_close(values(0.5 * base, 31), torch_lrs(make, 31, 0.5e-2), abs_=1e-18)
    assert (0 * base)(5) == 0.0
    assert [(2 * (3 * base))(k) for k in range(5)] == [2 * (3 * base(k)) for k in range(5)]


def test_pure_function_of_the_step():
    s = S.wsd(1e-2, 100, decay_steps=20, warmup_steps=10, floor=1e-3, decay="cosine")
    forward = [s(k) for k in range(120)]
    order = np.random.default_rng(0).permutation(120)
    assert [s(int(k)) for k in order] == [forward[k] for k in order]
    assert s(np.int64(95)) == forward[95] and s(np.array(95)) == forward[95]
    assert all(type(v) is float for v in forward)


def test_exported_and_documented():
    assert flatopt.schedules is S and "schedules" in flatopt.__all__
    for name in S.__all__:
        assert getattr(S, name).__doc__, name
    assert "set_lr(sched(step))" in S.__doc__
    assert repr(S.cosine(1.0, 10, warmup_steps=2)) == "cosine(1.0, total_steps=10, warmup_steps=2, floor=0.0)"


BAD = [
    (lambda: S.constant(float("nan")), ValueError, "constant: value must be finite"),
    (lambda: S.constant(-1e-3), ValueError, "constant: value must be finite and >= 0"),
    (lambda: S.constant("1e-3"), TypeError, "constant: value must be a real number"),
    (lambda: S.constant(True), TypeError, "constant: value must be a real number"),
    (lambda: S.linear_warmup(math.inf, 10), ValueError, "linear_warmup: peak must be finite"),
    (lambda: S.linear_warmup(1e-3, 0), ValueError, "linear_warmup: warmup_steps must be >= 1"),
    (lambda: S.linear_warmup(1e-3, 2.0), TypeError, "linear_warmup: warmup_steps must be an int"),
    (lambda: S.linear(1e-3, -1e-3, 10), ValueError, "linear: end must be finite and >= 0"),
    (lambda: S.linear(1e-3, 0.0, 0), ValueError, "linear: steps must be >= 1"),
    (lambda: S.polynomial(1e-3, 0.0, 10, 0.0), ValueError, "polynomial: power must be finite and > 0"),
    (lambda: S.polynomial(1e-3, 0.0, 10, math.nan), ValueError, "polynomial: power must be finite"),
    (lambda: S.cosine(1e-3, 0), ValueError, "cosine: total_steps must be >= 1"),
    (lambda: S.cosine(1e-3, 10, warmup_steps=10), ValueError, "cosine: warmup_steps must be < total_steps=10"),
    (lambda: S.cosine(1e-3, 10, warmup_steps=-1), ValueError, "cosine: warmup_steps must be >= 0"),
    (lambda: S.cosine(1e-3, 10, floor=2e-3), ValueError, "cosine: floor must be finite and >= 0 and <= peak"),
    (lambda: S.cosine(1e-3, 10, floor=-math.inf), ValueError, "cosine: floor must be finite"),
    (lambda: S.wsd(1e-3, 100), TypeError, "decay_steps"),
    (lambda: S.wsd(1e-3, 100, decay_steps=0), ValueError, "wsd: decay_steps must be >= 1"),
    (lambda: S.wsd(1e-3, 100, decay_steps=60, warmup_steps=50), ValueError,
     "wsd: warmup_steps + decay_steps must be <= total_steps=100"),
    (lambda: S.wsd(1e-3, 100, decay_steps=10, decay="exp"), ValueError, "wsd: decay must be one of"),
    (lambda: S.wsd(1e-3, 100, decay_steps=10, floor=1.0), ValueError, "wsd: floor must be finite and >= 0 and <="),
    (lambda: S.inverse_sqrt(1e-3, 0), ValueError, "inverse_sqrt: warmup_steps must be >= 1"),
    (lambda: S.inverse_sqrt(1e300 * 1e300, 5), ValueError, "inverse_sqrt: peak must be finite"),
    (lambda: S.piecewise_constant([1e-3, 1e-4], []), ValueError, "one boundary fewer than pieces"),
    (lambda: S.piecewise_constant([1e-3, 1e-4], [0]), ValueError, "piecewise_constant: boundaries[0] must be >= 1"),
    (lambda: S.piecewise_constant([1, 2, 3], [5, 5]), ValueError, "boundaries must be strictly increasing"),
    (lambda: S.piecewise_constant([1, math.nan], [5]), ValueError, "piecewise_constant: values[1] must be finite"),
    (lambda: S.piecewise_constant({5: 0.1}, [5]), TypeError, "piecewise_constant: values must be a list or tuple"),
    (lambda: S.piecewise_constant(1e-3, [5]), TypeError, "piecewise_constant: values must be a list or tuple"),
    (lambda: S.join([S.constant(1.0), lambda k: 0.5], [3]), TypeError, "join: schedules[1] must be a Schedule"),
    (lambda: S.join([S.constant(1.0), S.constant(0.5)], [2, 3]), ValueError, "one boundary fewer than pieces"),
    (lambda: S.join([S.constant(1.0), S.constant(0.5)], [1.5]), TypeError, "join: boundaries[0] must be an int"),
    (lambda: S.constant(1.0) * math.inf, ValueError, "factor must be finite"),
    (lambda: S.constant(1.0) * -2, ValueError, "factor must be finite and >= 0"),
    (lambda: S.constant(1.0) * S.constant(2.0), TypeError, "factor must be a real number"),
    (lambda: S.Schedule(3.0), TypeError, "Schedule: fn must be callable"),
]


@pytest.mark.parametrize("make,exc,msg", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_arguments_are_rejected_by_name(make, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        make()


@pytest.mark.parametrize("step,exc", [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("3", TypeError),
                                      (None, TypeError), (np.float64(2), TypeError)])
def test_bad_steps(step, exc):
    s = S.cosine(1e-3, 10)
    with pytest.raises(exc, match=r"cosine\(.*\): step must be an int >= 0"):
        s(step)


def test_a_wrapped_function_is_checked_at_each_call():
    s = S.Schedule(lambda k: 1.0 if k < 3 else math.nan, "mine")
    assert s(2) == 1.0
    with pytest.raises(ValueError, match="mine: step 3 gives lr nan"):
        s(3)
    with pytest.raises(ValueError, match="step 0 gives lr -1.0"):
        S.Schedule(lambda k: -1.0)(0)


def test_set_lr_pattern():
    """The documented one line: opt.set_lr(sched(step)) before each step; the optimizer reads it back."""
    sched = S.cosine(1e-2, 20, warmup_steps=4, floor=1e-3)
    opt = flatopt.AdamW(lr=1.0, weight_decay=0.0)
    w, g = np.zeros(3), np.ones(3)
    for step in range(20):
        opt.set_lr(sched(step))
        assert opt.lr == sched(step)
        opt.step("w", (3,), w, g)
        opt.end_iteration()

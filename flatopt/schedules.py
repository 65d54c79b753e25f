"""Learning-rate schedules: pure functions of the step, in float64, for ``set_lr``.

    from flatopt import schedules
    sched = schedules.cosine(3e-3, total_steps=10_000, warmup_steps=500, floor=3e-4)
    for step in range(10_000):
        ...                                   # gradients
        opt.set_lr(sched(step))               # the one line
        opt.step_batch(items)
        opt.end_iteration()

``schedule(step) -> float``: ``step`` is the number of updates made before this one (0 for the first), an int
≥ 0, and the result depends on nothing else (no state: resuming a run needs only its step count, e.g.
``opt.iteration``). That is the ``count`` optax passes to a schedule, and the ``last_epoch`` of a torch
``lr_scheduler`` when ``get_last_lr()`` is read before ``optimizer.step()`` (scheduler stepped after it, as torch
documents). Every schedule validates its arguments at construction (a ``TypeError``/``ValueError`` naming the
argument; non-finite values, negative learning rates and a floor above the peak are rejected).

Schedules compose: ``join(schedules, boundaries)`` runs one after the other, each restarted at its boundary (as
optax's ``join_schedules`` and torch's ``SequentialLR``), and ``c * schedule`` scales one by a constant.
``Schedule(fn)`` wraps a function of your own so that it composes too.

Warm-ups here make the first update move: ``linear_warmup(peak, W)`` gives ``peak·(s+1)/W`` at step s, so peak is
reached at step W−1. optax's warm-ups start from ``init_value`` (commonly 0) and reach peak at step W: with
``init_value=0`` their value at step s+1 is ours at step s, and their first update has lr 0. torch's
``LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1)`` gives the same values (to rounding: torch multiplies
the last lr step by step).
"""

from __future__ import annotations

import bisect
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "Schedule",
    "constant",
    "cosine",
    "inverse_sqrt",
    "join",
    "linear",
    "linear_warmup",
    "piecewise_constant",
    "polynomial",
    "wsd",
]


class Schedule:
    """A learning-rate schedule: ``schedule(step) -> float`` for an int step ≥ 0; ``c * schedule`` scales it.

    ``Schedule(fn)`` wraps a pure function of the step; each call checks the step and that the value is a finite
    float ≥ 0 (an error names the step otherwise)."""

    __slots__ = ("_fn", "_desc")
    __array_ufunc__ = None  # np.float64(2) * schedule: NumPy defers to __rmul__

    def __init__(self, fn: Callable[[int], float], desc: str | None = None):
        if not callable(fn):
            raise TypeError(f"Schedule: fn must be callable, got {fn!r}")
        self._fn = fn
        self._desc = desc if desc is not None else f"Schedule({fn!r})"

    def __call__(self, step: int) -> float:
        value = float(self._fn(_step(self._desc, step)))
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{self._desc}: step {step!r} gives lr {value!r} (must be finite and >= 0)")
        return value

    def __mul__(self, factor: float) -> Schedule:
        c = _real("Schedule * factor", "factor", factor)
        fn = self._fn
        return Schedule(lambda s: c * fn(s), f"{c!r} * {self._desc}")

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return self._desc


def constant(value: float) -> Schedule:
    """``value`` at every step. torch: no scheduler (or ``ConstantLR(factor=1.0)``); optax:
    ``constant_schedule(value)``."""
    v = _real("constant", "value", value)
    return Schedule(lambda s: v, f"constant({v!r})")


def linear_warmup(peak: float, warmup_steps: int) -> Schedule:
    """``peak · min(s + 1, W) / W``: from peak/W at step 0 up to ``peak`` at step W−1, then ``peak``.

    torch: ``LinearLR(start_factor=1/W, end_factor=1.0, total_iters=W-1)`` with base lr ``peak``. optax:
    ``linear_schedule(0, peak, W)`` (= ``warmup_constant_schedule(0, peak, W)``) is one step behind: its value
    at step s+1 is this schedule's at step s (the module doc says why)."""
    p = _real("linear_warmup", "peak", peak)
    w = _count("linear_warmup", "warmup_steps", warmup_steps, 1)
    return Schedule(lambda s: p * min(s + 1, w) / w, f"linear_warmup({p!r}, {w})")


def linear(start: float, end: float, steps: int) -> Schedule:
    """``start`` at step 0 to ``end`` at step ``steps`` in a straight line, then ``end``:
    ``(start − end)·(1 − min(s, T)/T) + end``, either direction.

    optax: ``linear_schedule(start, end, T)``, the same up to rounding (here both ends are exact). torch: ``LinearLR(start_factor=start/base,
    end_factor=end/base, total_iters=T)`` with base lr ``base`` (torch needs start > 0 and both ≤ base)."""
    return _polynomial("linear", start, end, steps, 1.0)


def polynomial(start: float, end: float, steps: int, power: float = 1.0) -> Schedule:
    """``(start − end)·(1 − min(s, T)/T)^power + end``: ``start`` at step 0 to ``end`` at step T, then ``end``.

    optax: ``polynomial_schedule(start, end, power, T)``, the same up to rounding (here both ends are exact). torch: ``PolynomialLR(total_iters=T,
    power=power)`` with base lr ``start`` is the case ``end = 0``."""
    return _polynomial("polynomial", start, end, steps, power)


def cosine(peak: float, total_steps: int, *, warmup_steps: int = 0, floor: float = 0.0) -> Schedule:
    """Linear warm-up (as ``linear_warmup``) over W steps, then a half cosine from ``peak`` at step W down to
    ``floor`` at step T = ``total_steps``, then ``floor``::

        s < W:       peak · (s + 1) / W
        W ≤ s:       peak · u + floor · (1 − u),  u = ½(1 + cos(π · min(s − W, T − W) / (T − W)))

    torch: ``CosineAnnealingLR(T_max=T, eta_min=floor)`` without a warm-up (torch's keeps going past T, back up
    to ``peak`` at 2T; this one stays at ``floor``); with one, ``SequentialLR([LinearLR(1/W, 1.0, W-1),
    CosineAnnealingLR(T-W, floor)], milestones=[W])``. optax: ``cosine_decay_schedule(peak, T,
    alpha=floor/peak)`` without a warm-up; with one, ``warmup_cosine_decay_schedule(0, peak, W, T, floor)`` for
    s ≥ W (its warm-up is one step behind: module doc)."""
    p = _real("cosine", "peak", peak)
    t = _count("cosine", "total_steps", total_steps, 1)
    w = _count("cosine", "warmup_steps", warmup_steps, 0)
    if w >= t:
        raise ValueError(f"cosine: warmup_steps must be < total_steps={t}, got {warmup_steps!r}")
    f = _real("cosine", "floor", floor, peak=p)
    desc = f"cosine({p!r}, total_steps={t}, warmup_steps={w}, floor={f!r})"
    return _warmup_stable_decay(desc, p, w, w, t - w, f, _cosine)


def wsd(peak: float, total_steps: int, *, decay_steps: int, warmup_steps: int = 0, floor: float = 0.0,
        decay: str = "linear") -> Schedule:
    """Warmup-stable-decay (MiniCPM; Hägele et al. 2024): linear warm-up (as ``linear_warmup``) over W steps,
    ``peak`` until step T − D, then down to ``floor`` at step T = ``total_steps`` over D = ``decay_steps``, then
    ``floor``; the decay shape is ``"linear"``, ``"cosine"`` or ``"sqrt"`` (1 − √x, Hägele et al.'s best)::

        s < W:           peak · (s + 1) / W
        W ≤ s < T − D:   peak
        T − D ≤ s:       peak · u + floor · (1 − u),  u = shape(min(s − (T − D), D) / D)
        shape(x) = 1 − x  |  ½(1 + cos(πx))  |  1 − √x

    torch: ``SequentialLR([LinearLR(1/W, 1.0, W-1), ConstantLR(factor=1.0), LinearLR(1.0, floor/peak, D)],
    milestones=[W, T-D])`` for the linear decay, ``CosineAnnealingLR(D, floor)`` as the last for the cosine one,
    a ``LambdaLR`` for 1 − √x. optax has no WSD schedule: ``join_schedules([linear_schedule(0, peak, W),
    constant_schedule(peak), linear_schedule(peak, floor, D)], [W, T-D])`` is the same from step W on."""
    p = _real("wsd", "peak", peak)
    t = _count("wsd", "total_steps", total_steps, 1)
    d = _count("wsd", "decay_steps", decay_steps, 1)
    w = _count("wsd", "warmup_steps", warmup_steps, 0)
    if w + d > t:
        raise ValueError(f"wsd: warmup_steps + decay_steps must be <= total_steps={t}, got {w} + {d}")
    f = _real("wsd", "floor", floor, peak=p)
    if decay not in _SHAPES:
        raise ValueError(f"wsd: decay must be one of {sorted(_SHAPES)}, got {decay!r}")
    desc = f"wsd({p!r}, total_steps={t}, decay_steps={d}, warmup_steps={w}, floor={f!r}, decay={decay!r})"
    return _warmup_stable_decay(desc, p, w, t - d, d, f, _SHAPES[decay])


def inverse_sqrt(peak: float, warmup_steps: int) -> Schedule:
    """The Transformer's schedule (Vaswani et al. 2017, with step_num n = s + 1) scaled to reach ``peak``::

        peak · min(n / W, √(W / n))

    a linear warm-up (as ``linear_warmup``) to ``peak`` at step W−1, then ∝ 1/√n; ``warmup_steps=1`` is
    ``peak/√n`` from the start. Vaswani's ``d_model^-0.5 · min(n^-0.5, n·W^-1.5)`` is ``peak = (d_model·W)^-0.5``.
    torch and optax have no built-in: ``LambdaLR(lambda s: min((s+1)/W, (W/(s+1))**0.5))`` with base lr
    ``peak``."""
    p = _real("inverse_sqrt", "peak", peak)
    w = _count("inverse_sqrt", "warmup_steps", warmup_steps, 1)
    return Schedule(lambda s: p * min((s + 1) / w, math.sqrt(w / (s + 1))), f"inverse_sqrt({p!r}, {w})")


def piecewise_constant(values: Sequence[float], boundaries: Sequence[int]) -> Schedule:
    """``values[i]`` for ``boundaries[i-1] ≤ s < boundaries[i]`` (``values[0]`` before the first boundary, the
    last value from the last boundary on); boundaries strictly increasing ints ≥ 1, one fewer than values.

    torch: ``MultiStepLR(milestones=boundaries, gamma)`` is ``values = [base·gamma^i]``, ``ConstantLR(factor,
    total_iters=k)`` is ``piecewise_constant([factor·base, base], [k])``. optax: ``piecewise_constant_schedule(
    values[0], {b_i: values[i+1]/values[i]})``, whose scales multiply from the boundary step on, as here."""
    raw = _seq("piecewise_constant", "values", values)
    vals = [_real("piecewise_constant", f"values[{i}]", v) for i, v in enumerate(raw)]
    bounds = _boundaries("piecewise_constant", boundaries, len(vals))
    return Schedule(lambda s: vals[bisect.bisect_right(bounds, s)], f"piecewise_constant({vals!r}, {bounds!r})")


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i-1]`` on, called with the steps since that boundary
    (``schedules[i](s − boundaries[i-1])``); boundaries strictly increasing ints ≥ 1, one fewer than schedules.

    optax: ``join_schedules(schedules, boundaries)``; torch: ``SequentialLR(schedulers, milestones=boundaries)``."""
    scheds: list[Schedule] = []
    for i, sc in enumerate(_seq("join", "schedules", schedules)):
        if not isinstance(sc, Schedule):
            raise TypeError(f"join: schedules[{i}] must be a Schedule (wrap a function in Schedule(fn)), got {sc!r}")
        scheds.append(sc)
    bounds = _boundaries("join", boundaries, len(scheds))
    starts = [0, *bounds]
    fns = [sc._fn for sc in scheds]

    def fn(s: int) -> float:
        i = bisect.bisect_right(bounds, s)
        return fns[i](s - starts[i])

    return Schedule(fn, f"join({scheds!r}, {bounds!r})")


# ---- the shared bodies and the argument checks ----

def _cosine(x: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * x))


_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda x: 1.0 - x,
    "cosine": _cosine,
    "sqrt": lambda x: 1.0 - math.sqrt(x),
}


def _warmup_stable_decay(desc: str, peak: float, warmup: int, decay_start: int, decay_steps: int, floor: float,
                         shape: Callable[[float], float]) -> Schedule:
    def fn(s: int) -> float:
        if s < warmup:
            return peak * (s + 1) / warmup
        if s < decay_start:
            return peak
        u = shape(min(s - decay_start, decay_steps) / decay_steps)  # 1 -> 0, both ends exact
        return peak * u + floor * (1.0 - u)

    return Schedule(fn, desc)


def _polynomial(owner: str, start: float, end: float, steps: int, power: float) -> Schedule:
    a = _real(owner, "start", start)
    b = _real(owner, "end", end)
    t = _count(owner, "steps", steps, 1)
    k = _real(owner, "power", power, lo_open=True)
    desc = f"{owner}({a!r}, {b!r}, {t})" if owner == "linear" else f"{owner}({a!r}, {b!r}, {t}, power={k!r})"

    def fn(s: int) -> float:
        u: float = (1.0 - min(s, t) / t) ** k  # 1 -> 0: start and end exactly at steps 0 and T
        return a * u + b * (1.0 - u)

    return Schedule(fn, desc)


def _real(owner: str, name: str, value: object, *, peak: float | None = None, lo_open: bool = False) -> float:
    """A finite real ≥ 0 (> 0 where ``lo_open``), and ≤ ``peak`` when one is given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and (v > 0.0 if lo_open else v >= 0.0) and (peak is None or v <= peak)):
        what = "> 0" if lo_open else ">= 0"
        what += "" if peak is None else f" and <= peak ({peak!r})"
        raise ValueError(f"{owner}: {name} must be finite and {what}, got {value!r}")
    return v


def _count(owner: str, name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < lo:
        raise ValueError(f"{owner}: {name} must be >= {lo}, got {value!r}")
    return int(value)


def _seq(owner: str, name: str, value: object) -> list[object]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{owner}: {name} must be a list or tuple, got {value!r}")
    return list(value)


def _step(owner: str, step: Any) -> int:
    msg = f"{owner}: step must be an int >= 0, got {step!r}"
    try:
        s = operator.index(step)
    except TypeError:
        raise TypeError(msg) from None
    if isinstance(step, bool):
        raise TypeError(msg)
    if s < 0:
        raise ValueError(msg)
    return s


def _boundaries(owner: str, boundaries: object, n_pieces: int) -> list[int]:
    bounds = [_count(owner, f"boundaries[{i}]", b, 1) for i, b in enumerate(_seq(owner, "boundaries", boundaries))]
    if len(bounds) != n_pieces - 1:
        raise ValueError(f"{owner}: needs one boundary fewer than pieces, got {n_pieces} pieces and "
                         f"{len(bounds)} boundaries")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{owner}: boundaries must be strictly increasing, got {bounds!r}")
    return bounds

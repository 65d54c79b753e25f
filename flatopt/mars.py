"""Mars: variance-reduced AdamW (Yuan et al. 2024, official MARS-AdamW, approximate mode) — pytorch-optimizer
``MARS(mars_type="adamw", optimize_1d=True)``.

Update rule, per tensor, with t the step count of this parameter and η = lr · lr_scale(name)::

    c  = g + (g − g_prev)·(γ·β1/(1 − β1))               (g_prev starts at 0: c_1 = 1.475·g at the defaults)
    c  = c / max(‖c‖₂, 1)                                (clip_c: "if ‖c‖ > 1, c/‖c‖", with no host branch)
    m  = m + (1 − β1)·(c − m);   v = β2·v + (1 − β2)·c²
    p  = p · (1 − η·λ)                                   (decoupled decay)
    u  = m;  with cautious: u = m·(mask·((1/(Σ mask + 1))·numel)),  mask = (m·g > 0)   (the new m: after the clip)
    p  = p + (u / (√v/√(1 − β2^t) + ε))·(−η/(1 − β1^t))  (= p − η·û/(√v̂ + ε))
    g_prev = g

The step is one definition (``step`` below, ``core/elementwise``): with clip_c, ‖c‖² is an ``e.sumsq`` sum over the
tensor, added in the fixed blocked order of ``core/sqsum.py`` (the same bits on NumPy, the compiled pass and CUDA),
and max(‖c‖, 1) is its fold, a device value on CuPy.  ``cautious=True`` (Liang et al. 2024, docs/algorithms.md):
pytorch-optimizer's ``MARS(cautious=True)``: its ``apply_cautious`` masks the new m (after the clip) against the raw
g before the division, times numel/(count + 1) per tensor; with clip_c m follows ‖c‖, so the count (and numel, both
sums) is a second reduction level after it (``core/elementwise/reduce.py``).
Defaults lr 3e-3 (official), betas (0.95, 0.99), eps 1e-8, weight_decay 0, gamma 0.025, clip_c True (rlx-optim's).

Deviations: flatopt applies MARS to every tensor, as rlx-optim does; the official default ``optimize_1d=False``
sends non-2-D tensors to a separate AdamW (betas (0.9, 0.95), λ 0.1): route those with ``flatopt.routing.Router``.
pytorch-optimizer adds ε (and 1e-15 inside the root) before dividing by √(1 − β2^t): 1.2e-6 from the official rule
at ε = 1e-8 (so the conformance test runs it at ε = 1e-12, and checks ε = 1e-8 against a float64 transcription of
the official ``update_fn``); the same holds with ``cautious``, tested against ``MARS(cautious=True)``.  mars-lion,
mars-shampoo and the exact two-gradient mode are not offered.

Paths, all derived from ``step`` (``core/elementwise/reduce.py``): with clip_c a reduce phase (c made, c² into the
sum; nothing written), the fold into max(‖c‖, 1); with cautious then a second level (c and m made again with the
first fold, the mask and 1 − mask into two sums; nothing written) and its fold into (1/(count + 1))·numel; a map (c
made again, divided, the moments, the step, g_prev).  Cautious alone is one level (its reduce phase writes m);
neither, the plain elementwise step.  GPU (``kernels/generated/mars.cu``): per tensor, each level's partials and fold
then the map: five launches with clip_c and cautious, three with one of them, else one; no atomics, no host
synchronisation; ``step_batch`` runs every tensor of one dtype and step count in as many launches
(``core/multi_tensor.py``).  NumPy (``core/cpu_tensors.py``): a tensor's sweeps run on the threads (in phases around
each fold), each piece one compiled pass where a C compiler exists (``kernels/generated/elementwise.c``); small
tensors of one size are updated together as the rows of (T, n) arrays by NumPy ufuncs, which, like CuPy's
whole-tensor twin, keep c from the reduce phase for the later parts (the carry form, where it saves operations:
``core/elementwise/reduce.py``).
``end_iteration`` only counts iterations.  State: ``m``, ``v``, ``g_prev`` (12 B/param in float32) plus the unsaved
``work`` (the sum's work area, or the kernels' partials).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .adam import bias_corrections, check_bool, check_common
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class MarsConfig(Cautious):
    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.0
    gamma: float = 0.025
    clip_c: bool = True

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Mars", self)
        check_range("Mars", "gamma", self.gamma, 0.0, math.inf)
        check_bool("Mars", "clip_c", self.clip_c)


def scalars(cfg: MarsConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced)."""
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return dict(coef=cfg.gamma * b1 / (1.0 - b1), omb1=1.0 - b1, b2=b2, omb2=1.0 - b2,
                decay=1.0 - lr * cfg.weight_decay, bc2_sqrt=bc2 ** 0.5, eps=cfg.eps, neg_step=-(lr / bc1))


def flags(cfg: MarsConfig, t: int) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0, clip=cfg.clip_c)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, g_prev: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """One element of Mars's step; with clip_c, ‖c‖ is a sum over the tensor (``core/elementwise/reduce.py``), and
    with cautious the mask's count a second one, after it (m follows the clip)."""
    c = g + (g - g_prev) * s.coef
    if f.clip:
        c = c / e.maximum(e.sqrt(e.sumsq(c)), 1)
    m = m + (c - m) * s.omb1
    v = v * s.b2 + (c * s.omb2) * c
    if f.wd:
        p = p * s.decay
    p = p + (e.cautious(m, g) / (e.sqrt(v) / s.bc2_sqrt + s.eps)) * s.neg_step  # the mask of m, as the reference
    return dict(p=p, m=m, v=v, g_prev=g)


DEF = define("mars", step, scalars=scalars, flags=flags, flag_names=("wd", "clip"), slots=("m", "v", "g_prev"),
             example=MarsConfig())
_D = MarsConfig  # the constructor's defaults: written once, in the config


class Mars(ElementwiseOptimizer, definition=DEF):  # clip_c sums: the reduce-then-map forms (run.py)
    """``Mars(...)``: see the module doc."""

    def __init__(self, lr: float = _D.lr, betas: tuple[float, float] = _D.betas, eps: float = _D.eps,
                 weight_decay: float = _D.weight_decay, gamma: float = _D.gamma, clip_c: bool = _D.clip_c, *,
                 cautious: bool = _D.cautious, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(MarsConfig(lr, betas, eps, weight_decay, gamma, clip_c, cautious=cautious),
                         lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)

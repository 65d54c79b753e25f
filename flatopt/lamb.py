"""Lamb: Adam's direction plus λθ, scaled per tensor by the trust ratio ‖θ‖/‖u‖ (You et al. 2020) — optax ``lamb``.

Update rule, per tensor, with t the step count of this parameter and η = lr · lr_scale(name)::

    m  = m + (1 − β1)·(g − m);   v = β2·v + (1 − β2)·g²
    u  = (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε) + λ·p      (λθ inside the update: "in-update" decay)
    φ  = ‖p‖₂,  ψ = ‖u‖₂  (both before the step);   r = φ/ψ if φ > 0 and ψ > 0, else 1
    p  = p + u·(−η·r)

There is no clamp on φ (φ(z) = z).  The step is one definition (``step`` below, ``core/elementwise``): φ² and ψ²
are ``e.sumsq`` sums over the tensor, added in the fixed blocked order of ``core/sqsum.py`` (the same bits on
NumPy, the compiled pass and CUDA), and r·(−η) is their fold, computed once per tensor in the dtype, a device value
on CuPy (no host synchronisation).  Defaults lr 1e-3 and weight_decay 1e-2 (flatopt AdamW's), betas (0.9, 0.999),
eps 1e-6 (rlx-optim's).

Deviations: none from the paper's Algorithm 2 with bias correction (optax, TF-addons, NVIDIA, rlx-optim);
rlx-optim's ``bias_correction`` switch is not exposed (always on).  A non-finite norm gives r = 1 (optax's ratio
would be NaN and poison the whole tensor; here only the non-finite elements are).  optax raises β to the power t in
float32 (~7e-6 away at β2 = 0.999); flatopt uses float64.  Not pytorch-optimizer's ``Lamb``, another algorithm (no
bias correction, decay outside the ratio, ‖θ‖ clamped at 10, ε on ψ).  The conformance tests compare with a float64
transcription of optax's chain (optax/jax are not installed in CI).

Paths, all derived from ``step`` (``core/elementwise/reduce.py``): a reduce phase (the moments, written; u, p² and
u² into the sums), the fold into r·(−η), a map (u made again from the new m, v and p; p updated).  GPU
(``kernels/generated/lamb.cu``): three launches per tensor (partials, fold, map; no atomics, no host
synchronisation), and ``step_batch`` runs every tensor of one dtype and step count in three launches
(``core/multi_tensor.py``).  NumPy (``core/cpu_tensors.py``): a large tensor's phases run on the threads (column
ranges of the reduce phase, then chunk ranges of the map), each piece one compiled pass where a C compiler exists
(``kernels/generated/elementwise.c``); small tensors of one size are updated together as the rows of (T, n) arrays
by NumPy ufuncs, which, like CuPy's whole-tensor twin, keep u from the reduce phase for the map (the carry form,
where it saves operations: ``core/elementwise/reduce.py``).
``end_iteration`` only counts iterations.  State: ``m``, ``v`` (8 B/param in float32) plus the unsaved ``work`` (the
sums' work area, or the kernels' partials).
``cautious=True``: the final update r·u masked where it disagrees in sign with g, times numel/(count + 1) per tensor,
as pytorch-optimizer's ``apply_cautious`` would take it (its own ``Lamb`` has no such option); the ratio r is
positive, so the mask is u's (u·g > 0, but where a product underflows) and ψ is the norm of the unmasked u: the
mask's count is a sum of the same reduce phase as φ² and ψ², so a step stays three launches (docs/algorithms.md,
cautious).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .adam import bias_corrections, check_common, decay_flag
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import normalize_numbers


@dataclasses.dataclass(frozen=True)
class LambConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Lamb", self)


def scalars(cfg: LambConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return dict(omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc1=bc1, bc2=bc2, eps=cfg.eps, wd=cfg.weight_decay,
                neg_lr=-lr)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """One element of Lamb's step; the two norms are sums over the tensor (``core/elementwise/reduce.py``)."""
    m = m + (g - m) * s.omb1
    v = v * s.b2 + (g * s.omb2) * g
    u = (m / s.bc1) / (e.sqrt(v / s.bc2) + s.eps)
    if f.wd:
        u = u + p * s.wd
    phi = e.sqrt(e.sumsq(p))
    psi = e.sqrt(e.sumsq(u))
    r = e.where((phi > 0) & (psi > 0), phi / psi, 1)
    p = p + e.cautious(u, g) * (r * s.neg_lr)  # masked after the ratio: r > 0, the mask of r·u is u's
    return dict(p=p, m=m, v=v)


DEF = define("lamb", step, scalars=scalars, flags=decay_flag, flag_names=("wd",), slots=("m", "v"), example=LambConfig())
_D = LambConfig  # the constructor's defaults: written once, in the config


class Lamb(ElementwiseOptimizer, definition=DEF):  # every flag set sums: the reduce-then-map forms (run.py)
    """``Lamb(...)``: see the module doc."""

    def __init__(self, lr: float = _D.lr, betas: tuple[float, float] = _D.betas, eps: float = _D.eps,
                 weight_decay: float = _D.weight_decay, *, cautious: bool = _D.cautious, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(LambConfig(lr, betas, eps, weight_decay, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

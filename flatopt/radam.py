"""RAdam: rectified Adam (Liu et al. 2020) — ``torch.optim.RAdam`` semantics, threshold exposed.

Update rule, per element, with t the step count of this parameter and η = lr · lr_scale(name)::

    decay: g' = g + λ·p (L2, default)   or, with decoupled_weight_decay, p = p · (1 − η·λ) and g' = g
    m  = m + (1 − β1)·(g' − m);   v = β2·v + (1 − β2)·g'²
    b1 = 1 − β1^t;  b2 = 1 − β2^t;  ρ∞ = 2/(1 − β2) − 1;  ρ_t = ρ∞ − 2t·β2^t/b2          (host float64)
    ρ_t > threshold:  r = √((ρ_t−4)(ρ_t−2)ρ∞ / ((ρ∞−4)(ρ∞−2)ρ_t))
                      p = p + (m / (√v + ε))·(−η·r·√b2/b1)     (ε on the raw √v, then times √b2: torch's placement)
    otherwise:        p = p + m·(−η/b1)                          (SGD with momentum)

The branch depends only on t and β2 (host scalars), so the GPU path never synchronises.  Defaults lr 1e-3 (torch's),
betas (0.9, 0.999), eps 1e-8, weight_decay 0, decoupled_weight_decay False, threshold 5.

Deviations: from rlx-optim, the threshold (rlx-optim rectifies when ρ_t > 4, the paper's Algorithm 2 text; the
official code, torch, optax and pytorch-optimizer use 5, and flatopt does: ``threshold=4`` reproduces rlx-optim) and
ε's placement (rlx-optim and optax put ε on √v̂, i.e. ε·√b2 here).  From torch: the step scalars −η·r·√b2/b1 are
folded into one float64 factor (torch multiplies the arrays by lr, the adaptive factor and r in turn), a few ulps.
From the official code: its default ``degenerated_to_sgd=False`` skips the whole update (decay included) while ρ_t <
5; flatopt (like torch) takes the SGD-momentum step.  ``end_iteration`` only counts iterations.  State: ``m``, ``v``
(8 B/param in float32).
``cautious=True``: the direction (m/(√v + ε), or m unrectified) masked where it disagrees in sign with g', times
numel/(count + 1) per tensor (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from .adam import adam_moments, bias_corrections, check_bool, check_common
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class RAdamConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    threshold: float = 5.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("RAdam", self)
        check_bool("RAdam", "decoupled_weight_decay", self.decoupled_weight_decay)
        check_range("RAdam", "threshold", self.threshold, 4.0, math.inf)


@functools.lru_cache(maxsize=16)
def _rectification(cfg: RAdamConfig, t: int) -> tuple[bool, float]:
    """(ρ_t > threshold, r) in float64 (r = 0 when not rectified)."""
    b2 = cfg.betas[1]
    bc2 = bias_corrections(cfg.betas, t)[1]
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    rho_t = rho_inf - 2.0 * t * (b2 ** t) / bc2
    if rho_t > cfg.threshold:
        return True, math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
    return False, 0.0


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: RAdamConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced: see ``core/elementwise/trace.py``); both
    step factors, the flag ``rect`` picks one, so that the operations that derive them never depend on t."""
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    _, r = _rectification(cfg, t)
    return dict(wd=cfg.weight_decay, decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2,
                eps=cfg.eps, factor=-lr / bc1, factor_rect=-lr * r * math.sqrt(bc2) / bc1)


def flags(cfg: RAdamConfig, t: int) -> dict[str, bool]:
    wd = cfg.weight_decay != 0
    return dict(wd=wd, dec=wd and cfg.decoupled_weight_decay, rect=_rectification(cfg, t)[0])


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    if f.dec:
        p = p * s.decay
    elif f.wd:
        g = g + p * s.wd
    m, v = adam_moments(g, m, v, s)
    if f.rect:
        p = p + e.cautious(m / (e.sqrt(v) + s.eps), g) * s.factor_rect
    else:
        p = p + e.cautious(m, g) * s.factor
    return dict(p=p, m=m, v=v)


DEF = define("radam", step, scalars=scalars, flags=flags, flag_names=("wd", "dec", "rect"), slots=("m", "v"),
             example=RAdamConfig(), valid=lambda f: f["wd"] or not f["dec"])


class RAdam(ElementwiseOptimizer, definition=DEF):
    """``RAdam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
    threshold=5.0)``: see the module doc."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False, threshold: float = 5.0, *,
                 cautious: bool = False, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(RAdamConfig(lr, betas, eps, weight_decay, decoupled_weight_decay, threshold,
                                     cautious=cautious), lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)

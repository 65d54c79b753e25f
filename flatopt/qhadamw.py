"""QHAdamW: quasi-hyperbolic Adam (Ma & Yarats 2019) with decoupled weight decay — qhoptim ``QHAdamW``.

Update rule, per element, with t the step count of this parameter and η = lr · lr_scale(name)::

    p  = p · (1 − η·λ)                                   (decoupled decay, on the value before the step)
    m  = m + (1 − β1)·(g − m);   v = β2·v + (1 − β2)·g²  (raw averages)
    n  = m·(ν1/(1 − β1^t)) + g·(1 − ν1)                  (the g term only when ν1 != 1)
    d  = √(v·(ν2/(1 − β2^t)) + (g·(1 − ν2))·g) + ε       (the g² term only when ν2 != 1)
    p  = p + (n / d)·(−η)

Defaults lr 1e-3 (qhoptim's), betas (0.995, 0.999) and nus (0.7, 1.0) (the paper's recommendation and
rlx-optim's), eps 1e-8, weight_decay 1e-2.  ν = (1, 1) is AdamW; ν1 = 0 is RMSProp-like.

Deviations: qhoptim stores already-debiased averages (its β_adj weights); flatopt stores the raw EMAs m, v and
debiases with float64 β^t, identical in exact arithmetic (rlx-optim does the same).  qhoptim's defaults (β1 0.9, ν
(1, 1)) differ from these.  ``end_iteration`` only counts iterations.  State: ``m``, ``v`` (8 B/param in float32).
``cautious=True``: the direction n/d masked where it disagrees in sign with g, times numel/(count + 1) per tensor
(docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .adam import adam_moments, bias_corrections, check_common
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class QHAdamWConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.995, 0.999)
    nus: tuple[float, float] = (0.7, 1.0)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("QHAdamW", self)
        if not isinstance(self.nus, (tuple, list)) or len(self.nus) != 2:
            raise TypeError(f"QHAdamW: nus must be a pair of floats, got {self.nus!r}")
        check_range("QHAdamW", "nus[0]", self.nus[0], 0.0, 1.0)
        check_range("QHAdamW", "nus[1]", self.nus[1], 0.0, 1.0)
        object.__setattr__(self, "nus", (float(self.nus[0]), float(self.nus[1])))


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: QHAdamWConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2 = cfg.betas
    nu1, nu2 = cfg.nus
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return dict(decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, c_m=nu1 / bc1,
                c_g=1.0 - nu1, c_v=nu2 / bc2, c_gg=1.0 - nu2, eps=cfg.eps, neg_lr=-lr)


def flags(cfg: QHAdamWConfig, t: int) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0, nu1=cfg.nus[0] != 1.0, nu2=cfg.nus[1] != 1.0)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    if f.wd:
        p = p * s.decay
    m, v = adam_moments(g, m, v, s)
    num = m * s.c_m
    if f.nu1:
        num = num + g * s.c_g
    den = v * s.c_v
    if f.nu2:
        den = den + (g * s.c_gg) * g
    p = p + e.cautious(num / (e.sqrt(den) + s.eps), g) * s.neg_lr
    return dict(p=p, m=m, v=v)


DEF = define("qhadamw", step, scalars=scalars, flags=flags, flag_names=("wd", "nu1", "nu2"), slots=("m", "v"),
             example=QHAdamWConfig())


class QHAdamW(ElementwiseOptimizer, definition=DEF):
    """``QHAdamW(lr=1e-3, betas=(0.995, 0.999), nus=(0.7, 1.0), eps=1e-8, weight_decay=1e-2)``: see the module
    doc."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.995, 0.999),
                 nus: tuple[float, float] = (0.7, 1.0), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 cautious: bool = False, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(QHAdamWConfig(lr, betas, nus, eps, weight_decay, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

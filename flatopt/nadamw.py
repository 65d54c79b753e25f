"""NAdamW: Dozat's Nesterov Adam with a constant momentum μ = β1 and decoupled weight decay — optax ``nadamw``,
``torch.optim.NAdam(momentum_decay=inf, decoupled_weight_decay=True)``, rlx-optim's NAdamW.

Update rule, per element, with t the step count of this parameter and η = lr · lr_scale(name)::

    p  = p · (1 − η·λ)                                   (decoupled decay, on the value before the step)
    m  = m + (1 − β1)·(g − m);   v = β2·v + (1 − β2)·g²
    d  = √(v / (1 − β2^t)) + ε
    p  = p + (g / d)·(−η(1 − β1)/(1 − β1^t))
    p  = p + (m / d)·(−η β1/(1 − β1^(t+1)))

i.e. p − η·m̄/(√v̂ + ε) with m̄ = β1·m/(1 − β1^(t+1)) + (1 − β1)·g/(1 − β1^t): the look-ahead momentum uses the
bias correction of step t+1.  Operation order: torch's single-tensor NAdam (two ``addcdiv_``).

Defaults lr 1e-3 and weight_decay 1e-2 (flatopt AdamW's), betas (0.9, 0.999), eps 1e-8 (rlx-optim's). Deviations:
torch's default momentum schedule μ_t = β1(1 − ½·0.96^(t·ψ)), ψ = 4e-3 (Dozat's decaying schedule, a different
optimizer: 0.44 apart after 10 steps) is not offered; flatopt is torch's NAdam at ψ = ∞.  torch keeps the product Π
μ in float32; flatopt computes β1^t and β1^(t+1) in float64.  optax raises β to the power t in float32, which puts
it ~7e-6 away at β2 = 0.999.  ``end_iteration`` only counts iterations.  State: ``m``, ``v`` (8 B/param in float32).
``cautious=True``: the direction (both terms together) masked where it disagrees in sign with g, times
numel/(count + 1) per tensor, then added to p at once, not term by term (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .adam import adam_moments, bias_corrections, check_common, decay_flag
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import normalize_numbers


@dataclasses.dataclass(frozen=True)
class NAdamWConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("NAdamW", self)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: NAdamWConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    bc1_next = 1.0 - b1 ** (t + 1)
    return dict(decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc2=bc2, eps=cfg.eps,
                c_g=-lr * (1.0 - b1) / bc1, c_m=-lr * b1 / bc1_next, k_g=(1.0 - b1) / bc1, k_m=b1 / bc1_next,
                neg_lr=-lr)  # k_g, k_m, neg_lr: the cautious direction's (its mask's count reads no lr)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    if f.wd:
        p = p * s.decay
    m, v = adam_moments(g, m, v, s)
    d = e.sqrt(v / s.bc2) + s.eps
    if f.cautious:  # one masked direction (both terms), then −η
        p = p + e.cautious((g / d) * s.k_g + (m / d) * s.k_m, g) * s.neg_lr
    else:
        p = p + (g / d) * s.c_g
        p = p + (m / d) * s.c_m
    return dict(p=p, m=m, v=v)


DEF = define("nadamw", step, scalars=scalars, flags=decay_flag, flag_names=("wd",), slots=("m", "v"),
             example=NAdamWConfig())


class NAdamW(ElementwiseOptimizer, definition=DEF):
    """``NAdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)``: see the module doc."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, cautious: bool = False, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(NAdamWConfig(lr, betas, eps, weight_decay, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

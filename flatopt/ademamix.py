"""AdEMAMix: Adam whose numerator mixes a fast and a slow momentum (Pagliardini et al. 2024) — pytorch-optimizer
``AdEMAMix``.

Update rule, per element, with t the step count of this parameter (advanced inside ``step``) and
η = lr · lr_scale(name)::

    p  = p · (1 − η·λ)                                  (decoupled decay, on the value before the step, when λ != 0)
    m  = m + (g − m)·(1 − β1)                           (the fast momentum, torch's lerp form)
    v  = β2·v + (1 − β2)·g²
    s  = s + (g − s)·(1 − β3(t))                        (the slow momentum: never bias-corrected)
    p  = p + (−η·(m/(1 − β1^t) + α(t)·s)) / (√v/√(1 − β2^t) + ε)

with, when ``t_alpha_beta3`` = T is given (the warm-up of both; else α(t) = α and β3(t) = β3), computed on the host
in double for each step::

    α(t)  = min(t·α/T, α)
    β3(t) = min(exp(ln β1 · ln β3 / ((1 − t/T)·ln β3 + (t/T)·ln β1)), β3)

Defaults lr 1e-3, betas (0.9, 0.999, 0.9999), alpha 5, t_alpha_beta3 None (no warm-up), eps 1e-8 (outside the
square root), weight_decay 0 (pytorch-optimizer's).  Arithmetic is in the parameter's dtype, in the operation order
of pytorch-optimizer's per-parameter path (``lerp_``, ``mul_(β2).addcmul_``, ``sqrt().div_().add_()``,
``div(bc1).add_(s, alpha=α)``, ``addcdiv_(value=−η)``: (−η·u)/d, the order of torch's CPU kernel); torch's CPU kernels
contract the lerps, ``addcmul_`` and ``add_`` with alpha into multiply-adds and its float32 ``sqrt`` is off by an ulp
in some elements, so the two agree to a few ulps per step rather than bit for bit.  Deviations: the weight decay is
decoupled (the paper's Algorithm 1 and the official code, as AdamW), where pytorch-optimizer's default
``weight_decouple=False`` adds λ·p to the gradient: this class equals ``AdEMAMix(weight_decouple=True)``;
``fixed_decay``, ``maximize`` and ``stable_adamw`` are not offered; with a warm-up, β1 and β3 must be
positive and β1 ≤ β3 (pytorch-optimizer accepts others and then fails or divides by zero at some step: the logarithms
and the denominator of β3(t)).  ``end_iteration`` only counts iterations (the warm-up follows the per-name t).
State: ``m``, ``v``, ``m_slow`` (12 B/param in float32).  Use it for long runs where a very slow momentum (β3 0.9999)
pays (the paper: language models over many thousands of steps), with an lr and a weight decay a little lower than
AdamW's, and a warm-up of α and β3 as long as the run when it diverges early.
``cautious=True``: the fast momentum m (before its bias correction) masked where it disagrees in sign with g, times
numel/(count + 1) per tensor; the slow term α·s and the decay stay outside, as pytorch-optimizer's
``AdEMAMix(cautious=True)`` (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .adam import adam_moments, bias_corrections, decay_flag
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import check_lr, check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class AdEMAMixConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float, float] = (0.9, 0.999, 0.9999)
    alpha: float = 5.0
    t_alpha_beta3: float | None = None
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_lr(self.lr, "lr", "AdEMAMix")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 3:
            raise TypeError(f"AdEMAMix: betas must be three floats (β1, β2, β3), got {self.betas!r}")
        check_range("AdEMAMix", "betas[0]", self.betas[0], 0.0, 1.0, hi_open=True)
        check_range("AdEMAMix", "betas[1]", self.betas[1], 0.0, 1.0, hi_open=True)
        check_range("AdEMAMix", "betas[2]", self.betas[2], 0.0, 1.0)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        check_range("AdEMAMix", "alpha", self.alpha, 0.0, math.inf)
        if self.t_alpha_beta3 is not None:
            check_range("AdEMAMix", "t_alpha_beta3", self.t_alpha_beta3, 0.0, math.inf, lo_open=True)
            b1, _, b3 = self.betas
            if not 0.0 < b1 <= b3:
                raise ValueError(f"AdEMAMix: with t_alpha_beta3, betas[0] must be in (0, betas[2]] (the warm-up "
                                 f"takes their logarithms), got {self.betas!r}")
        check_range("AdEMAMix", "eps", self.eps, 0.0, math.inf)
        check_range("AdEMAMix", "weight_decay", self.weight_decay, 0.0, math.inf)


def schedule_alpha(cfg: AdEMAMixConfig, t: int) -> float:
    """α(t), in double (pytorch-optimizer's ``schedule_alpha``)."""
    T = cfg.t_alpha_beta3
    return cfg.alpha if T is None else min(t * cfg.alpha / T, cfg.alpha)


def schedule_beta3(cfg: AdEMAMixConfig, t: int) -> float:
    """β3(t), in double (pytorch-optimizer's ``schedule_beta3``: the same operations in the same order)."""
    b1, _, b3 = cfg.betas
    T = cfg.t_alpha_beta3
    if T is None:
        return b3
    log_b1, log_b3 = math.log(b1), math.log(b3)
    return min(math.exp(log_b1 * log_b3 / ((1.0 - t / T) * log_b3 + (t / T) * log_b1)), b3)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: AdEMAMixConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2, _ = cfg.betas
    bc1, bc2 = bias_corrections((b1, b2), t)
    return dict(decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2,
                omb3=1.0 - schedule_beta3(cfg, t), bc2_sqrt=math.sqrt(bc2), eps=cfg.eps, bc1=bc1,
                alpha=schedule_alpha(cfg, t), neg_lr=-lr)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, m_slow: Any, *, s: Any, f: Any) -> dict[str, Any]:
    if f.wd:
        p = p * s.decay
    m, v = adam_moments(g, m, v, s)
    m_slow = m_slow + (g - m_slow) * s.omb3
    d = e.sqrt(v) / s.bc2_sqrt + s.eps
    u = e.cautious(m, g) / s.bc1 + m_slow * s.alpha  # the fast momentum masked, before its correction
    p = p + (u * s.neg_lr) / d  # torch's addcdiv_(u, d, value=−η): (−η·u)/d
    return dict(p=p, m=m, v=v, m_slow=m_slow)


DEF = define("ademamix", step, scalars=scalars, flags=decay_flag, flag_names=("wd",), slots=("m", "v", "m_slow"),
             example=AdEMAMixConfig())


class AdEMAMix(ElementwiseOptimizer, definition=DEF):
    """``AdEMAMix(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha_beta3=None, eps=1e-8,
    weight_decay=0.0)``: see the module doc."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 alpha: float = 5.0, t_alpha_beta3: float | None = None, eps: float = 1e-8,
                 weight_decay: float = 0.0, *, cautious: bool = False, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(AdEMAMixConfig(lr, betas, alpha, t_alpha_beta3, eps, weight_decay, cautious=cautious),
                         lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)

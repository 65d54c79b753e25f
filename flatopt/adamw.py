"""AdamW: Adam with decoupled weight decay — ``torch.optim.AdamW`` semantics exactly.

Update rule, per element, with t the step count of this parameter (advanced inside ``step``) and
η = lr · lr_scale(name)::

    p  = p · (1 − η·weight_decay)                       (decoupled decay, on the value before the step)
    m  = m + (1 − β1)·(g − m)                           (= β1·m + (1 − β1)·g, torch's lerp form)
    v  = β2·v + (1 − β2)·g²
    v̂max = max(v̂max, v)                                (amsgrad only)
    p  = p − η/(1 − β1^t) · m / (√(v or v̂max)/√(1 − β2^t) + ε)

Defaults lr 1e-3, betas (0.9, 0.999), eps 1e-8 (outside the square root), weight_decay 1e-2, amsgrad False.
Arithmetic is in the parameter's dtype (as torch; rlx-optim uses f64 intermediates), in the operation order of
torch's single-tensor path.  torch's vectorised CPU kernels may contract multiply-adds, so the two agree to a few
ulps rather than bit for bit.  ``end_iteration`` only counts iterations.  State: ``m``, ``v`` (and ``vmax``).
``cautious=True``: the direction m/(√v̂ + ε) masked where it disagrees in sign with g, times numel/(count + 1) per
tensor; the decay stays outside, as pytorch-optimizer's ``apply_cautious`` (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from .adam import AMSGRAD, adam_family
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import check_lr, check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class AdamWConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_lr(self.lr, "lr", "AdamW")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise TypeError(f"AdamW: betas must be a pair of floats, got {self.betas!r}")
        check_range("AdamW", "betas[0]", self.betas[0], 0.0, 1.0, hi_open=True)
        check_range("AdamW", "betas[1]", self.betas[1], 0.0, 1.0, hi_open=True)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        check_range("AdamW", "eps", self.eps, 0.0, math.inf)
        check_range("AdamW", "weight_decay", self.weight_decay, 0.0, math.inf)
        if not isinstance(self.amsgrad, bool):
            raise TypeError(f"AdamW: amsgrad must be a bool, got {self.amsgrad!r}")


@functools.lru_cache(maxsize=16)
def _bias(cfg: AdamWConfig, t: int) -> tuple[float, float]:
    """``(1 - beta1^t, sqrt(1 - beta2^t))`` in double (the host computes them for every path)."""
    b1, b2 = cfg.betas
    return 1.0 - b1**t, (1.0 - b2**t) ** 0.5


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: AdamWConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced: the multi-tensor kernel derives ``decay`` and
    ``neg_step`` per tensor with these operations)."""
    b1, b2 = cfg.betas
    bc1, bc2_sqrt = _bias(cfg, t)
    return dict(decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc2_sqrt=bc2_sqrt,
                eps=cfg.eps, neg_step=-(lr / bc1))


DEF = adam_family("adamw", scalars, AdamWConfig(), decoupled=True)  # the step: adam.py `adam_family_step`


class AdamW(ElementwiseOptimizer, definition=DEF, only_if=AMSGRAD):
    """``AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False)``: see the module doc."""

    matters = ("amsgrad",)

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, cautious: bool = False,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(AdamWConfig(lr, betas, eps, weight_decay, amsgrad, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)


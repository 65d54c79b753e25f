"""Lion: the sign of an interpolation of momentum and gradient (Chen et al. 2023) — lion-pytorch ``Lion``.

Update rule, per element, with η = lr · lr_scale(name)::

    p  = p · (1 − η·λ)                                  (decoupled decay, on the value before the step)
    c  = m·β1 + g·(1 − β1)
    p  = p + sign(c)·(−η)                               (sign(0) = 0; NaN propagates)
    m  = m·β2 + g·(1 − β2)

Defaults lr 1e-4 (lion-pytorch's), betas (0.9, 0.99), weight_decay 0 (rlx-optim's).  Lion's steps have size η per
element: use an lr 3-10x smaller than AdamW's and a weight decay 3-10x larger.  No bias correction, so the step
count t is unused.  Deviations: none from lion-pytorch with ``decoupled_weight_decay=False`` (its
``decoupled_weight_decay=True`` divides λ by the initial lr: not offered); optax ``lion`` computes the same rule
with other roundings.  ``end_iteration`` only counts iterations.  State: ``m`` (4 B/param in float32).
``cautious=True``: sign(c) masked where it disagrees in sign with g, times numel/(count + 1) per tensor, as
pytorch-optimizer's ``Lion(cautious=True)`` (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .adam import check_common, decay_flag
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import normalize_numbers


@dataclasses.dataclass(frozen=True)
class LionConfig(Cautious):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Lion", self, eps_field=False)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: LionConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2 = cfg.betas
    return dict(decay=1.0 - lr * cfg.weight_decay, b1=b1, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, neg_lr=-lr)


def step(e: Any, p: Any, g: Any, m: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """The NumPy path computes sign(c)·(−η) branch-free (``core/elementwise/lower_numpy.py`` ``signed_mul``)."""
    if f.wd:
        p = p * s.decay
    c = m * s.b1 + g * s.omb1
    p = p + e.cautious(e.sign(c), g) * s.neg_lr
    m = m * s.b2 + g * s.omb2
    return dict(p=p, m=m)


DEF = define("lion", step, scalars=scalars, flags=decay_flag, flag_names=("wd",), slots=("m",), example=LionConfig())


class Lion(ElementwiseOptimizer, definition=DEF):
    """``Lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``: see the module doc."""

    def __init__(self, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 cautious: bool = False, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(LionConfig(lr, betas, weight_decay, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

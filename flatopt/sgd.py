"""SGD with momentum, dampening, Nesterov and L2 weight decay — ``torch.optim.SGD`` semantics exactly.

Update rule, per element, with g' the decayed gradient and ``buf`` the momentum buffer::

    g' = g + weight_decay * p                      (L2 decay folded into the gradient, when weight_decay != 0)
    buf = g'                                       on the first step of this parameter (torch's clone)
    buf = momentum * buf + (1 - dampening) * g'    afterwards                   (when momentum != 0)
    d   = g' + momentum * buf  if nesterov  else buf                           (when momentum != 0; else d = g')
    p   = p - lr * lr_scale(name) * d

Deviations: none from torch (``maximize`` and ``differentiable`` are not offered).  The rlx-optim seed folds the
first step into ``momentum * 0 + g'``, which differs from torch when dampening != 0; flatopt follows torch.
Arithmetic is in the parameter's dtype.  ``end_iteration`` only counts iterations (SGD has no schedule). State:
``buf`` (only when momentum != 0).
``cautious=True``: d masked where d·g' ≤ 0, times numel/(count + 1) per tensor (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, JSONDict, LrScale
from .core.validate import check_lr, check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class SGDConfig(Cautious):
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_lr(self.lr, "lr", "SGD")
        check_range("SGD", "momentum", self.momentum, 0.0, 1.0)
        check_range("SGD", "dampening", self.dampening, 0.0, 1.0)
        check_range("SGD", "weight_decay", self.weight_decay, 0.0, float("inf"))
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"SGD: nesterov must be a bool, got {self.nesterov!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening == 0")


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: SGDConfig, t: int, lr: Any) -> dict[str, Any]:
    return dict(wd=cfg.weight_decay, mom=cfg.momentum, omd=1.0 - cfg.dampening, neg_lr=-lr)


def flags(cfg: SGDConfig, t: int) -> dict[str, bool]:
    mom = cfg.momentum != 0
    first = mom and t == 1
    return dict(wd=cfg.weight_decay != 0, mom=mom, first=first, damp=mom and not first and cfg.dampening != 0,
                nest=mom and cfg.nesterov)


def _valid(f: dict[str, bool]) -> bool:
    return (f["mom"] or not (f["first"] or f["damp"] or f["nest"])) and not (f["damp"] and (f["first"] or f["nest"]))


def step(e: Any, p: Any, g: Any, buf: Any, *, s: Any, f: Any) -> dict[str, Any]:
    d = g
    if f.wd:
        d = p * s.wd + d
    gd = d  # the (decayed) gradient the cautious mask compares with
    if f.mom:
        if f.first:
            buf = d
        else:
            buf = buf * s.mom + (d * s.omd if f.damp else d)
        d = d + buf * s.mom if f.nest else buf
    p = p + e.cautious(d, gd) * s.neg_lr
    return dict(p=p, buf=buf)


DEF = define("sgd", step, scalars=scalars, flags=flags, flag_names=("wd", "mom", "first", "damp", "nest"),
             slots=("buf",), example=SGDConfig(lr=1e-2, momentum=0.9), valid=_valid)


class SGD(ElementwiseOptimizer, definition=DEF, only_if={"buf": lambda cfg: cfg.momentum != 0}):
    """``SGD(lr, momentum=0, dampening=0, nesterov=False, weight_decay=0)``: see the module docstring."""

    matters = ("momentum",)  # whether a momentum buffer exists

    def __init__(self, lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, *, cautious: bool = False, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(SGDConfig(lr, momentum, dampening, nesterov, weight_decay, cautious=cautious),
                         lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)

    def _config_key(self) -> JSONDict:
        return {"momentum": self.config.momentum != 0}


"""Adam: Kingma & Ba with coupled (L2) weight decay — ``torch.optim.Adam`` semantics; and the Adam-family pieces
that NAdamW, RAdam, QHAdamW, Lamb and Mars compose (config checks, the moment passes, bias corrections).

Update rule, per element, with t the step count of this parameter (advanced inside ``step``) and
η = lr · lr_scale(name)::

    g' = g + λ·p                                        (L2 decay, when weight_decay != 0; torch's grad.add(p, α=λ))
    m  = m + (1 − β1)·(g' − m)                          (= β1·m + (1 − β1)·g', torch's lerp form)
    v  = β2·v + (1 − β2)·g'²
    v̂max = max(v̂max, v)                                (amsgrad only)
    p  = p − η/(1 − β1^t) · m / (√(v or v̂max)/√(1 − β2^t) + ε)

Defaults lr 1e-3, betas (0.9, 0.999), eps 1e-8 (outside the square root), weight_decay 0, amsgrad False (torch's;
rlx-optim requires lr).  This is torch's single-tensor operation order; torch's
``Adam(decoupled_weight_decay=True)`` is ``flatopt.AdamW``.  Deviations: none from torch or the paper (``maximize``,
``capturable``, ``differentiable`` are not offered); rlx-optim computes with f64 intermediates, flatopt in the
parameter's dtype with float64 bias corrections.  ``end_iteration`` only counts iterations (bias correction uses the
per-name t).  State: ``m``, ``v`` (and ``vmax``): 8 B/param in float32 (12 with amsgrad).  Use it where a model was
tuned with L2-coupled Adam; otherwise prefer AdamW.
``cautious=True``: the direction m/(√v̂ + ε) masked where it disagrees in sign with g' (L2-decayed), times
numel/(count + 1) per tensor, as pytorch-optimizer's ``apply_cautious`` (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import check_lr, check_range, normalize_numbers


# --------------------------------------------------------------------------------- the Adam-family pieces
def check_common(owner: str, cfg: Any, *, eps_field: bool = True) -> None:
    """Validate (and normalise) the fields every Adam-family config has: lr, betas, eps, weight_decay."""
    check_lr(cfg.lr, "lr", owner)  # finite, >= 0, at most float32's largest value (core.validate.LR_MAX)
    if not isinstance(cfg.betas, (tuple, list)) or len(cfg.betas) != 2:
        raise TypeError(f"{owner}: betas must be a pair of floats, got {cfg.betas!r}")
    check_range(owner, "betas[0]", cfg.betas[0], 0.0, 1.0, hi_open=True)
    check_range(owner, "betas[1]", cfg.betas[1], 0.0, 1.0, hi_open=True)
    object.__setattr__(cfg, "betas", (float(cfg.betas[0]), float(cfg.betas[1])))
    if eps_field:
        check_range(owner, "eps", cfg.eps, 0.0, math.inf)
    check_range(owner, "weight_decay", cfg.weight_decay, 0.0, math.inf)


def check_bool(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {field} must be a bool, got {value!r}")


def adam_moments(g: Any, m: Any, v: Any, s: Any) -> tuple[Any, Any]:
    """The moments inside a definition's step (scalars ``omb1``, ``b2``, ``omb2``): torch's lerp and addcmul
    forms, m = m + (g − m)·(1 − β1);  v = v·β2 + (g·(1 − β2))·g."""
    return m + (g - m) * s.omb1, v * s.b2 + (g * s.omb2) * g


def adam_family_step(decoupled: bool) -> Any:
    """The step of Adam (L2 decay: g' = g + p·wd) or, ``decoupled``, of AdamW (p = p·decay first): flags ``wd``,
    ``ams``; scalars ``decay`` or ``wd``, ``omb1``, ``b2``, ``omb2``, ``bc2_sqrt``, ``eps``, ``neg_step``."""
    def step(e: Any, p: Any, g: Any, m: Any, v: Any, vmax: Any, *, s: Any, f: Any) -> dict[str, Any]:
        if f.wd and decoupled:
            p = p * s.decay
        elif f.wd:
            g = g + p * s.wd
        m, v = adam_moments(g, m, v, s)
        src = v
        if f.ams:
            vmax = src = e.maximum(vmax, v)  # NumPy's NaN rule
        p = p + e.cautious(m / (e.sqrt(src) / s.bc2_sqrt + s.eps), g) * s.neg_step
        return dict(p=p, m=m, v=v, vmax=vmax)
    return step


def adam_family(name: str, scalars: Any, example: Any, *, decoupled: bool) -> Any:
    """The definition of Adam or AdamW (``adam_family_step``)."""
    return define(name, adam_family_step(decoupled), scalars=scalars,
                  flags=lambda cfg, t: dict(wd=cfg.weight_decay != 0, ams=cfg.amsgrad), flag_names=("wd", "ams"),
                  slots=("m", "v", "vmax"), example=example)


AMSGRAD = {"vmax": lambda cfg: cfg.amsgrad}  # Adam's and AdamW's only_if: vmax is kept with amsgrad only


def decay_flag(cfg: Any, t: int) -> dict[str, bool]:
    """The flags of a step whose only option is the weight decay (``wd``: λ != 0)."""
    return dict(wd=cfg.weight_decay != 0)


def bias_corrections(betas: tuple[float, float], t: int) -> tuple[float, float]:
    """(1 − β1^t, 1 − β2^t) in float64 (never β^t in float32)."""
    return 1.0 - betas[0] ** t, 1.0 - betas[1] ** t


# ------------------------------------------------------------------------------------------------ Adam
@dataclasses.dataclass(frozen=True)
class AdamConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Adam", self)
        check_bool("Adam", "amsgrad", self.amsgrad)


def scalars(cfg: AdamConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return dict(wd=cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc2_sqrt=bc2 ** 0.5, eps=cfg.eps,
                neg_step=-(lr / bc1))


DEF = adam_family("adam", scalars, AdamConfig(), decoupled=False)


class Adam(ElementwiseOptimizer, definition=DEF, only_if=AMSGRAD):
    """``Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False)``: see the module doc."""

    matters = ("amsgrad",)

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, cautious: bool = False,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(AdamConfig(lr, betas, eps, weight_decay, amsgrad, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

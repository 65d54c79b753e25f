"""ADOPT: Adam whose step normalises the gradient by the previous second moment, clipped (Taniguchi et al. 2024) —
pytorch-optimizer ``ADOPT``.

Update rule, per element, with t the step count of this parameter (advanced inside ``step``) and
η = lr · lr_scale(name)::

    p  = p · (1 − η·λ)                                  (decoupled decay, ``decoupled=True``, when λ != 0)
    g' = g + λ·p                                        (L2 decay, ``decoupled=False``, when λ != 0)
    t = 1:  v = v + g'·g'                               (the first step only initialises v: p and m are unchanged)
    t > 1:  n = clip(g' / max(√v, ε), −t^¼, t^¼)        (v of the previous step; NaN propagates through max and clip)
            m = m + (n − m)·(1 − β1)                    (= β1·m + (1 − β1)·n, torch's lerp form)
            p = p − η·m
            v = β2·v + (1 − β2)·g'²                     (after the step: the next step normalises by it)

Defaults lr 1e-3, betas (0.9, 0.9999), eps 1e-6 (a floor under √v, not added to it), weight_decay 0, decoupled
False (pytorch-optimizer's).  The clip value t^¼ is computed on the host in double and rounded to the parameter's
dtype, as torch rounds the scalar of ``clamp_``.  Arithmetic is in the parameter's dtype, in the operation order of
pytorch-optimizer's per-parameter path (``lerp_``, ``add_(alpha=−η)``, ``mul_(β2).addcmul_``); torch's CPU kernels
contract the lerp, ``add_`` with alpha and ``addcmul_`` into multiply-adds and its float32 ``sqrt`` is off by an ulp
in some elements, so the two agree to a few ulps per step rather than bit for bit.  Which step is the first is a flag
of the operation sequence (t == 1), never a test on the data.  Deviations: pytorch-optimizer's ``clip_lambda`` is
fixed at its default t^¼ (no other clip, no ``None``); ``fixed_decay`` (a decay of 1 − λ, not scaled by the lr),
``maximize`` and ``stable_adamw`` are not offered; the paper's first version has no clip (the clip is the
authors' later default, which pytorch-optimizer follows); the decoupled decay is pytorch-optimizer's and the official
code's p·(1 − η·λ) on the value before the step.  ``end_iteration`` only counts iterations.  State: ``m``, ``v`` (8
B/param in float32).  Use it where Adam diverges at a β2 that suits the problem (ADOPT converges for any β2), or as a
drop-in for Adam with the same lr.
``cautious=True``: m masked where it disagrees in sign with the clipped normalised gradient n, times
numel/(count + 1) per tensor, as pytorch-optimizer's ``ADOPT(cautious=True)`` (n has the signs of the L2-decayed
gradient g', not of the raw one, but where it underflows to 0); the first step (v only) is unchanged; the
decoupled decay stays outside (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .adam import check_bool, check_common
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import DecayMask, LrScale
from .core.validate import normalize_numbers


@dataclasses.dataclass(frozen=True)
class AdoptConfig(Cautious):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.9999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Adopt", self)
        check_bool("Adopt", "decoupled", self.decoupled)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: AdoptConfig, t: int, lr: Any) -> dict[str, Any]:
    b1, b2 = cfg.betas
    clip = math.pow(t, 0.25)  # pytorch-optimizer's default clip_lambda
    return dict(decay=1.0 - lr * cfg.weight_decay, wd=cfg.weight_decay, eps=cfg.eps, clip=clip, neg_clip=-clip,
                omb1=1.0 - b1, neg_lr=-lr, b2=b2, omb2=1.0 - b2)


def flags(cfg: AdoptConfig, t: int) -> dict[str, bool]:
    wd = cfg.weight_decay != 0
    return dict(wd=wd, dec=wd and cfg.decoupled, first=t == 1)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    if f.dec:
        p = p * s.decay
    elif f.wd:
        g = g + p * s.wd
    if f.first:
        return dict(p=p, v=v + g * g)
    n = g / e.maximum(e.sqrt(v), s.eps)  # torch's clamp_(min=eps) of √v: NumPy's NaN rule
    n = e.minimum(e.maximum(n, s.neg_clip), s.clip)  # clamp_(−clip, clip)
    m = m + (n - m) * s.omb1
    p = p + e.cautious(m, n) * s.neg_lr  # masked against the normalised gradient
    v = v * s.b2 + (g * s.omb2) * g
    return dict(p=p, m=m, v=v)


DEF = define("adopt", step, scalars=scalars, flags=flags, flag_names=("wd", "dec", "first"), slots=("m", "v"),
             example=AdoptConfig(), valid=lambda f: f["wd"] or not f["dec"],
             wide_maps=True)  # the cautious map recomputes n (a division, a square root): spills in double


class Adopt(ElementwiseOptimizer, definition=DEF):
    """``Adopt(lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, weight_decay=0.0, decoupled=False)``: see the module doc."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.9999), eps: float = 1e-6,
                 weight_decay: float = 0.0, decoupled: bool = False, *, cautious: bool = False,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(AdoptConfig(lr, betas, eps, weight_decay, decoupled, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

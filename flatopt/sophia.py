"""Sophia: clipped diagonal-Newton steps (Liu et al. 2023) — the official ``SophiaG`` (= sophia-opt's), with the
diagonal Hessian estimate supplied by the caller through ``update_hessian``.

``step``, per element, with η = lr · lr_scale(name)::

    p  = p · (1 − η·λ)                                   (decoupled decay)
    m  = m·β1 + g·(1 − β1)
    p  = p + (sign(m) · min(|m| / (h·ρ + ε), 1))·(−η)    (sign(0) = 0)

``update_hessian(name, shape, h_hat)``::

    h  = h·β2 + ĥ·(1 − β2)

ĥ is the caller's diagonal estimate: for Gauss-Newton-Bartlett ĥ = B·ĝ⊙ĝ, with ĝ the mean gradient of the loss on
labels sampled from the model and B the batch size in tokens (exactly the official ``update_hessian()`` followed by
``step(bs=B)``, which keeps EMA(ĝ²) and multiplies it by bs in the step); for Hutchinson ĥ = u⊙(∇²L·u).  The
official cadence is every 10 steps, after ``step``.  ``update_hessian`` validates like ``step`` (size, dtype,
backend, the shape of existing state; ĥ is never written), creates the state of a new name with t = 0 and never
advances t.  Never called, h = 0 and every step is η·sign(m), as in the official code.

Defaults lr 1e-4 (official), betas (0.965, 0.99), rho 0.04 (the official code's ρ, the paper's γ), weight_decay 0.1
(official), eps 1e-15 (the official constant).  Deviations: rlx-optim computes clip(m/max(γh, ε), ±ρ) with γ = 0.01,
ρ = 0.04 — a mix of the paper's earlier and final forms that caps every step at 0.04·η and stops ρ from scaling h —
flatopt follows the official code.  The official ``bs`` argument of ``step`` is folded into ĥ. pytorch-optimizer's
``SophiaH`` follows the earlier form.  t is unused (no bias correction).  ``update_hessian``'s EMA is not derived from
the definition: two NumPy/CuPy operations on ``h`` (called every few steps, per tensor; see there).
``end_iteration`` only counts iterations.  State: ``m``, ``h`` (8 B/param in float32).
``cautious=True`` (not in the official code nor pytorch-optimizer's Sophia variants): the direction is the clipped
step sign(m)·min(|m|/(h·ρ + ε), 1), masked where it disagrees in sign with g, times numel/(count + 1) per tensor,
as pytorch-optimizer's ``apply_cautious`` on the update it subtracts; the decay stays outside (docs/algorithms.md,
cautious).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

from .adam import check_common, decay_flag
from .core import backend
from .core.elementwise import define
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import Array, DecayMask, LrScale
from .core.validate import check_array, check_range, check_shape, normalize_numbers


@dataclasses.dataclass(frozen=True)
class SophiaConfig(Cautious):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.965, 0.99)
    rho: float = 0.04
    weight_decay: float = 1e-1
    eps: float = 1e-15

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Sophia", self)
        check_range("Sophia", "rho", self.rho, 0.0, math.inf)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: SophiaConfig, t: int, lr: Any) -> dict[str, Any]:
    b1 = cfg.betas[0]
    return dict(decay=1.0 - lr * cfg.weight_decay, b1=b1, omb1=1.0 - b1, rho=cfg.rho, eps=cfg.eps, neg_lr=-lr)


def step(e: Any, p: Any, g: Any, m: Any, h: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """``h`` is read, never written here (``update_hessian`` moves it)."""
    if f.wd:
        p = p * s.decay
    m = m * s.b1 + g * s.omb1
    ratio = e.minimum(e.abs(m) / (h * s.rho + s.eps), 1.0)  # NumPy's NaN rule: a NaN ratio stays NaN
    p = p + e.cautious(e.sign(m) * ratio, g) * s.neg_lr
    return dict(p=p, m=m)


DEF = define("sophia", step, scalars=scalars, flags=decay_flag, flag_names=("wd",), slots=("m", "h"),
             example=SophiaConfig())


_D = SophiaConfig  # the constructor's defaults: written once, in the config


class Sophia(ElementwiseOptimizer, definition=DEF):
    """``Sophia(...)`` plus ``update_hessian(name, shape, h_hat)``: see the module doc."""

    def __init__(self, lr: float = _D.lr, betas: tuple[float, float] = _D.betas, rho: float = _D.rho,
                 weight_decay: float = _D.weight_decay, eps: float = _D.eps, *, cautious: bool = _D.cautious,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(SophiaConfig(lr, betas, rho, weight_decay, eps, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

    def update_hessian(self, name: str, shape: tuple[int, ...], h_hat: Array) -> None:
        """h ← β2·h + (1 − β2)·ĥ for ``name`` (state created with t = 0 if new; t is not advanced).

        Not a second definition: the generated paths are bound to ``step`` (lr, t, ``lr_scale``, the multi-tensor
        table of a batch), while this is one tensor's two-operation EMA with no learning rate, called every few
        steps; as NumPy/CuPy ufuncs it is already one pass per operation on either backend."""
        with self._lock:
            if not isinstance(name, str) or not name:
                raise TypeError(f"parameter name must be a non-empty str, got {name!r}")
            shape = check_shape(name, shape)
            where = check_array(name, "h_hat", h_hat)
            n = math.prod(shape)
            if h_hat.size != n:
                raise ValueError(f"parameter {name!r}: h_hat has {h_hat.size} elements but shape {shape} needs {n}")
            slot = self._slots.get(name)
            if slot is not None:
                if slot.shape != shape:
                    raise ValueError(f"parameter {name!r}: shape {shape} differs from the shape {slot.shape} its "
                                     f"state was created with")
                if slot.dtype != h_hat.dtype:
                    raise TypeError(f"parameter {name!r}: h_hat dtype {h_hat.dtype} differs from the dtype "
                                    f"{slot.dtype} its state was created with")
                if slot.pinned and slot.backend != where:
                    raise TypeError(f"parameter {name!r}: state lives on {slot.backend}, got a {where} h_hat")
                if slot.pinned and slot.device is not None and h_hat.device.id != slot.device:
                    raise ValueError(f"parameter {name!r}: h_hat is on GPU {h_hat.device.id}, the state lives on "
                                     f"GPU {slot.device}")
                if not slot.pinned:
                    self._move_state(slot, h_hat)
            else:
                slot = self._new_slot(name, shape, h_hat, where)  # on h_hat's device
            xp = backend.array_module(h_hat)
            h, b2 = slot.state.h, self.config.betas[1]
            with h_hat.device if where == "cupy" else contextlib.nullcontext():
                xp.multiply(h, b2, h)
                xp.add(h, xp.multiply(h_hat, 1.0 - b2), h)

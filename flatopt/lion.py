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
with other roundings.  On the CPU the twin's operations run fused in one compiled pass
(``kernels/cpu/elementwise.c`` via ``core/native.py``, the same bits; without a C compiler the twin runs).
``end_iteration`` only counts iterations.  State: ``m`` (4 B/param in float32).
``cautious=True``: sign(c) masked where it disagrees in sign with g, times numel/(count + 1) per tensor, as
pytorch-optimizer's ``Lion(cautious=True)`` (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .adam import check_common
from .core import backend, kernels, native
from .core.elementwise import define, run
from .core.elementwise.define import Cautious
from .core.driver import PerParamOptimizer
from .core.multi_tensor import MultiTensor
from .core.types import Array, DecayMask, LrScale
from .core.validate import normalize_numbers


@dataclasses.dataclass(frozen=True)
class LionConfig(Cautious):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Lion", self, eps_field=False)


@dataclasses.dataclass
class LionState:
    m: Array


def init(xp: Any, cfg: LionConfig, shape: tuple[int, ...], dtype: Any) -> LionState:
    return LionState(xp.zeros(math.prod(shape), dtype))


def _scalars(cfg: LionConfig, lr: float) -> tuple[Any, ...]:
    b1, b2 = cfg.betas
    return 1.0 - lr * cfg.weight_decay, b1, 1.0 - b1, b2, 1.0 - b2, -lr


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: LionConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced: see ``core/elementwise/trace.py``)."""
    b1, b2 = cfg.betas
    return dict(decay=1.0 - lr * cfg.weight_decay, b1=b1, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, neg_lr=-lr)


def flags(cfg: LionConfig, t: int) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0)


def step(e: Any, p: Any, g: Any, m: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """One element of the update (the module docstring), written once: every path is derived from it (the NumPy
    path computes sign(c)·(−η) branch-free: ``core/elementwise/lower_numpy.py`` ``signed_mul``)."""
    if f.wd:
        p = p * s.decay
    c = m * s.b1 + g * s.omb1
    p = p + e.cautious(e.sign(c), g) * s.neg_lr
    m = m * s.b2 + g * s.omb2
    return dict(p=p, m=m)


DEF = define("lion", step, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m",), example=LionConfig())
_update, _kernel_update, _multi, _scratch = run.bind(DEF)


# ------------------------------------------- the hand-written paths (kept for the transition test until all match)
def _signed_step(c: np.ndarray, s: np.ndarray, neg_lr: float) -> bool:
    """NumPy: c <- sign(c)·neg_lr with the bits of ``numpy.sign`` then the multiply, branch-free: (c > 0) − (c < 0)
    as int8 in the bytes of the free scratch ``s``, times neg_lr (the int8 → dtype conversion is exact, so every
    element is the same ±1·neg_lr or +0·neg_lr product).  ``numpy.sign`` branches per element (~4 ns/element on
    random signs, 85% of a step); this is ~0.2.  A chunk holding a NaN (sign(NaN) = NaN) returns False untouched:
    the caller takes the ``numpy.sign`` path."""
    n = c.size
    b = s.view(np.int8)
    pos, neg = b[:n].view(np.bool_), b[n:2 * n].view(np.bool_)
    lo = np.minimum.reduce(c) if n else c.dtype.type(0)  # NaN exactly when c holds one (minimum propagates NaN)
    if lo != lo:
        return False
    np.greater(c, 0, out=pos)
    np.less(c, 0, out=neg)
    d = b[:n]
    np.subtract(d, b[n:2 * n], out=d)
    np.multiply(d, neg_lr, out=c, dtype=c.dtype)
    return True


def hand_update(xp: Any, cfg: LionConfig, st: LionState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step on (chunks of) flat buffers; ``scratch`` holds two buffers the size of ``p``, in the operation
    order of ``kernels/lion.cu``."""
    sc = _scalars(cfg, lr)
    if xp is np and native.step("lion", (p, g, st.m), sc, cfg.weight_decay != 0):
        return  # the same operations fused in one compiled pass (core/native.py)
    decay, b1, omb1, b2, omb2, neg_lr = sc
    s, u = scratch
    m = st.m
    if cfg.weight_decay != 0:
        xp.multiply(p, decay, p)
    xp.multiply(m, b1, u)  # c = m * b1 + g * (1 - b1)
    xp.multiply(g, omb1, s)
    xp.add(u, s, u)
    if xp is not np or not _signed_step(u, s, neg_lr):
        xp.sign(u, u)  # p = p + sign(c) * (-lr)
        xp.multiply(u, neg_lr, u)
    xp.add(p, u, p)
    xp.multiply(m, b2, m)  # m = m * b2 + g * (1 - b2)
    xp.multiply(g, omb2, s)
    xp.add(m, s, m)


def hand_kernel_update(cfg: LionConfig, st: LionState, p: Array, g: Array, *, t: int, lr: float) -> bool:
    dt = p.dtype.type
    k = kernels.get("lion.cu", "lion_step", p.dtype)
    scal = tuple(dt(x) for x in _scalars(cfg, lr))
    backend.launch(k, p.size, (p, g, st.m, np.int64(p.size), *scal, np.int32(cfg.weight_decay != 0)))
    return True


def _multi_args(cfg: LionConfig, t: int, dt: Any) -> tuple[Any, ...]:
    """``lion_multi``'s arguments after ``base_lr`` (each tensor's decay and −lr are derived in the kernel)."""
    _, *scal, _ = _scalars(cfg, 0.0)
    return (float(cfg.weight_decay), *(dt(x) for x in scal), np.int32(cfg.weight_decay != 0))


HAND_MULTI = MultiTensor("lion.cu", "lion_multi", lambda st, p: (st.m,), _multi_args)


class Lion(PerParamOptimizer):
    """``Lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``: see the module doc."""

    algorithm = "lion"
    config_cls = LionConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(_update)  # derived from DEF (core/elementwise)
    kernel_fn = staticmethod(_kernel_update)
    multi_tensor = _multi  # one launch for many tensors on CuPy (core/multi_tensor.py)
    elementwise = True
    scratch_buffers = _scratch

    def __init__(self, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 cautious: bool = False, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None) -> None:
        super().__init__(LionConfig(lr, betas, weight_decay, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask)
        run.configure(self, DEF)  # cautious: the reduce-then-map forms (core/elementwise/run.py)

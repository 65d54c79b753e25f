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
ulps rather than bit for bit.  On the CPU the twin's operations run fused in one compiled pass
(``kernels/cpu/elementwise.c`` via ``core/native.py``, the same bits; amsgrad and machines without a C compiler run
the twin).  ``end_iteration`` only counts iterations.  State: ``m``, ``v`` (and ``vmax``).
``cautious=True``: the direction m/(√v̂ + ε) masked where it disagrees in sign with g, times numel/(count + 1) per
tensor; the decay stays outside, as pytorch-optimizer's ``apply_cautious`` (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .adam import adam_family
from .core import backend, kernels, native
from .core.elementwise import run
from .core.elementwise.define import Cautious
from .core.driver import PerParamOptimizer
from .core.multi_tensor import MultiTensor
from .core.types import Array, DecayMask, LrScale
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


@dataclasses.dataclass
class AdamWState:
    m: Array
    v: Array
    vmax: Array = None


def init(xp: Any, cfg: AdamWConfig, shape: tuple[int, ...], dtype: Any) -> AdamWState:
    n = math.prod(shape)
    return AdamWState(xp.zeros(n, dtype), xp.zeros(n, dtype), xp.zeros(n, dtype) if cfg.amsgrad else None)


@functools.lru_cache(maxsize=16)
def _bias(cfg: AdamWConfig, t: int) -> tuple[float, float]:
    """``(1 - beta1^t, sqrt(1 - beta2^t))`` in double (the host computes them for every path)."""
    b1, b2 = cfg.betas
    return 1.0 - b1**t, (1.0 - b2**t) ** 0.5


@functools.lru_cache(maxsize=16)
def _scalars(cfg: AdamWConfig, t: int, lr: float) -> tuple[float, float, float, float, float, float, float]:
    """The per-step scalars (cached: ``update`` runs once per cache-sized chunk).  ``kernels/adamw.cu``'s
    ``adamw_multi`` derives ``decay`` and the step size from ``lr`` with these operations, in double."""
    b1, b2 = cfg.betas
    bc1, bc2_sqrt = _bias(cfg, t)
    return 1.0 - lr * cfg.weight_decay, 1.0 - b1, b2, 1.0 - b2, bc2_sqrt, cfg.eps, -(lr / bc1)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: AdamWConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced: the multi-tensor kernel derives ``decay`` and
    ``neg_step`` per tensor with these operations)."""
    b1, b2 = cfg.betas
    bc1, bc2_sqrt = _bias(cfg, t)
    return dict(decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc2_sqrt=bc2_sqrt,
                eps=cfg.eps, neg_step=-(lr / bc1))


DEF = adam_family("adamw", scalars, AdamWConfig(), decoupled=True)  # the step: adam.py `adam_family_step`
_update, _kernel_update, _multi, _scratch = run.bind(DEF)


# ------------------------------------------- the hand-written paths (kept for the transition test until all match)
def hand_update(xp: Any, cfg: AdamWConfig, st: AdamWState, p: Array, g: Array, *, t: int, lr: float,
                scratch: list[Array]) -> None:
    """One step on (chunks of) flat buffers; ``scratch`` holds one buffer the size of ``p``.

    Fourteen in-place ufunc passes (13 without weight decay, one more with amsgrad), each rounded to the dtype, in
    the operation order of ``kernels/adamw.cu``; one temporary, so that a cache-sized chunk of p, g, m, v and the
    temporary stays in the L2 cache from one pass to the next (the driver hands out such chunks)."""
    sc = _scalars(cfg, t, lr)
    if xp is np and not cfg.amsgrad and native.step("adam", (p, g, st.m, st.v), sc, cfg.weight_decay != 0):
        return  # the same operations fused in one compiled pass (core/native.py)
    decay, omb1, b2, omb2, bc2_sqrt, eps, neg_step = sc
    s = scratch[0]
    m, v = st.m, st.v
    mul, add = xp.multiply, xp.add
    if cfg.weight_decay != 0:
        mul(p, decay, p)  # p = p * decay
    xp.subtract(g, m, s)  # m = m + (g - m) * (1 - b1)
    mul(s, omb1, s)
    add(m, s, m)
    mul(g, omb2, s)  # v = v * b2 + (g * (1 - b2)) * g
    mul(s, g, s)
    mul(v, b2, v)
    add(v, s, v)
    src = v
    if cfg.amsgrad:
        xp.maximum(st.vmax, v, out=st.vmax)
        src = st.vmax
    xp.sqrt(src, s)  # p = p + (m / (sqrt(v) / bc2_sqrt + eps)) * neg_step
    xp.divide(s, bc2_sqrt, s)
    add(s, eps, s)
    xp.divide(m, s, s)
    mul(s, neg_step, s)
    add(p, s, p)


def hand_kernel_update(cfg: AdamWConfig, st: AdamWState, p: Array, g: Array, *, t: int, lr: float) -> bool:
    dt = p.dtype.type
    k = kernels.get("adamw.cu", "adamw_step", p.dtype)
    vmax = st.vmax if st.vmax is not None else st.v
    scal = tuple(dt(x) for x in _scalars(cfg, t, lr))
    backend.launch(k, p.size, (p, g, st.m, st.v, vmax, np.int64(p.size), *scal, np.int32(cfg.amsgrad)))
    return True


def _multi_args(cfg: AdamWConfig, t: int, dt: Any) -> tuple[Any, ...]:
    """``adamw_multi``'s arguments after ``base_lr`` (each tensor's decay and step size are derived in the kernel)."""
    b1, b2 = cfg.betas
    bc1, bc2_sqrt = _bias(cfg, t)
    return (float(cfg.weight_decay), bc1, dt(1.0 - b1), dt(b2), dt(1.0 - b2), dt(bc2_sqrt), dt(cfg.eps),
            np.int32(cfg.amsgrad))


HAND_MULTI = MultiTensor("adamw.cu", "adamw_multi",
                    lambda st, p: (st.m, st.v, st.vmax if st.vmax is not None else st.v), _multi_args)


class AdamW(PerParamOptimizer):
    """``AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False)``: see the module doc."""

    algorithm = "adamw"
    config_cls = AdamWConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(_update)  # derived from DEF (core/elementwise)
    kernel_fn = staticmethod(_kernel_update)
    multi_tensor = _multi  # one launch for many tensors on CuPy (core/multi_tensor.py)
    elementwise = True
    scratch_buffers = _scratch
    matters = ("amsgrad",)

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, cautious: bool = False,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None) -> None:
        super().__init__(AdamWConfig(lr, betas, eps, weight_decay, amsgrad, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask)
        run.configure(self, DEF)  # cautious: the reduce-then-map forms (core/elementwise/run.py)


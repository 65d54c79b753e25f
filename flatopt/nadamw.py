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
it ~7e-6 away at β2 = 0.999.  On the CPU the twin's operations run fused in one compiled pass
(``kernels/cpu/elementwise.c`` via ``core/native.py``, the same bits; without a C compiler the twin runs).
``end_iteration`` only counts iterations.  State: ``m``, ``v`` (8 B/param in float32).
``cautious=True``: the direction (both terms together) masked where it disagrees in sign with g, times
numel/(count + 1) per tensor, then added to p at once, not term by term (docs/algorithms.md, cautious).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .adam import adam_moments, bias_corrections, check_common, moments, zeros_state
from .core import backend, kernels, native
from .core.driver import PerParamOptimizer
from .core.elementwise import define, run
from .core.elementwise.define import Cautious
from .core.multi_tensor import MultiTensor
from .core.types import Array, DecayMask, LrScale
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


@dataclasses.dataclass
class NAdamWState:
    m: Array
    v: Array


def init(xp: Any, cfg: NAdamWConfig, shape: tuple[int, ...], dtype: Any) -> NAdamWState:
    return NAdamWState(*zeros_state(xp, math.prod(shape), dtype, 2))


@functools.lru_cache(maxsize=16)
def _scalars(cfg: NAdamWConfig, t: int, lr: float) -> tuple[Any, ...]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    bc1_next = 1.0 - b1 ** (t + 1)
    return (1.0 - lr * cfg.weight_decay, 1.0 - b1, b2, 1.0 - b2, bc2, cfg.eps,
            -lr * (1.0 - b1) / bc1, -lr * b1 / bc1_next)


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: NAdamWConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced: see ``core/elementwise/trace.py``)."""
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    bc1_next = 1.0 - b1 ** (t + 1)
    return dict(decay=1.0 - lr * cfg.weight_decay, omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc2=bc2, eps=cfg.eps,
                c_g=-lr * (1.0 - b1) / bc1, c_m=-lr * b1 / bc1_next, k_g=(1.0 - b1) / bc1, k_m=b1 / bc1_next,
                neg_lr=-lr)  # k_g, k_m, neg_lr: the cautious direction's (its mask's count reads no lr)


def flags(cfg: NAdamWConfig, t: int) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """One element of the update (the module docstring), written once: every path is derived from it."""
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


DEF = define("nadamw", step, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m", "v"),
             example=NAdamWConfig())
_update, _kernel_update, _multi, _scratch = run.bind(DEF)


# ------------------------------------------- the hand-written paths (kept for the transition test until all match)
def hand_update(xp: Any, cfg: NAdamWConfig, st: NAdamWState, p: Array, g: Array, *, t: int, lr: float,
                scratch: list[Array]) -> None:
    """One step on (chunks of) flat buffers; ``scratch`` holds two buffers the size of ``p``, in the operation
    order of ``kernels/nadamw.cu``."""
    sc = _scalars(cfg, t, lr)
    if xp is np and native.step("nadamw", (p, g, st.m, st.v), sc, cfg.weight_decay != 0):
        return  # the same operations fused in one compiled pass (core/native.py)
    decay, omb1, b2, omb2, bc2, eps, c_g, c_m = sc
    s, d = scratch
    if cfg.weight_decay != 0:
        xp.multiply(p, decay, p)
    moments(xp, st.m, st.v, g, omb1, b2, omb2, s)
    xp.divide(st.v, bc2, d)  # d = sqrt(v / bc2) + eps
    xp.sqrt(d, d)
    xp.add(d, eps, d)
    xp.divide(g, d, s)  # p = p + (g / d) * c_g
    xp.multiply(s, c_g, s)
    xp.add(p, s, p)
    xp.divide(st.m, d, s)  # p = p + (m / d) * c_m
    xp.multiply(s, c_m, s)
    xp.add(p, s, p)


def hand_kernel_update(cfg: NAdamWConfig, st: NAdamWState, p: Array, g: Array, *, t: int, lr: float) -> bool:
    dt = p.dtype.type
    k = kernels.get("nadamw.cu", "nadamw_step", p.dtype)
    scal = tuple(dt(x) for x in _scalars(cfg, t, lr))
    backend.launch(k, p.size, (p, g, st.m, st.v, np.int64(p.size), *scal, np.int32(cfg.weight_decay != 0)))
    return True


def _multi_args(cfg: NAdamWConfig, t: int, dt: Any) -> tuple[Any, ...]:
    """``nadamw_multi``'s arguments after ``base_lr``: the float64 operands from which the kernel derives each
    tensor's decay, c_g and c_m as ``_scalars`` does, then the rest rounded to the dtype."""
    b1 = cfg.betas[0]
    _, omb1, b2, omb2, bc2, eps, _, _ = _scalars(cfg, t, 0.0)
    return (float(cfg.weight_decay), b1, omb1, bias_corrections(cfg.betas, t)[0], 1.0 - b1 ** (t + 1), dt(omb1),
            dt(b2), dt(omb2), dt(bc2), dt(eps), np.int32(cfg.weight_decay != 0))


HAND_MULTI = MultiTensor("nadamw.cu", "nadamw_multi", lambda st, p: (st.m, st.v), _multi_args)


class NAdamW(PerParamOptimizer):
    """``NAdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)``: see the module doc."""

    algorithm = "nadamw"
    config_cls = NAdamWConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(_update)  # derived from DEF (core/elementwise)
    kernel_fn = staticmethod(_kernel_update)
    multi_tensor = _multi  # one launch for many tensors on CuPy (core/multi_tensor.py)
    elementwise = True
    scratch_buffers = _scratch

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, cautious: bool = False, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None) -> None:
        super().__init__(NAdamWConfig(lr, betas, eps, weight_decay, cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask)
        run.configure(self, DEF)  # cautious: the reduce-then-map forms (core/elementwise/run.py)

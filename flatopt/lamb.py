"""Lamb: Adam's direction plus λθ, scaled per tensor by the trust ratio ‖θ‖/‖u‖ (You et al. 2020) — optax ``lamb``.

Update rule, per tensor, with t the step count of this parameter and η = lr · lr_scale(name)::

    m  = m + (1 − β1)·(g − m);   v = β2·v + (1 − β2)·g²
    u  = (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε) + λ·p      (λθ inside the update: "in-update" decay)
    φ  = ‖p‖₂,  ψ = ‖u‖₂  (both before the step);   r = φ/ψ if φ > 0 and ψ > 0, else 1
    p  = p + u·(−η·r)

There is no clamp on φ (φ(z) = z).  The norms are sums of squares reduced by ``xp.sum`` (NumPy's pairwise sum: the
same bits on any CPU and BLAS), and r stays a 0-d device array on CuPy (``where``, never ``if``), so a step never
synchronises with the host.  Defaults lr 1e-3 and weight_decay 1e-2 (flatopt AdamW's), betas (0.9, 0.999),
eps 1e-6 (rlx-optim's).

Deviations: none from the paper's Algorithm 2 with bias correction (optax, TF-addons, NVIDIA, rlx-optim);
rlx-optim's ``bias_correction`` switch is not exposed (always on).  A non-finite norm gives r = 1 (optax's ratio
would be NaN and poison the whole tensor; here only the non-finite elements are).  optax raises β to the power t in float32
(~7e-6 away at β2 = 0.999); flatopt uses float64.  Not pytorch-optimizer's ``Lamb``, another algorithm (no bias
correction, decay outside the ratio, ‖θ‖ clamped at 10, ε on ψ).  The conformance tests compare with a float64
transcription of optax's chain (optax/jax are not installed in CI).  GPU: no fused kernel; the twin runs on CuPy
(elementwise passes plus two ``cupy.sum`` reductions, no host synchronisation).  The whole tensor is one task
(the norms need all of it): ``step_batch`` spreads tensors, not chunks, over threads.  ``end_iteration`` only
counts iterations.  State: ``m``, ``v`` (8 B/param in float32) plus two unsaved scratch buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from .adam import bias_corrections, check_common, moments
from .core.driver import PerParamOptimizer
from .core.types import Array, LrScale

_SCRATCH = {"persist": False}


@dataclasses.dataclass(frozen=True)
class LambConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        check_common("Lamb", self)


@dataclasses.dataclass
class LambState:
    m: Array
    v: Array
    s: Array = dataclasses.field(default=None, metadata=_SCRATCH)
    u: Array = dataclasses.field(default=None, metadata=_SCRATCH)


def init(xp: Any, cfg: LambConfig, shape: tuple[int, ...], dtype: Any) -> LambState:
    n = math.prod(shape)
    return LambState(xp.zeros(n, dtype), xp.zeros(n, dtype))


@functools.lru_cache(maxsize=16)
def _scalars(cfg: LambConfig, t: int) -> tuple[Any, ...]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return 1.0 - b1, b2, 1.0 - b2, bc1, bc2, cfg.eps


def trust_ratio(xp: Any, p: Array, u: Array, s: Array) -> Array:
    """where(‖p‖ > 0 and ‖u‖ > 0, ‖p‖/‖u‖, 1), a 0-d array on the device (``s``: a scratch buffer)."""
    xp.multiply(p, p, s)
    phi = xp.sqrt(xp.sum(s))
    xp.multiply(u, u, s)
    psi = xp.sqrt(xp.sum(s))
    ok = (phi > 0) & (psi > 0)
    return xp.where(ok, phi / xp.where(ok, psi, 1), 1)


def update(xp: Any, cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step on a whole flat buffer (not elementwise: the norms need all of it)."""
    omb1, b2, omb2, bc1, bc2, eps = _scalars(cfg, t)
    if st.s is None or st.s.size != p.size:
        st.s, st.u = xp.empty_like(p), xp.empty_like(p)
    s, u = st.s, st.u
    moments(xp, st.m, st.v, g, omb1, b2, omb2, s)
    xp.divide(st.v, bc2, s)  # u = (m / bc1) / (sqrt(v / bc2) + eps) + p * wd
    xp.sqrt(s, s)
    xp.add(s, eps, s)
    xp.divide(st.m, bc1, u)
    xp.divide(u, s, u)
    if cfg.weight_decay != 0:
        xp.multiply(p, cfg.weight_decay, s)
        xp.add(u, s, u)
    r = trust_ratio(xp, p, u, s)
    xp.multiply(u, r * (-lr), u)  # p = p + u * (-lr * r)
    xp.add(p, u, p)


class Lamb(PerParamOptimizer):
    """``Lamb(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2)``: see the module doc."""

    algorithm = "lamb"
    config_cls = LambConfig
    state_cls = LambState
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 1e-2, *, lr_scale: LrScale = None) -> None:
        super().__init__(LambConfig(lr, betas, eps, weight_decay), lr_scale=lr_scale)

"""Lamb: Adam's direction plus λθ, scaled per tensor by the trust ratio ‖θ‖/‖u‖ (You et al. 2020) — optax ``lamb``.

Update rule, per tensor, with t the step count of this parameter and η = lr · lr_scale(name)::

    m  = m + (1 − β1)·(g − m);   v = β2·v + (1 − β2)·g²
    u  = (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε) + λ·p      (λθ inside the update: "in-update" decay)
    φ  = ‖p‖₂,  ψ = ‖u‖₂  (both before the step);   r = φ/ψ if φ > 0 and ψ > 0, else 1
    p  = p + u·(−η·r)

There is no clamp on φ (φ(z) = z).  The norms are sums of squares added in the fused kernel's fixed blocked order
(``core.blocks.sq_sum``: the same bits on NumPy, CuPy and the kernel), and r stays a device array on CuPy (``where``, never ``if``), so a step never
synchronises with the host.  Defaults lr 1e-3 and weight_decay 1e-2 (flatopt AdamW's), betas (0.9, 0.999),
eps 1e-6 (rlx-optim's).

Deviations: none from the paper's Algorithm 2 with bias correction (optax, TF-addons, NVIDIA, rlx-optim);
rlx-optim's ``bias_correction`` switch is not exposed (always on).  A non-finite norm gives r = 1 (optax's ratio
would be NaN and poison the whole tensor; here only the non-finite elements are).  optax raises β to the power t in float32
(~7e-6 away at β2 = 0.999); flatopt uses float64.  Not pytorch-optimizer's ``Lamb``, another algorithm (no bias
correction, decay outside the ratio, ‖θ‖ clamped at 10, ε on ψ).  The conformance tests compare with a float64
transcription of optax's chain (optax/jax are not installed in CI).  GPU: ``kernels/lamb.cu``, three launches per tensor (moments and
the per-block partials of ‖θ‖² and ‖u‖², the fold into r·(−η), the update; no atomics, no host synchronisation), bit-
identical to the twin; ``step_batch`` runs every tensor of one dtype and step count in the same three launches
(``core/multi_tensor.py``, ``Norms``: the same partials, folds and elements).  The whole tensor is one task
(the norms need all of it): ``step_batch`` spreads tensors, not chunks, over threads.  ``end_iteration`` only
counts iterations.  State: ``m``, ``v`` (8 B/param in float32) plus unsaved scratch buffers (the twin's, the kernel's partials).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .adam import bias_corrections, check_common, moments
from .core import backend, blocks, kernels
from .core.driver import PerParamOptimizer
from .core.multi_tensor import MultiTensor, Norms
from .core.types import Array, LrScale

_SCRATCH = {"persist": False}
_CHUNK = 1 << 16  # elements per chunk of the NumPy sweeps (their operands stay in the L2 cache)


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
    parts: Array = dataclasses.field(default=None, metadata=_SCRATCH)  # the kernel's partials and its scalar


def init(xp: Any, cfg: LambConfig, shape: tuple[int, ...], dtype: Any) -> LambState:
    n = math.prod(shape)
    return LambState(xp.zeros(n, dtype), xp.zeros(n, dtype))


@functools.lru_cache(maxsize=16)
def _scalars(cfg: LambConfig, t: int) -> tuple[Any, ...]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return 1.0 - b1, b2, 1.0 - b2, bc1, bc2, cfg.eps


def trust_ratio(xp: Any, p: Array, u: Array, s: Array) -> Array:
    """where(‖p‖ > 0 and ‖u‖ > 0, ‖p‖/‖u‖, 1), a 1-element array on the device (``s``: ``blocks.sq_scratch``; the
    sums of squares in the blocked order of ``kernels/lamb.cu``)."""
    n = p.size
    xp.multiply(p, p, s[:n])
    phi = xp.sqrt(blocks.sq_sum(xp, s, n))
    xp.multiply(u, u, s[:n])
    psi = xp.sqrt(blocks.sq_sum(xp, s, n))
    return _ratio(xp, phi, psi)


def _ratio(xp: Any, phi: Array, psi: Array) -> Array:
    ok = (phi > 0) & (psi > 0)
    return xp.where(ok, phi / xp.where(ok, psi, 1), 1)


def _update_np(cfg: LambConfig, st: LambState, p: Array, g: Array, lr: float, scal: tuple[Any, ...]) -> None:
    """NumPy: ``update``'s operations on every element, cut into cache-sized chunks (one sweep for the moments, u
    and p², one for u², one for the step instead of ~17 sweeps over the whole buffers); the sums of squares are
    the same ``blocks.sq_sum`` calls over the same squares, so the bits are ``update``'s."""
    omb1, b2, omb2, bc1, bc2, eps = scal
    n = p.size
    wd = cfg.weight_decay
    sq, u, m, v = st.s, st.u, st.m, st.v
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        sc, uc, mc, vc, pc = sq[lo:hi], u[lo:hi], m[lo:hi], v[lo:hi], p[lo:hi]
        moments(np, mc, vc, g[lo:hi], omb1, b2, omb2, sc)
        np.divide(vc, bc2, sc)  # u = (m / bc1) / (sqrt(v / bc2) + eps) + p * wd
        np.sqrt(sc, sc)
        np.add(sc, eps, sc)
        np.divide(mc, bc1, uc)
        np.divide(uc, sc, uc)
        if wd != 0:
            np.multiply(pc, wd, sc)
            np.add(uc, sc, uc)
        np.multiply(pc, pc, sc)
    phi = np.sqrt(blocks.sq_sum(np, sq, n)[0])  # NumPy scalars of the dtype: the same roundings as the arrays
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        uc = u[lo:hi]
        np.multiply(uc, uc, sq[lo:hi])
    psi = np.sqrt(blocks.sq_sum(np, sq, n)[0])
    r = phi / psi if phi > 0 and psi > 0 else p.dtype.type(1)
    step = r * (-lr)  # p = p + u * (-lr * r)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        uc, pc = u[lo:hi], p[lo:hi]
        np.multiply(uc, step, uc)
        np.add(pc, uc, pc)


def update(xp: Any, cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step on a whole flat buffer (not elementwise: the norms need all of it)."""
    omb1, b2, omb2, bc1, bc2, eps = _scalars(cfg, t)
    n = p.size
    if st.u is None or st.u.size != n:
        st.s, st.u = blocks.sq_scratch(xp, n, p.dtype), xp.empty_like(p)
    if xp is np:
        _update_np(cfg, st, p, g, lr, (omb1, b2, omb2, bc1, bc2, eps))
        return
    s, u = st.s[:n], st.u
    moments(xp, st.m, st.v, g, omb1, b2, omb2, s)
    xp.divide(st.v, bc2, s)  # u = (m / bc1) / (sqrt(v / bc2) + eps) + p * wd
    xp.sqrt(s, s)
    xp.add(s, eps, s)
    xp.divide(st.m, bc1, u)
    xp.divide(u, s, u)
    if cfg.weight_decay != 0:
        xp.multiply(p, cfg.weight_decay, s)
        xp.add(u, s, u)
    r = trust_ratio(xp, p, u, st.s)
    xp.multiply(u, r * (-lr), u)  # p = p + u * (-lr * r)
    xp.add(p, u, p)


def kernel_update(cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float) -> bool:
    """``kernels/lamb.cu``: three launches (moments + partials, the ratio, the update), no host synchronisation; the
    partials' buffer is allocated once per name."""
    n = p.size
    if n == 0:
        return True
    nb = blocks.sq_blocks(n)
    if st.parts is None or st.parts.size != 2 * nb + 1:
        st.parts = backend.cupy().empty(2 * nb + 1, p.dtype)
    parts, scal = st.parts[:2 * nb], st.parts[2 * nb:]
    omb1, b2, omb2, bc1, bc2, eps = _scalars(cfg, t)
    dt, i64 = p.dtype.type, np.int64
    wd, has_wd = dt(cfg.weight_decay), np.int32(cfg.weight_decay != 0)
    threads = blocks.SQ_THREADS
    kernels.get("lamb.cu", "lamb_moments", p.dtype)((nb,), (threads,), (
        p, g, st.m, st.v, i64(n), dt(omb1), dt(b2), dt(omb2), dt(bc1), dt(bc2), dt(eps), wd, has_wd, parts))
    kernels.get("lamb.cu", "lamb_ratio", p.dtype)((1,), (threads,), (parts, i64(nb), dt(-lr), scal))
    backend.launch(kernels.get("lamb.cu", "lamb_apply", p.dtype), n,
                   (p, st.m, st.v, i64(n), dt(bc1), dt(bc2), dt(eps), wd, has_wd, scal), threads)
    return True


def _partial_args(cfg: LambConfig, t: int, dt: Any) -> tuple[Any, ...]:
    """``lamb_partials_multi``'s arguments after the partials (``lamb_moments``' scalars)."""
    return (*(dt(x) for x in _scalars(cfg, t)), dt(cfg.weight_decay), np.int32(cfg.weight_decay != 0))


def _apply_args(cfg: LambConfig, t: int, dt: Any) -> tuple[Any, ...]:
    """``lamb_apply_multi``'s arguments after ``base_lr`` (``lamb_apply``'s scalars; r·(−lr) comes from the fold)."""
    bc1, bc2, eps = _scalars(cfg, t)[3:]
    return dt(bc1), dt(bc2), dt(eps), dt(cfg.weight_decay), np.int32(cfg.weight_decay != 0)


# A group of tensors in three launches on CuPy (core/multi_tensor.py): the partials of ‖θ‖² and ‖u‖² of every
# tensor, the per-tensor folds into r·(−lr), the update.
MULTI = MultiTensor("lamb.cu", "lamb_apply_multi", lambda st, p: (st.m, st.v), _apply_args,
                    norms=Norms(2, "lamb_partials_multi", "lamb_ratio_multi", _partial_args))


class Lamb(PerParamOptimizer):
    """``Lamb(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2)``: see the module doc."""

    algorithm = "lamb"
    config_cls = LambConfig
    state_cls = LambState
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    kernel_fn = staticmethod(kernel_update)
    multi_tensor = MULTI

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 1e-2, *, lr_scale: LrScale = None) -> None:
        super().__init__(LambConfig(lr, betas, eps, weight_decay), lr_scale=lr_scale)

"""Soap: Adam in the eigenbasis of Shampoo's statistics — the official nikhilvyas/SOAP rule (Vyas et al., 2024).

Per parameter, with t its step count (advanced inside ``step``), k = t − 1 and η = lr · lr_scale(name).  Every
axis i of a tensor with ≥ 2 dims whose size dᵢ ≤ ``max_precond_dim`` is *preconditioned*; a 1-D tensor only with
``precondition_1d`` (and n ≤ ``max_precond_dim``); a 0-d tensor never.  A preconditioned axis keeps a statistic
Lᵢ (dᵢ×dᵢ) and an orthonormal basis Qᵢ; every other axis uses the identity::

    Oᵢ(G) = G₍ᵢ₎G₍ᵢ₎ᵀ (every axis but i contracted: GGᵀ and GᵀG for a matrix);  β_s = shampoo_beta or β2
    P(X)  = X with axis i multiplied by Qᵢᵀ (Q_LᵀXQ_R for a matrix);  P⁻¹(X): by Qᵢ (Q_L X Q_Rᵀ)

    t = 1:  Lᵢ = (1 − β_s)·Oᵢ(G);  Qᵢ = eigenvectors of Lᵢ + 1e-30·I, descending eigenvalues;  θ unchanged
    t ≥ 2:  G′ = P(G)
            m  = m + (1 − β1)(G − m)                        (original coordinates)
            v  = v + (1 − β2)(G′² − v)                      (eigen coordinates)
            θ  = θ − η·√(1 − β2ᵏ)/(1 − β1ᵏ) · P⁻¹(P(m) / (√v + ε))
            θ  = θ·(1 − η·weight_decay)                     (decoupled, *after* the step: the official order)
            Lᵢ = Lᵢ + (1 − β_s)(Oᵢ(G) − Lᵢ)                 (G shapes only later projections)
            if k mod precondition_frequency = 0, for each preconditioned i in axis order (one power iteration):
                M = LᵢQᵢ;  π = argsort(diag(QᵢᵀM), descending);  v permuted along axis i by π;  Qᵢ = qr(M[:, π]).Q

Defaults (the official code's): lr 3e-3, betas (0.95, 0.95), shampoo_beta None (= β2), eps 1e-8, weight_decay
1e-2, precondition_frequency 10, max_precond_dim 10000, precondition_1d False.  Arithmetic, statistics and bases
are in the parameter's dtype; the eigendecomposition of the first call is ``xp.linalg.eigh`` (NumPy computes a
float32 input in float64 and rounds the vectors; CuPy in float32), retried in float64 when it raises, as the
oracle does; the refresh's QR is cuSOLVER's on CuPy and, on NumPy, ``soap.numerics.householder_q`` in the
parameter's dtype (the same reflectors as LAPACK, ~10× faster than ``numpy.linalg.qr`` at d = 2048).
``end_iteration`` only counts iterations: the refresh schedule follows the per-name t, which the checkpoint
saves with m, v, the statistics ``gg`` and the bases ``q`` (Σdᵢ² floats each, concatenated in axis order), so a
resumed run refreshes at the same steps, bit for bit.  ``max_precond_dim`` and ``precondition_1d`` fix the state
layout, so a snapshot loads only into an optimizer with the same values.

**Deviations from pytorch-optimizer 4.1.0 ``SOAP``** (the oracle; it matches the official HEAD to ~1e-6): a
matrix is projected by two matrix products instead of two ``tensordot`` calls (same products, another summation
order); the QR runs in the parameter's dtype (the oracle casts to float32, so float64 parameters differ there);
the step count is per name (the oracle's is per group: identical whenever every parameter gets a gradient every
step); descending ``argsort`` ties may break differently.  ``max_precond_dim`` is the official name (the oracle:
``max_precondition_dim``).  Not offered: ``merge_dims``, ``data_format``, ``normalize_gradient``,
``correct_bias=False``, ``maximize``.  **From the official code:** m lives in original coordinates instead of
being stored in the eigenbasis and re-projected when the basis changes (the same in exact arithmetic).  **Not
copied from rlx-optim:** L and R absorbing the current G before it is projected; a step on the first call; m and
v left in the old basis when it changes; a cyclic-Jacobi ``eigh`` with absolute tolerances that never rotates for
gradients below ~1e-3 (SOAP silently becoming Adam); the refresh following the global ``end_iteration`` counter;
the decay inside the step; AdamW for non-2-D tensors; no ``state_dict``.  ``jacobi_sweeps`` is dropped.

**The basis is not unique** where a statistic is rank-deficient (the long side of a non-square matrix, a
preconditioned vector): LAPACK builds (and cuSOLVER) may pick different bases of the null space, so two
backends agree there only up to that choice; both are valid SOAP.

When to use: transformer-sized matrices, where Shampoo-quality preconditioning pays for its cost; set
``max_precond_dim`` below a vocabulary-sized axis (that axis then uses the identity).  Cost per step of an
r×c matrix: six projections (O(rc(r + c)) each), two Grams, and every ``precondition_frequency`` steps a QR and a
product per axis; the first step is an ``eigh`` per axis (on NumPy, OpenBLAS's float64 ``dsyevd``: seconds at
d = 2048, several times torch's MKL — a one-off cost).  Memory: 8 bytes/param (fp32) + 8(dᵢ²) per
axis (24 for a square matrix).  On NumPy the work is matrix products on the BLAS, so ``step_batch`` runs items
serially (``threaded = False``), each step with the BLAS held at one thread (``blas_bound``: ``core.shards``' cap, in
every mode): every bit is the serial loop's, under any BLAS thread count and beside any other thread's steps.  Against
pytorch-optimizer's SOAP it is about as fast on transformer-sized matrices (the time goes to the BLAS and LAPACK)
and slower on small ones (d = 64: a NumPy call per operation); re-measure: ``python -m benchmarks.run --only soap``.
On CuPy
nothing reads a device value on the host (see ``soap.numerics``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from . import numerics as N
from ..core.driver import PerParamOptimizer
from ..core.precision import Precision
from ..core.types import Array, DecayMask, LrScale
from ..core.validate import check_lr, check_range, normalize_numbers


def _check_int(field: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"Soap: {field} must be an int, got {v!r}")
    if v < lo:
        raise ValueError(f"Soap: {field} must be an int >= {lo}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class SoapConfig:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float | None = None  # None: betas[1]
    eps: float = 1e-8
    weight_decay: float = 1e-2
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    precondition_1d: bool = False

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_lr(self.lr, "lr", "Soap")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise TypeError(f"Soap: betas must be a pair of floats, got {self.betas!r}")
        check_range("Soap", "betas[0]", self.betas[0], 0.0, 1.0, hi_open=True)
        check_range("Soap", "betas[1]", self.betas[1], 0.0, 1.0, hi_open=True)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if self.shampoo_beta is not None:
            check_range("Soap", "shampoo_beta", self.shampoo_beta, 0.0, 1.0, hi_open=True)
            object.__setattr__(self, "shampoo_beta", float(self.shampoo_beta))
        check_range("Soap", "eps", self.eps, 0.0, math.inf)
        check_range("Soap", "weight_decay", self.weight_decay, 0.0, math.inf)
        _check_int("precondition_frequency", self.precondition_frequency, 1)
        _check_int("max_precond_dim", self.max_precond_dim, 1)
        object.__setattr__(self, "precondition_frequency", int(self.precondition_frequency))
        object.__setattr__(self, "max_precond_dim", int(self.max_precond_dim))
        if not isinstance(self.precondition_1d, bool):
            raise TypeError(f"Soap: precondition_1d must be a bool, got {self.precondition_1d!r}")

    @property
    def beta_s(self) -> float:
        return self.betas[1] if self.shampoo_beta is None else self.shampoo_beta


@dataclasses.dataclass
class SoapState:
    exp_avg: Array  # m, original coordinates (flat)
    exp_avg_sq: Array  # v, eigen coordinates (flat, in the parameter's shape)
    gg: Array  # the statistics Lᵢ, dᵢ×dᵢ row-major, concatenated in axis order
    q: Array  # the bases Qᵢ, same layout
    layout: N.Layout | None = dataclasses.field(default=None, metadata={"persist": False})


def init(xp: Any, cfg: SoapConfig, shape: tuple[int, ...], dtype: Any) -> SoapState:
    lay = N.make_layout(tuple(shape), cfg.max_precond_dim, cfg.precondition_1d)
    n = math.prod(shape)
    return SoapState(xp.zeros(n, dtype), xp.zeros(n, dtype), xp.zeros(lay.size, dtype), xp.zeros(lay.size, dtype),
                     layout=lay)


def update(xp: Any, cfg: SoapConfig, st: SoapState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step of one parameter (whole flat buffers; ``scratch`` is unused)."""
    lay = st.layout
    assert lay is not None
    if p.size == 0:
        return
    shape = lay.shape
    G = g.reshape(shape)
    stats, bases = lay.factors(st.gg), lay.factors(st.q)
    ws = 1.0 - cfg.beta_s
    if t == 1:  # initialise the preconditioner; no step, no decay
        for axis, _, _ in lay.axes:
            xp.multiply(N.gram(xp, G, axis), ws, out=stats[axis])  # = L + (O - L)(1 - beta_s) from L = 0
            bases[axis][...] = N.eigenbasis(xp, stats[axis])
        return
    k = t - 1
    b1, b2 = cfg.betas
    m, v = st.exp_avg, st.exp_avg_sq
    n, dt = p.size, p.dtype
    tmp = N.buf(xp, "t", (n,), dt)
    xp.subtract(g, m, out=tmp)  # m = m + (g - m)(1 - b1)
    tmp *= 1.0 - b1
    m += tmp
    gp = N.project(xp, G, bases)  # G' = P(G)
    xp.multiply(gp, gp, out=tmp.reshape(shape))  # v = v + (G'^2 - v)(1 - b2)
    tmp -= v
    tmp *= 1.0 - b2
    v += tmp
    den = xp.sqrt(v, out=N.buf(xp, "den", (n,), dt))
    den += cfg.eps
    mp = N.project(xp, m.reshape(shape), bases)
    xp.divide(mp.reshape(-1), den, out=den)  # P(m) / (sqrt(v) + eps)
    direction = N.project(xp, den.reshape(shape), bases, back=True)
    direction *= -(lr * math.sqrt(1.0 - b2**k) / (1.0 - b1**k))
    p += direction.reshape(-1)
    if cfg.weight_decay != 0:
        p *= 1.0 - lr * cfg.weight_decay
    for axis, _, _ in lay.axes:  # L = L + (O(G) - L)(1 - beta_s)
        o = N.gram(xp, G, axis)
        o -= stats[axis]
        o *= ws
        stats[axis] += o
    if lay.axes and k % cfg.precondition_frequency == 0:
        N.refresh(xp, stats, bases, v.reshape(shape))


_D = SoapConfig  # the constructor's defaults: written once, in the config


class Soap(PerParamOptimizer):
    """``Soap(...)``: see the module doc."""

    algorithm = "soap"
    config_cls = SoapConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    matters = ("max_precond_dim", "precondition_1d")
    threaded = False  # matrix products on the BLAS (see the module doc)
    blas_bound = True  # ... held at one thread

    def __init__(self, lr: float = _D.lr, betas: tuple[float, float] = _D.betas,
                 shampoo_beta: float | None = _D.shampoo_beta, eps: float = _D.eps,
                 weight_decay: float = _D.weight_decay, precondition_frequency: int = _D.precondition_frequency,
                 max_precond_dim: int = _D.max_precond_dim, precondition_1d: bool = _D.precondition_1d, *,
                 lr_scale: LrScale | None = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(SoapConfig(lr, betas, shampoo_beta, eps, weight_decay, precondition_frequency,
                                    max_precond_dim, precondition_1d), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)

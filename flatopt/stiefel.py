"""Stiefel: Riemannian SGD on the Stiefel manifold {W : orthonormal along its shorter side}, QR retraction.

Shapes: ndim ≥ 2; leading dims are a batch of independent matrices.  For the last two dims (r, c) the rows are
orthonormal (WWᵀ = I) when r ≤ c, else the columns (WᵀW = I).  A 0-d or 1-D shape raises ``ValueError`` naming
the parameter before anything is touched (rlx-optim silently ran plain SGD on it); a shape with a zero dim is a
no-op.  The rule is written on the tall orientation X (n×p, XᵀX = I): X = Wᵀ, D = Gᵀ when r ≤ c, else X = W,
D = G; with η = lr · lr_scale(name), μ = momentum and sym(A) = (A + Aᵀ)/2::

    first step of a name:  X ← qf(X)                     (off-manifold starts are projected, see below)
    ξ = D − X·sym(XᵀD)                                   (Riemannian gradient: D projected on the tangent space)
    μ > 0:  b ← μ·b + ξ (b = 0 at creation);  d = b      else d = ξ
    X ← qf(X − η·d)                                      (QR retraction)
    μ > 0:  b ← b − X·sym(Xᵀb)                           (transport: b projected on the new tangent space)

qf(Y) = Q·diag(sⱼ) of the reduced Householder QR Y = QR, sⱼ = sign(Rⱼⱼ) with sign(0) = +1, so that qf(X) = X
for X on the manifold (up to rounding).  The QR is cuSOLVER's (``cupy.linalg.qr``, batched) on CuPy and
``core.linalg.householder_q`` on NumPy (LAPACK's algorithm in the parameter's dtype: ``numpy.linalg.qr`` runs
float32 in float64 and allocates); the temporaries are per-thread ``core.workspace`` buffers on NumPy, so a step
allocates nothing of the parameter's size after the first.

**Off-manifold starts are projected, not refused**: the first step of a name first replaces X by qf(X), the
nearest-by-QR point of the manifold, then takes the step from there (a check would cost a host synchronisation
on CuPy and would refuse the usual random initialisation).  After that every step ends on the manifold (to
rounding: ‖WWᵀ − I‖_max stayed ≤ 6.2e-8 in float32 over 1,000 steps, as each step re-orthonormalises).  A step
with η = 0 (``lr`` or ``lr_scale`` 0) is a no-op — parameter and state untouched, so a frozen parameter does not
move, not even by the start projection, which then happens at its first step with η > 0.

No weight decay: P_W(λW) = 0 on the manifold (W·sym(WᵀW)·λ = λW), so decoupled or L2 decay means nothing here.
``end_iteration`` only counts iterations.  State: ``buf`` (only when momentum > 0, in the parameter's layout) and
``started`` (whether the start projection was done).  ``momentum != 0`` must agree for a snapshot to load.

**Oracle**: geoopt 0.5.1 ``RiemannianSGD([ManifoldParameter(X, manifold=EuclideanStiefel())], lr, momentum)`` on
the tall orientation, with ``state["momentum_buffer"] = zeros`` seeded before its first step (unseeded, geoopt
clones the raw Euclidean gradient into the buffer and then adds the Riemannian one: b₁ = μG + ξ, a different
rule) and started from qf(W₀) (geoopt never projects the start).  Deviations from it: the start projection; the
η = 0 no-op; no ``weight_decay``/``dampening``/``nesterov``/``stabilize``; NumPy's LAPACK QR vs torch's (same
Householder convention; measured ≤ 9.2e-7 apart after 10 float32 steps).  geoopt's ``Stiefel()`` is
``CanonicalStiefel`` (Cayley retraction), another rule.
**rlx-optim defects not copied**: no momentum transport (its buffer accumulates normal components), plain SGD on
tall and non-2-D shapes.  Its modified Gram–Schmidt is the same retraction in exact arithmetic.

When to use: weights that must stay orthonormal (orthogonal RNN cells, whitening/rotation layers, orthogonal
adapters).  Cost per step of an n×p matrix: three or five products of O(np²) and one QR; the QR dominates.  On
NumPy the work is BLAS, so ``step_batch`` runs items serially (``threaded = False``), each step with the BLAS held at
one thread (``blas_bound``: ``core.shards``' cap, in every mode): bits equal the serial loop's under any BLAS thread
count and beside any other thread's steps.  Measured on the 38 matrices of a transformer-like set (24.1M elements, 2 cores,
``benchmarks/bench_stiefel.py``): 0.58× geoopt's speed — torch's QR is MKL's, NumPy has no float32 LAPACK QR
(``householder_q``'s panels are Python loops of level-2 operations).  On CuPy nothing reads a device value on the
host (the sign fix is a device ``where``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .core import linalg
from .core.driver import PerParamOptimizer
from .core.precision import Precision
from .core.types import Array, LrScale
from .core.validate import check_lr, check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class StiefelConfig:
    lr: float
    momentum: float = 0.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_lr(self.lr, "lr", "Stiefel")
        check_range("Stiefel", "momentum", self.momentum, 0.0, 1.0, hi_open=True)

    @property
    def has_momentum(self) -> bool:
        return self.momentum != 0


@dataclasses.dataclass
class StiefelState:
    buf: Array = None  # momentum b (flat, the parameter's layout); None without momentum
    started: bool = False  # the start projection X <- qf(X) is done
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata={"persist": False})


def init(xp: Any, cfg: StiefelConfig, shape: tuple[int, ...], dtype: Any) -> StiefelState:
    return StiefelState(buf=xp.zeros(math.prod(shape), dtype) if cfg.has_momentum else None, shape=tuple(shape))


def _tall(a: Array, shape: tuple[int, ...]) -> Array:
    """The (batch, n, p) tall-orientation view of a flat buffer of ``shape``."""
    r, c = shape[-2], shape[-1]
    x = a.reshape(-1, r, c)
    return x.transpose(0, 2, 1) if r <= c else x


def _scratch(xp: Any, key: str, shape: tuple[int, ...], dtype: Any) -> Array:
    return linalg.scratch(xp, "stiefel_" + key, shape, dtype)


def _project(xp: Any, x: Array, u: Array, out: Array) -> Array:
    """out = u − X·sym(XᵀU): u projected on the tangent space at X (batched; ``out`` may be ``u``)."""
    b, n, p = x.shape
    a = xp.matmul(x.transpose(0, 2, 1), u, out=_scratch(xp, "a", (b, p, p), x.dtype))
    s = xp.add(a.transpose(0, 2, 1), a, out=_scratch(xp, "s", (b, p, p), x.dtype))  # geoopt: 0.5·(Aᵀ + A)
    s *= 0.5
    xs = xp.matmul(x, s, out=_scratch(xp, "xs", (b, n, p), x.dtype))
    return xp.subtract(u, xs, out=out)


def _retract(xp: Any, y: Array, x: Array) -> None:
    """x[...] = qf(y) = Q·diag(sign(diag R)) of the reduced QR of every matrix of ``y`` (sign(0) = +1)."""
    if xp is np:  # LAPACK's Householder QR in the parameter's dtype, allocation-free (core.linalg)
        q = _scratch(xp, "q", y.shape, y.dtype)
        d = np.empty(y.shape[::2], y.dtype)
        for i in range(y.shape[0]):
            d[i] = linalg.householder_q(y[i], out=q[i])[1]
    else:
        q, r = xp.linalg.qr(y)
        d = xp.diagonal(r, axis1=-2, axis2=-1)
    sign = xp.where(d < 0, -1.0, 1.0).astype(y.dtype)
    xp.multiply(q, sign[:, None, :], out=x)


def update(xp: Any, cfg: StiefelConfig, st: StiefelState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step of one parameter (whole flat buffers; ``scratch`` is unused)."""
    if p.size == 0 or lr == 0:
        return
    x = _tall(p, st.shape)
    if not st.started:
        _retract(xp, x, x)
        st.started = True
    xi = _project(xp, x, _tall(g, st.shape), _scratch(xp, "xi", x.shape, x.dtype))
    if cfg.has_momentum:
        b = _tall(st.buf, st.shape)
        b *= cfg.momentum
        b += xi
        xi = b
    y = xp.multiply(xi, lr, out=_scratch(xp, "y", x.shape, x.dtype))
    _retract(xp, xp.subtract(x, y, out=y), x)  # qf(X − η·d)
    if cfg.has_momentum:
        _project(xp, x, b, b)


_D = StiefelConfig  # the constructor's defaults: written once, in the config


class Stiefel(PerParamOptimizer):
    """``Stiefel(...)``: see the module doc."""

    algorithm = "stiefel"
    config_cls = StiefelConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    threaded = False  # BLAS/LAPACK work (see the module doc)
    blas_bound = True  # ... held at one thread

    def __init__(self, lr: float, momentum: float = _D.momentum, *, lr_scale: LrScale | None = None,
                 precision: Precision | None = None) -> None:
        super().__init__(StiefelConfig(lr, momentum), lr_scale=lr_scale, precision=precision)
        self.hooks = self.hooks.replace(check_shape=self._check_matrix)

    def _config_key(self) -> dict[str, Any]:  # the state layout: a momentum buffer or none
        return {"has_momentum": self.config.has_momentum}

    def _check_matrix(self, name: str, shape: tuple[int, ...]) -> None:
        if len(shape) < 2:
            raise ValueError(f"parameter {name!r}: Stiefel needs a matrix (or a batch of matrices), got shape "
                             f"{shape}; route vectors and scalars to another optimizer (flatopt.routing)")

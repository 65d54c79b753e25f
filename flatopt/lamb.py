"""Lamb: Adam's direction plus λθ, scaled per tensor by the trust ratio ‖θ‖/‖u‖ (You et al. 2020) — optax ``lamb``.

Update rule, per tensor, with t the step count of this parameter and η = lr · lr_scale(name)::

    m  = m + (1 − β1)·(g − m);   v = β2·v + (1 − β2)·g²
    u  = (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε) + λ·p      (λθ inside the update: "in-update" decay)
    φ  = ‖p‖₂,  ψ = ‖u‖₂  (both before the step);   r = φ/ψ if φ > 0 and ψ > 0, else 1
    p  = p + u·(−η·r)

There is no clamp on φ (φ(z) = z).  The norms are sums of squares added in the fused kernel's fixed blocked order
(``core.sqsum.sq_sum``: the same bits on NumPy, CuPy and the kernel), and r stays a device array on CuPy (``where``, never ``if``), so a step never
synchronises with the host.  Defaults lr 1e-3 and weight_decay 1e-2 (flatopt AdamW's), betas (0.9, 0.999),
eps 1e-6 (rlx-optim's).

Deviations: none from the paper's Algorithm 2 with bias correction (optax, TF-addons, NVIDIA, rlx-optim);
rlx-optim's ``bias_correction`` switch is not exposed (always on).  A non-finite norm gives r = 1 (optax's ratio
would be NaN and poison the whole tensor; here only the non-finite elements are).  optax raises β to the power t in
float32 (~7e-6 away at β2 = 0.999); flatopt uses float64.  Not pytorch-optimizer's ``Lamb``, another algorithm (no
bias correction, decay outside the ratio, ‖θ‖ clamped at 10, ε on ψ).  The conformance tests compare with a float64
transcription of optax's chain (optax/jax are not installed in CI).  GPU: ``kernels/lamb.cu``, three launches per
tensor (moments and the per-block partials of ‖θ‖² and ‖u‖², the fold into r·(−η), the update; no atomics, no host
synchronisation), bit-identical to the twin; ``step_batch`` runs every tensor of one dtype and step count in the
same three launches (``core/multi_tensor.py``, ``Norms``: the same partials, folds and elements).  NumPy
(``core/cpu_tensors.py``): a large tensor's sweeps run on the threads in two phases around the norms, small tensors
of one size are updated together as rows; the same bits (the sums keep the blocked order, ``core/norms.py``).  The
first phase's operations per piece (moments, u, p² and u² into the column sums) run fused in one compiled pass where
a C compiler exists (``kernels/cpu/elementwise.c`` via ``core/native.py``; the same bits).  ``end_iteration`` only
counts iterations.  State: ``m``, ``v`` (8 B/param in float32) plus unsaved scratch buffers (the twin's, the
kernel's partials).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator

import numpy as np

from .adam import bias_corrections, check_common, moments
from .core import backend, blocks, cpu_plan, driver, kernels, native, norms, sqsum
from .core.driver import PerParamOptimizer
from .core.elementwise import define, run
from .core.multi_tensor import MultiTensor, Norms
from .core.types import Array, DecayMask, LrScale
from .core.validate import normalize_numbers

_SCRATCH = {"persist": False}


@dataclasses.dataclass(frozen=True)
class LambConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Lamb", self)


@dataclasses.dataclass
class LambState:
    m: Array
    v: Array
    s: Array = dataclasses.field(default=None, metadata=_SCRATCH)
    u: Array = dataclasses.field(default=None, metadata=_SCRATCH)
    parts: Array = dataclasses.field(default=None, metadata=_SCRATCH)  # the kernel's partials and its scalar
    work: Array = dataclasses.field(default=None, metadata=_SCRATCH)  # the sums' work area (core/elementwise)


def init(xp: Any, cfg: LambConfig, shape: tuple[int, ...], dtype: Any) -> LambState:
    n = math.prod(shape)
    return LambState(xp.zeros(n, dtype), xp.zeros(n, dtype))


@functools.lru_cache(maxsize=16)
def _scalars(cfg: LambConfig, t: int) -> tuple[Any, ...]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return 1.0 - b1, b2, 1.0 - b2, bc1, bc2, cfg.eps


def trust_ratio(xp: Any, p: Array, u: Array, s: Array) -> Array:
    """where(‖p‖ > 0 and ‖u‖ > 0, ‖p‖/‖u‖, 1), a 1-element array on the device (``s``: ``sqsum.sq_scratch``; the
    sums of squares in the blocked order of ``kernels/lamb.cu``)."""
    n = p.size
    xp.multiply(p, p, s[:n])
    phi = xp.sqrt(sqsum.sq_sum(xp, s, n))
    xp.multiply(u, u, s[:n])
    psi = xp.sqrt(sqsum.sq_sum(xp, s, n))
    return _ratio(xp, phi, psi)


def _ratio(xp: Any, phi: Array, psi: Array) -> Array:
    ok = (phi > 0) & (psi > 0)
    return xp.where(ok, phi / xp.where(ok, psi, 1), 1)


# ----------------------------------------------------------------------------------------------- NumPy paths
# ``update``'s operations per element, in cache-sized blocks (a sweep for the moments, u, p² and u², a sweep for the
# step, instead of ~17 sweeps over whole buffers), the sums of squares in ``sqsum.sq_sum``'s order
# (``core.norms``), the trust ratio on NumPy values of the dtype: the bits of ``update``.
def _direction(m: Array, v: Array, p: Array, g: Array, u: Array, s: Array, scal: tuple[Any, ...], wd: float) -> None:
    """The moments, then u = (m / bc1) / (sqrt(v / bc2) + eps) + p * wd (arrays of any one shape; ``s`` scratch)."""
    omb1, b2, omb2, bc1, bc2, eps = scal
    moments(np, m, v, g, omb1, b2, omb2, s)
    np.divide(v, bc2, s)
    np.sqrt(s, s)
    np.add(s, eps, s)
    np.divide(m, bc1, u)
    np.divide(u, s, u)
    if wd != 0:
        np.multiply(p, wd, s)
        np.add(u, s, u)


def _columns(arrays: tuple[Array, ...], lay: norms.Columns, acc_p: Array, acc_u: Array, scal: tuple[Any, ...],
             wd: float, chunk: int, c0: int, c1: int) -> None:
    """Columns [c0, c1) of the column layout (``core.norms``), in row order: u, and the column sums of p² and u²."""
    p, g, m, v, u = arrays
    s = cpu_plan.scratch(p.dtype, 1, chunk)[0]
    for start, rows, w, col, first in norms.blocks(lay, c0, c1, chunk):
        a, b = start, start + rows * w
        pc, uc = p[a:b], u[a:b]
        accs = (acc_p[col:col + w], acc_u[col:col + w])
        if native.columns("lamb_columns", (pc, g[a:b], m[a:b], v[a:b], uc), accs, rows, w, scal + (wd,),
                          first | (wd != 0) << 1):
            continue  # the same operations in one compiled pass (core/native.py)
        _direction(m[a:b], v[a:b], pc, g[a:b], uc, s[:b - a], scal, wd)
        norms.add_squares(acc_p[col:col + w], pc, rows, first, s)
        norms.add_squares(acc_u[col:col + w], uc, rows, first, s)


def _apply(u: Array, p: Array, step: Any, chunk: int, lo: int, hi: int) -> None:
    for a in range(lo, hi, chunk):  # p = p + u * (-lr * r)
        b = min(a + chunk, hi)
        uc = u[a:b]
        if native.step("lamb_apply", (p[a:b], uc), (step,), 0):
            continue  # the same operations in one compiled pass (core/native.py), u left as it is
        np.multiply(uc, step, uc)
        np.add(p[a:b], uc, p[a:b])


def hand_np_phases(cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float, chunk: int) -> Iterator[Any]:
    """NumPy: ``update`` as two phases of tasks (``core.cpu_tensors``): column ranges making u and the column sums
    of p² and u², then (after the fold into r) ranges of the step.  Scratch: ``u`` and, on NumPy, ``parts`` (the
    column sums and the fold's work area)."""
    n = p.size
    if n == 0:
        return
    scal = _scalars(cfg, t)
    lay = norms.columns(n)
    cols = lay.cols
    if st.u is None or st.u.size != n:
        st.u = np.empty_like(p)
    need = 2 * cols + norms.fold_len(lay.nb)
    if st.parts is None or st.parts.size != need:
        st.parts = np.zeros(need, p.dtype)  # columns without a term stay 0
    acc_p, acc_u, work = st.parts[:cols], st.parts[cols:2 * cols], st.parts[2 * cols:]
    arrays = (p, g, st.m, st.v, st.u)
    wd = cfg.weight_decay
    yield [(cost, functools.partial(_columns, arrays, lay, acc_p, acc_u, scal, wd, chunk, c0, c1))
           for cost, c0, c1 in norms.column_ranges(lay, chunk)]
    phi = np.sqrt(norms.sq_fold(acc_p, lay.nb, work)[0])  # NumPy scalars of the dtype: the arrays' roundings
    psi = np.sqrt(norms.sq_fold(acc_u, lay.nb, work)[0])
    r = phi / psi if phi > 0 and psi > 0 else p.dtype.type(1)
    step = r * (-lr)
    yield [(hi - lo, functools.partial(_apply, st.u, p, step, chunk, lo, hi))
           for lo, hi in cpu_plan.ranges(n, chunk)]


def hand_np_rows(cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float, work: dict[str, Any]) -> None:
    """NumPy: ``update`` on the T rows of (T, n) arrays at once (a bucket of small tensors, ``core.cpu_tensors``);
    the norms per row (``core.norms.sq_rows``)."""
    rows, n = p.shape
    bufs = work.get("lamb")
    if bufs is None:
        bufs = work["lamb"] = (np.empty_like(p), np.empty_like(p), np.zeros((rows, sqsum.sq_layout(n)[2]), p.dtype),
                               np.empty(norms.rows_len(rows, n), p.dtype), np.empty((2, rows), p.dtype))
    u, s, x, w, nrm = bufs
    _direction(st.m, st.v, p, g, u, s, _scalars(cfg, t), cfg.weight_decay)
    np.multiply(p, p, x[:, :n])
    phi = np.sqrt(norms.sq_rows(x, n, w), out=nrm[0])
    np.multiply(u, u, x[:, :n])
    psi = np.sqrt(norms.sq_rows(x, n, w), out=nrm[1])
    ok = (phi > 0) & (psi > 0)
    step = np.where(ok, phi / np.where(ok, psi, 1), 1) * (-lr)  # r * (-lr), per row
    np.multiply(u, step[:, None], u)
    np.add(p, u, p)


def hand_update(xp: Any, cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step on a whole flat buffer (not elementwise: the norms need all of it)."""
    if xp is np:
        blocks.run_serial(hand_np_phases(cfg, st, p, g, t=t, lr=lr, chunk=driver.CHUNK))
        return
    omb1, b2, omb2, bc1, bc2, eps = _scalars(cfg, t)
    n = p.size
    if st.u is None or st.u.size != n:
        st.s, st.u = sqsum.sq_scratch(xp, n, p.dtype), xp.empty_like(p)
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


def hand_kernel_update(cfg: LambConfig, st: LambState, p: Array, g: Array, *, t: int, lr: float) -> bool:
    """``kernels/lamb.cu``: three launches (moments + partials, the ratio, the update), no host synchronisation; the
    partials' buffer is allocated once per name."""
    n = p.size
    if n == 0:
        return True
    nb = sqsum.sq_blocks(n)
    if st.parts is None or st.parts.size != 2 * nb + 1:
        st.parts = backend.cupy().empty(2 * nb + 1, p.dtype)
    parts, scal = st.parts[:2 * nb], st.parts[2 * nb:]
    omb1, b2, omb2, bc1, bc2, eps = _scalars(cfg, t)
    dt, i64 = p.dtype.type, np.int64
    wd, has_wd = dt(cfg.weight_decay), np.int32(cfg.weight_decay != 0)
    threads = sqsum.SQ_THREADS
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
HAND_MULTI = MultiTensor("lamb.cu", "lamb_apply_multi", lambda st, p: (st.m, st.v), _apply_args,
                    norms=Norms(2, "lamb_partials_multi", "lamb_ratio_multi", _partial_args))


def scalars(cfg: LambConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced)."""
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return dict(omb1=1.0 - b1, b2=b2, omb2=1.0 - b2, bc1=bc1, bc2=bc2, eps=cfg.eps, wd=cfg.weight_decay,
                neg_lr=-lr)


def flags(cfg: LambConfig, t: int) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """One element of Lamb's step; the two norms are sums over the tensor (``core/elementwise/reduce.py``)."""
    m = m + (g - m) * s.omb1
    v = v * s.b2 + (g * s.omb2) * g
    u = (m / s.bc1) / (e.sqrt(v / s.bc2) + s.eps)
    if f.wd:
        u = u + p * s.wd
    phi = e.sqrt(e.sumsq(p))
    psi = e.sqrt(e.sumsq(u))
    r = e.where((phi > 0) & (psi > 0), phi / psi, 1)
    p = p + u * (r * s.neg_lr)
    return dict(p=p, m=m, v=v)


DEF = define("lamb", step, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m", "v"), example=LambConfig())
_BOUND = run.bind_reduce(DEF)
update = _BOUND["update_fn"]
np_phases = _BOUND["np_phases_fn"]
np_rows = _BOUND["np_rows_fn"]
kernel_update = _BOUND["kernel_fn"]
MULTI = _BOUND["multi_tensor"]


_D = LambConfig  # the constructor's defaults: written once, in the config


class Lamb(PerParamOptimizer):
    """``Lamb(...)``: see the module doc."""

    algorithm = "lamb"
    config_cls = LambConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    kernel_fn = staticmethod(kernel_update)
    multi_tensor = MULTI
    np_phases_fn = staticmethod(np_phases)
    np_rows_fn = staticmethod(np_rows)

    def __init__(self, lr: float = _D.lr, betas: tuple[float, float] = _D.betas, eps: float = _D.eps,
                 weight_decay: float = _D.weight_decay, *, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None) -> None:
        super().__init__(LambConfig(lr, betas, eps, weight_decay), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask)

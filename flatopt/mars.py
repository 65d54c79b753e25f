"""Mars: variance-reduced AdamW (Yuan et al. 2024, official MARS-AdamW, approximate mode) — pytorch-optimizer
``MARS(mars_type="adamw", optimize_1d=True)``.

Update rule, per tensor, with t the step count of this parameter and η = lr · lr_scale(name)::

    c  = g + (g − g_prev)·(γ·β1/(1 − β1))               (g_prev starts at 0: c_1 = 1.475·g at the defaults)
    c  = c / max(‖c‖₂, 1)                                (clip_c: "if ‖c‖ > 1, c/‖c‖", with no host branch)
    m  = m + (1 − β1)·(c − m);   v = β2·v + (1 − β2)·c²
    p  = p · (1 − η·λ)                                   (decoupled decay)
    p  = p + (m / (√v/√(1 − β2^t) + ε))·(−η/(1 − β1^t))  (= p − η·m̂/(√v̂ + ε))
    g_prev = g

The norm is a sum of squares added in the fused kernel's fixed blocked order (``core.sqsum.sq_sum``: the same
bits on NumPy, CuPy and the kernel) and stays a device scalar on CuPy.
Defaults lr 3e-3 (official), betas (0.95, 0.99), eps 1e-8, weight_decay 0, gamma 0.025, clip_c True (rlx-optim's).

Deviations: flatopt applies MARS to every tensor, as rlx-optim does; the official default ``optimize_1d=False``
sends non-2-D tensors to a separate AdamW (betas (0.9, 0.95), λ 0.1): route those with ``flatopt.routing.Router``.
pytorch-optimizer adds ε (and 1e-15 inside the root) before dividing by √(1 − β2^t): 1.2e-6 from the official rule
at ε = 1e-8 (so the conformance test runs it at ε = 1e-12, and checks ε = 1e-8 against a float64 transcription of
the official ``update_fn``).  mars-lion, mars-shampoo and the exact two-gradient mode are not offered.  GPU:
``kernels/mars.cu``, three launches per tensor with clip_c (the per-block partials of ‖c‖², the fold into max(‖c‖,
1), the step), one without; no atomics, no host synchronisation; bit-identical to the twin; ``step_batch`` runs
every tensor of one dtype and step count in as many launches (``core/multi_tensor.py``, ``Norms``: the same
partials, folds and elements).  NumPy (``core/cpu_tensors.py``): a tensor's sweeps run on the threads (with clip_c
in two phases around the norm), small tensors of one size are updated together as rows; the same bits.  The phases'
operations run fused in compiled passes where a C compiler exists (``kernels/cpu/elementwise.c`` via
``core/native.py``; the same bits).  ``end_iteration`` only counts iterations.  State: ``m``, ``v``, ``g_prev`` (12
B/param in float32) plus unsaved scratch buffers (the twin's, the kernel's partials).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator

import numpy as np

from .adam import bias_corrections, check_bool, check_common, moments
from .core import backend, blocks, cpu_plan, driver, kernels, native, norms, sqsum
from .core.driver import PerParamOptimizer
from .core.elementwise import define, run
from .core.multi_tensor import MultiTensor, Norms
from .core.types import Array, DecayMask, LrScale
from .core.validate import check_range, normalize_numbers

_SCRATCH = {"persist": False}


@dataclasses.dataclass(frozen=True)
class MarsConfig:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.0
    gamma: float = 0.025
    clip_c: bool = True

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_common("Mars", self)
        check_range("Mars", "gamma", self.gamma, 0.0, math.inf)
        check_bool("Mars", "clip_c", self.clip_c)


@dataclasses.dataclass
class MarsState:
    m: Array
    v: Array
    g_prev: Array
    s: Array = dataclasses.field(default=None, metadata=_SCRATCH)
    c: Array = dataclasses.field(default=None, metadata=_SCRATCH)
    parts: Array = dataclasses.field(default=None, metadata=_SCRATCH)  # the kernel's partials and its scalar
    work: Array = dataclasses.field(default=None, metadata=_SCRATCH)  # the sums' work area (core/elementwise)


def init(xp: Any, cfg: MarsConfig, shape: tuple[int, ...], dtype: Any) -> MarsState:
    n = math.prod(shape)
    return MarsState(xp.zeros(n, dtype), xp.zeros(n, dtype), xp.zeros(n, dtype))


@functools.lru_cache(maxsize=16)
def _scalars(cfg: MarsConfig, t: int, lr: float) -> tuple[Any, ...]:
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    coef = cfg.gamma * b1 / (1.0 - b1)
    return coef, 1.0 - b1, b2, 1.0 - b2, 1.0 - lr * cfg.weight_decay, bc2 ** 0.5, cfg.eps, -(lr / bc1)


def _adam_part(xp: Any, cfg: MarsConfig, m: Array, v: Array, p: Array, c: Array, s: Array,
               scal: tuple[Any, ...]) -> None:
    """The moments of c, the decay and the step (``s``: scratch): the same operations on every path."""
    _, omb1, b2, omb2, decay, bc2_sqrt, eps, neg_step = scal
    moments(xp, m, v, c, omb1, b2, omb2, s)
    if cfg.weight_decay != 0:
        xp.multiply(p, decay, p)
    xp.sqrt(v, s)  # p = p + (m / (sqrt(v) / bc2_sqrt + eps)) * neg_step
    xp.divide(s, bc2_sqrt, s)
    xp.add(s, eps, s)
    xp.divide(m, s, s)
    xp.multiply(s, neg_step, s)
    xp.add(p, s, p)


# ----------------------------------------------------------------------------------------------- NumPy paths
# ``update``'s operations per element, in cache-sized blocks (with clip_c a sweep for c², the norm, a sweep that makes c
# again and does the rest; without, one sweep), ‖c‖² in ``sqsum.sq_sum``'s order (``core.norms``), max(‖c‖, 1) on
# NumPy values of the dtype: the bits of ``update``.  c is never stored whole (it is made twice, the same way).
def _c(g: Array, gp: Array, c: Array, coef: float) -> None:
    np.subtract(g, gp, c)  # c = g + (g - g_prev) * coef
    np.multiply(c, coef, c)
    np.add(g, c, c)


def _columns(arrays: tuple[Array, ...], lay: norms.Columns, acc: Array, coef: float, chunk: int, c0: int,
             c1: int) -> None:
    """Columns [c0, c1) of the column layout (``core.norms``), in row order: the column sums of c²."""
    g, gp = arrays
    s, c = cpu_plan.scratch(g.dtype, 2, chunk)
    for start, rows, w, col, first in norms.blocks(lay, c0, c1, chunk):
        a, b = start, start + rows * w
        if native.columns("mars_columns", (g[a:b], gp[a:b]), (acc[col:col + w],), rows, w, (coef,), first):
            continue  # the same operations in one compiled pass (core/native.py)
        cc = c[:b - a]
        _c(g[a:b], gp[a:b], cc, coef)
        norms.add_squares(acc[col:col + w], cc, rows, first, s)


def _steps(cfg: MarsConfig, st: MarsState, p: Array, g: Array, scal: tuple[Any, ...], den: Any, chunk: int, lo: int,
           hi: int) -> None:
    """Elements [lo, hi): c (divided by ``den`` with clip_c), the moments, the step, g_prev."""
    coef = scal[0]
    m, v, gp = st.m, st.v, st.g_prev
    s, cs = cpu_plan.scratch(p.dtype, 2, chunk)
    flags = (cfg.weight_decay != 0) | (den is not None) << 1
    fused = scal + (1.0 if den is None else float(den),)  # den: a value of the dtype, exact in double
    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        k = b - a
        sc, mc, vc, pc, gc = s[:k], m[a:b], v[a:b], p[a:b], g[a:b]
        if native.step("mars", (pc, gc, gp[a:b], mc, vc), fused, flags):
            continue  # the same operations in one compiled pass (core/native.py)
        cc = cs[:k]
        _c(gc, gp[a:b], cc, coef)
        if den is not None:
            np.divide(cc, den, cc)
        _adam_part(np, cfg, mc, vc, pc, cc, sc, scal)
        gp[a:b] = gc


def hand_np_phases(cfg: MarsConfig, st: MarsState, p: Array, g: Array, *, t: int, lr: float, chunk: int) -> Iterator[Any]:
    """NumPy: ``update`` as phases of tasks (``core.cpu_tensors``): with clip_c, column ranges making the column
    sums of c², then (after the fold into max(‖c‖, 1)) ranges of the rest; without, the ranges alone.  Scratch:
    with clip_c, ``parts`` (the column sums and the fold's work area)."""
    n = p.size
    if n == 0:
        return
    scal = _scalars(cfg, t, lr)
    den = None
    if cfg.clip_c:  # c = c / max(||c||, 1), ||c||² in the blocked order of kernels/mars.cu
        lay = norms.columns(n)
        need = lay.cols + norms.fold_len(lay.nb)
        if st.parts is None or st.parts.size != need:
            st.parts = np.zeros(need, p.dtype)  # columns without a term stay 0
        acc, work = st.parts[:lay.cols], st.parts[lay.cols:]
        arrays = (g, st.g_prev)
        yield [(cost, functools.partial(_columns, arrays, lay, acc, scal[0], chunk, c0, c1))
               for cost, c0, c1 in norms.column_ranges(lay, chunk)]
        nrm = np.sqrt(norms.sq_fold(acc, lay.nb, work)[0])  # a NumPy scalar of the dtype: the arrays' roundings
        den = nrm if nrm >= 1 or nrm != nrm else nrm.dtype.type(1)  # = maximum(nrm, 1), NaN kept
    yield [(hi - lo, functools.partial(_steps, cfg, st, p, g, scal, den, chunk, lo, hi))
           for lo, hi in cpu_plan.ranges(n, chunk)]


def hand_np_rows(cfg: MarsConfig, st: MarsState, p: Array, g: Array, *, t: int, lr: float, work: dict[str, Any]) -> None:
    """NumPy: ``update`` on the T rows of (T, n) arrays at once (a bucket of small tensors, ``core.cpu_tensors``);
    ‖c‖ per row (``core.norms.sq_rows``)."""
    scal = _scalars(cfg, t, lr)
    coef = scal[0]
    rows, n = p.shape
    bufs = work.get("mars")
    if bufs is None:
        bufs = work["mars"] = (np.empty_like(p), np.empty_like(p), np.zeros((rows, sqsum.sq_layout(n)[2]), p.dtype),
                               np.empty(norms.rows_len(rows, n), p.dtype), np.empty(rows, p.dtype))
    c, s, x, w, nrm = bufs
    _c(g, st.g_prev, c, coef)
    if cfg.clip_c:
        np.multiply(c, c, x[:, :n])
        np.sqrt(norms.sq_rows(x, n, w), out=nrm)
        den = np.where((nrm >= 1) | (nrm != nrm), nrm, 1)  # = maximum(nrm, 1), NaN kept
        np.divide(c, den[:, None], c)
    _adam_part(np, cfg, st.m, st.v, p, c, s, scal)
    np.copyto(st.g_prev, g)


def hand_update(xp: Any, cfg: MarsConfig, st: MarsState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step on a whole flat buffer (not elementwise: the clip needs ‖c‖)."""
    if xp is np:
        blocks.run_serial(hand_np_phases(cfg, st, p, g, t=t, lr=lr, chunk=driver.CHUNK))
        return
    coef = _scalars(cfg, t, lr)[0]
    n = p.size
    if st.c is None or st.c.size != n:
        st.s, st.c = sqsum.sq_scratch(xp, n, p.dtype), xp.empty_like(p)
    s, c = st.s[:n], st.c
    xp.subtract(g, st.g_prev, c)  # c = g + (g - g_prev) * coef
    xp.multiply(c, coef, c)
    xp.add(g, c, c)
    if cfg.clip_c:  # c = c / max(||c||, 1), ||c||² in the blocked order of kernels/mars.cu
        xp.multiply(c, c, s)
        xp.divide(c, xp.maximum(xp.sqrt(sqsum.sq_sum(xp, st.s, n)), 1), c)
    _adam_part(xp, cfg, st.m, st.v, p, c, s, _scalars(cfg, t, lr))
    st.g_prev[...] = g


def hand_kernel_update(cfg: MarsConfig, st: MarsState, p: Array, g: Array, *, t: int, lr: float) -> bool:
    """``kernels/mars.cu``: with clip_c three launches (the partials of ‖c‖², the clip divisor, the step), else the
    step alone; no host synchronisation; the partials' buffer is allocated once per name."""
    n = p.size
    if n == 0:
        return True
    coef, omb1, b2, omb2, decay, bc2_sqrt, eps, neg_step = _scalars(cfg, t, lr)
    dt, i64 = p.dtype.type, np.int64
    threads = sqsum.SQ_THREADS
    scal = p  # unread without clipping
    if cfg.clip_c:
        nb = sqsum.sq_blocks(n)
        if st.parts is None or st.parts.size != nb + 1:
            st.parts = backend.cupy().empty(nb + 1, p.dtype)
        parts, scal = st.parts[:nb], st.parts[nb:]
        kernels.get("mars.cu", "mars_c_partials", p.dtype)((nb,), (threads,), (g, st.g_prev, i64(n), dt(coef), parts))
        kernels.get("mars.cu", "mars_clip", p.dtype)((1,), (threads,), (parts, i64(nb), scal))
    backend.launch(kernels.get("mars.cu", "mars_step", p.dtype), n, (
        p, g, st.g_prev, st.m, st.v, i64(n), dt(coef), dt(omb1), dt(b2), dt(omb2), dt(decay), dt(bc2_sqrt),
        dt(eps), dt(neg_step), np.int32(cfg.weight_decay != 0), np.int32(cfg.clip_c), scal), threads)
    return True


def _multi_args(cfg: MarsConfig, t: int, dt: Any) -> tuple[Any, ...]:
    """``mars_multi``'s arguments after ``base_lr``: the float64 operands of each tensor's decay and step size (as
    ``_scalars`` derives them), then the rest rounded to the dtype."""
    coef, omb1, b2, omb2, _, bc2_sqrt, eps, _ = _scalars(cfg, t, 0.0)
    return (float(cfg.weight_decay), bias_corrections(cfg.betas, t)[0], dt(coef), dt(omb1), dt(b2), dt(omb2),
            dt(bc2_sqrt), dt(eps), np.int32(cfg.weight_decay != 0), np.int32(cfg.clip_c))


# A group of tensors in three launches on CuPy, one without clip_c (core/multi_tensor.py): the partials of ‖c‖² of
# every tensor, the per-tensor folds into the clip divisor, the step.
HAND_MULTI = MultiTensor("mars.cu", "mars_multi", lambda st, p: (st.g_prev, st.m, st.v), _multi_args,
                    norms=Norms(1, "mars_partials_multi", "mars_clip_multi",
                                lambda cfg, t, dt: (dt(_scalars(cfg, t, 0.0)[0]),), lambda cfg: cfg.clip_c))


def scalars(cfg: MarsConfig, t: int, lr: Any) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced)."""
    b1, b2 = cfg.betas
    bc1, bc2 = bias_corrections(cfg.betas, t)
    return dict(coef=cfg.gamma * b1 / (1.0 - b1), omb1=1.0 - b1, b2=b2, omb2=1.0 - b2,
                decay=1.0 - lr * cfg.weight_decay, bc2_sqrt=bc2 ** 0.5, eps=cfg.eps, neg_step=-(lr / bc1))


def flags(cfg: MarsConfig, t: int) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0, clip=cfg.clip_c)


def step(e: Any, p: Any, g: Any, m: Any, v: Any, g_prev: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """One element of Mars's step; with clip_c, ‖c‖ is a sum over the tensor (``core/elementwise/reduce.py``)."""
    c = g + (g - g_prev) * s.coef
    if f.clip:
        c = c / e.maximum(e.sqrt(e.sumsq(c)), 1)
    m = m + (c - m) * s.omb1
    v = v * s.b2 + (c * s.omb2) * c
    if f.wd:
        p = p * s.decay
    p = p + (m / (e.sqrt(v) / s.bc2_sqrt + s.eps)) * s.neg_step
    return dict(p=p, m=m, v=v, g_prev=g)


DEF = define("mars", step, scalars=scalars, flags=flags, flag_names=("wd", "clip"), slots=("m", "v", "g_prev"),
             example=MarsConfig())
_BOUND = run.bind_reduce(DEF)
update = _BOUND["update_fn"]
np_phases = _BOUND["np_phases_fn"]
np_rows = _BOUND["np_rows_fn"]
kernel_update = _BOUND["kernel_fn"]
MULTI = _BOUND["multi_tensor"]


_D = MarsConfig  # the constructor's defaults: written once, in the config


class Mars(PerParamOptimizer):
    """``Mars(...)``: see the module doc."""

    algorithm = "mars"
    config_cls = MarsConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    kernel_fn = staticmethod(kernel_update)
    multi_tensor = MULTI
    np_phases_fn = staticmethod(np_phases)
    np_rows_fn = staticmethod(np_rows)

    def __init__(self, lr: float = _D.lr, betas: tuple[float, float] = _D.betas, eps: float = _D.eps,
                 weight_decay: float = _D.weight_decay, gamma: float = _D.gamma, clip_c: bool = _D.clip_c, *,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None) -> None:
        super().__init__(MarsConfig(lr, betas, eps, weight_decay, gamma, clip_c), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask)

"""Adafactor: factored second moment, update clipping and relative step (Shazeer & Stern 2018), HF semantics.

Update rule for ``step(name, shape, θ, G)``, t the step count of this name (advanced inside ``step``)::

    ρ  = lr·lr_scale(name)                       manual lr (constructor ``lr``, ``with_lr`` or ``set_lr``)
       = min(1e-2, 1/√t)·lr_scale(name)          relative step (lr None);  min(1e-6·t, 1/√t) with warmup_init
    α  = ρ·max(eps2, RMS(θ))  if parameter scaling is on, else ρ          (RMS over the whole tensor, before the step)
    β̂₂ = beta2 if set, else 1 − t^beta2_decay                            (0 at t = 1: the first statistic as is)
    factored (ndim ≥ 2, ``factored=True``; last two dims, leading dims are a batch, one r̄ per leading index):
        R ← β̂₂R + (1 − β̂₂)·mean_cols(G² + eps1),  C ← β̂₂C + (1 − β̂₂)·mean_rows(G² + eps1)
        U = G·rsqrt(R/r̄)·rsqrt(C),  r̄ = mean(R)       (V̂ = R·Cᵀ / mean(R): means divided by their mean, not sum)
    otherwise:  V ← β̂₂V + (1 − β̂₂)(G² + eps1),  U = G/√V
    Ũ  = α·U / max(1, RMS(U)/clip_threshold)
    Δ  = M ← beta1·M + (1 − beta1)·Ũ  if beta1 is set (HF: an EMA of the scaled, clipped update, no debias), else Ũ
    θ ← θ·(1 − α·weight_decay) − Δ                       (decoupled decay with the step size α, as HF)

Defaults (the paper's): lr None (relative step), beta2_decay −0.8, eps1 1e-30, eps2 1e-3, clip_threshold 1, no first
moment, no weight decay.  ``scale_parameter=None`` means *on for the relative step, off for a manual lr* (the
relative step is ρ·max(eps2, RMS(θ)) as in the paper; a manual lr acts like AdamW's), resolved once at
construction (and again by ``with_lr``); True/False force it.

``set_lr(x)``: stores x as the manual lr, so ρ = x·lr_scale(name) from the next step on in every mode (the relative
step is replaced; parameter scaling keeps the setting resolved at construction, so ``Adafactor().set_lr(x)`` gives
α = x·max(eps2, RMS(θ))).  ``set_lr(None)`` returns to the relative step.  ``end_iteration`` only counts
iterations: t is per name and advances in ``step`` (a name without a gradient keeps its t, as HF and torch).

Deviations from HF ``transformers.Adafactor`` (same rule; rounding-level differences only): ε₁ is added to the row and
column means rather than to each G² (equal in exact arithmetic); Ũ is formed as (G·(column factor·s))·row factor
with the one scalar s = α/max(1, RMS(U)/d) (the CUDA kernels too); state and
arithmetic are in the parameter's dtype (HF: an fp32 copy of fp16 params).  From ``torch.optim.Adafactor``: ε₁ is added to G² (torch floors mean(R) at ε₁ and V̂ at ε₁² instead), lr is not a
cap of the relative step, weight decay is α·λ (torch: lr·λ), an optional first moment.  Non-finite gradients are
not guarded (as in all references): a NaN enters the state and the parameter, identically on NumPy and CuPy.

State per name: ``exp_avg_sq_row`` (prod(s[:-1])) and ``exp_avg_sq_col`` (prod(s[:-2])·s[-1]) when factored, else
``exp_avg_sq`` (n); ``exp_avg`` (n) with beta1; all flat, in the parameter's dtype.  About 4(r + c)/(r·c) bytes
per float32 parameter for a factored matrix.  Use Adafactor where optimizer memory matters (large matrices).

On CuPy every tensor of a step is stepped by one set of segmented kernels (``adafactor.gpu``: six launches per
dtype and step count, whatever the number of tensors; ``step_batch`` ≡ serial bits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import numpy as np

from . import gpu as fused, numerics as fm
from .numerics import st_shape, step_sizes  # noqa: F401 - part of the module's API
from ..core import blocks
from ..core import gpu_run, shards
from ..core.driver import PerParamOptimizer, config_to_dict
from ..core.precision import Precision
from ..core.types import Array, DecayMask, LrScale
from ..core.validate import check_lr, check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class AdafactorConfig:
    lr: float | None = None
    beta2_decay: float = -0.8
    eps1: float = 1e-30
    eps2: float = 1e-3
    clip_threshold: float = 1.0
    weight_decay: float = 0.0
    beta1: float | None = None
    beta2: float | None = None
    scale_parameter: bool | None = None  # None: resolved here to (lr is None)
    warmup_init: bool = False
    factored: bool = True

    def __post_init__(self) -> None:
        normalize_numbers(self)
        if self.lr is not None:
            check_lr(self.lr, "lr", "Adafactor")
        check_range("Adafactor", "beta2_decay", self.beta2_decay, -math.inf, 0.0)
        check_range("Adafactor", "eps1", self.eps1, 0.0, math.inf)
        check_range("Adafactor", "eps2", self.eps2, 0.0, math.inf)
        check_range("Adafactor", "clip_threshold", self.clip_threshold, 0.0, math.inf, lo_open=True)
        check_range("Adafactor", "weight_decay", self.weight_decay, 0.0, math.inf)
        for f in ("beta1", "beta2"):
            if getattr(self, f) is not None:
                check_range("Adafactor", f, getattr(self, f), 0.0, 1.0, hi_open=True)
        for f in ("scale_parameter", "warmup_init", "factored"):
            v = getattr(self, f)
            if not isinstance(v, bool) and not (f == "scale_parameter" and v is None):
                what = "a bool or None" if f == "scale_parameter" else "a bool"
                raise TypeError(f"Adafactor: {f} must be {what}, got {v!r}")
        if self.warmup_init and self.lr is not None:
            raise ValueError("Adafactor: warmup_init applies to the relative step only (lr must be None)")
        if self.scale_parameter is None:
            object.__setattr__(self, "scale_parameter", self.lr is None)


@dataclasses.dataclass
class AdafactorState:
    exp_avg_sq_row: Array = None
    exp_avg_sq_col: Array = None
    exp_avg_sq: Array = None
    exp_avg: Array = None
    work: Any = dataclasses.field(default=None, metadata={"persist": False})  # adafactor.factored_passes.Work scratch vectors


def is_factored(cfg: AdafactorConfig, shape: tuple[int, ...]) -> bool:
    return cfg.factored and len(shape) >= 2


def init(xp: Any, cfg: AdafactorConfig, shape: tuple[int, ...], dtype: Any) -> AdafactorState:
    n = math.prod(shape)
    st = AdafactorState(exp_avg=xp.zeros(n, dtype) if cfg.beta1 is not None else None)
    if is_factored(cfg, shape):
        b, r, c = blocks.factor_dims(tuple(shape))
        st.exp_avg_sq_row, st.exp_avg_sq_col = xp.zeros(b * r, dtype), xp.zeros(b * c, dtype)
    else:
        st.exp_avg_sq = xp.zeros(n, dtype)
    return st


def update(xp: Any, cfg: AdafactorConfig, st: AdafactorState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step on the whole flat buffers (``cfg.lr`` is the current manual lr or None; see ``step_sizes``)."""
    blocks.run_serial(phases(xp, cfg, st, p, g, t=t, lr=lr))


def phases(xp: Any, cfg: AdafactorConfig, st: AdafactorState, p: Array, g: Array, *, t: int, lr: float,
           blas: bool = False) -> Iterator[Any]:
    """``update`` as a generator of phases of independent block tasks (``core.blocks``): ``update`` runs them
    inline, ``Adafactor.step_batch`` on NumPy runs the phases of all its items on the threads."""
    n = p.size
    if n == 0:
        return
    rho, beta = step_sizes(cfg, t, lr)
    d, wd, eps2, scale = cfg.clip_threshold, cfg.weight_decay, cfg.eps2, cfg.scale_parameter

    def scalars(ssq_p: Array, ssq_u: Array, n: int) -> tuple[Any, Any, float | None]:
        alpha = rho * xp.maximum(xp.sqrt(ssq_p / n), eps2) if scale else rho
        step_scale = alpha / xp.maximum(xp.sqrt(ssq_u / n) / d, 1.0)
        return step_scale, (1.0 - alpha * wd) if wd != 0 else None, cfg.beta1

    kw: dict[str, Any] = dict(beta=beta, eps1=cfg.eps1, need_rms=scale, scalars=scalars)
    if st.exp_avg_sq is None:
        yield from fm.factored_phases(xp, st, p, g, st_shape(st, p), blas=blas, **kw)
    else:
        yield from fm.unfactored_phases(xp, st, p, g, **kw)


_D = AdafactorConfig  # the constructor's defaults: written once, in the config


class Adafactor(PerParamOptimizer):
    """``Adafactor(...)``.

    ``Adafactor()`` is the paper's default (relative step); ``.with_lr(lr)`` and ``.with_weight_decay(wd)`` return a
    configured copy (a new optimizer without state).  See the module documentation for the rule and ``set_lr``."""

    algorithm = "adafactor"
    config_cls = AdafactorConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    elementwise = False
    matters = ("factored",)

    def __init__(self, lr: float | None = _D.lr, beta2_decay: float = _D.beta2_decay, eps1: float = _D.eps1,
                 eps2: float = _D.eps2, clip_threshold: float = _D.clip_threshold,
                 weight_decay: float = _D.weight_decay, *, beta1: float | None = _D.beta1,
                 beta2: float | None = _D.beta2, scale_parameter: bool | None = _D.scale_parameter,
                 warmup_init: bool = _D.warmup_init, factored: bool = _D.factored, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None, precision: Precision | None = None) -> None:
        cfg = AdafactorConfig(lr, beta2_decay, eps1, eps2, clip_threshold, weight_decay, beta1, beta2,
                              scale_parameter, warmup_init, factored)
        super().__init__(cfg, lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)
        self._scale_spec = scale_parameter  # what the caller asked for (None: follows the lr mode in with_lr)
        self._step_cfg = cfg
        self.hooks = self.hooks.replace(effective_lr=self._rho_lr, run=self._run_all, update=self._update_item,
                                        kernel_batch=self._kernel_batch)

    # ------------------------------------------------------------------------------------------- builders
    def _copy(self, **changes: Any) -> "Adafactor":
        kw = config_to_dict(self.config)
        kw["lr"] = self._lr
        kw.update(changes)
        new = type(self)(**kw, lr_scale=self._lr_scale_spec, weight_decay_mask=self._decay_spec)
        new._scale_spec = self._scale_spec
        return new

    def with_lr(self, lr: float | None) -> "Adafactor":
        """A copy with a manual lr (ρ = lr), or the relative step for None; ``scale_parameter=None`` re-resolves and
        ``warmup_init`` (relative step only) is dropped for a manual lr."""
        return self._copy(lr=lr, scale_parameter=self._scale_spec,
                          warmup_init=self.config.warmup_init and lr is None)

    def with_weight_decay(self, weight_decay: float) -> "Adafactor":
        """A copy with decoupled weight decay θ ← θ·(1 − α·weight_decay)."""
        return self._copy(weight_decay=weight_decay)

    # ----------------------------------------------------------------------------------------- driver hooks
    def set_lr(self, lr: float | None) -> None:
        """Manual lr from the next step on: ρ = lr·lr_scale(name), in every mode (it replaces the relative step;
        parameter scaling keeps its setting).  ``None`` returns to the relative step."""
        with self._lock:
            self._lr = None if lr is None else check_lr(lr)

    def _rho_lr(self, scale: float) -> float:
        return (self._lr if self._lr is not None else 1.0) * scale

    def _run_all(self, prepared: list[Any]) -> None:
        cfg = self.config
        if cfg.lr != self._lr:
            cfg = dataclasses.replace(cfg, lr=self._lr, warmup_init=cfg.warmup_init and self._lr is None)
        self._step_cfg = cfg
        cpu: list[Any] = []
        gpu: list[Any] = []
        for it, slot, scale in prepared:
            slot.t += 1
            lr = self._rho_lr(scale)
            (gpu if slot.backend == "cupy" else cpu).append((it, slot, lr))
        if cpu:
            # every item's blocked passes, phase by phase, on the threads (bits independent of the threads); with
            # the BLAS held at one thread (threadpoolctl) large tensors sum their statistics by GEMV (fm.BLAS_MIN)
            with shards.blas_capped(any(it.param.size >= fm.BLAS_MIN for it, _, _ in cpu)) as capped:
                blocks.run_phased([(it.name, phases(np, cfg, slot.state, it.param, it.grad, t=slot.t, lr=lr,
                                                     blas=capped)) for it, slot, lr in cpu],
                                   serial=not self.threaded)
        if gpu:
            gpu_run.run_gpu(self, gpu)

    def _update_item(self, xp: Any, state: Any, param: Array, grad: Array, *, t: int, lr: float,
                scratch: list[Array]) -> None:
        update(xp, self._step_cfg, state, param, grad, t=t, lr=lr, scratch=scratch)

    def _kernel_batch(self, gpu: list[Any]) -> bool:
        """The fused path of ``core.gpu_run.run_gpu``: every CuPy item of the step by segmented kernels (``gpu``)."""
        fused.run(self, self._step_cfg, gpu)
        return True


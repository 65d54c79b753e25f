"""KronPsgd: PSGD with a Kronecker-factored preconditioner fitted on the Lie group of triangular matrices.

The step of kron_torch 0.3.3 (``kron_torch.Kron``, after Xi-Lin Li's PSGD), per parameter, with t its step count and
η = lr · lr_scale(name)::

    m  = β·m + (1 − β)·g;   h = m / (1 − β^t)                (debiased momentum, then in the precond dtype)
    if balance:  Q_i ← Q_i · gmean_j(max|Q_j|) / max|Q_i|     (the product Q_1 ⊗ … ⊗ Q_k is unchanged)
    if update:   V ~ N(0, I);  h ← h + 2^−11.5·mean|h|·V        (damping: the *same* perturbed h is applied below)
                 A = h ×_1 Q_1 … ×_k Q_k;   B̄ = V ×_1 Q_1⁻ᵀ … ×_k Q_k⁻ᵀ   (triangular solves; both from the old Q)
                 T1_i, T2_i = mode-i Grams of A and B̄ (only their diagonals for a diagonal factor)
                 dense:    Q_i ← Q_i − precond_lr·triu(T1 − T2)·Q_i / max(lb(T1 + T2), eps)
                 diagonal: q_i ← q_i − precond_lr·(T1 − T2)·q_i / max(max|T1 + T2|, eps)
    u  = h ×_1 Q_1ᵀQ_1 … ×_k Q_kᵀQ_k;   u ← u·min(1, clip/(RMS(u) + 1e−12))
    θ  ← θ − η·(u + weight_decay·θ)                           (decay only for parameters with ndim >= 2)

lb(S) is kron_torch's cheap lower bound of the spectral norm (``kron.numerics.spectral_lower_bound``).  Matrices are
preconditioned as Q_LᵀQ_L·h·Q_RᵀQ_R; a > 2-D tensor is first viewed as its most square 2-D split; a dim larger than
``max_size_triangular``, a dim of 1, every dim of a tensor with fewer than ``min_ndim_triangular`` dims (biases,
gains) and the dims ``memory_save_mode`` picks get diagonal factors.  Q starts at ``precond_init_scale``·I.

**Schedule** (per name, no ``end_iteration`` needed): counter += 1; the preconditioner is updated iff
counter >= 1/p(t − 1) (then counter = 0), p(n) = clamp(1.0·exp(−0.001·(n − 500)), 0.03, 1) in float32 (or the
constant ``update_probability``): every step up to 501, then every 2nd, …, every 34th from about step 4000.
**Balancing** happens at step t iff the t-th draw of ``random.Random(balance_seed)`` is < 0.01 and t updates
(first at t = 20 with seed 42).  kron_torch decides both once per ``step()`` call for all parameters; flatopt
replays the same sequence per name from the name's own step count, so the two agree whenever every parameter
gets a gradient every iteration; a parameter that skips iterations keeps its own cadence.  ``end_iteration``
only counts iterations (``state_dict().step``); it advances nothing in the algorithm.

**Probes** come from a counter-based generator per name: update number j of parameter ``name`` uses
V = gaussian_probe(blake2b(seed, name), j) (splitmix64 + Box–Muller, ``kron.layout``), computed on the
parameter's device.  The only state is the per-name update count, saved with the schedule counter, so
save/load/continue and ``step_batch`` (threads) are bit-identical to the serial loop, and NumPy and CuPy draw the
same V (to the rounding of log/cos).  ``probe=fn`` (or ``set_probe``) injects V instead: ``fn(name, shape, j)``
returns V of the preconditioner shape ``shape`` for update j of ``name`` (may be called from worker threads;
must depend on its arguments only).

**Deviations from kron_torch 0.3.3** (none in the arithmetic of a step; float32 results agree to ~1e−6):
``clip`` is the RMS cap (kron_torch: always 1.1; ``clip=None`` disables it); ``eps`` floors the normalisers
(kron_torch: finfo(float32).tiny; pass that for exact conformance); > 2-D shapes merge into the most square split
(``merge_rule="kron_torch"`` gives its signed-difference rule); 0-d parameters are 1-element vectors (kron_torch
raises); the schedule, balancing and probes are per name as above and all of them are saved (kron_torch restarts
its schedule and balance stream on load and draws V from the global torch RNG); a factor update that is not
finite is discarded (kron_torch lets a NaN poison Q forever); ``momentum_into_precond_update=False`` fits a copy
of the gradient (kron_torch perturbs ``p.grad`` in place); the decay is added in the parameter's dtype; nothing
is printed; lr is required (kron_torch: 3e−4).  Not offered: ``mu_dtype`` (momentum has the param dtype).
The ``KronPsgd`` of the Rust crate rlx-optim (probe V = g, so Q never moves; heavy ball after the preconditioner)
is not followed.

When to use: matrices of moderate size where curvature is strongly anisotropic; start with an lr ~3× smaller than
AdamW's and a 3–10× larger weight decay.  Memory: the momentum plus Σ d_i² floats (dense) / d_i (diagonal) per
parameter; on NumPy the temporaries of a step (about 13× the largest parameter's bytes, plus its factors' size)
are per-thread scratch (``kron.numerics.scratch`` over ``flatopt.core.workspace``) kept between steps, so a 1-D/2-D
step allocates nothing of the parameter's size after the first (> 2-D shapes with ``merge_dims=False`` use fresh
temporaries).  Matmul-bound: ``step_batch`` runs items serially (``threaded = False``), and on NumPy every step runs
its BLAS held at one thread (``blas_bound``: ``core.shards``' process-wide cap, the one Muon and Adafactor hold), in
every mode.  So ``step``, ``step_batch``, another Python thread and a ``flatopt.distributed`` rank make the same BLAS
calls at the same thread count and agree bit for bit, whatever ``OPENBLAS_NUM_THREADS`` is and whatever other
threads of the process step meanwhile (without ``threadpoolctl``, or with an OpenMP-threaded BLAS, the cap cannot be
held and the GEMMs run on the BLAS's own threads: bits may then follow the BLAS thread count).  Another CPU's BLAS
kernels still change last bits (amplified by the preconditioner's feedback): compare runs across machines with a
tolerance, not bits.  Triangular solves:
cuBLAS trsm on CuPy; on NumPy a blocked substitution on NumPy's BLAS, 32-row leaves by their triangular inverse
(SciPy's trsm is not used: its second OpenBLAS's idle threads spin against NumPy's and slow the step down).

**On CuPy** a 1-D or 2-D preconditioner shape takes the fused step of ``kron/fused.py`` (``kernels/kron.cu``): the
twin's GEMMs, solves and reductions with the elementwise work between them fused, the twin's bits, 52 launches for a
1024² matrix on an update step (8 otherwise) and its temporaries in per-thread workspace buffers;
``FLATOPT_FORCE_TWIN=1`` runs this module's code (fresh CuPy temporaries) instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence, cast

import numpy as np

from . import layout as L
from . import numerics as K
from . import fused as _fused
from ..core.driver import PerParamOptimizer, config_to_dict
from ..core.precision import Precision
from ..core.types import Array, DecayMask, LrScale, OptItem
from ..core.validate import check_lr, check_range, normalize_numbers

_MODES = (None, "one_diag", "smart_one_diag", "all_diag")


def _check_int(field: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"KronPsgd: {field} must be an int >= {lo}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class KronPsgdConfig:
    lr: float
    precond_lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    eps: float = 1e-8
    clip: float | None = 1.0
    update_probability: float | None = None  # None: the schedule below
    prob_schedule: tuple[float, float, float, float] = (1.0, 0.03, 0.001, 500.0)  # max_p, min_p, decay, flat_start
    max_size_triangular: int = 8192
    min_ndim_triangular: int = 2
    memory_save_mode: str | None = None
    momentum_into_precond_update: bool = True
    precond_init_scale: float = 1.0
    merge_dims: bool = True
    merge_rule: str = "square"  # or "kron_torch"
    precond_dtype: str = "float32"  # "float64", or "param" (the parameter's dtype)
    balance: bool = True
    seed: int = 0
    balance_seed: int = 42

    def __post_init__(self) -> None:
        normalize_numbers(self)
        inf = math.inf
        check_lr(self.lr, "lr", "KronPsgd")
        check_range("KronPsgd", "precond_lr", self.precond_lr, 0.0, inf, hi_open=True)
        check_range("KronPsgd", "momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_range("KronPsgd", "weight_decay", self.weight_decay, 0.0, inf, hi_open=True)
        check_range("KronPsgd", "eps", self.eps, 0.0, inf, lo_open=True, hi_open=True)
        if self.clip is not None:
            check_range("KronPsgd", "clip", self.clip, 0.0, inf, lo_open=True, hi_open=True)
        if self.update_probability is not None:
            check_range("KronPsgd", "update_probability", self.update_probability, 0.0, 1.0, lo_open=True)
        if not isinstance(self.prob_schedule, (tuple, list)) or len(self.prob_schedule) != 4:
            raise TypeError(f"KronPsgd: prob_schedule must be (max_p, min_p, decay, flat_start), got "
                            f"{self.prob_schedule!r}")
        hi_p, lo_p, decay, flat = self.prob_schedule
        check_range("KronPsgd", "prob_schedule max_p", hi_p, 0.0, 1.0, lo_open=True)
        check_range("KronPsgd", "prob_schedule min_p", lo_p, 0.0, hi_p, lo_open=True)
        check_range("KronPsgd", "prob_schedule decay", decay, 0.0, inf, hi_open=True)
        check_range("KronPsgd", "prob_schedule flat_start", flat, 0.0, inf, hi_open=True)
        object.__setattr__(self, "prob_schedule", tuple(float(x) for x in self.prob_schedule))
        _check_int("max_size_triangular", self.max_size_triangular, 0)
        _check_int("min_ndim_triangular", self.min_ndim_triangular, 0)
        if self.memory_save_mode not in _MODES:
            raise ValueError(f"KronPsgd: memory_save_mode must be one of {_MODES}, got {self.memory_save_mode!r}")
        for f in ("momentum_into_precond_update", "merge_dims", "balance"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"KronPsgd: {f} must be a bool, got {getattr(self, f)!r}")
        check_range("KronPsgd", "precond_init_scale", self.precond_init_scale, 0.0, inf, lo_open=True, hi_open=True)
        if self.merge_rule not in ("square", "kron_torch"):
            raise ValueError(f"KronPsgd: merge_rule must be 'square' or 'kron_torch', got {self.merge_rule!r}")
        if self.precond_dtype not in ("float32", "float64", "param"):
            raise ValueError(f"KronPsgd: precond_dtype must be 'float32', 'float64' or 'param', got "
                             f"{self.precond_dtype!r}")
        _check_int("seed", self.seed, 0)
        _check_int("balance_seed", self.balance_seed, 0)


_RUNTIME = {"persist": False}


@dataclasses.dataclass
class KronPsgdState:
    m: Array  # momentum (flat, parameter dtype)
    q: Array  # the packed factors (flat, precond dtype): dense d×d row-major, or diagonal d
    counter: int = 0  # steps since the last preconditioner update (the schedule counter)
    updates: int = 0  # preconditioner updates so far = index of the next probe
    layout: L.Layout | None = dataclasses.field(default=None, metadata=_RUNTIME)
    ctx: tuple[Any, ...] | None = dataclasses.field(default=None, metadata=_RUNTIME)  # (name, stream key, hook)
    views: tuple[Any, ...] | None = dataclasses.field(default=None, metadata=_RUNTIME)  # fused.py's factor views


def init(xp: Any, cfg: KronPsgdConfig, shape: tuple[int, ...], dtype: Any) -> KronPsgdState:
    lay = L.make_layout(cfg, tuple(shape))
    pdt = np.dtype(dtype) if cfg.precond_dtype == "param" else np.dtype(cfg.precond_dtype)
    return KronPsgdState(m=xp.zeros(lay.numel, dtype), q=L.init_factors(xp, lay, pdt), layout=lay)


def update(xp: Any, cfg: KronPsgdConfig, st: KronPsgdState, param: Array, grad: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One step of one parameter (whole flat buffers; ``scratch`` is unused)."""
    lay = cast(L.Layout, st.layout)  # set by init (also for restored state)
    if lay.numel == 0:
        return
    do_update, st.counter = L.decide_update(cfg, st.counter, t)
    balance = cfg.balance and do_update and len(lay.merged) > 1 and L.balance_hit(cfg.balance_seed, t)
    g = grad.reshape(lay.merged)
    m = st.m.reshape(lay.merged)
    b1 = cfg.momentum
    pdt = st.q.dtype
    if len(lay.merged) > 2:  # merge_dims=False on a > 2-D tensor: the allocating path
        _update_nd(xp, cfg, st, lay, param, g, m, b1, pdt, t, lr, do_update, balance)
        return
    # 1-D / 2-D: the same operations, every temporary in per-thread scratch (K.scratch; bit-identical)
    tmp = K.scratch(xp, "g", lay.merged, g.dtype)
    m *= b1
    xp.multiply(g, 1.0 - b1, out=tmp)  # g * (1 - b1)
    m += tmp
    h = K.scratch(xp, "h", lay.merged, m.dtype)
    xp.divide(m, 1.0 - b1**t, out=h)
    if pdt != h.dtype:  # .astype(pdt)
        hp = K.scratch(xp, "hp", lay.merged, pdt)
        hp[...] = h
        h = hp
    factors = K.factor_views(st.q, lay)
    if balance:
        K.balance_ws(xp, factors)
    if do_update:
        if cfg.momentum_into_precond_update:
            fit = h
        else:  # g.astype(pdt, copy=True)
            fit = K.scratch(xp, "fit", lay.merged, pdt)
            fit[...] = g
        v = L.probe_for(xp, cast("tuple[Any, ...]", st.ctx), st.updates, lay.merged, pdt)  # ctx: set by _prepare
        ab = K.scratch(xp, "pt", lay.merged, fit.dtype)  # the probe's theta buffer, dead by now
        xp.abs(fit, out=ab)
        c = K.SQRT_EPS_F32 * xp.mean(ab)
        cv = K.scratch(xp, "pt", lay.merged, np.result_type(c.dtype, v.dtype))
        xp.multiply(c, v, out=cv)
        fit += cv
        K.update_precond_ws(xp, factors, fit, v, cfg.precond_lr, cfg.eps)
        st.updates += 1
    u = K.precondition_ws(xp, factors, h)
    if cfg.clip is not None:
        u = K.clip_rms_ws(xp, u, cfg.clip)
    step = u.reshape(-1)  # C-contiguous scratch: ascontiguousarray and reshape are views
    if step.dtype != param.dtype:  # .astype(param.dtype)
        step = K.scratch(xp, "step", (lay.numel,), param.dtype)
        step[...] = u.reshape(-1)
    if cfg.weight_decay != 0 and lay.decays:
        wd = K.scratch(xp, "g", (lay.numel,), np.result_type(param.dtype, cfg.weight_decay))  # tmp, dead
        xp.multiply(param, cfg.weight_decay, out=wd)
        step += wd
    step *= -lr
    param += step


def _update_nd(xp: Any, cfg: KronPsgdConfig, st: KronPsgdState, lay: L.Layout, param: Array, g: Array, m: Array,
               b1: float, pdt: Any, t: int, lr: float, do_update: bool, balance: bool) -> None:
    """The step of a > 2-D merged shape (``merge_dims=False``), with fresh temporaries."""
    m *= b1
    m += g * (1.0 - b1)
    h = (m / (1.0 - b1**t)).astype(pdt, copy=False)
    factors = K.factor_views(st.q, lay)
    if balance:
        K.balance(xp, factors)
    if do_update:
        fit = h if cfg.momentum_into_precond_update else g.astype(pdt, copy=True)
        v = L.probe_for(xp, cast("tuple[Any, ...]", st.ctx), st.updates, lay.merged, pdt)
        fit += (K.SQRT_EPS_F32 * xp.mean(xp.abs(fit))) * v
        K.update_precond(xp, factors, fit, v, cfg.precond_lr, cfg.eps)
        st.updates += 1
    u = K.precondition(xp, factors, h)
    if cfg.clip is not None:
        u = K.clip_rms(xp, u, cfg.clip)
    step = xp.ascontiguousarray(u).reshape(-1).astype(param.dtype, copy=False)
    if cfg.weight_decay != 0 and lay.decays:
        step += param * cfg.weight_decay
    step *= -lr
    param += step


_D = KronPsgdConfig  # the constructor's defaults: written once, in the config


class KronPsgd(PerParamOptimizer):
    """``KronPsgd(...)``; see the module doc.  Builders: ``.with_momentum(mu)``, ``.with_weight_decay(wd)``;
    ``probe=fn`` injects the probes."""

    algorithm = "kron_psgd"
    config_cls = KronPsgdConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    kernel_fn = staticmethod(_fused.kernel_update)
    elementwise = False
    threaded = False
    blas_bound = True  # the BLAS held at one thread on NumPy (see the module doc)
    matters = ("max_size_triangular", "min_ndim_triangular", "memory_save_mode", "merge_dims", "merge_rule",
               "precond_dtype", "seed", "balance_seed")

    def __init__(self, lr: float, precond_lr: float = _D.precond_lr, momentum: float = _D.momentum,
                 weight_decay: float = _D.weight_decay, eps: float = _D.eps, clip: float | None = _D.clip, *,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 probe: Callable[[str, tuple[int, ...], int], Array] | None = None,
                 precision: Precision | None = None, **knobs: Any) -> None:
        super().__init__(KronPsgdConfig(lr, precond_lr, momentum, weight_decay, eps, clip, **knobs),
                         lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)
        self.hooks = self.hooks.replace(prepare=self._prepare_with_ctx)
        self.set_probe(probe)

    def with_momentum(self, mu: float) -> KronPsgd:
        """A new optimizer with ``momentum = mu`` (before the first step)."""
        return self._rebuild(momentum=mu)

    def with_weight_decay(self, wd: float) -> KronPsgd:
        """A new optimizer with ``weight_decay = wd`` (before the first step)."""
        return self._rebuild(weight_decay=wd)

    def _rebuild(self, **change: Any) -> KronPsgd:
        if self._slots:
            raise ValueError("KronPsgd: builders configure a fresh optimizer; this one already holds state")
        kw = {**config_to_dict(self.config), "lr": self._lr, **change}
        kw["prob_schedule"] = tuple(kw["prob_schedule"])
        return type(self)(lr_scale=self._lr_scale_spec, weight_decay_mask=self._decay_spec, probe=self._hook, **kw)

    def set_probe(self, fn: Callable[[str, tuple[int, ...], int], Array] | None) -> None:
        """Inject the probes: ``fn(name, shape, index) -> V`` (None: the built-in generator)."""
        if fn is not None and not callable(fn):
            raise TypeError(f"KronPsgd: probe must be callable or None, got {fn!r}")
        self._hook = fn
        self._ctx: dict[str, tuple[Any, ...]] = {}

    def _prepare_with_ctx(self, items: Sequence[OptItem]) -> list[Any]:
        """``hooks.prepare``: the driver's, then each state's noise stream and probe (``ctx``)."""
        prepared = self._prepare(items)
        for it, slot, _ in prepared:  # serial, before any worker runs
            ctx = self._ctx.get(it.name)
            if ctx is None:
                ctx = self._ctx[it.name] = (it.name, L.stream_key(self.config.seed, it.name), self._hook)
            slot.state.ctx = ctx
        return prepared

    def factors(self, name: str) -> list[Array]:
        """Copies of the preconditioner factors of ``name``: (d, d) upper-triangular or (d,) diagonal arrays."""
        slot = self._slots[name]
        return [q.copy() for _, q in K.factor_views(slot.state.q, slot.state.layout)]

    def preconditioner_shape(self, name_or_shape: str | Sequence[int]) -> tuple[int, ...]:
        """The (merged) shape the preconditioner sees for a parameter name or a shape."""
        if isinstance(name_or_shape, str):
            merged: tuple[int, ...] = self._slots[name_or_shape].state.layout.merged
            return merged
        return L.make_layout(self.config, tuple(name_or_shape)).merged

    def preconditioner_nbytes(self) -> int:
        """Bytes held by the preconditioner factors (without the momentum)."""
        return sum(s.state.q.nbytes for s in self._slots.values())

"""Adafactor8Bit: Adafactor with log-space 8-bit block-quantized states, APOLLO, Fira and CAME.

Follows the Python package adafactor8bit 0.4.6 (on PyPI): the same options under the same
names and defaults, and its pure-PyTorch (CPU) numbers.  Paths, chosen per parameter from its (group) config:

* **factored Adafactor** (≥ 2-D, ``factored=True``, default): R, C ← lerp(·, row/col means of g² + eps1, b),
  u = g·rsqrt(R/max(mean R, eps1))·rsqrt(C); with ``beta1`` Adam-style momentum (EMA of g, then normalised);
* **unfactored** (1-D or ``factored=False``): Adafactor-style v ← lerp(v, g² + eps1, b), u = g·rsqrt(max(v, eps1²))
  (with ``beta1``: momentum of the clipped u, the "momentum-only" rule), or **Adam-style** when ``factored=False``
  with a fixed ``beta2`` (torch.optim.Adam: eps added to √v̂, bias correction);
* **SGD** (``beta2 = beta2_decay = None``), **CAME** (``beta3``), **APOLLO** (``apollo_rank > 0`` on ≥ 2-D
  tensors; ``flatopt.adafactor8bit.apollo``) with the **Fira** limiter (``flatopt.adafactor8bit.fira``).

b = 1 − beta2, or t^beta2_decay (−0.8) when beta2 is None; ρ = min(lr, 1/√t) (``relative_step``) or lr;
α = ρ·max(RMS(p), eps2) (``scale_parameter``); decay p ← p·(1 − c·weight_decay), c = α (``scale_weight_decay``) or
ρ, before the update; final p ← p − α/max(1, RMS(u)/d)·u.  ``lr_scale(name)`` multiplies ρ.

Quantization (``quantize``, parameters with numel ≥ ``min_8bit_size``): second moments and CAME confidences in AL8 /
AL16 (``flatopt.adafactor8bit.quant``), the first moment in uf8 / uf4 / d8 / d4.  The exact float32 EMA drives each step; only
the stored copy is requantized.  ``state_dict`` holds the codes (uint8/uint16), block scales and min-logs as stored;
block sizes and formats are recorded with them, and ``load_state_dict`` converts a snapshot saved with another
layout (``flatopt.adafactor8bit.migrate``: requantized, or reset keeping t when the path changed; one warning).

Execution (``flatopt.adafactor8bit.paths``): the factored and CAME paths run on Adafactor's own blocked passes
(``flatopt.adafactor.factored_passes.FactoredPasses``) with the 8-bit factor EMA plugged in; elementwise states update over
ranges aligned to the codec blocks.  On NumPy a parameter of ≥ ``SPLIT_MIN`` elements spreads its passes (APOLLO: its
full-size elementwise passes) over the threads (bits independent of the thread count); smaller ones step whole,
several at once.

Deviations from the original (all deliberate):
* codec floor F = log2(max(eps², FLT_MIN)) and the 126 cap on every state and backend (the original's CPU encoder
  uses −126; equal for eps1 = 1e-30, so codes then match bit for bit);
* a state slot is kept in float32 when its quantized layout would be larger (short factor vectors: the original
  pads each to a whole block); set ``block_size`` small to quantize short vectors;
* CAME on the APOLLO path uses the exact res_low for the update; APOLLO's v_low uses the APOLLO floor also at t = 1;
* non-finite gradients: read as 0 on the APOLLO path (as the original on every device), not sanitised elsewhere
  (as its CPU path); the Fira limiter zeroes an update whose norm is non-finite; same policy on NumPy and CuPy;
* APOLLO projections come from flatopt's own counter-based draw unless injected (``apollo_proj_fn``,
  ``apollo_next_seed``): a function of (seed, shape) with the same bits on NumPy and CuPy, so a checkpoint moved
  between them continues with the same P (``flatopt.adafactor8bit.apollo_proj``), drawn on all threads on NumPy;
* ``lag_norm`` (the original: CUDA kernels only, ignored on its CPU path) is honoured on every backend for the
  non-APOLLO paths: the clip and Fira factor of step t use step t − 1's update norm (no clip at t = 1);
* ``stochastic_round_writeback=True`` (BF16/FP16 parameters in the original) is ``precision=
  Precision(writeback="stochastic")`` (``flatopt.Precision``, the write-back policy every optimizer takes): the
  original's unbiased rounding of 16-bit parameters, with random bits that are a pure function of (seed, name, t,
  element index) instead of the original's generator state; float32/float64 parameters are written back exactly, as
  in the original.  It is optimizer-wide (a group may not set it differently), and an explicit ``precision=`` with
  another write-back is an error.  ``warmup_multiplier`` (a CUDA allocator priming trick) is accepted and validated
  but has no effect: a step allocates nothing.

GPU (CuPy arrays): the factored, CAME and elementwise (Adam- and Adafactor-style) steps are fused CUDA kernels
(``flatopt.adafactor8bit.fused``, ``kernels/adafactor8bit.cu``): decode, EMA, statistics, update and re-encode in
registers, 4–13 launches per parameter (the factored step without a first moment, the default, and the elementwise
step with a float32 second moment and no first moment: 7 and 3 launches per group of tensors, segmented over all of
them, ``flatopt.adafactor8bit.segmented``), no host synchronisation, no allocation per step, deterministic reductions
(no atomics), the twin's bits wherever its sums are exact (otherwise the sums' rounding differs: see ``fused``);
SGD mode, Fira, ``lag_norm``, ``maximize`` and the momentum-only rule included.  APOLLO's step is 7 kernels around
its projection GEMM (``flatopt.adafactor8bit.apollo_fused``, ``kernels/apollo8bit.cu``; P drawn on the device from
its seed, no generator object, no synchronisation); APOLLO with CAME or ``apollo_factorize`` forms its low-rank
update with the twin's CuPy code (≈ 35 launches).  The twin is the same array-agnostic code as NumPy, every
data-dependent scalar (α, norms, clip and Fira factors) a 0-d device array.  ``use_cuda_kernel=False`` (per group)
or ``FLATOPT_FORCE_TWIN=1`` runs the twin (the array-agnostic code, without the state kernels for the former).

``end_iteration`` only counts iterations; the per-name step t drives b, ρ, bias correction and APOLLO refreshes.
Use it to save optimizer memory: the factored path costs ≈ 0.002 B/param, AdamW-style AL8 + uf8 ≈ 2.02 B/param.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Literal, Mapping, Sequence, TypeAlias, Union

import numpy as np

from . import apollo, fused, paths, segmented
from ..core import blocks, gpu_run, parallel, shards
from ..adafactor import factored_passes
from . import state as S
from . import migrate as migration
from ..core.driver import PerParamOptimizer, config_from_dict
from ..core.hooks import Hooks
from ..core.precision import Precision
from ..core.types import FORMAT_VERSION, Array, DecayMask, JSONDict, LrScale, OptimizerState, OptItem
from ..errors import IncompatibleStateError
from ..core.validate import check_lr, check_range, normalize_numbers
from .quant import M_FORMATS, V_FORMATS
from ..routing import Select

Adafactor8BitState = S.Adafactor8BitState
StateMigrationWarning = migration.StateMigrationWarning
MATTERS = ("quantize", "block_size", "m_block_size", "m_quant_type", "v_quant_type", "c_quant_type",
           "min_8bit_size", "factored", "apollo_rank", "apollo_factorize", "lag_norm")
# NumPy: parameters of at least this many elements step one at a time, their passes split over the threads; smaller
# ones step whole, several at once (each on one thread).
SPLIT_MIN = 1 << 17

Selector: TypeAlias = Union[Select, str, Sequence[str], Callable[[str, tuple[int, ...]], bool]]
"""A ``groups`` selector: a :class:`flatopt.routing.Select`, a glob pattern, a list of names or a predicate
``(name, shape) -> bool``."""


@dataclasses.dataclass(frozen=True)
class Adafactor8BitConfig:
    lr: float = 1e-2
    beta1: float | None = None
    beta2: float | None = None
    beta2_decay: float | None = -0.8
    beta3: float | None = None
    eps_came: float = 1e-16
    eps: tuple[float | None, float] = (1e-30, 1e-3)
    weight_decay: float = 0.0
    d: float = 1.0
    maximize: bool = False
    relative_step: bool = True
    scale_parameter: bool = True
    scale_weight_decay: bool = True
    factored: bool = True
    quantize: bool = True
    block_size: int = 2048
    m_block_size: int = 256
    m_quant_type: str = "uf8"
    v_quant_type: str = "al8"
    c_quant_type: str | None = None
    min_8bit_size: int = 4096
    use_cuda_kernel: bool = True
    apollo_rank: int = 0
    apollo_update_proj_gap: int = 200
    apollo_scale_type: str = "channel"
    apollo_scale: float = 1.0
    apollo_scale_front: bool = False
    apollo_eps: float = 1e-6
    apollo_factorize: bool = False
    apollo_cache_proj: bool = False
    enable_fira_for_apollo: bool = True
    enable_fira_for_adafactor: bool = False
    fira_margin: float = 0.01
    momentum_only_1d: bool | None = None
    bias_correction: bool | None = None
    lag_norm: bool = False
    stochastic_round_writeback: bool = False
    warmup_multiplier: int = 0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        o = "Adafactor8Bit"
        check_lr(self.lr, "lr", o)
        for f in ("beta1", "beta2", "beta3"):
            if getattr(self, f) is not None:
                check_range(o, f, getattr(self, f), 0.0, 1.0, hi_open=True)
        if self.beta2_decay is not None:
            check_range(o, "beta2_decay", self.beta2_decay, -math.inf, 0.0)
        if not isinstance(self.eps, (tuple, list)) or len(self.eps) != 2:
            raise TypeError(f"{o}: eps must be a pair (eps1, eps2), got {self.eps!r}")
        if self.eps[0] is not None:
            check_range(o, "eps[0]", self.eps[0], 0.0, math.inf)
        check_range(o, "eps[1]", self.eps[1], 0.0, math.inf)
        object.__setattr__(self, "eps", (None if self.eps[0] is None else float(self.eps[0]), float(self.eps[1])))
        for f in ("eps_came", "weight_decay", "d", "apollo_scale", "fira_margin"):
            check_range(o, f, getattr(self, f), 0.0, math.inf)
        check_range(o, "apollo_eps", self.apollo_eps, 0.0, math.inf, lo_open=True)
        for f in ("maximize", "relative_step", "scale_parameter", "scale_weight_decay", "factored", "quantize",
                  "use_cuda_kernel", "apollo_scale_front", "apollo_factorize", "apollo_cache_proj",
                  "enable_fira_for_apollo", "enable_fira_for_adafactor", "lag_norm", "stochastic_round_writeback"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"{o}: {f} must be a bool, got {getattr(self, f)!r}")
        for f in ("momentum_only_1d", "bias_correction"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), bool):
                raise TypeError(f"{o}: {f} must be None or a bool, got {getattr(self, f)!r}")
        for f, lo in (("block_size", 128), ("m_block_size", 32), ("min_8bit_size", 0), ("apollo_rank", 0),
                      ("apollo_update_proj_gap", 1), ("warmup_multiplier", 0)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{o}: {f} must be an int >= {lo}, got {v!r}")
        if self.block_size % 128:
            raise ValueError(f"{o}: block_size must be a multiple of 128, got {self.block_size}")
        if self.m_block_size % 4:
            raise ValueError(f"{o}: m_block_size must be a multiple of 4, got {self.m_block_size}")
        for f, ok in (("m_quant_type", M_FORMATS), ("v_quant_type", V_FORMATS), ("c_quant_type", V_FORMATS + (None,)),
                      ("apollo_scale_type", ("channel", "tensor"))):
            if getattr(self, f) not in ok:
                raise ValueError(f"{o}: {f} must be one of {ok}, got {getattr(self, f)!r}")
        if self.beta2 is None and self.beta2_decay is None:
            if self.relative_step or self.apollo_rank > 0 or self.beta3 is not None:
                raise ValueError(f"{o}: SGD mode (beta2 and beta2_decay None) needs relative_step=False, "
                                 f"apollo_rank=0 and beta3=None")
        if self.beta3 is not None and self.beta1 is None:
            raise ValueError(f"{o}: beta3 (CAME) requires beta1")
        if self.beta3 is not None and not self.factored and self.apollo_rank == 0:
            raise ValueError(f"{o}: beta3 (CAME) requires factored=True unless apollo_rank > 0")


def _as_select(sel: Selector) -> Select:
    if isinstance(sel, Select):
        return sel
    if isinstance(sel, str):
        return Select(patterns=[sel])
    if callable(sel):
        return Select(predicate=sel)
    return Select(names=list(sel))


def _writeback_alias(base: Adafactor8BitConfig, precision: Precision | None, groups: Any) -> Precision | None:
    """The policy ``stochastic_round_writeback`` stands for (module doc): ``precision`` itself, or
    ``Precision(writeback="stochastic")`` where the option is set and ``precision`` is not given."""
    for i, grp in enumerate(groups or ()):
        over = grp[1] if isinstance(grp, tuple) and len(grp) == 2 and isinstance(grp[1], Mapping) else {}
        if over.get("stochastic_round_writeback", base.stochastic_round_writeback) != base.stochastic_round_writeback:
            raise ValueError(f"Adafactor8Bit: groups[{i}]: stochastic_round_writeback is the write-back policy of the "
                             f"whole optimizer (precision=); a group may not set it differently")
    if not base.stochastic_round_writeback:
        return precision
    if precision is None:
        return Precision(writeback="stochastic")
    if isinstance(precision, Precision) and precision.writeback != "stochastic":
        raise ValueError(f"Adafactor8Bit: stochastic_round_writeback=True is writeback='stochastic', which "
                         f"contradicts precision={precision!r}")
    return precision


@functools.lru_cache(maxsize=64)
def _without_decay(cfg: Adafactor8BitConfig) -> Adafactor8BitConfig:
    """``cfg`` with ``weight_decay = 0`` (one object per configuration: states of one group share it)."""
    return cfg if cfg.weight_decay == 0 else dataclasses.replace(cfg, weight_decay=0.0)


_D = Adafactor8BitConfig  # the constructor's defaults: written once, in the config


class Adafactor8Bit(PerParamOptimizer):
    """``Adafactor8Bit(...)``: the options of adafactor8bit 0.4.6 (see the module doc).

    ``groups``: per-group options by parameter name, a sequence of ``(selector, overrides)``; the selector is a
    :class:`flatopt.routing.Select`, a glob pattern, a list of names or a predicate ``(name, shape) -> bool``;
    the first matching group's overrides apply (e.g. ``{"quantize": False, "weight_decay": 0.0}``), parameters no
    group matches use the constructor's options.  ``apollo_proj_fn(seed, shape)`` and ``apollo_next_seed(seed)``
    replace the APOLLO random source (a testing aid for exact comparisons; see ``flatopt.adafactor8bit.apollo``)."""

    algorithm = "adafactor8bit"
    config_cls = Adafactor8BitConfig
    init_fn = staticmethod(S.init)
    update_fn = staticmethod(paths.update)
    matters = MATTERS
    threaded = True

    _migration: migration.Report | Literal[False] | None  # during load_state_dict (see there)

    def __init__(self, lr: float = _D.lr, *, groups: Sequence[tuple[Selector, Mapping[str, Any]]] | None = None,
                 lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 apollo_proj_fn: Callable[[int, tuple[int, ...]], Array] | None = None,
                 apollo_next_seed: Callable[[int], int] | None = None, precision: Precision | None = None,
                 **options: Any) -> None:
        base = Adafactor8BitConfig(lr=lr, **options)
        super().__init__(base, lr_scale=lr_scale, weight_decay_mask=weight_decay_mask,
                         precision=_writeback_alias(base, precision, groups))
        self._plain_writeback_exact = base.stochastic_round_writeback  # (the original's float32 parameters)
        self._groups: list[tuple[Select, dict[str, Any], Adafactor8BitConfig]] = []
        for i, grp in enumerate(groups or ()):
            try:
                sel, overrides = grp
            except (TypeError, ValueError):
                raise TypeError(f"Adafactor8Bit: groups[{i}] must be (selector, overrides), got {grp!r}") from None
            if "lr" in overrides:
                raise ValueError(f"Adafactor8Bit: groups[{i}]: use lr_scale for per-name learning rates")
            self._groups.append((_as_select(sel), dict(overrides), dataclasses.replace(base, **overrides)))
        self._projector = apollo.ApolloProjector(apollo_proj_fn, apollo_next_seed)
        self._apollo_seed_counter = 1
        # lr: the pair (base lr, lr_scale), which paths/apollo apply themselves
        self.hooks = Hooks[tuple[float, float]](
            init=self._init_seeded, update=self._update_item, effective_lr=self._lr_pair,
            kernel_update=self._kernel_item, check_shape=self.hooks.check_shape, kernel_batch=self._kernel_batch,
            run=self._run_all)

    # ---------------------------------------------------------------------------------------- routing
    def config_for(self, name: str, shape: tuple[int, ...]) -> Adafactor8BitConfig:
        """The configuration parameter ``name`` is stepped with (first matching group, else the base; with
        ``weight_decay`` 0 where ``weight_decay_mask`` excludes ``name``)."""
        cfg: Adafactor8BitConfig = self.config
        for sel, _, group in self._groups:
            if sel.matches(name, tuple(shape)):
                cfg = group
                break
        return cfg if self.decays(name) else _without_decay(cfg)

    def _init_seeded(self, name: str, xp: Any, shape: tuple[int, ...], dtype: np.dtype[Any], /) -> Any:
        """``hooks.init``: the state of ``name`` with its group's configuration (and the next APOLLO seed)."""
        cfg = self.config_for(name, shape)
        seed = None
        if cfg.apollo_rank > 0 and len(shape) >= 2:
            seed = self._apollo_seed_counter
            self._apollo_seed_counter += 1
        return S.init(xp, cfg, shape, dtype, apollo_seed=seed)

    def _config_key(self) -> JSONDict:
        key = super()._config_key()
        key["groups"] = [{"select": sel.describe(), **{k: v for k, v in ov.items() if k in MATTERS}}
                         for sel, ov, _ in self._groups]
        return key

    def _config_dict(self) -> JSONDict:
        d = super()._config_dict()
        d["groups"] = [{"select": sel.describe(), "overrides": dict(ov)} for sel, ov, _ in self._groups]
        return d

    # --------------------------------------------------------------------------------------- stepping
    # the driver's lr is a float; here it is the pair (base lr, lr_scale), which paths/apollo apply themselves
    def _lr_pair(self, scale: float) -> tuple[float, float]:
        return (self._lr if self._lr is not None else 0.0, scale)

    def _run_all(self, prepared: list[Any]) -> None:
        cpu: list[Any] = []
        gpu: list[Any] = []
        for it, slot, scale in prepared:
            slot.t += 1
            (gpu if slot.backend == "cupy" else cpu).append((it, slot, self._lr_pair(scale)))
        whole: list[Any] = []
        split: list[Any] = []
        for it, slot, lr in cpu:
            big = it.param.size >= SPLIT_MIN and self.threaded
            (split if big else whole).append((it, slot, lr))
        # factored/CAME tensors of >= BLAS_MIN elements sum their statistics by single-threaded GEMVs while the
        # BLAS is held at one thread (threadpoolctl; per tensor, whatever it is stepped with: same bits)
        blas = any(it.param.size >= factored_passes.BLAS_MIN and slot.state.apollo_seed is None
                   for it, slot, _ in cpu)
        with shards.blas_capped(blas) as capped:
            if whole:  # each item on one thread, several at once (per-thread scratch)
                parallel.run_tasks([(it.param.size, it.name, functools.partial(self._step_whole, it, slot, lr,
                                                                                capped))
                                     for it, slot, lr in whole], serial=not self.threaded)
            for it, slot, lr in split:  # one at a time: its passes on all threads (bits independent of the threads)
                st = slot.state
                if st.apollo_seed is not None:
                    apollo.update(np, st.cfg, st, it.param, it.grad, t=slot.t, lr=lr, shape=st.sizes["shape"],
                                   projector=self._projector, threads=True)
                    continue
                blocks.run_phased([(it.name, paths.phases(np, st.cfg, st, it.param, it.grad, t=slot.t, lr=lr,
                                                               shape=st.sizes["shape"], blas=capped))])
        if gpu:
            gpu_run.run_gpu(self, gpu)

    def _step_whole(self, it: OptItem, slot: Any, lr: tuple[float, float], blas: bool = False) -> None:
        self._update_item(np, slot.state, it.param, it.grad, t=slot.t, lr=lr, scratch=[], blas=blas)

    def _kernel_batch(self, gpu: list[Any]) -> bool:
        """``core.gpu_run.run_gpu``'s hook: the segmentable items by segmented kernels over all tensors of a group
        (``adafactor8bit.segmented``), then the rest per tensor (a second ``run_gpu`` whose hook finds nothing to
        segment); False when nothing was segmentable."""
        rest = segmented.run(self, gpu)
        if len(rest) == len(gpu):
            return False
        if rest:
            gpu_run.run_gpu(self, rest)
        return True


    def _kernel_item(self, state: Any, param: Array, grad: Array, /, *, t: int, lr: tuple[float, float]) -> bool:
        """The fused CUDA step of the non-APOLLO paths (``adafactor8bit.fused``); False: the twin runs."""
        return fused.kernel_step(state.cfg, state, param, grad, t=t, lr=lr)

    def _update_item(self, xp: Any, state: Any, param: Array, grad: Array, /, *, t: int, lr: tuple[float, float],
                     scratch: list[Array], blas: bool = False) -> None:
        cfg = state.cfg
        shape = state.sizes["shape"]
        if param.size == 0:  # nothing to update (the step count still advances)
            return
        if state.apollo_seed is not None:
            apollo.update(xp, cfg, state, param, grad, t=t, lr=lr, shape=shape, projector=self._projector)
        else:
            paths.update(xp, cfg, state, param, grad, t=t, lr=lr, shape=shape, blas=blas)

    def _extra_state(self) -> JSONDict:
        return {"apollo_seed_counter": self._apollo_seed_counter}

    def _check_extra(self, extra: JSONDict) -> None:
        counter = extra.get("apollo_seed_counter", 1)
        if isinstance(counter, bool) or not isinstance(counter, (int, np.integer)) or counter < 1:
            raise ValueError(f"apollo_seed_counter must be an int >= 1, got {counter!r}")

    def _load_extra(self, extra: JSONDict) -> None:
        self._apollo_seed_counter = int(extra.get("apollo_seed_counter", 1))

    def load_state_dict(self, state: OptimizerState, *, restore_hparams: bool = False, migrate: bool = True,
                        strict: bool = False) -> bool:
        """The driver's load; a snapshot of this algorithm saved with another state layout (formats, block sizes,
        ``quantize``, ``min_8bit_size``, path, group overrides) is converted to this optimizer's layout or reset per
        parameter (``flatopt.adafactor8bit.migrate``), with one ``StateMigrationWarning`` naming the parameters (also in
        ``last_load_notes``).  ``migrate=False`` or ``restore_hparams=True``: such a snapshot is refused.  A refusal
        returns ``False`` with the reason in ``last_load_notes`` (``strict=True``: raises it)."""
        with self._lock:
            counter = self._apollo_seed_counter
            # None: no migration; False: allowed (_build_from_state puts its migration.Report here if used)
            self._migration = None if restore_hparams or not migrate else False
            try:
                groups = self._groups_from(state) if restore_hparams else None
            except IncompatibleStateError as exc:
                self.last_load_notes = [str(exc)]
                if strict:
                    raise
                return False
            try:
                ok = super().load_state_dict(state, restore_hparams=restore_hparams, strict=strict)
                report = self._migration
            except IncompatibleStateError:
                self._apollo_seed_counter = counter  # (building the refused state may have drawn seeds)
                raise
            finally:
                self._migration = None
            if not ok:
                self._apollo_seed_counter = counter
            elif groups is not None:
                self._restore_groups(groups)
            elif report:
                self._apollo_seed_counter = report.seed_counter
                message = report.warning()
                if message:
                    warnings.warn(message, migration.StateMigrationWarning, stacklevel=2)
            return ok

    def _groups_from(self, state: OptimizerState
                     ) -> list[tuple[Select, dict[str, Any], Adafactor8BitConfig]] | None:
        """For ``restore_hparams`` (nothing changed): each group takes the snapshot's overrides when its selector has
        the same description (selectors themselves are code and stay this object's), the group configurations
        rebuilt from the snapshot's base; ``None`` for a snapshot the driver refuses anyway (another algorithm, a
        config that is not a dict); :class:`IncompatibleStateError` when they do not make configurations."""
        if state.algorithm != self.algorithm or not isinstance(state.config, dict):
            return None
        saved = state.config.get("groups", [])
        groups: list[tuple[Select, dict[str, Any], Adafactor8BitConfig]] = []
        try:
            base = config_from_dict(self.config_cls, state.config)
            for i, (sel, ov, _) in enumerate(self._groups):
                mine = saved[i] if isinstance(saved, list) and i < len(saved) else None
                if isinstance(mine, dict) and mine.get("select") == sel.describe():
                    ov = dict(mine.get("overrides", ov))
                groups.append((sel, ov, dataclasses.replace(base, **ov)))
        except (TypeError, ValueError) as exc:
            raise IncompatibleStateError(f"snapshot field 'config': its groups do not make configurations "
                                         f"({type(exc).__name__}: {exc})") from None
        return groups

    def _restore_groups(self, groups: list[tuple[Select, dict[str, Any], Adafactor8BitConfig]]) -> None:
        """After a ``restore_hparams`` load: install ``_groups_from``'s groups; every loaded parameter steps with
        its rebuilt configuration."""
        self._groups = groups
        for name, slot in self._slots.items():
            slot.state.cfg = self.config_for(name, slot.shape)

    def _build_from_state(self, state: OptimizerState) -> tuple[dict[str, Any], list[str]]:
        try:
            return super()._build_from_state(state)
        except IncompatibleStateError as exc:
            if state.algorithm != self.algorithm or state.format_version != FORMAT_VERSION:
                raise
            if getattr(self, "_migration", None) is not False:
                raise IncompatibleStateError(f"{exc} (migration to this layout was not allowed: migrate=False or "
                                             f"restore_hparams=True)") from None
            built = migration.build(self, state)
            if built is None:
                raise IncompatibleStateError(f"{exc}; nor can it be migrated to this optimizer's layout") from None
            slots, notes, self._migration = built
            return slots, notes


def hybrid_groups(apollo_rank: int = 256, weight_decay: float = 1e-2) -> list[tuple[Select, dict[str, Any]]]:
    """The hybrid routing adafactor8bit's README recommends: 1-D / bias / norm in float32 without decay on
    Adafactor; embeddings in float32 without decay on APOLLO; other 2-D weights 8-bit with decay on APOLLO; > 2-D
    weights 8-bit with decay on Adafactor.  Pass as ``groups=`` (with ``weight_decay`` also given to the constructor for the rest)."""
    sensitive = Select(predicate=lambda n, s: len(s) <= 1 or "bias" in n or "norm" in n, description="1-D/bias/norm")
    embed = Select(predicate=lambda n, s: "embed" in n.lower(), description="embed")
    mat = Select(predicate=lambda n, s: len(s) == 2, description="2-D")
    return [
        (sensitive, dict(weight_decay=0.0, quantize=False, apollo_rank=0)),
        (embed, dict(weight_decay=0.0, quantize=False, apollo_rank=apollo_rank)),
        (mat, dict(weight_decay=weight_decay, quantize=True, apollo_rank=apollo_rank)),
        (Select.all(), dict(weight_decay=weight_decay, quantize=True, apollo_rank=0)),
    ]

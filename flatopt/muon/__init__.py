"""Muon: momentum, then a Newton–Schulz orthogonalised update, for 2-D matrices (Keller Jordan's Muon, as in
torch.optim.Muon).

Update rule for a matrix parameter W (r×c, row-major flat buffer) with gradient G, buffer B (zeros at creation),
μ = momentum, η = lr · lr_scale(name)::

    "ema" convention (default; torch.optim.Muon, Keller Jordan):  B ← μ·B + (1 − μ)·G;  D = (1 − μ)·G + μ·B  (Nesterov)
    "sgd" convention (Burn, ruda-optim's default, rlx-optim):     B ← μ·B + G;          D = G + μ·B          (Nesterov)
    (without Nesterov D = B)
    X = D / N,  N = max(‖D‖_F, ε) ("clamp", torch/Burn)  or  ‖D‖_F + ε ("additive", Keller)
    ns_steps times, with (a, b, c) = ns_coefficients:  A = X·Xᵀ;  X ← a·X + (b·A + c·A·A)·X
    W ← W·(1 − η·λ)                       decoupled decay with the *unadjusted* η
    W ← W − η·s·X                         s: the lr-adjust rule

The Gram matrix is always the smaller min(r, c)²: for a tall matrix (r > c) flatopt computes A = XᵀX and
X ← a·X + X·(b·A + c·A·A), which is torch's transpose-then-iterate in exact arithmetic (A and B are symmetric) but
needs no transposed copy.  lr-adjust rules: ``"original"`` s = √max(1, fan_out/fan_in) (torch/Keller); with
``layout="out_in"`` (default, torch's [out, in] storage) fan_out/fan_in = r/c, with ``"in_out"`` (Burn's Linear) it
is c/r.  ``"match_rms_adamw"`` s = 0.2·√max(r, c) (Moonshot).  ``None`` s = 1 (note: torch's ``adjust_lr_fn=None``
means "original"; flatopt's ``None`` means *no* adjustment).

Both momentum conventions give the same orthogonalised update (the EMA buffer is (1 − μ) times the SGD buffer and
NS divides by the norm first), but the stored buffers differ by that factor: the convention is part of the state
key and a snapshot of the other convention is refused.

Deviations from the references: Newton–Schulz runs in the **parameter dtype** (float32 or float64), not bfloat16
(torch, Keller): flatopt agrees with them to the bf16 rounding (~1e-2 relative on the update) and exactly with a
float64 reference in float64.  No silent cast, no master copy.  The Frobenius norm is a deterministic pairwise sum
(never a multi-threaded BLAS dot), so results do not depend on threads.  The gradient is never written (Keller's
``muon_update`` overwrites ``p.grad`` with the Nesterov direction).  Only 2-D, non-empty parameters are accepted:
route biases, norm gains, embeddings and output heads to AdamW with :class:`flatopt.MuonAdamW` or a
:class:`flatopt.routing.Router`.

On CuPy the same GEMMs run on cuBLAS, and the elementwise work between them runs in the fused kernels of
``kernels/muon.cu`` (``muon/fused.py``: 28 launches a step at ns_steps = 5, the twin's bits; ``FLATOPT_FORCE_TWIN=1``
runs this module's code instead); the norm, its clamp and the division stay on the device (no host
synchronisation).  ``end_iteration`` only counts iterations (Muon has no schedule).  State per name:
``momentum_buffer`` (parameter dtype).  Work buffers (2·r·c + 2·min(r, c)² elements) are allocated at the first step
of a name and never saved.  **BLAS threads.** On NumPy every Newton–Schulz GEMM runs with the BLAS held at **one thread** (through
``threadpoolctl``, the ``fast`` extra), in every mode: ``step``, a serial ``step_batch`` and the workers.  A GEMM's
bits depend on the BLAS thread count on some CPUs (with OpenBLAS's Haswell kernels, for one, a 2-thread sgemm
differs in the last bits from a 1-thread one), so this is what makes ``step_batch`` ≡ the ``step`` loop ≡ any
``workers`` hold on every CPU and under any ``OPENBLAS_NUM_THREADS`` (tested; the suite also runs under one BLAS
thread).  Without ``threadpoolctl`` nothing can hold the BLAS: every mode then runs the items serially on the BLAS's
own threads (the same calls), and the results may change with ``OPENBLAS_NUM_THREADS``.  So that a matrix stepped
alone still uses the cores, A·A and B·X are cut into row blocks fixed by the shape (``_row_blocks``) that run on
flatopt's threads (inside a ``workers`` thread: one after another); the Gram matrix stays one syrk call.  This
costs a matrix stepped alone a little against a BLAS on all threads, far less than a plain one-thread cap would.
``step_batch`` with ``workers=K`` runs the matrices on K persistent threads with a fixed, cost-balanced matrix →
thread assignment; many mid-size matrices gain most from it.  Re-measure both (a matrix alone and a batch, against
torch.optim.Muon): ``python -m benchmarks.run --only muon``.  So the default ``workers=None`` means
``min(FLATOPT_NUM_THREADS or the CPUs, 8)`` when ``threadpoolctl`` can hold the BLAS, else 1.
A batch below ``core.parallel.PARALLEL_MIN_COST`` (elements × min dimension) or of one matrix runs serially.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..core import parallel, shards
from ..core.driver import PerParamOptimizer
from ..core.precision import Precision
from ..core.types import Array, DecayMask, LrScale
from ..core.validate import check_lr, check_range, normalize_numbers
from . import fused as _fused
from .numerics import Work, gram, shape_scale, work

CONVENTIONS = ("ema", "sgd")
ADJUST_RULES = ("original", "match_rms_adamw", None)
_F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    adjust_lr: str | None = "original"
    momentum_convention: str = "ema"
    eps_mode: str = "clamp"
    layout: str = "out_in"

    def __post_init__(self) -> None:
        normalize_numbers(self)
        check_lr(self.lr, "lr", "Muon")
        check_range("Muon", "momentum", self.momentum, 0.0, 1.0, hi_open=True)
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"Muon: nesterov must be a bool, got {self.nesterov!r}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("Muon: nesterov needs momentum > 0")
        check_range("Muon", "weight_decay", self.weight_decay, 0.0, math.inf, hi_open=True)
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, (int, np.integer)) or not (
            1 <= self.ns_steps <= 99
        ):
            raise ValueError(f"Muon: ns_steps must be an int in [1, 99], got {self.ns_steps!r}")
        object.__setattr__(self, "ns_steps", int(self.ns_steps))
        if not isinstance(self.ns_coefficients, (tuple, list)) or len(self.ns_coefficients) != 3:
            raise TypeError(f"Muon: ns_coefficients must be three floats (a, b, c), got {self.ns_coefficients!r}")
        for i, v in enumerate(self.ns_coefficients):
            check_range("Muon", f"ns_coefficients[{i}]", v, -math.inf, math.inf, lo_open=True, hi_open=True)
        object.__setattr__(self, "ns_coefficients", tuple(float(v) for v in self.ns_coefficients))
        check_range("Muon", "eps", self.eps, 0.0, math.inf, lo_open=True, hi_open=True)
        if self.adjust_lr not in ADJUST_RULES:
            raise ValueError(f"Muon: adjust_lr must be one of {ADJUST_RULES}, got {self.adjust_lr!r}")
        if self.momentum_convention not in CONVENTIONS:
            raise ValueError(f"Muon: momentum_convention must be 'ema' or 'sgd', got {self.momentum_convention!r}")
        if self.eps_mode not in ("clamp", "additive"):
            raise ValueError(f"Muon: eps_mode must be 'clamp' or 'additive', got {self.eps_mode!r}")
        if self.layout not in ("out_in", "in_out"):
            raise ValueError(f"Muon: layout must be 'out_in' or 'in_out', got {self.layout!r}")


@dataclasses.dataclass
class MuonState:
    momentum_buffer: Array
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata={"persist": False})
    work: Work | None = dataclasses.field(default=None, metadata={"persist": False})


def init(xp: Any, cfg: MuonConfig, shape: tuple[int, ...], dtype: Any) -> MuonState:
    return MuonState(xp.zeros(math.prod(shape), dtype), tuple(shape))


# NumPy: the Newton–Schulz products A·A and B·X are cut into row blocks fixed by the shape alone (``_row_blocks``;
# the Gram matrix stays one syrk call) and run with the BLAS held at one thread (``Muon._run_sharded``):
# on the threads when matrices are stepped one at a time, one block after another inside a worker that steps several
# (``_local.serial``).  The same BLAS calls in every mode, so the bits depend neither on the mode nor on the cores,
# and a matrix stepped alone still uses the cores for two of its three products.
ROW_BLOCK = 128
_local = threading.local()


def _row_blocks(rows: int) -> list[tuple[int, int]]:
    """At most 8 blocks of a multiple of 64 rows (at least ``ROW_BLOCK``), from the row count alone."""
    per = max(ROW_BLOCK, -(-rows // 8))
    per = -(-per // 64) * 64
    return [(i, min(i + per, rows)) for i in range(0, rows, per)]


def _mm(xp: Any, left: Array, right: Array, out: Array) -> None:
    """out = left·right; on NumPy by the row blocks of ``left`` (see ``_row_blocks``)."""
    if xp is not np:
        xp.matmul(left, right, out=out)
        return
    tasks = [((i1 - i0) * right.size, "muon", functools.partial(np.matmul, left[i0:i1], right, out=out[i0:i1]))
             for i0, i1 in _row_blocks(left.shape[0])]
    parallel.run_tasks(tasks, serial=getattr(_local, "serial", False) or not shards.can_cap())


def newton_schulz(xp: Any, cfg: MuonConfig, w: Work, shape: tuple[int, ...]) -> Array:
    """Orthogonalise the (r, c) matrix held flat in ``w.x`` (overwritten); return the flat buffer holding the result
    (``w.x`` or ``w.y``; the other one, ``w.a`` and ``w.b`` are clobbered)."""
    r, c = shape
    x, y, xm, ym, a_buf, b_buf = w.x, w.y, w.xm, w.ym, w.a, w.b
    dt = x.dtype.type
    xp.multiply(x, x, out=y)
    norm = xp.sqrt(y.sum())  # pairwise sum: deterministic, and a device scalar on CuPy (no host sync)
    denom = xp.maximum(norm, dt(cfg.eps)) if cfg.eps_mode == "clamp" else norm + dt(cfg.eps)
    x /= denom
    a, b, cc = cfg.ns_coefficients
    wide = r <= c
    for _ in range(cfg.ns_steps):
        gram(xp, xm, a_buf, wide)
        _mm(xp, a_buf, a_buf, b_buf)
        b_buf *= dt(cc)
        a_buf *= dt(b)
        b_buf += a_buf  # B = b·A + c·A·A
        if wide:
            _mm(xp, b_buf, xm, ym)
        else:
            _mm(xp, xm, b_buf, ym)
        x *= dt(a)
        y += x  # a·X + B·X
        x, y, xm, ym = y, x, ym, xm
    return x


def update(xp: Any, cfg: MuonConfig, st: MuonState, p: Array, g: Array, *, t: int, lr: float,
           scratch: list[Array]) -> None:
    """One Muon step on a whole flat matrix buffer (``scratch`` is unused: work buffers live in the state)."""
    shape = st.shape
    w = work(xp, st, p)
    x, y = w.x, w.y
    dt = p.dtype.type
    buf, mu = st.momentum_buffer, dt(cfg.momentum)
    if cfg.momentum_convention == "ema":
        xp.multiply(g, dt(1.0 - cfg.momentum), out=x)  # (1 − μ)·G
        buf *= mu
        buf += x
        if cfg.nesterov:
            xp.multiply(buf, mu, out=y)
            x += y  # (1 − μ)·G + μ·B
        else:
            xp.copyto(x, buf)
    else:
        buf *= mu
        buf += g
        if cfg.nesterov:
            xp.multiply(buf, mu, out=x)
            x += g  # G + μ·B
        else:
            xp.copyto(x, buf)
    out = newton_schulz(xp, cfg, w, shape)
    if cfg.weight_decay != 0:
        p *= dt(1.0 - lr * cfg.weight_decay)
    out *= dt(-lr * shape_scale(cfg, shape))
    p += out



_D = MuonConfig  # the constructor's defaults: written once, in the config


class Muon(PerParamOptimizer):
    """``Muon(...)``: see the module doc.  2-D parameters only."""

    algorithm = "muon"
    config_cls = MuonConfig
    init_fn = staticmethod(init)
    update_fn = staticmethod(update)
    kernel_fn = staticmethod(_fused.kernel_update)
    elementwise = False
    matters = ("momentum_convention",)
    threaded = False  # the driver's pool over multi-threaded BLAS oversubscribes; ``workers`` shards instead

    def __init__(self, lr: float = _D.lr, momentum: float = _D.momentum, nesterov: bool = _D.nesterov,
                 weight_decay: float = _D.weight_decay, ns_steps: int = _D.ns_steps,
                 ns_coefficients: tuple[float, float, float] = _D.ns_coefficients, eps: float = _D.eps,
                 adjust_lr: str | None = _D.adjust_lr, momentum_convention: str = _D.momentum_convention,
                 eps_mode: str = _D.eps_mode, layout: str = _D.layout, *, lr_scale: LrScale = None,
                 weight_decay_mask: DecayMask = None, workers: int | None = None,
                 precision: Precision | None = None) -> None:
        cfg = MuonConfig(lr, momentum, nesterov, weight_decay, ns_steps, ns_coefficients, eps, adjust_lr,
                         momentum_convention, eps_mode, layout)
        super().__init__(cfg, lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)
        self.hooks = self.hooks.replace(check_shape=self._check_matrix, run=self._run_sharded)
        if workers is None:
            workers = shards.default_workers()
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Muon: workers must be an int >= 1 (or None: automatic), got {workers!r}")
        self.workers = workers
        self._shard: dict[str, int] = {}

    def assign_shards(self, order: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Fix the matrix → worker assignment from a stable list of ``(name, shape)`` (balanced by cost, each
        matrix on one worker for the whole run).  Names not listed get a worker at their first step."""
        self._shard.update(shards.assign([(n, _cost(s)) for n, s in order], self.workers))

    def _check_matrix(self, name: str, shape: tuple[int, ...]) -> None:
        """``hooks.check_shape``: non-empty 2-D matrices whose lr·s and lr·weight_decay are finite in float32."""
        if len(shape) != 2 or min(shape) == 0:
            raise ValueError(
                f"parameter {name!r}: Muon updates non-empty 2-D matrices only, got shape {shape}; route biases, "
                f"norm gains, embeddings and output heads to AdamW (flatopt.MuonAdamW(params=..., muon_names=[...]) "
                f"or flatopt.routing.Router)"
            )
        scale = self._lr_scale(name)
        if isinstance(scale, (int, float)) and math.isfinite(scale):
            lr = (self._lr or 0.0) * scale
            if not (lr * shape_scale(self.config, shape) <= _F32_MAX and lr * self.config.weight_decay <= _F32_MAX):
                raise ValueError(f"parameter {name!r}: lr·s or lr·weight_decay overflows float32 (lr {lr!r})")

    def _run_sharded(self, prepared: list[Any]) -> None:
        """``hooks.run``: the driver's execution, with the BLAS capped, on the shard workers when they pay."""
        # NumPy: every Newton–Schulz GEMM runs with the BLAS held at one thread, in every mode (the serial loop, one
        # item, the workers), because a GEMM's bits depend on the BLAS thread count on some CPUs; without
        # threadpoolctl nothing can hold it, so the items run serially on the BLAS's own threads (same calls either way)
        on_cpu = any(slot.backend == "numpy" for _, slot, _ in prepared)
        if (self.workers <= 1 or len(prepared) < 2 or not on_cpu or not shards.can_cap()
                or any(slot.backend == "cupy" for _, slot, _ in prepared)
                or sum(_cost(slot.shape) for _, slot, _ in prepared) < parallel.PARALLEL_MIN_COST):
            with shards.blas_capped(on_cpu):
                self._run(prepared)
            return
        for it, _, _ in prepared:
            if it.name not in self._shard:
                self._shard[it.name] = len(self._shard) % self.workers
        buckets: list[list[Any]] = [[] for _ in range(self.workers)]
        for entry in prepared:
            buckets[self._shard[entry[0].name]].append(entry)
        jobs: list[Callable[[], None] | None] = [
            functools.partial(self._run_bucket, b) if b else None for b in buckets]
        shards.run(jobs, single_threaded_blas=True)

    def _run_bucket(self, bucket: list[Any]) -> None:
        """A worker's matrices, one after another, each GEMM's row blocks in turn (``_mm``)."""
        _local.serial = True
        try:
            self._run(bucket)
        finally:
            _local.serial = False


def _cost(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * min(shape) if len(shape) == 2 else math.prod(shape)

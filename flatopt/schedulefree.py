"""ScheduleFreeAdamW: Schedule-Free AdamW (Defazio et al. 2024) — the ``schedulefree`` package's ``AdamWScheduleFree``.

The parameter buffer holds the training point y (where gradients are taken); the state holds the base sequence z and
the second moment v; the evaluation point x = average of the z's is not stored: ``eval(params)`` writes it into the
buffers and ``train(params)`` writes y back.  Per element, with t the step count of this parameter (advanced inside
``step``), η = lr · lr_scale(name) and the warm-up sched = t / warmup_steps while t ≤ warmup_steps, else 1::

    v  = β2·v + ((1 − β2)·g)·g
    u  = g / (√(v / (1 − β2^t)) + ε)
    u  = u + weight_decay·y                              (weight_decay != 0: decay calculated at y)
    z  = y                                               (t = 1: z starts at the first y, the reference's clone)
    y  = lerp(y, z, c)                                   (torch's lerp: y + c·(z − y) for |c| < 0.5,
                                                          else z − (z − y)·(1 − c))
    y  = y + (η·sched·(β1·(1 − c) − 1))·u
    z  = z − (η·sched)·u

The averaging weight c (``ckp1``) comes from two per-parameter host numbers, in double, once per step:
lr_max = max(lr_max, lr·sched) (from −1), weight = t^r · lr_max^weight_lr_power, weight_sum += weight,
c = weight / weight_sum (0 when weight_sum is 0).  eval: x = lerp(y, z, 1 − 1/β1); train: y = lerp(x, z, 1 − β1).

Defaults lr 0.0025, betas (0.9, 0.999), eps 1e-8 (outside the square root), weight_decay 0, warmup_steps 0, r 0,
weight_lr_power 2.  Arithmetic in the parameter's dtype, every operation rounded, in the reference's order; the
scalars in double on the host.  State: ``z``, ``v`` and the host numbers ``lr_max``, ``weight_sum`` (saved and
restored exactly); the optimizer's mode ("train" or "eval") is saved too.  ``end_iteration`` only counts iterations.

Deviations from the reference (``schedulefree.AdamWScheduleFree``, whose step k, lr_max and weight_sum are per
parameter group):
* per parameter: t, the warm-up, the bias correction and the averaging weight follow the parameter's own step count
  (flatopt's contract), where the reference uses its group's step count (equal when every parameter steps every
  time);
* the averaging weight is computed from the base learning rate (``set_lr``), without ``lr_scale``: for a constant
  scale s the reference's weights (a group at lr s·η) are s^weight_lr_power times these and c, their ratio, is the
  same number up to its double rounding; so the parameters that step together share c bit for bit, and one
  multi-tensor launch serves them all (the launch passes c as an argument and derives each tensor's η·sched from
  base_lr · lr_scale on the device, as for every generated algorithm);
* torch's vectorised CPU ``lerp`` and ``add(alpha=)`` may fuse a multiply-add; here each operation rounds, so the
  two agree to a few ulps per step rather than bit for bit (the conversions too);
* the gradient is never written (the reference divides ``p.grad`` in place);
* the optimizer starts in train mode (the reference must be put in it with ``train()`` first); ``eval``/``train``
  take the buffers (name → flat buffer) and refuse, before writing any, a name without state, a missing name that
  has state, or a buffer of another size, dtype or backend; ``step`` in eval mode raises ``RuntimeError`` and
  changes nothing (the reference raises too).

Round trip y → x → y: not bit for bit (two rounded lerps): |y' − y| ≤ |1 − (1 − w1)(1 − w2)|·|z − y| +
(1 − w2)·(u|x| + (2u + u²)|w1|·|z − y|) + u|y'| + (2u + u²)|w2|·|z − x| per element, with w1, w2 the two weights
rounded to the dtype and u its unit roundoff (``tests/test_schedulefree.py`` checks it).

16-bit parameters (``precision=``, ``flatopt.Precision``): a conversion acts on the float32 value the parameter
carries (``core.lowp.carried``): the master copy under ``writeback="master"`` (then the parameter is its nearest, and
the master copy converts exactly as a float32 parameter would), ``f32(p) + f32(c)`` under ``"kahan"`` (then
``p = nearest(x)`` and the compensation ``c = nearest(x − f32(p))``), ``f32(p)`` under ``"nearest"`` and
``"stochastic"`` (then ``p = nearest(x)``: a conversion is not a step and draws no random bits; each conversion adds
up to half a 16-bit ulp of rounding, so use ``"master"`` or ``"kahan"`` where eval/train alternate often).

``cautious=True`` (not in the ``schedulefree`` package nor pytorch-optimizer's ``ScheduleFreeAdamW``): the direction
is the normalised gradient g/(√(v/(1 − β2^t)) + ε), masked where it disagrees in sign with g and scaled by
numel/(count + 1) per tensor (pytorch-optimizer's ``apply_cautious``), before the decay λ·y is added; the masked u
moves both y and z (the one direction of the step), so x, their average, moves only where the mask keeps it;
``eval``/``train`` are unchanged (docs/algorithms.md, cautious).

When to use it: training without a learning-rate schedule (no decay horizon to choose); evaluate at x.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Mapping

import numpy as np

from .core import backend, cpu_plan, gpu_run, lowp, step_plan
from .core import multi_tensor as mt
from .core.driver import CHUNK
from .core.elementwise import define, run
from .core.elementwise.define import Cautious
from .core.elementwise.optimizer import ElementwiseOptimizer
from .core.precision import Precision
from .core.types import Array, DecayMask, JSONDict, LrScale
from .core.validate import check_array, check_lr, check_range, normalize_numbers


@dataclasses.dataclass(frozen=True)
class ScheduleFreeAdamWConfig(Cautious):
    lr: float = 0.0025
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    r: float = 0.0
    weight_lr_power: float = 2.0

    def __post_init__(self) -> None:
        normalize_numbers(self)
        who = "ScheduleFreeAdamW"
        check_lr(self.lr, "lr", who)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise TypeError(f"{who}: betas must be a pair of floats, got {self.betas!r}")
        check_range(who, "betas[0]", self.betas[0], 0.0, 1.0, lo_open=True, hi_open=True)  # eval divides by β1
        check_range(who, "betas[1]", self.betas[1], 0.0, 1.0, hi_open=True)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        check_range(who, "eps", self.eps, 0.0, math.inf)
        check_range(who, "weight_decay", self.weight_decay, 0.0, math.inf)
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"{who}: warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        check_range(who, "r", self.r, 0.0, math.inf)
        check_range(who, "weight_lr_power", self.weight_lr_power, 0.0, math.inf)


def sched(cfg: ScheduleFreeAdamWConfig, t: int) -> float:
    """The linear warm-up factor of step t (the reference's ``(k+1) / warmup_steps`` while k < warmup_steps)."""
    return t / cfg.warmup_steps if t - 1 < cfg.warmup_steps else 1.0


def advance(cfg: ScheduleFreeAdamWConfig, st: Any, t: int, base_lr: float) -> float:
    """Step t's averaging weight c of one parameter, advancing its host numbers ``lr_max`` and ``weight_sum`` of its
    state (once per step, in double, from the base lr)."""
    st.lr_max = lr_max = max(base_lr * sched(cfg, t), st.lr_max)
    weight = (t ** cfg.r) * (lr_max ** cfg.weight_lr_power)
    st.weight_sum = weight_sum = st.weight_sum + weight
    return weight / weight_sum if weight_sum != 0 else 0.0


# ------------------------------------------------------------------------------------------------ the definition
def scalars(cfg: ScheduleFreeAdamWConfig, t: int, lr: Any, ckp1: float) -> dict[str, Any]:
    """The per-step scalars by name, in double (``lr`` may be traced: the multi-tensor kernel derives the two step
    sizes per tensor; ``ckp1``, the averaging weight, is the parameter's host value)."""
    b1, b2 = cfg.betas
    lr_t = lr * sched(cfg, t)
    return dict(b2=b2, omb2=1.0 - b2, bc2=1.0 - b2**t, eps=cfg.eps, decay=cfg.weight_decay, ckp1=ckp1,
                y_step=lr_t * (b1 * (1.0 - ckp1) - 1.0), z_step=lr_t)


def flags(cfg: ScheduleFreeAdamWConfig, t: int, ckp1: float) -> dict[str, bool]:
    return dict(wd=cfg.weight_decay != 0, first=t == 1, big=abs(ckp1) >= 0.5)


def lerp(a: Any, b: Any, w: Any, big: bool) -> Any:
    """torch's ``lerp(a, b, w)``: its branch on the weight (a host scalar, so a flag) and its operation order."""
    return b - (b - a) * (1.0 - w) if big else a + (b - a) * w


def step(e: Any, p: Any, g: Any, z: Any, v: Any, *, s: Any, f: Any) -> dict[str, Any]:
    v = v * s.b2 + (g * s.omb2) * g
    u = e.cautious(g / (e.sqrt(v / s.bc2) + s.eps), g)  # masked before the decay is added
    if f.wd:
        u = u + p * s.decay
    if f.first:
        z = p
    y = lerp(p, z, s.ckp1, f.big)
    y = y + u * s.y_step
    z = z - u * s.z_step
    return dict(p=y, z=z, v=v)


DEF = define("schedulefree_adamw", step, scalars=scalars, flags=flags, flag_names=("wd", "first", "big"),
             slots=("z", "v"), example=ScheduleFreeAdamWConfig(weight_decay=0.01), host=("ckp1",))


# the conversions y -> x (eval) and x -> y (train): lerp towards z, each its own small definition (g is not read)
def _conv_scalars(weight: Any) -> Any:
    return lambda cfg, t, lr: dict(w=weight(cfg))


def _conv_flags(weight: Any) -> Any:
    return lambda cfg, t: dict(big=abs(weight(cfg)) >= 0.5)


def _eval_weight(cfg: ScheduleFreeAdamWConfig | _ConversionExample) -> float:
    return 1.0 - 1.0 / cfg.betas[0]


def _train_weight(cfg: ScheduleFreeAdamWConfig | _ConversionExample) -> float:
    return 1.0 - cfg.betas[0]


def convert(e: Any, p: Any, g: Any, z: Any, *, s: Any, f: Any) -> dict[str, Any]:
    """y -> x (w = 1 - 1/β1) or x -> y (w = 1 - β1): p = lerp(p, z, w)."""
    return dict(p=lerp(p, z, s.w, f.big))


@dataclasses.dataclass(frozen=True)
class _ConversionExample:
    """The conversions' example config: they read β1 alone and have no direction to mask (no flag ``cautious``:
    not a ``Cautious`` config); they run with the optimizer's config."""

    betas: tuple[float, float] = ScheduleFreeAdamWConfig.betas


DEF_X = define("schedulefree_to_x", convert, scalars=_conv_scalars(_eval_weight), flags=_conv_flags(_eval_weight),
               flag_names=("big",), slots=("z",), example=_ConversionExample())
DEF_Y = define("schedulefree_to_y", convert, scalars=_conv_scalars(_train_weight), flags=_conv_flags(_train_weight),
               flag_names=("big",), slots=("z",), example=_ConversionExample())
CONVERT = {"eval": run.bind(DEF_X), "train": run.bind(DEF_Y)}
_CONVERT_SCRATCH = max(CONVERT["eval"][3], CONVERT["train"][3])  # the conversions' NumPy path (cautious or not)


class _Kept:
    """A kept multi-tensor group's liveness (``step_plan.watch`` sets ``dead`` when one of its arrays is freed)."""

    def __init__(self, slots: list[Any]) -> None:
        self.dead = False
        self.slots = slots  # kept: their ids stay theirs
        self.refs: list[Any] = []


class ScheduleFreeAdamW(ElementwiseOptimizer, definition=DEF, host_state={"lr_max": -1.0, "weight_sum": 0.0}):
    """``ScheduleFreeAdamW(lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
    weight_lr_power=2.0)``: see the module doc.  ``eval(params)`` before evaluating, ``train(params)`` after."""

    # update_fn and kernel_fn receive lr as (lr, ckp1); multi_tensor is launched by _run_sf per group of tensors
    # that share t and ckp1
    scratch_buffers = max(run.scratch_needed(DEF), _CONVERT_SCRATCH)

    def __init__(self, lr: float = 0.0025, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 0, r: float = 0.0, weight_lr_power: float = 2.0, *,
                 cautious: bool = False, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(ScheduleFreeAdamWConfig(lr, betas, eps, weight_decay, warmup_steps, r, weight_lr_power,
                                                 cautious=cautious), lr_scale=lr_scale,
                         weight_decay_mask=weight_decay_mask, precision=precision)
        self.mode = "train"
        self.hooks = self.hooks.replace(run=self._run_sf)

    # ------------------------------------------------------------------------------------------------ steps
    def step_batch(self, items: Any) -> None:
        """The driver's ``step_batch`` (see ``PerParamOptimizer.step_batch``), refused in eval mode before anything
        is validated or changed (the buffers hold x)."""
        with self._lock:
            self._check_train_mode()
            super().step_batch(items)

    def validate_batch(self, items: Any) -> None:
        """What ``step_batch(items)`` would raise, the eval mode included (a router validates every group first)."""
        with self._lock:
            self._check_train_mode()
            super().validate_batch(items)

    def _check_train_mode(self) -> None:
        if self.mode != "train":
            raise RuntimeError("ScheduleFreeAdamW: step in eval mode (the buffers hold x): call train(params) first")

    def _run_sf(self, prepared: list[Any]) -> None:
        """The driver's execution with the averaging weight: each item's host numbers advance once (serially), then
        its steps receive ``lr`` as ``(lr, ckp1)``; on CuPy the items that share (device, dtype, t, ckp1) take one
        multi-tensor launch (its table kept between steps: ``_group``)."""
        base = self._lr if self._lr is not None else 0.0
        cpu: list[Any] = []
        gpu: list[Any] = []
        for it, slot, scale in prepared:
            slot.t += 1
            lr = self.step_lr(slot.state, slot.t, base * scale)
            if slot.backend == "cupy":
                gpu.append((it, slot, lr, scale))
            else:
                cpu.append((it, slot, lr))
        if cpu:
            cpu_plan.run_for(self, cpu_plan.tasks(self, cpu, CHUNK))
        if gpu:
            self._run_gpu(gpu, base)

    def step_lr(self, state: Any, t: int, lr: float) -> tuple[float, float]:
        """What step t of a parameter's update receives as ``lr``: ``(lr, ckp1)``, advancing its host numbers (once
        per step: the driver's execution calls it; a test that steps the hooks by hand calls it too)."""
        return lr, advance(self.config, state, t, self._lr if self._lr is not None else 0.0)

    def _run_gpu(self, gpu: list[Any], base: float) -> None:
        rest: list[Any] = []
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for it, slot, lr, scale in gpu:
            if backend.force_twin() or not it.param.size:
                rest.append((it, slot, lr))
            else:
                groups.setdefault((it.param.device.id, it.param.dtype, slot.t, lr[1]), []).append(
                    (it, slot, lr, scale))
        for (_, _, t, ckp1), members in groups.items():
            if len(members) == 1:
                rest.extend(m[:3] for m in members)
                continue
            self._group(members).launch(self.config, t, base, host=(ckp1,))
        if rest:
            gpu_run.run_gpu(self, rest)

    def _group(self, members: list[Any]) -> mt.Group:
        """The multi-tensor group (its device table) of these members, built once and kept while the same arrays,
        states and scales come back (``plan_cache``; a freed param or grad array retires it, as a step plan)."""
        plans = self.plan_cache.family_plans("schedulefree")
        key = tuple((id(it.param), id(it.grad), id(slot), id(slot.state.z), id(slot.state.v), scale)
                    for it, slot, _, scale in members)
        hit = plans.get(key)
        if hit is not None and not hit[0].dead:
            kept: mt.Group = hit[1]
            return kept
        holder = _Kept([m[1] for m in members])
        holder.refs = step_plan.watch(holder, [m[0].param for m in members] + [m[0].grad for m in members])
        group = mt.Group(self.multi_tensor, [(it.param, it.grad, slot, scale) for it, slot, _, scale in members],
                         mt.CHUNK)
        plans.pop(key, None)
        while len(plans) >= step_plan.MAX_PLANS:
            plans.pop(next(iter(plans)))
        plans[key] = (holder, group)
        return group

    # ------------------------------------------------------------------------------------------- eval / train
    def eval(self, params: Mapping[str, Array]) -> None:
        """Write the evaluation point x into each buffer (``params``: name -> flat buffer, every name with state);
        nothing to do in eval mode.  Bad input raises before any buffer is written."""
        self._convert(params, "eval")

    def train(self, params: Mapping[str, Array]) -> None:
        """Write the training point y back into each buffer (the inverse of ``eval``); nothing to do in train
        mode.  Bad input raises before any buffer is written."""
        self._convert(params, "train")

    def _convert(self, params: Mapping[str, Array], mode: str) -> None:
        with self._lock:
            checked = self._check_buffers(params)
            if self.mode == mode:
                return
            for name, buf in checked:
                slot = self._slots[name]
                if not slot.pinned:
                    self._move_state(slot, buf)
                if name in self._lowp:  # a 16-bit parameter: the float32 value it carries (module doc)
                    w = lowp.carried(self, name, buf)
                    self._convert_one(slot, w, mode)
                    lowp.store(self, name, w, buf)
                else:
                    self._convert_one(slot, buf, mode)
            self.mode = mode

    def _convert_one(self, slot: Any, buf: Array, mode: str) -> None:
        update, kernel_update, _, _ = CONVERT[mode]
        cfg = self.config
        if slot.backend == "cupy":
            with buf.device:
                if backend.force_twin() or not kernel_update(cfg, slot.state, buf, buf, t=1, lr=0.0):
                    cp = backend.cupy()
                    scratch = [cp.empty_like(buf) for _ in range(_CONVERT_SCRATCH)]
                    update(cp, cfg, slot.state, buf, buf, t=1, lr=0.0, scratch=scratch)
            return
        full = cpu_plan.scratch(buf.dtype, _CONVERT_SCRATCH, CHUNK)
        for lo in range(0, buf.size, CHUNK):
            hi = min(lo + CHUNK, buf.size)
            view = types.SimpleNamespace(z=slot.state.z[lo:hi])
            p = buf[lo:hi]
            update(np, cfg, view, p, p, t=1, lr=0.0, scratch=[b[:hi - lo] for b in full])

    def _check_buffers(self, params: Mapping[str, Array]) -> list[tuple[str, Array]]:
        if not isinstance(params, Mapping):
            raise TypeError(f"ScheduleFreeAdamW: params must be a mapping name -> flat buffer, got "
                            f"{type(params).__name__}")
        out = []
        for name, buf in params.items():
            slot = self._slots.get(name) if isinstance(name, str) else None
            if slot is None:
                raise ValueError(f"parameter {name!r}: no state (never stepped, or another optimizer's): "
                                 f"nothing to convert")
            kind = check_array(name, "param", buf, lowp=True)
            n = math.prod(slot.shape)
            if buf.ndim != 1 or buf.size != n:
                raise ValueError(f"parameter {name!r}: the buffer must be flat with {n} elements, got shape "
                                 f"{buf.shape}")
            rec = self._lowp.get(name)
            want = rec.dtype if rec is not None else slot.dtype.name
            if buf.dtype.name != want:
                raise TypeError(f"parameter {name!r}: buffer dtype {buf.dtype} differs from the dtype {want} its "
                                f"state was created with")
            if slot.pinned and kind != slot.backend:
                raise TypeError(f"parameter {name!r}: state lives on {slot.backend}, got a {kind} buffer")
            if kind == "cupy" and slot.pinned and slot.device is not None and buf.device.id != slot.device:
                raise ValueError(f"parameter {name!r}: the buffer is on GPU {buf.device.id}, its state on GPU "
                                 f"{slot.device}")
            if kind == "numpy" and not buf.flags.writeable:
                raise ValueError(f"parameter {name!r}: the buffer is read-only")
            out.append((name, buf))
        missing = sorted(set(self._slots) - set(params))
        if missing:
            raise ValueError(f"parameter {missing[0]!r} has state but no buffer in params: eval/train convert every "
                             f"parameter at once")
        return out

    # ------------------------------------------------------------------------------------------- checkpoints
    def _extra_state(self) -> JSONDict:
        return {"mode": self.mode}

    def _check_extra(self, extra: JSONDict) -> None:
        if extra.get("mode") not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {extra.get('mode')!r}")

    def _load_extra(self, extra: JSONDict) -> None:
        self.mode = extra["mode"]

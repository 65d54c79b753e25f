"""State migration of ``Adafactor8Bit`` on load (private): a snapshot saved with another state layout.

The original (adafactor8bit 0.4.6), when ``quantize``, a format, a block size, the APOLLO switch, the rank,
``apollo_factorize`` or the CAME switch changes, the state is dequantized/requantized or reset, keeping the step,
with a warning.  A flatopt optimizer's configuration is fixed, so this happens in ``load_state_dict``: a snapshot
whose layout (``quantize``, ``block_size``, ``m_block_size``, ``v_quant_type``/``m_quant_type``/``c_quant_type``,
``min_8bit_size``, the path, per-group overrides) differs from the optimizer's is converted, parameter by parameter,
from the snapshot's resolved (group) configuration A to the optimizer's ``config_for(name, shape)`` B:

* **same structure** (same path — factored, unfactored, SGD, or APOLLO with the same rank and ``apollo_factorize`` —
  CAME and momentum on both sides): every slot stored alike in A and B is copied as stored (codes kept bit for
  bit); every other slot is decoded with A's format and block size to exact float32 and re-encoded with B's (or
  kept float32).  AL slots are encoded with the floor their update uses (``apollo_eps`` for ``v_low``, ``eps1``
  otherwise).  APOLLO seeds and the refresh step are kept.  The limiter states (Fira's previous norm, the
  lag-norm state) are kept when both sides have them, started afresh when only B has them, dropped otherwise;
* **structure changed** (factored ↔ unfactored, SGD mode on/off, APOLLO on/off or another rank/factorisation, CAME
  or momentum (``beta1``) on/off): the parameter gets fresh state under B, keeping its step count ``t``.  A
  parameter that stays on APOLLO keeps its seed stream and draws a new projection at its next step; one that moves
  onto APOLLO takes the next seed of the optimizer-wide counter (continuing the snapshot's), in name order.

A's per-parameter configuration is rebuilt from the snapshot's ``config`` (its base options and its groups'
``select`` descriptions and overrides).  A group selected by a predicate is matched through a group of this
optimizer with the same description; otherwise (or when a rebuilt configuration does not fit what is stored) the
stored layout decides among the snapshot's group configurations (array names, code dtypes and block counts); a
layout that fits none of them, or fits configurations that would decode it differently (uf8 vs d8 codes look
alike), refuses the load.  Everything is built before anything is committed: a refused load changes nothing.

Used by ``Adafactor8Bit.load_state_dict`` only when the exact restore does not fit (another config key, or a state
whose slots differ from this optimizer's); ``migrate=False`` or ``restore_hparams=True`` refuse such a snapshot.
One :class:`StateMigrationWarning` names the requantized and the reset parameters; ``last_load_notes`` has a line
per parameter (what changed).

Caveat: a reset keeps ``t``, so bias correction, the relative step and the β2 schedule continue where they were
while the moments restart from zero (as in the original) — expect a few larger steps right after a reset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import state as S
from ..core import backend
from . import quant
from .common import eps1_of
from ..core.slots import Slot, config_from_dict, is_array, persistent_fields
from ..core.types import FORMAT_VERSION, OptimizerState
from ..routing import Select

APOLLO_SCALARS = ("apollo_seed", "current_proj_seed", "last_proj_step")
WARN_NAMES = 20  # names per list shown in the warning (all of them are in last_load_notes)


class StateMigrationWarning(UserWarning):
    """``Adafactor8Bit.load_state_dict`` converted (requantized) or reset parameter states of a snapshot saved with
    another state layout; the message and ``last_load_notes`` name the parameters."""


@dataclasses.dataclass
class Report:
    """What a migrating load did (filled by :func:`build`, used by the optimizer after the commit)."""

    seed_counter: int = 1
    requantized: list = dataclasses.field(default_factory=list)  # (name, detail)
    reset: list = dataclasses.field(default_factory=list)  # (name, reason)

    def warning(self) -> str | None:
        if not (self.requantized or self.reset):
            return None

        def names(items):
            shown = [n for n, _ in items[:WARN_NAMES]]
            more = f" and {len(items) - WARN_NAMES} more" if len(items) > WARN_NAMES else ""
            return f"{shown}{more}"

        parts = []
        if self.requantized:
            parts.append(f"requantized {len(self.requantized)} parameter(s) to this optimizer's layout: "
                         f"{names(self.requantized)}")
        if self.reset:
            parts.append(f"reset {len(self.reset)} parameter(s) to fresh state (structure changed; step counts "
                         f"kept): {names(self.reset)}")
        return ("Adafactor8Bit.load_state_dict: the snapshot was saved with another state layout; "
                + "; ".join(parts) + " (details in last_load_notes)")

    def notes(self) -> list[str]:
        if not (self.requantized or self.reset):
            return ["the snapshot's state layout options differ, but every stored state already fits (kept as stored)"]
        out = [f"requantized {n}: {d}" for n, d in self.requantized]
        return out + [f"reset {n} to fresh state, step count kept: {r}" for n, r in self.reset]


# ------------------------------------------------------------------------------------ layouts and structure
def _rep(st, slot):
    """How ``slot`` is stored in the fresh state ``st``: ("fp32",) or (codec, format, block)."""
    cfg = st.cfg
    if getattr(st, slot) is not None:
        return ("fp32",)
    if slot in S.SIGNED:
        return ("m", cfg.m_quant_type, cfg.m_block_size)
    fmt = (cfg.c_quant_type or cfg.v_quant_type) if slot.startswith(("conf", "res")) else cfg.v_quant_type
    return ("al", fmt, cfg.block_size)


def _layout(st) -> dict:
    """{logical slot: (size, representation)} of a fresh state (FP32_ONLY slots: always float32)."""
    out = {s: (n, _rep(st, s)) for s, n in st.sizes.items() if s != "shape"}
    for s in S.FP32_ONLY:
        if getattr(st, s) is not None:
            out[s] = (getattr(st, s).size, ("fp32",))
    return out


def _structure(cfg, shape) -> dict:
    if cfg.apollo_rank > 0 and len(shape) >= 2:
        return {"path": "APOLLO", "rank": cfg.apollo_rank, "factorize": cfg.apollo_factorize,
                "CAME": cfg.beta3 is not None, "momentum": cfg.beta1 is not None}
    path = "SGD" if S.is_sgd(cfg) else "factored" if len(shape) >= 2 and cfg.factored else "unfactored"
    return {"path": path, "CAME": cfg.beta3 is not None and path == "factored", "momentum": cfg.beta1 is not None}


def _why(a: dict, b: dict) -> str:
    def path(s):
        if s["path"] != "APOLLO":
            return s["path"]
        return f"APOLLO rank {s['rank']}" + (" factorized" if s["factorize"] else "")

    diffs = [f"{path(a)} -> {path(b)}"] if path(a) != path(b) else []
    diffs += [f"{k} {'on' if a[k] else 'off'} -> {'on' if b[k] else 'off'}" for k in ("CAME", "momentum")
              if a[k] != b[k]]
    return ", ".join(diffs) or "state slots differ"


def _fmt(rep) -> str:
    return "fp32" if rep[0] == "fp32" else f"{rep[1]}/block {rep[2]}"


def _floor(cfg, slot) -> float:
    """The AL floor the update encodes ``slot`` with (see adafactor8bit.paths, adafactor8bit.flat, adafactor8bit.apollo, adafactor8bit.came)."""
    eps = cfg.apollo_eps if slot == "v_low" else eps1_of(cfg)
    return quant.al_floor(eps)


def _arrays(slot, rep) -> list[str]:
    if rep[0] == "fp32":
        return [slot]
    return [f"{slot}_q", f"{slot}_scale"] + ([f"{slot}_min_log"] if rep[0] == "al" else [])


def _aux(st) -> dict:
    """{field: (shape, dtype)} of the persistent arrays outside the moment slots (Fira and lag-norm state)."""
    slots = {f for s, (_, rep) in _layout(st).items() for f in _arrays(s, rep)}
    return {f.name: (getattr(st, f.name).shape, getattr(st, f.name).dtype.name) for f in persistent_fields(st)
            if is_array(getattr(st, f.name)) and f.name not in slots}


# --------------------------------------------------------------------------------- the snapshot's configs
def _snapshot_routes(opt, config) -> tuple[Any, list]:
    """(base config A, [(matcher, group config)]) of the snapshot; matcher(name, shape) -> True/False/None."""
    base = config_from_dict(type(opt.config), {k: v for k, v in config.items() if k != "groups"})
    mine = {repr(sel.describe()): sel for sel, _, _ in opt._groups}  # noqa: SLF001 - the optimizer's own groups
    routes = []
    for g in config.get("groups") or ():
        desc, overrides = dict(g["select"]), dict(g["overrides"])
        cfg = dataclasses.replace(base, **overrides)
        if desc.get("predicate") is None:
            sel = Select(names=desc.get("names", ()), patterns=desc.get("patterns", ()), everything=desc.get("all"))
            routes.append((sel.matches, cfg))
        elif repr(desc) in mine:
            routes.append((mine[repr(desc)].matches, cfg))
        else:  # a predicate we cannot evaluate: matches when names/patterns say so, else unknown
            sel = Select(names=desc.get("names", ()), patterns=desc.get("patterns", ()), everything=desc.get("all"),
                         predicate=lambda n, s: False, description="?")
            routes.append((lambda n, s, sel=sel: True if sel.matches(n, s) else None, cfg))
    return base, routes


def _fits(tmpl, name, meta, buffers) -> bool:
    for f in persistent_fields(tmpl):
        tv, v = getattr(tmpl, f.name), buffers.get(f"{f.name}/{name}")
        if is_array(tv):
            if not is_array(v) or v.shape != tv.shape or v.dtype != tv.dtype:
                return False
        elif v is not None:
            return False
    if _structure(tmpl.cfg, tmpl.sizes["shape"])["path"] == "APOLLO":
        return all(isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool) for k in APOLLO_SCALARS)
    return True


def _resolve_a(base, routes, name, shape, dtype, meta, buffers):
    """The fresh template of the snapshot's config for this parameter that fits what is stored, or None."""
    first = []
    for match, cfg in routes:
        m = match(name, shape)
        if m is None or m:
            first.append(cfg)
        if m:
            break
    else:
        first.append(base)
    for cands in (first, [c for _, c in routes] + [base]):
        fit = [t for t in (S.init(np, c, shape, dtype) for c in cands) if _fits(t, name, meta, buffers)]
        sigs = {repr((_structure(t.cfg, shape), _layout(t), _aux(t))) for t in fit}
        if len(sigs) == 1:
            return fit[0]
        if len(sigs) > 1:
            return None  # stored codes that configurations would decode differently
    return None


# ------------------------------------------------------------------------------------------------ build
def build(opt, state) -> tuple[dict, list, Report] | None:
    """New slots for ``state`` under ``opt``'s configuration, hparam notes and a :class:`Report`; ``None`` when the
    snapshot does not belong (another algorithm or format version, a malformed entry, a shape or array that does
    not fit the snapshot's own layout, a left-over buffer).  Nothing of ``opt`` is changed."""
    if not isinstance(state, OptimizerState) or state.algorithm != opt.algorithm:
        return None
    if state.format_version != FORMAT_VERSION:
        return None
    try:
        base, routes = _snapshot_routes(opt, dict(state.config))
        report = Report(seed_counter=int(state.extra.get("apollo_seed_counter", 1)))
        slots, used = {}, set()
        for name in sorted(state.params):
            meta = state.params[name]
            shape, dtype, t = tuple(int(d) for d in meta["shape"]), np.dtype(meta["dtype"]), int(meta["t"])
            opt.hooks.check_shape(name, shape)
            if any(d < 0 for d in shape) or t < 0:
                return None
            a = _resolve_a(base, routes, name, shape, dtype, meta, state.buffers)
            if a is None:
                return None
            used.update(f"{f.name}/{name}" for f in persistent_fields(a) if is_array(getattr(a, f.name)))
            slots[name] = _migrate_one(opt, name, shape, dtype, t, meta, state.buffers, a, report)
    except Exception:  # noqa: BLE001 - anything malformed means "does not fit"
        return None
    if set(state.buffers) - used:
        return None
    cur = opt._config_dict()  # noqa: SLF001 - the Adafactor8Bit this migration builds the state of
    notes = [f"{k}: kept {cur[k]!r} (snapshot had {v!r})" for k, v in state.config.items() if k in cur and cur[k] != v]
    return slots, notes + report.notes(), report


def _migrate_one(opt, name, shape, dtype, t, meta, buffers, a, report: Report) -> Slot:
    """The slot of one parameter under the optimizer's config B, from the stored state laid out as template ``a``."""
    cfg_b = opt.config_for(name, shape)
    arrays = [buffers[f"{f.name}/{name}"] for f in persistent_fields(a) if is_array(getattr(a, f.name))]
    xp = backend.array_module(*arrays) if arrays else np
    sa, sb = _structure(a.cfg, shape), _structure(cfg_b, shape)
    apollo_a, apollo_b = sa["path"] == "APOLLO", sb["path"] == "APOLLO"
    seed = None
    if apollo_b:
        if apollo_a:
            seed = int(meta["apollo_seed"])
        else:
            seed, report.seed_counter = report.seed_counter, report.seed_counter + 1
    b = S.init(xp, cfg_b, shape, dtype, apollo_seed=seed)
    lay_a, lay_b = _layout(a), _layout(b)
    if sa != sb or {s: n for s, (n, _) in lay_a.items()} != {s: n for s, (n, _) in lay_b.items()}:
        if apollo_a and apollo_b:  # keep the seed stream; a new projection at the next step (S.init's refresh)
            b.current_proj_seed = int(meta["current_proj_seed"])
        report.reset.append((name, _why(sa, sb)))
        return Slot(shape, dtype, "numpy" if xp is np else "cupy", t, b, pinned=False)
    if apollo_b:
        for k in APOLLO_SCALARS:
            setattr(b, k, int(meta[k]))
    changed = []
    for slot, (n, rep_b) in lay_b.items():
        rep_a = lay_a[slot][1]
        if rep_a == rep_b:  # stored alike: keep the arrays as stored
            for f in _arrays(slot, rep_a):
                setattr(b, f, buffers[f"{f}/{name}"].copy())
            continue
        changed.append(f"{slot} {_fmt(rep_a)} -> {_fmt(rep_b)}")
        values = _decode(xp, buffers, name, slot, rep_a, n)
        if rep_b[0] == "fp32":
            setattr(b, slot, values)
        elif rep_b[0] == "m":
            quant.m_encode(xp, values, getattr(b, f"{slot}_q"), getattr(b, f"{slot}_scale"), mblock=rep_b[2],
                           fmt=rep_b[1])
        else:
            quant.al_encode(xp, values, getattr(b, f"{slot}_q"), getattr(b, f"{slot}_scale"),
                            getattr(b, f"{slot}_min_log"), block=rep_b[2], fmt=rep_b[1], floor=_floor(cfg_b, slot))
    aux_a, aux_b = _aux(a), _aux(b)
    for f in sorted(set(aux_a) | set(aux_b)):
        if aux_a.get(f) == aux_b.get(f):
            setattr(b, f, buffers[f"{f}/{name}"].copy())
        else:
            changed.append(f"{f} started afresh" if f in aux_b else f"{f} dropped")
    if changed:
        report.requantized.append((name, ", ".join(changed)))
    return Slot(shape, dtype, "numpy" if xp is np else "cupy", t, b, pinned=False)


def _decode(xp, buffers, name, slot, rep, n):
    """Exact float32 values of a stored slot (a new array)."""
    if rep[0] == "fp32":
        return xp.array(buffers[f"{slot}/{name}"], dtype=np.float32, copy=True)
    out = xp.empty(n, np.float32)
    q, scale = buffers[f"{slot}_q/{name}"], buffers[f"{slot}_scale/{name}"]
    if rep[0] == "m":
        quant.m_decode(xp, q, scale, out, mblock=rep[2], fmt=rep[1])
    else:
        quant.al_decode(xp, q, scale, buffers[f"{slot}_min_log/{name}"], out, block=rep[2], fmt=rep[1])
    return out

"""The ownership plan of :class:`flatopt.distributed.Sharded` and the merging/splitting of sharded snapshots.

A plan maps every (canonical) parameter name to one or more *pieces* ``(owner, lo, hi)``: element ranges of the
flat buffer, each stepped by exactly one rank.  It is a pure function of the world size, the split settings and
the sequence of batches of new names (every rank sees the same batches), so every rank computes it identically
without communicating:

* a name of an elementwise algorithm whose buffer has at least ``split_min`` elements is cut into ``world``
  contiguous, near-equal ranges, range r owned by rank r (each element's arithmetic is independent, so the
  result is bit-identical to stepping the whole buffer);
* every other name is owned whole by the least-loaded rank (lowest rank on ties), the new names of one batch
  taken largest first (then by name); the load is ``cost(name, shape)``, by default the number of elements
  (a user cost must be deterministic: every rank evaluates it).

Snapshots: a rank's inner optimizer holds ``OptimizerState`` entries for its pieces only (a split name appears
under its own name with the shape ``(hi - lo,)``).  :func:`merge` turns the shards back into the snapshot of the
single-process optimizer and :func:`carve` cuts a full snapshot into the shard of one rank under any plan; both
rely on the per-name layout (``params[name]``, ``buffers["<slot>/<name>"]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..core.types import OptimizerState


@dataclass(frozen=True)
class Piece:
    owner: int
    lo: int
    hi: int


@dataclass
class Plan:
    world: int
    split: bool  # the algorithm is elementwise: large buffers may be cut into ranges
    split_min: int
    entries: dict[str, tuple[tuple[int, ...], tuple[Piece, ...]]] = field(default_factory=dict)
    load: list[int] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # names in the order they were planned
    cost: Callable[[str, tuple], int] | None = None  # load of a whole name (default: its number of elements)

    def __post_init__(self):
        if not self.load:
            self.load = [0] * self.world

    def weight(self, name: str, shape: tuple[int, ...]) -> int:
        return int(self.cost(name, shape)) if self.cost is not None else math.prod(shape)

    def pieces(self, name: str) -> tuple[Piece, ...]:
        return self.entries[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][0]

    def extended(self, new: Sequence[tuple[str, tuple[int, ...]]]) -> Plan:
        """A copy of this plan that also places the names of ``new`` (one batch; names already planned and
        repeats are ignored)."""
        todo = {}
        for name, shape in new:
            if name not in self.entries:
                todo[name] = tuple(shape)
        if not todo:
            return self
        plan = Plan(self.world, self.split, self.split_min, dict(self.entries), list(self.load), list(self.order),
                    self.cost)
        weight = self.weight
        for name in sorted(todo, key=lambda n: (-weight(n, todo[n]), n)):
            shape = todo[name]
            n = math.prod(shape)
            if self.split and self.world > 1 and n >= max(self.split_min, self.world):
                pieces = tuple(Piece(r, n * r // self.world, n * (r + 1) // self.world) for r in range(self.world))
            else:
                owner = min(range(self.world), key=lambda r: (plan.load[r], r))
                pieces = (Piece(owner, 0, n),)
            for p in pieces:
                plan.load[p.owner] += weight(name, shape) * (p.hi - p.lo) // max(n, 1)
            plan.entries[name] = (shape, pieces)
            plan.order.append(name)
        return plan

    def owned(self, rank: int) -> dict[str, Piece]:
        return {n: p for n, (_, ps) in self.entries.items() for p in ps if p.owner == rank}

    def to_json(self) -> dict:
        return {"world": self.world, "split": self.split, "split_min": self.split_min,
                "names": [[n, list(self.entries[n][0]), [[p.owner, p.lo, p.hi] for p in self.entries[n][1]]]
                          for n in self.order]}

    @classmethod
    def from_json(cls, d: Mapping, cost: Callable | None = None) -> Plan:
        plan = cls(int(d["world"]), bool(d["split"]), int(d["split_min"]), cost=cost)
        for name, shape, pieces in d["names"]:
            shape = tuple(int(x) for x in shape)
            ps = tuple(Piece(int(o), int(lo), int(hi)) for o, lo, hi in pieces)
            plan.entries[name] = (shape, ps)
            plan.order.append(name)
            for p in ps:
                plan.load[p.owner] += plan.weight(name, shape) * (p.hi - p.lo) // max(math.prod(shape), 1)
        return plan


def buffer_name(key: str) -> str:
    """The parameter name of a buffer key ``"<slot>/<name>"`` (routed optimizers: ``"<group>.<slot>/<name>"``)."""
    return key.split("/", 1)[1]


def merge(shards: Mapping[int, OptimizerState], plan: Plan) -> OptimizerState:
    """The single-process snapshot equivalent to the shards (``rank -> state``) written under ``plan``."""
    first = shards[min(shards)]
    params: dict[str, dict] = {}
    buffers: dict[str, object] = {}
    split_parts: dict[str, dict[int, object]] = {}
    for rank in sorted(shards):
        st = shards[rank]
        for s in shards.values():
            if s.algorithm != st.algorithm or s.step != st.step:
                raise ValueError("the shards disagree on the algorithm or the iteration count")
        for name, meta in st.params.items():
            pieces = plan.pieces(name) if name in plan.entries else ()
            if len(pieces) <= 1:
                params[name] = dict(meta)
                continue
            full = {**meta, "shape": list(plan.shape(name))}
            if name in params and params[name] != full:
                raise ValueError(f"the ranges of {name!r} disagree on their scalar state")
            params[name] = full
        for key, v in st.buffers.items():
            name = buffer_name(key)
            if name in plan.entries and len(plan.pieces(name)) > 1:
                lo = next(p.lo for p in plan.pieces(name) if p.owner == rank)
                split_parts.setdefault(key, {})[lo] = v
            else:
                buffers[key] = v
    for key, parts in split_parts.items():
        name = buffer_name(key)
        if sorted(parts) != [p.lo for p in plan.pieces(name)]:
            raise ValueError(f"buffer {key!r}: ranges are missing from the shards")
        xp = np if all(isinstance(a, np.ndarray) for a in parts.values()) else _cupy_of(parts.values())
        buffers[key] = xp.concatenate([xp.asarray(parts[lo]).reshape(-1) for lo in sorted(parts)])
    return OptimizerState(first.algorithm, first.config, first.config_key, first.step, params, buffers,
                          first.extra, first.format_version)


def carve(full: OptimizerState, plan: Plan, rank: int) -> OptimizerState:
    """The shard of ``rank`` under ``plan`` of a single-process snapshot (names the plan lacks are refused)."""
    owned = plan.owned(rank)
    missing = sorted(n for n in full.params if n not in plan.entries)
    if missing:
        raise ValueError(f"the snapshot holds parameters the plan does not place: {missing[:5]}")
    params, buffers = {}, {}
    for name, meta in full.params.items():
        p = owned.get(name)
        if p is None:
            continue
        whole = len(plan.pieces(name)) == 1
        params[name] = dict(meta) if whole else {**meta, "shape": [p.hi - p.lo]}
    for key, v in full.buffers.items():
        name = buffer_name(key)
        p = owned.get(name)
        if p is None:
            continue
        if len(plan.pieces(name)) == 1:
            buffers[key] = v
        else:
            n = math.prod(plan.shape(name))
            if v.size != n:
                raise ValueError(f"buffer {key!r} has {v.size} elements, not one per element of {name!r} ({n}): "
                                 f"it cannot be split into ranges")
            buffers[key] = v.reshape(-1)[p.lo : p.hi].copy()
    return OptimizerState(full.algorithm, full.config, full.config_key, full.step, params, buffers, full.extra,
                          full.format_version)


def _cupy_of(arrays):
    from ..core import backend

    return backend.array_module(*[a for a in arrays if not isinstance(a, np.ndarray)])

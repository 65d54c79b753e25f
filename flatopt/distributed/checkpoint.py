"""Sharded checkpoint files of :class:`flatopt.distributed.Sharded`: a folder holding one ``flatopt.save`` file
per rank, ``shard-<rank>-of-<world>.npz`` (that rank's pieces, as its optimizer holds them), and
``manifest.json`` (format, world size, algorithm, shard files and the ownership plan), written last by rank 0
once every shard is on disk, each file atomically.  Re-sharding merges the shards under the saved plan
(``distributed.plan.merge``) and carves the result under the new one; this reads every shard (a shared filesystem is
assumed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core import backend as _backend
from .. import checkpoint
from .plan import Plan, carve, merge
from ..core.types import OptimizerState
from ..core.validate import check_snapshot
from ..errors import IncompatibleStateError

MANIFEST = "manifest.json"
FORMAT = "flatopt-sharded"
VERSION = 1


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.npz"


def write_manifest(directory: Path, plan: Plan, algorithm: str) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "world": plan.world, "algorithm": algorithm,
                "shards": [shard_file(r, plan.world) for r in range(plan.world)], "plan": plan.to_json()}
    tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory) -> tuple[dict, Plan]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise checkpoint.CheckpointError(f"{path}: corrupted manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise checkpoint.CheckpointError(f"{path}: not a flatopt sharded checkpoint manifest (version {VERSION})")
    return manifest, Plan.from_json(manifest["plan"])


def load_shard(directory, manifest: dict, rank: int) -> OptimizerState:
    return checkpoint.load(Path(directory) / manifest["shards"][rank])


def load_merged(directory: str | os.PathLike) -> OptimizerState:
    """The single-process snapshot of a sharded checkpoint of any world size: ``load_state_dict`` of a plain
    optimizer resumes from it exactly."""
    manifest, saved = read_manifest(directory)
    return merge({r: load_shard(directory, manifest, r) for r in range(len(manifest["shards"]))}, saved)


class ShardedCheckpoints:
    """The checkpoint half of :class:`flatopt.distributed.Sharded` (uses its ``inner``, ``plan``, ``backend``,
    ``rank``, ``world``, ``_vote``, ``_seeds`` and ``_lock``).  Every method is collective."""

    last_load_notes: list[str] = []  # why the last load_state_dict refused (set per instance by each load)

    def shard_state_dict(self) -> OptimizerState:
        """This rank's shard (the wrapped optimizer's snapshot of the pieces it owns)."""
        return self.inner.state_dict()

    def state_dict(self) -> OptimizerState:
        """Collective: the single-process snapshot (every rank gets it; the shards travel through the host)."""
        st = self.inner.state_dict()
        st.buffers = {k: _backend.to_numpy(v) for k, v in st.buffers.items()}
        shards = self.backend.allgather_object(st)
        return merge(dict(enumerate(shards)), self.plan)

    def load_state_dict(self, state: OptimizerState, *, strict: bool = False) -> bool:
        """Collective: restore a single-process snapshot, each rank keeping its pieces; ``False`` on every rank
        (nothing changed anywhere) when any rank's optimizer refuses its part, with the reason in
        ``last_load_notes`` (this rank's, or which ranks refused); ``strict=True`` raises it on every rank as
        :class:`~flatopt.errors.IncompatibleStateError`.  A path or a dict is a ``TypeError`` (``flatopt.load``)."""
        check_snapshot(state, type(self).__name__)
        why = None
        try:
            names = [(n, tuple(int(d) for d in m["shape"])) for n, m in state.params.items()]
            plan = self.plan.extended(names)
            local = carve(state, plan, self.rank)
        except Exception as exc:  # noqa: BLE001 - a snapshot that does not fit: voted as a refusal
            local, plan = None, None
            why = f"the snapshot does not fit the sharding plan ({type(exc).__name__}: {exc})"
        if not self._install(local, plan, why):
            if strict:
                raise IncompatibleStateError(self.last_load_notes[0])
            return False
        return True

    def _install(self, local: OptimizerState | None, plan: Plan | None, why: str | None = None) -> bool:
        with self._lock:
            before = self.inner.state_dict()
            ok = local is not None and self.inner.load_state_dict(local) is True
            if local is not None and not ok:
                why = "; ".join(getattr(self.inner, "last_load_notes", None) or ["its optimizer refused its part"])
            failed, _ = self.backend.agree(not ok, 0)
            if failed:
                if ok:
                    self.inner.load_state_dict(before)
                self.last_load_notes = [f"rank {self.rank}: {why}" if why else
                                        f"rank(s) {failed} refused their part of the snapshot"]
                return False
            self._use_plan(plan)
            if self._seeds is not None:
                self._seeds.reset()
            self.last_load_notes = []
            return True

    def save(self, directory: str | os.PathLike) -> None:
        """Collective: write this rank's shard, then (rank 0) ``manifest.json``; raises on every rank if any
        rank failed to write."""
        directory = Path(directory)
        err = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            checkpoint.save(directory / shard_file(self.rank, self.world), self.inner)
        except Exception as exc:  # noqa: BLE001
            err = exc
        self._vote(err, 0, "could not write its shard")
        try:
            if self.rank == 0:
                write_manifest(directory, self.plan, getattr(self.inner, "algorithm", type(self.inner).__name__))
        except Exception as exc:  # noqa: BLE001
            err = exc
        self._vote(err, 0, "could not write the manifest")

    def load(self, directory: str | os.PathLike) -> None:
        """Collective: resume from ``save(directory)`` of any world size (re-sharding when it differs); raises
        on every rank (nothing changed) when the checkpoint does not fit."""
        err, local, plan = None, None, None
        try:
            manifest, saved = read_manifest(directory)
            if saved.world == self.world and (saved.split, saved.split_min) == (self.plan.split, self.plan.split_min):
                plan = Plan.from_json(manifest["plan"], cost=self.plan.cost)
                local = load_shard(directory, manifest, self.rank)
            else:
                full = load_merged(directory)
                plan = Plan(self.world, self.plan.split, self.plan.split_min, cost=self.plan.cost).extended(
                    [(n, saved.shape(n)) for n in saved.order])
                local = carve(full, plan, self.rank)
        except Exception as exc:  # noqa: BLE001
            err = exc
        self._vote(err, 0, "could not read the checkpoint")
        if not self._install(local, plan):
            raise IncompatibleStateError(f"{directory}: the checkpoint does not fit this optimizer on at least one "
                                         f"rank ({self.last_load_notes[0]}); nothing was changed")

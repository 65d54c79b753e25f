"""Optimizer state sharded across data-parallel ranks (ZeRO stage 1) on MPI (NumPy) or NCCL (CuPy).

    from mpi4py import MPI
    from flatopt.distributed import Sharded, allreduce_mean
    opt = Sharded(lambda: flatopt.AdamW(lr=1e-3), MPI.COMM_WORLD)
    allreduce_mean(grads, MPI.COMM_WORLD)          # every rank now holds the same, averaged gradients
    opt.step_batch(items)                          # each rank steps what it owns; new values reach every rank
    opt.save("ckpt/")                              # one shard per rank + manifest.json; opt.load("ckpt/") on any W

**Plan.**  Each parameter (for elementwise algorithms, each contiguous range of a large buffer) is owned by one
rank, chosen by a deterministic, size-balanced plan every rank computes identically from the batches it is given
(``flatopt.distributed.plan``).  Matrix-aware algorithms (Adafactor, Adafactor8Bit, KronPsgd, Muon, MuonAdamW) always
own whole parameters; SGD and AdamW split buffers of at least ``split_min`` elements into ``world`` ranges.  The
owner steps with the wrapped optimizer (which therefore holds ≈ 1/world of the state); then the new values are
broadcast (MPI: large pieces in place, small ones packed into one ``Allgatherv`` per dtype; NCCL: grouped
``ncclBroadcast`` on the current stream).
The plan balances element counts (a proxy for state bytes: exact for SGD/AdamW/Muon, rough for Adafactor's
factored states).  Per step: two tiny all-reduces (the votes below) plus the broadcast.  Wrap a *fresh*
optimizer (or pass a factory); restore state through the wrapper.

**Exactness.**  Every rank must pass the same batch (names, shapes, dtypes, order) with the same, already
reduced gradients; then parameters after N steps are bit-identical to the single-process run on any world
size: per-name state, per-name step counts and per-name random streams (KronPsgd's probes are keyed by name) do
not depend on who steps, ranges of elementwise updates are independent element by element, and the one
optimizer-wide stream that depends on the order names are first stepped (Adafactor8Bit's APOLLO seed counter) is
replayed globally on every rank.  16-bit parameters (``flatopt.Precision``): a range draws the stochastic
write-back's bits by its elements' indices in the whole parameter (the wrapper sets the optimizer's
``element_offsets``), and the Kahan/master buffers are sharded like the other state; bfloat16 pieces travel as
their bits (``allreduce_mean`` refuses bfloat16: MPI cannot sum it).

**Bad input.**  Every rank validates the whole batch (generic checks on every item, the wrapped optimizer's
own checks on the items it owns), then all ranks vote with one all-reduce before anything mutates: if any rank
failed, every rank raises (the failing rank its own error, the others :class:`RemoteStepError` with its message)
and nothing changed anywhere.  The vote also compares a digest of the batch, so ranks passing different batches
raise instead of deadlocking.  An error inside a step (after validation) is voted on too: the broadcast still
runs (every rank then holds the same, possibly partly updated values) and every rank raises.

**Checkpoints.**  ``save(dir)`` writes ``shard-<rank>-of-<world>.npz`` per rank (``flatopt.save``) and
``manifest.json`` (the plan) last; ``load(dir)`` reads its own shard on the same world size, or merges the
shards and re-carves them for another world size (a shared filesystem is assumed).  :func:`load_merged` gives the
single-process snapshot, which a plain optimizer loads.  ``state_dict``/``load_state_dict`` are collective and
exchange full single-process snapshots.

**GPU.**  With a ``cupy.cuda.nccl.NcclCommunicator`` the same plan runs on CuPy arrays; pass ``control=`` an
mpi4py communicator over the same ranks for the host-side vote (without it the vote is a NCCL all-reduce read on
the host: one synchronisation per step).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..core import backend as _backend
from ..core import norms as _norms
from .checkpoint import ShardedCheckpoints, load_merged
from .comm import MpiBackend, NcclBackend, as_backend, digest
from .plan import Plan
from .seeds import ApolloSeeds
from ..core.driver import PerParamOptimizer
from ..core.types import Array, Optimizer, OptItem
from ..core.validate import check_item, check_shape

__all__ = ["Sharded", "RemoteStepError", "allreduce_mean", "global_norm", "load_merged", "MpiBackend",
           "NcclBackend"]

DEFAULT_SPLIT_MIN = 1 << 18


class RemoteStepError(ValueError):
    """Raised on every rank whose own input was fine when another rank rejected the batch (or the ranks passed
    different batches): nothing was changed on any rank."""


class Sharded(ShardedCheckpoints):
    """``Sharded(optimizer_or_factory, comm, *, control=None, split=None, split_min=2**18, cost=None)``: see the
    module doc.

    ``split``: cut large buffers into per-rank ranges (default: when the optimizer is elementwise — SGD, AdamW;
    refused for others).  ``cost(name, shape) -> int``: the load the plan balances (default: the number of elements;
    e.g. the state bytes you expect per parameter); it must give the same answer on every rank.  The wrapped
    optimizer is ``.inner``; it only ever sees the pieces this rank owns."""

    plan: Plan

    def __init__(self, optimizer: Optimizer | Callable[[], Optimizer], comm: Any, *, control: Any = None, split: bool | None = None,
                 split_min: int = DEFAULT_SPLIT_MIN, cost: Callable[[str, tuple[int, ...]], int] | None = None) -> None:
        self.backend = as_backend(comm, control)
        self.rank, self.world = self.backend.rank, self.backend.world
        inner: Any = optimizer if hasattr(optimizer, "step_batch") else optimizer()
        if not hasattr(inner, "step_batch"):
            raise TypeError(f"expected a flatopt optimizer or a factory of one, got {type(inner).__name__}")
        elementwise = isinstance(inner, PerParamOptimizer) and bool(inner.elementwise)
        if split is None:
            split = elementwise
        elif split and not elementwise:
            raise ValueError(f"{type(inner).__name__} is not elementwise: its parameters cannot be split")
        if isinstance(split_min, bool) or not isinstance(split_min, int) or split_min < 1:
            raise ValueError(f"split_min must be an int >= 1, got {split_min!r}")
        self.inner = inner
        if cost is not None and not callable(cost):
            raise TypeError(f"cost must be a callable (name, shape) -> int, got {cost!r}")
        self.plan = Plan(self.world, bool(split), split_min, cost=cost)
        self._aliases: dict[str, str] = {}  # MuonAdamW's tied names: alias -> name (the owner of the name steps both)
        if hasattr(inner, "manifest"):
            self._aliases = {r[1]: r[2] for r in inner.manifest() if len(r) == 3 and r[0] == "alias"}
        held = inner.state_dict() if hasattr(inner, "state_dict") else None
        if held is not None and held.params:
            raise ValueError("Sharded needs a fresh optimizer (this one already holds state): wrap a new one and "
                             "restore the state with Sharded.load_state_dict (collective)")
        self._seeds = ApolloSeeds(inner) if hasattr(inner, "_apollo_seed_counter") else None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------------------ protocol
    @property
    def lr(self) -> float | None:
        """The wrapped optimizer's base learning rate."""
        lr: float | None = self.inner.lr
        return lr

    def set_lr(self, lr: float) -> None:
        """Set the wrapped optimizer's base learning rate (call it on every rank with the same value)."""
        self.inner.set_lr(lr)

    def lr_scale(self, name: str) -> float:
        """The wrapped optimizer's learning-rate multiplier of ``name``."""
        scale: float = self.inner.lr_scale(name)
        return scale

    def end_iteration(self) -> None:
        """Count one iteration in the wrapped optimizer (call it on every rank)."""
        self.inner.end_iteration()

    def step(self, name: str, shape: tuple[int, ...], param: Array, grad: Array) -> None:
        """Collective, one parameter: ``step_batch([OptItem(name, shape, param, grad)])`` on every rank."""
        self.step_batch([OptItem(name, shape, param, grad)])

    def step_batch(self, items: Sequence[OptItem]) -> None:
        """Collective: every rank calls it with the same items (names, shapes, dtypes, order) and the same,
        already averaged gradients.  Each rank steps the parameters (or, for SGD/AdamW, the ranges of large
        buffers) the plan gives it, then the owners broadcast the new values, so every rank ends with the same
        parameters, bit-identical to one process stepping them all.  Bad input on any rank raises on every rank
        (the others get ``RemoteStepError``) before anything changes."""
        with self._lock:
            err: BaseException | None = None
            work: tuple[Plan, list[OptItem], list[tuple[int, Array]], Any] | None = None
            try:
                work = self._prepare_pieces(items)
            except Exception as exc:  # noqa: BLE001 - voted on below, re-raised on this rank
                err = exc
            self._vote(err, digest(items), "rejected the batch (nothing was changed on any rank)")
            plan, owned, pieces, seeds = work  # type: ignore[misc]  # not None: _vote raised otherwise
            if plan is not self.plan:
                self._use_plan(plan)
            if self._seeds is not None:
                self._seeds.begin(seeds)
            try:
                if owned:
                    self.inner.step_batch(owned)
            except Exception as exc:  # noqa: BLE001
                err = exc
            finally:
                if self._seeds is not None:
                    self._seeds.settle()
            # an error inside a step (after validation) is voted on too; the broadcast still runs so that every
            # rank holds the same (possibly partly updated) values before all of them raise
            raising = self._verdict(err, 0, "failed inside its step (after validation); parameters and state of "
                                            "its pieces may be partly updated")
            self.backend.broadcast(pieces)
            if raising is not None:
                raise raising

    def _prepare_pieces(self, items: Sequence[OptItem]) -> tuple[Plan, list[OptItem], list[tuple[int, Array]], Any]:
        """Validate the batch on this rank (nothing changes) and work out the pieces: ``(plan, items this rank
        steps, [(owner, param range)] to broadcast, APOLLO seeds of new names)``.  The wrapped optimizer checks
        the items this rank owns first (so its own error types and messages surface, as in a single process);
        the generic checks of ``step_batch`` then cover every other item, so every rank sees bad arrays."""
        items = [it if isinstance(it, OptItem) else OptItem(*it) for it in items]
        batch = [(self._canon(it.name), check_shape(it.name, it.shape)) for it in items]
        plan = self.plan.extended(batch)
        owned: list[OptItem] = []
        pieces: list[tuple[int, Array]] = []
        sent: set[str] = set()
        for it, (name, shape) in zip(items, batch):
            ps = plan.pieces(name)
            if len(ps) > 1 and it.grad is not None:
                check_item(it.name, shape, it.param, it.grad, lowp=True)  # before slicing ranges out of the buffers
            for p in ps:
                if p.owner == self.rank:
                    if len(ps) == 1:
                        owned.append(it)
                    else:
                        owned.append(OptItem(it.name, (p.hi - p.lo,), it.param[p.lo : p.hi],
                                             None if it.grad is None else it.grad[p.lo : p.hi]))
                if it.grad is not None and name not in sent:
                    pieces.append((p.owner, it.param[p.lo : p.hi]))
            sent.add(name)
        if owned and hasattr(self.inner, "validate_batch"):
            self.inner.validate_batch(owned)
        seen: set[str] = set()
        for it, (name, shape) in zip(items, batch):
            if it.grad is not None:
                check_item(it.name, shape, it.param, it.grad, lowp=True)
                self.backend.check_arrays([it.param, it.grad])
            if it.name in seen:
                raise ValueError(f"parameter {it.name!r} appears twice in one step_batch")
            seen.add(it.name)
            if name in self.plan.entries and self.plan.shape(name) != shape:
                raise ValueError(f"parameter {it.name!r}: shape {shape} differs from the shape "
                                 f"{self.plan.shape(name)} its state was created with")
        seeds = self._seeds.reserve(batch, self.plan) if self._seeds is not None else None
        return plan, owned, pieces, seeds

    def _use_plan(self, plan: Plan) -> None:
        """Adopt ``plan``, telling a split optimizer where each range it owns lies in its parameter (the stochastic
        write-back of 16-bit parameters draws by the index in the whole parameter, ``core.lowp``)."""
        if plan is not None and plan.split:
            self.inner.element_offsets = {n: p.lo for n, p in plan.owned(self.rank).items()}
        self.plan = plan

    def _canon(self, name: str) -> str:
        return self._aliases.get(name, name)

    def _vote(self, err: BaseException | None, digest: int, what: str) -> None:
        """All ranks agree: return when every rank is fine, else raise on every rank."""
        raising = self._verdict(err, digest, what)
        if raising is not None:
            raise raising

    def _verdict(self, err: BaseException | None, digest: int, what: str) -> BaseException | None:
        """The collective vote: ``None`` when no rank failed and the batch digests agree; else the exception
        this rank raises (its own, or a :class:`RemoteStepError` naming the failed rank and its message)."""
        failed, differ = self.backend.agree(err is not None, digest)
        if not failed and not differ:
            return None
        msgs = self.backend.messages(None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            return err
        if failed:
            r = failed[0]
            msg = msgs[r] or "(no message without a control communicator)"
            return RemoteStepError(f"rank {r} {what}: {msg}")
        return RemoteStepError("the ranks passed different batches (names, shapes, dtypes or order differ); every "
                               "rank must call step_batch with the same items; nothing was changed")

    # ---------------------------------------------------------------------------------------- helpers
    def allreduce_mean(self, buffers: Sequence[Array]) -> None:
        """Average each buffer in place over the ranks of this optimizer's communicator (collective)."""
        allreduce_mean(buffers, self.backend)

    def global_norm(self, buffers: Sequence[Array]) -> Array:
        """‖buffers‖₂ over all ranks' buffers together (collective; see ``flatopt.distributed.global_norm``)."""
        return global_norm(buffers, self.backend)

    def grad_norm(self, items: Sequence[OptItem]) -> Array:
        """‖all gradients of ``items``‖₂, each rank summing only the pieces it owns (1/world of the work), for
        identical gradients on every rank (float64 accumulation; not bit-equal to a single-process norm)."""
        bufs = []
        for it in items:
            it = it if isinstance(it, OptItem) else OptItem(*it)
            name = self._canon(it.name)
            if it.grad is None or name not in self.plan.entries:
                continue
            bufs += [it.grad[p.lo : p.hi] for p in self.plan.pieces(name) if p.owner == self.rank]
        return global_norm(bufs, self.backend, allow_empty=True, like=items[0].grad if items else None)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank."""
        if hasattr(self.inner, "state_nbytes"):
            return int(self.inner.state_nbytes())
        return sum(int(b.nbytes) for b in self.inner.state_dict().buffers.values())


# --------------------------------------------------------------------------------------------- free helpers
def allreduce_mean(buffers: Sequence[Array], comm: Any) -> None:
    """Average ``buffers`` in place across the ranks of ``comm`` (mpi4py or NCCL communicator, or a
    :class:`Sharded`): a sum all-reduce, then a division by the world size, in each buffer's dtype.  NumPy arrays
    go through MPI, CuPy arrays through NCCL on the current stream (no host synchronisation)."""
    be = comm.backend if isinstance(comm, Sharded) else as_backend(comm)
    be.check_arrays(buffers)
    be.allreduce_sum(buffers)
    if be.world > 1:
        for b in buffers:
            b /= b.dtype.type(be.world)


def global_norm(buffers: Sequence[Array], comm: Any, *, allow_empty: bool = False, like: Array = None) -> Array:
    """√(Σ over the ranks of Σ over their ``buffers`` of Σ x²), accumulated in float64: the norm of the union of
    disjoint per-rank buffers (e.g. gradient shards).  NumPy: a NumPy float64; CuPy: a 0-d device array (no host
    synchronisation).  Every rank must call it.  The local sum adds in one documented order on both backends
    (``core.norms.sumsq64``: each buffer in ``core.sqsum.sq_sum``'s blocked order over float64(x)², the buffers in
    order): the same bits on NumPy and CuPy; on CuPy two launches per buffer (then the all-reduce and the root)."""
    be = comm.backend if isinstance(comm, Sharded) else as_backend(comm)
    if not buffers and not allow_empty:
        raise ValueError("expected at least one buffer")
    be.check_arrays(buffers)
    probe = buffers[0] if buffers else like
    xp = _backend.array_module(probe) if probe is not None else np
    total = _norms.sumsq64(xp, buffers)
    return xp.sqrt(be.allreduce_scalar(total))

"""Communication backends of :mod:`flatopt.distributed`: MPI (mpi4py, NumPy arrays) and NCCL (CuPy arrays).

Both offer the same few collectives, called in the same order on every rank:

* ``agree(failed, digest)``: the control-plane vote taken before anything mutates: did any rank fail, and did
  every rank pass the same batch (``digest``)?  Returns ``(failed_ranks, digests_differ)``; the messages of the
  failed ranks come from ``messages(msg)``.
* ``broadcast(pieces)``: ``[(root, flat array)]``, each array overwritten on every rank with the root's values.
* ``allreduce_sum(buffers)``: in place.  ``allreduce_scalar(x)``: the sum of a 0-d value (a device array on NCCL:
  no host synchronisation).
* ``allgather_object(obj)`` and ``barrier()`` for checkpoints (host side).

mpi4py and CuPy are imported only when a backend is built from such a communicator, never by ``import flatopt``.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from ..core import backend

# Pieces of at least this many elements are broadcast in place; smaller ones are packed per dtype into one
# collective (one latency instead of one per tensor).
PACK_MAX = 1 << 16


class MpiBackend:
    """Collectives over an ``mpi4py`` communicator, on NumPy arrays (MPICH, Open MPI, ...)."""

    kind = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI  # noqa: PLC0415 - optional dependency

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world = comm.Get_size()

    def check_arrays(self, arrays: Sequence) -> None:
        for a in arrays:
            if not isinstance(a, np.ndarray):
                raise TypeError("the MPI backend takes NumPy arrays; use a NCCL communicator "
                                "(cupy.cuda.nccl.NcclCommunicator) for CuPy arrays")

    # ------------------------------------------------------------------------------------ control plane
    def agree(self, failed: bool, digest: int) -> tuple[list[int], bool]:
        vote = np.array([int(failed), digest, -digest], np.int64)
        out = np.empty_like(vote)
        self.comm.Allreduce(vote, out, op=self.MPI.MAX)
        if not out[0]:
            return [], bool(out[1] != -out[2])
        flags = self.comm.allgather(bool(failed))
        return [r for r, f in enumerate(flags) if f], bool(out[1] != -out[2])

    def messages(self, msg: str | None) -> list:
        return self.comm.allgather(msg)

    def allgather_object(self, obj: Any) -> list:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.Barrier()

    # -------------------------------------------------------------------------------------- data plane
    def broadcast(self, pieces: Sequence[tuple[int, np.ndarray]]) -> None:
        packed = defaultdict(list)
        for root, buf in pieces:
            if buf.dtype.name == "bfloat16":
                buf = buf.view(np.uint16)  # (MPI has no bfloat16 type; a broadcast moves bits)
            if buf.size >= PACK_MAX:
                self.comm.Bcast(buf, root=root)
            elif buf.size:
                packed[buf.dtype.str].append((root, buf))
        for key in sorted(packed):
            group = packed[key]
            counts = [0] * self.world
            for root, buf in group:
                counts[root] += buf.size
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            mine = [buf for root, buf in group if root == self.rank]
            send = np.concatenate(mine) if mine else np.empty(0, group[0][1].dtype)
            recv = np.empty(sum(counts), send.dtype)
            self.comm.Allgatherv(send, [recv, (counts, displs)])
            offset = list(displs)
            for root, buf in group:
                if root != self.rank:
                    buf[...] = recv[offset[root] : offset[root] + buf.size]
                offset[root] += buf.size

    def allreduce_sum(self, buffers: Sequence[np.ndarray]) -> None:
        for buf in buffers:
            if buf.dtype.name == "bfloat16":
                raise TypeError("the MPI backend cannot sum bfloat16 buffers (MPI has no bfloat16 type): reduce the "
                                "gradients in float32 (or float16)")
        packed = defaultdict(list)
        for buf in buffers:
            if buf.size >= PACK_MAX:
                self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
            elif buf.size:
                packed[buf.dtype.str].append(buf)
        for key in sorted(packed):
            group = packed[key]
            flat = np.concatenate([b.reshape(-1) for b in group])
            self.comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
            lo = 0
            for b in group:
                b.reshape(-1)[...] = flat[lo : lo + b.size]
                lo += b.size

    def allreduce_scalar(self, x):
        buf = np.array([float(x)], np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return np.float64(buf[0])


# NCCL's data types by dtype name (cupy.cuda.nccl constants)
NCCL_TYPES = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
              "float64": "NCCL_FLOAT64", "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


class NcclBackend:
    """Collectives over a ``cupy.cuda.nccl.NcclCommunicator``, on C-contiguous CuPy arrays (NCCL reads ``size``
    elements from the data pointer: a strided view is refused, never reduced over the wrong bytes) of float16,
    bfloat16, float32, float64, int32 or int64, on the communicator's device (``comm.device_id()``) and on that
    device's current stream, whichever device is current (no host synchronisation in the data plane).

    ``control`` (an mpi4py communicator over the same ranks, optional) carries the host-side vote, messages and
    checkpoint metadata.  Without it the vote is a NCCL all-reduce read back on the host (one synchronisation
    per step), the error messages of other ranks are not available, and checkpoint helpers that gather objects
    raise."""

    kind = "nccl"

    def __init__(self, comm, control=None):
        self.cp = backend.cupy()
        self.nccl = nccl = backend.nccl()
        self.comm = comm
        self.rank = comm.rank_id()
        self.world = comm.size()
        self.control = MpiBackend(control) if control is not None else None
        if self.control is not None and (self.control.rank, self.control.world) != (self.rank, self.world):
            raise ValueError("the control communicator must have the same ranks as the NCCL communicator")
        self.device = int(comm.device_id())
        # by dtype name (bfloat16 is not a NumPy dtype; ml_dtypes' is named so)
        self._types = {name: getattr(nccl, const) for name, const in NCCL_TYPES.items() if hasattr(nccl, const)}

    def check_arrays(self, arrays: Sequence) -> None:
        for a in arrays:
            if not backend.is_cupy_array(a):
                raise TypeError("the NCCL backend takes CuPy arrays; use an mpi4py communicator for NumPy arrays")
            if a.dtype.name not in self._types:
                raise TypeError(f"the NCCL backend takes arrays of {', '.join(self._types)}, got {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"the NCCL backend takes C-contiguous arrays (NCCL reads size elements from the data "
                                 f"pointer), got a strided array of shape {tuple(a.shape)}, strides {a.strides}")
            if a.data.device_id != self.device:
                raise ValueError(f"an array on device {a.data.device_id}, but the NCCL communicator is on device "
                                 f"{self.device}")

    def _on_device(self):
        """``with`` the communicator's device current: its current stream is the one NCCL is given."""
        return self.cp.cuda.Device(self.device)

    def _stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    # ------------------------------------------------------------------------------------ control plane
    def agree(self, failed: bool, digest: int) -> tuple[list[int], bool]:
        if self.control is not None:
            return self.control.agree(failed, digest)
        cp = self.cp
        with self._on_device():
            vote = cp.zeros(self.world + 2, cp.int64)
            vote[self.rank] = int(failed)
            vote[self.world], vote[self.world + 1] = digest, -digest
            self.comm.allReduce(vote.data.ptr, vote.data.ptr, vote.size, self.nccl.NCCL_INT64, self.nccl.NCCL_MAX,
                                self._stream())
            host = vote.get()  # the one host synchronisation of a step without a control communicator
        return [r for r in range(self.world) if host[r]], bool(host[self.world] != -host[self.world + 1])

    def messages(self, msg: str | None) -> list:
        if self.control is not None:
            return self.control.messages(msg)
        return [None] * self.world

    def allgather_object(self, obj: Any) -> list:
        if self.control is None:
            raise RuntimeError("this needs a host communicator: Sharded(opt, nccl_comm, control=mpi_comm)")
        return self.control.allgather_object(obj)

    def barrier(self) -> None:
        if self.control is not None:
            self.control.barrier()
        else:
            with self._on_device():
                self.cp.cuda.get_current_stream().synchronize()
                self.allreduce_sum([self.cp.zeros(1, self.cp.float32)])
                self.cp.cuda.get_current_stream().synchronize()

    # -------------------------------------------------------------------------------------- data plane
    def broadcast(self, pieces: Sequence[tuple[int, Any]]) -> None:
        self.check_arrays([buf for _, buf in pieces])
        with self._on_device():
            stream = self._stream()
            self.nccl.groupStart()
            try:
                for root, buf in pieces:
                    if buf.size:
                        self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype.name], root,
                                            stream)
            finally:
                self.nccl.groupEnd()

    def allreduce_sum(self, buffers: Sequence) -> None:
        self.check_arrays(buffers)
        with self._on_device():
            stream = self._stream()
            self.nccl.groupStart()
            try:
                for buf in buffers:
                    if buf.size:
                        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype.name],
                                            self.nccl.NCCL_SUM, stream)
            finally:
                self.nccl.groupEnd()

    def allreduce_scalar(self, x):
        with self._on_device():
            buf = self.cp.asarray(x, dtype=self.cp.float64).reshape(1).copy()
            self.allreduce_sum([buf])
        return buf.reshape(())


def as_backend(comm, control=None):
    """The backend for ``comm``: an mpi4py communicator, a ``cupy.cuda.nccl.NcclCommunicator`` (optionally with
    an mpi4py ``control`` communicator), or a backend object already."""
    if isinstance(comm, (MpiBackend, NcclBackend)):
        return comm
    mod = type(comm).__module__
    if mod.startswith("mpi4py"):
        return MpiBackend(comm)
    if mod.startswith("cupy") and type(comm).__name__ == "NcclCommunicator":
        return NcclBackend(comm, control)
    raise TypeError(f"expected an mpi4py communicator or a cupy.cuda.nccl.NcclCommunicator, got {mod}."
                    f"{type(comm).__name__}")


def digest(items) -> int:
    """A 56-bit digest of what must agree across ranks: names, shapes, dtypes (a gradient's too), sizes, missing
    gradients (never raises, whatever ``items`` holds: it is computed before the vote)."""
    h = hashlib.blake2b(digest_size=7)
    try:
        for it in items:
            try:
                name, shape, param, grad = it
                shape = tuple(int(d) for d in shape)
                key = (name, shape, str(getattr(param, "dtype", "")), getattr(param, "size", -1), grad is None,
                       str(getattr(grad, "dtype", "")))
            except Exception:  # noqa: BLE001 - a malformed item: rejected by validation, any digest will do
                key = ("?", type(it).__name__)
            h.update(repr(key).encode())
    except Exception:  # noqa: BLE001 - not iterable
        h.update(b"?")
    return int.from_bytes(h.digest(), "little")

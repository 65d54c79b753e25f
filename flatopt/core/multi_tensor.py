"""Multi-tensor launches of the elementwise algorithms on CuPy: one kernel launch updates many tensors.

A definition's optimizer class holds a :class:`MultiTensor` (``multi_tensor``, from ``core.elementwise.run.bind``:
its ``kernels`` name the generated kernels of the step's flag set and their arguments); ``core.step_plan`` then
groups the CuPy items of a batch by (device, dtype, step count ``t``) and launches the kernel once per group of two
or more tensors (a lone tensor keeps the per-tensor kernel).  So a step of N tensors of one dtype in lock-step costs
one launch.  The learning rate is the driver's ``base_lr * lr_scale`` and the state is updated in place.

**The table** (built once per plan, :class:`Group`): one int64 device buffer holding

* ``tensors``: one row per tensor: the addresses of p, g and the state arrays ``arrays(state, p)`` returns (in that
  order; a stand-in such as ``p`` for an absent one the kernel does not touch), then the tensor's size n, then 1
  when every one of those addresses is 16-byte aligned and ``chunk`` a multiple of 4, else 0: such a tensor is read
  and written by 16-byte vector loads and stores (``core/elementwise/emit.py``);
* ``blocks``: one (tensor index, first element) pair per chunk of ``CHUNK`` elements (as torch's
  ``multi_tensor_apply`` walks its tensor lists): block b of the launch updates elements [lo, min(lo + CHUNK, n)) of
  tensor ti; a tensor of 0 elements has no chunk;
* ``scales``: each tensor's ``lr_scale`` (float64).

It is uploaded once, when the plan is built, by ``cupy.asarray`` of a NumPy array: CuPy copies the data into a
pinned staging buffer of its pool and enqueues a ``cudaMemcpyAsync`` on the current stream, and keeps the staging
buffer from reuse until an event after the copy has passed, so there is no host synchronisation; the kernels that read
the table are launched later on the same stream (a launch on another stream first waits for an event recorded after
the upload).  Nothing is allocated or uploaded per step.

**The per-step scalars** (the base learning rate, the bias corrections of this step's ``t``) are kernel arguments:
the driver copies a launch's arguments when it is enqueued, so they need no staging buffer and no synchronisation.
The kernel derives each tensor's scalars from ``base_lr * scales[ti]`` in double with the operations (and
rounding) the twin performs on the host, so its bits are the per-tensor kernel's and the twin's.

**Per-tensor sums** (a definition with ``e.sum``, ``core/elementwise/reduce.py``: Lamb's ‖θ‖ and ‖u‖, Mars's
‖c‖): two passes per reduction level run before the elementwise kernel, so a group costs 2·levels + 1 launches
whatever its number of tensors (three for one level; Mars with clip_c and cautious has two: the mask's count follows
the clip's norm).  The per-tensor kernels sum in ``core/sqsum.py``'s blocked order: a first pass of ``sq_blocks(n)`` blocks
writes one partial per block, a one-block fold adds them (``kernels/sq_sum.cuh``).
The group's table then also holds

* ``segs``: one (tensor index, c) pair per block c of each tensor's first pass (the partials kernel runs launch block
  b as that tensor's block c, with the tensor's own block count, so each partial is the per-tensor kernel's);
* ``spans``: one (offset, nb) pair per tensor: its nb partials of sum k are ``parts[k * nparts + offset ...]``;

and a device buffer of ``sums * nparts`` partials plus ``folds`` values per tensor (``scal``), allocated with the
plan.  The fold kernel runs one block per tensor, folds its partials in the per-tensor fold's order and writes
``scal[ti * folds + k]``; the elementwise kernel reads them.  The levels run one after the other on the same
partials' buffer; a level after the first reads the earlier levels' values from ``scal``.  Signatures:
``partials(tensors, segs, spans, nparts, parts, <args>[, scal])`` (``scal`` after the first level), ``fold(spans,
scales, nparts, base_lr, parts, scal, <args>)``, the elementwise kernel's ``(tensors, blocks, scales, chunk,
base_lr, <args>)`` with ``scal`` last.  A flag set without a sum (Mars without clip_c nor cautious) runs the
elementwise kernel alone, without ``scal``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from . import backend, kernels, sqsum as sq

# Elements per chunk (one block each; 256 threads per block: 16 elements per thread, four groups of 4): small enough
# that the 76-tensor set is several waves of blocks, so the last wave's tail is a small part of the step; the model:
# `python -m benchmarks.kernel_model` (benchmarks/README.md, "Generated kernels: grid and waves").
CHUNK = 1 << 12
BLOCK = 256


@dataclasses.dataclass(frozen=True)
class MultiTensor:
    """How a definition's multi-tensor kernels are fed (see the module docstring)."""

    source: str  # the .cu file
    arrays: Callable[[Any, Any], tuple]  # (state, p) -> the state arrays of a table row, after p and g
    # (config, t, host values) -> ((kernel, args after base_lr) of the elementwise kernel, None or per reduction level
    # the (kernel, args) of its partials and of its fold): the flag set's kernels (core/elementwise/run.py)
    kernels: Callable[..., tuple]
    sums: int = 0  # the most sums of one level: the partials' buffer holds sums * nparts (0: no per-tensor sums)
    folds: int = 0  # the most per-tensor values a fold writes: scal[ti * folds + k]


def _ptr(a) -> int:
    return int(a.data.ptr)


class Group:
    """The tensors of one (device, dtype, t) class of a plan: the device table, built once."""

    def __init__(self, spec: MultiTensor, members: list, chunk: int):
        """``members``: ``[(param, grad, slot, scale)]``, two or more, of one device and dtype."""
        cp = backend.cupy()
        p0 = members[0][0]
        self.spec, self.dtype, self.device = spec, p0.dtype, p0.device
        rows = np.empty((len(members), 4 + len(spec.arrays(members[0][2].state, p0))), np.int64)
        blocks = []
        keep = []  # the state arrays whose addresses the table holds (the optimizer's own; kept alive)
        for r, (p, g, slot, _) in enumerate(members):
            st = spec.arrays(slot.state, p)
            keep.extend(st)
            addrs = (_ptr(p), _ptr(g), *map(_ptr, st))
            # a chunk starts at a multiple of ``chunk``: aligned too when that is of 4
            rows[r] = (*addrs, p.size, all(a % 16 == 0 for a in addrs) and chunk % 4 == 0)
            blocks.extend((r, lo) for lo in range(0, p.size, chunk))
        self.nblocks = len(blocks)
        nt, nb = rows.size, 2 * len(blocks)
        norm_tables = _norm_tables(members) if spec.sums else np.empty(0, np.int64)
        ns = nt + nb + len(members)
        host = np.empty(ns + norm_tables.size, np.int64)
        host[:nt] = rows.reshape(-1)
        host[nt:nt + nb] = np.asarray(blocks, np.int64).reshape(-1) if blocks else 0
        host[nt + nb:ns] = np.asarray([float(m[3]) for m in members], np.float64).view(np.int64)
        host[ns:] = norm_tables
        with self.device:
            stream = cp.cuda.get_current_stream()
            table = cp.asarray(host)  # async, through CuPy's pinned staging (see the module docstring)
            self.uploaded = stream.record()
            self.streams = {stream.ptr}
            self.tensors = table[:nt]
            self.blocks = table[nt:nt + nb]
            self.scales = table[nt + nb:ns].view(cp.float64)
            if spec.sums:  # the segment and span tables (views of the table) and the partials' buffer
                self.ntensors = len(members)
                self.nsegs = (norm_tables.size - 2 * self.ntensors) // 2
                self.nparts = np.int64(self.nsegs)
                self.segs, self.spans = table[ns:ns + 2 * self.nsegs], table[ns + 2 * self.nsegs:]
                parts = cp.empty(spec.sums * self.nsegs + spec.folds * self.ntensors, self.dtype)  # once per plan
                self.parts, self.scal = parts[:spec.sums * self.nsegs], parts[spec.sums * self.nsegs:]
        self.table = table
        self.keep = keep
        self.chunk_arg = np.int64(chunk)

    def launch(self, config, t: int, base_lr: float, host: tuple = ()) -> None:
        """One launch for every tensor of the group (no host synchronisation, nothing allocated).  ``host``: the
        per-parameter host values of a definition that declares them (``core.elementwise.define``), which every
        member of the group shares."""
        if not self.nblocks:
            return
        cp = backend.cupy()
        (name, margs), norms = self.spec.kernels(config, t, host)
        args = (self.tensors, self.blocks, self.scales, self.chunk_arg, float(base_lr), *margs)
        with self.device:
            stream = cp.cuda.get_current_stream()
            if stream.ptr not in self.streams:  # the table was uploaded on another stream: order after it
                stream.wait_event(self.uploaded)
                self.streams.add(stream.ptr)
            if norms is not None:  # per level the partials and the per-tensor fold, which later kernels read
                threads = (sq.SQ_THREADS,)  # the blocked sums' layout needs this many threads per block
                for level, ((partials, pargs), (fold, fargs)) in enumerate(norms):
                    self._get(partials)((self.nsegs,), threads, (self.tensors, self.segs, self.spans, self.nparts,
                                                                 self.parts, *pargs, *((self.scal,) if level else ())))
                    self._get(fold)((self.ntensors,), threads, (self.spans, self.scales, self.nparts,
                                                                float(base_lr), self.parts, self.scal, *fargs))
                args += (self.scal,)
            self._get(name)((self.nblocks,), (BLOCK,), args)

    def _get(self, name: str) -> Any:
        return kernels.get(self.spec.source, name, self.dtype)


def _norm_tables(members: list) -> np.ndarray:
    """``segs`` then ``spans`` (see the module docstring): the blocks of each tensor's first pass, ``core.blocks``'
    ``sq_blocks(n)`` of them (none for an empty tensor)."""
    segs, spans, off = [], [], 0
    for r, m in enumerate(members):
        n = m[0].size
        nb = sq.sq_blocks(n) if n else 0
        spans.append((off, nb))
        segs.extend((r, c) for c in range(nb))
        off += nb
    return np.asarray(segs + spans, np.int64).reshape(-1)

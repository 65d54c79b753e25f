"""Multi-tensor launches of the elementwise algorithms on CuPy: one kernel launch updates many tensors.

An elementwise algorithm that ships a multi-tensor kernel declares it with a :class:`MultiTensor` class attribute
(``multi_tensor = MultiTensor("<algo>.cu", "<algo>_multi", arrays, args)``; an algorithm defined once gets its own
from ``core.elementwise.run.bind``, whose ``pick`` chooses the kernel of the step's flag set); ``core.step_plan``
then groups the CuPy items of a batch by (device, dtype, step count ``t``) and launches the kernel once per group of
two or more tensors (a lone tensor keeps the per-tensor kernel).  So a step of N tensors of one dtype in lock-step
costs one launch.

**The table** (built once per plan, :class:`Group`): one int64 device buffer holding

* ``tensors``: one row per tensor: the addresses of p, g and the state arrays ``arrays(state, p)`` returns (in that
  order), then the tensor's size n, then (``aligned_flag``: the generated kernels) 1 when every one of those
  addresses is 16-byte aligned and ``chunk`` a multiple of 4, else 0: such a tensor is read and written by 16-byte
  vector loads and stores (``core/elementwise/emit.py``);
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

**Plugging in an algorithm**: a ``<name>_multi`` template kernel beside its per-tensor kernel in the algorithm's
``.cu`` file (both calling one ``__device__`` element function; signature ``(const long long* tensors, const long
long* blocks, const double* scales, long long chunk, double base_lr, <args>)``, registered in
``core.kernels.KERNELS``), and the class attribute above: ``arrays(state, p)`` gives the state arrays of a row (a
stand-in address such as ``p`` for an absent one the kernel does not touch) and ``args(config, t, dtype)`` the
launch's arguments after ``base_lr``.  The algorithm's learning rate must be the driver's ``base_lr * lr_scale``
(``hooks.effective_lr`` not replaced) and its state updated in place.

**Per-tensor sums** (a definition with ``e.sum``, ``core/elementwise/reduce.py``: Lamb's ‖θ‖ and ‖u‖, Mars's ‖c‖): a
:class:`Norms` in ``MultiTensor(..., norms=...)`` runs two passes per reduction level before the elementwise kernel,
so a group costs 2·levels + 1 launches whatever its number of tensors (three for one level; Mars with clip_c and
cautious has two: the mask's count follows the clip's norm).  The per-tensor kernels sum in ``core/sqsum.py``'s
blocked order: a first pass of ``sq_blocks(n)`` blocks writes one partial per block, a one-block fold adds them
(``kernels/sq_sum.cuh``).
The group's table then also holds

* ``segs``: one (tensor index, c) pair per block c of each tensor's first pass (the partials kernel runs launch block
  b as that tensor's block c, with the tensor's own block count, so each partial is the per-tensor kernel's);
* ``spans``: one (offset, nb) pair per tensor: its nb partials of sum k are ``parts[k * nparts + offset ...]``;

and a device buffer of ``sums * nparts`` partials plus ``folds`` values per tensor (``scal``), allocated with the
plan.  The fold kernel runs one block per tensor, folds its partials in the per-tensor fold's order and writes
``scal[ti * folds + k]``; the elementwise kernel reads them.  The levels run one after the other on the same
partials' buffer; a level after the first reads the earlier levels' values from ``scal``.  Signatures:
``partials(tensors, segs, spans, nparts, parts, <partial_args>[, scal])`` (``scal`` after the first level),
``fold(spans, scales, nparts, base_lr, parts, scal, <fold_args>)``, the elementwise kernel's as above with ``scal``
last; ``norms.pick(config, t)`` names the (partials, fold) kernels of each level of a flag set, or None for one
without a sum (Mars without clip_c): then only the elementwise kernel runs, without ``scal``.
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
class Norms:
    """The per-tensor sums a multi-tensor kernel needs first (see the module docstring)."""

    sums: int  # the most sums of one level: the partials' buffer holds sums * nparts
    folds: int  # the most per-tensor values the folds of a flag set write: scal[ti * folds + k]
    # (config, t) -> one (partials, fold) pair of kernels per level of this launch, or None for a flag set without
    # a sum; the three take the group's host values as a last argument where the definition declares them (as
    # MultiTensor's), the last two the keyword ``level``
    pick: Callable[..., tuple | None]
    partial_args: Callable[..., tuple]  # (config, t, dtype scalar type, level=) -> the arguments after parts
    fold_args: Callable[..., tuple]  # (config, t, dtype scalar type, level=) -> the arguments after scal


@dataclasses.dataclass(frozen=True)
class MultiTensor:
    """How an elementwise algorithm's multi-tensor kernel is fed (see the module docstring)."""

    source: str  # the .cu file
    kernel: str  # the template kernel's name (registered in core.kernels.KERNELS)
    arrays: Callable[[Any, Any], tuple]  # (state, p) -> the state arrays of a table row, after p and g
    args: Callable[..., tuple]  # (config, t, dtype scalar type) -> the arguments after base_lr
    norms: Norms | None = None  # per-tensor sums before the elementwise kernel (core/elementwise/reduce.py)
    # (config, t) -> the kernel of this launch, when it depends on them (a generated definition's flag set); both
    # take the group's host values as a fourth/third argument where the definition declares them
    pick: Callable[..., str] | None = None
    # a last column per row: 1 when every address of the row is 16-byte aligned (the generated kernels' vector path)
    aligned_flag: bool = False


def _ptr(a) -> int:
    return int(a.data.ptr)


class Group:
    """The tensors of one (device, dtype, t) class of a plan: the device table and the kernel, built once."""

    def __init__(self, spec: MultiTensor, members: list, chunk: int):
        """``members``: ``[(param, grad, slot, scale)]``, two or more, of one device and dtype."""
        cp = backend.cupy()
        p0 = members[0][0]
        self.spec, self.chunk, self.dtype = spec, chunk, p0.dtype
        self.device = p0.device
        ncol = 3 + len(spec.arrays(members[0][2].state, p0)) + spec.aligned_flag
        rows = np.empty((len(members), ncol), np.int64)
        blocks = []
        keep = []  # the state arrays whose addresses the table holds (the optimizer's own; kept alive)
        for r, (p, g, slot, _) in enumerate(members):
            st = spec.arrays(slot.state, p)
            keep.extend(st)
            addrs = (_ptr(p), _ptr(g), *map(_ptr, st))
            rows[r, :len(addrs) + 1] = (*addrs, p.size)
            if spec.aligned_flag:  # a chunk starts at a multiple of ``chunk``: aligned too when that is of 4
                rows[r, -1] = all(a % 16 == 0 for a in addrs) and chunk % 4 == 0
            blocks.extend((r, lo) for lo in range(0, p.size, chunk))
        self.nblocks = len(blocks)
        nt, nb = rows.size, 2 * len(blocks)
        norm_tables = _norm_tables(members) if spec.norms is not None else np.empty(0, np.int64)
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
            self.fn = kernels.get(spec.source, spec.kernel, self.dtype)
            if spec.norms is not None:
                self._norms_init(cp, spec, table[ns:], len(members))
        self.table = table
        self.keep = keep
        self.chunk_arg = np.int64(chunk)

    def _norms_init(self, cp, spec: MultiTensor, tables, ntensors: int) -> None:
        """The segment and span tables (views of the uploaded table), the partials' buffer and the two kernels."""
        nsegs = (tables.size - 2 * ntensors) // 2
        self.ntensors, self.nsegs = ntensors, nsegs
        self.segs, self.spans = tables[:2 * nsegs], tables[2 * nsegs:]
        self.nparts = np.int64(nsegs)
        parts = cp.empty(spec.norms.sums * nsegs + spec.norms.folds * ntensors, self.dtype)  # once per plan
        self.parts, self.scal = parts[:spec.norms.sums * nsegs], parts[spec.norms.sums * nsegs:]

    def launch(self, config, t: int, base_lr: float, host: tuple = ()) -> None:
        """One launch for every tensor of the group (no host synchronisation, nothing allocated).  ``host``: the
        per-parameter host values of a definition that declares them (``core.elementwise.define``), which every
        member of the group shares."""
        if not self.nblocks:
            return
        cp = backend.cupy()
        extra = (host,) if host else ()
        args = (self.tensors, self.blocks, self.scales, self.chunk_arg, float(base_lr),
                *self.spec.args(config, t, self.dtype.type, *extra))
        with self.device:
            stream = cp.cuda.get_current_stream()
            if stream.ptr not in self.streams:  # the table was uploaded on another stream: order after it
                stream.wait_event(self.uploaded)
                self.streams.add(stream.ptr)
            if self.spec.norms is not None:
                self._launch_norms(config, t, base_lr, args, extra)
            elif self.spec.pick is not None:
                kernels.get(self.spec.source, self.spec.pick(config, t, *extra), self.dtype)((self.nblocks,), (BLOCK,),
                                                                                            args)
            else:
                self.fn((self.nblocks,), (BLOCK,), args)

    def _launch_norms(self, config, t: int, base_lr: float, args: tuple, extra: tuple = ()) -> None:
        """The partials, the per-tensor fold and the elementwise kernel (which reads ``scal``); a flag set without a
        sum: its plain kernel alone."""
        norms, dt, spec = self.spec.norms, self.dtype.type, self.spec
        fn = self.fn if spec.pick is None else kernels.get(spec.source, spec.pick(config, t, *extra), self.dtype)
        names = norms.pick(config, t, *extra)
        if names is None:
            fn((self.nblocks,), (BLOCK,), args)
            return
        threads = (sq.SQ_THREADS,)  # the blocked sums' layout needs this many threads per block
        for level, pair in enumerate(names):  # a level after the first reads the earlier folds from scal
            partials_fn, fold_fn = (kernels.get(spec.source, k, self.dtype) for k in pair)
            partials_fn((self.nsegs,), threads, (self.tensors, self.segs, self.spans, self.nparts, self.parts,
                                                 *norms.partial_args(config, t, dt, *extra, level=level),
                                                 *((self.scal,) if level else ())))
            fold_fn((self.ntensors,), threads, (self.spans, self.scales, self.nparts, float(base_lr), self.parts,
                                                self.scal, *norms.fold_args(config, t, dt, *extra, level=level)))
        fn((self.nblocks,), (BLOCK,), (*args, self.scal))


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

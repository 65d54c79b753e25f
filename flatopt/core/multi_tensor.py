"""Multi-tensor launches of the elementwise algorithms on CuPy: one kernel launch updates many tensors.

An elementwise algorithm that ships a multi-tensor kernel declares it with a :class:`MultiTensor` class attribute
(``multi_tensor = MultiTensor("adamw.cu", "adamw_multi", arrays, args)``); ``core.step_plan`` then groups the CuPy
items of a batch by (device, dtype, step count ``t``) and launches the kernel once per group of two or more tensors
(a lone tensor keeps the per-tensor kernel).  So a step of N tensors of one dtype in lock-step costs one launch.

**The table** (built once per plan, :class:`Group`): one int64 device buffer holding

* ``tensors``: one row per tensor: the addresses of p, g and the state arrays ``arrays(state, p)`` returns (in that
  order), then the tensor's size n;
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
(``_effective_lr`` not overridden) and its state updated in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from . import backend, kernels

# Elements per chunk (one block each); 256 threads per block: 128 elements per thread.
CHUNK = 1 << 15
BLOCK = 256


@dataclasses.dataclass(frozen=True)
class MultiTensor:
    """How an elementwise algorithm's multi-tensor kernel is fed (see the module docstring)."""

    source: str  # the .cu file
    kernel: str  # the template kernel's name (registered in core.kernels.KERNELS)
    arrays: Callable[[Any, Any], tuple]  # (state, p) -> the state arrays of a table row, after p and g
    args: Callable[[Any, int, type], tuple]  # (config, t, dtype scalar type) -> the arguments after base_lr


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
        ncol = 3 + len(spec.arrays(members[0][2].state, p0))
        rows = np.empty((len(members), ncol), np.int64)
        blocks = []
        keep = []  # the state arrays whose addresses the table holds (the optimizer's own; kept alive)
        for r, (p, g, slot, _) in enumerate(members):
            st = spec.arrays(slot.state, p)
            keep.extend(st)
            rows[r] = (_ptr(p), _ptr(g), *map(_ptr, st), p.size)
            blocks.extend((r, lo) for lo in range(0, p.size, chunk))
        self.nblocks = len(blocks)
        nt, nb = rows.size, 2 * len(blocks)
        host = np.empty(nt + nb + len(members), np.int64)
        host[:nt] = rows.reshape(-1)
        host[nt:nt + nb] = np.asarray(blocks, np.int64).reshape(-1) if blocks else 0
        host[nt + nb:] = np.asarray([float(m[3]) for m in members], np.float64).view(np.int64)
        with self.device:
            stream = cp.cuda.get_current_stream()
            table = cp.asarray(host)  # async, through CuPy's pinned staging (see the module docstring)
            self.uploaded = stream.record()
            self.streams = {stream.ptr}
            self.tensors = table[:nt]
            self.blocks = table[nt:nt + nb]
            self.scales = table[nt + nb:].view(cp.float64)
            self.fn = kernels.get(spec.source, spec.kernel, self.dtype)
        self.table = table
        self.keep = keep
        self.chunk_arg = np.int64(chunk)

    def launch(self, config, t: int, base_lr: float) -> None:
        """One launch for every tensor of the group (no host synchronisation, nothing allocated)."""
        if not self.nblocks:
            return
        cp = backend.cupy()
        args = (self.tensors, self.blocks, self.scales, self.chunk_arg, float(base_lr),
                *self.spec.args(config, t, self.dtype.type))
        with self.device:
            stream = cp.cuda.get_current_stream()
            if stream.ptr not in self.streams:  # the table was uploaded on another stream: order after it
                stream.wait_event(self.uploaded)
                self.streams.add(stream.ptr)
            self.fn((self.nblocks,), (BLOCK,), args)

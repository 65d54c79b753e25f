"""The NCCL backend on the CuPy stand-in with a recording communicator (gpu-review M5): strided arrays are refused
(NCCL would reduce ``size`` elements from the data pointer: the wrong bytes), every dtype flatopt reduces maps to its
NCCL type, and each call runs with the communicator's device current, on that device's current stream."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from flatopt.core import backend
from flatopt.distributed import allreduce_mean, comm as comm_mod

from .cuda_emu import fakecupy

CONSTS = {name: 100 + i for i, name in enumerate(["NCCL_FLOAT16", "NCCL_BFLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64",
                                                 "NCCL_INT32", "NCCL_INT64", "NCCL_SUM", "NCCL_MAX"])}


class Comm:
    """``cupy.cuda.nccl.NcclCommunicator`` of one rank, recording each call with the device current during it."""

    def __init__(self, device=0):
        self.calls, self.dev = [], device

    def rank_id(self):
        return 0

    def size(self):
        return 1

    def device_id(self):
        return self.dev

    def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802 - NCCL's name
        self.calls.append(("allReduce", send, count, dtype, stream, list(CURRENT)))

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", send, count, dtype, stream, list(CURRENT)))


CURRENT: list = []  # the devices entered (a stack)


@pytest.fixture
def be(monkeypatch):
    with fakecupy.installed() as cp:
        class Device(fakecupy.Device):
            def __enter__(self):
                CURRENT.append(self.id)
                return self

            def __exit__(self, *exc):
                CURRENT.pop()
                return False

        monkeypatch.setattr(cp.cuda, "Device", Device)
        nccl = SimpleNamespace(groupStart=lambda: None, groupEnd=lambda: None, **CONSTS)
        monkeypatch.setattr(backend, "nccl", lambda: nccl)
        yield comm_mod.NcclBackend(Comm()), cp


def test_strided_arrays_are_refused_before_any_call(be):
    b, cp = be
    a = cp.zeros((4, 6), cp.float32)
    for bad in (a[:, ::2], a.T, cp.zeros(10, cp.float32)[::2]):
        with pytest.raises(ValueError, match="C-contiguous"):
            b.allreduce_sum([cp.zeros(3, cp.float32), bad])
        with pytest.raises(ValueError, match="C-contiguous"):
            allreduce_mean([bad], b)
        with pytest.raises(ValueError, match="C-contiguous"):
            b.broadcast([(0, bad)])
    assert b.comm.calls == []


@pytest.mark.parametrize("dtype, const", [("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"),
                                          ("float64", "NCCL_FLOAT64"), ("int32", "NCCL_INT32"),
                                          ("int64", "NCCL_INT64")])
def test_every_dtype_maps_to_its_nccl_type(be, dtype, const):
    b, cp = be
    x = cp.ones(5, dtype)
    allreduce_mean([x], b)
    b.broadcast([(0, x)])
    assert [c[3] for c in b.comm.calls] == [CONSTS[const]] * 2
    assert [c[2] for c in b.comm.calls] == [5, 5]


def test_bfloat16_is_mapped_and_others_refused(be):
    b, cp = be
    assert b._types["bfloat16"] == CONSTS["NCCL_BFLOAT16"]  # noqa: SLF001 (no bfloat16 dtype to build an array)
    with pytest.raises(TypeError, match="complex64"):
        b.allreduce_sum([cp.zeros(2, np.complex64)])


def test_calls_run_on_the_communicators_device(be):
    """Every collective (data plane, vote, scalar) runs with the communicator's device current and takes that
    device's current stream, whatever the caller's current device."""
    b, cp = be
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        b.allreduce_sum([cp.zeros(3, cp.float32)])
        b.broadcast([(0, cp.zeros(3, cp.float32))])
        b.allreduce_scalar(cp.zeros((), cp.float64))
    assert len(b.comm.calls) == 3
    for call in b.comm.calls:
        assert call[5] and call[5][-1] == 0, call  # inside `with Device(comm.device_id())`
        assert call[4] == s.ptr, call

"""``distributed.global_norm``'s local sum (``core.norms.sumsq64``): one documented order on NumPy and CuPy (each
buffer in ``core.sqsum.sq_sum``'s blocked order over float64(x)², the buffers in order), the same bits on both, and
on CuPy a bounded number of launches (issue #26, M3: 3 per 64K chunk before, 768 for a 16M shard)."""

from __future__ import annotations

import numpy as np
import pytest

from flatopt.core import backend, norms, sqsum
from flatopt.distributed import NcclBackend, global_norm
from flatopt.distributed.comm import NCCL_TYPES
from tests.cuda_emu import emu, fakecupy

SIZES = [0, 1, 5, 4095, 4096, 4097, 65536 + 3, 300_001]


def _reference(b: np.ndarray) -> np.float64:
    """``sqsum.sq_sum`` over the float64 squares (the documented order, its own implementation)."""
    n = b.size
    buf = sqsum.sq_scratch(np, n, np.float64)
    np.multiply(b.astype(np.float64), b.astype(np.float64), out=buf[:n])
    return np.float64(sqsum.sq_sum(np, buf, n)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_sum_is_the_blocked_order(dtype):
    rng = np.random.default_rng(0)
    for n in SIZES[1:] + [(1 << 20) + 17]:
        b = (rng.standard_normal(n) * 3).astype(dtype)
        got = norms.sumsq64(np, [b])
        assert np.float64(got).tobytes() == _reference(b).tobytes(), n
    bufs = [rng.standard_normal(n).astype(dtype) for n in SIZES]
    total = np.float64(0.0)
    for b in bufs:
        total = total + (_reference(b) if b.size else np.float64(0.0))
    assert np.float64(norms.sumsq64(np, bufs)).tobytes() == total.tobytes()


class _OneRank(NcclBackend):
    """A one-rank NCCL backend without NCCL: the all-reduce of one rank is the identity."""

    def __init__(self):  # noqa: D107 - no communicator
        self.cp, self.rank, self.world, self.control = backend.cupy(), 0, 1, None
        self.device, self._types = 0, dict.fromkeys(NCCL_TYPES)  # what check_arrays reads

    def allreduce_sum(self, buffers):
        pass

    def allreduce_scalar(self, x):
        return x


@pytest.fixture(scope="module")
def emulated():
    with fakecupy.installed() as cp:
        yield cp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_gives_the_numpy_bits(dtype, emulated):
    cp = emulated
    rng = np.random.default_rng(1)
    host = [(rng.standard_normal(n) * 2).astype(dtype) for n in SIZES]
    for b in host:
        got = backend.to_numpy(norms.sumsq64(cp, [cp.asarray(b)]))
        assert got.tobytes() == np.float64(norms.sumsq64(np, [b])).tobytes(), b.size
    got = backend.to_numpy(global_norm([cp.asarray(b) for b in host], _OneRank()))
    assert got.tobytes() == np.sqrt(norms.sumsq64(np, host)).tobytes()
    assert backend.to_numpy(global_norm([], _OneRank(), allow_empty=True, like=cp.zeros(1))) == 0.0


def test_a_16m_shard_takes_three_launches(emulated, monkeypatch):
    """Counted on the stand-in with no-op kernels: the local sum, its fold and the root; no host synchronisation."""
    cp = emulated

    def call(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        assert len(args) == len(self.params), self.expr
        emu.stats.launches += 1

    monkeypatch.setattr(emu.Kernel, "__call__", call)
    shard = cp.zeros(16 << 20, np.float32)
    global_norm([shard], _OneRank())  # compiled
    fakecupy.stats.reset()
    global_norm([shard], _OneRank())
    st = fakecupy.stats
    assert st.launches + st.ops <= 3, (st.launches, st.ops)
    assert st.syncs == 0

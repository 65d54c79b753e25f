"""Bits that do not depend on the BLAS: both sides of every bit-identity promise make the same BLAS calls under the
same BLAS thread count.

A GEMM's bits depend on the BLAS thread count on some CPUs (with OpenBLAS's Haswell kernels, for one, a 2-thread
sgemm differs in the last bits from a 1-thread one; with its SkylakeX kernels they happened to agree, which hid the
bug).  Comparing results can only catch that on such a CPU; these tests catch it on any machine
with two or more cores: they record every NumPy BLAS entry point flatopt calls (``np.matmul``, ``np.dot``) with the
operand shapes and the BLAS thread count at that moment, and require the same multiset of calls from the serial
``step`` loop, ``step_batch``, the workers and another Python thread.  CI also runs the bit-identity tests under
``OPENBLAS_NUM_THREADS=1`` (``.ci/run``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading

import numpy as np
import pytest

import flatopt
from flatopt.core import shards

from .helpers import assert_bits_equal, make_for, make_params, run_steps
from .registry import REGISTRY

pytest.importorskip("threadpoolctl")
pytestmark = pytest.mark.slow  # every mode of every registry entry, BLAS calls recorded; also .ci/bits
needs_cap = pytest.mark.skipif(not shards.can_cap(), reason="threadpoolctl cannot hold this BLAS at one thread")

APOLLO = dict(lr=0.01, relative_step=False, apollo_rank=8, apollo_update_proj_gap=2, min_8bit_size=0,
              block_size=128, m_block_size=32)
# besides the registry: configurations whose large tensors take the BLAS paths (APOLLO's projection), and Muon's modes
EXTRA = {
    "adafactor8bit_apollo": lambda **kw: flatopt.Adafactor8Bit(**{**APOLLO, **kw}),
    "adafactor8bit_apollo_fp32": lambda **kw: flatopt.Adafactor8Bit(**{**APOLLO, "quantize": False, **kw}),
    "muon_workers1": lambda **kw: flatopt.Muon(workers=1, **kw),
    "muon_workers2": lambda **kw: flatopt.Muon(workers=2, **kw),
}
BIG = [(300, 700), (700, 300), (512, 512)]  # above the BLAS and threading thresholds of every path


class BlasSpy:
    """Replaces ``np.matmul``/``np.dot`` while active; records (function, operand shapes, BLAS threads)."""

    def __init__(self, monkeypatch):
        self.calls = collections.Counter()
        self._lock = threading.Lock()
        for fn in ("matmul", "dot"):
            monkeypatch.setattr(np, fn, self._wrap(fn, getattr(np, fn)))

    def _wrap(self, fn, orig):
        def spy(*args, **kw):
            key = (fn, tuple(getattr(a, "shape", None) for a in args[:2]), tuple(shards.threads_now()))
            with self._lock:
                self.calls[key] += 1
            return orig(*args, **kw)
        return spy

    def take(self):
        out, self.calls = self.calls, collections.Counter()
        return out


def _make(name):
    if name in EXTRA:
        return EXTRA[name]()
    return REGISTRY[name].make()


def _params(name):
    spec = REGISTRY.get(name)
    return make_params((list(spec.shapes) if spec else []) + BIG, np.float32)


def _run(name, params, batch, in_thread=False):
    opt = make_for(REGISTRY[name], params) if name in REGISTRY and REGISTRY[name].make_for else _make(name)

    def go():
        run_steps(opt, params, 2, batch=batch)

    if in_thread:
        t = threading.Thread(target=go)
        t.start()
        t.join()
    else:
        go()


@needs_cap
@pytest.mark.parametrize("name", sorted(REGISTRY) + sorted(EXTRA))
def test_same_blas_calls_in_every_mode(name, monkeypatch):
    """The ``step`` loop, ``step_batch`` and ``step_batch`` from another thread (after the main thread has capped the
    BLAS once: threadpoolctl (3.8.0, installed here) ignores a cap set by any thread but the first) make the same BLAS calls under
    the same thread counts, and give the same bits."""
    spy = BlasSpy(monkeypatch)
    runs = {}
    for mode in ("serial", "batch", "thread"):
        params = _params(name)
        _run(name, params, batch=mode != "serial", in_thread=mode == "thread")
        runs[mode] = (spy.take(), params)
    for mode in ("batch", "thread"):
        assert runs[mode][0] == runs["serial"][0], f"{mode}: other BLAS calls or thread counts than the serial loop"
        for n in runs["serial"][1]:
            assert_bits_equal(runs[mode][1][n][1], runs["serial"][1][n][1], f"{mode} {n}")


@needs_cap
@pytest.mark.parametrize("name", ["muon", "muon_workers1", "muon_workers2", "muon_adamw", "adafactor8bit_apollo",
                                  "adafactor8bit_apollo_fp32", "adafactor"])
def test_blas_held_at_one_thread(name, monkeypatch):
    """Muon's Newton–Schulz, APOLLO's projection and Adafactor's GEMV sums run every BLAS call at one BLAS thread,
    whatever the mode, so their bits do not depend on the BLAS thread count or the CPU's kernels."""
    spy = BlasSpy(monkeypatch)
    for batch in (False, True):
        _run(name, _params(name), batch=batch)
    calls = spy.take()
    assert calls, "no BLAS call recorded"
    assert {threads for (_, _, threads) in calls} == {(1,) * len(shards.threads_now())}


# the BLAS-bound optimizers (reliability audit D4): each must give its solo bits beside any other in another thread
BESIDE = ["kron_psgd", "soap", "stiefel", "muon", "adafactor", "adafactor8bit"]
BESIDE_SHAPES = [(384, 384), (96, 160)]  # the first above Adafactor's GEMV threshold (factored_passes.BLAS_MIN)


def _steps_in_threads(names):
    """Step a fresh optimizer of each of ``names`` (3 ``step_batch`` calls) in its own thread, all started together;
    the parameters per name."""
    params = {n: make_params(BESIDE_SHAPES, np.float32) for n in names}
    opts = {n: REGISTRY[n].make() for n in names}
    start = threading.Barrier(len(names))

    def go(n):
        start.wait()
        run_steps(opts[n], params[n], 3, batch=True)

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        for f in [pool.submit(go, n) for n in names]:
            f.result()
    return params


@needs_cap
def test_blas_bound_steps_beside_each_other(monkeypatch):
    """reliability audit D4: every BLAS-bound optimizer (Kron, Soap, Stiefel, Muon, Adafactor, Adafactor8Bit) runs
    its BLAS held at one thread in every mode, so its bits are its solo run's while another thread steps any of the
    others (Adafactor, Adafactor8Bit and Muon hold the process-wide cap; Kron, Soap and Stiefel ran on whatever the
    BLAS had then), and do not depend on the BLAS thread count.  Each pair twice; every recorded BLAS call at one
    thread (the cause, on any machine with two or more BLAS threads), and the bits equal (the effect)."""
    spy = BlasSpy(monkeypatch)
    solo = {n: _steps_in_threads([n])[n] for n in BESIDE}
    calls = spy.take()
    assert calls
    one = (1,) * len(shards.threads_now())
    off = sorted({(fn, shapes, threads) for (fn, shapes, threads) in calls if threads != one})
    assert not off, f"BLAS calls of a solo step not held at one thread: {off[:4]}"
    for _ in range(2):
        for i, a in enumerate(BESIDE):
            for b in BESIDE[i + 1:]:
                got = _steps_in_threads([a, b])
                for n in (a, b):
                    for k in solo[n]:
                        assert_bits_equal(got[n][k][1], solo[n][k][1], f"{n} beside {b if n == a else a}: {k}")
    assert {threads for (_, _, threads) in spy.take()} == {one}


@needs_cap
def test_cap_from_another_thread_is_taken():
    """threadpoolctl (3.8.0, installed here) silently ignores a pthreads OpenBLAS limit set by any Python thread other than the first
    that set one; flatopt's cap must hold from whichever thread steps."""
    before = shards.threads_now()
    with shards.blas_capped() as capped:  # the main thread caps first
        assert capped and shards.threads_now() == [1] * len(before)
    assert shards.threads_now() == before
    seen = []

    def other():
        with shards.blas_capped() as capped:
            seen.append((capped, shards.threads_now()))
        seen.append(shards.threads_now())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [(True, [1] * len(before)), before]


def test_no_cap_means_serial_muon(monkeypatch):
    """Without a way to hold the BLAS (no threadpoolctl), Muon's workers are not used: every mode runs the same
    serial calls on the BLAS's own threads."""
    monkeypatch.setattr(shards, "_blas", [])
    used = []
    monkeypatch.setattr(shards, "run", lambda *a, **k: used.append(1))
    params = make_params(BIG * 2, np.float32)
    run_steps(flatopt.Muon(workers=2), params, 1, batch=True)
    assert used == []
    ref = make_params(BIG * 2, np.float32)
    run_steps(flatopt.Muon(workers=1), ref, 1, batch=False)
    for n in params:
        assert_bits_equal(params[n][1], ref[n][1], n)


@needs_cap
def test_muon_matrix_stepped_alone_uses_the_threads(monkeypatch):
    """One matrix stepped alone runs its row-blocked products (``flatopt.muon._row_blocks``) on the pool's threads,
    with the BLAS at one thread; the workers of a batch run the same blocks one after another: equal bits."""
    from flatopt.core import parallel

    if parallel.num_threads() < 2:
        pytest.skip("one thread")
    seen = set()
    orig = np.matmul

    def where(*a, **k):
        seen.add(threading.current_thread().name)
        return orig(*a, **k)

    monkeypatch.setattr(np, "matmul", where)
    alone = make_params([(1024, 512), (512, 384), (384, 1024)], np.float32)
    run_steps(flatopt.Muon(workers=1), alone, 2, batch=False)
    assert len(seen) >= 2, seen
    batch = make_params([(1024, 512), (512, 384), (384, 1024)], np.float32)
    run_steps(flatopt.Muon(workers=2), batch, 2, batch=True)
    for n in alone:
        assert_bits_equal(alone[n][1], batch[n][1], n)


def test_nested_run_tasks_in_a_pool_worker_runs_inline(monkeypatch):
    """A task that runs ``run_tasks`` again from a pool thread runs those tasks inline: submitting to the pool it
    occupies and waiting could deadlock it."""
    from flatopt.core import parallel

    monkeypatch.setenv("FLATOPT_NUM_THREADS", "2")
    done = []

    def inner(i):
        parallel.run_tasks([(parallel.PARALLEL_MIN_COST, f"in{i}{j}", lambda: done.append(1)) for j in range(4)])

    tasks = [(parallel.PARALLEL_MIN_COST, f"out{i}", lambda i=i: inner(i)) for i in range(4)]
    t = threading.Thread(target=parallel.run_tasks, args=(tasks,), daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "nested run_tasks deadlocked"
    assert len(done) == 16

"""The NumPy paths of the per-tensor algorithms (flatopt/core/cpu_tensors.py, norms.py; Lamb and Mars): the blocked
sums of squares from column sums and per row equal ``sqsum.sq_sum``; a large tensor's phases on 1, 2 or 3 threads
and buckets of small tensors of one size (rows of (T, n) arenas) give the bits of the array-agnostic twin stepping
each tensor alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.core import blocks, cpu_tensors, driver, norms, parallel, sqsum

from .helpers import assert_bits_equal, rng_arrays


class _Twin:
    """NumPy under another name: ``update`` takes its array-agnostic path (the twin the CUDA kernels reproduce)."""

    def __getattr__(self, name):
        return getattr(np, name)


TWIN = _Twin()
SIZES = [1, 64, 64, 64, 64, 300, 300, 4097, 4097, 8192, 8192, 70_000, 200_003]
ALGOS = {
    "lamb": (flatopt.Lamb, dict(lr=1e-2, weight_decay=1e-2)),
    "lamb_nowd": (flatopt.Lamb, dict(lr=1e-2, weight_decay=0.0)),
    "mars": (flatopt.Mars, dict(lr=1e-2, weight_decay=1e-2)),
    "mars_bigc": (flatopt.Mars, dict(lr=1e-2, gamma=3.0)),  # ‖c‖ > 1: the clip divides
    "mars_noclip": (flatopt.Mars, dict(lr=1e-2, clip_c=False)),
}


def _grad(i, it, n, dtype):
    g = rng_arrays(1000 + 37 * it + i, (n,), dtype, scale=3.0 if it % 2 else 0.1)
    if i == 1:
        g[:] = 0  # a zero gradient (Lamb: ψ from the decay alone; Mars: c = 0)
    return g


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_column_and_row_sums_are_sq_sum(dtype):
    rng = np.random.default_rng(3)
    for n in (1, 17, 256, 257, 4095, 4096, 4097, 8192, 9000, 5 * 4096 + 77, 257 * 4096 + 3):
        root = rng.standard_normal(n).astype(dtype)
        x = root * root  # the terms
        buf = sqsum.sq_scratch(np, n, dtype)
        buf[:n] = x
        want = sqsum.sq_sum(np, buf, n)[0].tobytes()
        lay = norms.columns(n)
        a = np.zeros(lay.cols, dtype)
        for k in range(lay.full):  # rows in order, as a column-range task adds them
            a += x[k * lay.cols:(k + 1) * lay.cols]
        a[:lay.tail] += x[lay.full * lay.cols:]
        for chunk in (100, 1000, 1 << 16):  # the sweeps of column-range tasks (several rows to a piece, or parts of
            got = np.full(lay.cols, np.nan, dtype)  # rows): the squares of ``root`` added to the columns
            for _, c0, c1 in norms.column_ranges(lay, chunk):
                for start, rows, w, col, first in norms.blocks(lay, c0, c1, chunk):
                    norms.add_squares(got[col:col + w], root[start:start + rows * w], rows, first,
                                      np.empty(chunk + w, dtype))
            if lay.full == 0:
                got[lay.tail:] = 0
            assert got.tobytes() == (a if lay.full else np.where(np.arange(lay.cols) < lay.tail, a, 0)).tobytes()
        work = np.full(norms.fold_len(lay.nb), np.nan, dtype)  # the work area need not be clean
        assert norms.sq_fold(a, lay.nb, work)[0].tobytes() == want, n
        if n <= sqsum.SQ_ROWS * sqsum.SQ_THREADS * 2:
            rows = np.stack([(rng.standard_normal(n) ** 2).astype(dtype) for _ in range(3)] + [x])
            padded = np.zeros((4, sqsum.sq_layout(n)[2]), dtype)
            padded[:, :n] = rows
            got = norms.sq_rows(padded, n, np.full(norms.rows_len(4, n), np.nan, dtype))
            for i in range(4):
                buf[:n] = rows[i]
                assert got[i].tobytes() == sqsum.sq_sum(np, buf, n)[0].tobytes(), (n, i)


def _twin_run(cls, kw, dtype, steps):
    """Each tensor stepped alone by the twin: {name: param} after ``steps`` (lists of names per step)."""
    cfg = cls(**kw).config
    params = {f"w{i:02d}": rng_arrays(i, (n,), dtype) for i, n in enumerate(SIZES)}
    states = {k: cls.init_fn(np, cfg, p.shape, dtype) for k, p in params.items()}
    t = dict.fromkeys(params, 0)
    for it, names in enumerate(steps):
        for k in names:
            i = int(k[1:])
            t[k] += 1
            cls.update_fn(TWIN, cfg, states[k], params[k], _grad(i, it, params[k].size, dtype), t=t[k], lr=kw["lr"],
                          scratch=[])
    return params, states


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_phases_and_row_buckets_are_the_twin_on_any_thread_count(algo, dtype, monkeypatch):
    cls, kw = ALGOS[algo]
    names = [f"w{i:02d}" for i in range(len(SIZES))]
    steps = [names, names, names[::2], names[1:], names]
    want, want_states = _twin_run(cls, kw, dtype, steps)
    monkeypatch.setattr(parallel, "PARALLEL_MIN_COST", 0)
    # 1000: many column ranges and step ranges per large tensor; the default: several rows to a piece
    for threads, chunk in (("1", 1000), ("2", 1000), ("3", 1000), ("2", driver.CHUNK)):
        monkeypatch.setattr(driver, "CHUNK", chunk)
        monkeypatch.setenv("FLATOPT_NUM_THREADS", threads)
        opt = cls(**kw)
        params = {f"w{i:02d}": rng_arrays(i, (n,), dtype) for i, n in enumerate(SIZES)}
        for it, batch in enumerate(steps):
            items = [OptItem(k, params[k].shape, params[k], _grad(int(k[1:]), it, params[k].size, dtype))
                     for k in batch]
            # the largest tensor holds over a quarter of a whole batch (its phases on the threads), 70 000 under a
            # quarter (one task); at step 3 the largest alone, then the rest
            opt.step_batch(items if it != 3 else items[-1:])
            if it == 3:
                opt.step_batch(items[:-1])
        for k in names:
            assert_bits_equal(params[k], want[k], f"{algo} threads={threads} {k}")
            for f in ("m", "v", "g_prev"):
                if hasattr(want_states[k], f):
                    assert_bits_equal(getattr(opt._slots[k].state, f), getattr(want_states[k], f), f)  # noqa: SLF001
        plans = [p for p in opt.plan_cache.bucket_plans.values() if isinstance(p, cpu_tensors.RowsPlan)]
        assert {p.p.shape for p in plans} >= {(4, 64), (2, 4097), (2, 8192)}


@pytest.mark.parametrize("algo", ["lamb", "mars"])
def test_row_buckets_pack_the_state_and_are_reused(algo):
    cls, kw = ALGOS[algo]
    opt = cls(**kw)
    params = {f"w{i:02d}": rng_arrays(i, (64,), np.float32) for i in range(30)}
    items = [OptItem(k, p.shape, p, _grad(i, 0, 64, np.float32)) for i, (k, p) in enumerate(sorted(params.items()))]
    opt.step_batch(items)
    (plan,) = opt.plan_cache.bucket_plans.values()
    assert isinstance(plan, cpu_tensors.RowsPlan) and plan.p.shape == (30, 64)
    arena = opt._slots["w00"].state.m.base  # noqa: SLF001
    assert all(opt._slots[k].state.m.base is arena for k in params)  # noqa: SLF001
    # the scratch stays per slot, the persistent state is saved as it was
    assert all(f.name in ("m", "v", "g_prev") for f in dataclasses.fields(plan.state)
               if getattr(plan.state, f.name) is not None)
    opt.step_batch(items)
    assert next(iter(opt.plan_cache.bucket_plans.values())) is plan
    snap = opt.state_dict()
    assert snap.buffers["m/w03"].base is None and snap.buffers["m/w03"].shape == (64,)


def test_blocked_layout_and_blocked_sum_are_two_modules():
    """``core.blocks`` is the blocked layout and phase runner of the Adafactor family; the blocked sum of squares of
    Lamb, Mars and ``global_norm`` (the kernels' fixed order) is ``core.sqsum``, which knows nothing of blocks."""
    import importlib

    assert not [n for n in vars(blocks) if n.lower().startswith("sq_") or n == "_cdiv"]
    mod = importlib.import_module("flatopt.core.sqsum")
    assert mod is sqsum and {"sq_sum", "sq_scratch", "sq_layout", "sq_blocks", "cdiv"} <= set(vars(sqsum))
    assert "blocks" not in {getattr(v, "__name__", "").rsplit(".", 1)[-1] for v in vars(sqsum).values()}

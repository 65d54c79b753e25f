"""The NumPy execution paths of the driver (flatopt/core/cpu_plan.py, cpu_tensors.py): chunked large items, bucketed
small items and the phases of the per-tensor algorithms (Lamb, Mars) give the bits of the plain serial loop, survive
resets, checkpoints and changing batch compositions, and allocate nothing per step once a batch composition has been
seen."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.core import cpu_plan, driver

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

MAKERS = {
    "adamw": lambda **kw: flatopt.AdamW(lr=1e-2, **kw),
    "adamw_amsgrad": lambda **kw: flatopt.AdamW(lr=1e-2, amsgrad=True, **kw),
    "sgd_dampened": lambda **kw: flatopt.SGD(lr=1e-2, momentum=0.9, dampening=0.2, weight_decay=1e-3, **kw),
    "sgd_nesterov": lambda **kw: flatopt.SGD(lr=1e-2, momentum=0.9, nesterov=True, **kw),
    # per-tensor norms: small items bucketed as rows, large ones in phases (core/cpu_tensors.py)
    "lamb": lambda **kw: flatopt.Lamb(lr=1e-2, **kw),
    "mars": lambda **kw: flatopt.Mars(lr=1e-2, weight_decay=1e-2, **kw),
    "mars_noclip": lambda **kw: flatopt.Mars(lr=1e-2, clip_c=False, **kw),
}


def _params(sizes, dtype=np.float32, seed=0):
    return {f"w{i}": rng_arrays(seed + i, (n,), dtype) for i, n in enumerate(sizes)}


def _grads(params, it):
    return {k: rng_arrays(1000 + 31 * it + i, p.shape, p.dtype) for i, (k, p) in enumerate(sorted(params.items()))}


def _serial(opt, params, grads, names):
    for k in names:
        opt.step(k, params[k].shape, params[k], grads[k])


def _batch(opt, params, grads, names):
    opt.step_batch([OptItem(k, params[k].shape, params[k], grads[k]) for k in names])


@pytest.mark.parametrize("algo", sorted(MAKERS))
def test_buckets_equal_the_serial_loop_through_changing_batches(algo):
    """Small items bucketed, with steps counts and lr scales that differ by name, batches whose composition
    changes (new names, missing names, a name stepped alone), a reset, float64 items and a large item."""
    sizes = [64] * 40 + [1, 3, 500, 7000, 9000, 70_000]
    scale = {"w3": 0.5, "w4": 0.5, "w5": 2.0}
    a, b = _params(sizes), _params(sizes)
    a.update(_params([50, 60], np.float64, seed=77)), b.update(_params([50, 60], np.float64, seed=77))
    a = {k.replace("w", "d") if v.dtype == np.float64 else k: v for k, v in a.items()}
    b = {k.replace("w", "d") if v.dtype == np.float64 else k: v for k, v in b.items()}
    opt_a, opt_b = MAKERS[algo](lr_scale=scale), MAKERS[algo](lr_scale=scale)
    names = sorted(a)
    schedule = [names, names, names[::2], names, [names[5]], names[3:], names, names[::-1], names]
    for it, batch in enumerate(schedule):
        grads = _grads(a, it)
        _serial(opt_a, a, grads, batch)
        _batch(opt_b, b, grads, batch)
        if it == 4:
            opt_a.reset("w7"), opt_b.reset("w7")
        for k in names:
            assert_bits_equal(a[k], b[k], f"step {it} {k}")
        assert_states_equal(opt_a.state_dict(), opt_b.state_dict())
    assert opt_a.state_nbytes() == opt_b.state_nbytes()


@pytest.mark.parametrize("algo", sorted(MAKERS))
def test_chunked_equals_unchunked(algo, monkeypatch):
    sizes = [100_000, 33_000, 64, 64, 5000]
    a, b = _params(sizes), _params(sizes)
    opt_a, opt_b = MAKERS[algo](), MAKERS[algo]()
    for it in range(3):
        grads = _grads(a, it)
        monkeypatch.setattr(driver, "CHUNK", 1 << 30)  # one chunk per item
        _batch(opt_a, a, grads, sorted(a))
        monkeypatch.setattr(driver, "CHUNK", 1000)  # many chunks, a short last one
        _batch(opt_b, b, grads, sorted(b))
    for k in a:
        assert_bits_equal(a[k], b[k], k)
    assert_states_equal(opt_a.state_dict(), opt_b.state_dict())


def test_save_load_continue_through_buckets():
    sizes = [64] * 30 + [200_000]
    a, b = _params(sizes), _params(sizes)
    opt_a = flatopt.AdamW(lr=1e-2)
    for it in range(4):
        _batch(opt_a, a, _grads(a, it), sorted(a))
    opt_b = flatopt.AdamW(lr=1e-2)
    for it in range(2):
        _batch(opt_b, b, _grads(b, it), sorted(b))
    snap = opt_b.state_dict()
    opt_c = flatopt.AdamW(lr=1e-2)
    assert opt_c.load_state_dict(snap)
    for it in range(2, 4):
        _batch(opt_c, b, _grads(b, it), sorted(b))
    for k in a:
        assert_bits_equal(a[k], b[k], k)
    assert_states_equal(opt_a.state_dict(), opt_c.state_dict())
    # the snapshot is a copy: stepping on did not change it
    assert snap.params["w0"]["t"] == 2


def test_bucket_error_names_the_bucket(monkeypatch):
    opt = flatopt.AdamW()
    params = _params([64] * 5)
    _batch(opt, params, _grads(params, 0), sorted(params))
    real = type(opt).update_fn

    def failing(xp, cfg, st, p, g, **kw):
        raise FloatingPointError("boom")

    monkeypatch.setattr(type(opt), "update_fn", staticmethod(failing))
    with pytest.raises(flatopt.TaskError, match="w0 .. w4.*boom"):
        _batch(opt, params, _grads(params, 1), sorted(params))
    monkeypatch.setattr(type(opt), "update_fn", staticmethod(real))


@pytest.mark.parametrize("algo", ["adamw", "sgd_nesterov"])
def test_no_allocation_for_a_batch_of_small_tensors(algo):
    opt = MAKERS[algo]()
    params = _params([64] * 300 + [3000] * 20)
    grads = _grads(params, 0)
    items = [OptItem(k, p.shape, p, grads[k]) for k, p in sorted(params.items())]
    for _ in range(3):
        opt.step_batch(items)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(5):
            opt.step_batch(items)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(p.nbytes for p in params.values())
    assert peak - base < 0.25 * total, (peak - base, total)  # bookkeeping (task lists), no packed copies
    assert current - base < 16 * 1024


def test_small_items_share_one_bucket_and_plans_are_reused():
    opt = flatopt.AdamW()
    params = _params([64] * 50)
    items = [OptItem(k, p.shape, p, _grads(params, 0)[k]) for k, p in sorted(params.items())]
    opt.step_batch(items)
    plans = dict(opt.plan_cache.bucket_plans)
    assert len(plans) == 1
    plan = next(iter(plans.values()))
    assert plan.size == 50 * 64
    arena = opt._slots["w0"].state.m.base  # noqa: SLF001
    assert all(opt._slots[k].state.m.base is arena for k in params)  # noqa: SLF001
    opt.step_batch(items)
    assert next(iter(opt.plan_cache.bucket_plans.values())) is plan
    assert cpu_plan.SMALL >= 64


def test_tasks_are_named_records():
    """The planner's records are named (``cpu_plan.Entry`` in, ``cpu_plan.Task`` with its ``Refill`` out), not
    positional 7- and 4-tuples: a kept plan's tasks say by name where they find their arrays in a later step."""
    opt = flatopt.AdamW(lr=1e-3)
    rng = np.random.default_rng(0)
    sizes = [40, 40, cpu_plan.RANGE + driver.CHUNK]  # AdamW's update takes ranges (Hooks.ranges): RANGE, the rest
    items = [OptItem(f"p{i}", (n,), rng.standard_normal(n).astype(np.float32),
                     rng.standard_normal(n).astype(np.float32)) for i, n in enumerate(sizes)]
    opt.step_batch(items)
    slots = opt._slots  # noqa: SLF001 - the driver's slots, as the planner receives them
    entries = [cpu_plan.Entry(i, it.name, it.param, it.grad, slots[it.name], 1e-3, 1.0) for i, it in enumerate(items)]
    made = cpu_plan._make(opt, entries, driver.CHUNK)  # noqa: SLF001
    assert made and all(type(t) is cpu_plan.Task and type(t.refill) is cpu_plan.Refill for t in made)
    assert [t.refill.index for t in made] == [2, 2, [0, 1]]  # the large item in two tasks, a bucket
    assert made[2].name == "p0 .. p1 (a bucket of 2 small parameters)"
    assert made[0].cost + made[1].cost == sizes[2] and made[2].refill.slot is slots["p0"]


def test_chunk_scratch_is_the_workspace():
    """One scratch mechanism: the chunk-sized scratch of the elementwise updates is this thread's
    ``core.workspace`` buffers (one key each), not a second per-thread cache."""
    from flatopt.core import workspace

    bufs = cpu_plan.scratch(np.dtype(np.float32), 3, driver.CHUNK)
    assert len(bufs) == 3 and all(b.size == driver.CHUNK for b in bufs)
    assert not any(np.shares_memory(a, b) for i, a in enumerate(bufs) for b in bufs[i + 1:])
    for i, b in enumerate(bufs):
        assert np.shares_memory(b, workspace.get(np, f"cpu_plan.chunk{i}", driver.CHUNK, np.float32))


def test_a_generated_update_takes_one_call_per_range(monkeypatch):
    """A generated algorithm's large item (``Hooks.ranges``) reaches its compiled pass once per task of ``RANGE``
    elements, not once per chunk."""
    from flatopt.core import native

    if not native.status()[0]:
        pytest.skip(f"no compiled passes: {native.status()[1]}")
    seen = []
    gen_step = native.gen_step
    monkeypatch.setattr(native, "gen_step", lambda name, fs, arrays, packed: (
        seen.append(arrays[0].size), gen_step(name, fs, arrays, packed))[1])
    monkeypatch.setattr(cpu_plan, "RANGE", 3 * driver.CHUNK)
    n = 7 * driver.CHUNK + 5
    for opt in (flatopt.AdamW(lr=1e-2), flatopt.Sophia(lr=1e-2)):
        assert opt.hooks.ranges
        p, g = _params([n])["w0"], _grads({"w0": np.zeros(n, np.float32)}, 0)["w0"]
        seen.clear()
        opt.step_batch([OptItem("w0", (n,), p, g)])
        assert sorted(seen) == sorted([3 * driver.CHUNK, 3 * driver.CHUNK, driver.CHUNK + 5]), seen


@pytest.mark.parametrize("algo", ["adamw_amsgrad", "sgd_dampened"])
def test_the_numpy_path_cuts_a_range_into_chunks(algo, monkeypatch):
    """Without the compiled pass, an update given a range longer than its scratch (``Hooks.ranges``) runs the
    NumPy path in pieces of the scratch's length (a short last one): the bits of one pass over the whole range."""
    from flatopt.core import native

    monkeypatch.setattr(native, "gen_step", lambda *a: False)  # the NumPy path
    n, k = 2500, 1000
    opt = MAKERS[algo]()
    assert opt.hooks.ranges
    p = {w: _params([n])["w0"] for w in "ab"}
    st = {w: opt.hooks.init(w, np, (n,), np.dtype(np.float32)) for w in "ab"}
    for t in (1, 2, 3):
        g = _grads({"w0": p["a"]}, t)["w0"]
        for w, size in (("a", n), ("b", k)):
            scratch = [np.full(size, np.nan, np.float32) for _ in range(opt.scratch_buffers)]
            opt.hooks.update(np, st[w], p[w], g, t=t, lr=1e-2, scratch=scratch)
        assert_bits_equal(p["a"], p["b"], f"step {t}")
        for f in ("m", "v", "vmax", "buf"):
            if getattr(st["a"], f, None) is not None:
                assert_bits_equal(getattr(st["a"], f), getattr(st["b"], f), f)

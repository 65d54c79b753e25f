"""Concurrency under stress: step_batch ≡ serial over many mixed items; optimizers in two threads do not interfere."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import flatopt

from .helpers import assert_bits_equal, assert_states_equal, make_for, run_steps
from .registry import REGISTRY

pytestmark = pytest.mark.slow  # stress: many items, several threads

NAMES = sorted(REGISTRY)


def _mixed_params(spec, count, seed=0, large_every=50):
    """Mostly the spec's small shapes, every ``large_every``-th item a large matrix (split over threads)."""
    rng = np.random.default_rng(seed)
    shapes = list(spec.shapes)
    large = [(400, 350), (350, 400)]
    params = {}
    for i in range(count):
        s = shapes[rng.integers(0, len(shapes))] if i % large_every else large[(i // large_every) % 2]
        params[f"t{i:05d}"] = (tuple(s), rng.standard_normal(int(np.prod(s))).astype(np.float32))
    return params


def test_thousands_of_items_adamw():
    a = _mixed_params(REGISTRY["adamw"], 2000, large_every=400)
    b = {n: (s, p.copy()) for n, (s, p) in a.items()}
    oa, ob = flatopt.AdamW(), flatopt.AdamW()
    run_steps(oa, a, 4, batch=False)
    run_steps(ob, b, 4, batch=True)
    for n in a:
        assert_bits_equal(a[n][1], b[n][1], n)
    assert_states_equal(oa.state_dict(), ob.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_many_mixed_items(name):
    spec = REGISTRY[name]
    a = _mixed_params(spec, 60, seed=1, large_every=30)
    b = {n: (s, p.copy()) for n, (s, p) in a.items()}
    oa, ob = make_for(spec, a), make_for(spec, b)
    run_steps(oa, a, 3, batch=False)
    run_steps(ob, b, 3, batch=True)
    for n in a:
        assert_bits_equal(a[n][1], b[n][1], n)


@pytest.mark.parametrize("name", NAMES)
def test_two_optimizers_in_two_threads(name):
    spec = REGISTRY[name]
    base = _mixed_params(spec, 20, seed=2, large_every=10)
    alone = {n: (s, p.copy()) for n, (s, p) in base.items()}
    run_steps(make_for(spec, alone), alone, 3, batch=True)
    worlds = [{n: (s, p.copy()) for n, (s, p) in base.items()} for _ in range(2)]
    errors = []

    def work(params):
        try:
            run_steps(make_for(spec, params), params, 3, batch=True)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for w in worlds:
        for n in base:
            assert_bits_equal(w[n][1], alone[n][1], n)


def test_one_optimizer_shared_by_two_threads_is_serialised():
    """Two threads stepping one optimizer (different names) give the same result as doing it in turn."""
    spec = REGISTRY["adamw"]
    base = _mixed_params(spec, 40, seed=3)
    names = sorted(base)
    halves = [names[::2], names[1::2]]
    ref = {n: (s, p.copy()) for n, (s, p) in base.items()}
    opt_ref = spec.make()
    for h in halves:
        run_steps(opt_ref, {n: ref[n] for n in h}, 3, batch=True)
    shared = {n: (s, p.copy()) for n, (s, p) in base.items()}
    opt = spec.make()
    threads = [threading.Thread(target=run_steps, args=(opt, {n: shared[n] for n in h}, 3), kwargs={"batch": True}) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in names:
        assert_bits_equal(shared[n][1], ref[n][1], n)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_run_beside_tasks_runs_every_task_once_and_reraises(threads, monkeypatch):
    """``core.parallel.run_beside_tasks``: ``here`` on the caller, every task exactly once (workers start on them at
    once and the caller joins after ``here``; with one thread: the tasks in order, then ``here``); an error is
    re-raised once every thread stopped — an error in ``here`` after all the tasks ran."""
    from flatopt.core import parallel

    monkeypatch.setenv("FLATOPT_NUM_THREADS", threads)
    lock, seen = threading.Lock(), []

    def task(i):
        with lock:
            seen.append(i)

    here_on_main = []
    tasks = [lambda i=i: task(i) for i in range(50)]
    parallel.run_beside_tasks(lambda: here_on_main.append(threading.current_thread() is threading.main_thread()),
                               tasks)
    assert here_on_main == [True] and sorted(seen) == list(range(50))
    if threads == "1":
        assert seen == list(range(50))

    def bad():
        raise ValueError("boom")

    seen.clear()
    here_ran = []
    with pytest.raises(ValueError, match="boom"):
        parallel.run_beside_tasks(lambda: here_ran.append(1), tasks[:10] + [bad] + tasks[10:])
    assert set(range(10)) <= set(seen)  # (tasks after a failed one may not run: the step fails anyway)
    assert here_ran == [1], "``here`` runs although a task failed"
    seen.clear()
    with pytest.raises(ValueError, match="boom"):
        parallel.run_beside_tasks(bad, tasks)
    assert sorted(seen) == list(range(50))


def test_thread_pools_live_in_core_parallel_and_core_shards():
    """One thread-pool module: every pool is created in ``core.parallel`` (the task pool, the group pool) or
    ``core.shards`` (the stable shard workers), each listed with its reason in ``core.parallel``'s docstring."""
    import pathlib
    import re

    from flatopt.core import parallel

    root = pathlib.Path(flatopt.__file__).parent
    makers = re.compile(r"\b(ThreadPoolExecutor|ProcessPoolExecutor|threading\.Thread|multiprocessing\.Pool)\(")
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if makers.search(p.read_text()))
    assert found == ["core/parallel.py", "core/shards.py"], found
    doc = parallel.__doc__
    assert "task pool" in doc and "group pool" in doc and "core.shards" in doc
    assert parallel.group_pool() is parallel.group_pool()

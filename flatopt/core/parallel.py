"""Thread-pool execution of independent tasks: a fixed set of workers claims them in order.

The thread pools of flatopt, each for a reason the others cannot serve:

* the **task pool** (here, ``run_tasks``/``run_beside_tasks``, threads ``flatopt_*``): ``num_threads() - 1`` workers
  beside the caller claim a step's tasks in order; a task running on it never submits to it again (``in_worker``:
  nested work runs inline), so it cannot deadlock;
* the **group pool** (here, ``group_pool()``, threads ``flatopt-group_*``): ``flatopt.routing.Router`` steps its
  groups concurrently on it, and each group's optimizer uses the task pool inside; on the task pool itself a group
  would run its tasks inline (``in_worker``) or, waiting for workers that wait for it, deadlock;
* the **shard workers** (``core.shards``, one single-thread executor per worker ``flatopt-shard<k>``): Muon's
  matrices keep the same OS thread on every call (a stable assignment, with the BLAS capped at one thread while
  they run), which a claim-in-order pool cannot promise.

No other module creates threads.

A *task* is a callable with a cost (about its number of elements).  Work too small to pay for threads runs on the
calling thread; otherwise ``num_threads()`` workers (the caller and a persistent pool) claim the tasks in order, one
at a time, so callers should cut large work into tasks of a few hundred thousand elements.  Tasks must be
independent (disjoint params and state), so any assignment to threads gives the same bits as the serial loop.

``FLATOPT_NUM_THREADS`` sets the number of threads (default: the number of CPUs this process may use).
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

# Below this many elements in all, threads cost more than they save (``python -m benchmarks.run`` workload (c)).
PARALLEL_MIN_COST = 1 << 18

_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()
_groups: ThreadPoolExecutor | None = None
# Groups of a Router stepped at once at most (each group's own work is spread over the task pool).
GROUP_WORKERS = 16


def num_threads() -> int:
    env = os.environ.get("FLATOPT_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:  # FLATOPT_NUM_THREADS grew: retire the old pool's threads once idle
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flatopt", initializer=_mark_worker)
            _pool_workers = workers
        return _pool


def group_pool() -> ThreadPoolExecutor:
    """The pool ``flatopt.routing.Router`` steps its groups on (see the module doc: not the task pool)."""
    global _groups
    with _pool_lock:
        if _groups is None:
            _groups = ThreadPoolExecutor(max_workers=GROUP_WORKERS, thread_name_prefix="flatopt-group")
        return _groups


_local = threading.local()


def _mark_worker() -> None:
    _local.worker = True


def in_worker() -> bool:
    """True on a thread of the pool: a task that runs ``run_tasks`` again runs those tasks inline (submitting to
    the pool it occupies and waiting could deadlock it)."""
    return getattr(_local, "worker", False)


class TaskError(RuntimeError):
    """A task failed inside a worker; the message names the parameter."""


def run_tasks(tasks: Sequence[tuple[int, str, Callable[[], None]]], *, wrap: Callable | None = None,
              serial: bool = False) -> None:
    """Run ``(cost, name, fn)`` tasks, in parallel when large enough.  ``wrap(group_fn)`` may set up a context
    (e.g. a CUDA stream) around each group; it must return a callable that runs the group."""
    if not tasks:
        return
    threads = num_threads()
    total = sum(c for c, _, _ in tasks)

    def run_group(lo: int, hi: int) -> None:
        for _, name, fn in tasks[lo:hi]:
            try:
                fn()
            except Exception as exc:
                raise TaskError(f"parameter {name!r}: {type(exc).__name__}: {exc}") from exc

    if serial or threads == 1 or total < PARALLEL_MIN_COST or len(tasks) == 1 or in_worker():
        groups = [lambda: run_group(0, len(tasks))]
    else:
        # Workers claim the tasks in order from a shared counter (``next`` on ``itertools.count`` is atomic under
        # the GIL): on a shared machine a descheduled worker does not hold up a pre-assigned half of the work.
        # The tasks are independent, so every assignment gives the bits of the serial loop.
        claim = itertools.count().__next__
        n = len(tasks)

        def run_claimed() -> None:
            i = claim()
            while i < n:
                run_group(i, i + 1)
                i = claim()

        groups = [run_claimed] * min(threads, n)
    if wrap is not None:
        groups = [wrap(g) for g in groups]
    if len(groups) == 1:
        groups[0]()
        return
    run_jobs(groups, _get_pool(threads - 1))


def run_beside_tasks(here: Callable[[], None], tasks: Sequence[Callable[[], None]], *,
                     serial: bool = False) -> None:
    """The pool's workers claim ``tasks`` (independent callables) in order while the calling thread runs ``here``,
    then the caller claims what is left; wait for all, then re-raise the first error (a thread stops claiming at
    its first error; an error in ``here`` still lets the caller claim).  With one thread or ``serial``: the tasks
    in order, then ``here`` (also after a failed task).  ``here`` keeps the caller's per-thread scratch; a task
    must not use any that the caller reads afterwards."""
    threads = num_threads()
    if serial or threads == 1 or not tasks:
        first = None
        for job in (lambda: [task() for task in tasks], here):
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after ``here`` ran
                first = first or exc
        if first is not None:
            raise first
        return
    claim = itertools.count().__next__

    def claimed() -> None:
        i = claim()
        while i < len(tasks):
            tasks[i]()
            i = claim()

    def here_then_claimed() -> None:
        try:
            here()
        finally:
            claimed()

    run_jobs([here_then_claimed] + [claimed] * min(threads - 1, len(tasks)), _get_pool(threads - 1))


def run_jobs(jobs: Sequence[Callable[[], None]], pool: ThreadPoolExecutor) -> None:
    """Run ``jobs[0]`` on the calling thread and the others on ``pool``; wait for all of them, then re-raise the
    first error (so no job is still running when the caller sees it)."""
    futures = [pool.submit(j) for j in jobs[1:]]
    first_error = None
    try:
        jobs[0]()
    except BaseException as exc:  # noqa: BLE001 - re-raised below after the workers finished
        first_error = exc
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001
            first_error = first_error or exc
    if first_error is not None:
        raise first_error

"""A fixed set of persistent worker threads with a stable task → worker assignment.

Used where per-item work is large and must land on the same thread every call (Muon's matrices in
``Muon(workers=K)`` / ``MuonAdamW``): worker ``k`` is always the same OS thread (a one-thread executor), so a
matrix keeps its thread for the whole run.  Results never depend on the assignment (items are independent), only
the wall-clock time does.  Workers run leaf work only (they never submit to another pool), so nesting cannot
deadlock.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

_workers: list[ThreadPoolExecutor] = []
_lock = threading.Lock()


def _worker(k: int) -> ThreadPoolExecutor:
    with _lock:
        while len(_workers) <= k:
            _workers.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flatopt-shard{len(_workers)}"))
        return _workers[k]


def assign(costs: Sequence[tuple[str, int]], k: int) -> dict[str, int]:
    """Balance ``(name, cost)`` over ``k`` workers: largest first (ties in list order) onto the least loaded."""
    load = [0] * max(k, 1)
    out = {}
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i][1], i)):
        w = min(range(len(load)), key=lambda j: (load[j], j))
        out[costs[i][0]] = w
        load[w] += costs[i][1]
    return out


_blas = None  # threadpoolctl controller (optional); False when unavailable


def _blas_controller():
    global _blas
    if _blas is None:
        try:
            import threadpoolctl  # noqa: PLC0415 - optional, never a dependency

            _blas = threadpoolctl.ThreadpoolController()
        except Exception:  # noqa: BLE001 - not installed or no BLAS found: no cap
            _blas = False
    return _blas


_cap_lock = threading.Lock()
_cap_depth = 0
_cap_limit = None


def cap_enter() -> bool:
    """Cap the BLAS at one thread (nested/concurrent callers share one cap; the last one out restores)."""
    global _cap_depth, _cap_limit
    ctl = _blas_controller()
    if not ctl:
        return False
    with _cap_lock:
        if _cap_depth == 0:
            _cap_limit = ctl.limit(limits=1, user_api="blas")
        _cap_depth += 1
    return True


def cap_exit() -> None:
    global _cap_depth, _cap_limit
    with _cap_lock:
        _cap_depth -= 1
        if _cap_depth == 0 and _cap_limit is not None:
            _cap_limit.restore_original_limits()
            _cap_limit = None


@contextlib.contextmanager
def blas_capped(wanted: bool = True):
    """``with blas_capped(wanted) as capped:`` — the BLAS held at one thread inside the block when ``wanted`` and
    threadpoolctl can (``capped`` says whether it is), restored on exit."""
    capped = bool(wanted) and cap_enter()
    try:
        yield capped
    finally:
        if capped:
            cap_exit()


def default_workers() -> int:
    """Workers for matmul-heavy sharding: ``min(_parallel.num_threads(), 8)`` when the BLAS can be capped at one
    thread meanwhile (``threadpoolctl`` installed and a BLAS found), else 1 (leave the cores to the BLAS)."""
    from . import parallel  # noqa: PLC0415

    ctl = _blas_controller()
    return min(parallel.num_threads(), 8) if ctl and ctl.select(user_api="blas").lib_controllers else 1


def run(fns: Sequence[Callable[[], None] | None], *, single_threaded_blas: bool = False) -> None:
    """Run ``fns[k]`` on worker ``k`` (``None``: nothing for that worker), wait for all, re-raise the first error.

    ``single_threaded_blas``: while the workers run, cap the BLAS thread pool at one thread (through
    ``threadpoolctl`` when it is installed; the cap is process-wide for that time), so that K workers do not
    oversubscribe the cores with K multi-threaded BLAS calls.  OpenBLAS partitions a GEMM over rows/columns only,
    so the bits do not depend on the BLAS thread count."""
    with blas_capped(single_threaded_blas):
        futures = [_worker(k).submit(fn) for k, fn in enumerate(fns) if fn is not None]
        first = None
        for f in futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised after every worker finished
                first = first or exc
    if first is not None:
        raise first

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


_blas = None  # threadpoolctl's controllers of the loaded BLAS libraries; [] when they cannot be capped


def _blas_libs() -> list:
    """The BLAS libraries to cap, or [] when flatopt cannot hold them at one thread: no threadpoolctl, no BLAS
    found, or an OpenMP-threaded one (its thread count is per calling thread, so a cap taken by the caller would not
    reach the worker threads that run the GEMMs)."""
    global _blas
    if _blas is None:
        try:
            import threadpoolctl  # noqa: PLC0415 - optional, never a dependency

            libs = list(threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers)
        except Exception:  # noqa: BLE001 - not installed or no BLAS found: no cap
            libs = []
        _blas = [] if any(getattr(lib, "threading_layer", None) == "openmp" for lib in libs) else libs
    return _blas


def _set_threads(lib, n: int) -> None:
    # threadpoolctl (3.8.0, installed here) lets only one Python thread (the first to set it) change a pthreads OpenBLAS's thread
    # count and silently ignores every other thread while that one lives; flatopt caps from whichever thread steps
    # (a worker of MuonAdamW's concurrent groups, a user's thread), so it calls the library's own setter.
    getattr(lib, "_real_set_num_threads", lib.set_num_threads)(n)


_cap_lock = threading.Lock()
_cap_depth = 0  # callers inside the process-wide cap
_cap_saved: list = []


def cap_enter() -> bool:
    """Hold the BLAS at one thread, process-wide (nested/concurrent callers share one cap; the last one out
    restores).  Returns False, changing nothing, when it cannot (see ``_blas_libs``) or the library did not take it."""
    global _cap_depth, _cap_saved
    libs = _blas_libs()
    if not libs:
        return False
    with _cap_lock:
        if _cap_depth == 0:
            _cap_saved = [(lib, lib.get_num_threads()) for lib in libs]
            for lib in libs:
                _set_threads(lib, 1)
            if any(lib.get_num_threads() != 1 for lib in libs):
                for lib, n in _cap_saved:
                    _set_threads(lib, n)
                return False
        _cap_depth += 1
    return True


def cap_exit() -> None:
    global _cap_depth
    with _cap_lock:
        _cap_depth -= 1
        if _cap_depth == 0:
            for lib, n in _cap_saved:
                _set_threads(lib, n)


def threads_now() -> list[int]:
    """The thread count each BLAS library would use for a call from this thread now (tests, diagnostics)."""
    return [lib.get_num_threads() for lib in _blas_libs()]


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


def can_cap() -> bool:
    """True when the BLAS thread count can be held at one thread (``threadpoolctl`` installed and a BLAS found)."""
    return bool(_blas_libs())


def default_workers() -> int:
    """Workers for matmul-heavy sharding: ``min(core.parallel.num_threads(), 8)`` when the BLAS can be capped at one
    thread meanwhile (``threadpoolctl`` installed and a BLAS found), else 1 (leave the cores to the BLAS)."""
    from . import parallel  # noqa: PLC0415

    return min(parallel.num_threads(), 8) if can_cap() else 1


def run(fns: Sequence[Callable[[], None] | None], *, single_threaded_blas: bool = False) -> None:
    """Run ``fns[k]`` on worker ``k`` (``None``: nothing for that worker), wait for all, re-raise the first error.

    ``single_threaded_blas``: while the workers run, cap the BLAS thread pool at one thread (through
    ``threadpoolctl`` when it is installed; the cap is process-wide for that time), so that K workers do not
    oversubscribe the cores with K multi-threaded BLAS calls.

    The bits of a GEMM **do** depend on the BLAS thread count on some CPUs (with OpenBLAS's Haswell kernels,
    for one, a 2-thread and a 1-thread sgemm of the same operands differ in the last bits), so a caller that
    promises the same bits as a serial path must run that serial path under the same cap (``blas_capped``), and
    must not use the workers at all when ``can_cap()`` is False."""
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

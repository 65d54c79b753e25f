"""Benchmark harness: times flatopt side by side with reference implementations in one process.

Each ``benchmarks/bench_<suite>.py`` module defines ``cases(quick: bool) -> list[Case]``.  A case's ``setup()``
builds its inputs and returns a zero-argument ``step`` function (one optimizer step over the whole workload); the
harness warms it up, then times ``repeats`` calls (each after untimed settling calls of the same case, see
``SETTLE``, and the case's ``prelude`` if it has one) and reports the median.  Within one (suite, workload), ratios are
``baseline median / case median``: > 1 means faster than the baseline.  The machine is noisy: compare ratios
measured in one process, never absolute times across runs.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Callable


@dataclasses.dataclass
class Case:
    suite: str  # "adamw", "adafactor", ...
    workload: str  # "(a) one 16M fp32 buffer", ...
    impl: str  # "flatopt", "torch fused", ...
    setup: Callable[[], Callable[[], None]]  # -> step()
    baseline: bool = False  # ratios in this workload are relative to this case
    state_bytes_per_param: Callable[[], float] | None = None  # called after the timed steps
    note: str = ""
    # untimed, right before each timed step (after the settling steps): e.g. the torch work that computes the
    # gradients in a training loop, whose threads may still hold the cores when the step starts
    prelude: Callable[[], None] | None = None


@dataclasses.dataclass
class Result:
    case: Case
    median_ms: float
    times_ms: list[float]
    bytes_per_param: float | None
    ratio: float | None = None  # baseline median / this median


def time_case(case: Case, repeats: int, warmup: int = 2) -> Result:
    """Time one case on its own: ``warmup`` untimed steps, then ``repeats`` timed ones."""
    return _time_group([case], repeats, warmup)[0]


# Untimed steps of the same case right before each timed one: at least one, and at least ``SETTLE_S`` seconds of
# them.  Torch's OpenMP workers (libgomp) and OpenBLAS's threads spin for a while after their parallel region
# ends (OpenBLAS's default: about 2^28 cycles, ~0.1 s); a step timed right after another library's step shares
# the cores with those spinning threads, which no real training loop does.  Measured: two threads of elementwise
# NumPy work ran 1.4-1.8x slower right after a threaded GEMM than after 0.2 s of sleep; flatopt's 8-bit factored
# step 1.2x slower right after the original's; the original's APOLLO step up to 2x slower right after a flatopt
# step that had called the threaded BLAS.  Settling puts every timed step in its own library's steady state.
SETTLE = 1
SETTLE_S = 0.25


def _time_group(cases: list[Case], repeats: int, warmup: int = 2, settle: int = SETTLE,
                settle_s: float = SETTLE_S) -> list[Result]:
    """Time the cases of one workload with their repeats interleaved (case A, B, C, then B, C, A, ...), so that a
    burst of load from other processes hits every case alike instead of skewing one of them; each timed step
    follows at least ``settle`` untimed steps and ``settle_s`` seconds of them of the same case (see ``SETTLE``)."""
    steps = []
    try:
        for c in cases:
            steps.append(c.setup())
            for _ in range(warmup):
                steps[-1]()
        times: list[list[float]] = [[] for _ in cases]
        gc.collect()
        gc_was = gc.isenabled()
        gc.disable()
        try:
            k = len(cases)
            for r in range(repeats):
                for j in range(k):
                    i = (j + r) % k
                    t_end = time.perf_counter() + settle_s
                    for _ in range(settle):
                        steps[i]()
                    while settle and time.perf_counter() < t_end:
                        steps[i]()
                    if cases[i].prelude is not None:
                        cases[i].prelude()
                    t0 = time.perf_counter()
                    steps[i]()
                    times[i].append((time.perf_counter() - t0) * 1e3)
        finally:
            if gc_was:
                gc.enable()
        out = []
        for c, ts in zip(cases, times):
            bpp = c.state_bytes_per_param() if c.state_bytes_per_param else None
            out.append(Result(c, statistics.median(ts), ts, bpp))
        return out
    finally:
        del steps
        gc.collect()


def run_cases(cases: list[Case], repeats: int, log: Callable[[str], None] = print, *,
              interleave: bool = True, settle_s: float = SETTLE_S) -> list[Result]:
    """Time every case and fill in the ratios.  With ``interleave`` the cases of one (suite, workload) are set up
    together and their repeats interleaved (more memory at once, less noise in the ratios); otherwise one case at a
    time.  Results keep the order of ``cases``."""
    groups: dict[tuple[str, str], list[Case]] = {}
    for c in cases:
        groups.setdefault((c.suite, c.workload), []).append(c)
    by_case: dict[int, Result] = {}
    for group in groups.values():
        rs = (_time_group(group, repeats, settle_s=settle_s) if interleave
              else [_time_group([c], repeats, settle_s=settle_s)[0] for c in group])
        for c, r in zip(group, rs):
            log(f"  {c.suite:10s} {c.workload:44s} {c.impl:28s} {r.median_ms:10.3f} ms")
            by_case[id(c)] = r
    results = [by_case[id(c)] for c in cases]
    by_workload: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        by_workload.setdefault((r.case.suite, r.case.workload), []).append(r)
    for group in by_workload.values():
        base = next((r for r in group if r.case.baseline), None)
        if base is not None:
            for r in group:
                r.ratio = base.median_ms / r.median_ms
    return results


def markdown(results: list[Result]) -> str:
    lines = [
        "| suite | workload | implementation | median ms/step | speed vs baseline | state bytes/param |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        ratio = "—" if r.ratio is None else (f"**{r.ratio:.2f}×** (baseline)" if r.case.baseline else f"{r.ratio:.2f}×")
        bpp = "—" if r.bytes_per_param is None else f"{r.bytes_per_param:.3f}"
        impl = r.case.impl + (f" ({r.case.note})" if r.case.note else "")
        lines.append(f"| {r.case.suite} | {r.case.workload} | {impl} | {r.median_ms:.2f} | {ratio} | {bpp} |")
    return "\n".join(lines) + "\n"

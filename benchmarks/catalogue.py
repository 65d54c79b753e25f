"""Shared shape of the catalogue benchmarks (``bench_adam.py``, ``bench_nadamw.py``, ...): AdamW's three workloads
(one 16M buffer, the 76-tensor transformer-like set, 500 x 64), flatopt's ``step_batch`` against each reference
implementation of the same rule; the first reference listed is the baseline (the fastest one torch has: fused,
else foreach, else the package's loop)."""

from __future__ import annotations

from typing import Callable

from .bench_adamw import flatopt_case, torch_case, workloads
from .harness import Case


def cases(suite: str, quick: bool, make_flatopt: Callable[[], object],
          references: list[tuple[str, Callable[[list], object]]]) -> list[Case]:
    out = []
    for workload, shapes in workloads(quick):
        for i, (impl, make) in enumerate(references):
            out.append(torch_case(suite, workload, shapes, make, impl, baseline=i == 0))
        out.append(flatopt_case(suite, workload, shapes, make_flatopt))
    return out

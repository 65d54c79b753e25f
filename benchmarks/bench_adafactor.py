"""Adafactor: flatopt vs ``torch.optim.Adafactor`` (foreach=False and foreach=True) in one process.

Workloads (issue 3): the transformer-like set of ``bench_adamw`` (76 tensors, ~24M elements) and one 4096x4096
float32 matrix.  Both sides run the same rule (relative step ρ = min(1e-2, 1/√t), parameter scaling, eps1 1e-30,
d = 1, no decay: torch's lr = 1e-2 is the cap of its relative step).  flatopt steps a workload with one
``step_batch``; torch with ``optimizer.step()``.  The baseline is torch's faster setting on the full workloads
(``foreach=True``); torch runs on 2 threads (``torch.set_num_threads(2)``).
"""

from __future__ import annotations

import math

import torch

import flatopt

from .bench_adamw import flatopt_case, torch_case, transformer_shapes
from .harness import Case

SUITE = "adafactor"
TORCH_HP = dict(lr=1e-2, eps=(1e-30, 1e-3), d=1.0, weight_decay=0.0)


def workloads(quick: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    if quick:
        shapes_b = transformer_shapes(d=128, layers=2, vocab=1024, ctx=256)
        return [
            ("(m) one 1024x1024 matrix", [(1024, 1024)]),
            (f"(b) transformer-like, {len(shapes_b)} tensors", shapes_b),
        ]
    shapes_b = transformer_shapes()
    total_b = sum(math.prod(s) for s in shapes_b)
    return [
        ("(m) one 4096x4096 matrix", [(4096, 4096)]),
        (f"(b) transformer-like, {len(shapes_b)} tensors, {total_b / 1e6:.1f}M", shapes_b),
    ]


def cases(quick: bool) -> list[Case]:
    torch.set_num_threads(2)
    out = []
    for workload, shapes in workloads(quick):
        out.append(torch_case(SUITE, workload, shapes,
                              lambda ps: torch.optim.Adafactor(ps, **TORCH_HP, foreach=True), "torch foreach",
                              baseline=True))
        out.append(torch_case(SUITE, workload, shapes,
                              lambda ps: torch.optim.Adafactor(ps, **TORCH_HP, foreach=False), "torch single-tensor"))
        out.append(flatopt_case(SUITE, workload, shapes, lambda: flatopt.Adafactor()))
    return out


if __name__ == "__main__":  # quick look: python -m benchmarks.bench_adafactor [--full]
    import sys

    from .harness import markdown, run_cases

    print(markdown(run_cases(cases(quick="--full" not in sys.argv), repeats=5)))

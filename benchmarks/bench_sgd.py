"""SGD with momentum: flatopt vs ``torch.optim.SGD`` (fused, foreach, single-tensor) on one 16M-element buffer."""

from __future__ import annotations

import torch

import flatopt

from .bench_adamw import flatopt_case, torch_case
from .harness import Case

SUITE = "sgd"
HP = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)


def cases(quick: bool) -> list[Case]:
    workload, shapes = ("(a) one 256K fp32 buffer", [(1 << 18,)]) if quick else ("(a) one 16M fp32 buffer",
                                                                               [(16 * 1024 * 1024,)])
    return [
        torch_case(SUITE, workload, shapes, lambda ps: torch.optim.SGD(ps, **HP, fused=True), "torch fused",
                   baseline=True),
        torch_case(SUITE, workload, shapes, lambda ps: torch.optim.SGD(ps, **HP, foreach=True), "torch foreach"),
        torch_case(SUITE, workload, shapes, lambda ps: torch.optim.SGD(ps, **HP, foreach=False),
                   "torch single-tensor"),
        flatopt_case(SUITE, workload, shapes, lambda: flatopt.SGD(**HP)),
    ]

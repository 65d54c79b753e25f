"""RAdam: flatopt vs ``torch.optim.RAdam`` foreach (baseline: torch has no fused RAdam) and single-tensor."""

from __future__ import annotations

import torch

import flatopt

from . import catalogue

SUITE = "radam"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.RAdam(**HP), [
        ("torch foreach", lambda ps: torch.optim.RAdam(ps, **HP, foreach=True)),
        ("torch single-tensor", lambda ps: torch.optim.RAdam(ps, **HP, foreach=False)),
    ])

"""Adam (L2 decay): flatopt vs ``torch.optim.Adam`` fused (baseline), foreach and single-tensor."""

from __future__ import annotations

import torch

import flatopt

from . import catalogue

SUITE = "adam"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.Adam(**HP), [
        ("torch fused", lambda ps: torch.optim.Adam(ps, **HP, fused=True)),
        ("torch foreach", lambda ps: torch.optim.Adam(ps, **HP, foreach=True)),
        ("torch single-tensor", lambda ps: torch.optim.Adam(ps, **HP, foreach=False)),
    ])

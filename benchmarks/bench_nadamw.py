"""NAdamW: flatopt vs ``torch.optim.NAdam(momentum_decay=inf, decoupled_weight_decay=True)``, foreach (baseline: torch
has no fused NAdam) and single-tensor."""

from __future__ import annotations

import torch

import flatopt

from . import catalogue

SUITE = "nadamw"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
TORCH = dict(HP, momentum_decay=float("inf"), decoupled_weight_decay=True)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.NAdamW(**HP), [
        ("torch foreach", lambda ps: torch.optim.NAdam(ps, **TORCH, foreach=True)),
        ("torch single-tensor", lambda ps: torch.optim.NAdam(ps, **TORCH, foreach=False)),
    ])

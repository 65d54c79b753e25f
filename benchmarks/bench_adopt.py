"""Adopt: flatopt vs pytorch-optimizer's ``ADOPT`` (its default clip t^(1/4)), its loop (baseline: faster than its
foreach path on the two large workloads here) and foreach (faster on the 500 small tensors)."""

from __future__ import annotations

import pytorch_optimizer

import flatopt

from . import catalogue

SUITE = "adopt"
HP = dict(lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, weight_decay=1e-2)
PO = dict(HP, weight_decouple=True)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.Adopt(**HP, decoupled=True), [
        ("pytorch-optimizer loop", lambda ps: pytorch_optimizer.ADOPT(ps, **PO, foreach=False)),
        ("pytorch-optimizer foreach", lambda ps: pytorch_optimizer.ADOPT(ps, **PO, foreach=True)),
    ])

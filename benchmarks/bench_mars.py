"""Mars: flatopt vs pytorch-optimizer's ``MARS(mars_type="adamw", optimize_1d=True)``, foreach (baseline) and loop."""

from __future__ import annotations

import pytorch_optimizer

import flatopt

from . import catalogue

SUITE = "mars"
HP = dict(lr=3e-3, betas=(0.95, 0.99), eps=1e-8, weight_decay=1e-2, gamma=0.025)
PO = dict(HP, mars_type="adamw", optimize_1d=True, weight_decouple=True)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.Mars(**HP), [
        ("pytorch-optimizer foreach", lambda ps: pytorch_optimizer.MARS(ps, **PO, foreach=True)),
        ("pytorch-optimizer loop", lambda ps: pytorch_optimizer.MARS(ps, **PO, foreach=False)),
    ])

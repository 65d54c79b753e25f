"""AdEMAMix: flatopt vs pytorch-optimizer's ``AdEMAMix(weight_decouple=True)`` (the paper's decoupled decay), foreach
(baseline) and loop."""

from __future__ import annotations

import pytorch_optimizer

import flatopt

from . import catalogue

SUITE = "ademamix"
HP = dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha_beta3=1e4, eps=1e-8, weight_decay=1e-2)
PO = dict(HP, weight_decouple=True)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.AdEMAMix(**HP), [
        ("pytorch-optimizer foreach", lambda ps: pytorch_optimizer.AdEMAMix(ps, **PO, foreach=True)),
        ("pytorch-optimizer loop", lambda ps: pytorch_optimizer.AdEMAMix(ps, **PO, foreach=False)),
    ])

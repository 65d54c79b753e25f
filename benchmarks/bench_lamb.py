"""Lamb: flatopt vs pytorch-optimizer's ``Lamb`` — a different rule (no bias correction, decay outside the ratio,
‖θ‖ clamped) of the same cost (Adam moments + two norms per tensor): the only torch Lamb installed (optax's, the
conformance reference, needs JAX)."""

from __future__ import annotations

import pytorch_optimizer

import flatopt

from . import catalogue

SUITE = "lamb"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.Lamb(**HP), [
        ("pytorch-optimizer Lamb", lambda ps: pytorch_optimizer.Lamb(ps, **HP)),
    ])

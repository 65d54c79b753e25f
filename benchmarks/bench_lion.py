"""Lion: flatopt vs lion-pytorch's ``Lion`` (``use_triton=False``: a per-tensor loop on the CPU)."""

from __future__ import annotations

import lion_pytorch

import flatopt

from . import catalogue

SUITE = "lion"
HP = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-1)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.Lion(**HP), [
        ("lion-pytorch", lambda ps: lion_pytorch.Lion(ps, **HP, use_triton=False)),
    ])

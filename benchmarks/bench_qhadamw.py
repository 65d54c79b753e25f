"""QHAdamW: flatopt vs qhoptim's ``QHAdamW`` (a per-tensor loop; the oracle of the conformance tests)."""

from __future__ import annotations

import warnings

import qhoptim.pyt

import flatopt

from . import catalogue

SUITE = "qhadamw"
HP = dict(lr=1e-3, betas=(0.995, 0.999), nus=(0.7, 1.0), eps=1e-8, weight_decay=1e-2)
warnings.filterwarnings("ignore", message=".*add_?\\(.*deprecated", category=UserWarning)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.QHAdamW(**HP), [
        ("qhoptim QHAdamW", lambda ps: qhoptim.pyt.QHAdamW(ps, **HP)),
    ])

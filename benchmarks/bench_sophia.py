"""Sophia: flatopt's ``step`` vs sophia-opt's ``SophiaG.step`` (= the official code, a per-tensor loop); the
Hessian-EMA update, every 10 steps in the official recipe, is not timed."""

from __future__ import annotations

import sophia_opt

import flatopt

from . import catalogue

SUITE = "sophia"
HP = dict(lr=1e-4, betas=(0.965, 0.99), rho=0.04, weight_decay=1e-1)


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.Sophia(**HP), [
        ("sophia-opt SophiaG", lambda ps: sophia_opt.SophiaG(ps, **HP)),
    ])

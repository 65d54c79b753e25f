"""ScheduleFreeAdamW: flatopt vs the ``schedulefree`` package's ``AdamWScheduleFree``, foreach (its default, the
baseline) and per-tensor; the reference is put in train mode first, as it requires.

The reference divides ``p.grad`` in place; the harness hands every step the same gradients, which would shrink
towards subnormals (and slow its arithmetic) step after step, so the reference's step first copies the original
gradients back (one more read and write of the gradients, counted in its time)."""

from __future__ import annotations

import schedulefree
import torch

import flatopt

from . import catalogue

SUITE = "schedulefree"
HP = dict(lr=2.5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, warmup_steps=10)


class _Reference:
    """``AdamWScheduleFree`` in train mode whose ``step`` restores the gradients it overwrote."""

    def __init__(self, ps, foreach: bool):
        self.opt = schedulefree.AdamWScheduleFree(ps, **HP, foreach=foreach)
        self.opt.train()
        self.state = self.opt.state
        self.grads = [p.grad for p in ps]
        self.saved = [g.clone() for g in self.grads]

    def step(self) -> None:
        torch._foreach_copy_(self.grads, self.saved)
        self.opt.step()


def cases(quick: bool):
    return catalogue.cases(SUITE, quick, lambda: flatopt.ScheduleFreeAdamW(**HP), [
        ("schedulefree foreach", lambda ps: _Reference(ps, True)),
        ("schedulefree per-tensor", lambda ps: _Reference(ps, False)),
    ])

"""The one registry of every optimizer: the contract suite (test_contract.py) runs over all of it.

A new algorithm joins with one entry: a factory for a fresh optimizer (keyword overrides allowed), the shapes it
accepts, and a learning rate at which it must decrease a quadratic and the Rosenbrock function.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flatopt


@dataclasses.dataclass(frozen=True)
class Spec:
    make: Callable[..., object]  # make(**overrides) -> a fresh optimizer
    shapes: tuple = ((7,), (4, 3), (2, 3, 4), (1,), (5, 1))
    quadratic_lr: float = 0.05  # lr for the convergence checks (passed to make(lr=...))
    rosenbrock_lr: float = 0.01
    converge_steps: int = 300
    set_lr_changes_update: bool = True  # a step with lr/2 differs from a step with lr


REGISTRY: dict[str, Spec] = {
    "sgd": Spec(make=lambda lr=0.05, **kw: flatopt.SGD(lr=lr, **kw), rosenbrock_lr=1e-3, converge_steps=2000),
    "sgd_nesterov": Spec(
        make=lambda lr=0.02, **kw: flatopt.SGD(lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4, **kw),
        rosenbrock_lr=2e-4, converge_steps=2000,
    ),
    "sgd_dampened": Spec(make=lambda lr=0.02, **kw: flatopt.SGD(lr=lr, momentum=0.5, dampening=0.3, **kw),
                         rosenbrock_lr=5e-4, converge_steps=2000),
    "adamw": Spec(make=lambda lr=0.05, **kw: flatopt.AdamW(lr=lr, **kw)),
    "adamw_amsgrad": Spec(make=lambda lr=0.05, **kw: flatopt.AdamW(lr=lr, amsgrad=True, weight_decay=0.0, **kw)),
}

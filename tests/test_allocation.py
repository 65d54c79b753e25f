"""CPU speed rule: after the first step of a name, a NumPy step allocates no array memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import flatopt

from .helpers import rng_arrays

OPTIMIZERS = {
    "sgd": lambda: flatopt.SGD(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_dampened": lambda: flatopt.SGD(lr=0.01, momentum=0.9, dampening=0.1),
    "adamw": lambda: flatopt.AdamW(),
    "adamw_amsgrad": lambda: flatopt.AdamW(amsgrad=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [40_000, 200_000, 1_000_000])  # a temporary would be >= 160 KB
def test_no_allocation_after_first_step(name, n):
    opt = OPTIMIZERS[name]()
    p = rng_arrays(0, (n,))
    g = rng_arrays(1, (n,))
    for _ in range(3):  # first steps: state, scratch, thread pool
        opt.step("w", (n,), p, g)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(5):
            opt.step("w", (n,), p, g)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # bookkeeping objects (views, closures) are a few hundred bytes per chunk; an array temporary would be
    # at least 4 * n bytes
    assert peak - base < max(64 * 1024, 0.05 * 4 * n), (peak - base, n)
    assert current - base < 16 * 1024

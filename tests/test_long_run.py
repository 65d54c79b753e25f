"""Long runs: no memory growth over 10,000 steps of every optimizer (tracemalloc).

Memory traced after a warm-up must not grow: state is created once per name, scratch once per thread, and
nothing accumulates per step (no unbounded caches, no lists of per-step objects).  ``LONG_RUN_STEPS`` overrides
the number of steps.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest

from flatopt import OptItem

from .helpers import make_params, rng_arrays
from .registry import REGISTRY

pytestmark = pytest.mark.slow  # 10,000 steps of every optimizer

STEPS = int(os.environ.get("LONG_RUN_STEPS", "10000"))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_no_memory_growth(name):
    spec = REGISTRY[name]
    params = make_params(spec.shapes[:2])  # two parameters: the per-step bookkeeping is what is measured
    opt = spec.make_for({n: s for n, (s, _) in params.items()}) if spec.make_for else spec.make()
    grads = {n: rng_arrays(7 + i, s) * 1e-2 for i, (n, (s, _)) in enumerate(sorted(params.items()))}
    items = [OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())]

    def steps(k):
        for i in range(k):
            if i % 2:
                opt.step_batch(items)
            else:
                for it in items:
                    opt.step(*it)
            opt.end_iteration()

    steps(200)  # warm-up: states, scratch, thread pool, kernels
    tracemalloc.start()
    try:
        steps(STEPS // 10)
        mid, _ = tracemalloc.get_traced_memory()
        steps(STEPS - STEPS // 10 - 200)
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a per-step leak of even 8 bytes over 9,000 steps would show as >= 72 KB
    assert end - mid < 48 * 1024, f"{name}: traced memory grew by {end - mid} bytes"

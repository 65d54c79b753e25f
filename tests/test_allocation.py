"""CPU speed rule: after the first step of a name, a NumPy step allocates no array memory."""

from __future__ import annotations

import tracemalloc

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


@pytest.mark.parametrize("name", sorted(__import__("tests.registry", fromlist=["REGISTRY"]).REGISTRY))
def test_registry_allocates_no_temporaries_after_warmup(name):
    """Every optimizer's NumPy path: after warm-up a step allocates no array of the parameter's size (a
    temporary would show as >= 1x the parameter's bytes; a few small vectors and Python objects are allowed)."""
    from .registry import REGISTRY

    spec = REGISTRY[name]
    shape = (256, 384)
    opt = spec.make_for({"w": shape}) if spec.make_for else spec.make()
    ratio = _peak_ratio_after_warmup(opt, shape, warmup=5)
    assert ratio < 0.25, f"{name}: {ratio:.2f}x the parameter's bytes"


def _peak_ratio_after_warmup(opt, shape, warmup: int) -> float:
    """Peak traced allocation of 3 steps of ``w`` after ``warmup`` steps, in multiples of the parameter's bytes."""
    p, g = rng_arrays(0, shape), rng_arrays(1, shape) * 1e-2
    for _ in range(warmup):
        opt.step("w", shape, p, g)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(3):
            opt.step("w", shape, p, g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (peak - base) / p.nbytes


@pytest.mark.parametrize("options", [dict(beta1=0.9), dict(beta1=0.9, m_quant_type="uf4", block_size=384),
                                     dict(beta1=0.9, beta2=0.999, beta3=0.9999, relative_step=False),
                                     dict(factored=False, beta1=0.9, beta2=0.999, relative_step=False, d=0.0,
                                          scale_parameter=False),
                                     dict(factored=False, beta1=0.9, enable_fira_for_adafactor=True),
                                     dict(apollo_rank=8, beta1=0.9, min_8bit_size=0)],
                         ids=["factored_uf8", "factored_uf4_unaligned", "came", "adam_one_pass", "momentum_only",
                              "apollo_threaded"])
def test_adafactor8bit_split_steps_allocate_nothing(options):
    """Above ``SPLIT_MIN`` an Adafactor8Bit step spreads its passes over the threads; after warm-up it allocates no
    array of the parameter's size either (its full-size scratch is per-thread workspace)."""
    from flatopt import adafactor8bit as a8

    shape = (512, 384)
    assert shape[0] * shape[1] >= a8.SPLIT_MIN
    ratio = _peak_ratio_after_warmup(flatopt.Adafactor8Bit(**options), shape, warmup=3)
    assert ratio < 0.25, f"{ratio:.2f}x the parameter's bytes"


def test_adafactor_gemv_path_allocates_nothing():
    """A tensor of >= BLAS_MIN elements (GEMV statistics sums while the BLAS is held at one thread, when
    threadpoolctl is there; einsum otherwise) allocates no array of its size after warm-up either."""
    from flatopt.adafactor import factored_passes

    shape = (512, 384)
    assert shape[0] * shape[1] >= factored_passes.BLAS_MIN
    ratio = _peak_ratio_after_warmup(flatopt.Adafactor(), shape, warmup=3)
    assert ratio < 0.25, f"{ratio:.2f}x the parameter's bytes"

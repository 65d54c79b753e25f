"""Shared test helpers: deterministic data, bitwise comparison of params and optimizer states."""

from __future__ import annotations

import math

import numpy as np

import flatopt
from flatopt.core import backend


def rng_arrays(seed: int, shape, dtype=np.float32, scale: float = 1.0):
    r = np.random.default_rng(seed)
    n = math.prod(shape)
    return (r.standard_normal(n) * scale).astype(dtype)


def assert_bits_equal(a, b, what=""):
    a, b = backend.to_numpy(a), backend.to_numpy(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), f"{what}: not bit-identical (max |diff| {np.max(np.abs(a - b))})"


def assert_states_equal(s1: flatopt.OptimizerState, s2: flatopt.OptimizerState):
    assert s1.algorithm == s2.algorithm
    assert s1.config == s2.config
    assert s1.config_key == s2.config_key
    assert s1.step == s2.step
    assert s1.params == s2.params
    assert s1.extra == s2.extra
    assert sorted(s1.buffers) == sorted(s2.buffers)
    for k in s1.buffers:
        assert_bits_equal(s1.buffers[k], s2.buffers[k], k)


def transformer_shapes(d: int = 512, layers: int = 6, vocab: int = 8192, ctx: int = 2048) -> list[tuple[int, ...]]:
    """The benchmarks' transformer-like layout (``benchmarks/bench_adamw.py``, kept here so that no test imports
    ``benchmarks/``): token and position embeddings, ``layers`` x (q, k, v, o, MLP up/down + biases, 2 norms with
    bias), final norm: 4 + 12 per layer tensors (76, 24.2M elements for the defaults)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(d, 4 * d), (4 * d,), (4 * d, d), (d,)] + [(d,)] * 4
    return shapes + [(d,), (d,)]


def make_params(shapes, dtype=np.float32, seed=0):
    return {f"p{i}": (tuple(s), rng_arrays(seed + i, s, dtype)) for i, s in enumerate(shapes)}


def grads_for(params, it, seed=100):
    return {name: rng_arrays(seed + 7919 * it + i, shape, p.dtype)
            for i, (name, (shape, p)) in enumerate(sorted(params.items()))}


def run_steps(opt, params, steps, start=0, batch=False):
    """``steps`` iterations over ``params`` ({name: (shape, buffer)}, NumPy or CuPy) with deterministic gradients:
    every item stepped by ``step`` in name order, or all at once by ``step_batch``; then ``end_iteration``."""
    from flatopt import OptItem

    on_gpu = backend.backend_name(next(iter(params.values()))[1]) == "cupy"
    for it in range(start, start + steps):
        grads = grads_for({n: (s, backend.to_numpy(p)) for n, (s, p) in params.items()}, it)
        if on_gpu:
            grads = {n: backend.cupy().asarray(g) for n, g in grads.items()}
        step_items(opt, [OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())], batch)


def step_items(opt, items, batch):
    """One iteration: ``items`` by ``step_batch`` (``batch``) or one ``step`` each, then ``end_iteration``."""
    if batch:
        opt.step_batch(items)
    else:
        for item in items:
            opt.step(*item)
    opt.end_iteration()


def make_for(spec, params, **overrides):
    """A fresh optimizer of a registry ``spec`` for ``params`` ({name: (shape, buffer)}): optimizers with a manifest
    fixed at construction (``spec.make_for``) get exactly these names and shapes (``overrides``: constructor
    keywords)."""
    if spec.make_for is not None:
        return spec.make_for({n: s for n, (s, _) in params.items()}, **overrides)
    return spec.make(**overrides)

"""Shared test helpers: deterministic data, bitwise comparison of params and optimizer states."""

from __future__ import annotations

import math

import numpy as np

import flatopt
from flatopt import _backend


def rng_arrays(seed: int, shape, dtype=np.float32, scale: float = 1.0):
    r = np.random.default_rng(seed)
    n = math.prod(shape)
    return (r.standard_normal(n) * scale).astype(dtype)


def assert_bits_equal(a, b, what=""):
    a, b = _backend.to_numpy(a), _backend.to_numpy(b)
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


def make_params(shapes, dtype=np.float32, seed=0):
    return {f"p{i}": (tuple(s), rng_arrays(seed + i, s, dtype)) for i, s in enumerate(shapes)}


def grads_for(params, it, seed=100):
    return {name: rng_arrays(seed + 7919 * it + i, shape, p.dtype)
            for i, (name, (shape, p)) in enumerate(sorted(params.items()))}

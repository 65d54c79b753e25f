"""Global-norm, clipping and finiteness helpers against float64 references (and torch's clip_grad_norm_)."""

from __future__ import annotations

import numpy as np
import pytest

from flatopt import gradients

from .helpers import rng_arrays


def _bufs(dtype=np.float32):
    return [rng_arrays(i, (n,), dtype, scale=3.0) for i, n in enumerate((5, 70_000, 1, 200_003))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_norm_matches_float64(dtype):
    bufs = _bufs(dtype)
    want = np.sqrt(sum(float(np.sum(b.astype(np.float64) ** 2)) for b in bufs))
    got = gradients.global_norm(bufs)
    assert got.dtype == np.float64 and got.shape == ()
    assert abs(float(got) - want) <= 1e-12 * want


def test_clip_matches_torch():
    torch = pytest.importorskip("torch")
    bufs = _bufs()
    ts = [torch.nn.Parameter(torch.zeros(b.size)) for b in bufs]
    for t, b in zip(ts, bufs):
        t.grad = torch.from_numpy(b.copy())
    want_norm = torch.nn.utils.clip_grad_norm_(ts, max_norm=5.0, foreach=False)
    norm = gradients.clip_by_global_norm(bufs, 5.0)
    assert abs(float(norm) - float(want_norm)) <= 1e-5 * float(want_norm)
    for t, b in zip(ts, bufs):
        np.testing.assert_allclose(b, t.grad.numpy(), rtol=2e-6, atol=0)
    assert float(gradients.global_norm(bufs)) <= 5.0 * (1 + 1e-6)


def test_clip_leaves_small_gradients_alone():
    bufs = _bufs()
    before = [b.copy() for b in bufs]
    gradients.clip_by_global_norm(bufs, 1e9)
    for a, b in zip(bufs, before):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        gradients.clip_by_global_norm(bufs, float("nan"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite(dtype, bad):
    bufs = _bufs(dtype)
    assert bool(gradients.all_finite(bufs))
    bufs[1][12345] = bad
    assert not bool(gradients.all_finite(bufs))
    assert not np.isfinite(float(gradients.global_norm(bufs)))


def test_huge_finite_float32_values_are_finite():
    b = np.full(1000, np.finfo(np.float32).max, np.float32)
    assert bool(gradients.all_finite([b]))

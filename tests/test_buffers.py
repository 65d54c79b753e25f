"""``flatopt.flat_view`` refuses what ``reshape(-1)`` would copy; ``pack``/``pack_like`` lay named arrays out in one
flat buffer whose views share memory with it."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from tests.helpers import rng_arrays


def test_flat_view_is_a_view_of_a_c_contiguous_array():
    W = np.arange(12, dtype=np.float32).reshape(3, 4)
    w = flatopt.flat_view(W)
    assert w.shape == (12,) and np.shares_memory(w, W) and w.flags.c_contiguous
    w[0] = 99.0
    assert W[0, 0] == 99.0
    assert np.shares_memory(flatopt.flat_view(W[1:]), W)  # leading-axis slices are contiguous
    assert flatopt.flat_view(np.zeros((0, 3))).shape == (0,)


@pytest.mark.parametrize("make", [
    lambda W: W.T,
    lambda W: np.asfortranarray(W),
    lambda W: W[:, :2],
    lambda W: W[::2],
    lambda W: W.reshape(-1)[::2],
], ids=["transposed", "fortran", "sliced_columns", "strided_rows", "strided_1d"])
def test_flat_view_refuses_what_would_copy(make):
    W = np.arange(24, dtype=np.float32).reshape(4, 6)
    with pytest.raises(ValueError, match="copy"):
        flatopt.flat_view(make(W))


def test_flat_view_refuses_non_arrays():
    with pytest.raises(TypeError):
        flatopt.flat_view([1.0, 2.0])


def test_an_optimizer_on_flat_view_updates_the_model():
    W = rng_arrays(0, (4, 3)).reshape(4, 3)
    W0 = W.copy()
    opt = flatopt.SGD(lr=0.1)
    opt.step("W", W.shape, flatopt.flat_view(W), np.ones(12, np.float32))
    np.testing.assert_allclose(W, W0 - 0.1)


def test_pack_round_trips_and_shares_memory():
    shapes = {"w": (3, 4), "b": (4,), "s": (), "e": (0, 2)}
    flat, views = flatopt.pack(shapes, dtype=np.float64)
    assert flat.shape == (17,) and flat.dtype == np.float64 and not flat.any()
    assert {n: v.shape for n, v in views.items()} == shapes
    for i, v in enumerate(views.values()):
        if v.size:
            assert np.shares_memory(v, flat)
            v[...] = i + 1
    np.testing.assert_array_equal(flat, [1] * 12 + [2] * 4 + [3])
    assert np.shares_memory(flatopt.flat_view(views["w"]), flat)
    with pytest.raises(ValueError, match="'bad'"):
        flatopt.pack({"bad": (2, -1)})


def test_pack_like_copies_values_in():
    arrays = {"w": rng_arrays(0, (2, 3)).reshape(2, 3), "b": np.arange(3, dtype=np.float32)}
    keep = {n: a.copy() for n, a in arrays.items()}
    flat, views = flatopt.pack_like(arrays)
    assert flat.dtype == np.float32 and flat.size == 9
    for n, a in arrays.items():
        np.testing.assert_array_equal(views[n], a)
        np.testing.assert_array_equal(a, keep[n])
        assert not np.shares_memory(views[n], a) and np.shares_memory(views[n], flat)
    opt = flatopt.AdamW(lr=0.1)
    opt.step("all", (9,), flat, np.ones(9, np.float32))  # one buffer stepped whole moves every view
    assert (views["w"] < arrays["w"]).all() and (views["b"] < arrays["b"]).all()

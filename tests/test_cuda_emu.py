"""The CUDA emulator and the CuPy stand-in (tests/cuda_emu) check what they claim to check.

Each error the emulator must report is committed once by a kernel of ``tests/cuda_emu/selftest.cu``; the stand-in's
signatures are compared with the installed CuPy; launches and host synchronisations per step are counted on
flatopt's real driver.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flatopt
from flatopt.core import backend as _backend
from flatopt.core import kernels as _kernels

from .cuda_emu import cupy_api, emu, fakecupy

pytestmark = pytest.mark.skipif(emu.available() is not None, reason=str(emu.available()))

SELFTEST = Path(__file__).parent / "cuda_emu" / "selftest.cu"
ST_KERNELS = ("st_shfl_sum", "st_shfl_modes", "st_shfl_partial", "st_divergent", "st_exit_before_barrier",
              "st_uninit_shared", "st_race", "st_shifted_copy", "st_params", "st_vector_copy")
cp = fakecupy.module


def st(name, dtype=np.float32):
    lib = emu.build_file(SELFTEST, ST_KERNELS)
    return emu.Kernel("selftest.cu", f"{name}<{_kernels.CTYPES[np.dtype(dtype)]}>", lib=lib)


def dev(a):
    return cp.asarray(np.asarray(a))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shuffle_and_shared_memory_reduction(dtype):
    x = np.random.default_rng(0).standard_normal(1000).astype(dtype)
    out = cp.zeros(4, dtype)
    for _ in range(3):  # three schedules (forward, reverse, random)
        st("st_shfl_sum", dtype)((4,), (256,), (dev(x), out, np.int64(1000)))
        want = [x[i * 256:(i + 1) * 256].astype(np.float64).sum() for i in range(4)]
        np.testing.assert_allclose(out.get(), want, rtol=1e-5)


def test_shuffle_width_and_up():
    x = np.arange(64, dtype=np.float32)
    out = cp.zeros(64, np.float32)
    st("st_shfl_modes")((1,), (64,), (dev(x), out, np.int32(0)))
    np.testing.assert_array_equal(out.get(), x.reshape(-1, 2)[:, ::-1].reshape(-1))  # partner within width 2
    st("st_shfl_modes")((1,), (64,), (dev(x), out, np.int32(1)))
    want = np.where(np.arange(64) % 32 == 0, x, x - 1)  # lane 0 of each warp keeps its own value
    np.testing.assert_array_equal(out.get(), want)


@pytest.mark.parametrize("kernel, block, message", [
    ("st_shfl_partial", 48, "does not exist"),
    ("st_divergent", 64, "__syncthreads divergence"),
    ("st_exit_before_barrier", 64, "after 48 of 64 threads exited"),
])
def test_reports_synchronisation_errors(kernel, block, message):
    x = dev(np.zeros(64, np.float32))
    out = cp.zeros(64, np.float32)
    args = (x, out) if kernel == "st_shfl_partial" else (out,)
    with pytest.raises(emu.EmulatorError, match=message):
        st(kernel)((1,), (block,), args)


def test_shared_memory_is_poisoned_before_every_block():
    out = cp.zeros(64, np.float32)
    st("st_uninit_shared")((3,), (64,), (out,))
    got = out.get()
    assert np.array_equal(got[:32], np.arange(32)) and np.isnan(got[32:]).all()


def test_thread_orders_expose_a_race():
    results = set()
    for _ in range(len(emu.SCHEDULES)):
        out = cp.zeros(256, np.float32)
        st("st_race")((1,), (256,), (out,))
        results.add(np.isnan(out.get()).sum())
    assert len(results) > 1, "the schedules should disagree on a racy kernel"


@pytest.mark.parametrize("shift, side", [(1, "end"), (-1, "start")])
def test_out_of_bounds_access_fails_the_launch(shift, side, monkeypatch):
    x, out = dev(np.ones(1000, np.float32)), cp.zeros(1000, np.float32)
    copy = st("st_shifted_copy")
    monkeypatch.setattr(emu, "FENCE", side)
    for rshift, wshift in ((shift, 0), (0, shift)):  # a read or a write across the guard page
        with pytest.raises(emu.EmulatorError, match="invalid memory access"):
            copy((2,), (256,), (x, out, np.int64(1000), np.int64(rshift), np.int64(wshift)))
    with pytest.raises(emu.EmulatorError, match="out-of-bounds write"):  # a write into the canary, far side
        copy((2,), (256,), (x, out, np.int64(1000), np.int64(0), np.int64(-shift)))
    copy((2,), (256,), (x, out, np.int64(1000), np.int64(0), np.int64(0)))  # in bounds: fine
    copy((2,), (256,), (x[1:], out[:999], np.int64(999), np.int64(0), np.int64(0)))  # views
    copy((2,), (256,), (out[1:], out[:999], np.int64(999), np.int64(0), np.int64(0)))  # aliasing views


def test_misaligned_vector_access_fails_the_launch():
    """A float4 access through ``__builtin_assume_aligned(p, 16)`` at an address that is not 16-byte aligned (what
    a GPU reports as a misaligned address) fails the launch; the aligned one copies."""
    x = dev(np.arange(1008, dtype=np.float32))
    out = cp.zeros(1000, np.float32)
    copy = st("st_vector_copy")
    with pytest.raises(emu.EmulatorError, match="misaligned 16-byte vector access"):
        copy((2,), (64,), (x, out, np.int64(1000), np.int64(1)))
    copy((2,), (64,), (x, out, np.int64(1000), np.int64(4)))
    assert np.array_equal(cp.asnumpy(out), np.arange(4, 1004, dtype=np.float32))


def test_arguments_are_packed_and_checked_as_cupy_packs_them():
    out = cp.zeros(10, np.float32)
    k = st("st_params")
    k((1,), (32,), (out, np.float32(2), np.int64(10), np.int32(3), np.float32(0.5)))
    np.testing.assert_array_equal(out.get(), 2 * np.arange(10, dtype=np.float32) + 3.5)
    bad = {
        "Python float for long long": (out, np.float32(2), 10.0, np.int32(3), np.float32(0.5)),
        "np.int32 for long long": (out, np.float32(2), np.int32(10), np.int32(3), np.float32(0.5)),
        "Python int for int": (out, np.float32(2), np.int64(10), 3, np.float32(0.5)),
        "Python float for float": (out, np.float32(2), np.int64(10), np.int32(3), 0.5),
        "float64 for float": (out, np.float64(2), np.int64(10), np.int32(3), np.float32(0.5)),
        "float64 array for float*": (cp.zeros(10, np.float64), np.float32(2), np.int64(10), np.int32(3),
                                     np.float32(0.5)),
        "host array": (np.zeros(10, np.float32), np.float32(2), np.int64(10), np.int32(3), np.float32(0.5)),
        "too few": (out, np.float32(2), np.int64(10), np.int32(3)),
    }
    for what, args in bad.items():
        with pytest.raises(emu.EmulatorError):
            k((1,), (32,), args)
            pytest.fail(what)
    with pytest.raises(TypeError):
        k(1, (32,), (out, np.float32(2), np.int64(10), np.int32(3), np.float32(0.5)))  # grid not a tuple


def test_every_registered_kernel_is_emulated():
    for filename, kernels in _kernels.KERNELS.items():
        for expr in _kernels.name_expressions(filename):
            k = emu.get(filename, expr)
            assert k.params and all(p != "?" for p in k.params), expr


# --------------------------------------------------------------------------------------------- the stand-in


def test_stand_in_signatures_match_installed_cupy():
    if cupy_api.REAL_CUPY is None:
        pytest.skip("CuPy is not installed (test extra)")
    # einsum takes **kwargs and rejects every keyword but those it pops: out= is a TypeError on CuPy
    assert "out" not in cupy_api.rule("einsum").kwargs_only
    with pytest.raises(TypeError, match="out"):
        cp.einsum("i,i->i", cp.ones(3), cp.ones(3), out=cp.empty(3))
    with pytest.raises(TypeError):
        cp.sqrt(cp.ones(3), where=cp.ones(3, bool))  # CuPy's ufuncs have no where=
    with pytest.raises(AttributeError):
        cp.fromregex  # noqa: B018 - NumPy has it, CuPy does not
    with pytest.raises(TypeError):
        np.asarray(cp.ones(3))  # no implicit device -> host conversion
    with pytest.raises(TypeError):
        cp.ones(3) + np.ones(3)  # no host operand
    for name in ("sum", "take", "clip", "copyto", "matmul", "add", "add.reduce", "ndarray.astype", "ndarray.sum"):
        assert cupy_api.rule(name).sig is not None, name
    assert np.isnan(cp.empty(5, np.float32).get()).all()  # poisoned
    assert np.isnan(cp.empty_like(cp.ones(5)).get()).all()


def _steady_state_counts(opt, shapes, steps=3):
    with fakecupy.installed() as cpm:
        params = {f"p{i}": (s, cpm.asarray(np.random.default_rng(i).standard_normal(s).astype(np.float32).reshape(-1)))
                  for i, s in enumerate(shapes)}
        grads = {n: cpm.asarray(np.random.default_rng(9).standard_normal(s).astype(np.float32).reshape(-1))
                 for n, (s, _) in params.items()}
        items = [flatopt.OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())]
        for _ in range(steps - 1):
            opt.step_batch(items)
        fakecupy.stats.reset()
        with fakecupy.forbid_sync():
            opt.step_batch(items)
        return fakecupy.stats.launches, fakecupy.stats.ops, fakecupy.stats.syncs


@pytest.mark.parametrize("make, shapes, launches", [
    (lambda: flatopt.AdamW(lr=1e-3), [(300,)], 1),
    (lambda: flatopt.AdamW(lr=1e-3), [(300,), (40, 30), (7,)], 1),  # one multi-tensor launch (core/multi_tensor.py)
    (lambda: flatopt.SGD(lr=1e-2, momentum=0.9), [(64, 32)], 1),
    (lambda: flatopt.Adafactor(), [(64, 32)], 6),  # rows (R, 1/R) + θ partials, column tiles (+ W), column fold
    # (C, factors), row factors (+ ΣU²), scalars, apply (adafactor/gpu.py)
    (lambda: flatopt.Adafactor(), [(100,)], 3),  # V update + U and θ partials, scalars, apply
    (lambda: flatopt.Adafactor(), [(64, 32), (100,), (3, 5, 7)], 6),  # the same passes for every tensor at once
])
def test_launches_and_no_host_sync_per_step(make, shapes, launches):
    got, ops, syncs = _steady_state_counts(make(), shapes)
    assert (got, syncs) == (launches, 0)
    assert ops <= 4 * len(shapes)  # the fused paths: no stray CuPy operations beyond temporaries


def test_gpu_tests_use_the_emulator_when_no_gpu_answers():
    if _backend.gpu_available():
        pytest.skip("a real GPU answers")
    with fakecupy.installed():
        assert _backend.gpu_available()
        p = _backend.cupy().asarray(np.ones(10, np.float32))
        assert _backend.backend_name(p) == "cupy"
        before = emu.stats.launches
        flatopt.AdamW(lr=0.1).step("w", (10,), p, _backend.cupy().asarray(np.ones(10, np.float32)))
        assert emu.stats.launches == before + 1
    assert _backend.cupy is not fakecupy.module and "cupy" not in {type(p).__module__} - {"cupy"}

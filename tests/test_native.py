"""The compiled CPU passes (``flatopt/core/native.py``, ``kernels/cpu/elementwise.c``) give their NumPy twins' bits.

Every algorithm with a compiled pass runs the same steps twice, once compiled and once on the twin (the library
switched off), over flag combinations, both dtypes, sizes that straddle the driver's chunks and the norms' column
layout, and gradients holding NaN, ±inf, ±0 and subnormals; parameters and every saved state array must agree bit for
bit (NaN with NaN).  Also: the library is built where a compiler exists (CI), FLATOPT_NATIVE=0 and a missing or
failing compiler fall back to the twins with a reason, the compiled pass is really taken (a mutated library fails
the comparison), and each instruction set the library may run on x86-64 (AVX2, the SSE2 baseline) gives the same bits.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flatopt
from flatopt.core import driver, native

HAS_CC = shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the compiled passes cannot be built here")

CH = driver.CHUNK
MAKERS = {
    "adamw": lambda: flatopt.AdamW(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "adamw_nowd": lambda: flatopt.AdamW(lr=1e-2, weight_decay=0.0),
    "adam": lambda: flatopt.Adam(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "adam_nowd": lambda: flatopt.Adam(lr=1e-2),
    "nadamw": lambda: flatopt.NAdamW(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "nadamw_nowd": lambda: flatopt.NAdamW(lr=1e-2, weight_decay=0.0),
    "radam": lambda: flatopt.RAdam(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "radam_decoupled": lambda: flatopt.RAdam(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam_nowd": lambda: flatopt.RAdam(lr=1e-2),
    "qhadamw": lambda: flatopt.QHAdamW(lr=1e-2, betas=(0.8, 0.95), nus=(0.7, 0.8), weight_decay=0.1),
    "qhadamw_nu1": lambda: flatopt.QHAdamW(lr=1e-2, nus=(1.0, 1.0), weight_decay=0.0),
    "qhadamw_default": lambda: flatopt.QHAdamW(lr=1e-2),
    "qhadamw_nu2": lambda: flatopt.QHAdamW(lr=1e-2, nus=(1.0, 0.5)),
    "lion": lambda: flatopt.Lion(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "lion_nowd": lambda: flatopt.Lion(lr=1e-2),
    "sophia": lambda: flatopt.Sophia(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "sophia_nowd": lambda: flatopt.Sophia(lr=1e-2, weight_decay=0.0),
    "sgd": lambda: flatopt.SGD(lr=1e-2),
    "sgd_wd": lambda: flatopt.SGD(lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: flatopt.SGD(lr=1e-2, momentum=0.9, weight_decay=0.1),
    "sgd_dampening": lambda: flatopt.SGD(lr=1e-2, momentum=0.9, dampening=0.3),
    "sgd_nesterov": lambda: flatopt.SGD(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
    "lamb": lambda: flatopt.Lamb(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "lamb_nowd": lambda: flatopt.Lamb(lr=1e-2, weight_decay=0.0),
    "mars": lambda: flatopt.Mars(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "mars_noclip": lambda: flatopt.Mars(lr=1e-2, clip_c=False),
    "mars_nowd": lambda: flatopt.Mars(lr=1e-2, weight_decay=0.0),
}
# one chunk and a tail; many chunks plus a tail; small items (bucketed), a >3-D one, one element; a matrix whose
# norm layout has several full rows
SHAPES = {
    "chunked": [(CH + 12345,)],
    "mixed": [(64,)] * 5 + [(4, 5, 6), (1,), (3 * CH + 7,)],
    "rows": [(1000, 333)],
}


def _grad(rng: np.random.Generator, n: int, dt: type, special: bool) -> np.ndarray:
    g = rng.standard_normal(n).astype(dt)
    if special and n > 40:
        k = max(1, n // 50)
        idx = rng.choice(n, 5 * k, replace=False)
        g[idx[:k]] = np.nan
        g[idx[k:2 * k]] = np.inf
        g[idx[2 * k:3 * k]] = -np.inf
        g[idx[3 * k:4 * k]] = -0.0
        g[idx[4 * k:]] = np.finfo(dt).smallest_subnormal * 3
    return g


def _run(make, shapes, dt, *, compiled: bool, steps: int = 4, special: bool = False, seed: int = 0):
    native.reset()
    if not compiled:
        native._state.update(lib=None, why="switched off by the test")  # noqa: SLF001
    try:
        rng = np.random.default_rng(seed)
        opt = make()
        ps = [rng.standard_normal(math.prod(s)).astype(dt) for s in shapes]
        for k in range(steps):
            items = [flatopt.OptItem(f"p{i}", s, p, _grad(rng, p.size, dt, special and k == steps - 2))
                     for i, (s, p) in enumerate(zip(shapes, ps))]
            opt.step_batch(items)
            if isinstance(opt, flatopt.Sophia) and k == 0:
                for i, (s, p) in enumerate(zip(shapes, ps)):
                    opt.update_hessian(f"p{i}", s, np.abs(rng.standard_normal(p.size)).astype(dt))
        return ps, opt.state_dict()
    finally:
        native.reset()


def _arrays(sd) -> list[np.ndarray]:
    out = []

    def walk(x):
        if isinstance(x, np.ndarray):
            out.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(sd)
    return out


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        ints = {4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
        same = (x.view(ints) == y.view(ints)) | (np.isnan(x) & np.isnan(y))
        assert same.all(), f"{np.count_nonzero(~same)} elements differ, first at {np.flatnonzero(~same)[:5]}"


def test_the_library_builds_where_a_compiler_exists():
    native.reset()
    ok, where = native.status()
    assert ok, where
    assert where.endswith(".so")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the twin's NaN/inf arithmetic warns; the compiled one not
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shapes", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("algo", list(MAKERS))
def test_compiled_pass_gives_the_twins_bits(algo, shapes, dt, special):
    make, sh = MAKERS[algo], SHAPES[shapes]
    pa, sa = _run(make, sh, dt, compiled=True, special=special)
    pb, sb = _run(make, sh, dt, compiled=False, special=special)
    _assert_same(pa, pb)
    _assert_same(_arrays(sa), _arrays(sb))


@pytest.mark.parametrize("algo", ["adamw", "lion", "qhadamw", "sgd_momentum", "sophia", "lamb", "mars"])
def test_the_compiled_pass_is_taken(algo, monkeypatch):
    """Each of these algorithms reaches the library (a call per chunk, or per column piece of a norm)."""
    calls = []
    step, columns = native.step, native.columns

    def spy(fn):
        def wrapped(name, *a, **k):
            ok = fn(name, *a, **k)
            calls.append((name, ok))
            return ok
        return wrapped

    monkeypatch.setattr(native, "step", spy(step))
    monkeypatch.setattr(native, "columns", spy(columns))
    native.reset()
    _run(MAKERS[algo], SHAPES["chunked"], np.float32, compiled=True, steps=2)
    assert calls and all(ok for _, ok in calls), calls


def test_a_mutated_library_is_caught(tmp_path, monkeypatch):
    """The comparison can fail: a library whose AdamW makes v·β2 + (g·(1−β2))·g in a fused multiply-add (one
    rounding fewer) differs from the twin."""
    src = native.SOURCE.read_text()
    mutated = src.replace("vi = vi * b2 + (gi * omb2) * gi;", "vi = fma(vi, b2, (gi * omb2) * gi);", 1)
    assert mutated != src
    path = tmp_path / "elementwise.c"
    path.write_text(mutated)
    monkeypatch.setattr(native, "SOURCE", path)
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path / "cache"))
    pa, _ = _run(MAKERS["adamw"], SHAPES["chunked"], np.float32, compiled=True)
    pb, _ = _run(MAKERS["adamw"], SHAPES["chunked"], np.float32, compiled=False)
    with pytest.raises(AssertionError, match="elements differ"):
        _assert_same(pa, pb)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 instruction sets only")
@pytest.mark.parametrize("isa", ["-mno-avx", "-mavx2"], ids=["sse2", "avx2"])
@pytest.mark.parametrize("algo", ["adamw", "adam", "nadamw", "radam", "qhadamw", "lion", "sophia", "sgd_nesterov",
                                  "lamb", "mars"])
def test_every_instruction_set_gives_the_twins_bits(algo, isa, tmp_path, monkeypatch):
    """The library runs whichever clone the CPU takes (``target_clones``: AVX2 or the baseline): each one, built
    alone (``-DFLATOPT_NO_CLONES`` plus the instruction set), gives the twin's bits.  AVX2 is skipped on a CPU
    without it."""
    if isa == "-mavx2" and "avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DFLATOPT_NO_CLONES", isa))
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path))
    make, sh = MAKERS[algo], SHAPES["mixed"]
    pa, sa = _run(make, sh, np.float32, compiled=True, special=True)
    assert len(list(tmp_path.glob("*.so"))) == 1  # this build ran, not the cached default one
    pb, sb = _run(make, sh, np.float32, compiled=False, special=True)
    _assert_same(pa, pb)
    _assert_same(_arrays(sa), _arrays(sb))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@pytest.mark.parametrize("env, why", [
    ({"FLATOPT_NATIVE": "0"}, "disabled by FLATOPT_NATIVE"),
    ({"FLATOPT_CC": "/nonexistent/cc"}, "no C compiler"),
    ({"FLATOPT_CC": "false"}, "failed on elementwise.c"),
])
def test_without_the_library_the_twins_run(env, why, monkeypatch, tmp_path):
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native.reset()
    try:
        ok, reason = native.status()
        assert not ok and why in reason
        p = np.ones(10, np.float32)
        flatopt.Lion(lr=0.1).step("w", (10,), p, np.full(10, 2, np.float32))
        np.testing.assert_array_equal(p, np.float32(0.9))  # the twin ran: one sign step of size lr
    finally:
        monkeypatch.undo()
        native.reset()


def test_a_fresh_process_builds_into_the_cache(tmp_path):
    """A new cache directory gets the library on first use, and a second process reuses it (same path)."""
    code = "from flatopt.core import native; print(native.status()[1])"
    env = {**os.environ, "FLATOPT_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert first == second and first.strip().startswith(str(tmp_path))
    assert len(list(tmp_path.glob("*.so"))) == 1


def test_a_cache_directory_others_can_write_is_not_used(tmp_path, monkeypatch):
    """A library in a directory someone else could write into might have been planted: it is not loaded."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(shared))
    native.reset()
    try:
        ok, reason = native.status()
        assert not ok and "writable by others" in reason
        assert list(shared.iterdir()) == []
    finally:
        monkeypatch.undo()
        native.reset()

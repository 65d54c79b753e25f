"""The compiled CPU passes (``flatopt/core/native.py``: the loops generated from the definitions into
``kernels/generated/elementwise.c``) give their NumPy twins' bits.

Every algorithm with a compiled pass runs the same steps twice, once compiled and once on the twin (the library
switched off), over flag combinations, both dtypes, sizes that straddle the driver's chunks and the norms' column
layout, and gradients holding NaN, ±inf, ±0 and subnormals; parameters and every saved state array must agree bit for
bit, except a NaN, which must be NaN in the same elements (its sign and payload may differ: docs/performance.md).
Also: the library is built where a compiler exists (CI), FLATOPT_NATIVE=0 and a missing or failing compiler fall back
to the twins with a reason, the compiled pass is really taken (a mutated library fails the comparison), and each
instruction set the library may run on x86-64 (AVX2, the SSE2 baseline) gives the same bits.  The cache
(``core/native_cache.py``): a directory another user could swap or write is refused, a damaged or swapped library is
never mapped but rebuilt, processes starting together compile once, a killed build's temporary is cleaned up.
Signed zeros (an lr or lr_scale of -0.0 is refused; the compiled scalars are keyed on their bits) and misaligned
buffers (refused) close the file.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import pathlib
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import flatopt
from flatopt.core import driver, native, native_cache
from flatopt.core.elementwise import run

from .registry import FLAG_SPACE, flag_cases, richest_cases

HAS_CC = shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the compiled passes cannot be built here")

CH = driver.CHUNK
# every combination of each elementwise algorithm's flags (tests/registry.py): each has a compiled pass (amsgrad
# too: the generated loops cover every flag set of a definition)
CASES = flag_cases()
COMPILED = CASES
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
def test_the_flag_space_covers_every_switch():
    """The grid is every algorithm with a compiled pass (every loop of the library is generated from a definition:
    an algorithm's, or for Lamb and Mars its reduce phase and map, or a conversion of ScheduleFreeAdamW's) over every
    switch of its constructor: each boolean option and the weight decay is a dimension of its flag space
    (tests/registry.py)."""
    names = set(re.findall(r"\bint flatopt_gen_(\w+)\(", native.GENERATED.read_text()))
    entries = {re.sub(r"_(columns\d*|map)$", "", n) for n in names}  # columns<level> after the first level
    assert {"adamw", "sgd", "lion", "sophia", "lamb", "mars"} <= entries, entries
    entries &= {case.algorithm for case in CASES.values()}
    assert entries <= {case.algorithm for case in CASES.values()}, entries
    for algo, space in FLAG_SPACE.items():
        switches = {n for n, p in inspect.signature(space.cls).parameters.items() if isinstance(p.default, bool)}
        assert switches | {"weight_decay"} <= set(space.options), (algo, switches)


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shapes", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("algo", list(CASES))
def test_compiled_pass_gives_the_twins_bits(algo, shapes, dt, special):
    case, sh = CASES[algo], SHAPES[shapes]
    steps = max(4, case.space.min_steps)
    pa, sa = _run(case.make, sh, dt, compiled=True, special=special, steps=steps)
    pb, sb = _run(case.make, sh, dt, compiled=False, special=special, steps=steps)
    _assert_same(pa, pb)
    _assert_same(_arrays(sa), _arrays(sb))
    assert not special or any(np.isnan(p).any() for p in pb)  # the NaN clause of _assert_same was exercised


@pytest.mark.parametrize("algo", list(COMPILED))
def test_the_compiled_pass_is_taken(algo, monkeypatch):
    """Each of these cases reaches the library (a call per chunk, or per column piece of a norm)."""
    calls = []

    def spy(fn):
        def wrapped(name, *a, **k):
            ok = fn(name, *a, **k)
            calls.append((name, ok))
            return ok
        return wrapped

    monkeypatch.setattr(native, "gen_step", spy(native.gen_step))  # the loops generated from a definition
    monkeypatch.setattr(native, "gen_columns", spy(native.gen_columns))  # a sum's reduce phase (Lamb, Mars)
    monkeypatch.setattr(native, "gen_map", spy(native.gen_map))  # and its map
    native.reset()
    _run(COMPILED[algo].make, SHAPES["chunked"], np.float32, compiled=True, steps=2)
    assert calls and all(ok for _, ok in calls), calls


def test_a_mutated_library_is_caught(tmp_path, monkeypatch):
    """The comparison can fail: a library whose AdamW makes v·β2 + (g·(1−β2))·g in a fused multiply-add (one
    rounding fewer) differs from the twin (AdamW's loop is generated from its definition: core/elementwise)."""
    src = native.GENERATED.read_text()
    at = src.index("adamw_f1_float(")
    mutated = src[:at] + src[at:].replace("const float t7 = t4 + t6;", "const float t7 = fmaf(t5, g_i, t4);", 1)
    assert mutated != src
    path = tmp_path / "elementwise.c"
    path.write_text(mutated)
    monkeypatch.setattr(native, "GENERATED", path)
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path / "cache"))
    pa, _ = _run(CASES["adamw-wd"].make, SHAPES["chunked"], np.float32, compiled=True)
    pb, _ = _run(CASES["adamw-wd"].make, SHAPES["chunked"], np.float32, compiled=False)
    with pytest.raises(AssertionError, match="elements differ"):
        _assert_same(pa, pb)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 instruction sets only")
@pytest.mark.parametrize("isa", ["-mno-avx", "-mavx2"], ids=["sse2", "avx2"])
@pytest.mark.parametrize("algo", list(richest_cases(COMPILED)))
def test_every_instruction_set_gives_the_twins_bits(algo, isa, tmp_path, monkeypatch):
    """The library runs whichever clone the CPU takes (``target_clones``: AVX2 or the baseline): each one, built
    alone (``-DFLATOPT_NO_CLONES`` plus the instruction set), gives the twin's bits.  AVX2 is skipped on a CPU
    without it."""
    if isa == "-mavx2" and "avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DFLATOPT_NO_CLONES", isa))
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path))
    make, sh = COMPILED[algo].make, SHAPES["mixed"]
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


# ------------------------------------------------------------------------------------- the cache (core/native_cache)
# Each test builds into its own directory: a step there must give the twin's bits (a one-sign-step Lion: 1 -> 0.9).

LION_STEP = "import numpy as np, flatopt; p = np.ones(10, np.float32); " \
            "flatopt.Lion(lr=0.1).step('w', (10,), p, np.full(10, 2, np.float32)); "


def _status_in(d, monkeypatch) -> tuple[bool, str]:
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(d))
    native.reset()
    try:
        return native.status()
    finally:
        native.reset()


def _lion_gives_the_twins_bits() -> None:
    p = np.ones(10, np.float32)
    flatopt.Lion(lr=0.1).step("w", (10,), p, np.full(10, 2, np.float32))
    np.testing.assert_array_equal(p, np.float32(0.9))


def _foreign(monkeypatch, *paths) -> None:
    """Make ``paths`` another user's: chown them to uid 4242 where we can (root), else pretend to be someone else
    (then everything of ours looks foreign)."""
    if os.getuid() == 0:
        for p in paths:
            os.lchown(p, 4242, 4242)
    else:
        monkeypatch.setattr(native_cache, "_uid", lambda: os.getuid() + 4242)


@pytest.fixture(scope="module")
def flipped_library(tmp_path_factory) -> bytes:
    """The bytes of a valid library whose Lion steps the wrong way (1 -> 1.1): built from a modified source (Lion's
    loop is generated from its definition: core/elementwise)."""
    root = tmp_path_factory.mktemp("flipped")
    src = native.GENERATED.read_text()
    at = src.index("lion_f0_float(")
    mutated = src[:at] + src[at:].replace("const float t5 = p_i + t4;", "const float t5 = p_i - t4;", 1)
    assert mutated != src
    (root / "elementwise.c").write_text(mutated)
    cache = root / "cache"
    cache.mkdir(mode=0o700)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(native, "GENERATED", root / "elementwise.c")
        ok, where = _status_in(cache, mp)
        assert ok, where
    finally:
        mp.undo()
        native.reset()
    (lib,) = cache.glob("*.so")
    return lib.read_bytes()


def _plant(d, data: bytes, name: str) -> None:
    (d / name).write_bytes(data)
    (d / name).chmod(0o500)


def test_a_cache_directory_of_another_user_is_refused(tmp_path, monkeypatch, flipped_library):
    """A directory (with a library planted under a valid name) that belongs to someone else is not used."""
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    _plant(d, flipped_library, f"elementwise-{'0' * 20}-{hashlib.sha256(flipped_library).hexdigest()}.so")
    _foreign(monkeypatch, d)
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(d))
    native.reset()
    try:
        ok, why = native.status()
        assert not ok and "belongs to another user" in why, why
        _lion_gives_the_twins_bits()
    finally:
        native.reset()


def test_a_link_to_a_cache_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(theirs)
    _foreign(monkeypatch, theirs)
    ok, why = _status_in(tmp_path / "cache", monkeypatch)
    assert not ok and "belongs to another user" in why, why
    assert list(theirs.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="making a link of another user needs root")
def test_a_link_of_another_user_on_the_way_is_refused(tmp_path, monkeypatch):
    """Our own directory, reached through someone else's symbolic link (which they can re-point at will)."""
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "via"
    link.symlink_to(ours)
    os.lchown(link, 4242, 4242)
    ok, why = _status_in(link / "cache", monkeypatch)
    assert not ok and "symbolic link of another user" in why, why


def test_without_a_home_a_fresh_private_temporary_directory_is_used(tmp_path, monkeypatch):
    """A home-less account gets a new ``mkdtemp`` directory, not the predictable ``$TMPDIR/flatopt-<uid>`` that
    someone else may have made first (here a link to their directory); it is removed once the library is loaded."""
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("FLATOPT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    theirs, taken = tmp_path / "theirs", tmp_path / f"flatopt-{os.getuid()}"
    theirs.mkdir()
    taken.symlink_to(theirs)
    native.reset()
    try:
        ok, where = native.status()
        assert ok, where
        assert where.startswith(str(tmp_path / "flatopt-")) and "private temporary directory" in where, where
    finally:
        native.reset()
    assert list(theirs.iterdir()) == []
    assert sorted(tmp_path.iterdir()) == [taken, theirs]


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o1777, False)], ids=["non-sticky", "sticky"])
def test_a_cache_directory_under_a_world_writable_parent(tmp_path, monkeypatch, mode, refused):
    """Our own 0700 directory inside a world-writable parent: anyone could swap it there, unless the sticky bit
    keeps others from renaming our entries."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(mode)
    (parent / "cache").mkdir(mode=0o700)
    ok, why = _status_in(parent / "cache", monkeypatch)
    if refused:
        assert not ok and "writable by others without the sticky bit" in why, why
        assert list((parent / "cache").iterdir()) == []
    else:
        assert ok, why


@pytest.mark.skipif(os.getuid() != 0, reason="planting a file of another user needs root")
def test_a_library_of_another_user_in_our_directory_is_not_loaded(tmp_path, monkeypatch, flipped_library):
    """A library under a valid name (its own digest) in our directory, but not ours: removed, ours built."""
    ok, where = _status_in(tmp_path, monkeypatch)
    assert ok, where
    (ours,) = tmp_path.glob("*.so")
    key = ours.name.split("-")[1]
    ours.unlink()
    planted = f"elementwise-{key}-{hashlib.sha256(flipped_library).hexdigest()}.so"
    _plant(tmp_path, flipped_library, planted)
    os.chown(tmp_path / planted, 4242, 4242)
    ok, where = _status_in(tmp_path, monkeypatch)
    assert ok and not where.endswith(planted), where
    assert not (tmp_path / planted).exists()
    monkeypatch.setenv("FLATOPT_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        _lion_gives_the_twins_bits()
    finally:
        native.reset()


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "other library", "old name"])
def test_a_damaged_library_is_rebuilt(tmp_path, monkeypatch, flipped_library, damage):
    """The cached library cut to 4096 bytes, emptied, overwritten with garbage, or replaced by another valid library
    (or one planted under the name of before, without its digest): detected before it is mapped, rebuilt, and the
    step gives the twin's bits.  Run in a fresh process, so that a SIGBUS (a truncated library mapped) shows as a
    failure instead of killing pytest."""
    ok, where = _status_in(tmp_path, monkeypatch)
    assert ok, where
    (lib,) = tmp_path.glob("*.so")
    # this process has the library mapped: damage a copy at the same name, never the mapped file (a mapped file cut
    # or overwritten in place crashes this process with SIGBUS when it next touches the library, e.g. at exit)
    data = lib.read_bytes()
    lib.unlink()
    lib.write_bytes(data)
    lib.chmod(0o700)
    if damage == "truncated":
        os.truncate(lib, 4096)
    elif damage == "empty":
        os.truncate(lib, 0)
    elif damage == "garbage":
        lib.write_bytes(np.random.default_rng(0).bytes(lib.stat().st_size))
    elif damage == "other library":
        (tmp_path / "tmp.so").write_bytes(flipped_library)
        os.replace(tmp_path / "tmp.so", lib)
    else:
        lib.unlink()
        lib = tmp_path / f"elementwise-{lib.name.split('-')[1]}.so"
        _plant(tmp_path, flipped_library, lib.name)
    code = LION_STEP + "from flatopt.core import native; print(native.status()); print(p.tolist())"
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FLATOPT_CACHE_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    status, values = res.stdout.splitlines()
    assert status.startswith("(True, "), status
    assert values == str([np.float32(0.9).item()] * 10), values
    (built,) = tmp_path.glob("elementwise-*-*.so")
    assert built.name == f"elementwise-{built.name.split('-')[1]}-{hashlib.sha256(built.read_bytes()).hexdigest()}.so"


def test_the_build_is_flushed_before_and_after_its_rename(tmp_path, monkeypatch):
    """The new library's bytes reach the disk before its rename and the directory entry after it: a power loss
    leaves either no library or a whole one."""
    events = []
    fsync, rename = os.fsync, os.rename

    def spy_fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        fsync(fd)

    def spy_rename(src, dst, **kw):
        if str(dst).endswith(".so"):
            events.append("rename")
        rename(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    monkeypatch.setattr(os, "replace", spy_rename)
    ok, where = _status_in(tmp_path, monkeypatch)
    assert ok, where
    assert events == ["fsync file", "rename", "fsync dir"], events


def test_status_never_raises(monkeypatch, tmp_path):
    """Whatever goes wrong while the library is found, built or loaded, ``status()`` answers (and the twins run)."""
    def boom():
        raise ValueError("something unforeseen")

    monkeypatch.setattr(native.platform, "machine", boom)
    ok, why = _status_in(tmp_path, monkeypatch)
    assert not ok and "something unforeseen" in why, why


COUNTING_CC = """#!/bin/sh
case " $* " in *" -o "*) echo build >> "{count}"; sleep 1;; esac
exec cc "$@"
"""


def test_processes_starting_together_compile_once(tmp_path):
    """Four fresh processes on an empty cache: one compiles (a counting compiler, slowed by a second), the others
    wait for it under the lock and load what it built."""
    cc, count, cache = tmp_path / "cc", tmp_path / "count", tmp_path / "cache"
    cc.write_text(COUNTING_CC.format(count=count))
    cc.chmod(0o755)
    env = {**os.environ, "FLATOPT_CACHE_DIR": str(cache), "FLATOPT_CC": str(cc)}
    code = LION_STEP + "from flatopt.core import native; print(native.status()); print(p.tolist())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and outs[0].startswith("(True, "), outs
    assert count.read_text().splitlines() == ["build"]
    assert len(list(cache.glob("*.so"))) == 1


SLOW_CC = """#!/bin/sh
case " $* " in *" -o "*) sleep 60;; esac
exec cc "$@"
"""


def test_a_build_killed_midway_leaves_nothing_for_long(tmp_path, monkeypatch):
    """A process killed while it compiles leaves its temporary; the next build removes it once it is older than
    any build can run (a fresh one, or a file not of our pattern, stays)."""
    cc, cache = tmp_path / "cc", tmp_path / "cache"
    cc.write_text(SLOW_CC)
    cc.chmod(0o755)
    env = {**os.environ, "FLATOPT_CACHE_DIR": str(cache), "FLATOPT_CC": str(cc)}
    proc = subprocess.Popen([sys.executable, "-c", "from flatopt.core import native; native.status()"], env=env,
                            start_new_session=True)  # (its own group: the compiler it runs is killed with it)
    try:
        for _ in range(600):
            left = list(cache.glob("tmp*.so")) if cache.exists() else []
            if left:
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (left,) = left
    old = time.time() - 2 * native_cache.STALE_S
    os.utime(left, (old, old))
    fresh, other = cache / "tmp0123456789abcdef.so", cache / "notours.so"
    fresh.write_bytes(b"")
    other.write_bytes(b"")
    ok, where = _status_in(cache, monkeypatch)
    assert ok, where
    assert not left.exists() and fresh.exists() and other.exists()


# ------------------------------------------------------------------------------------ signed zeros, alignment, NaN

def test_a_negative_zero_lr_or_lr_scale_is_refused():
    """-0.0 is refused wherever an lr or lr_scale is given (its sign would reach -lr, where the compiled pass, the
    twin and the scalar caches keyed on values could not agree), naming it; nothing changes."""
    with pytest.raises(ValueError, match=r"lr_scale\['b'\] must be >= 0, got -0.0"):
        flatopt.Lion(lr=1e-2, weight_decay=0.0, lr_scale={"a": 0.0, "b": -0.0})
    with pytest.raises(ValueError, match="Lion: lr must be >= 0, got -0.0"):
        flatopt.Lion(lr=-0.0)
    with pytest.raises(ValueError, match="-0.0"):
        flatopt.Lion(lr=1e-2).set_lr(-0.0)
    opt = flatopt.Lion(lr=1e-2, lr_scale=lambda name: -0.0)
    p = np.full(4, -0.0, np.float32)
    with pytest.raises(ValueError, match=r"parameter 'a': lr_scale must be finite and >= 0 \(not -0.0\)"):
        opt.step("a", (4,), p, np.array([1, -1, 1, -1], np.float32))
    assert p.view(np.uint32).tolist() == [0x80000000] * 4 and opt.state_dict().params == {}


@pytest.mark.parametrize("order", [(0.0, -0.0), (-0.0, 0.0)], ids=["+0 first", "-0 first"])
def test_the_compiled_scalars_are_keyed_on_their_bits(order):
    """The audit's Lion case below validation (an lr of +0.0, then -0.0, on -0.0 parameters): each call gives the
    twin's bits whatever came before (a cache keyed on values hands the second call the first one's zero)."""
    from flatopt import lion

    cfg = lion.LionConfig(1e-2, (0.9, 0.99), 0.0)
    g = np.array([1, -1, 1, -1], np.float32)

    def run(lr: float, compiled: bool) -> list[int]:
        native.reset()
        if not compiled:
            native._state.update(lib=None, why="switched off by the test")  # noqa: SLF001
        try:
            p = np.full(4, -0.0, np.float32)
            scratch = [np.empty(4, np.float32), np.empty(4, np.float32)]
            lion.Lion.update_fn(np, cfg, lion.Lion.init_fn(np, cfg, (4,), np.float32), p, g, t=1, lr=lr, scratch=scratch)
            return p.view(np.uint32).tolist()
        finally:
            native.reset()

    for lr in order:
        assert run(lr, compiled=True) == run(lr, compiled=False), lr


def test_a_misaligned_buffer_never_reaches_the_compiled_pass():
    """A float32 view at an odd byte offset: refused by validation for param and grad, naming the parameter (the
    registry-wide check is in test_contract.py), and the compiled pass itself declines it (the NumPy path would
    run)."""
    n = 8
    bad = np.zeros(4 * n + 1, np.uint8)[1:].view(np.float32)
    assert not bad.flags.aligned
    ok = np.ones(n, np.float32)
    for p, g, what in [(bad, ok, "param"), (ok.copy(), bad, "grad")]:
        with pytest.raises(ValueError, match=f"parameter 'w': {what} is not aligned"):
            flatopt.Lion(lr=0.1).step("w", (n,), p, g)
    native.reset()
    assert native.status()[0]
    cfg = flatopt.lion.LionConfig(lr=0.1)
    st = flatopt.Lion.init_fn(np, cfg, (n,), np.float32)
    assert not run.native_update(flatopt.lion.DEF, cfg, st, bad, ok, t=1, lr=0.1)
    assert bad.tolist() == [0.0] * n


def test_a_stuck_lock_holder_does_not_hang_the_first_step(tmp_path, monkeypatch):
    """A process that holds the build lock and never lets go: after a bounded wait the twins run, and status() says
    why."""
    import fcntl

    tmp_path.chmod(0o700)
    holder = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        monkeypatch.setattr(native_cache, "STALE_S", 0.3)
        ok, why = _status_in(tmp_path, monkeypatch)
        assert not ok and "held the build lock" in why, why
    finally:
        os.close(holder)

"""The test suite as a maintainer runs it: ``tests/`` never imports ``benchmarks/`` (whose modules need torch), and a
missing optional dependency skips the tests that need it instead of failing the collection."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Each group is what one optional install brings (pyproject's extras, requirements-oracles.txt).
OPTIONAL = {
    "torch": ["torch"],
    "cupy": ["cupy", "cupyx", "cupy_backends"],
    "mpi": ["mpi4py"],
    "hypothesis": ["hypothesis"],
    "mypy": ["mypy"],
    "examples": ["matplotlib", "sklearn"],
    "threadpoolctl": ["threadpoolctl"],
    "ml_dtypes": ["ml_dtypes"],
    "references": ["pytorch_optimizer", "adafactor8bit", "lion_pytorch", "qhoptim", "sophia_opt", "kron_torch",
                   "geoopt", "muon", "transformers", "schedulefree"],
}

# A sitecustomize that makes the named packages unimportable, as if they were not installed.
BLOCKER = textwrap.dedent('''
    import importlib.abc, os, sys
    BLOCK = [n for n in os.environ["FLATOPT_TEST_BLOCK"].split(",") if n]
    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCK):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    for b in BLOCK:
        sys.modules[b] = None  # also ahead of finders placed before ours (pytest's assertion rewriter)
    sys.meta_path.insert(0, Blocker())
''')


def test_no_test_module_imports_the_benchmarks():
    """A statement outside a function that imports ``benchmarks`` runs at collection: forbidden (a test imports a
    benchmark inside its body through ``optional.bench``, which skips when the benchmark's packages are missing)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node.body = []  # a function's body runs inside a test, not at import
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not found, found


# torch alone (the reference packages stay: each fails on its own import of torch), CuPy alone, and every optional
# group at once (a bare install: NumPy and pytest)
MISSING = {"torch": OPTIONAL["torch"], "cupy": OPTIONAL["cupy"], "all": sum(OPTIONAL.values(), [])}


@pytest.mark.parametrize("missing", sorted(MISSING))
def test_collects_without(missing, tmp_path):
    """The whole suite collects with the ``missing`` packages unimportable: no collection error (their tests skip)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, FLATOPT_TEST_BLOCK=",".join(MISSING[missing]),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if "hypothesis" in MISSING[missing]:  # not installed, Hypothesis brings no pytest plugin either
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(TESTS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert proc.returncode == 0 and not errors, errors or proc.stdout[-3000:] + proc.stderr[-3000:]
    probe = subprocess.run([sys.executable, "-c", f"import {MISSING[missing][0]}"], env=env, capture_output=True)
    assert probe.returncode != 0  # the blocker did block


def _collected(*args) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: every test deselected
    return {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_markers_derive_from_what_a_test_uses():
    """pyproject registers the markers (strict); conftest marks a test ``emulated`` by its fixtures, ``oracle`` by a
    fixture that imports a reference package, and both ``slow``; ``-m "not slow"`` leaves the plain ones."""
    codec = "tests/test_codec.py"
    emulated, oracle = f"{codec}::test_cupy_codec_matches_numpy", f"{codec}::test_dynamic_maps_equal_the_original"
    plain = f"{codec}::test_fresh_states_decode_to_zero"
    assert emulated in _collected(codec, "-m", "emulated") and oracle not in _collected(codec, "-m", "emulated")
    assert oracle in _collected(codec, "-m", "oracle") and emulated not in _collected(codec, "-m", "oracle")
    quick = _collected(codec, "-m", "not slow")
    assert plain in quick and emulated not in quick and oracle not in quick
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in ini["addopts"].split()
    assert {m.split(":")[0] for m in ini["markers"]} == {"slow", "emulated", "oracle"}

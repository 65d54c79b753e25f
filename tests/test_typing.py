"""The public API is typed (``flatopt/py.typed``) and passes ``mypy --strict``.

``[tool.mypy]`` in ``pyproject.toml`` lists the public modules (``files``) and the reasons for its few relaxations;
this test runs ``python -m mypy`` on them together with ``tests/typing_usage.py``, a user's script whose
``# type: ignore`` lines are mistakes the annotations must catch.  Any error fails the test.  Skipped when mypy is
not installed (it is pinned in the ``test`` extra).  mypy's cache lives in the temporary folder
(``$TMPDIR/flatopt-mypy-cache``), so a second run is faster than the first (``python -m pytest -q
tests/test_typing.py`` twice re-measures both; figures in benchmarks/README.md).
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

import flatopt

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "tests" / "typing_usage.py"

# public names whose module is not in the checked list, and why
EXEMPT = {
    "TaskError": "a bare RuntimeError subclass defined in the private engine module core/parallel.py: no signature",
}


def _mypy_files() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        files = tomllib.load(f)["tool"]["mypy"]["files"]
    assert isinstance(files, list) and files
    return [str(f) for f in files]


def test_every_public_name_lives_in_a_checked_module() -> None:
    """A new optimizer or helper exported from ``flatopt`` must have its module in ``[tool.mypy] files``."""
    files = {(ROOT / f).resolve() for f in _mypy_files()}
    missing = []
    for name in flatopt.__all__:
        if name in EXEMPT:
            continue
        obj = getattr(flatopt, name)
        mod = obj if isinstance(obj, types.ModuleType) else sys.modules[obj.__module__]
        path = Path(inspect.getfile(mod)).resolve()
        if path not in files:
            missing.append(f"{name} ({path.relative_to(ROOT)})")
    assert not missing, f"add these modules to [tool.mypy] files in pyproject.toml: {missing}"
    for f in files:
        assert f.is_file(), f"[tool.mypy] files lists {f}, which does not exist"


def test_mypy_strict_on_the_public_api() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    cache = Path(tempfile.gettempdir()) / "flatopt-mypy-cache"
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
           "--no-error-summary", "--hide-error-context", *_mypy_files(), str(USAGE.relative_to(ROOT))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and not out, f"mypy --strict failed (exit {proc.returncode}):\n{out}"


def test_typed_usage_runs() -> None:
    """The type-checked user script is real code: it runs."""
    sys.path.insert(0, str(USAGE.parent))
    try:
        spec = importlib.util.spec_from_file_location("typing_usage", USAGE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main()
    finally:
        sys.path.remove(str(USAGE.parent))

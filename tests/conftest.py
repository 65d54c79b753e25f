"""Fixtures shared by the test modules, and the markers derived from what each test uses (pyproject.toml registers
them; ``python -m pytest -q -m "not slow"`` is the quick run):

* ``emulated``: the test runs on the CUDA emulator or the CuPy stand-in when no GPU answers: it requests
  ``gpu_or_emulated`` or another fixture built on ``fakecupy.device_or_emulated``, or its module imports
  ``tests/cuda_emu``;
* ``oracle``: the test, a fixture it requests or a module-level function they call imports a reference
  implementation (``optional.ORACLES``) through ``pytest.importorskip``;
* ``slow``: every ``emulated`` test (the emulator runs each kernel thread on the CPU), and the tests or modules marked
  ``slow`` by hand (a subprocess, a long run).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys

import pytest

from .cuda_emu import fakecupy
from .optional import ORACLES


@pytest.fixture
def gpu_or_emulated():
    """The real GPU when one answers; otherwise CuPy is the stand-in of tests/cuda_emu and the kernels run on its
    emulator, so that CI (which has no GPU) executes the GPU tests too.  Use as
    ``@pytest.mark.usefixtures("gpu_or_emulated")``."""
    yield from fakecupy.device_or_emulated()


def _uses_the_emulator(item) -> bool:
    module = getattr(item, "module", None)
    if any(getattr(v, "__name__", "").startswith(__package__ + ".cuda_emu") for v in vars(module).values()):
        return True
    for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values():
        for d in defs:
            func = inspect.unwrap(d.func)
            if func is fakecupy.device_or_emulated or "device_or_emulated" in func.__code__.co_names:
                return True
    return False


@functools.cache
def _oracle_functions(module_name: str) -> frozenset:
    """The module-level functions of a test module that import a reference implementation, directly or through
    another module-level function they call."""
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    direct, calls = set(), {}
    for name, fn in funcs.items():
        calls[name] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in funcs:
                calls[name].add(node.func.id)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] in ORACLES):
                direct.add(name)
    found, grew = set(direct), True
    while grew:
        grew = False
        for name in funcs:
            if name not in found and calls[name] & found:
                found.add(name)
                grew = True
    return frozenset(found)


def _uses_an_oracle(item) -> bool:
    module = getattr(item, "module", None)
    if module is None:
        return False
    oracles = _oracle_functions(module.__name__)
    return getattr(item, "originalname", item.name) in oracles or bool(oracles & set(item.fixturenames))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _uses_the_emulator(item):
            item.add_marker(pytest.mark.emulated)
            item.add_marker(pytest.mark.slow)
        if _uses_an_oracle(item):
            item.add_marker(pytest.mark.oracle)

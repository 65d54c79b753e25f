"""Fixtures shared by the test modules, and the markers derived from what each test uses (pyproject.toml registers
them; ``python -m pytest -q -m "not slow"`` is the quick run):

* ``emulated``: the test runs on the CUDA emulator or the CuPy stand-in when no GPU answers: it requests
  ``gpu_or_emulated`` or another fixture built on ``fakecupy.device_or_emulated``, or its module imports
  ``tests/cuda_emu``;
* ``oracle``: the test, a fixture it requests or a module-level function they call imports a reference
  implementation (``optional.ORACLES``) through ``pytest.importorskip``;
* ``slow``: every ``emulated`` test (the emulator runs each kernel thread on the CPU), every ``oracle`` test (torch's
  import alone takes seconds: the quick run needs no torch), every test that starts a process (``subprocess``:
  examples, benchmarks, MPI ranks, mypy, a fresh interpreter) or builds the compiled passes afresh (a private
  ``FLATOPT_CACHE_DIR``), or draws Hypothesis examples (``@given``), all found as ``oracle`` is; and the tests
  and modules marked ``slow`` in their source (long runs, thread stress).
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
    module, info = getattr(item, "module", None), getattr(item, "_fixtureinfo", None)
    if module is None or info is None:
        return False
    if any(getattr(v, "__name__", "").startswith(__package__ + ".cuda_emu") for v in vars(module).values()):
        return True
    for defs in info.name2fixturedefs.values():
        for d in defs:
            func = inspect.unwrap(d.func)
            if func is fakecupy.device_or_emulated or "device_or_emulated" in func.__code__.co_names:
                return True
    return False


def _calls_subprocess(node) -> bool:  # subprocess.run(...), subprocess.Popen(...), ...
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess")


def _imports_an_oracle(node) -> bool:  # pytest.importorskip("torch"), ...
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
            and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] in ORACLES)


def _builds_the_library(node) -> bool:  # a private FLATOPT_CACHE_DIR: the compiled passes are built afresh
    return isinstance(node, ast.Constant) and node.value == "FLATOPT_CACHE_DIR"


def _draws_examples(node) -> bool:  # @given(...), on the test or on a function inside it
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "given"


RULES = {"oracle": _imports_an_oracle, "process": _calls_subprocess, "build": _builds_the_library,
         "hypothesis": _draws_examples}


@functools.cache
def _functions_that(module_name: str, rule: str) -> frozenset:
    """The module-level functions (tests, fixtures, helpers) of a test module whose body matches ``RULES[rule]``,
    directly or through another module-level function they call."""
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found, calls = set(), {}
    for name, fn in funcs.items():
        nodes = list(ast.walk(fn))
        called = {n.func.id for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        calls[name] = called & set(funcs)
        if any(RULES[rule](n) for n in nodes):
            found.add(name)
    grew = True
    while grew:
        grew = False
        for name in funcs:
            if name not in found and calls[name] & found:
                found.add(name)
                grew = True
    return frozenset(found)


def _uses(item, rule: str) -> bool:
    """The test, or a fixture it requests, is one of the module's functions that match ``rule``."""
    module = getattr(item, "module", None)
    if module is None:
        return False
    found = _functions_that(module.__name__, rule)
    return getattr(item, "originalname", item.name) in found or bool(found & set(item.fixturenames))


def pytest_collection_modifyitems(config, items):
    for item in items:
        emulated, oracle = _uses_the_emulator(item), _uses(item, "oracle")
        if emulated:
            item.add_marker(pytest.mark.emulated)
        if oracle:
            item.add_marker(pytest.mark.oracle)
        if emulated or oracle or any(_uses(item, rule) for rule in ("hypothesis", "process", "build")):
            item.add_marker(pytest.mark.slow)

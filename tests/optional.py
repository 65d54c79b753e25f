"""Optional test dependencies: a test that needs one skips when it is missing, and no module fails to collect.

* ``given``, ``settings``, ``st``, ``HealthCheck``: Hypothesis's when it is installed; otherwise stand-ins with which
  a module still imports (strategies built at import time absorb every call) and each ``@given`` test is skipped.
* ``bench(name)``: ``benchmarks.<name>``, imported inside a test (``tests/`` never imports ``benchmarks/`` at
  collection), skipping when the benchmark needs a package that is not installed (torch, a reference package).
"""

from __future__ import annotations

import importlib

import pytest

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - exercised with hypothesis uninstalled

    class _Absorb:
        """Whatever a module builds from strategies at import time: every attribute and call gives itself."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    st = HealthCheck = _Absorb()

    def settings(*args, **kwargs):
        return lambda f: f

    def given(*args, **kwargs):
        return pytest.mark.skip(reason="hypothesis is not installed (pip install -e '.[test]')")


def bench(name: str):
    """``benchmarks.<name>``, or a skip naming the missing package it needs."""
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "benchmarks":
            raise
        pytest.skip(f"benchmarks.{name} needs {exc.name}, which is not installed")


# The reference implementations the conformance tests compare against: torch (torch.optim) and the packages of
# requirements-oracles.txt, by import name.  A test that imports one (``pytest.importorskip``) is marked ``oracle``.
ORACLES = ("torch", "transformers", "adafactor8bit", "muon", "kron_torch", "qhoptim", "lion_pytorch",
           "pytorch_optimizer", "sophia_opt", "geoopt", "schedulefree")

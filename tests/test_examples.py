"""Every example runs at a tiny size and shows what it claims."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_train_digits_every_optimizer_learns(tmp_path):
    pytest.importorskip("sklearn")
    mod = _load("train_digits")
    results = mod.main(["--epochs", "3", "--hidden", "32", "--quiet", "--png", str(tmp_path / "loss.png")])
    assert {r["name"] for r in results} == set(mod.optimizer_factories(mod.param_shapes(32)))
    for r in results:
        first = sum(r["curve"][:5]) / 5
        assert r["final_loss"] < 0.5 * first, (r["name"], first, r["final_loss"])
        assert r["test_acc"] > 0.5, r
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "loss.png").stat().st_size > 1000

"""Every example runs at a tiny size and shows what it claims."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
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
    results = mod.main(["--epochs", "5", "--hidden", "32", "--quiet", "--png", str(tmp_path / "loss.png")])
    assert {r["name"] for r in results} == set(mod.optimizer_factories(mod.param_shapes(32)))
    for r in results:
        first = sum(r["curve"][:5]) / 5
        assert r["final_loss"] < 0.7 * first, (r["name"], first, r["final_loss"])
        assert r["test_acc"] > 0.5, r
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "loss.png").stat().st_size > 1000


def test_torch_interop_matches_torch_adamw_step_for_step():
    pytest.importorskip("torch")
    mod = _load("torch_interop")
    diffs = mod.run(steps=20, verbose=False)
    # one rounding difference per step at most, on weights of magnitude < 1, fed back through the gradients
    eps = 2.0**-23
    assert all(d <= 2 * (i + 1) * eps for i, d in enumerate(diffs)), diffs


def test_checkpoint_resume_is_bit_exact_for_every_optimizer():
    pytest.importorskip("sklearn")
    td = _load("train_digits")
    mod = _load("checkpoint_resume")
    for name in td.optimizer_factories(td.param_shapes(16)):
        assert mod.run(name, steps=8, crash_at=3, hidden=16, verbose=False), name


def test_warmup_clip_skip_skips_poisoned_steps_and_learns():
    pytest.importorskip("sklearn")
    _load("train_digits")
    mod = _load("warmup_clip_skip")
    out = mod.run(steps=100, poison_every=10, verbose=False)
    assert out["skipped"] == 10
    assert out["opt"].iteration == 90  # skipped steps changed no counter
    assert all(np.isfinite(p).all() for p in out["params"].values())
    assert np.mean(out["losses"][-10:]) < 0.5 * np.mean(out["losses"][:10])


def test_adafactor8bit_digits_quantized_learns_and_is_leaner():
    pytest.importorskip("sklearn")
    _load("train_digits")
    mod = _load("adafactor8bit_digits")
    results = {r["name"]: r for r in mod.main(["--epochs", "3", "--hidden", "64", "--min-8bit-size", "1024"])}
    for r in results.values():  # the APOLLO hybrid starts slowest: at this tiny size it only has to learn
        factor = 0.95 if r["name"].startswith("hybrid") else 0.7
        assert r["final_loss"] < factor * (sum(r["curve"][:5]) / 5), r["name"]
    assert results["adafactor 8-bit"]["state_bytes_per_param"] < results["adafactor fp32"]["state_bytes_per_param"]
    assert results["adamw-style 8-bit"]["state_bytes_per_param"] < 0.5 * results["adamw-style fp32"][
        "state_bytes_per_param"]


def test_muon_tiny_lm_gradients_are_right():
    """The example's hand-written backward pass against central finite differences (float64)."""
    mod = _load("muon_tiny_lm")
    x, y, vocab = mod.dataset(4)
    shapes = mod.shapes_for(len(vocab), 4, 8)
    p = mod.init(shapes, seed=3, dtype=np.float64)
    xb, yb = x[:16], y[:16]
    _, g = mod.loss_and_grads({n: v.copy() for n, v in p.items()}, shapes, xb, yb)
    rng = np.random.default_rng(0)
    for name in shapes:
        for i in rng.choice(p[name].size, 3, replace=False):
            q = {n: v.copy() for n, v in p.items()}
            q[name][i] += 1e-6
            up, _ = mod.loss_and_grads(q, shapes, xb, yb)
            q[name][i] -= 2e-6
            down, _ = mod.loss_and_grads(q, shapes, xb, yb)
            assert abs((up - down) / 2e-6 - g[name][i]) < 1e-6 + 1e-4 * abs(g[name][i]), (name, i)


def test_muon_tiny_lm_tied_head_is_updated_once_and_learns():
    mod = _load("muon_tiny_lm")
    tied, p_tied = mod.train(mod.make_muon_adamw, steps=100, d=16)
    # the same run without the alias item: a tied name given twice must be exactly one update
    untied, p_untied = mod.train(mod.make_muon_adamw, steps=100, d=16, tied_items=False)
    for n in p_tied:
        assert p_tied[n].tobytes() == p_untied[n].tobytes(), n
    assert np.mean(tied[-5:]) < 0.8 * np.mean(tied[:5])


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    readme = (EXAMPLES.parent / "README.md").read_text()
    start = readme.index("## Quickstart")
    code = readme[readme.index("```python\n", start) + len("```python\n"): readme.index("```", readme.index(
        "```python\n", start) + 10)]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md:quickstart", "exec"), scope)  # noqa: S102 - our own README
    rng = np.random.default_rng(0)  # the quickstart's starting point
    w0, t0 = (rng.standard_normal(512 * 256).astype(np.float32) for _ in range(2))
    start, end = np.abs(w0 - t0).mean(), np.abs(scope["w"] - scope["target"]).mean()
    assert end < 0.5 * start, (start, end)
    assert (tmp_path / "ckpt.npz").exists()

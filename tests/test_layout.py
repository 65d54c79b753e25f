"""The package layout and its import rules (CONTRIBUTING.md "Layout"), and checkpoints written before the move.

Floors, lowest first; a module may import its own room and anything on a lower floor, nothing above:

0. ``flatopt.errors``: a leaf (imports nothing of flatopt);
1. ``flatopt.core``: the engine (imports only ``core`` and ``errors``: no algorithm);
2. the public utilities ``checkpoint``, ``gradients``, ``routing``;
3. the algorithms: single files beside ``adamw.py`` and the family folders; a family imports the engine, the
   utilities, its own folder, and only the other algorithms listed in ``ALGORITHM_USES`` (composition: the 8-bit
   family reuses Adafactor's passes, MuonAdamW routes to AdamW, the Adam family shares adam.py's pieces);
4. ``flatopt.distributed`` (shards any optimizer);
5. ``flatopt/__init__.py``.

Only ``flatopt/core/backend.py`` imports CuPy.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import flatopt

from .helpers import assert_bits_equal, assert_states_equal, make_for, make_params, run_steps
from .registry import REGISTRY

ROOT = pathlib.Path(flatopt.__file__).parent
UTILITIES = {"buffers", "checkpoint", "gradients", "routing", "schedules"}
# composition between algorithms: the 8-bit family reuses Adafactor's passes, MuonAdamW composes AdamW, the Adam
# family's single-file algorithms share adam.py's moments, bias corrections and config checks
ALGORITHM_USES = {"adafactor8bit": {"adafactor"}, "muon": {"adamw"},
                  **{k: {"adam"} for k in ("adamw", "nadamw", "radam", "qhadamw", "lion", "lamb", "mars", "sophia",
                                           "adopt", "ademamix")}}


def _room(mod: str) -> str:
    """``flatopt.core.driver`` -> ``core``; ``flatopt.adamw`` -> ``adamw``; ``flatopt`` -> ``flatopt``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "flatopt"


def _floor(room: str) -> int:
    if room == "errors":
        return 0
    if room == "core":
        return 1
    if room in UTILITIES:
        return 2
    if room == "distributed":
        return 4
    if room == "flatopt":
        return 5
    return 3  # an algorithm


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield path, ".".join(parts), is_pkg


def _imports(path, mod, is_pkg):
    """Every (absolute module, line) that ``path`` imports, also inside functions."""
    tree = ast.parse(path.read_text())
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])
            else:
                base = [node.module]
            base_mod = ".".join(base)
            for a in node.names:  # `from . import x` imports the module flatopt.x when it is one
                sub = f"{base_mod}.{a.name}"
                yield (sub if _is_module(sub) else base_mod), node.lineno


def _is_module(dotted: str) -> bool:
    p = ROOT.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _violations(path, mod, is_pkg):
    here, out = _room(mod), []
    for target, line in _imports(path, mod, is_pkg):
        where = f"{mod}:{line} imports {target}"
        if target.split(".")[0] == "cupy" and mod != "flatopt.core.backend":
            out.append(where + " (only core/backend.py imports CuPy)")
        if not target.startswith("flatopt"):
            continue
        there = _room(target)
        if there == here or _floor(there) < _floor(here):
            continue
        if _floor(here) == _floor(there) == 3 and there in ALGORITHM_USES.get(here, ()):
            continue
        out.append(where)
    return out


def test_import_rules():
    offenders = [v for path, mod, is_pkg in _modules() for v in _violations(path, mod, is_pkg)]
    assert offenders == [], "\n".join(offenders)


def test_no_import_cycles():
    """No module imports (even inside a function) a module that imports it back, directly or not."""
    graph = {mod: {t for t, _ in _imports(path, mod, is_pkg) if t.startswith("flatopt") and t != mod}
             for path, mod, is_pkg in _modules()}
    done, cycles = set(), []

    def visit(mod, stack):
        if mod in stack:
            cycles.append(stack[stack.index(mod):] + [mod])
            return
        if mod in done or mod not in graph:
            return
        for t in sorted(graph[mod]):
            visit(t, stack + [mod])
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])
    assert cycles == []


@pytest.mark.parametrize("source, bad", [
    ("from ..adamw import AdamW\n", True),  # the engine imports an algorithm
    ("from .. import routing\n", True),  # or a public utility
    ("import cupy\n", True),  # CuPy outside core/backend.py
    ("from . import backend\nfrom ..errors import TiedParameterMismatch\n", False),
])
def test_rule_checker_has_teeth(tmp_path, source, bad):
    path = tmp_path / "bad.py"
    path.write_text(source)
    assert bool(_violations(path, "flatopt.core.bad", False)) is bad


def test_no_flat_private_modules_left():
    """The engine lives in core/ and each family in its folder: no ``_x.py`` beside ``adamw.py``."""
    assert sorted(p.name for p in ROOT.glob("_*.py") if p.name != "__init__.py") == []
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))  # the CUDA sources stay in one folder


@pytest.mark.parametrize("name", sorted(n for n in REGISTRY  # (algorithms added after the move have no file)
                                  if (pathlib.Path(__file__).parent / "data" / "pre_layout" / f"{n}.npz").exists()))
def test_checkpoint_written_before_the_move_loads(name):
    """``tests/data/pre_layout/<name>.npz`` was written by the flat-layout code (before the package folders) after
    3 steps of ``run_steps`` over the registry shapes (float32).  It loads into a fresh optimizer, its state comes
    back bit for bit, and the optimizer continues from it."""
    spec = REGISTRY[name]
    path = pathlib.Path(__file__).parent / "data" / "pre_layout" / f"{name}.npz"
    if not path.exists():
        pytest.skip(f"{name} is newer than the layout move: no checkpoint of the flat layout")
    state = flatopt.load(path)
    assert "lr" not in state.extra  # (written before the lr in effect was recorded: the lr stays the object's)
    params = make_params(spec.shapes, np.float32)
    opt = make_for(spec, params)
    assert opt.load_state_dict(state), opt.last_load_notes if hasattr(opt, "last_load_notes") else name
    assert opt.state_dict().extra.pop("lr", None) in (None, opt.lr)
    assert_states_equal(_without_lr(opt.state_dict()), state)
    if not name.startswith(("sgd", "adamw")):
        run_steps(opt, params, 2, start=3)
        return
    # IEEE-exact ops only (no BLAS, no transcendental ufunc): the same bits on any CPU, so the new code's own
    # 3 steps reproduce the file, and the loaded optimizer continues exactly as the uninterrupted one
    fresh, params = make_for(spec, make_params(spec.shapes, np.float32)), make_params(spec.shapes, np.float32)
    run_steps(fresh, params, 3)
    assert_states_equal(_without_lr(fresh.state_dict()), state)
    resumed = {n: (s, p.copy()) for n, (s, p) in params.items()}
    run_steps(fresh, params, 2, start=3)
    run_steps(opt, resumed, 2, start=3)
    for n in params:
        assert_bits_equal(params[n][1], resumed[n][1], n)


def _without_lr(st):
    """``st`` without the lr in effect (``extra["lr"]``, a routed snapshot's groups' too), which the pre-layout
    files predate."""
    st.extra.pop("lr", None)
    for group in st.extra.get("groups", {}).values():
        group["extra"].pop("lr", None)
    return st

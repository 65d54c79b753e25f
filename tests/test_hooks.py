"""The driver's extension points are one typed object (``core.hooks.Hooks``), not driver methods overridden with other
signatures or found by identity checks on overrides."""

from __future__ import annotations

import pathlib
import re

import flatopt
from flatopt.core.driver import PerParamOptimizer
from flatopt.core.hooks import Hooks

from .registry import REGISTRY

# the driver's stepping methods an algorithm used to override (now the defaults of, or replaced through, its hooks)
DRIVER_STEPPING = ("_init", "_init_named", "_update", "_kernel_update", "_effective_lr", "_run", "_execute",
                   "_prepare", "_check_items", "_check_shape", "_create_states", "_forget_plans")


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_no_algorithm_overrides_a_driver_stepping_method():
    for spec in REGISTRY.values():
        spec.make()  # import every family
    import flatopt.distributed  # noqa: F401 - a subclass too

    subs = [c for c in _subclasses(PerParamOptimizer) if c.__module__.startswith("flatopt.")]
    assert len(subs) >= 15
    bad = [f"{c.__qualname__}.{m}" for c in subs for m in DRIVER_STEPPING if m in vars(c)]
    assert not bad, bad


def test_every_optimizer_holds_typed_hooks():
    for name, spec in REGISTRY.items():
        opt = spec.make()
        inner = [opt] if isinstance(opt, PerParamOptimizer) else [
            v for v in vars(opt).values() if isinstance(v, PerParamOptimizer)]
        for o in inner:
            assert type(o.hooks) is Hooks, name
            assert callable(o.hooks.init) and callable(o.hooks.update) and callable(o.hooks.effective_lr), name


def test_no_override_identity_checks_or_ignored_override_errors():
    root = pathlib.Path(flatopt.__file__).parent
    text = {p: p.read_text() for p in root.rglob("*.py")}
    assert not [str(p) for p, t in text.items() if re.search(r"\bis PerParamOptimizer\.", t)]
    assert not [str(p) for p, t in text.items() if "type: ignore[override]" in t]


def test_a_replaced_update_takes_chunks():
    """``Hooks.ranges`` (the update cuts long ranges itself) holds for the generated algorithms' own update only: a
    replaced ``update`` gets cache-sized chunks again unless it says otherwise."""
    opt = flatopt.AdamW()
    assert opt.hooks.ranges and flatopt.Sophia().hooks.ranges and not flatopt.Lamb().hooks.ranges
    assert not flatopt.Adafactor().hooks.ranges
    assert not opt.hooks.replace(update=opt.hooks.update).ranges
    assert opt.hooks.replace(update=opt.hooks.update, ranges=True).ranges
    assert opt.hooks.replace(check_shape=opt.hooks.check_shape).ranges


def test_replacing_a_hook_changes_only_this_object():
    import numpy as np

    a, b = flatopt.Stiefel(lr=0.1), flatopt.Stiefel(lr=0.1)
    seen = []
    own = a.hooks.check_shape
    a.hooks = a.hooks.replace(check_shape=lambda name, shape: (seen.append((name, shape)), own(name, shape)))
    assert b.hooks.check_shape is not a.hooks.check_shape
    rng = np.random.default_rng(0)
    g = rng.standard_normal(12).astype(np.float32)
    for opt in (a, b):
        p = np.linalg.qr(rng.standard_normal((4, 3)))[0].astype(np.float32).reshape(-1)
        opt.step("w", (4, 3), p, g)
    assert seen == [("w", (4, 3))]
    for opt in (a, b):  # Stiefel's own check still runs in both
        try:
            opt.step("v", (6,), np.zeros(6, np.float32), np.ones(6, np.float32))
        except ValueError as exc:
            assert "'v'" in str(exc)
        else:
            raise AssertionError("Stiefel's own shape check did not run")


def test_private_reads_across_modules_are_justified_and_no_cache_hides_in_dict():
    """Every remaining read of another object's private attribute says why (``noqa: SLF001 - reason``), and no module
    stores a cache in another object's ``__dict__``."""
    root = pathlib.Path(flatopt.__file__).parent
    bare, dicts = [], []
    for p in root.rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if "noqa: SLF001" in line and "noqa: SLF001 - " not in line:
                bare.append(f"{p.relative_to(root)}:{i}")
            if re.search(r"(?<!cls)\.__dict__\.(setdefault|get|pop)\(|(?<!cls)\.__dict__\[", line):
                dicts.append(f"{p.relative_to(root)}:{i}")
    assert not bare, bare
    assert not dicts, dicts


def test_no_unread_state_cls():
    """``state_cls`` was set by every algorithm and read by nothing: it is gone (the state is what ``init`` builds)."""
    for spec in REGISTRY.values():
        spec.make()
    assert not [c.__qualname__ for c in [PerParamOptimizer, *_subclasses(PerParamOptimizer)] if "state_cls" in vars(c)]
    assert "state_cls" not in PerParamOptimizer.__annotations__

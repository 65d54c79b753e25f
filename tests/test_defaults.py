"""Constructor defaults are written once, in each algorithm's config dataclass: the constructor's defaults refer to
it, and ``help()``'s signature line is derived from the constructor (``core.driver.signature_line``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys

import pytest

import flatopt
from flatopt.core.driver import COMMON_KEYWORDS, signature_line

CLASSES = ["Sophia", "Lamb", "Mars", "Stiefel", "Soap", "KronPsgd", "Muon", "Adafactor", "Adafactor8Bit"]


@pytest.mark.parametrize("name", CLASSES)
def test_constructor_defaults_are_the_config_defaults(name):
    cls = getattr(flatopt, name)
    fields = {f.name: f.default for f in dataclasses.fields(cls.config_cls)}
    params = inspect.signature(cls).parameters
    shared = [p for p in params if p in fields]
    assert shared
    for p in shared:
        default = params[p].default
        if default is inspect.Parameter.empty:
            assert fields[p] is dataclasses.MISSING, (name, p)
        else:
            assert default == fields[p] and type(default) is type(fields[p]), (name, p)


@pytest.mark.parametrize("name", CLASSES)
def test_constructor_source_does_not_repeat_a_default(name):
    cls = getattr(flatopt, name)
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    fields = {f.name for f in dataclasses.fields(cls.config_cls)}
    a = init.args
    pos = a.posonlyargs + a.args
    pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + [
        (k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    literal = [arg.arg for arg, d in pairs if arg.arg in fields and not isinstance(d, ast.Attribute)]
    assert not literal, f"{name}: defaults written again in __init__: {literal}"
    own = ast.get_docstring(node) or ""
    head = own[:own.index(")``") + 3] if own.startswith(f"``{name}(") else ""
    assert "=" not in head, f"{name}: the class docstring repeats the defaults: {head}"


@pytest.mark.parametrize("name", CLASSES + ["AdamW", "SGD"])
def test_help_shows_the_derived_signature(name):
    cls = getattr(flatopt, name)
    line = signature_line(cls)
    assert " ".join(cls.__doc__.split()).startswith(f"``{line}``"), cls.__doc__[:200]
    assert "lr_scale" not in line and "weight_decay_mask" not in line and "precision" not in line
    assert "``precision``" in cls.__doc__  # the shared keywords, described after the module doc
    for p in inspect.signature(cls).parameters.values():
        if p.default is not p.empty and p.name not in COMMON_KEYWORDS:
            assert f"{p.name}={p.default!r}" in line

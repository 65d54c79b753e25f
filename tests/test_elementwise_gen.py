"""The generated sources (``flatopt/kernels/generated/``) are current: regenerating them from the definitions
changes nothing; ``python -m flatopt.core.elementwise show`` prints every lowering; a data-dependent branch in a
step is refused with a clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flatopt  # noqa: F401 - registers the definitions
from flatopt.core.elementwise import REGISTRY, trace
from flatopt.core.elementwise.define import Definition
from flatopt.core.elementwise.__main__ import OUT, sources


def test_snapshots_are_current():
    gen = sources()
    on_disk = {p.name: p.read_text() for p in OUT.iterdir() if p.suffix in (".c", ".cu")}
    assert sorted(on_disk) == sorted(gen), "one snapshot per generated file"
    stale = [name for name, text in gen.items() if on_disk[name] != text]
    assert not stale, f"regenerate with `python -m flatopt.core.elementwise regen`: {stale}"


@pytest.mark.parametrize("lowering", ["trace", "numpy", "c", "cuda"])
def test_show_prints_each_lowering(lowering):
    res = subprocess.run([sys.executable, "-m", "flatopt.core.elementwise", "show", "adamw", lowering],
                         capture_output=True, text=True, check=True)
    assert "adamw" in res.stdout or "sqrt" in res.stdout


def test_data_dependent_branch_is_refused():
    def step(e, p, g, m, *, s, f):
        if g > 0:  # a branch on the data
            p = p + g
        return dict(p=p, m=m)

    d = Definition("branchy", step, scalars=lambda c, t, lr: {"a": 1.0}, flags=lambda c, t: {},
                          flag_names=(), slots=("m",), example=None)
    REGISTRY.pop("branchy", None)
    with pytest.raises(trace.DataDependentBranch, match=r"data-dependent branch in branchy\.step"):
        d.program({})

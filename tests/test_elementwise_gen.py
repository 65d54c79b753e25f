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


@pytest.mark.parametrize("order", [(0.0, -0.0), (-0.0, 0.0)], ids=["+0 first", "-0 first"])
def test_the_scalar_caches_key_on_the_sign_of_lr(order):
    """``-0.0 == 0.0``, but ``-lr`` differs in its bits: each lr gets its own scalars (C struct, NumPy values)
    whatever ran before (Lion: neg_lr = -lr)."""
    import math

    import numpy as np

    from flatopt import lion
    from flatopt.core.elementwise import run

    cfg = lion.LionConfig(1e-2, (0.9, 0.99), 0.0)
    for lr in order:
        want = math.copysign(1.0, -lr)
        assert math.copysign(1.0, run.values(lion.DEF, cfg, 1, lr).sc["neg_lr"]) == want
        packed = np.frombuffer(run.values(lion.DEF, cfg, 1, lr).packed, np.float64)
        assert math.copysign(1.0, packed[lion.DEF.scalar_names.index("neg_lr")]) == want
        p = np.full(4, -0.0, np.float32)
        g = np.array([1, -1, 1, -1], np.float32)
        scratch = [np.empty(4, np.float32) for _ in range(2)]
        run.numpy_update(lion.DEF, np, cfg, lion.Lion.init_fn(np, cfg, (4,), np.float32), p, g, t=1, lr=lr,
                         scratch=scratch)
        expect = np.float32(-0.0) + np.sign(np.float32(0.1) * g) * np.float32(-lr)
        assert p.view(np.uint32).tolist() == expect.view(np.uint32).tolist(), lr


def test_host_values_reach_every_path_and_key_its_caches():
    """A definition with per-parameter host values (ScheduleFreeAdamW's averaging weight ckp1): the NumPy path, the
    compiled pass and the multi-tensor arguments take them from ``lr = (lr, ckp1)``, and the scalar caches key on
    them (two weights at the same config, t and lr give two results); the traced shape does not depend on them."""
    import numpy as np

    from flatopt import schedulefree as sf
    from flatopt.core.elementwise import run

    cfg = sf.ScheduleFreeAdamWConfig(weight_decay=0.01)
    r = np.random.default_rng(0)
    n = 64
    p0, g, z = (r.standard_normal(n).astype(np.float32) for _ in range(3))
    got = {}
    for ck in (0.25, 0.3, 0.25):
        for path in ("numpy", "native"):
            st = sf.ScheduleFreeAdamW.init_fn(np, cfg, (n,), np.float32)
            st.z[:] = z
            p = p0.copy()
            if path == "native":
                assert run.native_update(sf.DEF, cfg, st, p, g, t=3, lr=(0.01, ck))
            else:
                scratch = [np.empty(n, np.float32) for _ in range(run.scratch_needed(sf.DEF))]
                run.numpy_update(sf.DEF, np, cfg, st, p, g, t=3, lr=(0.01, ck), scratch=scratch)
            got.setdefault(ck, set()).add(p.tobytes())
    assert len(got[0.25]) == 1 and len(got[0.3]) == 1 and got[0.25] != got[0.3]
    shapes = {trace.trace_scalars(sf.scalars, cfg, 3, (ck,))[0] for ck in (0.25, 0.3, 1.0)}
    assert shapes == {run.generated_shape(sf.DEF)}
    assert sf.ScheduleFreeAdamW.multi_tensor.kernels(cfg, 3, (0.25,)) != \
        sf.ScheduleFreeAdamW.multi_tensor.kernels(cfg, 3, (0.3,))


def test_the_numpy_path_passes_out_as_numpy_asks():
    """Every NumPy lowering of every registered definition runs without a DeprecationWarning (NumPy 2.4 deprecates a
    positional ``out`` for ``maximum``/``minimum``: AdamW's amsgrad, Adopt's floor and clip, Sophia's ratio); a flag
    set with a sum runs its split's reduce programs (one per level) and its map program (``reduce.py``)."""
    import warnings

    import numpy as np

    from flatopt.core.elementwise import lower_numpy, run

    def runners(d, fs):
        sp = d.split_at(fs)
        if sp is None:
            return [run._runner(d, fs, np)]  # noqa: SLF001
        return [*(lower_numpy.Runner(lower_numpy.allocate(lv.reduce), np, tuple(d.arrays) + lv.sums)
                  for lv in sp.levels), lower_numpy.Runner(lower_numpy.allocate(sp.map), np, tuple(d.arrays))]

    for d in REGISTRY.values():
        for f in d.flag_sets():
            for r in runners(d, d.index(f)):
                arrays = [np.full(8, 0.5, np.float32) for _ in r.names]
                scratch = [np.empty(8, np.float32) for _ in range(r.plan.scratch)]
                bools = [np.empty(8, bool) for _ in range(r.plan.bools)]
                sp = d.split_at(d.index(f))
                sc = {k: np.float32(0.5) for k in (*d.scalar_names, *(sp.folds if sp else ()))}
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)
                    r.run(arrays, sc, scratch, bools, np.float32)
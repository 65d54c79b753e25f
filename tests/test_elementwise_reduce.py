"""The reduce-then-map stage of the elementwise generator (``core/elementwise/reduce.py``), on a test-only
definition: the split of a traced step at its sums, and the NumPy lowerings (phases on the threads, rows of small
tensors, a whole tensor through ``sqsum.sq_sum``) against a direct NumPy transcription, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flatopt.core import blocks, sqsum
from flatopt.core.elementwise import reduce, run
from flatopt.core.elementwise.define import Definition


@dataclasses.dataclass(frozen=True)
class Cfg:
    lr: float = 0.1
    beta: float = 0.9
    wd: float = 0.0


@dataclasses.dataclass
class St:
    m: np.ndarray
    work: np.ndarray = None


def scalars(cfg, t, lr):
    return dict(b=cfg.beta, neg_lr=-lr, wd=cfg.wd)


def flags(cfg, t):
    return dict(wd=cfg.wd != 0)


def step(e, p, g, m, *, s, f):
    """m = b·m + g; ‖m‖; the clip factor 1/‖m‖ over 1 (else 1); p += m·(k·(−lr)); with wd also Σ p·g (a sum of
    any value, not a square) in the ratio."""
    m = m * s.b + g
    nrm = e.sqrt(e.sumsq(m))
    k = e.where(nrm > 1, 1 / nrm, 1)
    if f.wd:
        k = k * e.maximum(e.sum(p * g), 0) * s.wd
    p = p + m * (k * s.neg_lr)
    return dict(p=p, m=m)


DEF = Definition("reduce_test", step, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m",),
                        example=Cfg(), register=False)
BOUND = run.bind_reduce(DEF)


def reference(cfg, p, g, m, lr):
    """The step by hand: the sums through ``sqsum.sq_sum`` (the blocked order), the rest one ufunc at a time."""
    dt = p.dtype.type
    n = p.size
    m[...] = m * dt(cfg.beta) + g
    buf = sqsum.sq_scratch(np, n, p.dtype)
    np.multiply(m, m, buf[:n])
    with np.errstate(all="ignore"):
        nrm = np.sqrt(sqsum.sq_sum(np, buf, n)[0])
        k = np.where(nrm > 1, dt(1) / nrm, dt(1))
        if cfg.wd:
            buf = sqsum.sq_scratch(np, n, p.dtype)
            np.multiply(p, g, buf[:n])
            k = k * np.maximum(sqsum.sq_sum(np, buf, n)[0], dt(0)) * dt(cfg.wd)
        p[...] = p + m * (k * dt(-lr))


def test_split_structure():
    sp = DEF.split_at(0)
    assert sp.first == ("m",)  # the reduce phase writes m (no sum changes it); the map reads it back
    assert sp.sums == ("_sum0",)
    assert [i.op for i in sp.reduce.instrs] == ["mul", "add", "mul"]
    assert [i.op for i in sp.fold.instrs] == ["sqrt", "gt", "div", "where", "mul"]
    assert [i.op for i in sp.map.instrs] == ["mul", "add"] and sp.map.reads == ("p", "m")
    assert sp.map.scalars == ("fold0",)
    sp1 = DEF.split_at(1)
    assert sp1.sums == ("_sum0", "_sum1")
    assert DEF.has_sums()


def test_split_refuses_nested_sums():
    def bad(e, p, g, m, *, s, f):
        a = e.sum(g)
        return dict(p=p + e.sum(g * a))

    d = Definition("reduce_bad", bad, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m",),
                          example=Cfg(), register=False)
    with pytest.raises(ValueError, match="depends on another sum"):
        d.split_at(0)


def _data(n, dt, seed):
    rng = np.random.default_rng(seed)
    p, g, m = (rng.standard_normal(n).astype(dt) for _ in range(3))
    g[: min(n, 3)] = [np.float32(1e-40), -0.0, 3.0][: min(n, 3)]
    return p, g, m


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("wd", [0.0, 0.5])
@pytest.mark.parametrize("n", [1, 700, 4096 * 3 + 17, 300_000])
def test_numpy_paths_match_reference(dt, wd, n):
    cfg = Cfg(wd=wd)
    p0, g, m0 = _data(n, dt, n)
    want_p, want_m = p0.copy(), m0.copy()
    reference(cfg, want_p, g, want_m, cfg.lr)
    for chunk in (1 << 17, 1000):
        p, st = p0.copy(), St(m0.copy())
        blocks.run_serial(BOUND["np_phases_fn"](cfg, st, p, g, t=1, lr=cfg.lr, chunk=chunk))
        assert p.tobytes() == want_p.tobytes() and st.m.tobytes() == want_m.tobytes(), chunk
    p, st = p0.copy(), St(m0.copy())
    reduce.xp_update(DEF, DEF.flags_of(cfg, 1), np, (p, g, st.m), st, run.values(DEF, cfg, 1, cfg.lr).cast(p.dtype))
    assert p.tobytes() == want_p.tobytes() and st.m.tobytes() == want_m.tobytes()


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_rows_match_reference(dt):
    cfg = Cfg(wd=0.5)
    rows, n = 5, 3000
    P, G, M = (np.stack(x) for x in zip(*(_data(n, dt, s) for s in range(rows))))
    want = [(P[i].copy(), M[i].copy()) for i in range(rows)]
    for i, (wp, wm) in enumerate(want):
        reference(cfg, wp, G[i], wm, cfg.lr)
    st = St(M.copy())
    P2 = P.copy()
    BOUND["np_rows_fn"](cfg, st, P2, G, t=1, lr=cfg.lr, work={})
    for i, (wp, wm) in enumerate(want):
        assert P2[i].tobytes() == wp.tobytes() and st.m[i].tobytes() == wm.tobytes(), i

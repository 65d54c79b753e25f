"""The reduce-then-map stage of the elementwise generator (``core/elementwise/reduce.py``), on test-only
definitions: the split of a traced step at its sums (one level, and two ordered levels: a sum of a value made from
another sum), and the NumPy lowerings (phases on the threads, rows of small tensors, a whole tensor through
``sqsum.sq_sum``) against a direct NumPy transcription, bit for bit."""

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
    assert len(sp.levels) == 1
    assert [i.op for i in sp.levels[0].reduce.instrs] == ["mul", "add", "mul"]
    assert [i.op for i in sp.levels[0].fold.instrs] == ["sqrt", "gt", "div", "where", "mul"]
    assert [i.op for i in sp.map.instrs] == ["mul", "add"] and sp.map.reads == ("p", "m")
    assert sp.map.scalars == ("fold0",)
    sp1 = DEF.split_at(1)
    assert sp1.sums == ("_sum0", "_sum1")
    assert DEF.has_sums()


def step2(e, p, g, m, *, s, f):
    """Two reduction levels: c = g/N, N = max(‖g‖, 1); m = b·m + c; then the count of m·g > 0, a sum of a value that
    depends on the first sum; p += m·(((count + 1)/N)·(−lr)) (the second fold reads the first's N)."""
    nrm = e.maximum(e.sqrt(e.sumsq(g)), 1)
    m = m * s.b + g / nrm
    count = e.sum(e.cast(m * g > 0))
    p = p + m * (((count + 1) / nrm) * s.neg_lr)
    return dict(p=p, m=m)


DEF2 = Definition("reduce_test2", step2, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m",),
                  example=Cfg(), register=False)
BOUND2 = run.bind_reduce(DEF2)


def _blocked_sum(x):
    """The sum of ``x``'s terms in the blocked order (``sqsum.sq_sum``)."""
    buf = sqsum.sq_scratch(np, x.size, x.dtype)
    buf[:x.size] = x
    return sqsum.sq_sum(np, buf, x.size)[0]


def reference2(cfg, p, g, m, lr):
    """``step2`` by hand: each sum through ``sqsum.sq_sum``, the second after the first's fold."""
    dt = p.dtype.type
    nrm = np.maximum(np.sqrt(_blocked_sum(g * g)), dt(1))
    m[...] = m * dt(cfg.beta) + g / nrm
    count = _blocked_sum((m * g > 0).astype(p.dtype))
    p[...] = p + m * (((count + dt(1)) / nrm) * dt(-lr))


def test_split_orders_dependent_sums_in_levels():
    sp = DEF2.split_at(0)
    assert len(sp.levels) == 2 and sp.sums == ("_sum0", "_sum1") and sp.folds == ("fold0", "fold1")
    first, second = sp.levels
    assert first.sums == ("_sum0",) and first.reduce.scalars == () and first.fold.outputs[0][0] == "fold0"
    assert second.sums == ("_sum1",) and second.reduce.scalars == ("b", "fold0")  # m made again from the fold
    assert second.reduce.reads == ("g", "m") and second.first == () and sp.first == ()
    assert sp.map.scalars == ("b", "fold0", "fold1")
    assert second.fold.scalars == ("neg_lr", "fold0")  # ((count + 1)/N)·(−lr): N is the first fold's


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 4096 * 3 + 17, 300_000])
def test_two_levels_match_reference(dt, n):
    cfg = Cfg()
    p0, g, m0 = _data(n, dt, n)
    g *= dt(0.01)  # ‖g‖ near 1 at some sizes, over it at others
    _phases_and_whole_tensor(DEF2, BOUND2, reference2, cfg, p0, g, m0)
    if n <= 20_000:
        _two_rows(BOUND2, reference2, cfg, p0, g, m0)


def _two_rows(bound, ref, cfg, p0, g, m0):
    """The rows form on two rows (the data and its reverse) gives ``ref``'s bits per row."""
    P, G, M = (np.stack([x, x[::-1].copy()]) for x in (p0, g, m0))
    st = St(M.copy())
    bound["np_rows_fn"](cfg, st, P, G, t=1, lr=cfg.lr, work={})
    for i in range(2):
        wp, wm = (p0 if i == 0 else p0[::-1]).copy(), M[i].copy()
        ref(cfg, wp, G[i], wm, cfg.lr)
        assert P[i].tobytes() == wp.tobytes() and st.m[i].tobytes() == wm.tobytes(), i


def _phases_and_whole_tensor(d, bound, ref, cfg, p0, g, m0):
    """The phases (two chunk sizes) and the whole-tensor form of ``d`` give ``ref``'s bits."""
    want_p, want_m = p0.copy(), m0.copy()
    ref(cfg, want_p, g, want_m, cfg.lr)
    for chunk in (1 << 17, 1000):
        p, st = p0.copy(), St(m0.copy())
        blocks.run_serial(bound["np_phases_fn"](cfg, st, p, g, t=1, lr=cfg.lr, chunk=chunk))
        assert p.tobytes() == want_p.tobytes() and st.m.tobytes() == want_m.tobytes(), chunk
    p, st = p0.copy(), St(m0.copy())
    reduce.xp_update(d, d.flags_of(cfg, 1), np, (p, g, st.m), st, run.values(d, cfg, 1, cfg.lr).cast(p.dtype))
    assert p.tobytes() == want_p.tobytes() and st.m.tobytes() == want_m.tobytes()


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
    _phases_and_whole_tensor(DEF, BOUND, reference, cfg, p0, g, m0)


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


@pytest.mark.parametrize("n", [1, 5000, 70_001])
def test_two_levels_emulated_kernels(n, tmp_path, monkeypatch):
    """The CUDA lowering of the two-level definition (``emit.cuda_source``: each level's partials and fold, the
    second level reading the first's ``scal``, then the map), launched per tensor by ``run.kernel_update``, on
    the CPU emulator of ``tests/cuda_emu``: the bits of the direct transcription."""
    from flatopt.core import kernels  # noqa: PLC0415
    from flatopt.core.elementwise import emit  # noqa: PLC0415

    from .cuda_emu import emu, fakecupy  # noqa: PLC0415

    if emu.available() is not None:
        pytest.skip(str(emu.available()))
    cu = tmp_path / "reduce_test2.cu"
    cu.write_text(emit.cuda_source(DEF2, run.generated_shape(DEF2), cu.name))
    names = tuple(emit.cuda_name(DEF2, 0, k) for k in ("partials", "fold", "partials1", "fold1", "map"))
    lib = emu.build_file(cu, names)
    cp = fakecupy.module
    launched = []

    def get(src, name, dtype):
        kern = emu.Kernel(cu.name, f"{name}<{kernels.CTYPES[np.dtype(dtype)]}>", lib=lib)
        launched.append(name)
        return lambda grid, block, args: kern(grid, block, tuple(np.dtype(dtype).type(a) if isinstance(a, float)
                                                                else a for a in args))

    monkeypatch.setattr(run.kernels, "get", get)
    monkeypatch.setattr(run.backend, "cupy", lambda: cp)
    cfg = Cfg()
    for dt in (np.float32, np.float64):
        p0, g, m0 = _data(n, dt, n)
        g *= dt(0.01)
        want_p, want_m = p0.copy(), m0.copy()
        reference2(cfg, want_p, g, want_m, cfg.lr)
        p, st = cp.asarray(p0.copy()), St(cp.asarray(m0.copy()))
        assert run.kernel_update(DEF2, cfg, st, p, cp.asarray(g), t=1, lr=cfg.lr)
        assert p.get().tobytes() == want_p.tobytes() and st.m.get().tobytes() == want_m.tobytes(), dt
    assert launched[:5] == list(names)  # 2 levels: 2·2 + 1 launches, in order


def step3(e, p, g, m, *, s, f):
    """Two levels where the second reduce phase computes a value the map needs: c = g/N, N = max(‖g‖, 1); the count
    of c·m > 0; p += c·((count + 1)·(−lr)); m = b·m + c."""
    c = g / e.maximum(e.sqrt(e.sumsq(g)), 1)
    count = e.sum(e.cast(c * m > 0))
    p = p + c * ((count + 1) * s.neg_lr)
    return dict(p=p, m=m * s.b + c)


DEF3 = Definition("reduce_test3", step3, scalars=scalars, flags=flags, flag_names=("wd",), slots=("m",),
                  example=Cfg(), register=False)
BOUND3 = run.bind_reduce(DEF3)


def reference3(cfg, p, g, m, lr):
    """``step3`` by hand."""
    dt = p.dtype.type
    c = g / np.maximum(np.sqrt(_blocked_sum(g * g)), dt(1))
    count = _blocked_sum((c * m > 0).astype(p.dtype))
    p[...] = p + c * ((count + dt(1)) * dt(-lr))
    m[...] = m * dt(cfg.beta) + c


def test_carry_form():
    """The rows and whole-tensor forms keep what a reduce phase computes and a later part needs (``_carry<j>``)
    instead of recomputing it, only where that takes no more scratch buffers and fewer operations; the phases
    form and the compiled lowerings keep the plain programs."""
    from flatopt.core.elementwise import lower_numpy  # noqa: PLC0415
    from flatopt.core.elementwise.define import REGISTRY  # noqa: PLC0415

    first, second = DEF3.split_at(0).levels
    sp = DEF3.split_at(0)
    assert first.carry == () and second.carry == ("_carry0",) and sp.carry == ("_carry0",)
    assert [i.op for i in second.carrying.instrs] == ["div", "mul", "gt", "cast"]  # c = g/N, once
    assert "g" not in sp.carried_map.reads and "_carry0" in sp.carried_map.reads and "g" in sp.map.reads
    assert DEF.split_at(0).carried_map is None  # the map reads m back: nothing to carry
    lamb, mars = REGISTRY["lamb"], REGISTRY["mars"]
    for d, f in [(lamb, dict(wd=False, cautious=False)), (lamb, dict(wd=True, cautious=False)),
                 (mars, dict(wd=False, clip=True, cautious=False)), (mars, dict(wd=True, clip=True, cautious=False))]:
        sp = d.split_at(d.index(f))
        assert sp.carry == ("_carry0",), (d.name, f)  # Lamb's direction u, Mars's corrected gradient c
        assert not {"bc1", "bc2", "coef"} & set(sp.carried_map.scalars), (d.name, f)
    for d in REGISTRY.values():
        for f in d.flag_sets():
            sp = d.split_at(d.index(f))
            if sp is None or sp.carried_map is None:
                continue
            plain = [lower_numpy.allocate(q) for q in (*(lv.reduce for lv in sp.levels), sp.map)]
            carry = [lower_numpy.allocate(lv.carrying) for lv in sp.levels] + [
                lower_numpy.allocate(sp.carried_map, sp.carry)]
            assert max(q.scratch for q in carry) + len(sp.carry) <= max(q.scratch for q in plain), (d.name, f)
            assert sum(len(q.steps) + len(q.copies) for q in carry) < sum(
                len(q.steps) + len(q.copies) for q in plain), (d.name, f)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 3000, 70_001])
def test_carry_across_levels_matches_reference(dt, n):
    cfg = Cfg()
    p0, g, m0 = _data(n, dt, n)
    g *= dt(0.01)
    _phases_and_whole_tensor(DEF3, BOUND3, reference3, cfg, p0, g, m0)
    if n <= 20_000:
        _two_rows(BOUND3, reference3, cfg, p0, g, m0)

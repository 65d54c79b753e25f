"""The transition test of issue #28: for every ported algorithm, the hand-written paths (``hand_update``,
``hand_kernel_update``, ``HAND_MULTI``) and the paths generated from its definition (``core/elementwise``) give
the same bits on every path — the NumPy path, the compiled C pass, the per-tensor and the multi-tensor CUDA kernels
(emulated when no GPU answers) — over every flag set of the definition (asserted covered), float32 and float64,
with NaN, ±inf, −0 and subnormals in the gradient, the parameter and the state.  Run with ``-s`` to print the
table (algorithm × path × flag set: bits equal).  Removed, with the hand-written code, once every algorithm
matches."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import types

import numpy as np
import pytest

from flatopt import adam, adamw, lion, nadamw, qhadamw, radam, sgd
from flatopt.core import backend, native
from flatopt.core import multi_tensor as mt
from flatopt.core.elementwise import run

from .cuda_emu import fakecupy

PORTED = {"adamw": adamw, "adam": adam, "sgd": sgd, "nadamw": nadamw, "qhadamw": qhadamw, "radam": radam, "lion": lion}
DTYPES = (np.float32, np.float64)
N = 1000
STEPS = 6  # t = 1 .. 6: SGD's first step and the ones after; RAdam (threshold 4, β2 0.9) rectifies from t = 5


def _configs(name: str):
    if name == "sgd":
        for mom, damp, nest, wd in itertools.product((0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.1)):
            if nest and (mom == 0 or damp != 0):
                continue
            yield sgd.SGDConfig(lr=1e-2, momentum=mom, dampening=damp, nesterov=nest, weight_decay=wd)
        return
    if name == "nadamw":
        for wd in (0.0, 0.1):
            yield nadamw.NAdamWConfig(lr=1e-2, betas=(0.8, 0.95), weight_decay=wd)
        return
    if name == "qhadamw":
        for wd, nu1, nu2 in itertools.product((0.0, 0.1), (0.7, 1.0), (0.8, 1.0)):
            yield qhadamw.QHAdamWConfig(lr=1e-2, betas=(0.8, 0.95), nus=(nu1, nu2), weight_decay=wd)
        return
    if name == "radam":
        for wd, dec in itertools.product((0.0, 0.1), (False, True)):
            yield radam.RAdamConfig(lr=1e-2, betas=(0.8, 0.9), weight_decay=wd, decoupled_weight_decay=dec,
                                    threshold=4.0)
        return
    if name == "lion":
        for wd in (0.0, 0.5):
            yield lion.LionConfig(lr=1e-2, betas=(0.8, 0.95), weight_decay=wd)
        return
    cls = adamw.AdamWConfig if name == "adamw" else adam.AdamConfig
    for wd, ams in itertools.product((0.0, 0.1), (False, True)):
        yield cls(lr=1e-2, betas=(0.8, 0.95), weight_decay=wd, amsgrad=ams)


def _specials(rng, n: int, dt, positive: bool = False) -> np.ndarray:
    x = rng.standard_normal(n).astype(dt)
    if positive:
        x = np.abs(x)
    tiny = np.finfo(dt).smallest_subnormal
    x[:8] = [np.nan, np.inf, -np.inf, -0.0, 0.0, tiny, -tiny * 3, np.finfo(dt).tiny / 2]
    if positive:
        x[:8] = np.abs(x[:8])
    rng.shuffle(x)
    return x


def _state(mod, cfg, dt, rng):
    st = mod.init(np, cfg, (N,), dt)
    for f in dataclasses.fields(st):
        a = getattr(st, f.name)
        if a is not None:
            a[...] = _specials(rng, N, dt, positive=f.name in ("v", "vmax"))
    return st


def _copy(st):
    return dataclasses.replace(st, **{f.name: (None if getattr(st, f.name) is None else getattr(st, f.name).copy())
                                      for f in dataclasses.fields(st)})


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _same(xs, ys) -> str:
    """"bits": every element's bits equal; "nan": equal but for the sign or payload of a NaN (NaN in the same
    elements: a compiler may swap the operands of a commutative operation, and x86 passes on the first NaN); else
    "differ"."""
    verdict = "bits"
    for x, y in zip(xs, ys):
        x, y = np.asarray(x), np.asarray(y)
        if _bits(x).tobytes() == _bits(y).tobytes():
            continue
        both_nan = np.isnan(x) & np.isnan(y)
        if not np.array_equal(_bits(x)[~both_nan], _bits(y)[~both_nan]) or not np.array_equal(np.isnan(x),
                                                                                             np.isnan(y)):
            return "differ"
        verdict = "nan"
    return verdict


def _arrays(p, st):
    return [p] + [getattr(st, f.name) for f in dataclasses.fields(st) if getattr(st, f.name) is not None]


def _cases(name):
    mod = PORTED[name]
    for ci, cfg in enumerate(_configs(name)):
        for dt in DTYPES:
            rng = np.random.default_rng(ci * 7 + (dt == np.float64))
            p0 = _specials(rng, N, dt)
            st0 = _state(mod, cfg, dt, rng)
            grads = [_specials(rng, N, dt) for _ in range(STEPS)]
            yield mod, cfg, dt, p0, st0, grads


_RANK = {"bits": 0, "nan": 1, "differ": 2}


def _row(table, name, path, mod, cfg, t, verdict):
    key = (name, path, mod.DEF.flags_of(cfg, t))
    table[key] = max(table.get(key, "bits"), verdict, key=_RANK.get)


CPU_TABLE: dict = {}
GPU_TABLE: dict = {}


@pytest.mark.parametrize("name", sorted(PORTED))
def test_numpy_and_c_pass(name, monkeypatch):
    """NumPy: the hand twin (compiled pass off) against the generated NumPy path; C: the hand-written compiled
    pass (where it had one: amsgrad ran the twin) against the generated loop."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    assert native.status()[0], native.status()[1]
    d = PORTED[name].DEF
    for mod, cfg, dt, p0, st0, grads in _cases(name):
        runs = {}
        for path in ("hand_numpy", "gen_numpy", "hand_c", "gen_c"):
            p, st = p0.copy(), _copy(st0)
            for t, g in enumerate(grads, 1):
                g = g.copy()
                scratch = [np.empty(N, dt) for _ in range(type_of(mod).scratch_buffers)]  # as the driver
                if path == "hand_numpy":
                    with monkeypatch.context() as m:
                        m.setattr(native, "step", lambda *a: False)
                        mod.hand_update(np, cfg, st, p, g, t=t, lr=cfg.lr, scratch=scratch)
                elif path == "gen_numpy":
                    run.numpy_update(d, np, cfg, st, p, g, t=t, lr=cfg.lr, scratch=scratch)
                elif path == "hand_c":
                    mod.hand_update(np, cfg, st, p, g, t=t, lr=cfg.lr, scratch=scratch)
                else:
                    assert run.native_update(d, cfg, st, p, g, t=t, lr=cfg.lr)
                runs.setdefault(path, []).append(_arrays(p, st) and [a.copy() for a in _arrays(p, st)])
        for t in range(1, STEPS + 1):
            _row(CPU_TABLE, name, "numpy", mod, cfg, t, _same(runs["hand_numpy"][t - 1], runs["gen_numpy"][t - 1]))
            _row(CPU_TABLE, name, "c", mod, cfg, t, _same(runs["hand_c"][t - 1], runs["gen_c"][t - 1]))
    covered = {fs for (n, _, fs) in CPU_TABLE if n == name}
    assert covered == {d.index(f) for f in d.plain_flag_sets()}, "every flag set of the definition is exercised"
    bad = [k for k, v in CPU_TABLE.items() if v != "bits" and k[0] == name]
    assert not bad, f"bits differ: {bad}"


@pytest.fixture(scope="module")
def device():
    yield from fakecupy.device_or_emulated()


@pytest.mark.parametrize("name", sorted(PORTED))
def test_kernels(name, device):
    """The per-tensor kernels and the multi-tensor launches (two tensors, chunks of 256, different lr_scales),
    hand-written against generated."""
    cp = backend.cupy()
    mod = PORTED[name]
    d = mod.DEF
    for _, cfg, dt, p0, st0, grads in _cases(name):
        out = {}
        for path in ("hand_step", "gen_step", "hand_multi", "gen_multi"):
            p = cp.asarray(p0)
            st = dataclasses.replace(st0, **{f.name: (None if getattr(st0, f.name) is None else
                                                      cp.asarray(getattr(st0, f.name)))
                                             for f in dataclasses.fields(st0)})
            if path.endswith("multi"):
                spec = mod.HAND_MULTI if path == "hand_multi" else type_of(mod).multi_tensor
                cut = 377
                pv = [p[:cut], p[cut:]]
                sv = [dataclasses.replace(st, **{f.name: (None if getattr(st, f.name) is None else
                                                          getattr(st, f.name)[sl])
                                                 for f in dataclasses.fields(st)})
                      for sl in (slice(0, cut), slice(cut, N))]
            for t, g0 in enumerate(grads, 1):
                g = cp.asarray(g0)
                if path == "hand_step":
                    assert mod.hand_kernel_update(cfg, st, p, g, t=t, lr=cfg.lr)
                elif path == "gen_step":
                    assert type_of(mod).kernel_fn(cfg, st, p, g, t=t, lr=cfg.lr)
                else:
                    gv = [g[:cut], g[cut:]]
                    members = [(pv[k], gv[k], types.SimpleNamespace(state=sv[k]), (0.5, 2.0)[k]) for k in (0, 1)]
                    mt.Group(spec, members, 256).launch(cfg, t, cfg.lr)
                out.setdefault(path, []).append([cp.asnumpy(a) for a in _arrays(p, st)])
        for t in range(1, STEPS + 1):
            _row(GPU_TABLE, name, "cuda_step", mod, cfg, t, _same(out["hand_step"][t - 1], out["gen_step"][t - 1]))
            _row(GPU_TABLE, name, "cuda_multi", mod, cfg, t,
                 _same(out["hand_multi"][t - 1], out["gen_multi"][t - 1]))
    bad = [k for k, v in GPU_TABLE.items() if v == "differ" and k[0] == name]
    assert not bad, f"bits differ: {bad}"


def type_of(mod):
    return {"adamw": mod.__dict__.get("AdamW"), "adam": mod.__dict__.get("Adam"), "sgd": mod.__dict__.get("SGD"),
            "nadamw": mod.__dict__.get("NAdamW"), "qhadamw": mod.__dict__.get("QHAdamW"),
            "radam": mod.__dict__.get("RAdam"), "lion": mod.__dict__.get("Lion")}[mod.__name__.rsplit(".", 1)[-1]]


def test_print_table():
    """The transition table (run with -s): algorithm × path × flag set: bits equal."""
    rows = sorted({**CPU_TABLE, **GPU_TABLE}.items())
    if not rows:
        pytest.skip("run with the tests above")
    print("\nalgorithm  path        flag set                                          bits equal "
          "(nan: but for a NaN's sign or payload)")
    for (name, path, fs), ok in rows:
        f = {n: bool(fs >> k & 1) for k, n in enumerate(PORTED[name].DEF.flag_names)}
        on = ",".join(n for n, v in f.items() if v) or "-"
        print(f"{name:<10} {path:<11} f{fs:<3} {on:<45} {dict(bits='yes', nan='yes (nan)').get(ok, 'NO')}")
    assert all(v != "differ" for _, v in rows)

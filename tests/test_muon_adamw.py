"""flatopt.MuonAdamW: every safety rule of reference/muon.md §4 has a test that fails if the rule is broken, plus
equality with the pair of optimizers run by hand and with torch.optim.AdamW for the AdamW half."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt import errors as E
from flatopt.muon.muon_adamw import propose_muon_names

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

MANIFEST = {"embed": (10, 4), "h0.w": (4, 6), "h0.b": (6,), "h1.w": (6, 4), "norm": (4,), "head": (4, 10)}
MUON = ["h0.w", "h1.w"]


def make(**kw):
    kw.setdefault("params", MANIFEST)
    kw.setdefault("muon_names", MUON)
    return flatopt.MuonAdamW(**kw)


def model(seed=0, dtype=np.float32):
    return {n: rng_arrays(seed + i, s, dtype) for i, (n, s) in enumerate(sorted(MANIFEST.items()))}


def grads(it, names=None, dtype=np.float32):
    return {n: rng_arrays(1000 + 31 * it + i, MANIFEST[n], dtype)
            for i, n in enumerate(sorted(MANIFEST)) if names is None or n in names}


def items_of(params, g):
    return [OptItem(n, MANIFEST[n], params[n], g[n]) for n in sorted(g)]


def snapshot(opt, params):
    return opt.state_dict(), {n: p.copy() for n, p in params.items()}


def assert_unchanged(opt, params, snap):
    state, before = snap
    assert_states_equal(opt.state_dict(), state)
    for n, p in params.items():
        assert_bits_equal(p, before[n], n)


# ----------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("kw, err", [
    (dict(muon_names=[]), E.EmptyMuonGroup),
    (dict(muon_names=["h0.w", "h0.w"]), E.DuplicateParameter),
    (dict(muon_names=["h0.w", "nope"]), E.UnknownParameter),
    (dict(muon_names=["h0.b"]), E.ExpectedMatrix),
    (dict(params={**MANIFEST, "e": (0, 3)}, muon_names=["e"]), E.EmptyMatrix),
    (dict(params={**MANIFEST, "c": (2, 3, 4)}, muon_names=["c"]), E.ExpectedMatrix),
    (dict(adamw_lr_ratio=float("nan")), E.InvalidConfig),
    (dict(adamw_lr_ratio=-1.0), E.InvalidConfig),
    (dict(adamw_lr_ratio=1e39), E.InvalidConfig),
    (dict(muon={"momentum": 1.5}), E.InvalidConfig),
    (dict(muon={"momentum_convention": "torch"}), E.InvalidConfig),
    (dict(adamw={"betas": (0.9, 1.0)}), E.InvalidConfig),
    (dict(lr=-1.0), E.InvalidConfig),
    (dict(params={"a": (2, 2), "b": ((3,), "int32")}, muon_names=["a"]), E.InvalidConfig),
    (dict(aliases={"tied": "nope"}), E.UnknownParameter),
    (dict(aliases={"embed": "head"}), E.DuplicateParameter),
    (dict(aliases={"w0": "h0.w"}, muon_names=["h0.w", "w0"]), E.DuplicateParameter),
])
def test_construction_rejections(kw, err):
    with pytest.raises(err):
        make(**kw)


def test_roles_are_explicit_and_counted():
    opt = make()
    assert opt.muon_parameter_count() == 2  # parameters, not elements (24 + 24)
    roles = {r[0]: r[2] for r in opt.manifest()}
    assert roles["head"] == roles["embed"] == "adamw"  # 2-D but not selected: never inferred from rank
    assert propose_muon_names(MANIFEST) == ["h0.w", "h1.w"]  # a proposal only


# ------------------------------------------------------------------------------------------ equivalence
def test_equals_the_pair_run_by_hand_and_step_batch_equals_step():
    lr, ratio = 0.03, 0.1
    a, b, c = model(), model(), model()
    opt = make(lr=lr, adamw_lr_ratio=ratio, muon={"weight_decay": 0.1}, adamw={"weight_decay": 0.2})
    opt_c = make(lr=lr, adamw_lr_ratio=ratio, muon={"weight_decay": 0.1}, adamw={"weight_decay": 0.2},
                 concurrent=False)
    muon = flatopt.Muon(lr=lr, weight_decay=0.1)
    adamw = flatopt.AdamW(lr=lr * ratio, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.2)  # Keller's aux Adam
    for it in range(4):
        g = grads(it)
        opt.step_batch(items_of(a, g))
        for item in items_of(c, g):
            opt_c.step(*item)
        for n in sorted(g):
            (muon if n in MUON else adamw).step(n, MANIFEST[n], b[n], g[n])
        opt.end_iteration()
        opt_c.end_iteration()
    for n in MANIFEST:
        assert_bits_equal(a[n], b[n], n)
        assert_bits_equal(a[n], c[n], n)
    assert opt.muon_state_count() == 2 and opt.adamw_state_count() == 4


def test_step_and_set_lr_follow_the_ratio():
    a, b = model(), model()
    opt_a, opt_b = make(lr=0.02), make(lr=0.02)
    opt_a.set_lr(0.01)
    assert opt_a.lr == 0.01 and opt_a.adamw.lr == pytest.approx(0.01 * 0.015)
    g = grads(0)
    opt_a.step_batch(items_of(a, g))
    opt_b.try_step_with_lrs(0.01, 0.01 * 0.015, b, g)  # the mapping form
    for n in MANIFEST:
        assert_bits_equal(a[n], b[n], n)
    assert opt_b.lr == 0.02 and opt_b.muon.lr == 0.02  # per-call lrs do not stick


def test_lr_scale_honoured_by_both_groups():
    a, b = model(), model()
    opt_a = make(lr_scale={"h0.w": 0.0, "norm": 0.0})
    opt_b = make()
    g = grads(0)
    opt_a.step_batch(items_of(a, g))
    opt_b.step_batch(items_of(b, g))
    ref = model()
    assert_bits_equal(a["h0.w"], ref["h0.w"])
    assert_bits_equal(a["norm"], ref["norm"])
    assert not np.array_equal(a["h1.w"], ref["h1.w"])
    assert_bits_equal(a["h1.w"], b["h1.w"])


# --------------------------------------------------------------------------------- validate, then commit
def _bad_batches(params):
    g = grads(0)
    bad_adamw = dict(g, norm=g["norm"].astype(np.int32))  # (another float dtype is accepted: widened)
    bad_muon = dict(g, **{"h1.w": g["h1.w"][:-1]})
    yield "bad AdamW gradient (dtype)", E.DTypeMismatch, items_of(params, g)[:-1] + [
        OptItem("norm", (4,), params["norm"], bad_adamw["norm"])]
    yield "bad Muon gradient (size)", E.ShapeMismatch, [
        OptItem(n, MANIFEST[n], params[n], bad_muon[n]) for n in sorted(g)]
    yield "unknown gradient", E.UnusedGradients, items_of(params, g) + [
        OptItem("extra", (3,), np.zeros(3, np.float32), np.zeros(3, np.float32))]
    yield "manifest shape changed", E.ModelChanged, items_of(params, g)[:-1] + [
        OptItem("norm", (2, 2), params["norm"], g["norm"])]
    yield "same name twice", E.DuplicateParameter, items_of(params, g) + [items_of(params, g)[0]]
    yield "strided param", E.InvalidBuffer, items_of(params, g)[:-1] + [
        OptItem("norm", (4,), np.repeat(params["norm"], 2)[::2], g["norm"])]
    yield "grad aliases another param", (E.InvalidStep, E.InvalidBuffer), items_of(params, g)[:-1] + [
        OptItem("norm", (4,), params["norm"], params["h0.b"][:4])]


@pytest.mark.parametrize("k", range(7))
def test_validates_both_groups_before_updating(k):
    params = model()
    why, err, batch = list(_bad_batches(params))[k]
    opt = make()
    snap = snapshot(opt, params)
    with pytest.raises(err):
        opt.step_batch(batch)
    assert opt.muon_state_count() == 0 and opt.adamw_state_count() == 0, why
    assert_unchanged(opt, params, snap)
    # and after some steps: no state moves either
    opt.step_batch(items_of(params, grads(1)))
    params2 = {n: p for n, p in params.items()}
    why, err, batch = list(_bad_batches(params2))[k]
    snap = snapshot(opt, params2)
    with pytest.raises(err):
        opt.step_batch(batch)
    assert_unchanged(opt, params2, snap)


@pytest.mark.parametrize("lrs", [(float("nan"), 0.1), (0.1, -1.0), (1e39, 0.1), (0.1, float("inf")), ("x", 0.1)])
def test_invalid_learning_rates(lrs):
    params, opt = model(), make()
    snap = snapshot(opt, params)
    with pytest.raises(E.InvalidLearningRate):
        opt.try_step_with_lrs(*lrs, params, grads(0))
    assert_unchanged(opt, params, snap)


def test_muon_lr_overflow_after_adjust_is_rejected():
    params, opt = model(), make()
    snap = snapshot(opt, params)
    with pytest.raises(E.InvalidLearningRate):
        opt.try_step_with_lrs(3e38, 0.0, params, grads(0))  # h1.w (6, 4): 3e38 · √1.5 overflows float32
    assert_unchanged(opt, params, snap)


def test_manifest_dtype_is_enforced():
    opt = flatopt.MuonAdamW({"w": ((3, 3), "float64"), "b": (3,)}, ["w"])
    p, g = rng_arrays(0, (3, 3)), rng_arrays(1, (3, 3))
    with pytest.raises(E.DTypeMismatch):
        opt.step("w", (3, 3), p, g)
    opt.step("b", (3,), rng_arrays(2, (3,), np.float64), rng_arrays(3, (3,), np.float64))
    with pytest.raises(E.DTypeMismatch):  # dtype fixed by the first step when the manifest leaves it open
        opt.step("b", (3,), rng_arrays(2, (3,)), rng_arrays(3, (3,)))


# ------------------------------------------------------------------------------------- missing and tied
def test_missing_gradient_is_a_no_op():
    params, ref = model(), model()
    opt = make(muon={"weight_decay": 0.5}, adamw={"weight_decay": 0.5})
    g = grads(0)
    del g["h1.w"], g["head"]
    opt.try_step_with_lrs(0.02, 0.001, params, g)  # mapping form: absent names are missing
    assert_bits_equal(params["h1.w"], ref["h1.w"])  # no decay either
    assert_bits_equal(params["head"], ref["head"])
    assert opt.muon_state_count() == 1 and opt.adamw_state_count() == 3
    names = opt.state_dict().params
    assert "h1.w" not in names and "head" not in names
    # item form: grad None
    g2 = grads(1)
    opt.step_batch([OptItem(n, MANIFEST[n], params[n], None if n == "h0.w" else g2[n]) for n in sorted(g2)])
    assert opt.state_dict().params["h0.w"]["t"] == 1


def test_tied_parameter_updated_once():
    manifest = {"embed": (6, 4), "h.w": (4, 4)}
    opt = flatopt.MuonAdamW(manifest, ["h.w"], aliases={"lm_head": "embed"}, adamw_lr_ratio=1.0)
    ref = flatopt.MuonAdamW(manifest, ["h.w"], adamw_lr_ratio=1.0)
    e, e_ref = rng_arrays(0, (6, 4)), rng_arrays(0, (6, 4))
    h, h_ref = rng_arrays(1, (4, 4)), rng_arrays(1, (4, 4))
    ge, gh = rng_arrays(2, (6, 4)), rng_arrays(3, (4, 4))
    opt.step_batch([OptItem("embed", (6, 4), e, ge), OptItem("lm_head", (6, 4), e, ge), OptItem("h.w", (4, 4), h, gh)])
    ref.step_batch([OptItem("embed", (6, 4), e_ref, ge), OptItem("h.w", (4, 4), h_ref, gh)])
    assert_bits_equal(e, e_ref)  # one update, not two
    assert opt.adamw_state_count() == 1 and opt.state_dict().params["embed"]["t"] == 1
    assert opt.lr_scale("lm_head") == 1.0
    # the alias alone steps the tied parameter under its name
    opt.step("lm_head", (6, 4), e, ge)
    assert opt.state_dict().params["embed"]["t"] == 2
    # aliases given other buffers: refused before anything changes
    snap = snapshot(opt, {"e": e, "h": h})
    with pytest.raises(E.TiedParameterMismatch):
        opt.step_batch([OptItem("embed", (6, 4), e, ge), OptItem("lm_head", (6, 4), e.copy(), ge)])
    with pytest.raises(E.TiedParameterMismatch):
        opt.step_batch([OptItem("embed", (6, 4), e, ge), OptItem("lm_head", (6, 4), e, ge.copy())])
    assert_unchanged(opt, {"e": e, "h": h}, snap)


def test_skip_changes_no_byte_and_validates_nothing():
    params, opt = model(), make()
    opt.step_batch(items_of(params, grads(0)))
    snap = snapshot(opt, params)
    opt.try_step_or_skip(0.02, 0.001, params, grads(1), skip_update=True)
    opt.try_step_or_skip(float("nan"), -1.0, [OptItem("garbage", (1,), None, None)], skip_update=True)
    assert_unchanged(opt, params, snap)
    opt.try_step_or_skip(0.02, 0.001, params, grads(1), skip_update=False)
    assert opt.state_dict().params["h0.w"]["t"] == 2


# ---------------------------------------------------------------------------------------------- threads
def test_step_batch_concurrent_groups_and_fixed_muon_threads_bit_identical(monkeypatch):
    shapes = {f"m{i}": s for i, s in enumerate([(96, 64), (64, 96), (80, 80), (64, 64), (128, 48)])}
    shapes.update({f"v{i}": (200_000,) for i in range(2)})
    muon_names = [n for n in shapes if n.startswith("m")]
    threads: dict[str, set] = {}
    inner, inner_adamw = flatopt.Muon.update_fn, flatopt.AdamW.update_fn

    def spy(xp, cfg, st, p, g, **kw):
        threads.setdefault(st.shape, set()).add(threading.current_thread().name)
        inner(xp, cfg, st, p, g, **kw)

    def spy_adamw(*a, **kw):
        threads.setdefault("adamw", set()).add(threading.current_thread().name)
        inner_adamw(*a, **kw)

    outs = []
    for concurrent, workers in ((False, 1), (True, 2)):
        if concurrent:
            monkeypatch.setattr(flatopt.Muon, "update_fn", staticmethod(spy))
            monkeypatch.setattr(flatopt.AdamW, "update_fn", staticmethod(spy_adamw))
        opt = flatopt.MuonAdamW(shapes, muon_names, concurrent=concurrent, muon_workers=workers,
                                muon={"weight_decay": 0.1}, adamw={"weight_decay": 0.1})
        ps = {n: rng_arrays(i, s) for i, (n, s) in enumerate(sorted(shapes.items()))}
        for it in range(2):
            opt.step_batch([OptItem(n, s, ps[n], rng_arrays(50 + 9 * it + i, s))
                            for i, (n, s) in enumerate(sorted(shapes.items()))])
        outs.append((ps, opt.state_dict()))
    for n in shapes:
        assert_bits_equal(outs[0][0][n], outs[1][0][n], n)
    assert_states_equal(outs[0][1], outs[1][1])
    names = set().union(*(v for k, v in threads.items() if k != "adamw"))
    assert {n.split("_")[0] for n in names} == {"flatopt-shard0", "flatopt-shard1"}, names
    assert all(len(v) == 1 for k, v in threads.items() if k != "adamw"), "a matrix changed worker thread"
    assert any(n.startswith("flatopt-group") for n in threads["adamw"]), "the AdamW group did not run concurrently"


# ---------------------------------------------------------------------------------------------- records
def _trained(opt, params, steps=2):
    for it in range(steps):
        opt.step_batch(items_of(params, grads(it)))
        opt.end_iteration()
    return opt.state_dict()


@pytest.mark.parametrize("through_file", [False, True])
def test_record_round_trip_continues_bit_exact(through_file, tmp_path):
    a, b = model(), model()
    opt_a = make(muon={"weight_decay": 0.1})
    _trained(opt_a, a, 4)
    opt_b = make(muon={"weight_decay": 0.1})
    state = _trained(opt_b, b, 2)
    assert state.config_key["record"].startswith("muon-adamw-v1:")
    assert state.config_key["version"] == 1 and state.config_key["manifest"] == opt_b.manifest()
    if through_file:
        flatopt.save(tmp_path / "r.npz", state)
        state = flatopt.load(tmp_path / "r.npz")
    opt_c = make(muon={"weight_decay": 0.1})
    opt_c.try_load_record(state)
    for it in range(2, 4):
        opt_c.step_batch(items_of(b, grads(it)))
        opt_c.end_iteration()
    for n in MANIFEST:
        assert_bits_equal(a[n], b[n], n)
    assert_states_equal(opt_a.state_dict(), opt_c.state_dict())


def _tamper_role(st):
    st = copy.deepcopy(st)
    st.params["norm"]["group"] = "muon"
    return st


def _tamper_buffer_role(st):
    st = copy.deepcopy(st)
    st.buffers["muon.momentum_buffer/embed"] = st.buffers["adamw.m/embed"]
    return st


def _tamper_shape(st):
    st = copy.deepcopy(st)
    st.params["h0.w"]["shape"] = [6, 4]
    return st


def _tamper_version(st):
    st = copy.deepcopy(st)
    st.config_key["version"] = 2
    return st


@pytest.mark.parametrize("other, err", [
    (lambda: make(muon_names=["h0.w"]), E.GroupingMismatch),
    (lambda: make(muon_names=["h0.w", "h1.w", "head"]), E.GroupingMismatch),
    (lambda: make(adamw_lr_ratio=0.02), E.ConfigMismatch),
    (lambda: make(muon={"ns_steps": 6}), E.ConfigMismatch),
    (lambda: make(adamw={"eps": 1e-8}), E.ConfigMismatch),
    (lambda: make(muon={"momentum_convention": "sgd"}), E.ConventionMismatch),
    (lambda: make(params={**MANIFEST, "extra": (3,)}), E.ManifestMismatch),
    (lambda: make(aliases={"lm_head": "embed"}), E.ManifestMismatch),
])
def test_load_refuses_other_grouping_config_convention(other, err):
    st = _trained(make(), model())
    opt = other()
    params = model()
    _trained(opt, {n: params[n] for n in MANIFEST}, 1)
    before = opt.state_dict()
    with pytest.raises(err):
        opt.try_load_record(st)
    assert opt.load_state_dict(st) is False and isinstance(opt.last_load_error, err)
    assert_states_equal(opt.state_dict(), before)


@pytest.mark.parametrize("tamper, err", [
    (_tamper_role, E.RoleMismatch), (_tamper_buffer_role, E.RoleMismatch), (_tamper_shape, E.StateMismatch),
    (_tamper_version, E.RecordVersionMismatch),
])
def test_load_refuses_tampered_roles_and_states(tamper, err):
    st = _trained(make(), model())
    opt = make()
    _trained(opt, model(), 1)
    before = opt.state_dict()
    with pytest.raises(err):
        opt.try_load_record(tamper(st))
    assert_states_equal(opt.state_dict(), before)


def test_load_refuses_other_algorithms():
    sgd = flatopt.SGD(lr=0.1, momentum=0.9)
    sgd.step("h0.w", (4, 6), rng_arrays(0, (4, 6)), rng_arrays(1, (4, 6)))
    opt = make()
    with pytest.raises(E.RecordVersionMismatch):
        opt.try_load_record(sgd.state_dict())
    with pytest.raises(TypeError, match="flatopt.load"):
        opt.load_state_dict("nonsense")


# --------------------------------------------------------------------------------------------- oracles
def test_adamw_half_matches_torch_adamw():
    torch = pytest.importorskip("torch")
    p, ref = model(), model()
    opt = make(lr=0.02, adamw={"weight_decay": 0.1})
    W = torch.nn.Parameter(torch.tensor(ref["norm"]))
    t_opt = torch.optim.AdamW([W], lr=0.02 * 0.015, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    for it in range(3):
        g = grads(it, ["norm"])
        opt.try_step_with_lrs(0.02, 0.02 * 0.015, {"norm": p["norm"]}, g)
        W.grad = torch.tensor(g["norm"])
        t_opt.step()
    # float32, same formula; torch may contract multiply-adds: a few ulps
    np.testing.assert_allclose(p["norm"], W.detach().numpy(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.usefixtures("gpu_or_emulated")
def test_gpu_matches_numpy_without_host_sync():
    cp = flatopt.core.backend.cupy()  # noqa: SLF001
    import cupyx

    cpu, gpu = make(muon={"weight_decay": 0.1}), make(muon={"weight_decay": 0.1})
    p_cpu = model()
    p_gpu = {n: cp.asarray(p) for n, p in p_cpu.items()}
    for it in range(3):
        g = grads(it)
        cpu.step_batch(items_of(p_cpu, g))
        batch = [OptItem(n, MANIFEST[n], p_gpu[n], cp.asarray(g[n])) for n in sorted(g)]
        if it == 0:
            gpu.step_batch(batch)  # first step: kernel compilation and allocations
        else:
            with cupyx.allow_synchronize(False):
                gpu.step_batch(batch)
    assert gpu.muon_state_count() == 2 and gpu.adamw_state_count() == 4
    for n in MANIFEST:
        # cuBLAS vs OpenBLAS summation order in float32 NS, fused AdamW kernel vs NumPy ufuncs: float32 noise
        np.testing.assert_allclose(cp.asnumpy(p_gpu[n]), p_cpu[n], rtol=0, atol=1e-4, err_msg=n)
    st = gpu.state_dict()
    assert make(muon={"weight_decay": 0.1}).load_state_dict(st) is True  # records move between backends

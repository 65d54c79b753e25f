"""flatopt.Muon: an independent float64 reference of reference/muon.md §1.7, the lr-adjust rules, decay placement,
both momentum conventions, validation, sharded step_batch, and conformance with torch.optim.Muon and Keller
Jordan's muon-optimizer 0.1.0 (skipped when absent)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.core import backend
from flatopt.muon import MuonConfig, shape_scale

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

A, B, C = 3.4445, -4.7750, 2.0315


def reference(w0, grads, *, lr=0.02, mu=0.95, nesterov=True, wd=0.0, convention="ema", eps=1e-7,
              eps_mode="clamp", adjust="original", layout="out_in", steps=5):
    """Float64, written from the formulas: explicit transpose when rows > cols (torch's rule), numpy's norm."""
    w = w0.astype(np.float64).copy()
    r, c = w.shape
    buf = np.zeros_like(w)
    for g in grads:
        g = g.astype(np.float64)
        if convention == "ema":
            buf = mu * buf + (1 - mu) * g
            d = (1 - mu) * g + mu * buf if nesterov else buf
        else:
            buf = mu * buf + g
            d = g + mu * buf if nesterov else buf
        x = d.T if r > c else d
        n = np.linalg.norm(x)
        x = x / (max(n, eps) if eps_mode == "clamp" else n + eps)
        for _ in range(steps):
            a = x @ x.T
            x = A * x + (B * a + C * a @ a) @ x
        o = x.T if r > c else x
        if adjust == "original":
            fo, fi = (r, c) if layout == "out_in" else (c, r)
            s = math.sqrt(max(1.0, fo / fi))
        elif adjust == "match_rms_adamw":
            s = 0.2 * math.sqrt(max(r, c))
        else:
            s = 1.0
        w = w * (1 - lr * wd)
        w = w - lr * s * o
    return w, buf


def run_flat(shape, w0, grads, dtype=np.float64, **kw):
    opt = flatopt.Muon(**kw)
    p = w0.astype(dtype).ravel().copy()
    for g in grads:
        opt.step("w", shape, p, g.astype(dtype).ravel().copy())
    buf = opt.state_dict().buffers["momentum_buffer/w"]
    return p.reshape(shape), buf.reshape(shape)


def data(shape, steps=3, seed=0):
    r = np.random.default_rng(seed)
    return r.standard_normal(shape), [r.standard_normal(shape) for _ in range(steps)]


CASES = [
    dict(),
    dict(convention="sgd"),
    dict(nesterov=False),
    dict(convention="sgd", nesterov=False, wd=0.1),
    dict(eps_mode="additive", wd=0.05),
    dict(adjust="match_rms_adamw"),
    dict(adjust=None, layout="in_out"),
    dict(adjust="original", layout="in_out", mu=0.5),
]


def _flat_kw(case):
    m = {"lr": "lr", "mu": "momentum", "nesterov": "nesterov", "wd": "weight_decay", "convention":
         "momentum_convention", "eps_mode": "eps_mode", "adjust": "adjust_lr", "layout": "layout"}
    return {m[k]: v for k, v in case.items()}


@pytest.mark.parametrize("shape", [(32, 16), (16, 32), (9, 9), (1, 5)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_float64_reference(shape, case):
    kw = CASES[case]
    w0, grads = data(shape, seed=case)
    want_w, want_b = reference(w0, grads, **kw)
    got_w, got_b = run_flat(shape, w0, grads, **_flat_kw(kw))
    # float64 throughout; the only differences are the Gram orientation (XᵀX instead of a transposed copy) and the
    # summation order of the norm: ~1e-16 relative per operation, amplified at most a^5 ≈ 480 by five NS steps.
    delta_want, delta_got = want_w - w0, got_w - w0
    assert np.max(np.abs(delta_got - delta_want)) <= 1e-11 * np.max(np.abs(delta_want))
    np.testing.assert_allclose(got_b, want_b, rtol=1e-14, atol=0)


def test_conventions_same_update_buffers_ratio():
    w0, grads = data((24, 12), steps=4)
    w_ema, b_ema = run_flat((24, 12), w0, grads, momentum_convention="ema")
    w_sgd, b_sgd = run_flat((24, 12), w0, grads, momentum_convention="sgd")
    np.testing.assert_allclose(w_ema, w_sgd, rtol=0, atol=1e-13)
    np.testing.assert_allclose(b_ema, 0.05 * b_sgd, rtol=1e-13)


def test_lr_adjust_rules():
    assert shape_scale(MuonConfig(), (512, 2048)) == 1.0
    assert shape_scale(MuonConfig(), (2048, 512)) == 2.0
    assert shape_scale(MuonConfig(layout="in_out"), (512, 2048)) == 2.0  # Burn's Linear [in, out] layout
    assert shape_scale(MuonConfig(adjust_lr="match_rms_adamw"), (512, 2048)) == pytest.approx(0.2 * math.sqrt(2048))
    assert shape_scale(MuonConfig(adjust_lr="match_rms_adamw"), (2048, 512)) == pytest.approx(0.2 * math.sqrt(2048))
    assert shape_scale(MuonConfig(adjust_lr=None), (2048, 512)) == 1.0


def test_decay_uses_unadjusted_lr_and_zero_grad_is_pure_decay():
    shape = (8, 2)  # tall: s = 2 under "original"
    p = rng_arrays(0, shape, np.float64)
    want = p * (1 - 0.1 * 0.5)
    opt = flatopt.Muon(lr=0.1, weight_decay=0.5)
    opt.step("w", shape, p, np.zeros(16))
    assert_bits_equal(p, want)  # zero direction: X = 0/eps = 0, only the decay with lr (not lr·s) remains


def test_lr_scale_equals_scaled_lr():
    shape = (6, 10)
    w0, grads = data(shape)
    a, _ = run_flat(shape, w0, grads, lr=0.02, lr_scale={"w": 0.25})
    b, _ = run_flat(shape, w0, grads, lr=0.005)
    assert_bits_equal(a, b)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), (0, 4), (4, 0)])
def test_non_matrix_is_a_clear_error(shape):
    opt = flatopt.Muon()
    n = math.prod(shape)
    p = rng_arrays(0, (n,))
    before = p.copy()
    with pytest.raises(ValueError, match="2-D.*MuonAdamW"):
        opt.step("bias", shape, p, rng_arrays(1, (n,)))
    assert_bits_equal(p, before)
    assert opt.state_dict().params == {}


def test_grad_never_written_float32():
    shape = (16, 8)
    p, g = rng_arrays(0, shape), rng_arrays(1, shape)
    g_before = g.copy()
    opt = flatopt.Muon()
    for _ in range(3):
        opt.step("w", shape, p, g)
    assert_bits_equal(g, g_before)


@pytest.mark.parametrize("bad", [
    dict(momentum=1.0), dict(momentum=-0.1), dict(momentum=0.0), dict(ns_steps=0), dict(ns_steps=100),
    dict(ns_steps=2.5), dict(eps=0.0), dict(eps=float("inf")), dict(ns_coefficients=(1, 2)),
    dict(ns_coefficients=(1, 2, float("nan"))), dict(adjust_lr="torch"), dict(momentum_convention="nesterov"),
    dict(eps_mode="max"), dict(layout="rows"), dict(weight_decay=-1.0), dict(lr=float("nan")), dict(workers=0),
])
def test_config_validation(bad):
    with pytest.raises((ValueError, TypeError)):
        flatopt.Muon(**bad)


def test_lr_overflowing_float32_rejected_before_mutation():
    opt = flatopt.Muon(lr=3e38, adjust_lr="match_rms_adamw")  # s = 0.2·√40 ≈ 1.26
    p = rng_arrays(0, (40, 40))
    before = p.copy()
    with pytest.raises(ValueError, match="float32"):
        opt.step("w", (40, 40), p, rng_arrays(1, (40, 40)))
    assert_bits_equal(p, before)


def test_load_refuses_other_convention():
    shape = (5, 4)
    a = flatopt.Muon(momentum_convention="sgd")
    a.step("w", shape, rng_arrays(0, shape), rng_arrays(1, shape))
    b = flatopt.Muon(momentum_convention="ema")
    assert b.load_state_dict(a.state_dict()) is False
    assert b.state_dict().params == {}
    assert flatopt.Muon(momentum_convention="sgd", ns_steps=3).load_state_dict(a.state_dict()) is True


def test_workers_bit_identical_and_fixed_assignment(monkeypatch):
    import threading

    shapes = [(64, 96), (96, 64), (80, 80), (32, 128), (128, 32), (64, 64), (48, 100)]
    seen: dict[str, set] = {}
    inner = flatopt.Muon.update_fn

    def spy(xp, cfg, st, p, g, **kw):
        seen.setdefault(st.shape, set()).add(threading.current_thread().name)
        inner(xp, cfg, st, p, g, **kw)

    results = []
    for workers in (1, 3):
        opt = flatopt.Muon(workers=workers)
        if workers > 1:
            opt.assign_shards([(f"p{i}", s) for i, s in enumerate(shapes)])
            monkeypatch.setattr(flatopt.Muon, "update_fn", staticmethod(spy))
        ps = [rng_arrays(i, s) for i, s in enumerate(shapes)]
        for it in range(3):
            opt.step_batch([OptItem(f"p{i}", s, ps[i], rng_arrays(100 + 10 * it + i, s)) for i, s in enumerate(shapes)])
        results.append((ps, opt.state_dict()))
    for a, b in zip(results[0][0], results[1][0]):
        assert_bits_equal(a, b)
    assert_states_equal(results[0][1], results[1][1])
    threads = set().union(*seen.values())
    assert len(threads) == 3 and all(t.startswith("flatopt-shard") for t in threads), threads
    assert all(len(v) == 1 for v in seen.values()), "a matrix moved between worker threads"


def test_blas_cap_is_restored_after_a_sharded_step():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    ctl = threadpoolctl.ThreadpoolController()
    before = [i["num_threads"] for i in ctl.info()]
    opt = flatopt.Muon(workers=2)
    shapes = [(96, 128)] * 4
    ps = [rng_arrays(i, s) for i, s in enumerate(shapes)]
    opt.step_batch([OptItem(f"p{i}", s, ps[i], rng_arrays(9 + i, s)) for i, s in enumerate(shapes)])
    assert [i["num_threads"] for i in ctl.info()] == before


# ------------------------------------------------------------------------------------------------ oracles
def _torch_run(torch, cls, shape, w0, grads, **kw):
    W = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    opt = cls([W], **kw)
    deltas, bufs = [], []
    for g in grads:
        gt = torch.tensor(g, dtype=torch.float32)
        W.grad = gt.clone()
        before = W.detach().clone()
        opt.step()
        deltas.append((W.detach() - before).numpy().astype(np.float64))
        bufs.append(opt.state[W]["momentum_buffer"].numpy().astype(np.float64).copy())
    return deltas, bufs


def _flat_run(shape, w0, grads, **kw):
    opt = flatopt.Muon(**kw)
    p = w0.astype(np.float32).ravel().copy()
    deltas, bufs = [], []
    for g in grads:
        before = p.copy()
        opt.step("w", shape, p, g.astype(np.float32).ravel().copy())
        deltas.append((p.astype(np.float64) - before).reshape(shape))
        bufs.append(opt.state_dict().buffers["momentum_buffer/w"].reshape(shape).astype(np.float64))
    return deltas, bufs


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# bf16 has an 8-bit significand: one rounding is ≤ 2^-9 ≈ 2e-3 relative; NS rounds X, A and B in bf16 every step
# and the polynomial amplifies small singular values, so the reference measured 1.0e-2 (torch) on the update.
# 3e-2 is that gap with a 3x margin; float32 flatopt vs float64 is exact to ~1e-6, so the bound is all bf16.
BF16_UPDATE_RTOL = 3e-2


@pytest.mark.parametrize("shape", [(32, 16), (16, 32), (64, 48)])
@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_torch_muon_conformance(shape, adjust):
    torch = pytest.importorskip("torch")
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    w0, grads = data(shape, steps=3, seed=7)
    t_d, t_b = _torch_run(torch, torch.optim.Muon, shape, w0, grads, lr=0.02, weight_decay=0.1,
                          adjust_lr_fn=adjust)
    f_d, f_b = _flat_run(shape, w0, grads, lr=0.02, weight_decay=0.1,
                         adjust_lr="original" if adjust is None else adjust)  # torch's None means "original"
    for k in range(3):
        assert _rel(f_d[k], t_d[k]) <= BF16_UPDATE_RTOL, (k, _rel(f_d[k], t_d[k]))
        # the buffer is float32 in both (torch's fused lerp vs multiply-add): a few ulps
        np.testing.assert_allclose(f_b[k], t_b[k], rtol=1e-6, atol=1e-7)


def _ref_deltas(w0, grads, **kw):
    out = [reference(w0, grads[: k + 1], **kw)[0] for k in range(len(grads))]
    return [out[0] - w0] + [out[k] - out[k - 1] for k in range(1, len(out))]


def _keller_run(torch, muon, w0, grads, wd):
    W = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    opt = muon.SingleDeviceMuon([W], lr=0.02, weight_decay=wd, momentum=0.95)
    deltas = []
    for g in grads:
        gt = torch.tensor(g, dtype=torch.float32)
        W.grad = gt.clone()  # Keller's Nesterov step overwrites p.grad: give it a copy (reference/muon.md §5.3)
        before = W.detach().clone()
        opt.step()
        assert not torch.equal(W.grad, gt), "Keller's muon_update writes into p.grad (flatopt must not)"
        deltas.append((W.detach() - before).numpy().astype(np.float64))
    return deltas


@pytest.mark.parametrize("shape", [(32, 16), (16, 32)])
def test_keller_muon_conformance_float32_ns(shape, monkeypatch):
    """Keller's muon.py with only its bf16 cast replaced by float32: then everything else (EMA momentum, Nesterov
    lerp, additive ε, √max(1, r/c), decay order) must agree to float32 rounding."""
    torch = pytest.importorskip("torch")
    muon = pytest.importorskip("muon")
    import inspect

    src = inspect.getsource(muon.zeropower_via_newtonschulz5)
    assert "G.bfloat16()" in src
    ns: dict = {}
    exec(src.replace("G.bfloat16()", "G.float()"), muon.__dict__ | {}, ns)  # noqa: S102 - the oracle's own code
    monkeypatch.setattr(muon, "zeropower_via_newtonschulz5", ns["zeropower_via_newtonschulz5"])
    w0, grads = data(shape, steps=3, seed=3)
    k_d = _keller_run(torch, muon, w0, grads, wd=0.01)
    f_d, _ = _flat_run(shape, w0, grads, lr=0.02, weight_decay=0.01, eps_mode="additive")
    for k in range(3):
        # float32 vs float32 (different summation orders): ~6e-8 per op, amplified ≤ a^5 ≈ 480 by NS
        assert _rel(f_d[k], k_d[k]) <= 1e-4, _rel(f_d[k], k_d[k])


@pytest.mark.parametrize("shape", [(32, 16), (16, 32)])
def test_keller_muon_conformance_bf16(shape):
    """The real package (bf16 NS, unfused: ~7 bf16 roundings per NS step, vs torch's 3): flatopt must be as close
    to it as the exact float64 math is (plus float32 noise)."""
    torch = pytest.importorskip("torch")
    muon = pytest.importorskip("muon")
    w0, grads = data(shape, steps=3, seed=3)
    k_d = _keller_run(torch, muon, w0, grads, wd=0.01)
    f_d, _ = _flat_run(shape, w0, grads, lr=0.02, weight_decay=0.01, eps_mode="additive")
    r_d = _ref_deltas(w0, grads, lr=0.02, wd=0.01, eps_mode="additive")
    for k in range(3):
        exact_gap = _rel(r_d[k], k_d[k])  # the whole bf16 error of the oracle
        assert _rel(f_d[k], k_d[k]) <= exact_gap + 1e-4, (k, _rel(f_d[k], k_d[k]), exact_gap)
        assert _rel(f_d[k], r_d[k]) <= 1e-4  # float32 vs float64: 6e-8 per op, amplified ≤ a^5 ≈ 480 by NS


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.usefixtures("gpu_or_emulated")
def test_gpu_matches_numpy_without_host_sync():
    cp = backend.cupy()
    import cupyx

    shapes = [(64, 32), (32, 64), (48, 48)]
    cpu, gpu = flatopt.Muon(weight_decay=0.1), flatopt.Muon(weight_decay=0.1)
    ps = [rng_arrays(i, s) for i, s in enumerate(shapes)]
    pg = [cp.asarray(p) for p in ps]
    for it in range(3):
        gs = [rng_arrays(10 + it * 5 + i, s) for i, s in enumerate(shapes)]
        cpu.step_batch([OptItem(f"p{i}", s, ps[i], gs[i]) for i, s in enumerate(shapes)])
        items = [OptItem(f"p{i}", s, pg[i], cp.asarray(gs[i])) for i, s in enumerate(shapes)]
        if it == 0:
            gpu.step_batch(items)  # first step allocates; later steps must not synchronise
        else:
            with cupyx.allow_synchronize(False):
                gpu.step_batch(items)
    for a, b in zip(ps, pg):
        # cuBLAS and OpenBLAS sum in different orders (float32): ~1e-6 relative per matmul, amplified by NS
        np.testing.assert_allclose(cp.asnumpy(b), a, rtol=0, atol=1e-4)

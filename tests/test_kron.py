"""KronPsgd: an independent float64 reference of the step (reference/kron.md §4), the schedule and balancing
streams, D4 (the preconditioner moves), conformance with kron_torch 0.3.3 eager on injected probes, exact resume,
the ill-conditioned quadratic, and NumPy/CuPy parity (GPU tests skip without a GPU)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import zlib

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # kron_torch is compile-first; never compile in tests

import numpy as np
import pytest

import flatopt
from flatopt.core import backend
from flatopt.kron import layout

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

TINY = float(np.finfo(np.float32).tiny)
BALANCE_AT_5 = 6  # random.Random(6): the first draw below 0.01 is the 5th


def table_probe(seed=0, dtype=np.float32):
    """Deterministic probes keyed by (name, index), cached so every consumer gets the same array."""
    cache = {}

    def probe(name, shape, index):
        key = (name, tuple(shape), index)
        if key not in cache:
            r = np.random.default_rng([seed, zlib.crc32(name.encode()), index])
            cache[key] = r.standard_normal(shape).astype(dtype)
        return cache[key]

    return probe


# ------------------------------------------------------------------------------ float64 reference (kron.md §4)
_LET = "abcdefgh"


def _mode(x, m, i):  # x ×_i M
    s = _LET[:x.ndim]
    return np.einsum(f"z{s[i]},{s}->{s[:i]}z{s[i + 1:]}", m, x)


def _gram(x, i, diag):
    s = _LET[:x.ndim]
    a, b = s[:i] + "y" + s[i + 1:], s[:i] + "z" + s[i + 1:]
    return np.einsum(f"{a},{a}->y", x, x) if diag else np.einsum(f"{a},{b}->yz", x, x)


def _lb(s):
    amax = np.max(np.abs(s))
    if amax == 0:
        return 0.0
    m = s / amax
    x = m[:, np.argmax(np.sum(m * m, axis=0))]
    y = x @ m
    y = y / np.linalg.norm(y)
    return np.linalg.norm(m @ y) * amax


def ref_step(st, theta, g, v, *, t, lr, b1, wd, eta, floor, clip, do_update, balance, decays):
    """One kron_torch step in float64, written from kron.md (einsum, explicit inverses)."""
    q = st["Q"]
    m = st["m"] = b1 * st["m"] + (1 - b1) * g
    h = m / (1 - b1**t)
    if balance and h.ndim > 1:
        norms = np.array([np.max(np.abs(f)) for f in q])
        gm = np.exp(np.mean(np.log(norms)))
        q = [f * (gm / n) for f, n in zip(q, norms)]
    if do_update:
        h = h + 2**-11.5 * np.mean(np.abs(h)) * v
        a, b = h, v
        for i, f in enumerate(q):
            a = _mode(a, np.diag(f) if f.ndim == 1 else f, i)
            b = _mode(b, np.diag(1 / f) if f.ndim == 1 else np.linalg.inv(f).T, i)
        new = []
        for i, f in enumerate(q):
            t1, t2 = _gram(a, i, f.ndim == 1), _gram(b, i, f.ndim == 1)
            if f.ndim == 1:
                new.append(f - eta * (t1 - t2) * f / max(np.max(np.abs(t1 + t2)), floor))
            else:
                new.append(f - eta * np.triu(t1 - t2) @ f / max(_lb(t1 + t2), floor))
        q = new
    st["Q"] = q
    u = h
    for i, f in enumerate(q):
        u = _mode(u, np.diag(f * f) if f.ndim == 1 else f.T @ f, i)
    if clip is not None:
        u = u * min(1.0, clip / (np.sqrt(np.mean(u * u)) + 1e-12))
    u = u.reshape(theta.shape)
    if wd and decays:
        u = u + wd * theta
    return theta - lr * u


def _ref_run(shape, steps, *, probe, lr=0.05, b1=0.9, wd=0.01, eta=0.1, clip=1.0, balance_seed=42, upd=1.0,
             **layout_kw):
    cfg = flatopt.kron.KronPsgdConfig(lr=lr, **layout_kw)
    lay = layout.make_layout(cfg, shape)
    st = {"m": np.zeros(lay.merged), "Q": [np.ones(d) if dg else np.eye(d) for d, dg in zip(lay.merged, lay.diag)]}
    theta = rng_arrays(0, shape, np.float64)
    counter, updates, draws = 0, 0, random.Random(balance_seed)
    for t in range(1, steps + 1):
        counter += 1
        do = counter >= 1 / upd
        counter = 0 if do else counter
        bal = draws.random() < 0.01 and do
        g = rng_arrays(100 + t, shape, np.float64).reshape(lay.merged) * np.linspace(0.1, 3, lay.merged[-1])
        v = probe("w", lay.merged, updates).astype(np.float64) if do else None
        updates += do
        theta = ref_step(st, theta, g, v, t=t, lr=lr, b1=b1, wd=wd, eta=eta, floor=1e-8, clip=clip,
                         do_update=do, balance=bal, decays=len(shape) >= 2)
    return theta, st["Q"]


def _flat_run(shape, steps, dtype, *, probe, lr=0.05, wd=0.01, upd=1.0, balance_seed=42, **kw):
    opt = flatopt.KronPsgd(lr=lr, weight_decay=wd, update_probability=upd, balance_seed=balance_seed, probe=probe,
                           **kw)
    merged = opt.preconditioner_shape(shape)
    theta = rng_arrays(0, shape, np.float64).astype(dtype)
    for t in range(1, steps + 1):
        g = rng_arrays(100 + t, shape, np.float64).reshape(merged) * np.linspace(0.1, 3, merged[-1])
        opt.step("w", shape, theta, g.reshape(-1).astype(dtype))
    return theta, opt.factors("w"), opt


REF_CASES = [
    ((9,), {}),
    ((6, 4), {}),
    ((3, 7), {"memory_save_mode": "one_diag"}),
    ((2, 3, 4), {}),  # merged to 6 x 4
    ((2, 3, 4), {"merge_dims": False}),  # the general k-mode path
    ((5, 1), {}),
    ((12, 3), {"max_size_triangular": 8}),  # a diagonal factor above the size limit
    ((300, 270), {}),  # factors above kron.blocked.LEAF: the blocked triangular/symmetric products
]


@pytest.mark.parametrize("shape,kw", REF_CASES)
def test_float64_matches_reference(shape, kw):
    """precond_dtype float64 on float64 params: agreement to 1e-13 (measured <= 3e-16: only the summation order
    differs), through a balance (step 5) and a constant cadence of every 2nd update."""
    probe = table_probe(1, np.float64)
    common = dict(probe=probe, upd=0.5, balance_seed=BALANCE_AT_5, **kw)
    theta_r, q_r = _ref_run(shape, 8, **common)
    theta_f, q_f, _ = _flat_run(shape, 8, np.float64, precond_dtype="float64", **common)
    theta0 = rng_arrays(0, shape, np.float64)
    assert np.max(np.abs(theta_f - theta_r)) <= 1e-13 * np.max(np.abs(theta_r - theta0))
    for a, b in zip(q_f, q_r):
        assert np.max(np.abs(a - b)) <= 1e-13 * np.max(np.abs(b))


@pytest.mark.parametrize("shape,kw", REF_CASES)
def test_float32_close_to_reference(shape, kw):
    """Default float32 preconditioner against the float64 reference: float32 rounding (ε = 6e-8) accumulated over
    8 chained steps; measured <= 1.6e-6 (parameters, against their change) and <= 2.4e-7 (Q)."""
    probe = table_probe(1)
    theta_r, q_r = _ref_run(shape, 8, probe=probe, **kw)
    theta_f, q_f, _ = _flat_run(shape, 8, np.float32, probe=probe, **kw)
    theta0 = rng_arrays(0, shape, np.float64)
    assert np.max(np.abs(theta_f - theta_r)) <= 2e-5 * np.max(np.abs(theta_r - theta0))
    for a, b in zip(q_f, q_r):
        assert np.max(np.abs(a - b)) <= 2e-6 * np.max(np.abs(b))


# ------------------------------------------------------------------------------------ kron_torch 0.3.3 eager
class _TorchWithQueue:
    """``torch`` for kron_torch.kron with ``randn_like`` answered from a queue (the injected probes)."""

    def __init__(self, torch, queue):
        self._torch, self._queue = torch, queue

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def randn_like(self, x):
        v = self._queue.pop(0)
        assert tuple(v.shape) == tuple(x.shape)
        return v.to(dtype=x.dtype).clone()


@pytest.fixture
def kron_torch(monkeypatch):
    """kron_torch.kron, eager (the torch.compile wrappers bypassed), its V drawn from a queue we fill."""
    torch = pytest.importorskip("torch")
    kt = pytest.importorskip("kron_torch.kron")
    for fn in ("_update_precond", "_precond_grad", "_clip_update_rms", "_balance_Q"):
        f = getattr(kt, fn)
        monkeypatch.setattr(kt, fn, getattr(f, "_torchdynamo_orig_callable", f))
    queue = []
    monkeypatch.setattr(kt, "torch", _TorchWithQueue(torch, queue))
    return torch, kt, queue


CONFORMANCE = {  # name: (shape, extra options for both sides)
    "bias": ((16,), {}),
    "square": ((12, 12), {}),
    "tall": ((20, 6), {}),
    "wide": ((6, 20), {}),
    "tensor3": ((4, 5, 6), {}),
    "tensor4_signed_rule": ((8, 2, 3, 3), {}),  # kron_torch's signed rule: 48 x 3 (the square rule: 16 x 9)
    "above_max_size": ((40, 6), {"max_size_triangular": 32}),
    "tensor3_unmerged": ((3, 4, 5), {"merge_dims": False}),
    "one_diag": ((10, 7), {"memory_save_mode": "one_diag"}),
}


def _conformance_run(kron_torch, names, steps, *, lr=0.03, wd=0.01, balance_seed=42, momentum_into=True):
    torch, kt, queue = kron_torch
    shapes = {n: CONFORMANCE[n][0] for n in names}
    extra = {}
    for n in names:
        extra.update(CONFORMANCE[n][1])
    probe = table_probe(7)
    opt = flatopt.KronPsgd(lr=lr, weight_decay=wd, eps=TINY, clip=1.1, update_probability=1.0,
                           merge_rule="kron_torch", balance_seed=balance_seed, probe=probe,
                           momentum_into_precond_update=momentum_into, **extra)
    init = {n: rng_arrays(i, s) for i, (n, s) in enumerate(shapes.items())}
    ours = {n: p.copy() for n, p in init.items()}
    theirs = {n: torch.nn.Parameter(torch.from_numpy(p.reshape(shapes[n]).copy())) for n, p in init.items()}
    ref = kt.Kron(list(theirs.values()), lr=lr, weight_decay=wd, preconditioner_update_probability=1.0,
                  momentum_into_precond_update=momentum_into, **extra)
    ref.rng = random.Random(balance_seed)
    for step in range(steps):
        for i, (n, s) in enumerate(shapes.items()):
            scale = np.linspace(0.2, 5.0, s[-1]) if len(s) > 1 else 1.0
            g = (rng_arrays(1000 * step + i, s).reshape(s) * scale).astype(np.float32)
            theirs[n].grad = torch.from_numpy(g.copy())
            opt.step(n, s, ours[n], g.reshape(-1))
            queue.append(torch.from_numpy(probe(n, opt.preconditioner_shape(n), step)))
        with contextlib.redirect_stdout(io.StringIO()):
            ref.step()
        assert not queue
    errors = {}
    for n in shapes:
        t_param = theirs[n].detach().numpy().reshape(-1).astype(np.float64)
        moved = np.max(np.abs(t_param - init[n]))
        e_param = np.max(np.abs(ours[n] - t_param)) / moved
        q_ours, q_theirs = opt.factors(n), [q.numpy() for q in ref.state[theirs[n]]["Q"]]
        assert [q.shape for q in q_ours] == [tuple(q.shape) for q in q_theirs], n
        e_q = max(np.max(np.abs(a - b)) / np.max(np.abs(b)) for a, b in zip(q_ours, q_theirs))
        e_dq = max(np.max(np.abs(a - b)) / np.max(np.abs(b - (np.eye(len(b)) if b.ndim == 2 else 1)))
                   for a, b in zip(q_ours, q_theirs))
        errors[n] = (e_param, e_q, e_dq)
        for q in q_ours:
            if q.ndim == 2:
                assert not np.any(np.tril(q, -1)), f"{n}: Q left the upper-triangular group"
            assert not np.allclose(q, np.eye(len(q)) if q.ndim == 2 else 1.0, atol=1e-3), f"{n}: Q did not move"
    return errors


@pytest.mark.parametrize("name", sorted(CONFORMANCE))
def test_conformance_kron_torch(kron_torch, name):
    """19 steps (before kron_torch's first balance), every step updating Q, identical probes, clip 1.1, eps tiny.
    Relative errors: the parameter against its total change, Q against max|Q| — both float32 round-off (the two
    sides sum in different orders and torch fuses multiply-adds), measured at most a few 1e-7."""
    errors = _conformance_run(kron_torch, [name], 19)
    e_param, e_q, _ = errors[name]
    assert e_param <= 1e-5 and e_q <= 1e-5, errors


def test_conformance_kron_torch_balance_and_raw_gradient(kron_torch):
    """Balancing at step 5 (both sides use random.Random(6)) and the fit on the raw gradient."""
    errors = _conformance_run(kron_torch, ["square", "wide", "bias"], 8, balance_seed=BALANCE_AT_5)
    errors.update(_conformance_run(kron_torch, ["tall"], 6, momentum_into=False))
    for e_param, e_q, _ in errors.values():
        assert e_param <= 1e-5 and e_q <= 1e-5, errors


def test_schedule_matches_kron_torch():
    """The deterministic cadence: every step to 501, then every 2nd, ...; counts from kron.md §3; and, where
    kron_torch is installed, its own ProbScheduler (float32) step by step over 6000 steps."""
    cfg = flatopt.kron.KronPsgdConfig(lr=0.1)
    counter, updates = 0, []
    for t in range(1, 6001):
        do, counter = layout.decide_update(cfg, counter, t)
        if do:
            updates.append(t)
    assert updates[:501] == list(range(1, 502)) and updates[501:503] == [503, 505]
    assert sum(u <= 1000 for u in updates) == 750 and sum(u <= 2000 for u in updates) == 1076
    assert len(updates) == 1317 and updates[-1] - updates[-2] == 34
    torch = pytest.importorskip("torch")
    kt = pytest.importorskip("kron_torch.kron")
    sched = kt.ProbScheduler()
    c, theirs = 0, []
    for n in range(6000):
        c += 1
        if c >= 1 / sched._schedule_fn(torch.tensor(float(n), dtype=torch.float32)):  # noqa: SLF001
            theirs.append(n + 1)
            c = 0
    assert theirs == updates


def test_balance_stream():
    """kron.md §3: with seed 42 the draws below 0.01 fall on steps 20, 125, 270, ..."""
    hits = [t for t in range(1, 1100) if layout.balance_hit(42, t)]
    assert hits == [20, 125, 270, 291, 298, 369, 395, 428, 482, 685, 883, 1027]


@pytest.mark.slow  # a long run
def test_d14_balance_record_does_not_grow():
    """reliability audit D14: the balance draws' record must not grow with the step count (it kept every hit, about
    1 % of steps, forever), and stays the stream of ``random.Random(seed)``: parameters in lock-step, one that lags
    far behind (a late or ``reset`` name) and a late restart from step 1 all get the stream's draws."""
    import tracemalloc

    seed, n = 987_654_321, 120_000
    ref = random.Random(seed)
    want = [False] + [ref.random() < 0.01 for _ in range(n)]
    for t in range(1, 20_001):  # warm-up: the record's fixed part exists
        assert layout.balance_hit(seed, t) == want[t]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for t in range(20_001, n + 1):
            assert layout.balance_hit(seed, t) == want[t]
            assert layout.balance_hit(seed, t - 10_000) == want[t - 10_000]  # a name far behind
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8192, f"the balance record grew by {grown} bytes over {n - 20_000} steps"
    assert [t for t in range(1, 3000) if layout.balance_hit(seed, t)] == [t for t in range(1, 3000) if want[t]]


# ------------------------------------------------------------------------------------------------- behaviour
def test_d4_preconditioner_moves_and_stays_triangular():
    """optimizer-trait.md D4: from Q = I, one update on anisotropic columns moves Q (the seed crate's probe V = g
    leaves it at I forever), Q stays upper triangular, and 60 steps learn the column scales."""
    scales = np.array([1.0, 10.0, 100.0, 0.1], np.float32)
    opt = flatopt.KronPsgd(lr=1e-3, seed=3)
    p = np.zeros(32, np.float32)
    for i in range(60):
        g = (rng_arrays(i, (8, 4)).reshape(8, 4) * scales).reshape(-1)
        opt.step("w", (8, 4), p, g)
        if i == 0:
            for q in opt.factors("w"):
                assert np.max(np.abs(q - np.eye(len(q)))) > 1e-3
                assert not np.any(np.tril(q, -1))
    q_l, q_r = opt.factors("w")
    assert not np.any(np.tril(q_l, -1)) and not np.any(np.tril(q_r, -1))
    d = np.sqrt(np.diag(q_r.T @ q_r))
    assert d[2] < d[1] < d[0] < d[3]  # P_R ~ E[g gᵀ]^(-1/2): the smaller the column scale, the larger P


def test_resume_bit_exact_across_schedule_and_balance(tmp_path):
    """Save in the middle of a sparse cadence and before a balance; the continued run equals the uninterrupted one."""
    kw = dict(lr=0.02, update_probability=0.4, balance_seed=BALANCE_AT_5)
    shapes = {"a": (6, 5), "b": (7,), "c": (2, 3, 4)}

    def steps(opt, params, lo, hi):
        for t in range(lo, hi):
            for i, (n, s) in enumerate(shapes.items()):
                opt.step(n, s, params[n], rng_arrays(50 * t + i, s))
            opt.end_iteration()

    full = {n: rng_arrays(i, s) for i, (n, s) in enumerate(shapes.items())}
    part = {n: p.copy() for n, p in full.items()}
    a = flatopt.KronPsgd(**kw)
    steps(a, full, 0, 9)
    b = flatopt.KronPsgd(**kw)
    steps(b, part, 0, 4)
    flatopt.save(tmp_path / "k.npz", b)
    c = flatopt.KronPsgd(**kw)
    assert c.load_state_dict(flatopt.load(tmp_path / "k.npz"))
    steps(c, part, 4, 9)
    for n in shapes:
        assert_bits_equal(full[n], part[n], n)
    assert_states_equal(a.state_dict(), c.state_dict())
    meta = a.state_dict().params["a"]
    assert meta["t"] == 9 and meta["updates"] == 3 and meta["counter"] == 0  # updates at steps 3, 6, 9
    assert not c.load_state_dict(_other_seed(a))  # another probe seed does not load


def _other_seed(opt):
    st = opt.state_dict()
    st.config_key = {**st.config_key, "seed": 1}
    return st


def test_probe_stream_properties():
    key = layout.stream_key(0, "w")
    v = layout.gaussian_probe(np, key, 0, (300, 301), np.float64)
    assert v.shape == (300, 301) and abs(v.mean()) < 0.01 and abs(v.std() - 1) < 0.01
    assert abs(np.mean(v**4) - 3) < 0.05  # Gaussian kurtosis
    v32 = layout.gaussian_probe(np, key, 0, (300, 301), np.float32)
    np.testing.assert_allclose(v32, v, rtol=0, atol=2e-5)  # same stream in float32
    assert_bits_equal(v, layout.gaussian_probe(np, key, 0, (300, 301), np.float64))
    assert not np.allclose(v, layout.gaussian_probe(np, key, 1, (300, 301), np.float64))
    other = layout.gaussian_probe(np, layout.stream_key(0, "w2"), 0, (300, 301), np.float64)
    assert abs(np.corrcoef(v.ravel(), other.ravel())[0, 1]) < 0.01


def test_probe_hook_is_used_and_seed_matters():
    calls = []
    base = table_probe(2)

    def hook(name, shape, index):
        calls.append((name, tuple(shape), index))
        return base(name, shape, index)

    outs = []
    for kw in ({"probe": hook}, {"seed": 0}, {"seed": 1}):
        opt = flatopt.KronPsgd(lr=0.01, **kw)
        p = rng_arrays(0, (2, 3, 4))
        for t in range(3):
            opt.step("w", (2, 3, 4), p, rng_arrays(t + 1, (2, 3, 4)))
        outs.append(p)
    assert calls == [("w", (6, 4), 0), ("w", (6, 4), 1), ("w", (6, 4), 2)]
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])


def test_layouts_and_merge_rules():
    opt = flatopt.KronPsgd(lr=0.1)
    assert opt.preconditioner_shape((64, 3, 3, 3)) == (64, 27)  # most square; kron_torch: 576 x 3
    assert flatopt.KronPsgd(lr=0.1, merge_rule="kron_torch").preconditioner_shape((64, 3, 3, 3)) == (576, 3)
    assert opt.preconditioner_shape(()) == (1,)
    assert opt.preconditioner_shape((8, 16, 4)) == (8, 64)
    cfg = flatopt.kron.KronPsgdConfig
    lay = layout.make_layout
    assert lay(cfg(lr=1), (50, 7)).diag == (False, False)
    assert lay(cfg(lr=1, max_size_triangular=10), (50, 7)).diag == (True, False)
    assert lay(cfg(lr=1, memory_save_mode="one_diag"), (6, 6)).diag == (False, True)  # ties: the later dim
    assert lay(cfg(lr=1, memory_save_mode="smart_one_diag"), (6, 6)).diag == (False, False)
    assert lay(cfg(lr=1, memory_save_mode="smart_one_diag"), (9, 6)).diag == (True, False)
    assert lay(cfg(lr=1, memory_save_mode="all_diag"), (9, 6)).diag == (True, True)
    assert lay(cfg(lr=1, min_ndim_triangular=3), (9, 6)).diag == (True, True)
    assert lay(cfg(lr=1), (5, 1)).diag == (False, True)
    big = flatopt.KronPsgd(lr=0.1, memory_save_mode="smart_one_diag")
    big.step("emb", (1000, 16), np.zeros(16000, np.float32), rng_arrays(0, (1000, 16)))
    assert [q.shape for q in big.factors("emb")] == [(1000,), (16, 16)]
    assert big.preconditioner_nbytes() == 4 * (1000 + 256)


def test_config_validation_and_builders():
    for bad in (dict(precond_lr=-1), dict(momentum=1.0), dict(eps=0.0), dict(clip=0.0), dict(clip=float("nan")),
                dict(update_probability=0.0), dict(memory_save_mode="some_diag"), dict(merge_rule="abs"),
                dict(precond_dtype="float16"), dict(max_size_triangular=-1), dict(seed=-1), dict(seed=1.5),
                dict(prob_schedule=(1.0, 0.03)), dict(prob_schedule=(0.5, 0.9, 0.001, 500)),
                dict(weight_decay=float("inf")), dict(precond_init_scale=0.0)):
        with pytest.raises((ValueError, TypeError), match="KronPsgd"):
            flatopt.KronPsgd(lr=0.1, **bad)
    with pytest.raises(TypeError):
        flatopt.KronPsgd(lr=0.1, merge_dims="yes")
    opt = flatopt.KronPsgd(lr=0.2, lr_scale={"w": 0.5}).with_momentum(0.5).with_weight_decay(0.1)
    assert (opt.config.momentum, opt.config.weight_decay, opt.lr, opt.lr_scale("w")) == (0.5, 0.1, 0.2, 0.5)
    opt.step("w", (3,), np.zeros(3, np.float32), np.ones(3, np.float32))
    with pytest.raises(ValueError):
        opt.with_momentum(0.9)


def test_decay_only_for_matrices_and_lr_scale():
    """weight decay is added after the clip and only for ndim >= 2 (kron_torch); a zero gradient then moves a
    matrix by exactly -lr·λ·θ (h = 0 ⇒ u = 0)."""
    opt = flatopt.KronPsgd(lr=0.5, weight_decay=0.1, lr_scale={"v": 0.5})
    w, v = rng_arrays(0, (3, 4)), rng_arrays(1, (5,))
    w0, v0 = w.copy(), v.copy()
    opt.step("w", (3, 4), w, np.zeros(12, np.float32))
    opt.step("v", (5,), v, np.zeros(5, np.float32))
    np.testing.assert_array_equal(v, v0)
    np.testing.assert_allclose(w, w0 - 0.5 * 0.1 * w0, rtol=1e-6)


def test_non_finite_gradient_keeps_q():
    opt = flatopt.KronPsgd(lr=0.01)
    p = rng_arrays(0, (4, 3))
    opt.step("w", (4, 3), p, rng_arrays(1, (4, 3)))
    before = opt.factors("w")
    g = rng_arrays(2, (4, 3))
    g[5] = np.nan
    with np.errstate(all="ignore"):
        opt.step("w", (4, 3), p, g)
    for a, b in zip(opt.factors("w"), before):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("n,m", [(257, 40), (700, 300), (300, 700), (1030, 65)])
def test_blocked_products_equal_the_full_ones(n, m):
    """``kron.blocked``: D·Q, T·X, X·T (upper and lower T) and the Gram matrices agree with the plain products to
    float64 rounding; the zero block of D·Q is exactly zero and the Gram matrices are exactly symmetric."""
    from flatopt.kron import blocked as B

    rng = np.random.default_rng(n)
    q, d = np.triu(rng.standard_normal((n, n))), np.triu(rng.standard_normal((n, n)))
    x, y = rng.standard_normal((n, m)), rng.standard_normal((m, n))

    def close(got, want):
        assert np.max(np.abs(got - want)) <= 1e-13 * np.max(np.abs(want))

    uu = B.upper_upper(np, d, q, np.empty((n, n)))
    close(uu, d @ q)
    assert np.all(np.tril(uu, -1) == 0)
    for t, lower in ((q, False), (q.T, True)):
        close(B.tri_mul(np, t, x, np.empty((n, m)), left=True, lower=lower), t @ x)
        close(B.tri_mul(np, t, y, np.empty((m, n)), left=False, lower=lower), y @ t)
    for a, rows in ((x, True), (y, False)):
        g = B.gram(np, a, np.empty((n, n)), rows)
        close(g, a @ a.T if rows else a.T @ a)
        assert np.array_equal(g, g.T)


@pytest.mark.parametrize("d,n", [(1, 4), (7, 3), (33, 5), (100, 41), (130, 300)])
def test_triangular_solves(d, n):
    """B̄'s solves: the NumPy blocked substitution (and SciPy's trsm where it is used) against a float64 inverse."""
    from flatopt.kron import numerics as K  # noqa: PLC0415

    rng = np.random.default_rng(d)
    q = (np.triu(rng.standard_normal((d, d))) * 0.1 + np.eye(d)).astype(np.float32)
    b = rng.standard_normal((d, n)).astype(np.float32)
    exact = np.linalg.inv(q.astype(np.float64)).T @ b.astype(np.float64)
    out = np.empty_like(b)
    K._lower_solve(q.T, b, out)  # noqa: SLF001
    for got in (out, K._solve_upper_t(np, q, b)):  # noqa: SLF001
        assert got.dtype == np.float32
        assert np.max(np.abs(got - exact)) <= 1e-5 * np.max(np.abs(exact))


def test_ill_conditioned_quadratic_beats_adamw_and_sgd():
    """f(W) = ½·tr(Wᵀ H_L W H_R) with rotated spectra 1..100 on each side (condition number 1e4), 300 steps with
    the same linear lr decay for all: KronPsgd (defaults, lr 0.1) ends lower than AdamW and SGD-momentum at the
    best lr of their grids (measured: about 4e-7 against 1e-4 and 3e-5)."""
    rng = np.random.default_rng(0)
    m, n, steps = 10, 8, 300
    u_l, _ = np.linalg.qr(rng.standard_normal((m, m)))
    u_r, _ = np.linalg.qr(rng.standard_normal((n, n)))
    h_l = u_l @ np.diag(np.logspace(0, 2, m)) @ u_l.T
    h_r = u_r @ np.diag(np.logspace(0, 2, n)) @ u_r.T
    w0 = rng.standard_normal((m, n))

    def loss(w):
        return 0.5 * np.sum(w * (h_l @ w @ h_r))

    def run(opt, lr):
        w = w0.astype(np.float32).reshape(-1)
        for s in range(steps):
            opt.set_lr(lr * (1 - s / steps))
            g = (h_l @ w.reshape(m, n).astype(np.float64) @ h_r).astype(np.float32)
            opt.step("W", (m, n), w, g.reshape(-1))
        f = loss(w.reshape(m, n).astype(np.float64)) / loss(w0)
        return f if np.isfinite(f) else np.inf

    with np.errstate(all="ignore"):
        kron = run(flatopt.KronPsgd(lr=0.1), 0.1)
        adamw = min(run(flatopt.AdamW(lr=lr, weight_decay=0.0), lr) for lr in (0.03, 0.1, 0.3, 1.0))
        sgd = min(run(flatopt.SGD(lr=lr, momentum=0.9), lr) for lr in (1e-4, 2e-4, 3e-4, 4e-4, 5e-4))
    assert kron < 0.1 * min(adamw, sgd), (kron, adamw, sgd)


def test_step_batch_with_hook_equals_serial():
    shapes = [(7,), (12, 9), (2, 3, 4), (30, 20)]
    outs = []
    for batch in (False, True):
        opt = flatopt.KronPsgd(lr=0.02, probe=table_probe(4))
        params = [rng_arrays(i, s) for i, s in enumerate(shapes)]
        for t in range(3):
            items = [flatopt.OptItem(f"p{i}", s, p, rng_arrays(10 * t + i, s))
                     for i, (s, p) in enumerate(zip(shapes, params))]
            if batch:
                opt.step_batch(items)
            else:
                for it in items:
                    opt.step(*it)
        outs.append((params, opt.state_dict()))
    for a, b in zip(outs[0][0], outs[1][0]):
        assert_bits_equal(a, b)
    assert_states_equal(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.usefixtures("gpu_or_emulated")  # the GPU, else the emulated device (tests/conftest.py)


@gpu
@pytest.mark.parametrize("shape", [(16,), (24, 24), (40, 9), (4, 5, 6), (300, 12)])
def test_gpu_matches_numpy(shape):
    """Same injected probes: CuPy (cuBLAS matmuls, trsm) agrees with NumPy within float32 round-off; the default
    probe stream is the same on both (to the rounding of log/cos), so the default runs agree closely too."""
    cp = backend.cupy()
    for probe in (table_probe(5), None):
        runs = []
        for xp in (np, cp):
            opt = flatopt.KronPsgd(lr=0.03, weight_decay=0.01, probe=probe)
            p = xp.asarray(rng_arrays(0, shape))
            for t in range(8):
                opt.step("w", shape, p, xp.asarray(rng_arrays(t + 1, shape)))
            runs.append((backend.to_numpy(p), [backend.to_numpy(q) for q in opt.factors("w")]))
        (p_np, q_np), (p_cp, q_cp) = runs
        p0 = rng_arrays(0, shape)
        tol = 1e-5 if probe is not None else 1e-4
        assert np.max(np.abs(p_cp - p_np)) <= tol * np.max(np.abs(p_np - p0))
        for a, b in zip(q_cp, q_np):
            assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b))
            if b.ndim == 2:
                assert not np.any(np.tril(a, -1))


@gpu
def test_gpu_step_never_synchronises():
    import cupyx  # noqa: PLC0415 - GPU-only test

    cp = backend.cupy()
    opt = flatopt.KronPsgd(lr=0.03, weight_decay=0.01, balance_seed=BALANCE_AT_5)
    shapes = [(16,), (24, 24), (4, 5, 6)]
    params = [cp.asarray(rng_arrays(i, s)) for i, s in enumerate(shapes)]
    grads = [cp.asarray(rng_arrays(10 + i, s)) for i, s in enumerate(shapes)]
    opt.step_batch([flatopt.OptItem(f"p{i}", s, p, g) for i, (s, p, g) in enumerate(zip(shapes, params, grads))])
    cp.cuda.get_current_stream().synchronize()  # first step compiles/allocates outside the guard
    with cupyx.allow_synchronize(False):
        for _ in range(6):  # crosses the balance at step 5
            opt.step_batch([flatopt.OptItem(f"p{i}", s, p, g)
                            for i, (s, p, g) in enumerate(zip(shapes, params, grads))])
    assert all(bool(cp.all(cp.isfinite(p))) for p in params)


@gpu
def test_gpu_checkpoint_moves_between_backends(tmp_path):
    cp = backend.cupy()
    shape = (12, 10)
    a = flatopt.KronPsgd(lr=0.03)
    p = rng_arrays(0, shape)
    for t in range(3):
        a.step("w", shape, p, rng_arrays(t + 1, shape))
    flatopt.save(tmp_path / "k.npz", a)
    b = flatopt.KronPsgd(lr=0.03)
    assert b.load_state_dict(flatopt.load(tmp_path / "k.npz"))
    pg = cp.asarray(p)
    a.step("w", shape, p, rng_arrays(9, shape))
    b.step("w", shape, pg, cp.asarray(rng_arrays(9, shape)))
    np.testing.assert_allclose(backend.to_numpy(pg), p, rtol=0, atol=1e-5)

"""Soap: an independent float64 reference written from the rule (reference/catalogue.md §7), conformance with
pytorch-optimizer's ``SOAP`` (the oracle), the first call, the refresh schedule across checkpoints, step_batch under
any BLAS thread count, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flatopt
from flatopt import OptItem

from .helpers import assert_bits_equal, assert_states_equal

# (shape, options): a square matrix, a vector (Adam path), a 3-D tensor, and a non-square matrix whose long side
# is excluded by max_precond_dim (the statistic of a long side is rank-deficient: its basis is not unique, and
# LAPACK builds pick different ones, see the module doc).
CASES = [
    ((6, 6), {}),
    ((10,), {}),
    ((3, 4, 5), {}),
    ((12, 7), {"max_precond_dim": 7}),
]
HP = dict(lr=0.01, betas=(0.9, 0.98), shampoo_beta=0.9, eps=1e-8, weight_decay=0.05, precondition_frequency=3)
STEPS = 12  # four refreshes (k = 3, 6, 9, 12 ... k = t - 1 up to 11: k = 3, 6, 9)


def _grads(shape, steps, seed, dtype):
    r = np.random.default_rng(seed)
    return [r.standard_normal(math.prod(shape)).astype(dtype) for _ in range(steps)]


def _flatopt_run(shape, opts, dtype, steps=STEPS, seed=1, **hp):
    p = np.random.default_rng(seed + 100).standard_normal(math.prod(shape)).astype(dtype)
    start = p.copy()
    opt = flatopt.Soap(**{**HP, **hp}, **opts)
    for g in _grads(shape, steps, seed, dtype):
        opt.step("w", shape, p, g)
    return start, p, opt


# ------------------------------------------------------------------------------------- float64 reference
def _mode(x, a, axis):
    """x ×_axis a: every fibre along ``axis`` multiplied by the matrix a."""
    return np.moveaxis(np.einsum("ij,...j->...i", a, np.moveaxis(x, axis, -1)), -1, axis)


def _reference(shape, opts, dtype, steps=STEPS, seed=1):
    """SOAP from the formula in float64, with einsum mode products (not the module's matmul/tensordot paths), on
    the inputs ``_flatopt_run`` draws in ``dtype``."""
    hp = {**HP, **opts}
    b1, b2 = hp["betas"]
    bs, lr, wd, eps, freq = hp["shampoo_beta"], hp["lr"], hp["weight_decay"], hp["eps"], hp["precondition_frequency"]
    cap = hp.get("max_precond_dim", 10000)
    theta = np.random.default_rng(seed + 100).standard_normal(math.prod(shape)).astype(dtype)
    theta = theta.astype(np.float64).reshape(shape)
    pre = [d <= cap for d in shape] if len(shape) > 1 else [False]
    L = [np.zeros((d, d)) if on else None for d, on in zip(shape, pre)]
    Q = [None] * len(shape)
    m = np.zeros(shape)
    v = np.zeros(shape)

    def gram(g, i):
        gi = np.moveaxis(g, i, 0).reshape(shape[i], -1)
        return np.einsum("ik,jk->ij", gi, gi)

    def P(x, back=False):
        for i, q in enumerate(Q):
            if q is not None:
                x = _mode(x, q if back else q.T, i)
        return x

    for t, g32 in enumerate(_grads(shape, steps, seed, dtype), start=1):
        g = g32.astype(np.float64).reshape(shape)
        if t == 1:
            for i in range(len(shape)):
                if L[i] is not None:
                    L[i] = (1 - bs) * gram(g, i)
                    w, vec = np.linalg.eigh(L[i])
                    Q[i] = vec[:, np.argsort(-w)]
            continue
        k = t - 1
        gp = P(g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * gp**2
        n = P(P(m) / (np.sqrt(v) + eps), back=True)
        theta = theta - lr * math.sqrt(1 - b2**k) / (1 - b1**k) * n
        theta = theta * (1 - lr * wd)
        for i in range(len(shape)):
            if L[i] is not None:
                L[i] = bs * L[i] + (1 - bs) * gram(g, i)
        if k % freq == 0:
            for i in range(len(shape)):
                if Q[i] is not None:
                    mq = L[i] @ Q[i]
                    order = np.argsort(-np.diag(Q[i].T @ mq))
                    v = np.take(v, order, axis=i)
                    Q[i] = np.linalg.qr(mq[:, order])[0]
    return theta.reshape(-1)


def _rel(delta, ref_delta):
    return float(np.linalg.norm(delta - ref_delta) / np.linalg.norm(ref_delta))


@pytest.mark.parametrize("shape,opts", CASES, ids=[str(s) for s, _ in CASES])
def test_float64_matches_the_reference(shape, opts):
    """flatopt in float64 against the formula in float64: the same LAPACK eigh/QR on both sides, so only the
    summation order of the products differs (measured ≤ 5e-15; the update is invariant to the sign of each
    eigenvector, so sign choices cannot differ).  1e-10 leaves room for other BLAS/LAPACK builds."""
    start, p, _ = _flatopt_run(shape, opts, np.float64)
    ref = _reference(shape, opts, np.float64)
    assert _rel(p - start, ref - start) <= 1e-10


@pytest.mark.parametrize("shape,opts", CASES, ids=[str(s) for s, _ in CASES])
def test_float32_matches_the_reference(shape, opts):
    """float32 against the float64 formula.  Two float32 effects: θ itself is stored in float32 (ε₃₂·|θ| ≈ 6e-8 per
    step against an accumulated update of ~0.1 per element: ~6e-6 after 12 steps, the whole error of the vector's
    Adam path), and eigenvector rounding, ~ε₃₂/relative eigen-gap ≈ 6e-8/1e-2 per basis, which the projections
    carry into the update.  Measured ≤ 8.4e-6; 5e-5 as the catalogue's SOAP bound.  Real bugs (decay order, a step
    on the first call, a missing permutation of v) cost 1.5e-3 to 1."""
    start, p, _ = _flatopt_run(shape, opts, np.float32)
    ref = _reference(shape, opts, np.float32)
    assert _rel(p.astype(np.float64) - start, ref - start) <= 5e-5


@pytest.mark.parametrize("shape,opts", CASES, ids=[str(s) for s, _ in CASES])
def test_conformance_with_pytorch_optimizer(shape, opts):
    """Against pytorch-optimizer 4.1.0 ``SOAP`` (= the official code to ~1e-6), float32, 12 steps with three
    refreshes, weight decay and non-default betas and shampoo_beta.  Tolerance 5e-5 (see the float32 test: two
    float32 eigenbases of the same statistics, each ~6e-6 from the exact one, the same float32 storage of θ on both
    sides; measured ≤ 1.9e-6, and bit-identical on the vector's Adam path)."""
    torch = pytest.importorskip("torch")
    po = pytest.importorskip("pytorch_optimizer")
    start, p, _ = _flatopt_run(shape, opts, np.float32)
    w = torch.nn.Parameter(torch.from_numpy(start.reshape(shape).copy()))
    opt = po.SOAP([w], lr=HP["lr"], betas=HP["betas"], shampoo_beta=HP["shampoo_beta"],
                  weight_decay=HP["weight_decay"], precondition_frequency=HP["precondition_frequency"],
                  max_precondition_dim=opts.get("max_precond_dim", 10000), merge_dims=False, precondition_1d=False,
                  correct_bias=True, normalize_gradient=False, eps=HP["eps"])
    for g in _grads(shape, STEPS, 1, np.float32):
        w.grad = torch.from_numpy(g.reshape(shape).copy())
        opt.step()
    oracle = w.detach().numpy().reshape(-1).astype(np.float64)
    assert _rel(p.astype(np.float64) - start, oracle - start) <= 5e-5


def test_first_call_only_initialises():
    shape = (5, 4)
    p = np.random.default_rng(0).standard_normal(20).astype(np.float32)
    before = p.copy()
    opt = flatopt.Soap(lr=0.1, weight_decay=0.5)
    g = np.random.default_rng(1).standard_normal(20).astype(np.float32)
    opt.step("w", shape, p, g)
    assert_bits_equal(p, before, "no step and no decay at t = 1")
    st = opt.state_dict()
    q = st.buffers["q/w"]
    ql, qr = q[:25].reshape(5, 5), q[25:].reshape(4, 4)
    G = g.reshape(shape).astype(np.float64)
    for qm, stat in ((ql, G @ G.T), (qr, G.T @ G)):
        assert np.allclose(qm.T @ qm, np.eye(len(qm)), atol=1e-6)
        eig = np.diag(qm.T.astype(np.float64) @ stat @ qm)
        assert np.all(np.diff(eig) <= 1e-6 * eig[0]), "columns in descending eigenvalue order"
    assert not np.any(st.buffers["exp_avg/w"]) and not np.any(st.buffers["exp_avg_sq/w"])


def test_small_gradients_still_rotate_the_basis():
    """rlx-optim's Jacobi eigh with absolute tolerances never rotated for gradients below ~1e-3 (SOAP became Adam):
    here the bases follow the statistics whatever their scale, and the step is scale-invariant like Adam's."""
    shape = (6, 5)
    steps = {}
    for scale in (1.0, 1e-4):
        p = np.zeros(30, np.float32)
        opt = flatopt.Soap(lr=0.01, weight_decay=0.0, eps=0.0, precondition_frequency=2)
        for g in _grads(shape, 6, 3, np.float32):
            opt.step("w", shape, p, (g * scale).astype(np.float32))
        q = opt.state_dict().buffers["q/w"]
        assert np.abs(np.abs(q[:36].reshape(6, 6)) - np.eye(6)).max() > 0.1, "the basis rotated"
        steps[scale] = p.copy()
    assert np.allclose(steps[1e-4], steps[1.0], rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("split", range(1, 9))
def test_resume_at_every_point_of_the_refresh_schedule(split, tmp_path):
    """Save after ``split`` steps (before, at and after refreshes of frequency 3), load into a fresh optimizer
    through a file, continue: bit-identical to the uninterrupted run, bases, statistics and permuted v included."""
    shapes = {"a": (5, 5), "b": (2, 3, 4), "c": (6,)}
    grads = {n: _grads(s, 10, i, np.float32) for i, (n, s) in enumerate(shapes.items())}

    def fresh():
        return {n: np.random.default_rng(i).standard_normal(math.prod(s)).astype(np.float32)
                for i, (n, s) in enumerate(shapes.items())}

    def run(opt, params, lo, hi):
        for k in range(lo, hi):
            for n, s in shapes.items():
                opt.step(n, s, params[n], grads[n][k])
            opt.end_iteration()

    a, b = fresh(), fresh()
    opt_a = flatopt.Soap(**HP, precondition_1d=True)
    run(opt_a, a, 0, 10)
    opt_b = flatopt.Soap(**HP, precondition_1d=True)
    run(opt_b, b, 0, split)
    flatopt.save(tmp_path / "soap.npz", opt_b)
    opt_c = flatopt.Soap(**HP, precondition_1d=True)
    assert opt_c.load_state_dict(flatopt.load(tmp_path / "soap.npz"))
    run(opt_c, b, split, 10)
    for n in shapes:
        assert_bits_equal(a[n], b[n], n)
    assert_states_equal(opt_a.state_dict(), opt_c.state_dict())


def test_layout_options_must_match_to_load():
    opt = flatopt.Soap()
    p = np.ones(12, np.float32)
    opt.step("w", (4, 3), p, np.arange(12, dtype=np.float32))
    st = opt.state_dict()
    assert flatopt.Soap(lr=0.5, betas=(0.8, 0.9)).load_state_dict(st)  # hyper-parameters may differ
    assert not flatopt.Soap(max_precond_dim=3).load_state_dict(st)
    assert not flatopt.Soap(precondition_1d=True).load_state_dict(st)


@pytest.mark.parametrize("threads", [1, 2])
def test_step_batch_equals_serial_at_any_blas_thread_count(threads):
    """step_batch runs Soap's items serially (``threaded = False``), so its BLAS calls run at the caller's thread
    count exactly like the serial loop's: bit-identical with the BLAS held at 1 thread or at 2."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    shapes = [(64, 96), (96,), (3, 16, 20), (128, 128), (8, 8)]

    def run(batch):
        params = [np.random.default_rng(i).standard_normal(math.prod(s)).astype(np.float32)
                  for i, s in enumerate(shapes)]
        opt = flatopt.Soap(precondition_frequency=2, precondition_1d=True)
        for k in range(5):
            items = [OptItem(f"p{i}", s, params[i], _grads(s, 1, 10 * k + i, np.float32)[0])
                     for i, s in enumerate(shapes)]
            if batch:
                opt.step_batch(items)
            else:
                for it in items:
                    opt.step(*it)
        return params, opt.state_dict()

    with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
        (pa, sa), (pb, sb) = run(False), run(True)
    for i in range(len(shapes)):
        assert_bits_equal(pa[i], pb[i], str(shapes[i]))
    assert_states_equal(sa, sb)


@pytest.mark.parametrize("kw,err", [
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas\\[0\\]"), (dict(betas=(0.9, -0.1)), "betas\\[1\\]"),
    (dict(betas=0.9), "betas"), (dict(shampoo_beta=1.0), "shampoo_beta"), (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=float("nan")), "weight_decay"), (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(precondition_frequency=2.5), "precondition_frequency"), (dict(max_precond_dim=0), "max_precond_dim"),
    (dict(precondition_1d=1), "precondition_1d"),
])
def test_config_validated_field_by_field(kw, err):
    with pytest.raises((ValueError, TypeError), match=err):
        flatopt.Soap(**kw)


def test_defaults_are_the_official_ones():
    c = flatopt.Soap().config
    assert (c.lr, c.betas, c.shampoo_beta, c.eps, c.weight_decay, c.precondition_frequency, c.max_precond_dim,
            c.precondition_1d) == (3e-3, (0.95, 0.95), None, 1e-8, 1e-2, 10, 10000, False)
    assert c.beta_s == 0.95 and flatopt.Soap(shampoo_beta=0.5).config.beta_s == 0.5


@pytest.mark.parametrize("shape", [(1, 1), (5, 5), (97, 20), (260, 260), (420, 161)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_householder_q_is_lapacks_q(shape, dtype):
    """The refresh's QR on NumPy (``core.linalg.householder_q``: below ``SMALL_QR`` elements numpy's; from there
    blocked over panels of ``QR_BLOCK`` columns, which (260, 260) and (420, 161) cross) gives LAPACK's Q and
    diag(R): the same reflectors, so the same column signs; orthonormal to a few ε; a zero column (rank
    deficiency) is handled as LAPACK does (τ = 0); the input is not modified and ``out`` receives Q."""
    from flatopt.core import linalg

    a = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    if shape[1] > 3:
        a[:, 2] = 0.0
    before = a.copy()
    out = np.full(shape, np.nan, dtype)
    q, rdiag = linalg.householder_q(a, out=out)
    assert q is out
    assert_bits_equal(a, before, "input untouched")
    ref, r = np.linalg.qr(a.astype(np.float64))
    eps = np.finfo(dtype).eps
    assert q.dtype == dtype and q.shape == ref.shape
    assert np.abs(q.T.astype(np.float64) @ q - np.eye(shape[1])).max() <= 50 * eps
    keep = [j for j in range(shape[1]) if j != 2 or shape[1] <= 3]  # a zero column's direction is arbitrary
    assert np.abs(q[:, keep] - ref[:, keep]).max() <= 1e3 * eps
    assert np.abs(rdiag[keep] - np.diag(r)[keep]).max() <= 1e3 * eps * np.abs(r).max()

"""The fused APOLLO step of Adafactor8Bit (kernels/apollo8bit.cu, flatopt/adafactor8bit/apollo_fused.py) against its
twin (``FLATOPT_FORCE_TWIN=1``: apollo.py's CuPy path), on a real GPU when one answers, else on the emulated device.

* P's draw: the twin's bits (integer operations, one gather, one multiply, one add);
* where no sum can differ (every sum of at most two terms: 1×2, 2×1, 2×2 shapes and ranks ≤ 2), the whole step is
  the twin's, bit for bit: parameter, low-rank moments (8-bit codes or float32) and the Fira state, over all the
  options the fused path reads (channel / tensor scaling, left / right, Fira, the RMS clip, decay, bias correction,
  apollo_scale in front or behind, maximize, CAME and apollo_factorize, a cached P, float32 and float64);
* general shapes: the low-rank moments are the twin's bits (they depend on G_low alone); the parameter and the Fira
  state agree within the rounding of the float32 sums the twin makes in another order (``_twin_bound``, derived
  below), and the fused sums match a float64 reference within a few float32 roundings (``_reference_step``);
* ``step_batch`` ≡ serial ``step`` bit for bit; non-finite gradient entries read as 0 as in the twin;
* on the stand-in: the launches, host synchronisations and allocations of a steady-state step (issue #19: ≤ 16).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.adafactor8bit import apollo_fused, apollo_proj
from flatopt.adafactor8bit.common import rho_of
from flatopt.core import backend, workspace

from .cuda_emu import emu, fakecupy
from .helpers import assert_bits_equal, rng_arrays

gpu_device = pytest.fixture(scope="module", autouse=True)(fakecupy.device_or_emulated)

U32 = 2.0**-24  # float32's unit roundoff
BASE = dict(lr=1e-2, beta1=0.9, apollo_rank=2, apollo_update_proj_gap=2)


def _data(shape, dtype, steps, seed=0, bad=None):
    n = math.prod(shape)
    p0 = rng_arrays(seed, shape, dtype)
    grads = [rng_arrays(seed + 1 + s, shape, dtype) for s in range(steps)]
    if bad is not None:
        for s, g in enumerate(grads):
            g[(7 * s) % n] = bad
    return p0, grads


def _run(shape, kw, twin, p0, grads, monkeypatch, *, each=None):
    """Steps of ``Adafactor8Bit(**BASE, **kw)`` on one parameter; ``each(opt, p, g, t)`` after every step."""
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", twin)
    cp = backend.cupy()
    p = cp.asarray(p0.copy())
    opt = flatopt.Adafactor8Bit(**{**BASE, **kw})
    for t, g in enumerate(grads, 1):
        gd = cp.asarray(g)
        before = backend.to_numpy(p).copy()
        prev = opt._slots["w"].state.fira_prev if "w" in opt._slots else None  # noqa: SLF001
        prev = None if prev is None else backend.to_numpy(prev).copy()
        opt.step("w", shape, p, gd)
        opt.end_iteration()
        if each is not None:
            each(opt, before, prev, p, g, t)
    return backend.to_numpy(p), opt.state_dict().params["w"]


def _states(st, skip=()):
    return {k: np.asarray(v) for k, v in st.items() if isinstance(v, np.ndarray) and k not in skip}


def _assert_states_equal(a, b, skip=()):
    sa, sb = _states(a, skip), _states(b, skip)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert_bits_equal(sa[k], sb[k], k)


# ------------------------------------------------------------------------------------------------ the draw
@pytest.mark.parametrize("n, seed", [(1, 1), (2, 7), (4097, 2**63 + 12345), (3 * 256 + 5, 123456789)])
def test_draw_kernel_is_the_twin_draw(n, seed):
    cp = backend.cupy()
    scale = 1.0 / math.sqrt(3)
    want = np.empty(n, np.float32)
    apollo_proj.draw(np, seed, 0, want, scale)
    got = cp.empty(n, np.float32)
    apollo_proj.draw_kernel(cp, seed, got, scale)
    assert_bits_equal(got, want, "P")


# ------------------------------------------------------------------- bit for bit where no sum can differ
TINY = [((2, 1), 1), ((2, 1), 2), ((1, 2), 1), ((1, 2), 2), ((1, 1), 2), ((2, 1, 1), 2)]
OPTIONS = {
    "defaults": {},
    "tensor": dict(apollo_scale_type="tensor"),
    "manual_bias_wd": dict(relative_step=False, beta2=0.999, weight_decay=0.1, scale_weight_decay=False, lr=0.05),
    "scaled_wd_clip": dict(weight_decay=0.05, d=0.5, fira_margin=0.05, apollo_scale=2.0),
    "front_scale": dict(apollo_scale=3.0, apollo_scale_front=True, apollo_scale_type="tensor"),
    "no_fira_no_clip": dict(enable_fira_for_apollo=False, d=0.0, beta1=None, maximize=True),
    "fira_no_clip": dict(d=0.0, maximize=True),
    "came": dict(relative_step=False, beta2=0.999, beta3=0.999, lr=0.05),
    "factorize": dict(apollo_factorize=True),
    "cached_proj": dict(apollo_cache_proj=True, apollo_update_proj_gap=3),
    "injected_proj": dict(apollo_proj_fn=lambda seed, shape: np.random.default_rng(seed).standard_normal(shape),
                          apollo_next_seed=lambda seed: seed + 1),
}


def _tiny_shapes(opts):
    """The shapes whose sums all have at most two terms: G's (and θ's) rows and columns, G_low's rows and columns,
    the channels; the tensor sums over the whole of G (θ) and G_low: two elements at most."""
    out = []
    for shape, rank in TINY:
        r_, c_ = (shape[0], math.prod(shape[1:]))
        lr_, lc_ = (r_, rank) if r_ >= c_ else (rank, c_)
        if opts.get("apollo_scale_type") == "tensor" and lr_ * lc_ > 2:
            continue
        out.append((shape, rank))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_bits_equal_twin_where_no_sum_can_differ(name, dtype, monkeypatch):
    for shape, rank in _tiny_shapes(OPTIONS[name]):
        kw = dict(OPTIONS[name], apollo_rank=rank)
        p0, grads = _data(shape, dtype, 6, seed=rank)
        twin = _run(shape, kw, "1", p0, grads, monkeypatch)
        fused = _run(shape, kw, "0", p0, grads, monkeypatch)
        assert_bits_equal(fused[0], twin[0], f"{shape} r={rank}")
        _assert_states_equal(fused[1], twin[1])


# ----------------------------------------------------------------------------- general shapes vs the twin
def _e(n: int) -> float:
    """Bound on the relative difference between two float32 results of a sum of n ≥ 1 non-negative terms: the twin's
    (any order: γ_{n−1} = (n−1)u/(1 − (n−1)u), Higham, Accuracy and Stability, §4.2) and the fused one (double
    accumulation of the float32 terms, one rounding: u + n·2⁻⁵³)."""
    k = (n - 1) * U32
    return k / (1 - k) + U32 + n * 2.0**-53


def _twin_bound(kw, shape) -> float:
    """Relative bound on the difference of the step coefficient cs (and of the decay's α·λ) between the twin and the
    fused path from the same state: α = ρ·max(√Σθ²/√n, ε₂): ½e(n); s = √ΣU²/(√ΣG_low² + 1e-8): ½e(L) + ½e(L)
    (L the low-rank sum's length); the norm: ½(e(K) + e(M)) + rel(s) (channel: K channels of G sums of M terms;
    tensor: √ΣG²·s, M = n); the Fira factor and the clip: rel(norm) each; plus a float32 rounding per operation
    (16u in all)."""
    r_, c_ = shape[0], math.prod(shape[1:])
    right, rank, n = r_ >= c_, kw.get("apollo_rank", BASE["apollo_rank"]), r_ * c_
    lr_, lc_ = (r_, rank) if right else (rank, c_)
    if kw.get("apollo_scale_type") == "tensor":
        rel_s = _e(lr_ * lc_)
        rel_n = 0.5 * _e(n) + rel_s
    else:
        rel_s = _e(rank)
        k, m = (r_, c_) if right else (c_, r_)
        rel_n = 0.5 * (_e(k) + _e(m)) + rel_s
    rel_a = 0.5 * _e(n)
    return rel_a + rel_s + 2 * rel_n + 16 * U32


GENERAL = [
    ((40, 24), dict(apollo_rank=4)),  # right, channel
    ((24, 40), dict(apollo_rank=4, weight_decay=0.1)),  # left, channel
    ((37, 19), dict(apollo_rank=25, min_8bit_size=0, block_size=128, m_block_size=32)),  # rank > C, 8-bit moments
    ((19, 37), dict(apollo_rank=25, apollo_scale_type="tensor")),
    ((3, 5, 7), dict(apollo_rank=3, enable_fira_for_apollo=False)),  # viewed as 3 × 35 (left)
    ((300, 7), dict(apollo_rank=5, apollo_scale_type="tensor", d=0.0, min_8bit_size=0, block_size=128,
                    m_block_size=32)),
    ((9, 300), dict(apollo_rank=5, beta3=0.999, relative_step=False, beta2=0.99, lr=0.05)),  # CAME, left
    ((60, 50), dict(apollo_rank=6, apollo_factorize=True, weight_decay=0.01)),
]


def _chunks(monkeypatch, small: bool):
    if small:  # the sums' layouts cross several chunks (ROW) and tiles (COL) on these small shapes
        monkeypatch.setattr(apollo_fused, "CHUNK", 16)
        monkeypatch.setattr(apollo_fused, "TILE", 3)


@pytest.mark.parametrize("small", [False, True], ids=["layout", "small_layout"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, kw", GENERAL, ids=[f"{'x'.join(map(str, s))}-{i}" for i, (s, _) in
                                                     enumerate(GENERAL)])
def test_moments_bitwise_and_update_within_the_rounding_of_the_sums(shape, kw, dtype, small, monkeypatch):
    _chunks(monkeypatch, small)
    _compare_with_twin(shape, kw, dtype, 5, monkeypatch)


def test_issue_workload_against_the_twin(monkeypatch):
    """``Adafactor8Bit(lr=1e-2, beta1=0.9, apollo_rank=256)`` on 2048×1024 (8-bit v_low and m_low, channel scaling,
    Fira), a refresh at step 3."""
    _compare_with_twin((2048, 1024), dict(apollo_rank=256), np.float32, 3, monkeypatch)


def _compare_with_twin(shape, kw, dtype, steps, monkeypatch):
    """Each step of the fused path is compared with the twin's step from the same state (the twin is given the
    fused run's θ and Fira state before the step; the low-rank moments are the same bits, asserted after each
    step): |Δθ_fused − Δθ_twin| ≤ bound·(|Δθ| + |θ|·α·λ) + 2 ulp(θ), bound = ``_twin_bound``; the Fira state
    within bound·|prev|."""
    p0, grads = _data(shape, dtype, steps, seed=len(shape))
    bound = _twin_bound(kw, shape)
    cp = backend.cupy()
    twin_opt = flatopt.Adafactor8Bit(**{**BASE, **kw})
    tp = cp.asarray(p0.copy())

    def each(opt, before, prev, p, g, t):
        tp[...] = cp.asarray(before)
        tst = twin_opt._slots["w"].state if "w" in twin_opt._slots else None  # noqa: SLF001
        if tst is not None and tst.fira_prev is not None:
            tst.fira_prev[...] = cp.asarray(prev)
        with pytest.MonkeyPatch.context() as m:
            m.setenv("FLATOPT_FORCE_TWIN", "1")
            twin_opt.step("w", shape, tp, cp.asarray(g))
            twin_opt.end_iteration()
        _assert_states_equal(opt.state_dict().params["w"], twin_opt.state_dict().params["w"], skip=("fira_prev",))
        got, want = backend.to_numpy(p), backend.to_numpy(tp)
        wd_part = np.abs(before).max() * 0.1 * abs(kw.get("weight_decay", 0.0))  # α·λ ≤ 0.1·λ here (lr ≤ 0.05)
        tol = bound * (np.abs(want - before).max() + wd_part) + 2 * np.spacing(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"step {t}")
        fs, ts = opt._slots["w"].state.fira_prev, twin_opt._slots["w"].state.fira_prev  # noqa: SLF001
        if fs is not None:
            a, b = backend.to_numpy(fs), backend.to_numpy(ts)
            np.testing.assert_allclose(a, b, rtol=bound + 4 * U32, err_msg=f"Fira state, step {t}")

    _run(shape, kw, "0", p0, grads, monkeypatch, each=each)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vectors_beside_apollo_matrices_step_as_without_apollo(dtype, monkeypatch):
    """The 1-D fallback (APOLLO needs ≥ 2 dimensions): vectors take the non-APOLLO path, bit for bit as the same
    optimizer without APOLLO (its fused path, whose agreement with the twin tests/test_adafactor8bit_fused.py
    checks), and so bit for bit as the twin where the vector's sums are exact."""
    kw = dict(apollo_rank=4, min_8bit_size=0, block_size=128, m_block_size=32)
    for shape in ((7,), (300,)):
        p0, grads = _data(shape, dtype, 4)
        plain = _run(shape, {**kw, "apollo_rank": 0}, "0", p0, grads, monkeypatch)
        fused = _run(shape, kw, "0", p0, grads, monkeypatch)
        assert_bits_equal(fused[0], plain[0], str(shape))
        _assert_states_equal(fused[1], plain[1])


# ------------------------------------------------------------------------------ the sums vs float64
def _reference_step(cfg, shape, before, prev, g32, glow, v, m, t):
    """θ after the step from the fused step's exact inputs (its G, G_low and float32 moments), with every sum made
    in float64 and rounded once to float32, every other operation the twin's float32 one (apollo._update)."""
    f32, f64 = np.float32, np.float64
    r_, c_ = shape[0], math.prod(shape[1:])
    right, n = r_ >= c_, r_ * c_
    src = glow if cfg.beta1 is None else m
    den = np.sqrt(v) + f32(cfg.apollo_eps)
    u = (src / den).astype(f32)

    def sq_sum(x, axis=None):
        return np.sum((x * x).astype(f64), axis=axis).astype(f32)

    rho = rho_of(cfg, t, (cfg.lr, 1.0))
    alpha = rho
    if cfg.scale_parameter:
        alpha = np.maximum(np.sqrt(sq_sum(before)) / f32(math.sqrt(n)), f32(cfg.eps[1])) * rho
    sq = f32(math.sqrt(cfg.apollo_scale))
    gm, um, lm = g32.reshape(r_, c_), u.reshape(glow.shape), glow
    if cfg.apollo_scale_type == "tensor":
        s = np.sqrt(sq_sum(um)) / (np.sqrt(sq_sum(lm)) + f32(1e-8))
        s = s * sq if cfg.apollo_scale_front else s
        nrm = np.sqrt(sq_sum(gm)) * s
    else:
        ax = 1 if right else 0
        s = np.sqrt(sq_sum(um, ax)) / (np.sqrt(sq_sum(lm, ax)) + f32(1e-8))
        s = s * sq if cfg.apollo_scale_front else s
        nrm = np.sqrt(np.sum((sq_sum(gm, ax) * (s * s)).astype(f64)).astype(f32))
    f = f32(1.0)
    if cfg.enable_fira_for_apollo:
        nm = nrm if np.isfinite(nrm) else f32(0.0)
        p0 = f32(-1.0 if prev is None else prev[0])  # (a fresh limiter state is −1)
        one_m = f32(1.0 + cfg.fira_margin)
        f = f32(1.0) if p0 < f32(1e-6) else f32(1.0) / (np.maximum(nm / (p0 + f32(1e-8)), one_m) / one_m)
    final = s * f if cfg.enable_fira_for_apollo else s
    final = final if cfg.apollo_scale_front else final * sq
    coef = -alpha
    if cfg.d > 0:
        coef = coef / np.maximum(nrm / f32(math.sqrt(n) * cfg.d), f32(1.0))
    cs = (coef * final).astype(f32)
    cs = cs.reshape(-1, 1) if cs.ndim and right else cs
    out = before.reshape(r_, c_).copy()
    if cfg.weight_decay:
        c = alpha if cfg.scale_weight_decay else rho
        out *= f32(1.0) - c * f32(cfg.weight_decay)
    return out + (gm * cs).astype(f32), np.abs(gm * cs).max()


REFERENCE = [((40, 24), {}), ((24, 40), dict(weight_decay=0.1)), ((19, 37), dict(apollo_scale_type="tensor")),
             ((300, 7), dict(apollo_scale=2.0, apollo_scale_front=True, d=0.3)),
             ((2048, 1024), dict(apollo_rank=256))]


@pytest.mark.parametrize("small", [False, True], ids=["layout", "small_layout"])
@pytest.mark.parametrize("shape, kw", REFERENCE, ids=["x".join(map(str, s)) for s, _ in REFERENCE])
def test_sums_are_float32_roundings_of_exact_sums(shape, kw, small, monkeypatch):
    """The fused path's sums are made in double and rounded once: each step equals a float64-sum reference within
    a few float32 roundings (≤ 32u of the update, + 1 ulp of θ: a sum whose exact value lies within n·2⁻⁵³ of a
    float32 rounding boundary may round the other way).  Float32 moments (their exact values are the state)."""
    if math.prod(shape) > 10**5 and small:
        pytest.skip("the large shape once (its default layout)")
    _chunks(monkeypatch, small)
    kw = dict(kw, quantize=False, apollo_rank=kw.get("apollo_rank", 4))

    def each(opt, before, prev, p, g, t):
        st = opt._slots["w"].state  # noqa: SLF001
        cp = backend.cupy()
        r_, c_ = shape[0], math.prod(shape[1:])
        rank = st.cfg.apollo_rank
        lshape = (r_, rank) if r_ >= c_ else (rank, c_)
        g32 = backend.to_numpy(workspace.get(cp, "g32", r_ * c_, np.float32)).copy()
        glow = backend.to_numpy(workspace.get(cp, "a_glow", lshape[0] * lshape[1], np.float32)).reshape(lshape)
        want, upd = _reference_step(st.cfg, shape, before, prev, g32, glow, backend.to_numpy(st.v_low).reshape(lshape),
                                    backend.to_numpy(st.m_low).reshape(lshape), t)
        got = backend.to_numpy(p).reshape(want.shape)
        tol = 32 * U32 * upd + np.spacing(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"step {t}")

    p0, grads = _data(shape, np.float32, 3 if math.prod(shape) < 10**5 else 2)
    _run(shape, kw, "0", p0, grads, monkeypatch, each=each)


# -------------------------------------------------------------------------- batches, twin switch, non-finite
def _batch_params(cp):
    shapes = {"a": (40, 24), "b": (24, 40), "c": (7,), "d": (3, 5, 7), "e": (1, 1)}
    return {k: (s, cp.asarray(rng_arrays(i, s))) for i, (k, s) in enumerate(sorted(shapes.items()))}


def test_step_batch_equals_serial_steps():
    cp = backend.cupy()
    kw = dict(BASE, apollo_rank=3, min_8bit_size=0, block_size=128, m_block_size=32)
    a, b = _batch_params(cp), _batch_params(cp)
    oa, ob = flatopt.Adafactor8Bit(**kw), flatopt.Adafactor8Bit(**kw)
    for it in range(4):
        grads = {k: cp.asarray(rng_arrays(50 + it * 10 + i, s)) for i, (k, (s, _)) in enumerate(sorted(a.items()))}
        for k, (s, p) in sorted(a.items()):
            oa.step(k, s, p, grads[k])
        ob.step_batch([OptItem(k, s, p, grads[k]) for k, (s, p) in sorted(b.items())])
        oa.end_iteration(), ob.end_iteration()
    for k in a:
        assert_bits_equal(a[k][1], b[k][1], k)


@pytest.mark.parametrize("how", ["use_cuda_kernel", "FLATOPT_FORCE_TWIN"])
def test_twin_switches_run_no_fused_kernel(how, gpu_device, monkeypatch):
    if gpu_device != "emulated":
        pytest.skip("counts kernels on the emulator")
    kw = dict(use_cuda_kernel=False) if how == "use_cuda_kernel" else {}
    if how == "FLATOPT_FORCE_TWIN":
        monkeypatch.setenv("FLATOPT_FORCE_TWIN", "1")
    before = {k: v for k, v in emu.stats.by_kernel.items() if k.startswith("ap_")}
    cp = backend.cupy()
    p = cp.asarray(rng_arrays(0, (40, 24)))
    opt = flatopt.Adafactor8Bit(**{**BASE, **kw})
    opt.step("w", (40, 24), p, cp.asarray(rng_arrays(1, (40, 24))))
    after = {k: v for k, v in emu.stats.by_kernel.items() if k.startswith("ap_")}
    assert after == before


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("scale_type", ["channel", "tensor"])
def test_nonfinite_gradient_entries_read_as_zero(bad, scale_type, monkeypatch):
    shape, kw = (24, 40), dict(apollo_rank=4, apollo_scale_type=scale_type)
    p0, grads = _data(shape, np.float32, 3, bad=bad)
    twin = _run(shape, kw, "1", p0, grads, monkeypatch)
    fused = _run(shape, kw, "0", p0, grads, monkeypatch)
    assert np.all(np.isfinite(fused[0]))
    _assert_states_equal(fused[1], twin[1], skip=("fira_prev",))
    np.testing.assert_allclose(fused[0], twin[0], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ launches on the stand-in
ALL = ("ap_draw", "ap_grad", "ap_lowrank", "ap_scalars", "ap_apply")
COUNTS = {  # configuration -> the kernels of apollo8bit.cu launched in a steady-state step (once each)
    "defaults": ({}, ALL),  # + the 8-bit EMAs of v_low and m_low (adafactor8bit.cu) and the GEMM
    "tensor": (dict(apollo_scale_type="tensor"), ALL),
    "no_fira": (dict(enable_fira_for_apollo=False), ALL),
    "float32_moments": (dict(quantize=False), ALL),  # their EMAs inside ap_lowrank
    "cached_proj": (dict(apollo_cache_proj=True), ALL[1:]),  # P kept: not drawn
    "left": (dict(), ALL),  # on the 1024×2048 transpose
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_launches_syncs_and_allocations_of_a_steady_step(name, gpu_device, monkeypatch):
    """Issue #19's workload: ``Adafactor8Bit(lr=1e-2, beta1=0.9, apollo_rank=256)`` on one 2048×1024 float32 matrix:
    at most 16 launches (fused kernels + other CuPy operations) per steady-state step, no host synchronisation, no
    allocation.  The stand-in counts a ``reshape`` and an ``ascontiguousarray`` of a contiguous array as operations
    (no launch on CuPy)."""
    if gpu_device != "emulated":
        pytest.skip("counts on the emulator's stand-in")

    def count(self, k, dims, args):  # count, do not run (the numbers are checked by the tests above)
        emu.stats.launches += 1
        emu.stats.by_kernel[self.expr] = emu.stats.by_kernel.get(self.expr, 0) + 1

    monkeypatch.setattr(emu.Kernel, "_launch", count)
    kw, want = COUNTS[name]
    cp = backend.cupy()
    shape = (1024, 2048) if name == "left" else (2048, 1024)
    p = cp.asarray(rng_arrays(0, shape))
    g = cp.asarray(rng_arrays(1, shape))
    opt = flatopt.Adafactor8Bit(lr=1e-2, beta1=0.9, apollo_rank=256, **kw)
    for _ in range(2):
        opt.step_batch([OptItem("w", shape, p, g)])
    st = fakecupy.stats
    st.reset()
    ops0, kernels0 = st.ops, dict(emu.stats.by_kernel)
    with fakecupy.forbid_sync():
        opt.step_batch([OptItem("w", shape, p, g)])
    ran = {k: v - kernels0.get(k, 0) for k, v in emu.stats.by_kernel.items() if v != kernels0.get(k, 0)}
    assert {k.split("<")[0]: v for k, v in ran.items() if k.startswith("ap_")} == dict.fromkeys(want, 1)
    assert st.launches + st.ops - ops0 <= 16 and st.syncs == 0 and st.allocs == 0

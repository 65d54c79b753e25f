"""Adafactor8Bit: an independent float64 reference, conformance with adafactor8bit 0.4.6 (its pure-PyTorch CPU
path), state layout (codes in the state dict, bit-exact resume), per-group options, memory, GPU parity."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import flatopt
from flatopt.adafactor8bit import state as _a8_state
from flatopt.core import backend
from flatopt.adafactor8bit import Adafactor8BitConfig, hybrid_groups
from flatopt.routing import Select

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

R, C = 64, 48
SMALL = dict(min_8bit_size=0, block_size=128, m_block_size=32)  # quantize the small check problem, same layout
APOLLO = dict(beta1=0.9, beta2=0.999, relative_step=False, scale_parameter=False, scale_weight_decay=False,
              d=0.0, eps=(1e-6, 1e-3), lr=1e-3)  # the original's apollo preset (reference APOLLO)
ADAM = dict(factored=False, beta1=0.9, beta2=0.999, relative_step=False, scale_parameter=False,
            scale_weight_decay=False, d=0.0, lr=1e-3)
CAME = dict(beta1=0.9, beta2=0.999, beta3=0.9999, relative_step=False, scale_parameter=False, d=1.0, lr=1e-3,
            scale_weight_decay=False, weight_decay=0.01)

CONFIGS = {  # every path of the original, quantize=False (float32 states)
    "factored_default": {},
    "factored_beta1_wd_fira": dict(beta1=0.9, weight_decay=0.01, enable_fira_for_adafactor=True),
    "unfactored_adafactor": dict(factored=False),
    "unfactored_beta1_fixed_beta2": dict(factored=False, beta1=0.9, beta2=0.99, momentum_only_1d=False),
    "adam_style": ADAM,
    "rmsprop_style": dict(ADAM, beta1=None, beta2=0.99),
    "sgd_momentum": dict(beta1=0.9, beta2=None, beta2_decay=None, relative_step=False, scale_parameter=False, d=0.0),
    "came": CAME,
    "apollo_channel_defaults": dict(apollo_rank=4),
    "apollo_preset_gap3": dict(APOLLO, apollo_rank=4, apollo_update_proj_gap=3, weight_decay=0.01),
    "apollo_mini_tensor": dict(APOLLO, apollo_rank=1, apollo_scale_type="tensor", apollo_scale=2.0),
    "apollo_factorize": dict(APOLLO, apollo_rank=4, apollo_factorize=True, d=1.0),
    "apollo_came": dict(APOLLO, apollo_rank=4, beta3=0.999),
    "apollo_came_factorize": dict(APOLLO, apollo_rank=4, beta3=0.999, apollo_factorize=True),
    "apollo_came_factorize_clip": dict(APOLLO, apollo_rank=4, beta3=0.999, apollo_factorize=True, d=1.0),
}


# ------------------------------------------------------------------------------- the check problem
def _problem():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    w0, b0 = torch.randn(R, C) * 0.05, torch.randn(C) * 0.01
    x, y = torch.randn(16, R), torch.randn(16, C)
    return torch, w0, b0, x, y


def _torch_proj(seed, shape):
    import torch

    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(seed))).numpy()


def run_both(cfg, steps=10):
    """The original (use_cuda_kernel=False) and flatopt on the same gradients (the original's), W and b."""
    oracle = pytest.importorskip("adafactor8bit")
    from adafactor8bit.optimizer import next_seed

    torch, w0, b0, x, y = _problem()
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref = oracle.Adafactor8Bit([w, b], use_cuda_kernel=False, **cfg)
    wf, bf = w0.numpy().ravel().copy(), b0.numpy().copy()
    opt = flatopt.Adafactor8Bit(apollo_proj_fn=_torch_proj, apollo_next_seed=next_seed, **cfg)
    for _ in range(steps):
        ref.zero_grad()
        ((x @ w + b - y) ** 2).mean().backward()
        gw, gb = w.grad.numpy().ravel().copy(), b.grad.numpy().copy()
        ref.step()
        opt.step("W", (R, C), wf, gw)
        opt.step("b", (C,), bf, gb)
    return (w.detach().numpy().ravel(), b.detach().numpy()), (wf, bf), ref, opt, (w, b)


def _rel(a, b):
    return float(np.max(np.abs(a.astype(np.float64) - b)) / np.max(np.abs(a)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_float32_paths_match_the_original(name):
    """quantize=False: float32 arithmetic in the original's order; 10 steps of a few float32 roundings each stay
    far below 1e-5 of the weights (measured ≤ 3e-7)."""
    (wo, bo), (wf, bf), *_ = run_both(dict(CONFIGS[name], quantize=False))
    assert _rel(wo, wf) <= 1e-5 and _rel(bo, bf) <= 1e-5


QUANTIZED = {
    "factored_al8_uf8": dict(beta1=0.9),
    "adam_al8_d8": dict(ADAM, m_quant_type="d8"),
    "adam_al16_uf4": dict(ADAM, m_quant_type="uf4", v_quant_type="al16"),
    "came_al8_uf8": CAME,
    "apollo_al8_uf8": dict(APOLLO, apollo_rank=4),
}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_codes_and_trajectories_match_the_original(name):
    """quantize=True: the stored codes equal the original's (AL8, uf/d formats); AL16 codes may differ by one step
    where the decoded value's last ulp differs (torch.pow(2, ·) versus exp2, ≈ 0.5 % of codes at 65534 levels).
    Because the exact float32 EMA drives every step, equal codes give trajectories equal to float32 rounding; one
    AL16 code step changes the stored v by 2^(scale/65534) − 1 ≲ 1e-3 relative, damped by (1 − b) into the next step
    only: tolerance 1e-5 of the weights, as for float32."""
    cfg = dict(QUANTIZED[name], quantize=True, **SMALL)
    (wo, bo), (wf, bf), ref, opt, (w, b) = run_both(cfg)
    sd = opt.state_dict()
    assert _rel(wo, wf) <= 1e-5
    if "variance_q/b" in sd.buffers or "variance_q" not in ref.state[b]:
        assert _rel(bo, bf) <= 1e-5
    else:  # flatopt keeps this 48-vector's AL16 state in float32 (smaller): the original's requantization error,
        # at most 2^(scale/(2·65534)) − 1 ≤ 2.3e-4 relative in v for ≤ 30 octaves, i.e. ≤ 1.2e-4 in the step
        # direction, over 10 steps of size ≤ lr: |Δb| ≤ 10·lr·1.2e-4
        assert np.max(np.abs(bo - bf)) <= 10 * cfg["lr"] * 1.2e-4
    compared = 0
    for pname, tensor in (("W", w), ("b", b)):
        for key, val in ref.state[tensor].items():
            if not (key.endswith("_q") and hasattr(val, "numpy")) or f"{key}/{pname}" not in sd.buffers:
                continue
            theirs = val.numpy().ravel()
            theirs = theirs.view(np.uint16) if theirs.dtype == np.int16 else theirs
            mine = sd.buffers[f"{key}/{pname}"]
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, key
            diff = np.abs(mine.astype(np.int64) - theirs.astype(np.int64))
            if mine.dtype == np.uint16:
                assert diff.max() <= 1 and np.mean(diff > 0) < 0.02, key
            else:
                assert_bits_equal(mine, theirs, f"{key}/{pname}")
            compared += 1
    assert compared >= 2


def test_check_values_of_the_reference():
    """The reference's published check values (5 steps, reference §12)."""
    (wo, bo), (wf, bf), *_ = run_both(dict(quantize=False), steps=5)
    np.testing.assert_allclose(wf[:3], [-0.0550861, -0.0601039, -0.0148561], rtol=2e-6)
    np.testing.assert_allclose(bf[:3], [-0.0216996, -0.000262014, -0.00249407], rtol=2e-5)


# ------------------------------------------------------------------------- independent float64 reference
def test_default_factored_path_against_float64_reference():
    """Paper/HF Adafactor rule (reference §4.1–4.2) written independently in float64: 5 steps of a (6, 5, 7) tensor."""
    shape = (6, 5, 7)
    p = rng_arrays(0, shape, scale=0.1)
    p64 = p.astype(np.float64).reshape(shape)
    rv, cv = np.zeros((6, 5, 1)), np.zeros((6, 1, 7))
    opt = flatopt.Adafactor8Bit(weight_decay=0.1)  # defaults: relative step, parameter scaling, d = 1
    for t in range(1, 6):
        g = rng_arrays(t, shape)
        opt.step("w", shape, p, g)
        g64 = g.astype(np.float64).reshape(shape)
        b = t**-0.8
        rho = min(1e-2, 1 / math.sqrt(t))
        alpha = rho * max(math.sqrt(np.mean(p64**2)), 1e-3)
        rv = (1 - b) * rv + b * (np.mean(g64**2, axis=-1, keepdims=True) + 1e-30)
        cv = (1 - b) * cv + b * (np.mean(g64**2, axis=-2, keepdims=True) + 1e-30)
        u = g64 / np.sqrt(rv / np.mean(rv, axis=-2, keepdims=True) * cv)
        p64 = p64 * (1 - alpha * 0.1) - alpha / max(1.0, math.sqrt(np.mean(u**2))) * u
    np.testing.assert_allclose(p, p64.ravel(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fira", [False, True])
def test_lag_norm_against_float64_reference(fira):
    """``lag_norm``: step t clips with step t − 1's RMS(U) (no clip at t = 1) and, with Fira, uses step t − 1's
    limiter factor; written independently in float64 (factored, relative step, parameter scaling, decay)."""
    shape = (6, 5, 7)
    p = rng_arrays(0, shape, scale=0.1)
    p64 = p.astype(np.float64).reshape(shape)
    rv, cv = np.zeros((6, 5, 1)), np.zeros((6, 1, 7))
    opt = flatopt.Adafactor8Bit(weight_decay=0.1, lag_norm=True, enable_fira_for_adafactor=fira, d=0.5)
    prev_norm, prev_fira, fira_prev = 0.0, 1.0, None
    for t in range(1, 7):
        g = rng_arrays(t, shape) * (3.0 if t % 2 else 0.2)  # norms that jump: the limiter and clip both act
        opt.step("w", shape, p, g)
        g64 = g.astype(np.float64).reshape(shape)
        b = t**-0.8
        alpha = min(1e-2, 1 / math.sqrt(t)) * max(math.sqrt(np.mean(p64**2)), 1e-3)
        rv = (1 - b) * rv + b * (np.mean(g64**2, axis=-1, keepdims=True) + 1e-30)
        cv = (1 - b) * cv + b * (np.mean(g64**2, axis=-2, keepdims=True) + 1e-30)
        u = g64 / np.sqrt(rv / np.mean(rv, axis=-2, keepdims=True) * cv)
        norm = math.sqrt(np.sum(u**2))
        f = 1.0
        if fira:
            f = prev_fira
            if fira_prev is None:  # Fira: the first norm is taken as is; then growth ≤ 1.01 per step
                new_f, fira_prev = 1.0, norm
            else:
                new_f = 1.0 / (max(norm / (fira_prev + 1e-8), 1.01) / 1.01)
                fira_prev = norm * new_f
            prev_fira = new_f
        clip = max(1.0, prev_norm / math.sqrt(u.size) / 0.5)
        prev_norm = norm
        p64 = p64 * (1 - alpha * 0.1) - alpha * f / clip * u
    np.testing.assert_allclose(p, p64.ravel(), rtol=1e-6, atol=1e-7)  # measured ≤ 5.4e-8: six steps of float32 rounding
    sd = opt.state_dict()
    assert "prev_update_norm/w" in sd.buffers and ("lag_fira_scale/w" in sd.buffers) == fira


PATHS = {  # every blocked path, quantized (block sizes that do not divide the rows, uf4 packing) and not
    "factored": dict(),
    "factored_m_fira_max": dict(beta1=0.9, enable_fira_for_adafactor=True, maximize=True, weight_decay=0.01),
    "came": dict(CAME, m_quant_type="uf4", v_quant_type="al16"),
    "adam": dict(ADAM, m_quant_type="d8"),
    "momentum_only": dict(factored=False, beta1=0.9, d=1.0, enable_fira_for_adafactor=True),
    "sgd": dict(beta1=0.9, beta2=None, beta2_decay=None, relative_step=False, d=1.0, lr=0.01),
    "lag": dict(beta1=0.9, lag_norm=True),
    # APOLLO: its full-size passes over row ranges (channel norms of G folded by range on the "left" layout)
    "apollo_left": dict(APOLLO, apollo_rank=4, weight_decay=0.01, d=1.0),
    "apollo_right_tensor": dict(APOLLO, apollo_rank=4, apollo_scale_type="tensor", weight_decay=0.01),
    "apollo_right_channel": dict(APOLLO, apollo_rank=4, weight_decay=0.01),  # row norms measured by the ranges
    "apollo_right_channel_r5": dict(APOLLO, apollo_rank=5),  # ranges that cut rows: norms measured after them
    "apollo_factorize_right": dict(APOLLO, apollo_rank=4, apollo_factorize=True, weight_decay=0.01),
    "apollo_factorize_left": dict(APOLLO, apollo_rank=4, apollo_factorize=True, beta1=None),
    "apollo_factorize_came": dict(APOLLO, apollo_rank=4, apollo_factorize=True, beta3=0.999, d=1.0),
}
SHAPES = {"apollo_right_tensor": (941, 157), "apollo_factorize_right": (941, 157), "apollo_right_channel": (941, 157),
          "apollo_right_channel_r5": (941, 157), "apollo_factorize_came": (941, 157)}  # R ≥ C; the others (3, 301, 157) (APOLLO views it as 3 × 47 257)


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("name", sorted(PATHS))
def test_blocked_paths_bits_do_not_depend_on_threads(name, quantize, monkeypatch):
    """A parameter above ``SPLIT_MIN`` steps with its ranges/blocks on all threads; one below steps whole on one
    thread; the serial driver runs the same phases inline.  All three give the same bits (every reduction is per
    block and folded in block order), also with a block size that does not divide the rows."""
    from flatopt.adafactor8bit import common, apollo, apollo_lowrank, apollo_proj
    from flatopt.core import blocks as _blocks, parallel
    from flatopt import adafactor8bit as a8

    shape = SHAPES.get(name, (3, 301, 157))  # 141 771 (147 737) elements: above SPLIT_MIN
    assert math.prod(shape) >= a8.SPLIT_MIN
    monkeypatch.setattr(parallel, "PARALLEL_MIN_COST", 0)  # threads even for this size,
    monkeypatch.setattr(_blocks, "BLOCK", 1 << 14)  # several blocks
    monkeypatch.setattr(_blocks, "TASK", 1 << 15)  # and several tasks per factored pass
    monkeypatch.setattr(apollo_proj, "PROJ_BLOCK", 100)  # APOLLO: P drawn in several blocks,
    monkeypatch.setattr(apollo, "GEMM_TASK", 1 << 14)  # the projection GEMM in several ranges,
    monkeypatch.setattr(apollo_lowrank, "TASK", 1 << 10)  # its row and low-rank (factorized) passes in ranges,
    monkeypatch.setattr(common, "TASK", 1 << 10)  # the plain ones too
    seen, run_jobs = [], parallel.run_jobs

    def spy(jobs, pool):  # the phases were handed to more than one thread (which thread claims what may vary)
        seen.append(len(jobs))
        return run_jobs(jobs, pool)

    monkeypatch.setattr(parallel, "run_jobs", spy)
    cfg = dict(PATHS[name], quantize=quantize, block_size=384, m_block_size=96)
    outs = []
    for i, (threads, split_min) in enumerate((("2", a8.SPLIT_MIN), ("1", a8.SPLIT_MIN), ("2", 1 << 30))):
        monkeypatch.setenv("FLATOPT_NUM_THREADS", threads)
        monkeypatch.setattr(a8, "SPLIT_MIN", split_min)
        seen.clear()
        p = rng_arrays(0, shape, scale=0.1)
        opt = flatopt.Adafactor8Bit(**cfg)
        for t in range(3):
            opt.step("w", shape, p, rng_arrays(1 + t, shape))
        outs.append((p, opt.state_dict()))
        if i == 0:
            assert seen and max(seen) == 2, "the split step did not run on two threads"
    for p, sd in outs[1:]:
        assert_bits_equal(p, outs[0][0], name)
        assert_states_equal(sd, outs[0][1])


@pytest.mark.parametrize("name", ["adafactor", "factored", "factored_m_fira_max", "came", "came_fira"])
def test_tiled_column_scaling_gives_the_same_bits(name, monkeypatch):
    """Row blocks of a matrix with short rows multiply by the column factor tiled k times (``adafactor.factored_passes.TILE``,
    in U's apply, CAME's write and the ΣU² pass): the bits equal the row-by-row multiply, also where k does not
    divide a block's rows (a remainder of rows) and for a batch of matrices."""
    from flatopt.core import blocks as _blocks
    from flatopt.adafactor import factored_passes

    monkeypatch.setattr(_blocks, "BLOCK", 1 << 14)  # row blocks of 104 rows of 157: k = 53, 51 rows left over
    shape = (3, 301, 157)
    c = shape[-1]
    k = -(-factored_passes.TILE // c)
    assert shape[1] * c > _blocks.BLOCK and 1 < k <= _blocks.BLOCK // c and (_blocks.BLOCK // c) % k
    make = {"adafactor": lambda: flatopt.Adafactor(beta1=0.9, weight_decay=0.01),
            "came_fira": lambda: flatopt.Adafactor8Bit(**CAME, enable_fira_for_adafactor=True)}.get(
        name, lambda: flatopt.Adafactor8Bit(**({"came": CAME}.get(name) or PATHS[name])))
    outs = []
    for tile in (factored_passes.TILE, 1):  # tiled, then row by row
        monkeypatch.setattr(factored_passes, "TILE", tile)
        p, opt = rng_arrays(0, shape, scale=0.1), make()
        for t in range(3):
            opt.step("w", shape, p, rng_arrays(1 + t, shape))
        outs.append(p)
    assert_bits_equal(outs[0], outs[1], name)


@pytest.mark.parametrize("m_quant_type", ["uf8", "uf4", "fp32"])
def test_came_one_pass_residual_equals_the_written_u(m_quant_type, monkeypatch):
    """CAME on NumPy makes U, its m update, U − m and the statistics of (U − m)² block by block in one pass when
    the blocks start at whole codec blocks of m; the bits equal the path that writes U whole first (blocks that do
    not start there), on two threads."""
    from flatopt.core import blocks as _blocks, parallel
    from flatopt.adafactor import factored_passes
    from flatopt import adafactor8bit as a8

    monkeypatch.setattr(_blocks, "BLOCK", 1 << 14)
    monkeypatch.setattr(_blocks, "TASK", 1 << 15)
    monkeypatch.setattr(parallel, "PARALLEL_MIN_COST", 0)
    monkeypatch.setattr(a8, "SPLIT_MIN", 1)
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "2")
    shape = (602, 157)  # blocks of 96 rows (whole codec blocks of m: 96·157 elements)
    cfg = dict(CAME, m_quant_type=m_quant_type, m_block_size=96, block_size=384, maximize=True)
    outs, used = [], []
    real = factored_passes.FactoredPasses.u_source
    monkeypatch.setattr(factored_passes.FactoredPasses, "u_source", lambda *a: used.append(1) or real(*a))
    for fused in (True, False):
        if not fused:  # every layout reads as unaligned: U written whole, then its ranges
            monkeypatch.setattr(factored_passes, "aligned", lambda bl, align: False)
        used.clear()
        p, opt = rng_arrays(0, shape, scale=0.1), flatopt.Adafactor8Bit(**cfg)
        for t in range(3):
            opt.step("w", shape, p, rng_arrays(1 + t, shape))
        outs.append((p, opt.state_dict()))
        assert len(used) == (3 if fused else 0)
    assert_bits_equal(outs[0][0], outs[1][0], m_quant_type)
    assert_states_equal(outs[0][1], outs[1][1])


def test_options_of_the_original_that_do_not_apply_are_accepted():
    """``stochastic_round_writeback`` (BF16/FP16 parameters in the original: a float32 parameter's write-back is
    exact) and ``warmup_multiplier`` (a CUDA-allocator priming trick) are accepted, validated, and change nothing on
    float32 parameters."""
    shape = (40, 30)
    outs = []
    for kw in ({}, dict(stochastic_round_writeback=True, warmup_multiplier=3)):
        p = rng_arrays(0, shape, scale=0.1)
        opt = flatopt.Adafactor8Bit(beta1=0.9, **kw)
        for t in range(3):
            opt.step("w", shape, p, rng_arrays(1 + t, shape))
        outs.append(p)
    assert_bits_equal(outs[1], outs[0], "options without effect")
    with pytest.raises(ValueError, match="warmup_multiplier"):
        flatopt.Adafactor8Bit(warmup_multiplier=-1)
    with pytest.raises(TypeError, match="stochastic_round_writeback"):
        flatopt.Adafactor8Bit(stochastic_round_writeback=1)



def test_stochastic_round_writeback_is_the_stochastic_policy():
    """On 16-bit parameters ``stochastic_round_writeback=True`` is ``precision=Precision(writeback="stochastic")``
    (the same bits and snapshot); it is optimizer-wide, and contradicting an explicit policy is an error."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    shape = (40, 30)
    outs = []
    for kw in (dict(stochastic_round_writeback=True), dict(precision=flatopt.Precision("stochastic")),
               dict(stochastic_round_writeback=True, precision=flatopt.Precision("stochastic")), {}):
        p = rng_arrays(0, shape, scale=0.1).astype(ml_dtypes.bfloat16)
        opt = flatopt.Adafactor8Bit(beta1=0.9, **kw)
        assert opt.precision.writeback == ("stochastic" if kw else "nearest")
        for t in range(3):
            opt.step("w", shape, p, rng_arrays(1 + t, shape).astype(ml_dtypes.bfloat16))
        outs.append((p, opt.state_dict()))
    for p, st in outs[1:3]:
        assert_bits_equal(p, outs[0][0], "alias vs policy")
        ref = outs[0][1]  # (the configuration records the option as given)
        assert_states_equal(dataclasses.replace(st, config=ref.config, config_key=ref.config_key), ref)
    assert outs[3][0].tobytes() != outs[0][0].tobytes()  # round to nearest differs
    with pytest.raises(ValueError, match="stochastic_round_writeback.*contradicts.*kahan"):
        flatopt.Adafactor8Bit(stochastic_round_writeback=True, precision=flatopt.Precision("kahan"))
    with pytest.raises(ValueError, match=r"groups\[0\]: stochastic_round_writeback"):
        flatopt.Adafactor8Bit(groups=[("b*", dict(stochastic_round_writeback=True))])


# --------------------------------------------------------------------------- state layout and resume
def test_state_dict_holds_codes_and_resumes_bit_exactly():
    cfgs = dict(beta1=0.9, apollo_rank=3, block_size=128, m_block_size=32, min_8bit_size=0,
                groups=[(Select(patterns=["conv*"]), dict(apollo_rank=0, m_quant_type="uf4", v_quant_type="al16"))])
    shapes = {"lin": (40, 30), "conv": (8, 4, 3, 3), "bias": (300,)}
    params = {n: rng_arrays(i, s, scale=0.1) for i, (n, s) in enumerate(shapes.items())}
    grads = [{n: rng_arrays(100 + 10 * k + i, s) for i, (n, s) in enumerate(shapes.items())} for k in range(6)]

    def run(opt, ps, ks):
        for k in ks:
            for n in shapes:
                opt.step(n, shapes[n], ps[n], grads[k][n])

    a = {n: v.copy() for n, v in params.items()}
    opt_a = flatopt.Adafactor8Bit(**cfgs)
    run(opt_a, a, range(6))
    bprm = {n: v.copy() for n, v in params.items()}
    opt_b = flatopt.Adafactor8Bit(**cfgs)
    run(opt_b, bprm, range(3))
    sd = opt_b.state_dict()
    dtypes = {k: v.dtype for k, v in sd.buffers.items()}
    assert dtypes["v_low_q/lin"] == np.uint8 and dtypes["m_low_q/lin"] == np.uint8
    assert dtypes["row_var_q/conv"] == np.uint16 and dtypes["m_q/conv"] == np.uint8
    assert "variance_q/bias" in dtypes and "variance/bias" not in dtypes
    assert not any(k.startswith(("v_low/", "m/conv", "row_var/conv")) for k in dtypes), "codes, not floats"
    assert sd.params["lin"]["apollo_seed"] is not None and sd.extra["apollo_seed_counter"] == 2
    opt_c = flatopt.Adafactor8Bit(**cfgs)
    assert opt_c.load_state_dict(sd) is True
    run(opt_c, bprm, range(3, 6))
    for n in shapes:
        assert_bits_equal(a[n], bprm[n], n)
    assert_states_equal(opt_a.state_dict(), opt_c.state_dict())
    other = flatopt.Adafactor8Bit(**dict(cfgs, block_size=256))
    assert other.load_state_dict(sd, migrate=False) is False, "a block-size change must not load silently"
    with pytest.warns(flatopt.adafactor8bit.StateMigrationWarning):  # migrated (tests/test_a8_migrate.py)
        assert other.load_state_dict(sd) is True


# ----------------------------------------------------------------------------------- per-group options
def test_hybrid_recipe_routes_like_the_seed():
    opt = flatopt.Adafactor8Bit(lr=1e-3, relative_step=False, beta2=0.999, weight_decay=1e-2,
                                enable_fira_for_adafactor=True, fira_margin=0.01,
                                groups=hybrid_groups(apollo_rank=8, weight_decay=1e-2))
    cases = {"blk.norm.w": ((64,), False, 0, 0.0), "blk.attn.bias": ((64,), False, 0, 0.0),
             "tok_embed": ((100, 64), False, 8, 0.0), "blk.attn.w": ((64, 64), True, 8, 1e-2),
             "conv.w": ((16, 8, 3, 3), True, 0, 1e-2)}
    for name, (shape, q, rank, wd) in cases.items():
        cfg = opt.config_for(name, shape)
        assert (cfg.quantize, cfg.apollo_rank, cfg.weight_decay) == (q, rank, wd), name
        assert cfg.enable_fira_for_adafactor and cfg.beta2 == 0.999
        p, g = rng_arrays(1, shape, scale=0.1), rng_arrays(2, shape)
        before = p.copy()
        opt.step(name, shape, p, g)
        assert not np.array_equal(p, before) and np.all(np.isfinite(p))
    sd = opt.state_dict()
    assert "v_low/blk.attn.w" in sd.buffers or "v_low_q/blk.attn.w" in sd.buffers
    assert "row_var_q/conv.w" not in sd.buffers  # short factor vectors stay float32 (smaller than a block)
    with pytest.raises(TypeError):
        flatopt.Adafactor8Bit(groups=[("*", dict(no_such_option=1))])
    with pytest.raises(ValueError, match="beta3"):
        flatopt.Adafactor8Bit(groups=[("*", dict(beta3=0.9))])


def test_validation_names_the_option():
    for kw, match in ((dict(block_size=100), "block_size"), (dict(m_quant_type="q8"), "m_quant_type"),
                      (dict(beta2=None, beta2_decay=None), "SGD"), (dict(beta1=1.0), "beta1"),
                      (dict(eps=(1e-30, -1.0)), "eps"), (dict(apollo_scale_type="row"), "apollo_scale_type")):
        with pytest.raises((ValueError, TypeError), match=match):
            flatopt.Adafactor8Bit(**kw)


# ------------------------------------------------------------------------------------------ memory
ORIGINAL_BPP = {  # reference §3, 2048×1024 weight, measured on the original
    "factored_al8": (dict(), 0.0020), "factored_fp32": (dict(quantize=False), 0.0059),
    "factored_uf8": (dict(beta1=0.9), 1.0176), "factored_uf4": (dict(beta1=0.9, m_quant_type="uf4"), 0.5176),
    "came": (dict(beta1=0.9, beta2=0.999, beta3=0.9999), 1.0195),
    "adam_al8_uf8": (dict(factored=False, beta1=0.9, beta2=0.999), 2.0195),
    "adam_al16_uf8": (dict(factored=False, beta1=0.9, beta2=0.999, v_quant_type="al16"), 3.0195),
    "adam_fp32": (dict(factored=False, beta1=0.9, beta2=0.999, quantize=False), 8.0),
    "apollo_r256": (dict(apollo_rank=256, beta1=0.9), 0.505), "apollo_r256_fp32": (dict(apollo_rank=256, beta1=0.9,
                                                                                          quantize=False), 2.0),
    "apollo_mini": (dict(apollo_rank=1, apollo_scale_type="tensor"), 0.001),
    "apollo_r256_factorize": (dict(apollo_rank=256, beta1=0.9, apollo_factorize=True), 0.258),
    "factored_d8": (dict(beta1=0.9, m_quant_type="d8"), 1.0176),  # measured on the original
    "apollo_r256_factorize_came": (dict(apollo_rank=256, beta1=0.9, beta2=0.999, beta3=0.9999,
                                        apollo_factorize=True), 0.2603),  # likewise
}


def state_bytes_per_param(options, shape=(2048, 1024)) -> float:
    st = _a8_state.init(np, Adafactor8BitConfig(**options), shape, np.float32, apollo_seed=1)
    total = sum(getattr(st, f.name).nbytes for f in _a8_state.dataclasses.fields(st)
                if f.metadata.get("persist", True) and isinstance(getattr(st, f.name), np.ndarray))
    return total / math.prod(shape)


@pytest.mark.parametrize("name", sorted(ORIGINAL_BPP))
def test_state_bytes_never_exceed_the_original(name):
    options, original = ORIGINAL_BPP[name]
    assert state_bytes_per_param(options) <= original + 5e-4  # the published figures are rounded to 3–4 digits


# --------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.usefixtures("gpu_or_emulated")  # the GPU, else the emulated device (tests/conftest.py)


@gpu
@pytest.mark.parametrize("name", ["factored_beta1_wd_fira", "adam_style", "came", "apollo_preset_gap3"])
def test_cupy_twin_matches_numpy(name):
    cp = backend.cupy()
    cfg = dict(CONFIGS[name], quantize=True, **SMALL)
    shape = (R, C)
    outs = []
    for xp in (np, cp):
        opt = flatopt.Adafactor8Bit(apollo_proj_fn=_torch_free_proj, **cfg)
        p = xp.asarray(rng_arrays(0, shape, scale=0.05))
        for k in range(5):
            opt.step("w", shape, p, xp.asarray(rng_arrays(10 + k, shape)))
        outs.append(backend.to_numpy(p))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-6)


def _torch_free_proj(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@gpu
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_fused_kernels_match_the_twin(name, monkeypatch):
    """kernels/adafactor8bit.cu against the array-agnostic twin on CuPy: the same float32 operations in the same
    order (--fmad=false; log2 in double, exp2f on both), so codes agree to at most one step and weights closely."""
    cp = backend.cupy()
    cfg = dict(QUANTIZED[name], quantize=True, **SMALL)
    runs = []
    for twin in ("1", "0"):
        monkeypatch.setenv("FLATOPT_FORCE_TWIN", twin)
        opt = flatopt.Adafactor8Bit(apollo_proj_fn=_torch_free_proj, **cfg)
        p = cp.asarray(rng_arrays(0, (R, C), scale=0.05))
        for k in range(5):
            opt.step("w", (R, C), p, cp.asarray(rng_arrays(10 + k, (R, C))))
        runs.append((backend.to_numpy(p), opt.state_dict()))
    (p0, s0), (p1, s1) = runs
    np.testing.assert_allclose(p1, p0, rtol=1e-5, atol=1e-7)
    for key, v in s0.buffers.items():
        a, b = backend.to_numpy(v), backend.to_numpy(s1.buffers[key])
        if a.dtype.kind == "u":
            assert np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))) <= 1, key


@gpu
@pytest.mark.parametrize("name", ["factored_beta1_wd_fira", "adam_style", "came", "apollo_preset_gap3"])
def test_no_host_synchronisation_inside_a_step(name):
    cp = backend.cupy()
    import cupyx

    opt = flatopt.Adafactor8Bit(**dict(CONFIGS[name], quantize=True, **SMALL))
    p = cp.asarray(rng_arrays(0, (R, C), scale=0.05))
    g = cp.asarray(rng_arrays(1, (R, C)))
    opt.step("w", (R, C), p, g)  # first step: state creation
    with cupyx.allow_synchronize(False):
        for _ in range(3):
            opt.step("w", (R, C), p, g)


@pytest.mark.parametrize("shape", [(256, 1024), (1000, 3), (7, 9), (1, 1)])
def test_default_projection_is_seeded_gaussian(shape, monkeypatch):
    """The default NumPy projection (no ``apollo_proj_fn``): P·√r is standard normal — mean, variance, the
    fractions within 1σ and 2σ, a bound (the table's truncation at 4.32 lies inside it) — a function of the seed alone (the same from
    any thread count and in any order of its blocks, another for another seed), and its blocks are not
    correlated with each other.  Odd block lengths (a last, partial pair) included."""
    from flatopt.adafactor8bit import apollo_proj
    from flatopt.core import parallel

    class St:
        proj = None
        current_proj_seed = 12345

    def draw(seed, threads):
        monkeypatch.setenv("FLATOPT_NUM_THREADS", threads)
        st = St()
        st.current_proj_seed = seed
        rank = shape[0]
        pt, jobs = apollo_proj.ApolloProjector().prepare(np, st, rank, 10_000, shape[1], True, cache=True)
        parallel.run_beside_tasks(lambda: None, jobs)
        return np.array(pt.T) * np.float32(math.sqrt(rank))

    monkeypatch.setattr(apollo_proj, "PROJ_BLOCK", 4097)  # odd: several blocks with a half pair at the end
    a = draw(7, "2")
    assert a.shape == shape and a.dtype == np.float32
    assert_bits_equal(a, draw(7, "1"), "thread count")
    assert not np.array_equal(a, draw(8, "2"))
    z = a.ravel().astype(np.float64)
    assert np.all(np.abs(z) <= math.sqrt(2 * math.log(2.0**24)) + 1e-5)
    if z.size >= 100_000:
        se = 1 / math.sqrt(z.size)
        assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se
        for k, frac in ((1, 0.682689), (2, 0.954500)):
            assert abs(np.mean(np.abs(z) < k) - frac) < 5 * math.sqrt(frac * (1 - frac)) * se
        n = 4097 * (z.size // 4097)
        blocks = z[:n].reshape(-1, 4097)
        corr = np.corrcoef(blocks[:8])[np.triu_indices(8, 1)]
        assert np.all(np.abs(corr) < 5 / math.sqrt(4097))
        half = 2048  # the sine half of a block is not the cosine half
        assert abs(np.corrcoef(blocks[:, :half].ravel(), blocks[:, half + 1:2 * half + 1].ravel())[0, 1]) < 5 * se


def _poisoned_run(cfg, shape, rows, poison: bool, bad: float):
    """θ and the state after three APOLLO steps whose gradients hold ``bad`` (or 0) in the rows ``rows(t)``."""
    opt = flatopt.Adafactor8Bit(**cfg)
    p = rng_arrays(0, shape, scale=0.1)
    for t in range(3):
        g = rng_arrays(1 + t, shape)
        g[rows(t)] = bad if poison else 0.0
        with np.errstate(all="ignore"):
            opt.step("w", shape, p, g)
    return p, opt.state_dict()


@pytest.mark.parametrize("scale_type", ["channel", "tensor"])
def test_apollo_reads_nonfinite_gradient_entries_as_zero(scale_type):
    """APOLLO reads NaN/±Inf as 0 (as the original): the step with a poisoned entry is bit for bit the step with a
    0 there — G's norm statistic doubles as the finiteness check, so a poisoned G must take the sanitising path —
    and a gradient whose squares overflow (finite entries) steps as −G does with ``maximize`` (a sanitised copy)."""
    shape = (96, 40)
    cfg = dict(APOLLO, apollo_rank=4, apollo_scale_type=scale_type, d=1.0)
    for bad in (np.nan, np.inf, -np.inf):
        runs = [_poisoned_run(cfg, shape, lambda t: 5 + t, poison, bad)[0] for poison in (True, False)]
        assert_bits_equal(runs[0], runs[1], f"{scale_type} {bad}")
    runs = []
    for sign in (1, -1):
        opt = flatopt.Adafactor8Bit(**cfg, maximize=sign < 0)
        p = rng_arrays(0, shape, scale=0.1)
        g = rng_arrays(1, shape)
        g[3] = 3e30  # finite, its square overflows float32
        with np.errstate(all="ignore"):
            opt.step("w", shape, p, g * np.float32(sign))
        runs.append(p)
    assert_bits_equal(runs[0], runs[1], f"{scale_type} overflow")


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("norm", ["none", "channel", "tensor"])
def test_apollo_poisoned_ranges_step_as_zeros_on_threads(norm, quantize, monkeypatch):
    """A threaded APOLLO step (projection, low-rank and update passes over many ranges) with NaN/±Inf in a few rows
    is bit for bit the step with zeros there, with and without G's norm statistic (Fira/clip), quantized or not."""
    from flatopt.adafactor8bit import common, apollo, apollo_lowrank
    from flatopt.core import parallel
    from flatopt import adafactor8bit as a8

    monkeypatch.setattr(apollo, "GEMM_TASK", 1 << 13)  # projection ranges of 52 rows,
    monkeypatch.setattr(apollo_lowrank, "TASK", 1 << 12)  # G's and θ's passes in ranges of 26 rows,
    monkeypatch.setattr(common, "TASK", 1 << 10)  # the low-rank moments in ranges too
    monkeypatch.setattr(parallel, "PARALLEL_MIN_COST", 0)
    monkeypatch.setattr(a8, "SPLIT_MIN", 1)
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "2")
    shape = (941, 157)
    extra = {"none": dict(enable_fira_for_apollo=False), "channel": {}, "tensor": dict(apollo_scale_type="tensor")}
    cfg = dict(APOLLO, apollo_rank=4, quantize=quantize, block_size=384, m_block_size=96, min_8bit_size=0,
               **extra[norm])
    for bad in (np.nan, np.inf, -np.inf):  # two ranges of many
        runs = [_poisoned_run(cfg, shape, lambda t: [7 + t, 500], poison, bad) for poison in (True, False)]
        assert_bits_equal(runs[0][0], runs[1][0], f"{norm} {bad}")
        assert_states_equal(runs[0][1], runs[1][1])


def test_apollo_proj_fn_of_the_wrong_shape_is_named():
    """An ``apollo_proj_fn`` returning a broadcastable but wrong shape is an error naming the parameter and both
    shapes (copying it into P would broadcast silently)."""
    opt = flatopt.Adafactor8Bit(apollo_rank=2, apollo_proj_fn=lambda seed, shape: np.ones((1, shape[1]), np.float32))
    p, g = rng_arrays(0, (6, 5)), rng_arrays(1, (6, 5))
    with pytest.raises(flatopt.TaskError, match=r"'w': ValueError: apollo_proj_fn returned an array of shape "
                                                r"\(1, 5\), expected \(2, 5\)"):
        opt.step("w", (6, 5), p, g)


def test_apollo_seeds_and_refresh_schedule():
    """Seeds from a counter starting at 1 in first-step order; refresh at steps 1, 1 + gap, ...; the injected
    next_seed advances them (the original's: next_seed(1) = 505211975917066638)."""
    calls = []

    def proj(seed, shape):
        calls.append(seed)
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)

    opt = flatopt.Adafactor8Bit(apollo_rank=2, apollo_update_proj_gap=3, apollo_proj_fn=proj,
                                apollo_next_seed=lambda s: s + 1000)
    p, q = rng_arrays(0, (6, 5)), rng_arrays(1, (4, 7))
    for k in range(7):
        opt.step("b", (4, 7), q, rng_arrays(20 + k, (4, 7)))
        opt.step("a", (6, 5), p, rng_arrays(10 + k, (6, 5)))
    sd = opt.state_dict()
    assert sd.params["b"]["current_proj_seed"] == 1 + 2000 and sd.params["a"]["current_proj_seed"] == 2 + 2000
    assert sd.params["a"]["last_proj_step"] == 7 and sd.params["a"]["apollo_seed"] == 2 + 3000
    assert calls[::2] == [1, 1, 1, 1001, 1001, 1001, 2001] and calls[1::2] == [2, 2, 2, 1002, 1002, 1002, 2002]
    oracle = pytest.importorskip("adafactor8bit.optimizer")
    assert oracle.next_seed(1) == 505211975917066638


def test_restore_hparams_restores_the_step_configuration():
    """``load_state_dict(restore_hparams=True)`` restores the base options and the group overrides (for groups
    with the same selector description), and the loaded parameters step with them: the continued run equals the
    saving optimizer's, bit for bit."""
    groups = lambda wd: [(Select(patterns=["b*"], description="biases"), dict(weight_decay=wd, quantize=False))]  # noqa: E731
    shapes = {"w": (40, 30), "bias": (30,)}
    a = flatopt.Adafactor8Bit(beta1=0.9, weight_decay=0.1, min_8bit_size=0, block_size=128, m_block_size=32,
                              groups=groups(0.05))
    params = {n: rng_arrays(i, s, scale=0.1) for i, (n, s) in enumerate(shapes.items())}
    for t in range(2):
        for n, s in shapes.items():
            a.step(n, s, params[n], rng_arrays(10 + t, s))
    b = flatopt.Adafactor8Bit(beta1=0.5, weight_decay=0.0, min_8bit_size=0, block_size=128, m_block_size=32,
                              groups=groups(0.0))
    assert b.load_state_dict(a.state_dict(), restore_hparams=True)
    assert b.config_for("bias", (30,)).weight_decay == 0.05 and b.config.beta1 == 0.9
    pb = {n: p.copy() for n, p in params.items()}
    for t in range(2, 4):
        for n, s in shapes.items():
            a.step(n, s, params[n], rng_arrays(10 + t, s))
            b.step(n, s, pb[n], rng_arrays(10 + t, s))
    for n in shapes:
        assert_bits_equal(pb[n], params[n], n)

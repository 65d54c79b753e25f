"""ScheduleFreeAdamW: an independent float64 reference written in the paper's (x, z) form (Defazio et al. 2024,
Algorithm 1 with the AdamW normalisation of the ``schedulefree`` package), conformance with the package's
``AdamWScheduleFree``, eval/train (idempotence, the round trip's bound, refusals, checkpoints in eval mode), the
per-parameter host numbers, and the conversions' compiled pass against their NumPy path.

Tolerances, relative to the accumulated update Δθ = θ_STEPS − θ_0 over STEPS = 10 steps with an lr that changes every
step (as tests/test_catalogue_elementwise.py):
* float32 vs the float64 reference or the package: 1e-5.  A step is 13–15 roundings of relative size 2^-24 = 6e-8
  (the moment, the normalisation, the decay, the lerp, the two scaled additions), ~1e-6 of the step; the rounding of
  y itself adds half an ulp of |y| ~ 0.1 per step against steps of ~η = 1e-2, ~6e-7 per step, ~2e-6 over 10 steps as
  a random walk.  1e-5 leaves a margin of 3–5x, far below what a wrong averaging weight or a misplaced decay costs
  (1e-3 and more).  The package's vectorised CPU kernels fuse multiply-adds (lerp, add with alpha): a few ulps more,
  inside the same bound.
* float64 vs the float64 reference: 1e-10 (the same rule, rounded 2^-53 per operation; the (x, z) form rounds
  differently from the y form, ~1e-14 relative per step).
The evaluation point x (after ``eval``) is compared with the same tolerances, relative to x_STEPS − θ_0.
"""

from __future__ import annotations

import math
import types
import warnings

import numpy as np
import pytest

import flatopt
from flatopt import schedulefree as sf
from flatopt.core.elementwise import run

STEPS = 10
SHAPES = [(6, 5), (7,), (70001,)]  # the last spans several NumPy chunks
CONFIGS = {
    "default": dict(),
    "wd_warmup_r": dict(weight_decay=0.05, warmup_steps=4, r=0.5),
    "power0_betas": dict(betas=(0.8, 0.99), weight_lr_power=0.0, eps=1e-6),
}


def lr_of(step: int, base: float = 1e-2) -> float:
    return base * (0.5 + step) / (1 + step)  # changes every step (set_lr), and so does lr_max's history


def data(shape, seed, dtype=np.float32):
    r = np.random.default_rng(seed)
    n = math.prod(shape)
    p = (r.standard_normal(n) * 0.1).astype(dtype)
    return p, [r.standard_normal(n).astype(dtype) for _ in range(STEPS)]


def reference(p0, grads, lrs, *, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
              weight_lr_power=2.0, **_):
    """float64, the paper's form: y_t = (1 − β1)·z_t + β1·x_t is where the gradient is taken; z_{t+1} = z_t − γ_t·u;
    x_{t+1} = (1 − c_{t+1})·x_t + c_{t+1}·z_{t+1}, c = weight / Σ weights, weight = t^r · max_{s≤t}(γ_s)^power.
    Returns (y, x) after the steps."""
    b1, b2 = betas
    x = np.asarray(p0, np.float64).copy()
    z = x.copy()
    v = np.zeros_like(x)
    lr_max, weights = 0.0, []
    for k, (g, lr) in enumerate(zip(grads, lrs)):
        t = k + 1
        gamma = lr * (t / warmup_steps if t <= warmup_steps else 1.0)
        lr_max = max(lr_max, gamma)
        weights.append(t**r * lr_max**weight_lr_power)
        c = weights[-1] / sum(weights) if sum(weights) else 0.0
        y = (1 - b1) * z + b1 * x
        g = np.asarray(g, np.float64)
        v = b2 * v + (1 - b2) * g * g
        u = g / (np.sqrt(v / (1 - b2**t)) + eps) + weight_decay * y
        z = z - gamma * u
        x = (1 - c) * x + c * z
    return (1 - b1) * z + b1 * x, x


def run_flatopt(opt, shape, p, grads):
    p = p.copy()
    for i, g in enumerate(grads):
        opt.set_lr(lr_of(i))
        opt.step("w", shape, p, g)
        opt.end_iteration()
    y = p.copy()
    opt.eval({"w": p})
    return y, p


def rel(p0, got, ref) -> float:
    p0 = np.asarray(p0, np.float64)
    d_ref = np.asarray(ref, np.float64) - p0
    return float(np.linalg.norm(np.asarray(got, np.float64) - p0 - d_ref) / np.linalg.norm(d_ref))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-10)], ids=["f32", "f64"])
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_the_float64_reference(shape, cfg, dtype, tol):
    p0, grads = data(shape, 1, dtype)
    y, x = run_flatopt(flatopt.ScheduleFreeAdamW(lr=lr_of(0), **CONFIGS[cfg]), shape, p0, grads)
    ry, rx = reference(p0, grads, [lr_of(i) for i in range(STEPS)], **CONFIGS[cfg])
    assert rel(p0, y, ry) < tol
    assert rel(p0, x, rx) < tol


def run_package(shape, p0, grads, lr_base, cfg):
    """The ``schedulefree`` package's ``AdamWScheduleFree`` (in train mode) on the same steps: (y, x) as float32."""
    torch = pytest.importorskip("torch")
    sfp = pytest.importorskip("schedulefree")
    w = torch.nn.Parameter(torch.from_numpy(p0.copy()).reshape(shape))
    ref = sfp.AdamWScheduleFree([w], lr=lr_of(0, lr_base), **cfg)
    ref.train()
    for i, g in enumerate(grads):
        ref.param_groups[0]["lr"] = lr_of(i, lr_base)
        w.grad = torch.from_numpy(g.copy()).reshape(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref.step()
    ry = w.detach().numpy().reshape(-1).copy()
    ref.eval()
    return ry, w.detach().numpy().reshape(-1).copy()


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_matches_the_schedulefree_package(shape, cfg):
    p0, grads = data(shape, 2)
    y, x = run_flatopt(flatopt.ScheduleFreeAdamW(lr=lr_of(0), **CONFIGS[cfg]), shape, p0, grads)
    ry, rx = run_package(shape, p0, grads, 1e-2, CONFIGS[cfg])
    assert rel(p0, y, ry) < 1e-5
    assert rel(p0, x, rx) < 1e-5


# ------------------------------------------------------------------------------------------------ eval / train
def _trained(n=1000, steps=5, dtype=np.float32, **kw):
    opt = flatopt.ScheduleFreeAdamW(lr=1e-2, **kw)
    p, grads = data((n,), 3, dtype)
    q = (p[::-1] * 2).copy()
    for g in grads[:steps]:
        opt.step_batch([flatopt.OptItem("w", (n,), p, g), flatopt.OptItem("b", (n,), q, g[::-1].copy())])
    return opt, {"w": p, "b": q}, grads


def _bits(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_eval_and_train_are_idempotent_and_the_round_trip_is_within_its_bound(dtype):
    opt, params, _ = _trained(dtype=dtype)
    y = {k: v.copy() for k, v in params.items()}
    opt.eval(params)
    x = {k: v.copy() for k, v in params.items()}
    assert opt.mode == "eval" and all(_bits(x[k]) != _bits(y[k]) for k in y)
    opt.eval(params)  # idempotent: nothing changes
    assert all(_bits(params[k]) == _bits(x[k]) for k in x)
    opt.train(params)
    opt.train(params)
    assert opt.mode == "train"
    # not bit for bit (two rounded lerps): the bound of the module docstring, per element, from the dtype's weights
    u = np.longdouble(np.finfo(dtype).eps) / 2
    w1 = np.longdouble(dtype(1 - 1 / 0.9))
    w2 = np.longdouble(dtype(1 - 0.9))
    for k in y:
        # (in extended precision: the bound itself must not round like the dtype)
        z = opt._slots[k].state.z.astype(np.longdouble)  # noqa: SLF001 - the state the conversions read
        yy, xx, y2 = (a.astype(np.longdouble) for a in (y[k], x[k], params[k]))
        bound = (abs(1 - (1 - w1) * (1 - w2)) * abs(z - yy) + (1 - w2) * (u * abs(xx) + (2 * u + u * u) * abs(w1)
                 * abs(z - yy)) + u * abs(y2) + (2 * u + u * u) * abs(w2) * abs(z - xx))
        assert np.all(abs(y2 - yy) <= bound), float(np.max(abs(y2 - yy) - bound))
        assert np.any(y2 != yy) or dtype is np.float64  # (the bound is what holds, not equality)


def test_step_in_eval_mode_raises_and_changes_nothing():
    opt, params, grads = _trained()
    opt.eval(params)
    before = opt.state_dict()
    x = {k: v.copy() for k, v in params.items()}
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step("w", (1000,), params["w"], grads[0])
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step_batch([flatopt.OptItem("new", (3,), np.zeros(3, np.float32), np.ones(3, np.float32))])
    with pytest.raises(RuntimeError, match="eval mode"):  # a router validates every group before any steps
        opt.validate_batch([flatopt.OptItem("w", (1000,), params["w"], grads[0])])
    after = opt.state_dict()
    assert "new" not in after.params and after.params == before.params
    assert all(_bits(after.buffers[k]) == _bits(before.buffers[k]) for k in before.buffers)
    assert all(_bits(params[k]) == _bits(x[k]) for k in x)


@pytest.mark.parametrize("bad, match", [
    (lambda p: {**p, "nope": np.zeros(3, np.float32)}, "'nope': no state"),
    (lambda p: {"w": p["w"]}, "'b' has state but no buffer"),
    (lambda p: {**p, "b": p["b"].astype(np.float64)}, "'b': buffer dtype"),
    (lambda p: {**p, "b": p["b"][:-1].copy()}, "'b': the buffer must be flat"),
    (lambda p: {**p, "b": p["b"].reshape(10, 100)}, "'b'"),
    (lambda p: list(p.values()), "mapping"),
])
def test_eval_refuses_bad_input_before_writing_any_buffer(bad, match):
    opt, params, _ = _trained()
    arg = bad(params)
    keep = {k: v.copy() for k, v in params.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        opt.eval(arg)
    assert opt.mode == "train" and all(_bits(params[k]) == _bits(keep[k]) for k in keep)


def test_a_read_only_buffer_is_refused_before_any_is_written():
    opt, params, _ = _trained()
    params["b"].flags.writeable = False
    keep = params["w"].copy()
    with pytest.raises(ValueError, match="'b'"):
        opt.eval(params)
    assert _bits(params["w"]) == _bits(keep) and opt.mode == "train"


def test_checkpoint_in_eval_mode_resumes_bit_for_bit(tmp_path):
    """Run 4 steps, eval, save (file: the host numbers through JSON); a fresh optimizer loads it (mode eval), both
    train() and run 4 more steps: the same bits as the run that never stopped."""
    opt, params, grads = _trained(steps=4, weight_decay=0.01, warmup_steps=3, r=0.5)
    opt.eval(params)
    flatopt.save(tmp_path / "ck.npz", opt)
    saved = {k: v.copy() for k, v in params.items()}
    fresh = flatopt.ScheduleFreeAdamW(lr=1e-2, weight_decay=0.01, warmup_steps=3, r=0.5)
    assert fresh.load_state_dict(flatopt.load(tmp_path / "ck.npz"), strict=True)
    assert fresh.mode == "eval"
    for o, ps in ((opt, params), (fresh, saved)):
        o.train(ps)
        for g in grads[4:8]:
            o.step_batch([flatopt.OptItem("w", (1000,), ps["w"], g), flatopt.OptItem("b", (1000,), ps["b"], g)])
    assert all(_bits(params[k]) == _bits(saved[k]) for k in params)
    a, b = opt.state_dict(), fresh.state_dict()
    assert a.params == b.params and a.extra == b.extra
    assert all(_bits(a.buffers[k]) == _bits(b.buffers[k]) for k in a.buffers)


def test_a_snapshot_with_a_bad_mode_is_refused():
    opt, _, _ = _trained()
    st = opt.state_dict()
    st.extra["mode"] = "sleep"
    fresh = flatopt.ScheduleFreeAdamW(lr=1e-2)
    assert not fresh.load_state_dict(st)
    assert "mode" in fresh.last_load_notes[0] and fresh.mode == "train"


def test_the_averaging_weight_comes_from_the_base_lr_not_lr_scale():
    """Two parameters stepped together with different lr_scale keep the same host numbers (so they share c and a
    multi-tensor launch); the scaled one follows the reference at lr · scale (c is invariant under a constant
    scale of the lr, up to its rounding)."""
    n = 300
    p, grads = data((n,), 4, np.float64)
    q = p.copy()
    opt = flatopt.ScheduleFreeAdamW(lr=lr_of(0), warmup_steps=3, lr_scale={"b": 0.25})
    for i, g in enumerate(grads):
        opt.set_lr(lr_of(i))
        opt.step_batch([flatopt.OptItem("a", (n,), p, g), flatopt.OptItem("b", (n,), q, g)])
    st = opt.state_dict().params
    assert st["a"]["lr_max"] == st["b"]["lr_max"] and st["a"]["weight_sum"] == st["b"]["weight_sum"]
    ry, _ = reference(data((n,), 4, np.float64)[0], grads, [0.25 * lr_of(i) for i in range(STEPS)], warmup_steps=3)
    assert rel(data((n,), 4, np.float64)[0], q, ry) < 1e-10


def test_the_weight_is_zero_when_no_weight_was_summed():
    """lr 0 from the start: every weight is 0^2 = 0, the reference's ZeroDivisionError gives c = 0 (y stays)."""
    p, grads = data((50,), 5)
    opt = flatopt.ScheduleFreeAdamW(lr=0.0)
    q = p.copy()
    for g in grads[:3]:
        opt.step("w", (50,), q, g)
    assert _bits(q) == _bits(p)
    assert opt.state_dict().params["w"]["weight_sum"] == 0.0


@pytest.mark.parametrize("bad", [dict(betas=(0.0, 0.9)), dict(betas=(1.0, 0.9)), dict(warmup_steps=-1),
                                 dict(warmup_steps=1.5), dict(r=-1.0), dict(weight_lr_power=float("nan")),
                                 dict(eps=-1.0), dict(weight_decay=-0.1)])
def test_bad_hyper_parameters_are_refused_by_name(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        flatopt.ScheduleFreeAdamW(**bad)


# ------------------------------------------------------------------------------------ the conversions' C pass
@pytest.mark.parametrize("beta1", [0.9, 0.5], ids=["small_weight", "big_weight"])  # 1 - 1/0.5 = -1: the other branch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_the_conversions_compiled_pass_equals_their_numpy_path(mode, dtype, beta1):
    update_fn = sf.CONVERT[mode][0]
    d = {"eval": sf.DEF_X, "train": sf.DEF_Y}[mode]
    cfg = sf.ScheduleFreeAdamWConfig(betas=(beta1, 0.999))
    r = np.random.default_rng(6)
    n = 1037
    p = r.standard_normal(n).astype(dtype)
    z = r.standard_normal(n).astype(dtype)
    p[:6] = [np.nan, np.inf, -np.inf, -0.0, 1e-42 if dtype is np.float32 else 1e-310, 0.0]
    z[6:12] = [np.nan, np.inf, -np.inf, -0.0, 1e-42 if dtype is np.float32 else 1e-310, 0.0]
    a, b = p.copy(), p.copy()
    with np.errstate(all="ignore"):
        assert run.native_update(d, cfg, types.SimpleNamespace(z=z), a, a, t=1, lr=0.0)
        scratch = [np.empty(n, dtype) for _ in range(run.scratch_needed(d))]
        run.numpy_update(d, np, cfg, types.SimpleNamespace(z=z), b, b, t=1, lr=0.0, scratch=scratch)
        update_fn(np, cfg, types.SimpleNamespace(z=z), p, p, t=1, lr=0.0, scratch=scratch)
    assert _bits(a) == _bits(b) == _bits(p)

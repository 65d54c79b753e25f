"""Adafactor8Bit state migration on load (flatopt.adafactor8bit.migrate): a snapshot saved with another state layout is
requantized or reset per parameter, with one StateMigrationWarning; a snapshot that does not belong is still
refused and changes nothing."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest

import flatopt
from flatopt.adafactor8bit import state, quant
from flatopt.core import backend
from flatopt.adafactor8bit import StateMigrationWarning
from flatopt.routing import Select

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

# "v": unfactored 6000 values (AL8 variance even with 2048-blocks), "w": factored matrix, "s": a short vector
SHAPES = {"s": (300,), "v": (6000,), "w": (96, 80)}
BASE = dict(beta1=0.9, lr=1e-2, relative_step=False, min_8bit_size=0)
EPS1_FLOOR = quant.al_floor(1e-30)


def _params(shapes=SHAPES):
    return {n: rng_arrays(i, s, scale=0.1) for i, (n, s) in enumerate(sorted(shapes.items()))}


def _run(opt, params, k0, k1, shapes=SHAPES):
    for k in range(k0, k1):
        for i, n in enumerate(sorted(shapes)):
            opt.step(n, shapes[n], params[n], rng_arrays(1000 + 10 * k + i, shapes[n]))
        opt.end_iteration()


def _snapshot(steps=3, shapes=SHAPES, **cfg):
    opt = flatopt.Adafactor8Bit(**{**BASE, **cfg})
    params = _params(shapes)
    _run(opt, params, 0, steps, shapes)
    return opt.state_dict(), params


def _load(opt, sd, **kw):
    """load_state_dict recording every warning: (result, [StateMigrationWarning messages])."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ok = opt.load_state_dict(sd, **kw)
    assert all(issubclass(w.category, StateMigrationWarning) for w in rec), [str(w.message) for w in rec]
    return ok, [str(w.message) for w in rec]


def _migrated(sd, **cfg):
    opt = flatopt.Adafactor8Bit(**{**BASE, **cfg})
    ok, msgs = _load(opt, sd)
    assert ok is True
    return opt, opt.state_dict(), msgs


def _al_decode(sd, slot, name, block, fmt, n):
    out = np.empty(n, np.float32)
    quant.al_decode(np, sd.buffers[f"{slot}_q/{name}"], sd.buffers[f"{slot}_scale/{name}"],
                    sd.buffers[f"{slot}_min_log/{name}"], out, block=block, fmt=fmt)
    return out


def _al_encode(values, block, fmt, floor=EPS1_FLOOR):
    q, s, ml = quant.al_init(np, values.size, block, fmt)
    quant.al_encode(np, values, q, s, ml, block=block, fmt=fmt, floor=floor)
    return q, s, ml


def _m_decode(sd, name, mblock, fmt, n):
    out = np.empty(n, np.float32)
    quant.m_decode(np, sd.buffers[f"m_q/{name}"], sd.buffers[f"m_scale/{name}"], out, mblock=mblock, fmt=fmt)
    return out


def _m_encode(values, mblock, fmt):
    q, s = quant.m_init(np, values.size, mblock, fmt)
    quant.m_encode(np, values, q, s, mblock=mblock, fmt=fmt)
    return q, s


def _assert_al(sd, name, slot, codes):
    for suffix, arr in zip(("_q", "_scale", "_min_log"), codes):
        assert_bits_equal(sd.buffers[f"{slot}{suffix}/{name}"], arr, f"{slot}{suffix}/{name}")


# ------------------------------------------------------------------------------------------- conversions
def test_al8_to_fp32_values_equal_the_decode_of_the_codes():
    sd, _ = _snapshot(factored=False)
    assert sd.buffers["variance_q/v"].dtype == np.uint8 and sd.buffers["m_q/v"].dtype == np.uint8
    opt, new, msgs = _migrated(sd, factored=False, quantize=False)
    for name in SHAPES:
        n = math.prod(SHAPES[name])
        assert_bits_equal(new.buffers[f"variance/{name}"], _al_decode(sd, "variance", name, 2048, "al8", n)
                          if f"variance_q/{name}" in sd.buffers else sd.buffers[f"variance/{name}"], name)
        assert_bits_equal(new.buffers[f"m/{name}"], _m_decode(sd, name, 256, "uf8", n), name)
        assert not any(k.endswith(f"_q/{name}") for k in new.buffers)
        assert new.params[name]["t"] == 3
    assert new.step == 3 and len(msgs) == 1
    assert "quantize: kept False (snapshot had True)" in opt.last_load_notes
    assert any(n.startswith("requantized v: variance al8/block 2048 -> fp32") for n in opt.last_load_notes)


def test_fp32_to_al8_codes_equal_a_fresh_encode_of_the_values():
    sd, _ = _snapshot(factored=False, quantize=False)
    _, new, _ = _migrated(sd, factored=False)
    vals = sd.buffers["variance/v"]
    _assert_al(new, "v", "variance", _al_encode(vals, 2048, "al8"))
    q, s = _m_encode(sd.buffers["m/v"], 256, "uf8")
    assert_bits_equal(new.buffers["m_q/v"], q), assert_bits_equal(new.buffers["m_scale/v"], s)


def test_block_2048_to_256_requantizes_only_what_changed():
    sd, _ = _snapshot(factored=False)
    opt, new, msgs = _migrated(sd, factored=False, block_size=256)
    n = SHAPES["v"][0]
    _assert_al(new, "v", "variance", _al_encode(_al_decode(sd, "variance", "v", 2048, "al8", n), 256, "al8"))
    assert new.buffers["variance_q/v"].size == quant.nblocks(n, 256) * 256
    for key in ("m_q/v", "m_scale/v"):  # the first moment's layout did not change: kept as stored
        assert_bits_equal(new.buffers[key], sd.buffers[key], key)
    # "s" (300 values) was float32 under 2048-blocks and is AL8 under 256-blocks
    _assert_al(new, "s", "variance", _al_encode(sd.buffers["variance/s"], 256, "al8"))
    assert len(msgs) == 1 and "'s'" in msgs[0] and "'v'" in msgs[0]


def test_al8_to_al16():
    sd, _ = _snapshot(factored=False, block_size=128)
    _, new, _ = _migrated(sd, factored=False, block_size=128, v_quant_type="al16")
    for name in ("s", "v"):
        n = math.prod(SHAPES[name])
        vals = _al_decode(sd, "variance", name, 128, "al8", n)
        assert new.buffers[f"variance_q/{name}"].dtype == np.uint16
        _assert_al(new, name, "variance", _al_encode(vals, 128, "al16"))


def test_uf8_to_uf4_first_moment():
    sd, _ = _snapshot(factored=False)
    _, new, _ = _migrated(sd, factored=False, m_quant_type="uf4")
    for name in SHAPES:
        n = math.prod(SHAPES[name])
        q, s = _m_encode(_m_decode(sd, name, 256, "uf8", n), 256, "uf4")
        assert new.buffers[f"m_q/{name}"].size == sd.buffers[f"m_q/{name}"].size // 2
        assert_bits_equal(new.buffers[f"m_q/{name}"], q, name), assert_bits_equal(new.buffers[f"m_scale/{name}"], s)
    for key in ("variance_q/v", "variance_scale/v", "variance_min_log/v"):  # v's variance: kept as stored
        assert_bits_equal(new.buffers[key], sd.buffers[key], key)


def test_min_8bit_size_crossing():
    sd, _ = _snapshot(factored=False, block_size=128, m_block_size=32)
    opt, new, msgs = _migrated(sd, factored=False, block_size=128, m_block_size=32, min_8bit_size=1000)
    assert_bits_equal(new.buffers["variance/s"], _al_decode(sd, "variance", "s", 128, "al8", 300))
    assert_bits_equal(new.buffers["m/s"], _m_decode(sd, "s", 32, "uf8", 300))
    for k in sd.buffers:  # the tensors above the threshold are untouched
        if not k.endswith("/s"):
            assert_bits_equal(new.buffers[k], sd.buffers[k], k)
    assert len(msgs) == 1 and "['s']" in msgs[0] and "'v'" not in msgs[0] and "'w'" not in msgs[0]
    assert "min_8bit_size: kept 1000 (snapshot had 0)" in opt.last_load_notes


def _emb_predicate(name, shape):
    return name.startswith("emb")


@pytest.mark.parametrize("selector", ["pattern", "predicate_known", "predicate_unknown"])
@pytest.mark.parametrize("through_file", [False, True])
def test_group_override_change(selector, through_file, tmp_path):
    shapes = {"emb": (5000,), "v": (6000,)}
    sel = {"pattern": "emb*", "predicate_known": Select(predicate=_emb_predicate, description="embeddings"),
           "predicate_unknown": Select(predicate=_emb_predicate, description="embeddings")}[selector]
    a = flatopt.Adafactor8Bit(**BASE, groups=[(sel, {"quantize": False})])
    params = _params(shapes)
    _run(a, params, 0, 3, shapes)
    sd = a.state_dict()
    if through_file:
        flatopt.save(tmp_path / "a8.npz", a)
        sd = flatopt.load(tmp_path / "a8.npz")
    assert "variance/emb" in sd.buffers and "variance_q/v" in sd.buffers
    # the current optimizer: emb in AL16 (same selector), or (unknown predicate) no groups at all: AL8
    groups = [] if selector == "predicate_unknown" else [(sel, {"v_quant_type": "al16"})]
    opt, new, msgs = _migrated(sd, groups=groups)
    fmt = "al8" if selector == "predicate_unknown" else "al16"
    _assert_al(new, "emb", "variance", _al_encode(sd.buffers["variance/emb"], 2048, fmt))
    q, s = _m_encode(sd.buffers["m/emb"], 256, "uf8")
    assert_bits_equal(new.buffers["m_q/emb"], q), assert_bits_equal(new.buffers["m_scale/emb"], s)
    for k in sd.buffers:
        if k.endswith("/v"):
            assert_bits_equal(new.buffers[k], sd.buffers[k], k)
    assert len(msgs) == 1 and "['emb']" in msgs[0]
    assert any(n.startswith("groups: kept") for n in opt.last_load_notes)
    _run(opt, params, 3, 5, shapes)  # and it steps on
    assert all(np.all(np.isfinite(p)) for p in params.values())


# ------------------------------------------------------------------------------------------------- resets
def _fresh_like(opt, name, shape):
    return state.init(np, opt.config_for(name, shape), shape, np.float32)


def _assert_fresh(opt, sd, name, shape, skip=()):
    tmpl = _fresh_like(opt, name, shape)
    for f in state.Adafactor8BitState.__dataclass_fields__:
        v = getattr(tmpl, f)
        if isinstance(v, np.ndarray) and f not in skip:
            assert_bits_equal(sd.buffers[f"{f}/{name}"], v, f"{f}/{name}")


@pytest.mark.parametrize("change", [dict(factored=False), dict(beta1=None), dict(beta3=0.999),
                                    dict(beta2=None, beta2_decay=None, relative_step=False)])
def test_structure_change_resets_and_keeps_t(change):
    sd, _ = _snapshot(steps=4, block_size=128, m_block_size=32)
    opt, new, msgs = _migrated(sd, **{**dict(block_size=128, m_block_size=32), **change})
    reset = ["w"] if "factored" in change or "beta3" in change else sorted(SHAPES)
    for name in SHAPES:
        assert new.params[name]["t"] == 4, name
        if name in reset:
            _assert_fresh(opt, new, name, SHAPES[name])
        else:
            for k in sd.buffers:
                if k.endswith("/" + name):
                    assert_bits_equal(new.buffers[k], sd.buffers[k], k)
    assert len(msgs) == 1 and f"reset {len(reset)} parameter(s)" in msgs[0] and str(reset) in msgs[0]
    assert "requantized" not in msgs[0]
    assert sum(n.startswith("reset ") for n in opt.last_load_notes) == len(reset)


def test_apollo_switch_and_rank_change_seeds():
    shapes = {"a": (40, 30), "b": (24, 32), "s": (300,)}
    sd, params = _snapshot(shapes=shapes, block_size=128, m_block_size=32)
    assert sd.extra["apollo_seed_counter"] == 1
    # onto APOLLO: seeds from the snapshot's counter, in name order; the 1-D parameter is not touched
    opt, new, msgs = _migrated(sd, block_size=128, m_block_size=32, apollo_rank=4)
    assert (new.params["a"]["apollo_seed"], new.params["b"]["apollo_seed"]) == (1, 2)
    assert new.params["a"]["t"] == 3 and new.extra["apollo_seed_counter"] == 3
    assert "['a', 'b']" in msgs[0] and "factored -> APOLLO rank 4" in " ".join(opt.last_load_notes)
    _run(opt, params, 3, 5, shapes)
    assert opt.state_dict().params["a"]["current_proj_seed"] == 1
    # APOLLO rank 4 -> rank 2: the seed stream is kept, a new projection is drawn at the next step
    sd4 = opt.state_dict()
    opt2, new2, msgs2 = _migrated(sd4, block_size=128, m_block_size=32, apollo_rank=2)
    for n in ("a", "b"):
        assert new2.params[n]["apollo_seed"] == sd4.params[n]["apollo_seed"]
        assert new2.params[n]["current_proj_seed"] == sd4.params[n]["current_proj_seed"]
        assert new2.params[n]["last_proj_step"] == -200 and new2.params[n]["t"] == 5
    assert new2.extra["apollo_seed_counter"] == 3 and "APOLLO rank 4 -> APOLLO rank 2" in msgs2[0] + str(
        opt2.last_load_notes)
    _run(opt2, params, 5, 6, shapes)
    st = opt2.state_dict()
    assert st.params["a"]["current_proj_seed"] == sd4.params["a"]["apollo_seed"]  # refreshed to the next seed
    assert st.params["a"]["last_proj_step"] == 6
    # same rank, quantize off: the APOLLO state is converted, its seeds and refresh step kept as they are
    opt3, new3, _ = _migrated(sd4, block_size=128, m_block_size=32, apollo_rank=4, quantize=False)
    for k in ("apollo_seed", "current_proj_seed", "last_proj_step"):
        assert new3.params["a"][k] == sd4.params["a"][k]
    assert_bits_equal(new3.buffers["v_low/a"], _al_decode(sd4, "v_low", "a", 128, "al8", 40 * 4))


# ------------------------------------------------------------------------------------ warnings and refusals
def test_one_warning_naming_requantized_and_reset_parameters():
    sd, _ = _snapshot(block_size=128, m_block_size=32)
    opt, _, msgs = _migrated(sd, block_size=128, m_block_size=32, m_quant_type="uf4",
                             groups=[("w", {"factored": False})])
    assert len(msgs) == 1
    assert "requantized 2 parameter(s)" in msgs[0] and "['s', 'v']" in msgs[0]
    assert "reset 1 parameter(s)" in msgs[0] and "['w']" in msgs[0]
    assert any(n == "requantized s: m uf8/block 32 -> uf4/block 32" for n in opt.last_load_notes)
    assert any(n == "reset w to fresh state, step count kept: factored -> unfactored" for n in opt.last_load_notes)


def test_no_warning_when_nothing_needs_converting():
    sd, _ = _snapshot(quantize=False)
    same = flatopt.Adafactor8Bit(**BASE, quantize=False)
    assert _load(same, sd) == (True, []) and same.last_load_notes == []
    other = flatopt.Adafactor8Bit(**BASE, quantize=False, block_size=256, v_quant_type="al16")
    assert _load(other, sd) == (True, [])  # another layout on paper, but every stored state already fits
    assert any("already fits" in n for n in other.last_load_notes)
    new = other.state_dict()
    assert new.params == sd.params and sorted(new.buffers) == sorted(sd.buffers)
    for k in sd.buffers:
        assert_bits_equal(new.buffers[k], sd.buffers[k], k)


def _refusals(sd):
    """Snapshots that must be refused by an Adafactor8Bit (with migration on)."""
    adamw = flatopt.AdamW()
    adamw.step("v", (6000,), rng_arrays(0, (6000,)), rng_arrays(1, (6000,)))
    out = {"other algorithm": adamw.state_dict()}
    st = copy.deepcopy(sd)
    st.format_version += 1
    out["format version"] = st
    st = copy.deepcopy(sd)
    st.params["v"]["shape"] = [5000]
    out["shape"] = st
    st = copy.deepcopy(sd)
    st.buffers["stray/v"] = np.zeros(3, np.float32)
    out["left-over buffer"] = st
    st = copy.deepcopy(sd)
    st.buffers["variance_q/v"] = st.buffers["variance_q/v"].astype(np.uint16)
    out["code dtype no config explains"] = st
    st = copy.deepcopy(sd)
    del st.buffers["m_scale/w"]
    out["missing array"] = st
    st = copy.deepcopy(sd)
    st.params["w"]["t"] = "x"
    out["malformed"] = st
    return out


def test_refused_snapshots_change_nothing():
    sd, _ = _snapshot(factored=False, block_size=128, m_block_size=32)
    opt = flatopt.Adafactor8Bit(**BASE, apollo_rank=2, quantize=False)  # another layout, with state of its own
    params = _params()
    _run(opt, params, 0, 2)
    opt.last_load_notes = ["before"]
    before, counter = opt.state_dict(), opt._apollo_seed_counter
    cases = _refusals(sd)
    for what, st in cases.items():
        assert _load(opt, st) == (False, []), what
    assert _load(opt, sd, migrate=False) == (False, [])
    assert _load(opt, sd, restore_hparams=True) == (False, [])
    assert_states_equal(opt.state_dict(), before)
    # nothing changed but the reason of the last refusal (``last_load_notes``: see tests/test_load_reasons.py)
    assert opt._apollo_seed_counter == counter
    assert len(opt.last_load_notes) == 1 and "migration to this layout was not allowed" in opt.last_load_notes[0]
    # and the untouched snapshot does load
    assert _load(opt, sd)[0] is True


def test_ambiguous_codes_are_refused():
    """uf8 and d8 codes look alike: with a group selected by a predicate this optimizer does not know, a parameter
    that either configuration could have stored cannot be decoded safely."""
    a = flatopt.Adafactor8Bit(**BASE, block_size=128, groups=[(Select(predicate=_emb_predicate, description="e"),
                                                                {"m_quant_type": "d8"})])
    shapes = {"emb": (400,), "v": (600,)}
    _run(a, _params(shapes), 0, 2, shapes)
    opt = flatopt.Adafactor8Bit(**BASE, block_size=128, quantize=False)
    before = opt.state_dict()
    assert _load(opt, a.state_dict()) == (False, [])
    assert_states_equal(opt.state_dict(), before)
    # with the predicate known (same description), it decodes each with its own format
    known = flatopt.Adafactor8Bit(**BASE, block_size=128, quantize=False,
                                  groups=[(Select(predicate=_emb_predicate, description="e"), {})])
    ok, msgs = _load(known, a.state_dict())
    assert ok and len(msgs) == 1
    sd = a.state_dict()
    assert_bits_equal(known.state_dict().buffers["m/emb"], _m_decode(sd, "emb", 256, "d8", 400))
    assert_bits_equal(known.state_dict().buffers["m/v"], _m_decode(sd, "v", 256, "uf8", 600))


# ------------------------------------------------------------------------------------------- training on
def _problem():
    r = np.random.default_rng(0)
    x, w_true = r.standard_normal((64, 48)).astype(np.float32), r.standard_normal((48, 32)).astype(np.float32)
    return x, x @ w_true


def _loss_grad(w, x, y):
    err = x @ w.reshape(48, 32) - y
    return float(np.mean(err**2)), (2.0 / err.size * x.T @ err).astype(np.float32).ravel()


@pytest.mark.parametrize("target", [dict(quantize=False), dict(v_quant_type="al16", m_quant_type="uf4"),
                                    dict(factored=False), dict(apollo_rank=8)])
def test_training_continues_after_migration(target):
    x, y = _problem()
    cfg = dict(lr=3e-2, beta1=0.9, relative_step=False, scale_parameter=False, min_8bit_size=0, block_size=128,
               m_block_size=32)
    w = np.zeros(48 * 32, np.float32)
    opt = flatopt.Adafactor8Bit(**cfg)
    for _ in range(40):
        loss, g = _loss_grad(w, x, y)
        opt.step("w", (48, 32), w, g)
    loss_at_save = _loss_grad(w, x, y)[0]
    new = flatopt.Adafactor8Bit(**{**cfg, **target})
    ok, msgs = _load(new, opt.state_dict())
    assert ok and len(msgs) == 1
    for _ in range(40):
        loss, g = _loss_grad(w, x, y)
        new.step("w", (48, 32), w, g)
    final = _loss_grad(w, x, y)[0]
    assert np.isfinite(final) and final < 0.7 * loss_at_save, (loss_at_save, final)
    assert new.state_dict().params["w"]["t"] == 80


@pytest.mark.usefixtures("gpu_or_emulated")
def test_cupy_snapshot_migrates_on_the_device():
    cp = backend.cupy()
    a = flatopt.Adafactor8Bit(**BASE, factored=False)
    params = {n: cp.asarray(p) for n, p in _params().items()}
    for k in range(3):
        for i, n in enumerate(sorted(SHAPES)):
            a.step(n, SHAPES[n], params[n], cp.asarray(rng_arrays(1000 + 10 * k + i, SHAPES[n])))
    sd_gpu = a.state_dict()
    opt, new, msgs = _migrated(sd_gpu, factored=False, block_size=256, m_quant_type="uf4")
    assert backend.backend_name(new.buffers["variance_q/v"]) == "cupy" and len(msgs) == 1
    host = copy.copy(sd_gpu)
    host.buffers = {k: backend.to_numpy(v) for k, v in sd_gpu.buffers.items()}
    _, new_host, _ = _migrated(host, factored=False, block_size=256, m_quant_type="uf4")
    for k in new_host.buffers:
        assert_bits_equal(new.buffers[k], new_host.buffers[k], k)
    for i, n in enumerate(sorted(SHAPES)):  # and it steps on the device
        opt.step(n, SHAPES[n], params[n], cp.asarray(rng_arrays(7 + i, SHAPES[n])))


def test_every_registry_layout_migrates_into_every_other():
    from .helpers import make_params, run_steps
    from .registry import REGISTRY

    specs = [s for n, s in sorted(REGISTRY.items()) if n.startswith("adafactor8bit")]
    snaps = []
    for spec in specs:
        opt = spec.make()
        run_steps(opt, make_params(spec.shapes), 2)
        snaps.append(opt.state_dict())
    for i, spec in enumerate(specs):
        for j, sd in enumerate(snaps):
            opt = spec.make()
            ok, msgs = _load(opt, sd)
            assert ok is True and len(msgs) == (0 if i == j else 1), (i, j, msgs)
            params = make_params(spec.shapes)
            run_steps(opt, params, 1, start=2)
            assert all(np.all(np.isfinite(p)) for _, p in params.values())
            assert all(m["t"] == 3 for m in opt.state_dict().params.values())

"""The step plan (``core/step_plan.py``): a repeated ``step_batch`` re-uses what it derived, and still notices
everything the contract validates.

Each test runs on NumPy and, where the emulator can run, on the CuPy stand-in (``tests/cuda_emu``); the reference
is the serial ``step`` loop (no plan: one item per call)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.core import backend

from .cuda_emu import emu, fakecupy
from .registry import REGISTRY

SIZES = [64] * 6 + [3, 1, 0, 5000]


@pytest.fixture(params=["numpy", "cupy"])
def xp(request):
    if request.param == "numpy":
        yield np
        return
    if backend.gpu_available():
        yield backend.cupy()
        return
    why = emu.available()
    if why:
        pytest.skip(f"no CUDA device answers and {why}")
    with fakecupy.installed() as cp:
        yield cp


def _host(x):
    return backend.to_numpy(x).copy()


def _data(xp, seed=0, sizes=SIZES, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [xp.asarray(rng.standard_normal(n).astype(dtype)) for n in sizes]


def _items(params, grads, names=None):
    names = names or [f"w{i}" for i in range(len(params))]
    return [OptItem(n, (p.size,), p, g) for n, p, g in zip(names, params, grads)]


def _snapshot(opt, params):
    st = opt.state_dict()
    return [_host(p) for p in params], {k: _host(v) for k, v in st.buffers.items()}, st.params


def _same(a, b):
    pa, ba, ma = a
    pb, bb, mb = b
    assert all(x.tobytes() == y.tobytes() for x, y in zip(pa, pb))
    assert sorted(ba) == sorted(bb) and all(ba[k].tobytes() == bb[k].tobytes() for k in ba)
    assert ma == mb


def _twins(xp, make=lambda: flatopt.AdamW(lr=1e-2)):
    """(batch optimizer, its params, serial optimizer, its params), grads shared."""
    pa, pb = _data(xp), _data(xp)
    return make(), pa, make(), pb


def _step_both(oa, pa, ob, pb, grads, names=None):
    oa.step_batch(_items(pa, grads, names))
    for it in _items(pb, grads, names):
        ob.step(*it)


def test_repeated_batch_reuses_its_plan_and_equals_serial(xp):
    oa, pa, ob, pb = _twins(xp)
    grads = _data(xp, 1)
    for _ in range(4):
        _step_both(oa, pa, ob, pb, grads)
    plans = oa.plan_cache.step_plans
    assert len(plans) == 1
    plan = next(iter(plans.values()))
    for _ in range(2):
        _step_both(oa, pa, ob, pb, grads)
    assert next(iter(oa.plan_cache.step_plans.values())) is plan
    _same(_snapshot(oa, pa), _snapshot(ob, pb))


def test_new_grad_array_name_or_batch_is_noticed(xp):
    oa, pa, ob, pb = _twins(xp)
    grads = _data(xp, 1)
    _step_both(oa, pa, ob, pb, grads)
    _step_both(oa, pa, ob, pb, grads)
    plan = next(iter(oa.plan_cache.step_plans.values()))
    hits = plan.hits
    assert hits == 1
    grads2 = _data(xp, 2)  # new arrays, other values: the plan is not used
    _step_both(oa, pa, ob, pb, grads2)
    assert plan.hits == hits
    _step_both(oa, pa, ob, pb, grads2)  # a new plan for the new arrays, re-used
    assert next(iter(oa.plan_cache.step_plans.values())).hits == 1
    names = [f"v{i}" for i in range(len(pa))]  # new names: fresh states
    _step_both(oa, pa, ob, pb, grads2, names)
    del grads  # a freed array kills the plans that knew it
    _step_both(oa, pa[:4], ob, pb[:4], grads2[:4])  # a sub-batch: other step counts
    _step_both(oa, pa, ob, pb, grads2)  # items at different t: regrouped
    _step_both(oa, pa, ob, pb, grads2)
    _same(_snapshot(oa, pa), _snapshot(ob, pb))


def test_set_lr_and_a_changing_lr_scale_take_effect(xp):
    scale = {"w1": 2.0}

    def make():
        return flatopt.AdamW(lr=1e-2, lr_scale=lambda n: scale.get(n, 1.0))

    oa, pa, ob, pb = _twins(xp, make)
    grads = _data(xp, 1)
    for k in range(5):
        if k == 2:
            oa.set_lr(3e-2)
            ob.set_lr(3e-2)
        if k == 3:
            scale["w2"] = 0.5
        _step_both(oa, pa, ob, pb, grads)
    _same(_snapshot(oa, pa), _snapshot(ob, pb))
    oa.set_lr(float(np.finfo(np.float32).max))
    scale["w3"] = 10.0
    before = _snapshot(oa, pa)
    with pytest.raises(ValueError, match="not finite in float32"):  # lr · lr_scale (w1: 2, w3: 10)
        oa.step_batch(_items(pa, grads))
    _same(_snapshot(oa, pa), before)


def _bad_cases(xp):
    """(description, mutate(params, grads) -> items, exception, restore) after the plan exists."""
    cases = [
        ("grad of another size", lambda p, g: _items(p, g[:1] + [xp.zeros(65, np.float32)] + g[2:]), ValueError),
        ("another shape for a name with state",
         lambda p, g: [OptItem("w0", (8, 9), xp.zeros(72, np.float32), xp.zeros(72, np.float32))] + _items(p, g)[1:],
         ValueError),
        ("a float in a shape", lambda p, g: [OptItem("w0", (64.0,), p[0], g[0])] + _items(p, g)[1:], ValueError),
        ("a duplicated name", lambda p, g: _items(p, g) + [_items(p, g)[0]], ValueError),
        ("param and grad the same array", lambda p, g: [OptItem("w0", (64,), p[0], p[0])] + _items(p, g)[1:],
         ValueError),
    ]
    return cases


@pytest.mark.parametrize("case", range(5))
def test_bad_item_after_the_plan_is_rejected_before_anything_changes(xp, case):
    opt = flatopt.AdamW(lr=1e-2)
    params, grads = _data(xp), _data(xp, 1)
    for _ in range(3):
        opt.step_batch(_items(params, grads))
    what, mutate, exc = _bad_cases(xp)[case]
    before = _snapshot(opt, params)
    with pytest.raises(exc):
        opt.step_batch(mutate(params, grads))
    _same(_snapshot(opt, params), before)
    opt.step_batch(_items(params, grads))  # and the good batch still steps


@pytest.mark.parametrize("change", ["shape", "dtype", "strides", "writeable"])
def test_numpy_attributes_changed_in_place_are_noticed(change):
    opt = flatopt.SGD(lr=0.1, momentum=0.9)
    base = np.zeros(128, np.float32)
    params = _data(np) + [base[:64]]
    grads = _data(np, 1) + [np.ones(64, np.float32)]
    for _ in range(2):
        opt.step_batch(_items(params, grads))
    p = params[-1]
    if change == "shape":
        p.shape = (8, 8)
    elif change == "dtype":
        p.dtype = np.int32
    elif change == "strides":
        with warnings.catch_warnings():  # deprecated since NumPy 2.4, still possible
            warnings.simplefilter("ignore", DeprecationWarning)
            p.strides = (8,)  # (base has room: 64 elements 8 bytes apart)
    else:
        p.flags.writeable = False
    before = _snapshot(opt, params)
    with pytest.raises((ValueError, TypeError)):
        opt.step_batch([OptItem(n, (a.size,), a, g) for n, a, g in
                        zip([f"w{i}" for i in range(len(params))], params, grads)])
    _same(_snapshot(opt, params), before)


def test_cupy_shape_changed_in_place_is_noticed(xp):
    if xp is np:
        pytest.skip("CuPy only")
    opt = flatopt.AdamW()
    params, grads = _data(xp), _data(xp, 1)
    for _ in range(2):
        opt.step_batch(_items(params, grads))
    params[0].shape = (8, 8)
    with pytest.raises(ValueError):
        opt.step_batch([OptItem(f"w{i}", (a.size,), a, g) for i, (a, g) in enumerate(zip(params, grads))])


def test_reset_and_load_state_dict_drop_the_plans(xp):
    oa, pa, ob, pb = _twins(xp)
    grads = _data(xp, 1)
    for _ in range(2):
        _step_both(oa, pa, ob, pb, grads)
    oa.reset("w1")
    ob.reset("w1")
    _step_both(oa, pa, ob, pb, grads)
    snap = oa.state_dict()
    _step_both(oa, pa, ob, pb, grads)
    assert oa.load_state_dict(snap) and ob.load_state_dict(snap)
    _step_both(oa, pa, ob, pb, grads)
    _same(_snapshot(oa, pa), _snapshot(ob, pb))


def test_validate_batch_uses_the_plan_and_still_rejects(xp):
    opt = flatopt.AdamW()
    params, grads = _data(xp), _data(xp, 1)
    opt.step_batch(_items(params, grads))
    opt.validate_batch(_items(params, grads))
    with pytest.raises(ValueError):
        opt.validate_batch(_items(params, grads) + [_items(params, grads)[0]])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_stepping_stores_no_cache_on_the_optimizer(name):
    """Every plan and cache a batch derives lives in the driver's ``plan_cache``: stepping (a batch twice, so that
    its plan is built and re-used), ``validate_batch`` and ``reset`` add no attribute to the optimizer object."""
    spec = REGISTRY[name]
    opt = spec.make()
    before = set(vars(opt))
    rng = np.random.default_rng(0)
    arrays = [(f"w{s}", s, rng.standard_normal(int(np.prod(s))).astype(np.float32),
               rng.standard_normal(int(np.prod(s))).astype(np.float32)) for s in spec.shapes]
    items = [OptItem(n, s, p, g) for n, s, p, g in arrays]
    for _ in range(3):
        opt.step_batch(items)
    opt.validate_batch(items)
    opt.reset(items[0].name)
    opt.step_batch(items)
    assert set(vars(opt)) == before, sorted(set(vars(opt)) ^ before)

"""flatopt.routing.Router: selection rules, validate-everything-before-any-mutation, concurrent groups bit-identical
to serial, lr ratios and per-call overrides, combined snapshots that refuse another grouping."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.routing import Group, IncompatibleState, Router, RoutingError, Select

from .helpers import assert_bits_equal, assert_states_equal, rng_arrays

SHAPES = {"enc.w": (30, 20), "enc.b": (20,), "dec.w": (20, 30), "dec.b": (30,), "ln.g": (20,)}


def make(concurrent=True, **kw):
    return Router([
        Group("mom", flatopt.SGD(lr=0.1, momentum=0.9), Select(names=["enc.w"], patterns=["dec.*"])),
        Group("adam", flatopt.AdamW(lr=0.01), Select.all(), lr_ratio=0.5),
    ], concurrent=concurrent, **kw)


def params(seed=0, shapes=SHAPES):
    return {n: rng_arrays(seed + i, s) for i, (n, s) in enumerate(sorted(shapes.items()))}


def items(ps, it, shapes=SHAPES):
    return [OptItem(n, shapes[n], ps[n], rng_arrays(100 + 7 * it + i, shapes[n])) for i, n in enumerate(sorted(ps))]


def test_selection_rules_first_match_wins():
    r = Router([
        Group("a", flatopt.SGD(lr=0.1), Select(names=["x"])),
        Group("b", flatopt.SGD(lr=0.1), Select(patterns=["blk.*.w"])),
        Group("c", flatopt.SGD(lr=0.1), Select(predicate=lambda n, s: len(s) == 2, description="2-D")),
        Group("d", flatopt.SGD(lr=0.1), Select.all()),
    ])
    assert r.route("x", (3, 3)) == "a"
    assert r.route("blk.0.w", (3, 3)) == "b"
    assert r.route("emb", (3, 3)) == "c"
    assert r.route("bias", (3,)) == "d"
    strict = Router([Group("a", flatopt.SGD(lr=0.1), Select(names=["x"]))])
    with pytest.raises(RoutingError, match="'y'"):
        strict.route("y", (2,))
    with pytest.raises(RoutingError):
        Select()
    with pytest.raises(RoutingError):
        Router([Group("a", flatopt.SGD(lr=0.1), Select.all()), Group("a", flatopt.SGD(lr=0.1), Select.all())])
    with pytest.raises(TypeError, match="validate_batch"):
        Router([Group("a", object(), Select.all())])


def test_bad_item_in_any_group_changes_nothing():
    ps = params()
    r = make()
    r.step_batch(items(ps, 0))
    state, before = r.state_dict(), {n: p.copy() for n, p in ps.items()}
    good = items(ps, 1)
    bad_last = good[:-1] + [OptItem(good[-1].name, good[-1].shape, ps[good[-1].name], np.zeros(3, np.float32))]
    unrouted = Router([Group("only", flatopt.SGD(lr=0.1), Select(names=list(SHAPES)[:2]))])
    for batch in (bad_last, good + [good[0]], good + [OptItem("x", (20,), ps["enc.b"], rng_arrays(1, (20,)))]):
        with pytest.raises((ValueError, TypeError)):
            r.step_batch(batch)
        assert_states_equal(r.state_dict(), state)
        for n, p in ps.items():
            assert_bits_equal(p, before[n], n)
    with pytest.raises(RoutingError):
        unrouted.step_batch(good)
    assert unrouted.state_dict().params == {}


def test_concurrent_equals_serial_bit_for_bit():
    shapes = {"a.w": (600, 500), "b.w": (400, 700), "c": (300_000,), "d": (5,)}
    outs = []
    for concurrent in (False, True):
        r = make(concurrent=concurrent)
        r.groups[0].select = Select(names=["a.w", "b.w"])
        ps = params(shapes=shapes)
        for it in range(3):
            r.step_batch(items(ps, it, shapes))
        outs.append((ps, r.state_dict()))
    for n in outs[0][0]:
        assert_bits_equal(outs[0][0][n], outs[1][0][n], n)
    assert_states_equal(outs[0][1], outs[1][1])


def test_lr_ratios_overrides_and_scale():
    r = Router([
        Group("a", flatopt.SGD(lr=0.1), Select(names=["x"])),
        Group("b", flatopt.AdamW(lr=0.1, lr_scale={"y": 0.25}), Select.all(), lr_ratio=0.5),
        Group("c", flatopt.SGD(lr=0.3), Select(names=["never"]), lr_ratio=None),
    ])
    order = [g.name for g in r.groups]
    r.set_lr(0.2)
    assert [r.groups[order.index(k)].optimizer.lr for k in "abc"] == [0.2, 0.1, 0.3]
    assert r.lr == 0.2 and r.lr_scale("y") == 0.25 and r.lr_scale("x") == 1.0
    p1, p2 = rng_arrays(0, (4,)), rng_arrays(0, (4,))
    g = rng_arrays(1, (4,))
    r.step_batch([OptItem("x", (4,), p1, g)], lrs={"a": 0.05})
    assert r.groups[0].optimizer.lr == 0.2  # restored after the call
    flatopt.SGD(lr=0.05).step("x", (4,), p2, g)
    assert_bits_equal(p1, p2)
    with pytest.raises(RoutingError):
        r.step_batch([OptItem("x", (4,), p1, g)], lrs={"zz": 0.1})


@pytest.mark.parametrize("through_file", [False, True])
def test_snapshot_round_trip_continues_bit_exact(through_file, tmp_path):
    a, b = params(), params()
    ra, rb = make(), make()
    for it in range(4):
        ra.step_batch(items(a, it))
        ra.end_iteration()
    for it in range(2):
        rb.step_batch(items(b, it))
        rb.end_iteration()
    st = rb.state_dict()
    assert st.params["enc.w"]["group"] == "mom" and "adam.m/ln.g" in st.buffers
    if through_file:
        flatopt.save(tmp_path / "r.npz", st)
        st = flatopt.load(tmp_path / "r.npz")
    rc = make()
    assert rc.load_state_dict(st) is True
    for it in range(2, 4):
        rc.step_batch(items(b, it))
        rc.end_iteration()
    for n in a:
        assert_bits_equal(a[n], b[n], n)
    assert_states_equal(ra.state_dict(), rc.state_dict())


def test_load_refuses_other_grouping_and_rolls_back():
    ps = params()
    r = make()
    r.step_batch(items(ps, 0))
    st = r.state_dict()
    other = Router([
        Group("mom", flatopt.SGD(lr=0.1, momentum=0.9), Select(names=["enc.w"])),  # dec.* no longer selected
        Group("adam", flatopt.AdamW(lr=0.01), Select.all(), lr_ratio=0.5),
    ])
    with pytest.raises(IncompatibleState, match="grouping"):
        other.try_load_state_dict(st)
    # same grouping key, but a parameter stored under a group this router would not send it to
    bad = copy.deepcopy(st)
    bad.params["ln.g"]["group"] = "mom"
    fresh = make()
    assert fresh.load_state_dict(bad) is False
    # the second group refuses (AdamW amsgrad differs) after the first loaded: the first is rolled back
    ams = Router([
        Group("mom", flatopt.SGD(lr=0.1, momentum=0.9), Select(names=["enc.w"], patterns=["dec.*"])),
        Group("adam", flatopt.AdamW(lr=0.01, amsgrad=True), Select.all(), lr_ratio=0.5),
    ])
    ps2 = params(5)
    ams.step_batch(items(ps2, 3))
    before = ams.state_dict()
    assert ams.load_state_dict(st) is False
    assert_states_equal(ams.state_dict(), before)
    assert make().load_state_dict(flatopt.AdamW().state_dict()) is False

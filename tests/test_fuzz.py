"""Property-based fuzzing of the whole registry (hypothesis).

Random call sequences of ``step``, ``step_batch``, ``end_iteration``, ``set_lr`` and save/load, over shapes of rank
0 to 4 with sides 1 to 7, float32 and float64, and random valid hyper-parameters.  Invariants:

* finite inputs give finite outputs;
* ``grad`` is never written (the buffers are read-only: any write raises);
* a rejected call (an unsupported shape, a shape or dtype change) changes no byte of any param or state;
* ``step_batch`` ≡ the serial loop, bit for bit (a twin optimizer replays every batch as serial steps);
* save → load into a fresh optimizer → continue ≡ continue, bit for bit (the twin is the one reloaded).

``FUZZ_EXAMPLES`` (default 25 per optimizer) sets the number of hypothesis examples.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import flatopt
from flatopt import OptItem

from .helpers import assert_bits_equal, assert_states_equal
from .optional import HealthCheck, given, settings, st
from .registry import REGISTRY

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
NAMES = sorted(REGISTRY)

shapes = st.lists(st.integers(1, 7), min_size=0, max_size=4).map(tuple)
op = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 3), shapes, st.sampled_from(["float32", "float64"])),
    st.tuples(st.just("batch"), st.lists(st.tuples(st.integers(0, 3), shapes, st.sampled_from(["float32", "float64"])),
                                         min_size=1, max_size=4, unique_by=lambda t: t[0])),
    st.tuples(st.just("end")),
    st.tuples(st.just("set_lr"), st.floats(0.1, 2.0)),
    st.tuples(st.just("save_load")),
)


class World:
    """Two optimizers fed identical inputs: A steps serially, B takes batches as step_batch and is the one
    saved and reloaded; every call must leave them bit-identical."""

    def __init__(self, spec, kwargs, seed):
        self.spec, self.kwargs = spec, kwargs
        self.a, self.b = spec.make(**kwargs), spec.make(**kwargs)
        self.params: dict[str, tuple[tuple, np.ndarray, np.ndarray]] = {}  # name -> (shape, param A, param B)
        self.rng = np.random.default_rng(seed)

    def grad(self, shape, dtype):
        g = (self.rng.standard_normal(int(np.prod(shape))) * self.rng.choice([1e-3, 1.0, 30.0])).astype(dtype)
        g.flags.writeable = False
        return g

    def snapshot(self):
        return (self.a.state_dict(), self.b.state_dict(), {n: (pa.copy(), pb.copy()) for n, (_, pa, pb) in
                                                           self.params.items()})

    def assert_unchanged(self, snap):
        sa, sb, ps = snap
        assert_states_equal(self.a.state_dict(), sa)
        assert_states_equal(self.b.state_dict(), sb)
        for n, (_, pa, pb) in self.params.items():
            assert_bits_equal(pa, ps[n][0], n)
            assert_bits_equal(pb, ps[n][1], n)

    def step(self, idx, shape, dtype):
        name = f"p{idx}"
        if name in self.params:
            old_shape, pa, pb = self.params[name]
            if old_shape != shape or str(pa.dtype) != dtype:
                g = self.grad(shape, dtype)
                p = np.ones(int(np.prod(shape)), dtype)
                snap = self.snapshot()
                with pytest.raises((ValueError, TypeError)):
                    self.a.step(name, shape, p, g)
                self.assert_unchanged(snap)
                return
        else:
            start = self.rng.standard_normal(int(np.prod(shape))).astype(dtype)
            pa, pb = start.copy(), start.copy()
        g = self.grad(shape, dtype)
        snap = self.snapshot()
        try:
            self.a.step(name, shape, pa, g)
        except (ValueError, TypeError):  # a shape the algorithm does not take: nothing may have changed
            self.assert_unchanged(snap)
            with pytest.raises((ValueError, TypeError)):
                self.b.step(name, shape, pb, g)
            self.assert_unchanged(snap)
            return
        self.b.step(name, shape, pb, g)
        self.params[name] = (shape, pa, pb)

    def batch(self, entries):
        """A step_batch on B of existing names (their own shape) and new ones (created inside the batch); A
        replays it serially.  A batch with an item the algorithm rejects must change nothing at all."""
        items, new = [], {}
        for idx, shape, dtype in entries:
            name = f"p{idx}"
            if name in self.params:
                shape, pa, pb = self.params[name]
            else:
                start = self.rng.standard_normal(int(np.prod(shape))).astype(dtype)
                pa, pb = start.copy(), start.copy()
                new[name] = (shape, pa, pb)
            items.append((name, shape, pa, pb, self.grad(shape, pa.dtype)))
        snap = self.snapshot()
        try:
            self.b.step_batch([OptItem(n, s, pb, g) for n, s, _, pb, g in items])
        except (ValueError, TypeError):
            self.assert_unchanged(snap)
            for _, _, pa, pb, _ in items:
                assert_bits_equal(pa, pb)
            return
        for n, s, pa, _, g in items:
            self.a.step(n, s, pa, g)
        self.params.update(new)

    def set_lr(self, factor):
        for o in (self.a, self.b):
            if o.lr is not None:
                o.set_lr(o.lr * factor)

    def save_load(self, tmp):
        flatopt.save(tmp, self.b)
        fresh = self.spec.make(**self.kwargs)
        if self.b.lr is not None:
            fresh.set_lr(self.b.lr)
        assert fresh.load_state_dict(flatopt.load(tmp)) is True
        self.b = fresh

    def check(self):
        for n, (_, pa, pb) in self.params.items():
            assert np.all(np.isfinite(pa)), n
            assert_bits_equal(pa, pb, n)
        sa, sb = self.a.state_dict(), self.b.state_dict()
        sa.config = sb.config = {}  # the lr may be restated; everything else must agree
        assert_states_equal(sa, sb)


@pytest.mark.parametrize("name", NAMES)
def test_fuzz_registry(name, tmp_path):
    spec = REGISTRY[name]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops=st.lists(op, min_size=1, max_size=14), seed=st.integers(0, 2**31 - 1))
    def run(ops, seed):
        kwargs = spec.fuzz(random.Random(seed)) if spec.fuzz else {}
        w = World(spec, kwargs, seed)
        for o in ops:
            if o[0] == "step":
                w.step(*o[1:])
            elif o[0] == "batch":
                w.batch(o[1])
            elif o[0] == "end":
                w.a.end_iteration()
                w.b.end_iteration()
            elif o[0] == "set_lr":
                w.set_lr(o[1])
            else:
                w.save_load(tmp_path / "fuzz.npz")
            w.check()

    run()

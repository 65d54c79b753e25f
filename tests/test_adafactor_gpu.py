"""Adafactor's segmented GPU path (``flatopt/adafactor/gpu.py``, ``kernels/adafactor.cu``): on a real GPU when one
answers, else on the emulated device (``tests/cuda_emu``), as ``tests/test_gpu.py``.

* kernel vs twin (``FLATOPT_FORCE_TWIN=1``) over one batch of mixed shapes (matrices whose rows straddle the
  column-sum tiles and whose columns straddle a block, 3-D and 4-D tensors, vectors around the chunk size, 0 and 1
  element) holding a float32 and a float64 group: V (no sum) bit for bit, the rest within float rounding (see
  ``test_segmented_step_matches_twin``); the tensors are views into one buffer with sentinel gaps, so a write outside a
  tensor's range through the table's addresses shows up;
* determinism: a tensor's bits (param and every state buffer) are the same stepped alone, in one batch, in another
  batch order with other tensors and dtypes, at different step counts;
* a steady-state step of the 76-tensor transformer layout: at most 24 launches (6), no host synchronisation, no
  device allocation, also across ``set_lr``; fresh arrays rebuild the plan and are stepped correctly.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flatopt
from flatopt import OptItem
from flatopt.adafactor import gpu as af_gpu
from flatopt.core import backend

from .cuda_emu import emu, fakecupy
from .helpers import transformer_shapes

GAP = 5
SENTINEL = 4321.0
STEPS = 3

# the real GPU when one answers; otherwise CuPy is the stand-in and the kernels run on the emulator
gpu_device = pytest.fixture(scope="module", autouse=True)(fakecupy.device_or_emulated)

CONFIGS = {
    "relative": {},  # relative step, parameter scaling (Σθ² partials), factored
    "manual_beta1_wd": dict(lr=1e-2, beta1=0.9, weight_decay=0.1),  # no scaling: decay 1 − ρλ from the host's double
    "scaled_beta1_wd": dict(beta1=0.8, weight_decay=0.05, clip_threshold=0.5),
    "unfactored": dict(lr=1e-2, beta2=0.99, factored=False, scale_parameter=True),
    "unfactored_manual_wd": dict(lr=1e-2, factored=False, weight_decay=0.01),  # no Σθ² partials
}
TILE, CH = af_gpu.TILE_ROWS, af_gpu.CHUNK
F32 = [(10 * TILE - 20, af_gpu.THREADS + 1), (TILE + 1, 70), (2 * TILE, af_gpu.THREADS), (0,), (1,), (CH + 1,),
       (3, TILE + 1, 5), (5, 1), (1, 300), (2, 1, 3), (2, 3, 2, 4), (CH - 1,), (0, 4)]
F64 = [(TILE - 1, 2 * af_gpu.THREADS + 1), (CH,), (1, 1), (6,), (4, 3, 9)]
LAYOUT = [(f"f{i}", s, np.float32) for i, s in enumerate(F32)] + [(f"d{i}", s, np.float64) for i, s in enumerate(F64)]


def _size(shape) -> int:
    return int(np.prod(shape))


def _buffers(cp, layout, seed):
    """Per dtype, one device buffer holding every tensor of that dtype with SENTINEL gaps; views by name, and the
    buffers with each view's span (for ``_gaps_intact``).  A tensor's values depend on its name and ``seed`` only."""
    views, whole = {}, []
    for dt in (np.float32, np.float64):
        names = [(n, _size(s)) for n, s, d in layout if d is dt]
        if not names:
            continue
        host = np.full(sum(k for _, k in names) + GAP * (len(names) + 1), SENTINEL, dt)
        off, spans = GAP, []
        for n, k in names:
            host[off:off + k] = np.random.default_rng([seed, zlib.crc32(n.encode())]).standard_normal(k)
            spans.append((off, k))
            off += k + GAP
        dev = cp.asarray(host)
        whole.append((dev, spans))
        at = GAP
        for n, k in names:
            views[n] = dev[at:at + k]
            at += k + GAP
    return views, whole


def _gaps_intact(whole):
    for dev, spans in whole:
        host = backend.to_numpy(dev)
        mask = np.ones(host.size, bool)
        for o, k in spans:
            mask[o:o + k] = False
        assert np.all(host[mask] == SENTINEL), "a write outside a tensor's range"


def _run(cp, opt, layout, schedule, steps=STEPS):
    """``steps`` steps of ``layout`` (fresh gradient buffers each step, checked for writes); ``schedule(items)``
    steps the items (one batch, serially, ...).  Returns the params on the host and the state snapshot."""
    params, pwhole = _buffers(cp, layout, 0)
    for k in range(steps):
        grads, gwhole = _buffers(cp, layout, 100 + k)
        schedule(opt, [OptItem(n, s, params[n], grads[n]) for n, s, _ in layout])
        _gaps_intact(gwhole)
    _gaps_intact(pwhole)
    return {n: backend.to_numpy(p) for n, p in params.items()}, opt.state_dict()


def _batch(opt, items):
    opt.step_batch(items)


def _serial(opt, items):
    for it in items:
        opt.step(*it)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_segmented_step_matches_twin(config, monkeypatch):
    """Kernel vs twin.  Every elementwise operation is the twin's (tests/test_gpu.py checks it bit for bit where no sum
    has more than two terms); what differs is the order in which the sums add (kernels/adafactor.cu).  So:

    * V (unfactored: no sum) is bit-identical;
    * R and C (EMAs of row and column sums of k = c or r positive terms): any two orders of a sum of k positive terms
      are within 2(k − 1)·u (u = eps/2) of each other relatively, and an EMA of positive terms keeps the largest
      relative error of its terms, plus one rounding per step: rtol (k + 2·steps)·eps;
    * p and m: the sums' relative differences reach Δ through the rsqrt factors, α and the clip factor, and Δ is a
      small fraction of p, so p moves by a few of its own roundings per step: test_gpu's 4 ulps per step of
      max(1, max|p|); m (Δ's EMA) the same relative to max|m|."""
    cp = backend.cupy()
    out = {}
    for twin in ("1", "0"):
        monkeypatch.setenv("FLATOPT_FORCE_TWIN", twin)
        out[twin] = _run(cp, flatopt.Adafactor(**CONFIGS[config]), LAYOUT, _batch)
    (tp, ts), (kp, ks) = out["1"], out["0"]
    shapes = {n: (s, dt) for n, s, dt in LAYOUT}
    for n, (shape, dt) in shapes.items():
        eps = float(np.finfo(dt).eps)
        np.testing.assert_allclose(kp[n], tp[n], rtol=0, err_msg=n,
                                   atol=4 * STEPS * eps * max(1.0, float(np.abs(tp[n]).max(initial=0))))
    assert sorted(ks.buffers) == sorted(ts.buffers) and ks.params == ts.params
    for key, want in ts.buffers.items():
        field, name = key.split("/", 1)
        shape, dt = shapes[name]
        want, got = backend.to_numpy(want), backend.to_numpy(ks.buffers[key])
        eps = float(np.finfo(dt).eps)
        if field == "exp_avg_sq":
            assert got.tobytes() == want.tobytes(), key
        elif field in ("exp_avg_sq_row", "exp_avg_sq_col"):
            k = shape[-1] if field == "exp_avg_sq_row" else shape[-2]
            np.testing.assert_allclose(got, want, rtol=(k + 2 * STEPS) * eps, atol=0, err_msg=key)
        else:
            assert field == "exp_avg", key
            np.testing.assert_allclose(got, want, rtol=0, err_msg=key,
                                       atol=4 * STEPS * eps * float(np.abs(want).max(initial=0)))


def _bits(result, names):
    params, st = result
    out = {n: params[n].tobytes() for n in names}
    for key, buf in st.buffers.items():
        if key.split("/", 1)[1] in names:
            out[key] = backend.to_numpy(buf).tobytes()
    return out


@pytest.mark.parametrize("config", ["relative", "scaled_beta1_wd", "unfactored"])
def test_bits_do_not_depend_on_the_batch(config, monkeypatch):
    """A tensor's reductions are cut and ordered by its shape alone: its bits are the same stepped alone, in one
    batch, in a reversed batch with other tensors of both dtypes, and in two batches.  (The emulator also runs each
    launch's blocks and threads in a rotating order: forward, reverse, seeded random; tests/cuda_emu/emu.py.)"""
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    cp = backend.cupy()
    core = [x for x in LAYOUT if x[0] in ("f0", "f1", "f4", "f5", "f6", "f10", "d0", "d1", "d4")]
    extra = [("x0", (40, 33), np.float32), ("x1", (77,), np.float64), ("x2", (2, 9, 300), np.float32)]
    names = [n for n, _, _ in core]
    make = lambda: flatopt.Adafactor(**CONFIGS[config])  # noqa: E731
    ref = _bits(_run(cp, make(), core, _serial), names)

    def reversed_with_extra(opt, items):
        opt.step_batch(items[::-1])

    def two_batches(opt, items):
        opt.step_batch(items[1::2])
        opt.step_batch(items[0::2])

    for schedule, layout in ((_batch, core), (reversed_with_extra, core + extra), (two_batches, core + extra)):
        got = _bits(_run(cp, make(), layout, schedule), names)
        assert got.keys() == ref.keys()
        for key in ref:
            assert got[key] == ref[key], f"{schedule.__name__}: {key}"


def test_items_at_different_step_counts_in_one_batch(monkeypatch):
    """Names whose step counts differ form separate groups (β̂₂ and the relative step are per step count): the bits
    are those of serial steps."""
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    cp = backend.cupy()
    layout = LAYOUT[:4] + LAYOUT[-3:]

    def uneven(opt, items):
        if not opt.state_names():  # the first call: two names get a step of their own first
            _serial(opt, [items[0], items[-1]])
        opt.step_batch(items)

    def uneven_serial(opt, items):
        if not opt.state_names():
            _serial(opt, [items[0], items[-1]])
        _serial(opt, items)

    names = [n for n, _, _ in layout]
    assert _bits(_run(cp, flatopt.Adafactor(), layout, uneven), names) == \
        _bits(_run(cp, flatopt.Adafactor(), layout, uneven_serial), names)


def _items(cp, shapes, dtype=np.float32, seed=1):
    rng = np.random.default_rng(seed)
    return [OptItem(f"w{i}", s, cp.asarray(rng.standard_normal(_size(s)).astype(dtype)),
                    cp.asarray(rng.standard_normal(_size(s)).astype(dtype))) for i, s in enumerate(shapes)]


def _steady_state(opt, items, between=None):
    for _ in range(2):
        opt.step_batch(items)
    if between is not None:
        between(opt)
    fakecupy.stats.reset()
    ops = fakecupy.stats.ops
    with fakecupy.forbid_sync():
        opt.step_batch(items)
    return fakecupy.stats.launches, fakecupy.stats.ops - ops, fakecupy.stats.allocs, fakecupy.stats.syncs


@pytest.mark.parametrize("make, between", [
    (lambda: flatopt.Adafactor(), None),
    (lambda: flatopt.Adafactor(lr=1e-3, beta1=0.9, weight_decay=0.01, lr_scale=lambda n: 0.5 if "1" in n else 1.0),
     lambda opt: opt.set_lr(5e-4)),  # a schedule: the plan holds the lr_scales, not the lrs
], ids=["relative", "manual_set_lr"])
def test_76_tensors_launches_syncs_allocations(make, between, monkeypatch, gpu_device):
    """Issue #19's target for Adafactor on the 76 tensors: at most 24 launches per steady-state step (one launch per
    pass for the whole set: 6), no host synchronisation, no device allocation (the plan's tables and workspace are
    built once).  The benchmarks' layout (helpers.transformer_shapes), scaled down for the emulator."""
    if gpu_device != "emulated":
        pytest.skip("counted by the stand-in")
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    shapes = transformer_shapes(d=16, layers=6, vocab=64, ctx=32)
    assert len(shapes) == 76
    launches, ops, allocs, syncs = _steady_state(make(), _items(backend.cupy(), shapes), between)
    assert launches <= 24 and (launches, ops, allocs, syncs) == (6, 0, 0, 0)


def test_two_dtypes_two_groups(monkeypatch, gpu_device):
    if gpu_device != "emulated":
        pytest.skip("counted by the stand-in")
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    cp = backend.cupy()
    items = _items(cp, [(8, 5), (3,), (2, 4, 4)]) + [
        OptItem("d" + it.name, it.shape, it.param.astype(np.float64), it.grad.astype(np.float64))
        for it in _items(cp, [(9, 2), (5,)], seed=2)]
    emu.stats.by_kernel.clear()
    assert _steady_state(flatopt.Adafactor(), items) == (12, 0, 0, 0)  # 6 passes per dtype
    af = {k: v for k, v in emu.stats.by_kernel.items() if k.startswith("af_")}
    assert len(af) == 12 and set(af.values()) == {3}, af  # each pass once per dtype and step


def test_new_arrays_rebuild_the_plan(monkeypatch):
    """A batch with other arrays (a new param object for a name, fresh gradients) is stepped through its own table,
    never through the addresses of the previous arrays: the result is that of serial steps on the same arrays, and
    the previous param is not written."""
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    cp = backend.cupy()
    shapes = [(40, 30), (17,), (3, 5, 6)]
    opts = {mode: flatopt.Adafactor(beta1=0.9) for mode in ("batch", "serial")}
    first = {mode: _items(cp, shapes) for mode in opts}
    for mode, opt in opts.items():
        (_batch if mode == "batch" else _serial)(opt, first[mode])
    old = backend.to_numpy(first["batch"][0].param).copy()
    second = {mode: [OptItem(it.name, it.shape, it.param.copy() if it.name == "w0" else it.param,
                             it.grad * 0.5) for it in first[mode]] for mode in opts}
    for mode, opt in opts.items():
        (_batch if mode == "batch" else _serial)(opt, second[mode])
        (_batch if mode == "batch" else _serial)(opt, second[mode])
    assert backend.to_numpy(first["batch"][0].param).tobytes() == old.tobytes()
    for a, b in zip(second["batch"], second["serial"]):
        assert backend.to_numpy(a.param).tobytes() == backend.to_numpy(b.param).tobytes(), a.name


def test_plan_keeps_no_gradient_alive(monkeypatch):
    """The plan refers to params and grads weakly: a gradient dropped by the caller is freed, and the plan dies."""
    import gc
    import weakref

    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    items = _items(backend.cupy(), [(6, 5), (4,)])
    opt = flatopt.Adafactor()
    opt.step_batch(items)
    ref = weakref.ref(items[0].grad)
    plan = opt.plan_cache.family["adafactor.gpu"][("w0", "w1")]
    items[0] = items[0]._replace(grad=None)
    gc.collect()
    assert ref() is None and plan.dead

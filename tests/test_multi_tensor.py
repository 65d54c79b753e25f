"""Multi-tensor kernels (``core/multi_tensor.py``) of SGD, AdamW and the catalogue's elementwise algorithms (Adam,
NAdamW, RAdam, QHAdamW, Lion, Sophia; Lamb and Mars with their per-tensor norms) on the GPU path: on a real GPU
when one answers, else on the emulated device (``tests/cuda_emu``), as ``tests/test_gpu.py``.

* ``step_batch`` (one multi-tensor launch per (dtype, t) group) is bit-identical to ``step`` per item (the
  per-tensor kernel) and to the twin (``FLATOPT_FORCE_TWIN=1``): params and every state array, over mixed sizes
  (0 and 1 element, sizes on and across chunk boundaries), float32 and float64 in one batch, different lr_scales,
  items at different step counts, weight decay and non-default betas, RAdam across its rectification threshold,
  Sophia with Hessian estimates set between steps, Lamb and Mars over tensors of one and of many norm blocks; the
  tensors are views into one buffer with sentinel gaps, so a write outside a tensor's range through the table's
  addresses shows up;
* a steady-state step of the issue's workloads (76 tensors; 500 x 64) costs at most 4 launches (one per group, three
  for Lamb, Mars and a cautious mask; five for Mars's clip and mask, two reduction levels), no host synchronisation
  and no device allocation (counted by the stand-in).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from flatopt import OptItem
from flatopt.core import backend
from flatopt.core import multi_tensor as mt

from .cuda_emu import emu, fakecupy
from .helpers import transformer_shapes
from .registry import FLAG_SPACE, flag_cases

SCALES = {"t1": 0.5, "t3": 3.0, "t5": 1.5, "d2": 0.25, "d4": 0.7}
GAP = 7  # sentinel elements between two tensors of the shared buffer
SENTINEL = 12345.0


# the real GPU when one answers; otherwise CuPy is the stand-in and the kernels run on the emulator
gpu_device = pytest.fixture(scope="module", autouse=True)(fakecupy.device_or_emulated)


# every combination of each elementwise algorithm's flags (tests/registry.py), with a per-tensor lr_scale; the
# combination with every flag off also without one (no scale table)
CASES = flag_cases()
MAKERS = {cid: functools.partial(case.make, lr_scale=SCALES) for cid, case in CASES.items()}
MAKERS.update({f"{algo}-unscaled": CASES[algo].make for algo in FLAG_SPACE})


def _layout(chunk):
    """(name, size, dtype): float32 and float64 tensors around the chunk boundaries, 0 and 1 element."""
    f32 = [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 64, 5]
    f64 = [1, chunk + 1, 0, 3 * chunk - 1, 64]
    return [(f"t{i}", n, np.float32) for i, n in enumerate(f32)] + [(f"d{i}", n, np.float64) for i, n in enumerate(f64)]


def _buffers(cp, layout, seed):
    """Per dtype, one device buffer holding every tensor of that dtype with SENTINEL gaps; the views by name."""
    rng = np.random.default_rng(seed)
    out, whole = {}, {}
    for dt in (np.float32, np.float64):
        names = [(n, k) for n, k, d in layout if d is dt]
        total = sum(k for _, k in names) + GAP * (len(names) + 1)
        host = np.full(total, SENTINEL, dt)
        off = GAP
        spans = {}
        for n, k in names:
            host[off:off + k] = rng.standard_normal(k)
            spans[n] = (off, k)
            off += k + GAP
        dev = cp.asarray(host)
        whole[np.dtype(dt)] = (dev, spans)
        for n, (o, k) in spans.items():
            out[n] = dev[o:o + k]
    return out, whole


def _gaps_intact(whole):
    for dev, spans in whole.values():
        host = backend.to_numpy(dev)
        mask = np.ones(host.size, bool)
        for o, k in spans.values():
            mask[o:o + k] = False
        assert np.all(host[mask] == SENTINEL), "a write outside a tensor's range"


def _run(cp, kind, mode, chunk, monkeypatch, steps):
    monkeypatch.setattr(mt, "CHUNK", chunk)
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "1" if mode == "twin" else "0")
    layout = _layout(chunk)
    params, pwhole = _buffers(cp, layout, 0)
    opt = MAKERS[kind]()
    # two names step once on their own first: the batch then holds two step counts (two groups per dtype)
    for name in ("t2", "t4", "d1", "d3"):
        g = cp.asarray(np.random.default_rng(7).standard_normal(params[name].size).astype(params[name].dtype))
        opt.step(name, (params[name].size,), params[name], g)
    for k in range(steps):
        grads, gwhole = _buffers(cp, layout, 100 + k)
        items = [OptItem(n, (size,), params[n], grads[n]) for n, size, _ in layout]
        if mode == "single":
            for it in items:
                opt.step(*it)
        else:
            opt.step_batch(items)
        _gaps_intact(gwhole)
        if hasattr(opt, "update_hessian"):  # Sophia: a new Hessian estimate between steps (h updated in place)
            hess, _ = _buffers(cp, layout, 200 + k)
            for n, size, _ in layout:
                opt.update_hessian(n, (size,), hess[n] * hess[n])
    _gaps_intact(pwhole)
    st = opt.state_dict()
    return {n: backend.to_numpy(p) for n, p in params.items()}, st


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("chunk", [256, mt.CHUNK], ids=["chunk256", "chunk_default"])
def test_multi_tensor_bit_identical_to_per_tensor_kernel_and_twin(kind, chunk, monkeypatch, gpu_device):
    cp = backend.cupy()
    if gpu_device == "emulated":
        emu.stats.by_kernel.clear()
    case = CASES[kind.removesuffix("-unscaled")]
    steps = max(3, case.space.min_steps)  # batch steps: RAdam's rectification starts within them
    got = {mode: _run(cp, kind, mode, chunk, monkeypatch, steps) for mode in ("single", "batch", "twin")}
    if gpu_device == "emulated":
        multi = sum(v for k, v in emu.stats.by_kernel.items() if "_multi<" in k)
        # batch steps x (2 dtypes x 2 step counts) x the launches of a group
        assert multi == sum(2 * case.launches_at(t) for k in range(steps) for t in (k + 1, k + 2)), \
            emu.stats.by_kernel
    ref_p, ref_s = got["single"]
    for mode in ("batch", "twin"):
        p, s = got[mode]
        for n in ref_p:
            assert ref_p[n].tobytes() == p[n].tobytes(), f"{mode}: param {n}"
        assert sorted(s.buffers) == sorted(ref_s.buffers)
        for key in ref_s.buffers:
            assert backend.to_numpy(ref_s.buffers[key]).tobytes() == backend.to_numpy(s.buffers[key]).tobytes(), \
                f"{mode}: {key}"
        assert s.params == ref_s.params


def _workload(cp, shapes, dtype=np.float32):
    rng = np.random.default_rng(1)
    return [OptItem(f"w{i}", s, cp.asarray(rng.standard_normal(int(np.prod(s))).astype(dtype)),
                    cp.asarray(rng.standard_normal(int(np.prod(s))).astype(dtype))) for i, s in enumerate(shapes)]


# per algorithm and launch count (a norm or none), the case with the most flags on
RICHEST = {}
for _cid, _case in CASES.items():
    _key = (_case.algorithm, _case.launches)
    if _key not in RICHEST or len(_case.labels) > len(CASES[RICHEST[_key]].labels):
        RICHEST[_key] = _cid
RICHEST = sorted(RICHEST.values())


@pytest.mark.parametrize("kind", RICHEST)
# the benchmarks' 76-tensor layout scaled down for the emulator (d = 16), and many tiny tensors
@pytest.mark.parametrize("shapes", [transformer_shapes(d=16, layers=6, vocab=64, ctx=32), [(64,)] * 500],
                         ids=["76_tensors", "500x64"])
def test_steady_state_launches_syncs_allocations(kind, shapes, gpu_device):
    if gpu_device != "emulated":
        pytest.skip("counted by the stand-in")
    assert len(shapes) in (76, 500)
    cp = backend.cupy()
    items = _workload(cp, shapes)
    opt = MAKERS[kind]()
    for _ in range(2):
        opt.step_batch(items)
    fakecupy.stats.reset()
    ops = fakecupy.stats.ops
    with fakecupy.forbid_sync():
        opt.step_batch(items)
    launches = fakecupy.stats.launches + fakecupy.stats.ops - ops
    assert launches <= max(4, CASES[kind].launches), launches  # Mars's clip and mask: 2 levels, 5 launches
    assert fakecupy.stats.launches == CASES[kind].launches  # one dtype, one step count: one group
    assert fakecupy.stats.syncs == 0
    assert fakecupy.stats.allocs == 0


# weight_decay_mask on the GPU path: every elementwise kernel family, with and without the multi-tensor launch
WD_MAKERS = {cid: CASES[cid].make for cid in RICHEST if "wd" in CASES[cid].labels}
NO_DECAY = {"t1", "t3", "t5", "d1", "d4"}  # two or more per dtype: both parts of a batch take a multi-tensor launch


@pytest.mark.parametrize("kind", sorted(WD_MAKERS))
def test_weight_decay_mask_on_the_gpu_path(kind, monkeypatch, gpu_device):
    """An excluded name steps on the device exactly as with ``weight_decay=0`` and the others as without a mask:
    by ``step_batch`` (multi-tensor launches) and by ``step`` (the per-tensor kernel)."""
    cp = backend.cupy()
    monkeypatch.setattr(mt, "CHUNK", 256)
    layout = _layout(256)
    got = {}
    for key, kw, single in [("batch", {"weight_decay_mask": {n: False for n in NO_DECAY}}, False),
                            ("single", {"weight_decay_mask": lambda n: n not in NO_DECAY}, True),
                            ("plain", {}, False), ("no_decay", {"weight_decay": 0.0}, False)]:
        params, _ = _buffers(cp, layout, 0)
        opt = WD_MAKERS[kind](**kw)
        if gpu_device == "emulated":
            emu.stats.by_kernel.clear()
        for k in range(2):
            grads, _ = _buffers(cp, layout, 100 + k)
            items = [OptItem(n, (size,), params[n], grads[n]) for n, size, _ in layout]
            if single:
                for it in items:
                    opt.step(*it)
            else:
                opt.step_batch(items)
            if hasattr(opt, "update_hessian"):
                for n, size, _ in layout:
                    opt.update_hessian(n, (size,), grads[n] * grads[n])
        got[key] = {n: backend.to_numpy(p) for n, p in params.items()}
        if gpu_device == "emulated" and key == "batch":  # 2 steps x 2 dtypes x (with, without decay)
            multi = sum(v for k, v in emu.stats.by_kernel.items() if "_multi<" in k)
            assert multi == sum(4 * CASES[kind].launches_at(t) for t in (1, 2)), emu.stats.by_kernel
    for key in ("batch", "single"):
        for n, _, _ in layout:
            ref = got["no_decay" if n in NO_DECAY else "plain"][n]
            assert ref.tobytes() == got[key][n].tobytes(), f"{key}: {n}"
    assert any(got["plain"][n].tobytes() != got["no_decay"][n].tobytes() for n in NO_DECAY)


@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=["f32", "f64"])
def test_the_generated_table_marks_16_byte_aligned_tensors(dt, gpu_device):
    """The generated kernels' table has a last column per tensor: 1 where every address of the row is 16-byte
    aligned (their vector path), else 0.  Emulated: a flag set on a misaligned tensor fails the launch, so the
    kernel reads the flag and the emulator checks the alignment of every vector access."""
    import types

    import flatopt

    cp = backend.cupy()
    cfg = flatopt.adamw.AdamWConfig()
    spec = flatopt.AdamW.multi_tensor
    buf = cp.zeros(3000, dt)
    grads = cp.ones(3000, dt)
    offsets = [0, 1, 2, 4, 1000]  # elements: 16-byte aligned for float32 at 0, 4, 1000; for float64 at 0, 2, 4, 1000
    members = []
    for k, off in enumerate(offsets):
        p, g = buf[off:off + 300 + k], grads[off:off + 300 + k]
        st = flatopt.AdamW.init_fn(cp, cfg, (p.size,), dt)
        members.append((p, g, types.SimpleNamespace(state=st), 1.0))
    group = mt.Group(spec, members, 256)
    ncol = 3 + len(spec.arrays(members[0][2].state, members[0][0])) + 1
    table = backend.to_numpy(group.tensors).reshape(len(members), ncol)
    per_element = np.dtype(dt).itemsize
    assert table[:, -1].tolist() == [int(off * per_element % 16 == 0) for off in offsets]
    assert table[:, -2].tolist() == [300 + k for k in range(len(offsets))]
    group.launch(cfg, 1, 1e-3)
    if gpu_device == "emulated":
        group.tensors[ncol * 1 + ncol - 1] = 1  # tensor 1 starts 4 or 8 bytes past a 16-byte boundary
        with pytest.raises(emu.EmulatorError, match="misaligned"):
            group.launch(cfg, 2, 1e-3)

"""The GPU-path defects of issue #18 (``../shared/reference/gpu-audit.md`` §1.4, §3), each pinned without a GPU:
through the NumPy stand-in of CuPy (``tests/fake_device.py``), CuPy's installed Python API (it imports without a
GPU), and the host-side logic of the CuPy execution (streams and events recorded by a small fake).  The kernels
themselves are compared with their twins by ``tests/test_gpu.py`` (on a GPU, or on the emulator)."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

import flatopt
from flatopt.core import backend as _backend

from . import fake_device
from .helpers import rng_arrays
from .test_device_paths import XP, _device_steps, _numpy_steps


@pytest.fixture(autouse=True)
def _twins(monkeypatch):
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "1")  # no CUDA kernels on the stand-in


# ------------------------------------------------------------------------------------------ D3: einsum(out=)
def test_the_stand_in_rejects_einsum_out():
    """cupy.einsum takes dtype= and optimize= only (tests/cuda_emu/cupy_api.py reads them from the installed CuPy)."""
    with pytest.raises(TypeError):
        XP.einsum("i,i->", XP.ones(2), XP.ones(2), out=XP.empty(()))


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (24, 24)])
def test_apollo_steps_on_the_device_branch_for_every_orientation(shape):
    """rows ≥ cols ("right") measured G's channel norms with ``einsum(out=)``: TypeError at step 1 on CuPy."""
    cfg = dict(apollo_rank=4, enable_fira_for_apollo=True, min_8bit_size=0, block_size=128, m_block_size=32,
               use_cuda_kernel=False, groups=[("*", {})])
    params = {"w": (shape, rng_arrays(0, shape, scale=0.1))}
    dev = _device_steps(flatopt.Adafactor8Bit(**cfg), params, 2, np.float32)
    host = _numpy_steps(flatopt.Adafactor8Bit(**cfg), params, 2)
    assert np.all(np.isfinite(dev["w"]))
    assert dev["w"].shape == host["w"].shape


# ------------------------------------------------------------------ D2, D4: the 8-bit state kernels' twin
def _a8_state(xp, fmt="uf8", n=300):
    opt = flatopt.Adafactor8Bit(lr=1e-3, relative_step=False, beta1=0.9, min_8bit_size=0, block_size=128,
                                m_block_size=32, m_quant_type=fmt)
    return opt.hooks.init("w", xp, (n,), np.dtype(np.float32))


def _stored(st):
    return {k: np.asarray(v).copy() for k, v in vars(st).items()
            if k.endswith(("_q", "_scale", "_min_log")) and v is not None}


def _ema(xp, st, slot, x, step):
    from flatopt.adafactor8bit import state as S

    if slot == "variance":  # the second moment: x², as the elementwise path feeds it (first step: x²·w)
        return S.ema(xp, st, slot, x, 0.001, floor=-126.0, square=True, first=step == 0)
    return S.ema(xp, st, slot, x, 0.1, floor=0.0)


@pytest.mark.parametrize("xp", [np, XP], ids=["numpy", "device"])
@pytest.mark.parametrize("slot", ["variance", "m"])
def test_a8_state_rounds_a_float64_sample_to_float32_first(xp, slot):
    """The fused kernels load x as ``(float)x[idx]`` and then square / interpolate in float32: the twin must round
    at the same point (it rounded after the float64 square or difference: other codes for float64 parameters)."""
    a, b = _a8_state(xp), _a8_state(xp)
    rng = np.random.default_rng(3)
    for step in range(3):
        x64 = rng.standard_normal(300) * np.exp(rng.uniform(-6, 6, 300))
        va = _ema(xp, a, slot, xp.asarray(x64), step)
        vb = _ema(xp, b, slot, xp.asarray(x64.astype(np.float32)), step)
        np.testing.assert_array_equal(np.asarray(va).view(np.uint32), np.asarray(vb).view(np.uint32))
    sa, sb = _stored(a), _stored(b)
    for k in sa:
        np.testing.assert_array_equal(sa[k].view(np.uint8), sb[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("xp", [np, XP], ids=["numpy", "device"])
def test_a8_al_state_of_a_block_with_a_nan(xp):
    """One documented behaviour (kernels/adafactor8bit.cu, quant.py): NaN propagates to its block's statistics,
    exact zeros keep code 0, every other value of the block gets code 1; the other blocks are untouched."""
    import warnings

    st = _a8_state(xp)
    x = np.random.default_rng(0).uniform(0.5, 2.0, 300).astype(np.float32)
    x[5], x[7] = np.nan, 0.0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "invalid value encountered in cast")  # no NaN cast into a code
        _ema(xp, st, "variance", xp.asarray(x), 0)
    s = _stored(st)
    assert np.isnan(s["variance_scale"][0]) and np.isnan(s["variance_min_log"][0])
    want = np.ones(128, np.uint8)
    want[7] = 0
    np.testing.assert_array_equal(s["variance_q"][:128], want)
    assert np.all(np.isfinite(s["variance_scale"][1:])) and np.all(s["variance_q"][128:300] > 0)


@pytest.mark.parametrize("xp", [np, XP], ids=["numpy", "device"])
@pytest.mark.parametrize("fmt", ["uf8", "uf4", "d8", "d4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a8_signed_state_of_a_block_with_a_nonfinite_value(xp, fmt, bad):
    """A block whose absmax is not finite keeps it and is encoded as zeros (the fresh state's codes), so the whole
    block decodes as NaN; the kernel stored a NaN as code 0 = −absmax, NumPy cast NaN into a code."""
    import warnings

    from flatopt.adafactor8bit import quant

    st = _a8_state(xp, fmt)
    fresh = _stored(_a8_state(np, fmt))["m_q"]
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    x[40] = bad  # block 1 of 32
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "invalid value encountered in cast")
        _ema(xp, st, "m", xp.asarray(x), 0)
    s = _stored(st)
    am = s["m_scale"]
    assert not np.isfinite(am[1]) and (np.isnan(am[1]) == np.isnan(bad)) and np.all(np.isfinite(np.delete(am, 1)))
    per = 2 if fmt in ("uf4", "d4") else 1
    np.testing.assert_array_equal(s["m_q"][32 // per:64 // per], fresh[32 // per:64 // per])
    out = np.empty(300, np.float32)
    quant.m_decode(np, s["m_q"], am, out, mblock=32, fmt=fmt)
    assert np.all(np.isnan(out[32:64])) and np.all(np.isfinite(np.delete(out, np.s_[32:64])))


# ------------------------------------------------------- the quantization map's upload, ordered on every stream
def test_a_device_constant_is_ordered_before_its_reads_on_every_stream(monkeypatch):
    """quant.qmap (then _qmap) uploaded the map on whatever stream was current (a worker's non-blocking stream) with
    no event for the other workers' kernels, into an unlocked dict.  Now: one upload (under a lock) on its own stream,
    an event recorded after it, and every read makes the reading stream wait for that event."""
    import threading

    from flatopt.adafactor8bit import quant

    monkeypatch.setattr(_backend, "_constants", {})
    xp = fake_device.FakeDevice()
    calls = []
    real_asarray = np.asarray

    def asarray(a, *args, **kw):  # the stand-in's upload, counted
        calls.append(fake_device._Cuda.get_current_stream())
        return fake_device._wrap(real_asarray(a, *args, **kw))

    xp.asarray = asarray
    a, b = xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True)
    barrier, got = threading.Barrier(4), []

    def worker(stream):
        barrier.wait()
        with stream:
            got.append(quant.qmap(xp, 8))

    threads = [threading.Thread(target=worker, args=(s,)) for s in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and calls[0] not in (a, b)  # one upload, on a stream of its own
    (upload,) = [c for c in calls[0].calls if c[0] == "record"]
    assert all(g is got[0] for g in got)
    np.testing.assert_array_equal(np.asarray(got[0]), quant.dynamic_map(8))
    for s in (a, b):  # every read waited for the upload's event on its stream
        assert s.calls == [("wait", upload[1])] * 2


# ------------------------------------------------------------- D5: test_cupy_matches_numpy's tolerance
@pytest.mark.parametrize("name, eps", [("adafactor8bit", np.float32), ("adafactor8bit_adam_d8_fira", np.float32),
                                       ("kron_psgd", np.float32), ("adamw", np.float64), ("adafactor", np.float64)])
def test_the_cupy_vs_numpy_tolerance_follows_the_state_dtype(name, eps):
    """test_gpu's CuPy-vs-NumPy bound is 4 ulps per step in the coarser of the parameter's and the state's float
    dtypes (it was the parameter's: a float64 bound for optimizers that keep float32 state)."""
    from .helpers import make_for, make_params, run_steps
    from .registry import REGISTRY
    from .test_gpu import STEPS, _tol

    spec = REGISTRY[name]
    host = make_params(spec.shapes, np.float64)
    opt = make_for(spec, host)
    run_steps(opt, host, 1)
    p = np.ones(3)
    assert _tol(np.float64, p, opt.state_dict()) == 4 * STEPS * float(np.finfo(eps).eps)


# ------------------------------------------------- D6: one APOLLO projection for NumPy and the device
@pytest.mark.parametrize("block", [1 << 16, 4097, 100])
def test_apollo_projection_is_the_same_on_numpy_and_the_device(block, monkeypatch):
    """The default P is a function of (seed, shape): the device draw (one piece) and NumPy's (blocks on threads,
    any cut) give the same bits; it was CuPy's RandomState on the device and Box–Muller on NumPy."""
    import math

    from flatopt.adafactor8bit import apollo_proj
    from flatopt.core import parallel

    monkeypatch.setattr(apollo_proj, "PROJ_BLOCK", block)

    class St:
        proj = None
        current_proj_seed = 2**63 + 12345  # any integer (a 64-bit one too)

    def prepare(xp, shape, right):
        rank = shape[0] if right else shape[1]
        pt, jobs = apollo_proj.ApolloProjector().prepare(xp, St(), rank, *((10**6, shape[1]) if right else
                                                                           (shape[0], 10**6)), right, True)
        parallel.run_beside_tasks(lambda: None, jobs) if xp is np else [j() for j in jobs]
        return np.array(np.asarray(pt).T) * np.float32(math.sqrt(rank))

    for shape, right in (((64, 4099), True), ((3001, 7), False)):
        a, b = prepare(np, shape, right), prepare(XP, shape, right)
        assert a.shape == shape and a.dtype == np.float32
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        z = a.ravel().astype(np.float64)
        se = 1 / math.sqrt(z.size)
        assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se and np.abs(z).max() < 4.33


def test_apollo_checkpoint_moves_from_the_device_to_numpy(tmp_path):
    """Two steps of the device twin (the stand-in), the snapshot saved and loaded on NumPy, two more steps there:
    within the device-path tolerance of four NumPy steps, with the default projection (no injected P; with another
    P on the device the continuation was off by the whole update)."""
    from flatopt.core import slots as slotlib

    from .helpers import grads_for, make_params, run_steps
    from .registry import REGISTRY
    from .test_device_paths import _compare

    spec = REGISTRY["adafactor8bit_apollo_came"]
    params = make_params(spec.shapes)
    ref = {n: (s, p.copy()) for n, (s, p) in params.items()}
    run_steps(spec.make(), ref, 4)

    opt = spec.make()  # the device steps by hand, as test_device_paths (the driver's state and count kept here)
    dev = {n: (s, XP.asarray(p.copy())) for n, (s, p) in params.items()}
    states = {}
    for it in range(2):
        grads = grads_for(params, it)
        for n, (s, p) in sorted(dev.items()):
            if n not in states:
                states[n] = opt.hooks.init(n, XP, s, np.dtype(np.float32))
            opt.hooks.update(XP, states[n], p, XP.asarray(grads[n]), t=it + 1, lr=opt.hooks.effective_lr(opt.lr_scale(n)),
                        scratch=[XP.empty_like(p) for _ in range(opt.scratch_buffers)])
        opt.end_iteration()
    for n, st in states.items():  # the device state as the driver would snapshot it
        for f, v in vars(st).items():
            if isinstance(v, np.ndarray):
                setattr(st, f, np.array(v))
        st.proj = st.work = None
        opt._slots[n] = slotlib.Slot(shape=dev[n][0], dtype=np.dtype(np.float32), backend="numpy", t=2, state=st)
    flatopt.save(tmp_path / "dev.npz", opt)

    host = {n: (s, XP.asnumpy(p)) for n, (s, p) in dev.items()}
    opt_h = spec.make()
    assert opt_h.load_state_dict(flatopt.load(tmp_path / "dev.npz"))
    run_steps(opt_h, host, 2, start=2)
    _compare({n: p for n, (_, p) in host.items()}, {n: p for n, (_, p) in ref.items()}, "came")


# ------------------------------------------------------------ a step_batch over several GPUs: joined per device
class _MultiGpu:
    """CuPy's device and stream model, recorded: the current device is per thread, the current stream per thread
    and per device (a device's default stream unless a stream of that device was entered)."""

    def __init__(self):
        self.tls = threading.local()
        self.log = []
        self.lock = threading.Lock()
        gpu = self

        class Event:
            def __init__(self, stream):
                self.stream = stream

        class Stream:
            def __init__(self, non_blocking=False, null=False, device=None):
                self.device = gpu.current_device() if device is None else device
                self.null, self.non_blocking = null, non_blocking

            def __enter__(self):
                assert gpu.current_device() == self.device, "a stream entered on another device"
                gpu.stack(self.device).append(self)
                return self

            def __exit__(self, *exc):
                gpu.stack(self.device).pop()

            def record(self):
                ev = Event(self)
                gpu.note("record", self, ev)
                return ev

            def wait_event(self, ev):
                gpu.note("wait", self, ev)

        class Device:
            def __init__(self, i):
                self.id = i

            def __enter__(self):
                gpu.devices().append(self.id)
                return self

            def __exit__(self, *exc):
                gpu.devices().pop()

        self.Device, self.Stream = Device, Stream
        self.null = {i: Stream(null=True, device=i) for i in range(2)}
        self.cuda = self

    def note(self, *what):
        with self.lock:
            self.log.append(what)

    def devices(self):
        if not hasattr(self.tls, "dev"):
            self.tls.dev = [0]
        return self.tls.dev

    def current_device(self):
        return self.devices()[-1]

    def stack(self, dev):
        if not hasattr(self.tls, "streams"):
            self.tls.streams = {0: [], 1: []}
        return self.tls.streams[dev]

    def get_current_stream(self):
        s = self.stack(self.current_device())
        return s[-1] if s else self.null[self.current_device()]


def test_a_batch_on_two_gpus_is_ordered_on_each(monkeypatch):
    """Every item of a multi-item batch runs on a worker stream of its own device that waited for the caller's
    event on that device, and the caller's stream of each device waits for those workers' final events (items on
    the second GPU ran on its default stream, outside the events)."""
    from flatopt import OptItem
    from flatopt.core import gpu_run, parallel

    gpu = _MultiGpu()
    monkeypatch.setattr(_backend, "_cupy", gpu)
    monkeypatch.setattr(gpu_run, "_tls", threading.local())
    monkeypatch.setattr(parallel, "PARALLEL_MIN_COST", 0)
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", "0")
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "2")
    ran = {}

    class Param:
        size = 10

        def __init__(self, dev):
            self.device = gpu.Device(dev)

    def kernel_update(state, param, grad, *, t, lr):
        ran[state] = (gpu.current_device(), gpu.get_current_stream())
        return True

    class Opt:
        scratch_buffers = 0
        hooks = types.SimpleNamespace(kernel_batch=None, kernel_update=kernel_update, update=None)

    class Slot:
        def __init__(self, name):
            self.state, self.t = name, 1

    items = [(OptItem(f"w{i}", (10,), Param(i % 2), None), Slot(f"w{i}"), 1.0) for i in range(6)]
    gpu_run.run_gpu(Opt(), items)
    assert sorted(ran) == [f"w{i}" for i in range(6)]
    starts = {s.device: ev for op, s, ev in gpu.log if op == "record" and s.null}
    assert sorted(starts) == [0, 1]  # one start event per device, on its caller stream
    finals = {}
    for op, s, ev in gpu.log:
        if op == "record" and not s.null:
            finals.setdefault(s.device, []).append(ev)
    for name, (dev, stream) in ran.items():
        assert dev == int(name[1:]) % 2 and stream.device == dev and not stream.null, name
        assert ("wait", stream, starts[dev]) in gpu.log, name  # after the gradients, on its device
        assert any(ev.stream is stream for ev in finals[dev]), name  # its work joins back ...
    for dev, evs in finals.items():
        for ev in evs:  # ... into the caller's stream of that device
            assert ("wait", gpu.null[dev], ev) in gpu.log


# ------------------------------------------------------------------------------- cached kernel objects
def test_a_kernel_object_is_built_once_per_kernel_dtype_and_device(monkeypatch):
    """core.kernels.get called RawModule.get_function (a new RawKernel, the function resolved again) on every
    launch.  Now once per (file, kernel, dtype, device), also when threads ask at once."""
    from flatopt.core import kernels

    built = []

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.names = list(name_expressions)

        def get_function(self, name):
            assert name in self.names
            built.append((name, dev.id))
            return object()

    class Device:
        id = 0

        def __init__(self, *_):
            pass

    dev = Device
    fake = type("cp", (), {"RawModule": RawModule, "cuda": type("cuda", (), {"Device": Device})})
    monkeypatch.setattr(_backend, "_cupy", fake)
    monkeypatch.setattr(_backend, "_modules", {})
    warm = len(kernels.name_expressions("generated/adamw.cu"))  # the module compiles every name once at creation
    barrier, got = threading.Barrier(4), []

    def worker():
        barrier.wait()
        for _ in range(50):
            got.append(kernels.get("generated/adamw.cu", "adamw_f0_step", np.float32))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(k) for k in got}) == 1
    assert len(built) == warm + 1
    assert kernels.get("generated/adamw.cu", "adamw_f0_step", np.float64) is not got[0] and len(built) == warm + 2
    Device.id = 1  # another device: its own module and kernel
    k1 = kernels.get("generated/adamw.cu", "adamw_f0_step", np.float32)
    assert k1 is not got[0] and built[-1] == ("adamw_f0_step<float>", 1)

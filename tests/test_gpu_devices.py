"""Several GPUs in one process, and stream ordering, on the CuPy stand-in (``tests/cuda_emu``: two devices without
peer access, a launch or operation given memory of another device than the current one fails, and a happens-before
race detector over every kernel and CuPy operation).

* H1 (``shared/reference/gpu-review.md``): every registry optimizer steps a batch whose parameters live on device 1
  while device 0 is current, bit for bit as on device 0, with every state array (scratch included) on device 1; a
  parameter given on another device than its state is refused before anything changes.
* S1: an item that raises inside a ``step_batch`` worker still joins the other workers' streams into the caller's.
* L4: the per-thread workspace is per stream.
* The streams test and the error paths run under the race detector with 0 hazards, and removing any one of flatopt's
  waits makes the detector report hazards while the results stay bit-identical.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flatopt import OptItem
from flatopt.core import backend

from .cuda_emu import emu, fakecupy
from .helpers import assert_bits_equal, grads_for, make_for, make_params, step_items
from .registry import REGISTRY

NAMES = sorted(REGISTRY)


@pytest.fixture(scope="module", autouse=True)
def stand_in():
    """Always the stand-in (its two devices and its race detector), also where a real GPU answers."""
    why = emu.available()
    if why:
        pytest.skip(why)
    with fakecupy.installed() as cp:
        yield cp


def _on(params, device):
    cp = backend.cupy()
    with cp.cuda.Device(device):
        return {n: (s, cp.asarray(p)) for n, (s, p) in params.items()}


def _steps(opt, params, steps, *, batch=True, start=0):
    """``steps`` iterations, each gradient on its parameter's device (the current device stays what it is)."""
    cp = backend.cupy()
    for it in range(start, start + steps):
        host = grads_for(_shapes(params), it)
        grads = {}
        for n, g in host.items():
            with params[n][1].device:
                grads[n] = cp.asarray(g)
        step_items(opt, [OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())], batch)


def _shapes(params):
    """What ``grads_for`` reads of the parameters (shape and dtype; no device-to-host copy)."""
    return {n: (s, np.empty(0, p.dtype)) for n, (s, p) in params.items()}


def _state_devices(opt):
    devs = set()
    parts = (opt.muon, opt.adamw) if hasattr(opt, "muon") else (opt,)  # MuonAdamW composes two
    for slot in (s for o in parts for s in o._slots.values()):  # noqa: SLF001
        for f in dataclasses.fields(slot.state):
            v = getattr(slot.state, f.name)
            if backend.is_cupy_array(v):
                devs.add(v.device.id)
    return devs


# ---------------------------------------------------------------------------------------------------------------- H1
@pytest.mark.parametrize("name", NAMES)
def test_a_batch_on_device_1_steps_as_on_device_0(name):
    """States, scratch, workspaces and tables of a device-1 batch are made on device 1 although device 0 is current
    (before: on device 0, so the first fused launch or CuPy operation got memory of the other device)."""
    spec = REGISTRY[name]
    base = make_params(spec.shapes)
    ref, dev1 = _on(base, 0), _on(base, 1)
    opt0, opt1 = make_for(spec, ref), make_for(spec, dev1)
    for opt, params in ((opt0, ref), (opt1, dev1)):
        _steps(opt, params, 2)  # batches (multi-tensor groups, worker streams, segmented plans)
        _steps(opt, params, 1, batch=False, start=2)  # one item at a time
    assert backend.cupy().cuda.Device().id == 0
    for n in base:
        assert dev1[n][1].device.id == 1
        assert_bits_equal(ref[n][1], dev1[n][1], n)
    assert _state_devices(opt1) <= {1} and _state_devices(opt0) <= {0}  # (SGD without momentum, Stiefel: none)


@pytest.mark.parametrize("name", NAMES)
def test_a_parameter_on_another_device_than_its_state_is_refused(name):
    spec = REGISTRY[name]
    base = make_params(spec.shapes)
    params = _on(base, 0)
    opt = make_for(spec, params)
    _steps(opt, params, 1)
    before = opt.state_dict()
    moved = _on({n: (s, backend.to_numpy(p)) for n, (s, p) in params.items()}, 1)
    first = sorted(moved)[0]
    mixed = dict(params, **{first: moved[first]})  # one parameter now on device 1, its state on device 0
    kept = {n: backend.to_numpy(p).copy() for n, (_, p) in mixed.items()}
    with fakecupy.race_detector() as det:  # (an error path: nothing queued, nothing racing)
        with pytest.raises(ValueError, match=rf"parameter '{first}'.*GPU 1.*GPU 0"):
            _steps(opt, mixed, 1)
        for n, (_, p) in mixed.items():
            assert_bits_equal(p, kept[n], n)
        after = opt.state_dict()
    assert det.hazards == []
    assert after.params == before.params
    for k in before.buffers:
        assert_bits_equal(after.buffers[k], before.buffers[k], k)


# ------------------------------------------------------------------------------------------ streams: race detector
@pytest.fixture
def workers(monkeypatch):
    """Several worker threads (streams) even for the small tensors of these tests."""
    from flatopt.core import parallel

    monkeypatch.setattr(parallel, "PARALLEL_MIN_COST", 0)
    monkeypatch.setenv("FLATOPT_NUM_THREADS", "3")


def _mixed(params):
    """Every other parameter on device 1 (the batch spans both devices)."""
    cp = backend.cupy()
    out = {}
    for i, (n, (s, p)) in enumerate(sorted(params.items())):
        with cp.cuda.Device(i % 2):
            out[n] = (s, cp.asarray(p))
    return out


def _host(params):
    return {n: backend.to_numpy(p) for n, (_, p) in params.items()}  # device-to-host copies on the caller's stream


@pytest.mark.parametrize("twin", ["0", "1"], ids=["kernels", "twins"])
@pytest.mark.parametrize("name", NAMES)
def test_step_batch_on_worker_streams_has_no_hazard(name, twin, workers, monkeypatch):
    """The streams test under the race detector, over a batch on two devices: every access of the workers' kernels
    and CuPy operations is ordered after the caller's gradients and before the caller's next work (and the bits are
    the serial loop's)."""
    monkeypatch.setenv("FLATOPT_FORCE_TWIN", twin)
    spec = REGISTRY[name]
    base = make_params(spec.shapes * 2)
    ref, got = _mixed(base), _mixed(base)
    _steps(make_for(spec, ref), ref, 2, batch=False)
    with fakecupy.race_detector() as det:
        _steps(make_for(spec, got), got, 2)
        out = _host(got)
    assert det.hazards == [], [str(h) for h in det.hazards[:5]]
    for n in base:
        assert_bits_equal(out[n], ref[n][1], n)


# flatopt's waits: the worker stream waits for the caller's event (the gradients are ready), the caller's stream
# waits for every worker's final event, a stream reading a device constant waits for its upload
WAITS = {"worker waits for the caller": ("core/gpu_run.py", "on_worker"),
         "caller joins the workers": ("core/gpu_run.py", "run_gpu"),
         "reader waits for the constant's upload": ("core/backend.py", "device_constant")}


def _without_wait(site, monkeypatch) -> list:
    """``Stream.wait_event`` does nothing when called from ``site`` (file, function); returns the skipped calls."""
    import sys

    real = fakecupy.Stream.wait_event
    skipped = []

    def wait_event(self, event):
        code = sys._getframe(1).f_code  # noqa: SLF001
        if code.co_filename.replace("\\", "/").endswith(site[0]) and code.co_name == site[1]:
            skipped.append(code.co_name)
            return None
        return real(self, event)

    monkeypatch.setattr(fakecupy.Stream, "wait_event", wait_event)
    return skipped


@pytest.mark.parametrize("wait", WAITS)
def test_removing_any_wait_makes_hazards_that_the_bits_do_not_show(wait, workers, monkeypatch):
    """Adafactor8Bit's fused steps on worker streams read the gradients, write the parameters and read the
    quantization maps (device constants): each of flatopt's waits orders some of it.  Without it the results are
    still bit-identical here (the stand-in runs everything in issue order), and only the detector sees the race."""
    monkeypatch.setattr(backend, "_constants", {})  # uploaded inside the detector
    spec = REGISTRY["adafactor8bit"]
    base = make_params(spec.shapes * 2)
    ref, got = _on(base, 0), _on(base, 0)
    _steps(make_for(spec, ref), ref, 2)
    with fakecupy.race_detector() as clean:
        _steps(make_for(spec, _on(base, 0)), _on(base, 0), 1)
    assert clean.hazards == []
    monkeypatch.setattr(backend, "_constants", {})
    skipped = _without_wait(WAITS[wait], monkeypatch)
    with fakecupy.race_detector() as det:
        _steps(make_for(spec, got), got, 2)
        out = _host(got)
    assert skipped, "the wait was never reached"
    assert det.hazards, "no hazard without the wait"
    for n in base:
        assert_bits_equal(out[n], ref[n][1], n)


# ---------------------------------------------------------------------------------------------------------------- S1
def test_a_failing_item_still_joins_the_other_workers(workers):
    """A probe hook that returns a wrong shape for one parameter raises inside its worker; the kernels the other
    workers queued still run, and the caller's stream must wait for them (before: the join was skipped, and the
    caller's next work, here reading the parameters back, raced with them)."""
    import flatopt

    def probe(name, shape, index):
        return np.ones((3,), np.float32) if name == "p2" else np.ones(shape, np.float32)

    base = make_params([(6, 5)] * 5)
    params = _on(base, 0)
    opt = flatopt.KronPsgd(lr=0.03, probe=probe)
    with fakecupy.race_detector() as det:
        with pytest.raises(Exception, match="probe for 'p2' must have shape"):
            _steps(opt, params, 1)
        _host(params)
    assert det.hazards == [], [str(h) for h in det.hazards[:5]]


# ---------------------------------------------------------------------------------------------------------------- L4
@pytest.mark.parametrize("name", ["adafactor8bit", "adafactor8bit_apollo_came", "kron_psgd"])
def test_one_thread_stepping_on_two_streams_shares_no_scratch(name):
    """One parameter stepped on stream A, the next on stream B (independent parameters, no order between the two
    streams, one thread): the per-thread workspace gave B the buffers A's queued kernels were still using."""
    cp = backend.cupy()
    spec = REGISTRY[name]
    base = make_params([(40, 24), (24, 40)])
    ref, got = _on(base, 0), _on(base, 0)
    _steps(make_for(spec, ref), ref, 2, batch=False)
    opt = make_for(spec, got)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with fakecupy.race_detector() as det:
        for it in range(2):
            host = grads_for(_shapes(got), it)
            for (n, (s, p)), stream in zip(sorted(got.items()), (a, b)):
                with stream:
                    opt.step(n, s, p, cp.asarray(host[n]))
                    ev = stream.record()
            opt.end_iteration()
            a.wait_event(ev)  # the next iteration's stream A after B's step (each parameter stays on its stream)
        for s in (a, b):
            s.synchronize()
        out = _host(got)
    assert det.hazards == [], [str(h) for h in det.hazards[:5]]
    for n in base:
        assert_bits_equal(out[n], ref[n][1], n)


# ------------------------------------------------------------------------------------------ the detector itself
def _hazards(body) -> int:
    with fakecupy.race_detector() as det:
        body()
    return len(det.hazards)


def test_the_detector_orders_by_streams_events_and_host_syncs():
    cp = backend.cupy()
    x = cp.zeros(1000, cp.float32)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    def write(s, v=x):
        with s:
            v.fill(1.0)

    def read(s, v=x):
        with s:
            cp.sum(v)

    assert _hazards(lambda: (write(a), read(b))) == 1  # read-write on two streams, unordered
    assert _hazards(lambda: (read(a), write(b))) == 1  # write-read
    assert _hazards(lambda: (write(a), write(b))) == 1  # write-write
    assert _hazards(lambda: (read(a), read(b))) == 0  # reads never conflict
    assert _hazards(lambda: (write(a), write(a), read(a))) == 0  # one stream is a sequence
    assert _hazards(lambda: (write(a, x[:500]), write(b, x[500:]))) == 0  # disjoint bytes

    def event():
        write(a)
        b.wait_event(a.record())
        read(b)

    def event_too_early():
        ev = a.record()
        write(a)
        b.wait_event(ev)
        read(b)

    assert _hazards(event) == 0 and _hazards(event_too_early) == 1
    for sync in (lambda ev: a.synchronize(), lambda ev: ev.synchronize(), lambda ev: cp.cuda.Device(0).synchronize(),
                 lambda ev: x.get(stream=a)):
        def host(sync=sync):
            write(a)
            sync(a.record())
            read(b)

        assert _hazards(host) == 0
    # CuPy's null stream is the legacy default stream: ordered with blocking streams, not with non-blocking ones
    blocking = cp.cuda.Stream()
    null = cp.cuda.Stream.null
    assert _hazards(lambda: (write(null), read(blocking))) == 0
    assert _hazards(lambda: (write(blocking), read(null))) == 0
    assert _hazards(lambda: (write(null), read(a))) == 1
    assert _hazards(lambda: (write(a), read(null))) == 1
    # each device has its own null stream
    with cp.cuda.Device(1):
        y = cp.zeros(10, cp.float32)
        s1 = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.Device(1):
        assert _hazards(lambda: (write(null, y), read(s1, y))) == 1


def test_the_detector_models_the_stream_ordered_pool():
    """CuPy 14.2's pool hands a freed block back to the stream it was allocated on without any ordering: a kernel of
    another stream still reading it races with the new owner's first write; another stream never gets that block."""
    from .cuda_emu.hazards import Detector

    det = Detector()
    det.stream(1, 0, "nonblocking")
    det.stream(2, 0, "nonblocking")

    def run(reuser):
        det.reset()
        det.allocated(1, 0x1000, 0x2000, stream=1)
        det.access(1, [(1, 0x1000, 0x2000, True)], "fill on A")  # A writes it
        det.wait(2, det.record(1))
        det.access(2, [(1, 0x1000, 0x2000, False)], "read on B")  # B reads it (after A's write)
        det.released(1, 0x1000, 0x2000, stream=1)  # freed: back to A's arena
        det.allocated(2, 0x1000, 0x2000, stream=reuser)
        det.access(reuser, [(2, 0x1000, 0x1800, True)], "new owner's write")
        return len(det.hazards)

    assert run(reuser=1) == 1  # A re-uses the block while B may still be reading it
    assert run(reuser=2) == 0  # (the stand-in's memory at the same address: not the pool's block)

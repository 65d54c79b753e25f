"""The CuPy execution of a step: fused kernel or twin per item, worker streams joined by events.

One item runs on the caller's current stream.  Several items run on ``core.parallel``'s workers, each worker on a
non-blocking stream of its own per device; per device, a worker's stream first waits for an event recorded on the
caller's current stream of that device (which produced the gradients), and the caller's stream of each device then
waits for every worker's final event on that device.  So a batch whose items live on several GPUs is ordered on each
of them (CuPy's current stream is per device: inside ``with device`` an item would otherwise run on that device's
default stream, outside the events).  The join also happens when an item raises: the other items' queued kernels
are still ordered before the caller's next work.  Nothing synchronises with the host.
"""

from __future__ import annotations

import threading

from . import backend, parallel


def run_gpu(opt, gpu: list) -> None:
    """Step ``[(item, slot, lr)]`` of CuPy items (``slot.t`` already advanced).  An optimizer whose
    ``hooks.kernel_batch(gpu)`` returns True has stepped them all itself (segmented kernels over every item of the
    step, on the caller's current stream); otherwise each item runs its fused kernel or its twin."""
    cp = backend.cupy()
    twin = backend.force_twin()
    hooks = opt.hooks
    batch = hooks.kernel_batch
    if batch is not None and not twin and batch(gpu):
        return

    def one(it, slot, lr):
        if twin or not hooks.kernel_update(slot.state, it.param, it.grad, t=slot.t, lr=lr):
            scratch = [cp.empty_like(it.param) for _ in range(opt.scratch_buffers)]
            hooks.update(cp, slot.state, it.param, it.grad, t=slot.t, lr=lr, scratch=scratch)

    if len(gpu) == 1:
        it = gpu[0][0]
        with it.param.device:
            one(*gpu[0])
        return
    # per device: the caller's current stream there and an event recorded on it (the gradients are ready)
    devices: dict[int, tuple] = {}
    for it, _, _ in gpu:
        dev = it.param.device
        if dev.id not in devices:
            with dev:
                caller = cp.cuda.get_current_stream()
                devices[dev.id] = (dev, caller, caller.record())
    done = []
    done_lock = threading.Lock()
    ctx = threading.local()

    def wrap(group_fn):
        def run():
            ctx.streams = streams = {}  # device id -> this group's worker stream there (entered on first use)
            try:
                group_fn()
            finally:
                ctx.streams = None
                evs = []
                for dev_id, stream in streams.items():
                    with devices[dev_id][0]:
                        evs.append((dev_id, stream.record()))
                with done_lock:
                    done.extend(evs)

        return run

    def on_worker(it, slot, lr):
        dev = it.param.device
        with dev:
            stream = ctx.streams.get(dev.id)
            if stream is None:
                stream = ctx.streams[dev.id] = _worker_stream(cp, dev.id)
                stream.wait_event(devices[dev.id][2])
            with stream:
                one(it, slot, lr)

    tasks = [(it.param.size, it.name, (lambda it=it, s=slot, lr=lr: on_worker(it, s, lr))) for it, slot, lr in gpu]
    try:
        parallel.run_tasks(tasks, wrap=wrap)
    finally:  # also when an item raised (run_tasks returns once every group has stopped): the kernels the workers
        # queued before it still run, and the caller's next work must be ordered after them
        for dev_id, ev in done:
            dev, caller, _ = devices[dev_id]
            with dev:
                caller.wait_event(ev)


_tls = threading.local()


def _worker_stream(cp, device_id: int):
    """This thread's non-blocking stream on the current device (``device_id``), created once."""
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    s = streams.get(device_id)
    if s is None:
        s = streams[device_id] = cp.cuda.Stream(non_blocking=True)
    return s

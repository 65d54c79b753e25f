"""The CuPy execution of a step: fused kernel or twin per item, worker streams joined by events.

One item runs on the caller's current stream.  Several items run on ``core.parallel``'s workers, each on its own
non-blocking stream that first waits for an event recorded on the caller's stream (which produced the
gradients); the caller's stream then waits for every worker's final event.  Nothing synchronises with the host.
"""

from __future__ import annotations

import threading

from . import backend, parallel


def run_gpu(opt, gpu: list) -> None:
    """Step ``[(item, slot, lr)]`` of CuPy items (``slot.t`` already advanced)."""
    cp = backend.cupy()
    twin = backend.force_twin()

    def one(it, slot, lr):
        with it.param.device:
            if twin or not opt._kernel_update(slot.state, it.param, it.grad, t=slot.t, lr=lr):
                scratch = [cp.empty_like(it.param) for _ in range(opt.scratch_buffers)]
                opt._update(cp, slot.state, it.param, it.grad, t=slot.t, lr=lr, scratch=scratch)

    if len(gpu) == 1:
        one(*gpu[0])
        return
    # Each worker group runs on its own non-blocking stream, ordered after the caller's stream (which
    # produced the gradients) and joined back into it by events: no host synchronisation.
    caller = cp.cuda.get_current_stream()
    start = caller.record()
    done = []
    done_lock = threading.Lock()

    def wrap(group_fn):
        def run():
            with gpu[0][0].param.device:
                stream = _worker_stream(cp)
                with stream:
                    stream.wait_event(start)
                    group_fn()
                    ev = stream.record()
            with done_lock:
                done.append(ev)

        return run

    tasks = [(it.param.size, it.name, (lambda it=it, s=slot, lr=lr: one(it, s, lr))) for it, slot, lr in gpu]
    parallel.run_tasks(tasks, wrap=wrap)
    for ev in done:
        caller.wait_event(ev)


_tls = threading.local()


def _worker_stream(cp):
    s = getattr(_tls, "stream", None)
    if s is None or s.device_id != cp.cuda.Device().id:
        s = _tls.stream = cp.cuda.Stream(non_blocking=True)
    return s

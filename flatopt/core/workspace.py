"""Per-thread scratch buffers: the one scratch mechanism of flatopt (allocated once, grown on demand, never saved).

Every temporary that outlives one call but not one step comes from here: the chunk-sized scratch of the elementwise
updates (``core.cpu_plan.scratch``), the matrix temporaries of the per-tensor algorithms (``core.linalg.scratch``;
on CuPy it takes CuPy's stream-ordered pool instead), the quantized optimizers' and Kron's work areas. What is *not*
scratch lives in the state: buffers whose contents must survive to the next step (e.g. the blocked sums' zero
padding of ``core.sqsum.sq_scratch``, a bucket's packed arenas in ``core.cpu_plan``) are per parameter, created with
the state and owned by it.

``get(xp, key, n, dtype)`` returns a 1-D view of ``n`` elements of a buffer owned by the calling thread; two calls
with the same key return overlapping memory, so a caller uses one key per live temporary.  Buffers are per thread
(the driver runs ``step_batch`` items on a thread pool, each GPU worker on its own stream), so a buffer is never
shared between concurrently running items.

On CuPy a buffer is also per device and per stream (the current one when it is asked for): work queued on one stream
may still be reading a buffer when the thread goes on with another stream (a caller that steps one parameter on one
stream and the next on another, unordered), and a buffer is only ever used, grown and freed on the stream it was
allocated on, so CuPy's stream-ordered pool never hands its memory to other work before that stream's work is done.
The stream object is kept with its buffers, so its handle cannot be re-used by a new stream while they exist.
"""

from __future__ import annotations

import threading

import numpy as np

_tls = threading.local()


def get(xp, key: str, n: int, dtype) -> object:
    pool = getattr(_tls, "pool", None)
    if pool is None:
        pool = _tls.pool = {}
    dtype = np.dtype(dtype)
    if xp is np or not hasattr(xp, "cuda"):  # NumPy, or a NumPy-like module without devices
        k = (key, dtype, -1, 0)
    else:
        stream = xp.cuda.get_current_stream()
        k = (key, dtype, xp.cuda.Device().id, stream.ptr)
    buf = pool.get(k)
    if buf is None or buf.size < n:
        buf = pool[k] = xp.empty(max(n, 1), dtype)
        if k[2] != -1:
            streams = getattr(_tls, "streams", None)
            if streams is None:
                streams = _tls.streams = {}
            streams[k[2:]] = stream  # keep its handle from re-use
    return buf[:n]


def clear() -> None:
    """Drop this thread's buffers (e.g. after stepping one very large parameter)."""
    _tls.pool = {}
    _tls.streams = {}

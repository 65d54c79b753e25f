"""Per-thread scratch buffers shared by the quantized optimizers (allocated once, grown on demand, never saved).

``get(xp, key, n, dtype)`` returns a 1-D view of ``n`` elements of a buffer owned by the calling thread; two calls
with the same key return overlapping memory, so a caller uses one key per live temporary.  Buffers are per thread
(the driver runs ``step_batch`` items on a thread pool, each GPU worker on its own stream), so a buffer is never
shared between concurrently running items.
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
    dev = -1 if xp is np else xp.cuda.Device().id
    k = (key, dtype, dev)
    buf = pool.get(k)
    if buf is None or buf.size < n:
        buf = pool[k] = xp.empty(max(n, 1), dtype)
    return buf[:n]


def clear() -> None:
    """Drop this thread's buffers (e.g. after stepping one very large parameter)."""
    _tls.pool = {}

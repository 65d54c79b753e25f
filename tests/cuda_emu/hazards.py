"""A happens-before race detector for the CuPy stand-in (``fakecupy.py``): vector clocks per stream.

The stand-in runs every kernel and CuPy operation at once, in issue order (a legal schedule of any set of streams),
so a missing event never changes a result there.  This detector sees it anyway: every operation the stand-in runs on a
stream (a fused kernel launch, a CuPy ufunc, reduction, copy, fill, host-to-device or device-to-host copy) reports the
memory ranges it reads and writes, and a conflicting pair of accesses (write-write or read-write, overlapping bytes)
that the happens-before order does not order is a *hazard* (:attr:`Detector.hazards`).

The order, as CUDA and CuPy 14.2 define it:

* each stream is a sequence: an operation happens after every earlier operation of its stream;
* ``Event.record(stream)`` (or ``Stream.record()``) captures the stream's work so far; ``Stream.wait_event(event)``
  orders the stream's later work after it;
* host synchronisations (``Stream.synchronize``, ``Event.synchronize``, ``Device.synchronize``, a device-to-host copy
  such as ``get``/``item``/``float``) order everything the host issues afterwards, on any stream, after what they
  waited for;
* the legacy default stream (CuPy's ``Stream.null``, ptr 0, per device): an operation on it waits for all earlier
  work of the device's *blocking* streams (``Stream()``, ``non_blocking=False``), and a blocking stream's operation
  waits for all earlier work of the null stream; ``non_blocking=True`` streams do neither;
* CuPy 14.2's memory pool is stream-ordered: a freed block returns to the arena of the stream it was allocated on and
  is reused, without any synchronisation, by a later allocation on that same stream only.  So the accesses to a freed
  block stay recorded, and the next allocation of the same stream at that address inherits them: a kernel of another
  stream still reading the block when the allocating stream writes its new contents is a hazard.  (A block is never
  handed to another stream's allocation; the stand-in's NumPy memory may be, and then the history is dropped.)

Each stream has a vector clock (stream key -> the number of its operations known to have happened before); an access
records (stream, its operation count); a later access of stream ``T`` is ordered after it when ``T``'s clock covers
that count.  Keys: a positive serial per ``Stream`` object, ``-(device + 1)`` for a device's null stream.
"""

from __future__ import annotations

import bisect
import threading


def null_key(device: int) -> int:
    return -(device + 1)


class Hazard(tuple):
    """(first access, second access, the memory): each access as 'write|read by <what> on stream <key> #<n>'."""

    def __str__(self):
        return f"{self[1]} is not ordered after {self[0]} ({self[2]})"


class Detector:
    def __init__(self):
        self.lock = threading.RLock()
        self.enabled = False
        self.kinds: dict[int, tuple[int, str]] = {}  # stream key -> (device, "null" | "blocking" | "nonblocking")
        self.blocking: dict[int, set[int]] = {}  # device -> its blocking streams' keys
        self.reset()

    def reset(self):
        """Forget every clock, access and hazard (the streams stay declared)."""
        with self.lock:
            self.clocks: dict[int, dict[int, int]] = {}
            self.host: dict[int, int] = {}
            self.mem: dict[int, list] = {}  # allocation serial -> [(lo, hi, stream key, count, write, what)]
            self.freed_starts: list[int] = []  # freed blocks (non-overlapping), sorted by start
            self.freed: dict[int, tuple] = {}  # start -> (end, allocating stream key, records)
            self.hazards: list[Hazard] = []

    # ------------------------------------------------------------------------------------------ streams
    def _clock(self, key: int) -> dict[int, int]:
        c = self.clocks.get(key)
        if c is None:
            c = self.clocks[key] = {}
        return c

    def stream(self, key: int, device: int, kind: str) -> None:
        """Declare a stream (its device and kind) before its first use."""
        with self.lock:
            self.kinds[key] = (device, kind)
            if kind == "blocking":
                self.blocking.setdefault(device, set()).add(key)

    def begin(self, key: int) -> tuple[dict[int, int], int]:
        """A new operation on stream ``key``: its clock after the implicit orderings, and its count."""
        c = self._clock(key)
        _join(c, self.host)  # the host issued it after everything it synchronised with
        device, kind = self.kinds.get(key, (0, "nonblocking"))
        if kind == "null":
            for b in self.blocking.get(device, ()):
                _join(c, self.clocks.get(b, {}))
        elif kind == "blocking":
            _join(c, self.clocks.get(null_key(device), {}))
        n = c[key] = c.get(key, 0) + 1
        return c, n

    def record(self, key: int) -> dict[int, int]:
        """An event recorded on stream ``key`` now: the clock it carries."""
        with self.lock:
            c, _ = self.begin(key)
            return dict(c)

    def wait(self, key: int, clock: dict[int, int] | None) -> None:
        with self.lock:
            _join(self._clock(key), clock or {})

    def host_wait(self, clock: dict[int, int] | None) -> None:
        """The host waited for the work ``clock`` covers (an event, a stream)."""
        with self.lock:
            _join(self.host, clock or {})

    def host_wait_stream(self, key: int) -> None:
        with self.lock:
            _join(self.host, self._clock(key))

    def host_wait_device(self, device: int) -> None:
        with self.lock:
            for key, (dev, _) in self.kinds.items():
                if dev == device:
                    _join(self.host, self.clocks.get(key, {}))

    # ------------------------------------------------------------------------------------------ memory
    def allocated(self, serial: int, lo: int, hi: int, stream: int) -> None:
        """A new device block [lo, hi) allocated on ``stream``: the history of a freed block of the same stream
        there carries over (the pool hands it back without ordering); any other freed history there is dropped."""
        with self.lock:
            i = bisect.bisect_left(self.freed_starts, hi)
            inherited = []
            while i > 0:
                start = self.freed_starts[i - 1]
                end, key, recs = self.freed[start]
                if end <= lo:
                    break
                del self.freed_starts[i - 1]
                del self.freed[start]
                i -= 1
                if key == stream:
                    inherited.extend(r for r in recs if r[0] < hi and lo < r[1])
            if inherited:
                self.mem[serial] = inherited

    def released(self, serial: int, lo: int, hi: int, stream: int) -> None:
        with self.lock:
            recs = self.mem.pop(serial, None)
            if not recs or hi <= lo:
                return
            i = bisect.bisect_left(self.freed_starts, lo)
            # (a live block never overlaps a freed one: allocated() removed those)
            self.freed_starts.insert(i, lo)
            self.freed[lo] = (hi, stream, recs)

    def access(self, key: int, accesses: list, what: str) -> None:
        """One operation on stream ``key``: ``accesses`` = [(allocation serial, lo, hi, write)]."""
        with self.lock:
            c, n = self.begin(key)
            for serial, lo, hi, write in accesses:
                if hi <= lo:
                    continue
                recs = self.mem.get(serial)
                if recs is None:
                    self.mem[serial] = [(lo, hi, key, n, write, what)]
                    continue
                keep = []
                for r in recs:
                    rlo, rhi, rk, rn, rw, rwhat = r
                    if rhi <= lo or hi <= rlo:
                        keep.append(r)
                        continue
                    ordered = rk == key or c.get(rk, 0) >= rn
                    if not ordered and (write or rw):
                        self.hazards.append(Hazard((
                            f"{'write' if rw else 'read'} by {rwhat} on stream {rk} #{rn}",
                            f"{'write' if write else 'read'} by {what} on stream {key} #{n}",
                            f"bytes [{max(lo, rlo):#x}, {min(hi, rhi):#x})")))
                    if ordered and lo <= rlo and rhi <= hi and (write or not rw):
                        continue  # superseded: whatever conflicts with it conflicts with the new access
                    keep.append(r)
                keep.append((lo, hi, key, n, write, what))
                self.mem[serial] = keep


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


detector = Detector()

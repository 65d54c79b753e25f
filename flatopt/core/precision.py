"""The precision policy of an optimizer and the write-back of 16-bit parameters (``flatopt.Precision``).

``Precision(writeback="nearest", state="float32", seed=0)`` is one frozen object, the same for every algorithm
(``precision=`` of the driver, ``core.driver.PerParamOptimizer``).  Parameters and gradients may be float16 or
bfloat16 (NumPy's ``ml_dtypes.bfloat16``, recognised by its dtype name: flatopt itself never imports ml_dtypes) beside
float32 and float64, and a gradient may have another of these dtypes than its parameter.  The algorithm always steps
a float32 working copy of a 16-bit parameter (float64 for a float64 one), with a gradient upcast to that dtype where
it differs (``core.lowp``), and its own state stays float32 (float64 for float64 parameters).  Then the working copy
``w`` is written back into the parameter ``p`` by ``writeback``:

* ``"nearest"``: round to nearest, ties to even (IEEE; what a cast does): a float32 beyond the 16-bit range by half
  an ulp or more becomes ±inf, NaN stays NaN (quiet, sign and top payload bits kept), ±inf stays ±inf.
* ``"stochastic"``: rounded up (away from zero) with probability equal to the distance to the value below (toward
  zero) in units of the 16-bit spacing there, so E[round(w)] = w, with random bits that are a pure function of
  (seed, parameter name, the parameter's step count t after this step, element index): the same for ``step`` and
  ``step_batch``, any thread count and after a resume.  NaN stays NaN, ±inf stays ±inf, and a finite value never
  becomes infinite: one that would rounds to the largest finite value of its sign (a value beyond that largest
  finite value is therefore rounded down: the one biased case).
* ``"kahan"``: a compensation buffer ``c`` in the parameter's dtype is kept per parameter in the optimizer state
  (Kahan summation as optimi does it): the algorithm steps ``w = f32(p) + f32(c)``; then ``p' = nearest(w')`` and
  ``c' = nearest(w' - f32(p'))`` (the float32 difference is exact when p' is finite: ``c' = 0`` where ``p'`` is
  not finite, so an inf or NaN parameter does not turn the compensation into NaN).
* ``"master"``: a float32 master copy ``m`` of the parameter is kept in the optimizer state (created from the
  parameter at its first step); the algorithm steps ``m`` and ``p' = nearest(m')``.  What the caller writes into
  ``p`` between steps is ignored: the master copy is the parameter.

A ``writeback`` other than ``"nearest"`` on a float32 or float64 parameter is an error (its write-back is exact).
``state`` is ``"float32"`` only: compressed states (``"bfloat16"``, ``"8bit"``, ``"al8"``, a mapping per slot) are
refused as not implemented yet.  ``seed`` is an int in [0, 2**63).

The random bits of ``"stochastic"`` (integer arithmetic modulo 2**64, so C and CUDA reproduce it):
``mix64(z)`` is SplitMix64's finaliser: ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
z *= 0x94D049BB133111EB; z ^= z >> 31``; ``fnv1a64(name)`` the 64-bit FNV-1a hash of the name's UTF-8 bytes (offset
0xCBF29CE484222325, prime 0x100000001B3).  Per parameter and step: ``base = mix64(seed ^ mix64(fnv1a64(name) ^
mix64(t)))``; element i draws ``U_i = mix64(base + (i + 1)·0x9E3779B97F4A7C15) >> 32`` (SplitMix64's i-th output from
``base``, its top 32 bits).  With ``b`` the float32 bits of ``w_i`` and ``a = |w_i|``:

* bfloat16: ``r = U_i >> 16``; the result's bits are ``(b + r) >> 16`` (the carry rounds up with probability
  (b & 0xFFFF) / 2**16, on the magnitude; the sign bit is untouched);
* float16, ``a >= 2**-14`` (a normal float16): ``r = U_i >> 19``; the result is the float32 whose bits are
  ``(bits(a) + r) & ~0x1FFF`` (an exact float16 value), with the sign of ``w_i``;
* float16, ``a < 2**-14`` (the subnormal float16 spacing 2**-24): ``y = a·2**24`` (exact), ``q = floor(y)``,
  ``f = y - q`` (exact); rounded up iff ``U_i < f·2**32`` (compared exactly, in float64); the result is
  ``(q + up)·2**-24`` with the sign of ``w_i``.  The probability is f rounded up to a multiple of 2**-32: exact for
  every w that is a multiple of 2**-56, a bias below 2**-56 in absolute value otherwise.

Then NaN -> NaN, ±inf -> ±inf, a finite value whose result is infinite -> the largest finite value of that sign.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping

import numpy as np

from . import workspace

WRITEBACKS = ("nearest", "stochastic", "kahan", "master")
STATES = ("float32",)
LATER_STATES = ("bfloat16", "8bit", "al8")  # compressed states: named, refused as not implemented
LOWP_NAMES = ("float16", "bfloat16")  # the 16-bit parameter dtypes, by name (bfloat16 is ml_dtypes')
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")  # every dtype a parameter or gradient may have
SEED_END = 1 << 63

_MASK = (1 << 64) - 1
_PHI = 0x9E3779B97F4A7C15
_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))
_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Precision:
    """How 16-bit parameters are written back and how states are stored (see the module doc).

    ``writeback``: ``"nearest"`` (default), ``"stochastic"``, ``"kahan"`` or ``"master"``; ``state``: ``"float32"``
    (compressed states are not implemented yet); ``seed``: the int in [0, 2**63) of the stochastic rounding."""

    writeback: str = "nearest"
    state: Any = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.writeback, str) or self.writeback not in WRITEBACKS:
            raise ValueError(f"Precision: writeback must be one of {', '.join(map(repr, WRITEBACKS))}, "
                             f"got {self.writeback!r}")
        if isinstance(self.state, Mapping) or self.state in LATER_STATES:
            raise ValueError(f"Precision: state={self.state!r} is not implemented yet (compressed optimizer "
                             f"states); only 'float32' is available")
        if not isinstance(self.state, str) or self.state not in STATES:
            raise ValueError(f"Precision: state must be 'float32', got {self.state!r}")
        if isinstance(self.seed, (bool, np.bool_)) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"Precision: seed must be an int, got {self.seed!r}")
        if not 0 <= self.seed < SEED_END:
            raise ValueError(f"Precision: seed must be in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))

    def to_dict(self) -> dict[str, Any]:
        return {"writeback": self.writeback, "state": self.state, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: Any) -> Precision:
        """The policy a snapshot recorded (``to_dict``); ``TypeError``/``ValueError`` for anything else."""
        if not isinstance(d, Mapping) or set(d) != {"writeback", "state", "seed"}:
            raise TypeError(f"a precision policy must be a dict with keys writeback, state, seed; got {d!r}")
        return cls(d["writeback"], d["state"], d["seed"])


def check_precision(precision: Any) -> Precision:
    """The ``precision=`` argument: ``None`` (the default policy) or a :class:`Precision`."""
    if precision is None:
        return Precision()
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a flatopt.Precision or None, got {type(precision).__name__}")
    return precision


def is_lowp(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16."""
    return dtype.name in LOWP_NAMES


def work_dtype(dtype: Any) -> np.dtype:
    """The dtype an algorithm steps a parameter of ``dtype`` in: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64) if dtype == np.float64 else _F32


# ------------------------------------------------------------------------------------------------ the bits
def _mix64_int(z: int) -> int:
    for shift, mult in _MIX:
        z ^= z >> shift
        if mult is not None:
            z = (z * mult) & _MASK
    return z


def fnv1a64(name: str) -> int:
    h = 0xCBF29CE484222325
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    return h


def stream_base(seed: int, name: str, t: int) -> int:
    """``base`` of the module doc: the SplitMix64 state of (seed, name, t)."""
    return _mix64_int(seed ^ _mix64_int(fnv1a64(name) ^ _mix64_int(t & _MASK)))


def random_words(xp: Any, base: int, lo: int, out: Any, tmp: Any) -> None:
    """``U_i`` (module doc) for i = lo, lo + 1, ... into the uint64 ``out`` (``tmp``: uint64 scratch, same size);
    allocates nothing after the first call of a size (``base + (i + 1)·φ = i·φ + (base + (lo + 1)·φ)`` modulo
    2**64, from a cached ramp of ``i·φ``)."""
    n = out.size
    xp.add(_phi_ramp(xp, n), np.uint64((base + (lo + 1) * _PHI) & _MASK), out=out)
    for shift, mult in _MIX:
        xp.right_shift(out, np.uint64(shift), out=tmp)
        xp.bitwise_xor(out, tmp, out=out)
        if mult is not None:
            xp.multiply(out, np.uint64(mult), out=out)
    xp.right_shift(out, np.uint64(32), out=out)


_ramps: dict[Any, Any] = {}  # (module, device, stream) -> (the read-only uint64 ramp i·φ mod 2**64, the stream)
_ramps_lock = threading.Lock()


def _phi_ramp(xp: Any, n: int) -> Any:
    """The ramp ``i·φ`` (i < n) on the current device and stream (on CuPy per stream, as ``core.workspace``'s
    buffers: it is filled on that stream, so work on another stream never reads it before it is written)."""
    stream = None
    if xp is not np and hasattr(xp, "cuda"):
        stream = xp.cuda.get_current_stream()
        key: Any = (xp.__name__, xp.cuda.Device().id, stream.ptr)
    else:
        key = (xp.__name__,)
    got = _ramps.get(key)
    if got is None or got[0].size < n:
        with _ramps_lock:
            got = _ramps.get(key)
            if got is None or got[0].size < n:
                ramp = xp.arange(max(n, 1 << 16), dtype=np.uint64)
                xp.multiply(ramp, np.uint64(_PHI), out=ramp)
                got = _ramps[key] = (ramp, stream)  # (the stream kept: its handle is not re-used meanwhile)
    return got[0][:n]


# ------------------------------------------------------------------------------------------- conversions
def widen(xp: Any, src: Any, out: Any) -> None:
    """``out`` (float32 or float64) = ``src`` (any accepted dtype), exactly where it widens (bfloat16 by its bits;
    float64 into float32 rounds to nearest)."""
    if src.dtype.name == "bfloat16":
        if out.dtype != _F32:
            raise AssertionError("a bfloat16 buffer widens into float32 scratch")
        bits = out.view(np.uint32)
        xp.copyto(bits, src.view(np.uint16), casting="unsafe")
        xp.left_shift(bits, np.uint32(16), out=bits)
    else:
        xp.copyto(out, src, casting="unsafe")


def round_nearest(xp: Any, w: Any, out: Any) -> None:
    """``out`` (float16 or bfloat16) = ``w`` (float32) rounded to nearest even (module doc)."""
    if out.dtype.name != "bfloat16":
        with np.errstate(over="ignore"):
            xp.copyto(out, w, casting="unsafe")  # IEEE: round to nearest even, overflow to inf, NaN kept
        return
    b = w.view(np.uint32)
    lsb = workspace.get(xp, "precision.rn_bits", w.size, np.uint32)
    xp.right_shift(b, np.uint32(16), out=lsb)
    xp.bitwise_and(lsb, np.uint32(1), out=lsb)
    xp.add(lsb, np.uint32(0x7FFF), out=lsb)
    xp.add(lsb, b, out=lsb)
    xp.right_shift(lsb, np.uint32(16), out=lsb)
    _keep_nan(xp, w, b, lsb)
    xp.copyto(out.view(np.uint16), lsb, casting="unsafe")


def _keep_nan(xp: Any, w: Any, b: Any, top: Any) -> None:
    """Where ``w`` is NaN, ``top`` (the bfloat16 bits as uint32) = its top 16 bits, quiet."""
    q = workspace.get(xp, "precision.nan_bits", w.size, np.uint32)
    xp.right_shift(b, np.uint32(16), out=q)
    xp.bitwise_or(q, np.uint32(0x40), out=q)
    nan = workspace.get(xp, "precision.nan", w.size, np.bool_)
    xp.isnan(w, out=nan)
    xp.copyto(top, q, where=nan)  # (no branch on the data: no host synchronisation on a GPU)


def _scratch(xp: Any, n: int, *kinds: tuple[str, Any]) -> list[Any]:
    """One ``core.workspace`` view of ``n`` elements per ``(role, dtype)``."""
    return [workspace.get(xp, f"precision.{role}", n, dtype) for role, dtype in kinds]


def round_stochastic(xp: Any, w: Any, out: Any, words: Any) -> None:
    """``out`` (float16 or bfloat16) = ``w`` (float32) rounded stochastically with the words ``U_i`` (uint64,
    < 2**32) of ``random_words`` (module doc); ``words`` is not written, and nothing is allocated."""
    b = w.view(np.uint32)
    n = w.size
    if out.dtype.name == "bfloat16":
        r, top, low, over, finite = _scratch(xp, n, ("sr_words", np.uint64), ("sr_top", np.uint32),
                                             ("sr_low", np.uint32), ("sr_over", np.bool_), ("sr_finite", np.bool_))
        xp.right_shift(words, np.uint64(16), out=r)
        xp.copyto(top, r, casting="unsafe")
        xp.add(top, b, out=top)
        xp.right_shift(top, np.uint32(16), out=top)
        xp.bitwise_and(top, np.uint32(0x7FFF), out=low)
        xp.equal(low, np.uint32(0x7F80), out=over)
        xp.isfinite(w, out=finite)
        xp.logical_and(over, finite, out=over)
        xp.copyto(low, over, casting="unsafe")
        xp.subtract(top, low, out=top)  # 0x7F80 -> 0x7F7F, the largest finite, sign kept
        _keep_nan(xp, w, b, top)
        xp.copyto(out.view(np.uint16), top, casting="unsafe")
        return
    with np.errstate(over="ignore", invalid="ignore"):
        _stochastic_f16(xp, w, out, words)


def _stochastic_f16(xp: Any, w: Any, out: Any, words: Any) -> None:
    n = w.size
    a, y, q, mag, u64, f64, sub, bad = _scratch(
        xp, n, ("f16_a", np.float32), ("f16_y", np.float32), ("f16_q", np.float32), ("f16_mag", np.uint32),
        ("f16_u64", np.uint64), ("f16_f64", np.float64), ("f16_sub", np.bool_), ("f16_bad", np.bool_))
    xp.abs(w, out=a)
    # subnormal float16 range: (q + up)·2**-24 with up = U_i < f·2**32, f = y - q, y = a·2**24
    xp.multiply(a, np.float32(2.0**24), out=y)
    xp.floor(y, out=q)
    xp.subtract(y, q, out=y)  # f (exact)
    xp.copyto(f64, y)
    xp.multiply(f64, 2.0**32, out=f64)
    xp.less(words, f64, out=sub)  # (uint64 < 2**32 and float64: compared exactly)
    xp.copyto(y, sub)
    xp.add(q, y, out=q)
    xp.multiply(q, np.float32(2.0**-24), out=q)
    # normal float16 range: the magnitude's bits plus U_i >> 19, cleared below the float16 mantissa
    xp.right_shift(words, np.uint64(19), out=u64)
    xp.copyto(mag, u64, casting="unsafe")
    xp.add(mag, a.view(np.uint32), out=mag)
    xp.bitwise_and(mag, np.uint32(0xFFFFE000), out=mag)
    res = mag.view(np.float32)
    xp.less(a, np.float32(2.0**-14), out=sub)
    xp.copyto(res, q, where=sub)
    xp.minimum(res, np.float32(np.finfo(np.float16).max), out=res)  # saturate (non-finite w: replaced below)
    xp.copysign(res, w, out=res)
    xp.isfinite(w, out=bad)
    xp.logical_not(bad, out=bad)
    xp.copyto(res, w, where=bad)  # NaN and ±inf as they are
    xp.copyto(out, res, casting="unsafe")  # exact: every finite res is a float16 value

"""Block quantization codecs of ``Adafactor8Bit`` (as in the Python package adafactor8bit 0.4.6).

**AL8 / AL16** (non-negative states: second moments, CAME confidences, APOLLO's low-rank variance).  A flat state of
``n`` values is cut into blocks of ``block_size`` (zero-padded); each block stores one float32 ``scale`` (its log2
range) and one float32 ``min_log`` (log2 of its smallest non-zero value, raised to the floor F), and one code per
value: uint8 for AL8 (L = 254), uint16 for AL16 (L = 65534, the original's int16 bit pattern read unsigned)::

    encode: ℓ = log2(max(v, 1e-38));  min_log = max(min ℓ over v ≠ 0, F);  max_log = min(max ℓ, 126)
            min_log = max_log − 1 if min_log ≥ max_log;   scale = max(max_log − min_log, 1e-12)
            q = clamp(rint((ℓ − min_log)/scale·L) + 1, 1, L + 1),  q = 0  iff  v == 0 exactly
    decode: v = 2^(((q − 1)·scale)/L + min_log),  v = 0 for q = 0

F = log2(max(eps², FLT_MIN)) (``al_floor``).  Every step is float32 in the original's PyTorch order, rint is
round-half-to-even, and ℓ is log2 evaluated in float64 and rounded to float32 (torch's float32 log2 on the CPU is
correctly rounded to within a handful of ulps in 4M; NumPy's float32 log2 is not), so the codes equal the original
CPU encoder's bit for bit whenever the floors agree (eps1 = 1e-30 ⇒ F = −126).  The decode uses float32 ``exp2``
(CuPy's is ``pow(2, x)``, which the fused kernels call too; the original's ``torch.pow(2, ·)`` differs from NumPy's
by ≤ 1 ulp).  Worst-case relative round-trip error inside a
block is 2^(scale/(2L)) − 1; both end points of a block are exact up to float rounding.

**Signed first moment** ``uf8`` / ``uf4`` / ``d8`` / ``d4`` (blocks of ``m_block_size``, one float32 absmax per
block floored at 1e-12): ``uf8`` q = clamp(rint(128·m/absmax), −128, 127) + 128; ``uf4`` likewise with 8, two codes
per byte, even index in the high nibble; ``d8``/``d4`` the nearest entry of Dettmers' signed dynamic map with a
sign-preserving nudge (``_nearest``; on NumPy by an equivalent table look-up on the upper 16 bits of the float,
``flatopt.adafactor8bit.nearest_lut``).  ``fp32`` means unquantized (handled by the caller).

**Non-finite values** (the same on NumPy and CuPy, fused kernel or not; ``kernels/adafactor8bit.cu``): a NaN makes
its block's statistics NaN.  AL: scale = min_log = NaN, code 0 for exact zeros and 1 for every other value, so the
block decodes as NaN (zeros apart); +inf is an ordinary value (max_log is clamped at 126).  Signed first moment: a
block whose absmax is not finite (a NaN or an infinity in it) keeps that absmax and is encoded as zeros (the code of
0 everywhere), so it decodes as NaN.  A poisoned block stays poisoned until the state is reset.

Array-agnostic (``xp`` is NumPy or CuPy); NumPy processes a few blocks at a time in per-thread scratch buffers, so
nothing is allocated per step after the first.
"""

from __future__ import annotations

import math

import numpy as np

from . import nearest_lut
from .nearest_lut import nearest as _nearest
from ..core import backend, workspace
from .qmaps import construct_dynamic_map, dynamic_map  # noqa: F401 - re-exported

AL_FORMATS = ("al8", "al16")
V_FORMATS = ("al8", "al16", "fp32")
M_FORMATS = ("uf8", "uf4", "d8", "d4", "fp32")
AL_LEVELS = {"al8": 254, "al16": 65534}
AL_DTYPES = {"al8": np.dtype(np.uint8), "al16": np.dtype(np.uint16)}
FLT_MIN = float(np.finfo(np.float32).tiny)
# the original's clamp before log2 (1e-38 rounded to float32), applied in float64: a float32 subnormal, which a
# GPU's flush-to-zero float32 ufuncs would read as 0 (log2 = -inf, a NaN scale for an all-zero block), but a
# normal double; the float64 max equals the original's float32 max on every input (kernels/a8_codec.cuh A8_TINY)
_TINY = np.float64(np.float32(1e-38))
# NumPy: elements per codec chunk (its scratch stays in the L2 cache).  Each chunk is ~10 NumPy calls; two threads
# hand the GIL over at every call, so short calls do not run in parallel: longer chunks let two threads scale.
# Re-measure: ``python -m benchmarks.threads_probe codec`` (32K against 128K chunks) and
# ``python -m benchmarks.run --only adafactor8bit`` with this constant at 1 << 15 and 1 << 17.
_CHUNK = 1 << 17
_F32 = np.float32


def al_floor(eps: float) -> float:
    """F = log2(max(eps², FLT_MIN)); −126 for eps = 1e-30 (the original CPU encoder's fixed floor)."""
    return math.log2(max(float(eps) * float(eps), FLT_MIN))


def nblocks(n: int, block: int) -> int:
    return -(-n // block)


def al_init(xp, n: int, block: int, fmt: str):
    """Fresh AL state: codes 0 (all zeros), scale 1, min_log 0."""
    nb = nblocks(n, block)
    return xp.zeros(nb * block, AL_DTYPES[fmt]), xp.ones(nb, np.float32), xp.zeros(nb, np.float32)


def _chunks(xp, nb: int, block: int):
    step = nb if xp is not np else max(1, _CHUNK // block)
    for b0 in range(0, nb, step):
        yield b0, min(nb, b0 + step)


def al_encode(xp, v, q, scale, min_log, *, block: int, fmt: str, floor: float) -> None:
    """Quantize the float32 values ``v`` (length n ≥ 0, non-negative) into ``q``/``scale``/``min_log`` in place."""
    n, levels = v.size, _F32(AL_LEVELS[fmt])
    fl = _F32(floor)
    for b0, b1 in _chunks(xp, scale.size, block):
        k, lo = b1 - b0, b0 * block
        m = max(0, min(n, b1 * block) - lo)
        lg = workspace.get(xp, "al_lg", k * block, np.float32)
        if m == k * block and v.dtype == np.float32:
            src = v[lo : lo + m]
        else:  # the last blocks, zero-padded (or values to round to float32 first)
            src = lg
            lg[:m] = v[lo : lo + m]
            lg[m:] = 0.0
        # NumPy: a block without zeros (the common case) skips the masking; CuPy always masks (no host read)
        zero = None
        if xp is not np or not np.all(src):
            zero = workspace.get(xp, "al_zero", k * block, np.bool_)
            xp.equal(src, 0.0, out=zero)
        w = workspace.get(xp, "al_f64", k * block, np.float64)  # log2 in float64 (rounded to float32 below);
        w[...] = src  # the clamp in float64 (_TINY), whatever the array module's scalar promotion
        xp.maximum(w, _TINY, out=w)
        xp.log2(w, out=w)
        lg[...] = w
        tmp = workspace.get(xp, "al_tmp", k * block, np.float32)
        lg2 = lg.reshape(k, block)
        mx = xp.minimum(lg2.max(axis=1), _F32(126.0))
        if zero is None:
            mn = lg2.min(axis=1)
        else:
            tmp[...] = lg
            xp.copyto(tmp, _F32(np.inf), where=zero)
            mn = tmp.reshape(k, block).min(axis=1)
        mn = xp.maximum(mn, fl)
        xp.copyto(mn, mx - _F32(1.0), where=mn >= mx)
        sc = xp.maximum(mx - mn, _F32(1e-12))
        xp.subtract(lg2, mn[:, None], out=lg2)
        xp.divide(lg2, sc[:, None], out=lg2)
        xp.multiply(lg2, levels, out=lg2)
        xp.rint(lg2, out=lg2)
        xp.clip(lg2, _F32(0.0), levels, out=lg2)  # clamp(rint(·) + 1, 1, L + 1) = clamp(rint(·), 0, L) + 1
        nan_block = xp.isnan(sc)  # a NaN in the block: code 1 for its non-zero values (the kernel's; module doc)
        if xp is not np or nan_block.any():
            xp.copyto(lg2, _F32(0.0), where=nan_block[:, None])
        if zero is not None:
            xp.copyto(lg, _F32(-1.0), where=zero)  # code 0 iff exactly zero
        xp.add(lg, _F32(1.0), out=q[lo : lo + k * block], casting="unsafe")
        scale[b0:b1] = sc
        min_log[b0:b1] = mn


def al_decode(xp, q, scale, min_log, out, *, block: int, fmt: str) -> None:
    """Dequantize into the float32 buffer ``out`` (its length n ≤ the padded code length)."""
    n, levels = out.size, _F32(AL_LEVELS[fmt])
    for b0, b1 in _chunks(xp, scale.size, block):
        k, lo = b1 - b0, b0 * block
        m = max(0, min(n, b1 * block) - lo)
        if m == 0:
            continue
        x = workspace.get(xp, "al_dec", k * block, np.float32)
        zero = workspace.get(xp, "al_zero", k * block, np.bool_)
        qc = q[lo : lo + k * block]
        xp.equal(qc, 0, out=zero)
        x[...] = qc
        x2 = x.reshape(k, block)
        xp.subtract(x2, _F32(1.0), out=x2)
        xp.multiply(x2, scale[b0:b1, None], out=x2)
        xp.divide(x2, levels, out=x2)
        xp.add(x2, min_log[b0:b1, None], out=x2)
        xp.exp2(x2, out=x2)
        xp.copyto(x, _F32(0.0), where=zero)
        out[lo : lo + m] = x[:m]


# ------------------------------------------------------------------------------------------ first moment
def m_bits(fmt: str) -> int:
    return 4 if fmt in ("uf4", "d4") else 8


def m_init(xp, n: int, mblock: int, fmt: str):
    """Fresh quantized first moment: codes of zero (128 / 0x88 / 127 / 0x77) and absmax 1 per block."""
    nb = nblocks(n, mblock)
    fill = {"uf8": 128, "uf4": 0x88, "d8": 127, "d4": 0x77}[fmt]
    size = nb * mblock // (2 if m_bits(fmt) == 4 else 1)
    return xp.full(size, fill, np.uint8), xp.ones(nb, np.float32)


def qmap(xp, bits: int):
    """The map on the array module's device: uploaded once per device, ordered before its reads on every stream
    (``core.backend.device_constant``: the workers' non-blocking streams wait for the upload's event)."""
    if xp is np:
        return dynamic_map(bits)
    return backend.device_constant(xp, ("flatopt.dynamic_map", bits), lambda: dynamic_map(bits))


def m_encode(xp, m, q, scale, *, mblock: int, fmt: str) -> None:
    """Quantize the float32 first moment ``m`` (length n) into ``q``/``scale`` in place."""
    n, bits = m.size, m_bits(fmt)
    for b0, b1 in _chunks(xp, scale.size, mblock):
        k, lo = b1 - b0, b0 * mblock
        cnt = max(0, min(n, b1 * mblock) - lo)
        w = workspace.get(xp, "m_w", k * mblock, np.float32)
        a = workspace.get(xp, "m_a", k * mblock, np.float32)
        if cnt == k * mblock and m.dtype == np.float32:
            src = m[lo : lo + cnt]
        else:  # the last block, zero-padded
            src = w
            w[:cnt] = m[lo : lo + cnt]
            w[cnt:] = 0.0
        xp.abs(src, out=a)
        if xp is np:  # non-negative floats order as their bit patterns: an int32 max is faster (NaN stays NaN)
            am = np.maximum(a.view(np.int32).reshape(k, mblock).max(axis=1).view(np.float32), _F32(1e-12))
        else:
            am = xp.maximum(a.reshape(k, mblock).max(axis=1), _F32(1e-12))
        scale[b0:b1] = am
        w2 = w.reshape(k, mblock)
        bad = ~xp.isfinite(am)  # a NaN or an infinity in the block: encoded as zeros (the module documentation)
        bad = bad if xp is not np or bad.any() else None
        if fmt in ("uf8", "uf4"):
            # rint(half·(m/absmax)) with one division: m/(absmax/half) is the same float (half a power of two)
            half = _F32(128.0 if fmt == "uf8" else 8.0)
            xp.divide(src.reshape(k, mblock), (am / half)[:, None], out=w2)
            if bad is not None:
                xp.copyto(w2, _F32(0.0), where=bad[:, None])
            xp.rint(w, out=w)
            xp.minimum(w, half - _F32(1.0), out=w)  # |m/absmax| ≤ 1: only +half needs the clamp
            if bits == 8 and xp is np:  # w ∈ [−128, 127]: as int8, then the sign bit flipped = w + 128 as uint8
                dst = q[lo : lo + k * mblock]
                np.copyto(dst.view(np.int8), w, casting="unsafe")
                np.bitwise_xor(dst, np.uint8(128), out=dst)
            elif bits == 8:
                xp.add(w, half, out=q[lo : lo + k * mblock], casting="unsafe")
            else:  # two codes per byte, the even index high: 16·(w₀ + 8) + (w₁ + 8), exact in float32
                h = workspace.get(xp, "m_h", k * mblock // 2, np.float32)
                xp.multiply(w[0::2], _F32(16.0), out=h)
                xp.add(h, w[1::2], out=h)
                xp.add(h, _F32(136.0), out=q[lo // 2 : (lo + k * mblock) // 2], casting="unsafe")
            continue
        xp.divide(src.reshape(k, mblock), am[:, None], out=w2)
        if bad is not None:
            xp.copyto(w2, _F32(0.0), where=bad[:, None])
        if bits == 8:
            _nearest_into(xp, w, qmap(xp, bits), q[lo : lo + k * mblock])
        else:
            c = workspace.get(xp, "m_c", k * mblock, np.uint8)
            _nearest_into(xp, w, qmap(xp, bits), c)
            out = q[lo // 2 : (lo + k * mblock) // 2]
            xp.left_shift(c[0::2], 4, out=out)
            xp.bitwise_or(out, c[1::2], out=out)


# uf4 decode table: byte b -> ((b >> 4) − 8, (b & 15) − 8), the codes of elements 2i and 2i + 1
_UF4_PAIRS = np.array([[(b >> 4) - 8, (b & 15) - 8] for b in range(256)], np.float32)
_NEAREST_SUB = 1024  # NumPy: elements per _nearest call (its int64 temporaries stay a few KB)


def _nearest_into(xp, x, mp, out) -> None:
    """out[...] = _nearest(x) cast to ``out``'s dtype.  NumPy, float32 into uint8: by the table look-up of
    ``flatopt.adafactor8bit.nearest_lut`` (the same codes, faster: ``python -m benchmarks.threads_probe codec``);
    otherwise in slices of ``_NEAREST_SUB`` elements (the map lookup is elementwise, so the codes are the same) so
    no temporary of the chunk's size is allocated."""
    if xp is np and x.dtype == np.float32 and out.dtype == np.uint8 and x.flags.c_contiguous:
        nearest_lut.nearest_into(x, mp, out, lambda key, n, dtype: workspace.get(np, key, n, dtype))
        return
    step = x.size if xp is not np else _NEAREST_SUB
    for s0 in range(0, x.size, step):
        s1 = min(x.size, s0 + step)
        xp.copyto(out[s0:s1], _nearest(xp, x[s0:s1], mp), casting="unsafe")


def m_decode(xp, q, scale, out, *, mblock: int, fmt: str) -> None:
    """Dequantize into the float32 buffer ``out`` (length n)."""
    n, bits = out.size, m_bits(fmt)
    for b0, b1 in _chunks(xp, scale.size, mblock):
        k, lo = b1 - b0, b0 * mblock
        cnt = max(0, min(n, b1 * mblock) - lo)
        if cnt == 0:
            continue
        full = cnt == k * mblock
        w = out[lo : lo + cnt] if full else workspace.get(xp, "m_w", k * mblock, np.float32)
        w2 = w.reshape(k, mblock)
        if fmt == "uf4" and xp is np:  # a table of the two signed codes of each byte: one gather
            idx = workspace.get(xp, "m_idx", k * mblock // 2, np.intp)
            idx[...] = q[lo // 2 : (lo + k * mblock) // 2]
            np.take(_UF4_PAIRS, idx, axis=0, out=w.reshape(-1, 2), mode="clip")
            xp.multiply(w2, (scale[b0:b1] / _F32(8.0))[:, None], out=w2)
            if not full:
                out[lo : lo + cnt] = w[:cnt]
            continue
        if bits == 8:
            codes = q[lo : lo + k * mblock]
        else:
            codes = workspace.get(xp, "m_c", k * mblock, np.uint8)
            qb = q[lo // 2 : (lo + k * mblock) // 2]
            xp.right_shift(qb, 4, out=codes[0::2])
            xp.bitwise_and(qb, 0x0F, out=codes[1::2])
        if fmt in ("uf8", "uf4"):
            half = _F32(128.0 if fmt == "uf8" else 8.0)
            if xp is np:  # the cast, then a float32 subtract (faster than a mixed-type subtract; same values)
                np.copyto(w, codes, casting="unsafe")
                np.subtract(w, half, out=w)
            else:
                xp.subtract(codes, half, out=w, dtype=np.float32)
            xp.multiply(w2, (scale[b0:b1] / half)[:, None], out=w2)
        else:
            if xp is np:  # codes are always valid indices: mode="clip" takes them as they are, and unlike the
                # default mode="raise" it writes straight into ``out`` (no buffer); intp indices are not converted
                idx = workspace.get(xp, "m_idx", k * mblock, np.intp)
                idx[...] = codes
                np.take(qmap(xp, bits), idx, out=w, mode="clip")
            else:
                xp.take(qmap(xp, bits), codes, out=w)
            xp.multiply(w2, scale[b0:b1, None], out=w2)
        if not full:
            out[lo : lo + cnt] = w[:cnt]

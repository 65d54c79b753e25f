"""State layout of ``Adafactor8Bit`` (private): slots, their formats, and load/store through the codec.

Every state slot is stored either as float32 (``<slot>``) or quantized (``<slot>_q`` codes plus ``<slot>_scale``
and, for the AL formats, ``<slot>_min_log``), as in the original's state dict; the slot names are the original's.
A slot is quantized when the parameter is quantized (``quantize`` and numel ≥ ``min_8bit_size``), its format is
not ``fp32``, and the quantized layout is not larger than float32 (a factor vector shorter than about a quarter of
a block is kept in float32: each quantized vector occupies at least one whole block).

``load`` returns the exact float32 values to update in place (the state array itself for float32 slots, a
per-thread workspace for quantized ones); ``store`` re-quantizes them (a no-op for float32 slots).  The value
used by this step's update is always the exact float32 one ("fused EMA, then requantize only what is stored").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..core import backend, kernels, workspace
from . import fira, quant

NONNEG = ("row_var", "col_var", "variance", "conf_row", "conf_col", "v_low", "res_low", "conf_row_low",
          "conf_col_low")
SIGNED = ("m", "m_low")
FP32_ONLY = ("row_var_low", "col_var_low")


def _fields():
    out = []
    for s in NONNEG:
        out += [s, f"{s}_q", f"{s}_scale", f"{s}_min_log"]
    for s in SIGNED:
        out += [s, f"{s}_q", f"{s}_scale"]
    out += list(FP32_ONLY) + ["fira_prev", "prev_update_norm", "lag_fira_scale", "apollo_seed", "current_proj_seed",
                              "last_proj_step"]
    fs = [(f, object, dataclasses.field(default=None)) for f in out]
    for f in ("cfg", "sizes", "proj", "work"):  # resolved group config, slot sizes, cached projection, scratch
        fs.append((f, object, dataclasses.field(default=None, metadata={"persist": False})))
    return fs


Adafactor8BitState = dataclasses.make_dataclass("Adafactor8BitState", _fields())
Adafactor8BitState.__doc__ = "Per-parameter state of Adafactor8Bit (see flatopt.adafactor8bit.state)."
Adafactor8BitState.__module__ = __name__


def is_sgd(cfg) -> bool:
    return cfg.beta2 is None and cfg.beta2_decay is None


def apollo_shape(shape) -> tuple[int, int, bool, int]:
    """(R, C, right, low-rank numel) of the 2-D view APOLLO uses; ``right`` when R ≥ C (P is r×C)."""
    r_, c_ = (shape[0], math.prod(shape[1:])) if len(shape) > 2 else tuple(shape)
    return r_, c_, r_ >= c_, 0


def _al_fits(n: int, block: int, fmt: str) -> bool:
    nb = quant.nblocks(n, block)
    return nb * block * quant.AL_DTYPES[fmt].itemsize + 8 * nb <= 4 * n


def _m_fits(n: int, mblock: int, fmt: str) -> bool:
    nb = quant.nblocks(n, mblock)
    return nb * mblock * quant.m_bits(fmt) // 8 + 4 * nb <= 4 * n


def init(xp, cfg, shape, dtype, *, apollo_seed: int | None = None):
    """Fresh state for a parameter of ``shape`` under the (group) config ``cfg``."""
    st = Adafactor8BitState(cfg=cfg, sizes={"shape": tuple(shape)})
    n = math.prod(shape)
    use_q = cfg.quantize and n >= cfg.min_8bit_size
    cqt = cfg.c_quant_type or cfg.v_quant_type

    def nonneg(slot, size, fmt):
        st.sizes[slot] = size
        if use_q and fmt != "fp32" and _al_fits(size, cfg.block_size, fmt):
            q, s, ml = quant.al_init(xp, size, cfg.block_size, fmt)
            setattr(st, f"{slot}_q", q), setattr(st, f"{slot}_scale", s), setattr(st, f"{slot}_min_log", ml)
        else:
            setattr(st, slot, xp.zeros(size, np.float32))

    def signed(slot, size):
        st.sizes[slot] = size
        fmt = cfg.m_quant_type
        if use_q and fmt != "fp32" and _m_fits(size, cfg.m_block_size, fmt):
            q, s = quant.m_init(xp, size, cfg.m_block_size, fmt)
            setattr(st, f"{slot}_q", q), setattr(st, f"{slot}_scale", s)
        else:
            setattr(st, slot, xp.zeros(size, np.float32))

    if cfg.apollo_rank > 0 and len(shape) >= 2:
        r_, c_, right, _ = apollo_shape(shape)
        lr_, lc_ = (r_, cfg.apollo_rank) if right else (cfg.apollo_rank, c_)
        st.apollo_seed, st.current_proj_seed, st.last_proj_step = apollo_seed, apollo_seed, -cfg.apollo_update_proj_gap
        if cfg.apollo_factorize:
            st.row_var_low, st.col_var_low = xp.zeros(lr_, np.float32), xp.zeros(lc_, np.float32)
            if cfg.beta3 is not None:
                nonneg("conf_row_low", lr_, cqt), nonneg("conf_col_low", lc_, cqt)
        else:
            nonneg("v_low", lr_ * lc_, cfg.v_quant_type)
            if cfg.beta3 is not None:
                nonneg("res_low", lr_ * lc_, cqt)
        if cfg.beta1 is not None:
            signed("m_low", lr_ * lc_)
        if cfg.enable_fira_for_apollo:
            st.fira_prev = fira.init(xp)
        return st
    if not is_sgd(cfg):
        if len(shape) >= 2 and cfg.factored:
            lead = math.prod(shape[:-2])
            nonneg("row_var", lead * shape[-2], cfg.v_quant_type), nonneg("col_var", lead * shape[-1], cfg.v_quant_type)
            if cfg.beta3 is not None:
                nonneg("conf_row", lead * shape[-2], cqt), nonneg("conf_col", lead * shape[-1], cqt)
        else:
            nonneg("variance", n, cfg.v_quant_type)
    if cfg.beta1 is not None:
        signed("m", n)
    if cfg.enable_fira_for_adafactor:
        st.fira_prev = fira.init(xp)
    if cfg.lag_norm:  # the previous step's update norm (0: no clip at the first step) and Fira factor
        st.prev_update_norm = xp.zeros(1, np.float32)
        if cfg.enable_fira_for_adafactor:
            st.lag_fira_scale = xp.ones(1, np.float32)
    return st


def load(xp, st, slot):
    """Exact float32 values of ``slot`` to update in place (the state array, or a decoded workspace copy)."""
    arr = getattr(st, slot)
    if arr is not None:
        return arr
    cfg, n = st.cfg, st.sizes[slot]
    out = workspace.get(xp, "slot_" + slot, n, np.float32)
    if slot in SIGNED:
        quant.m_decode(xp, getattr(st, f"{slot}_q"), getattr(st, f"{slot}_scale"), out, mblock=cfg.m_block_size,
                       fmt=cfg.m_quant_type)
    else:
        fmt = (cfg.c_quant_type or cfg.v_quant_type) if slot.startswith(("conf", "res")) else cfg.v_quant_type
        quant.al_decode(xp, getattr(st, f"{slot}_q"), getattr(st, f"{slot}_scale"), getattr(st, f"{slot}_min_log"),
                        out, block=cfg.block_size, fmt=fmt)
    return out


def store(xp, st, slot, values, *, floor: float) -> None:
    """Requantize ``values`` into a quantized slot (no-op for float32 slots, which were updated in place)."""
    if getattr(st, slot) is not None:
        return
    cfg = st.cfg
    if slot in SIGNED:
        quant.m_encode(xp, values, getattr(st, f"{slot}_q"), getattr(st, f"{slot}_scale"), mblock=cfg.m_block_size,
                       fmt=cfg.m_quant_type)
        return
    fmt = (cfg.c_quant_type or cfg.v_quant_type) if slot.startswith(("conf", "res")) else cfg.v_quant_type
    quant.al_encode(xp, values, getattr(st, f"{slot}_q"), getattr(st, f"{slot}_scale"),
                    getattr(st, f"{slot}_min_log"), block=cfg.block_size, fmt=fmt, floor=floor)


def ema(xp, st, slot, x, w: float, *, floor: float, square: bool = False, add: float = 0.0, first: bool = False):
    """slot ← lerp(slot, x', w) with x' = (x² if ``square`` else x) + ``add`` (x'·w at the ``first`` step), on the
    whole slot: ``ema_range`` over 0:n, the exact values of a quantized slot in a per-thread workspace."""
    n = st.sizes[slot]
    out = workspace.get(xp, "slot_" + slot, n, np.float32) if getattr(st, slot) is None else None
    return ema_range(xp, st, slot, 0, n, x, w, out, floor=floor, square=square, add=add, first=first)


def _ema_kernel(xp, st, slot, x, w, *, floor, square, add, first, out=None):
    cfg, n = st.cfg, st.sizes[slot]
    out = workspace.get(xp, "slot_" + slot, n, np.float32) if out is None else out
    x = xp.ascontiguousarray(x.reshape(-1))
    q, scale = getattr(st, f"{slot}_q"), getattr(st, f"{slot}_scale")
    if slot in SIGNED:
        k = kernels.get("adafactor8bit.cu", "a8_m_ema", x.dtype)
        fmt = ("uf8", "uf4", "d8", "d4").index(cfg.m_quant_type)
        mp = quant.qmap(xp, quant.m_bits(cfg.m_quant_type))
        k((scale.size,), (128,), (q, scale, x, out, np.int64(n), np.int32(cfg.m_block_size), np.int32(fmt),
                                  np.float32(w), mp, np.int32(mp.size)))
    else:
        k = kernels.get("adafactor8bit.cu", "a8_al_ema", x.dtype)
        k((scale.size,), (256,), (q, np.int32(q.dtype.itemsize * 8), scale, getattr(st, f"{slot}_min_log"), x, out,
                                  np.int64(n), np.int32(cfg.block_size), np.float32(w), np.int32(square),
                                  np.float32(add), np.float32(floor), np.int32(first)))
    return out


def align(st) -> int:
    """The chunk alignment of this state's elementwise slots: ``ema_range`` chunks start at multiples of it."""
    cfg = st.cfg
    return math.lcm(cfg.block_size, cfg.m_block_size)


def ema_range(xp, st, slot, lo: int, hi: int, x, w: float, out, *, floor: float, square: bool = False,
              add: float = 0.0, first: bool = False):
    """slot[lo:hi] ← lerp(slot[lo:hi], x', w) with x' = (x² if ``square`` else x) + ``add`` (x'·w at the ``first``
    step), x rounded to float32 before anything else (a float64 x too: the state is float32; the fused kernel
    rounds at the same point); ``lo`` a multiple of ``align(st)``, so the range covers whole codec blocks except at the slot's end.  The
    exact float32 values are written into ``out`` (length hi − lo; a float32 slot is updated in place instead) and
    returned; the stored codes of the range are requantized, those of other ranges untouched, so disjoint ranges may
    run on different threads (scratch is per thread).  On CuPy, for a quantized slot and ``use_cuda_kernel`` (unless
    ``FLATOPT_FORCE_TWIN``), the whole slot is one fused kernel launch (kernels/adafactor8bit.cu)."""
    n = hi - lo
    arr = getattr(st, slot)
    if arr is None and xp is not np and st.cfg.use_cuda_kernel and not backend.force_twin():
        if (lo, hi) != (0, st.sizes[slot]):
            raise ValueError(f"{slot}: the fused kernel updates a whole slot (CuPy steps one range)")
        return _ema_kernel(xp, st, slot, x, w, floor=floor, square=square, add=add, first=first, out=out)
    xin = x
    if x.dtype != np.float32:  # one rounding point, the fused kernel's: x to float32 first, then x², + add, lerp
        xin = workspace.get(xp, "a8.ema_in", n, np.float32)
        xin[...] = x
    if square or add:
        src, xin = xin, workspace.get(xp, "a8.ema_in", n, np.float32)
        xp.multiply(src, src, out=xin) if square else xin.__setitem__(Ellipsis, src)
        if add:  # (x² + 0 is x²: no pass for a zero)
            xp.add(xin, np.float32(add), out=xin)
    if arr is not None:
        v = arr[lo:hi]
    else:
        v = out
        _range_codec(xp, st, slot, lo, hi, v, decode=True)
    if first:
        xp.multiply(xin, np.float32(w), out=v)
    else:
        lerp_(xp, v, xin, w, workspace.get(xp, "a8.ema_tmp", n, np.float32))
    if arr is None:
        _range_codec(xp, st, slot, lo, hi, v, decode=False, floor=floor)
    return v


def _range_codec(xp, st, slot, lo, hi, v, *, decode: bool, floor: float = 0.0) -> None:
    cfg = st.cfg
    if slot in SIGNED:
        mb, fmt = cfg.m_block_size, cfg.m_quant_type
        nb = quant.nblocks(hi - lo, mb)
        per = 2 if quant.m_bits(fmt) == 4 else 1
        q = getattr(st, f"{slot}_q")[lo // per:(lo + nb * mb) // per]
        scale = getattr(st, f"{slot}_scale")[lo // mb:lo // mb + nb]
        if decode:
            quant.m_decode(xp, q, scale, v, mblock=mb, fmt=fmt)
        else:
            quant.m_encode(xp, v, q, scale, mblock=mb, fmt=fmt)
        return
    bs = cfg.block_size
    fmt = (cfg.c_quant_type or cfg.v_quant_type) if slot.startswith(("conf", "res")) else cfg.v_quant_type
    nb = quant.nblocks(hi - lo, bs)
    q = getattr(st, f"{slot}_q")[lo:lo + nb * bs]
    scale = getattr(st, f"{slot}_scale")[lo // bs:lo // bs + nb]
    min_log = getattr(st, f"{slot}_min_log")[lo // bs:lo // bs + nb]
    if decode:
        quant.al_decode(xp, q, scale, min_log, v, block=bs, fmt=fmt)
    else:
        quant.al_encode(xp, v, q, scale, min_log, block=bs, fmt=fmt, floor=floor)


def lerp_(xp, a, b, w: float, tmp):
    """a ← torch.lerp(a, b, w) in place (float32; torch's two-branch formula); ``tmp`` is scratch like ``a``."""
    w32 = np.float32(w)
    xp.subtract(b, a, out=tmp)
    if abs(w) < 0.5:
        xp.multiply(tmp, w32, out=tmp)
        xp.add(a, tmp, out=a)
    else:
        xp.multiply(tmp, np.float32(1.0) - w32, out=tmp)
        xp.subtract(b, tmp, out=a)
    return a

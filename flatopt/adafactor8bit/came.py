"""CAME confidence (Luo et al., "CAME: Confidence-guided Adaptive Memory Efficient Optimization"), as in
adafactor8bit 0.4.6 (its plain and APOLLO paths).

Given the clipped normalised update U and its momentum m (β1 EMA of U), the instability is
res = (U − m)² + eps_came.  Factored: the confidence vectors are β3 EMAs of the row/column means of res,
c̄ = max(mean(conf_row), floor) per leading index, and the step direction is m·rsqrt(conf_row/c̄)·rsqrt(conf_col).
Element-wise (APOLLO + CAME, not factorised): res_low ← β3 EMA of res, direction m·rsqrt(max(res_low, eps²)).
The confidence states may be AL-quantized; the exact float32 EMA drives this step and only the stored copy is
requantized (the original uses the requantized res_low on its CPU APOLLO path — not copied here).
"""

from __future__ import annotations

import numpy as np

from . import state as S
from . import quant
from .common import eps1_of

F32 = np.float32


def residual(xp, cfg, u, m) -> None:
    xp.subtract(u, m, out=u)
    xp.multiply(u, u, out=u)
    xp.add(u, F32(cfg.eps_came), out=u)


def factored_confidence(xp, cfg, st, u, m, dims, out, *, lo_rank: bool, mean_floor: float | None = None):
    """res from (u, m) (``u`` is overwritten), EMA of the confidence factors, ``out`` ← m·rsqrt(...)."""
    bsz, r_, c_ = dims
    residual(xp, cfg, u, m)
    res = u.reshape(bsz, r_, c_)
    res_row = res.mean(axis=-1).astype(np.float32).reshape(-1)
    res_col = res.mean(axis=-2).astype(np.float32).reshape(-1)
    inv_row, inv_col = confidence_factors(xp, cfg, st, res_row, res_col, dims, lo_rank=lo_rank, mean_floor=mean_floor)
    o3 = out.reshape(bsz, r_, c_)
    xp.multiply(m.reshape(bsz, r_, c_), inv_row[:, :, None], out=o3)
    xp.multiply(o3, inv_col[:, None, :], out=o3)
    return out


def confidence_factors(xp, cfg, st, res_row, res_col, dims, *, lo_rank: bool, mean_floor: float | None = None):
    """The confidence EMAs (row and column means of res, stored per the format) and their factors
    (rsqrt(c_row/mean(c_row)) of shape (bsz, r), rsqrt(c_col) of shape (bsz, c))."""
    bsz, r_, c_ = dims
    eps1 = eps1_of(cfg)
    rs, cs = ("conf_row_low", "conf_col_low") if lo_rank else ("conf_row", "conf_col")
    floor = quant.al_floor(eps1)
    c_row = S.ema(xp, st, rs, res_row, 1.0 - cfg.beta3, floor=floor)
    c_col = S.ema(xp, st, cs, res_col, 1.0 - cfg.beta3, floor=floor)
    fl = F32(eps1 if mean_floor is None else mean_floor)
    cbar = xp.maximum(c_row.reshape(bsz, r_).mean(axis=-1), fl).astype(np.float32)
    inv_row = F32(1.0) / xp.sqrt(c_row.reshape(bsz, r_) / cbar[:, None])
    inv_col = F32(1.0) / xp.sqrt(c_col.reshape(bsz, c_))
    return inv_row, inv_col


def elementwise_confidence(xp, cfg, st, u, m, out, *, eps_sq: float):
    """APOLLO + CAME without factorisation: res_low ← lerp(res_low, res, 1 − β3); out ← m·rsqrt(max(res_low, eps²))."""
    residual(xp, cfg, u, m)
    r = S.ema(xp, st, "res_low", u, 1.0 - cfg.beta3, floor=quant.al_floor(eps1_of(cfg)))
    xp.maximum(r, F32(eps_sq), out=out)
    xp.sqrt(out, out=out)
    xp.divide(F32(1.0), out, out=out)
    xp.multiply(m, out, out=out)
    return out

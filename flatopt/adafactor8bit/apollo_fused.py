"""The fused APOLLO step of ``Adafactor8Bit`` on a device (CuPy arrays, ``use_cuda_kernel`` and not
``FLATOPT_FORCE_TWIN``): ``apollo._update``'s step in the kernels of ``kernels/apollo8bit.cu`` around the projection
GEMM (CuPy's matmul, as in the twin).  Per step, for the default configuration (channel scaling, Fira, 8-bit v_low
and m_low): P's draw (none when ``apollo_cache_proj`` holds the current P), G's pass (sanitised float32 G, the
partial sums of G² and θ²), the GEMM, the two 8-bit EMA kernels of ``kernels/adafactor8bit.cu`` (float32 slots are
updated inside the next kernel instead), U_low with the partial sums of U_low² and G_low², the scalars (one block),
the update: 8 launches, no host synchronisation, no allocation once the per-thread workspaces exist.  CAME
(``beta3`` with ``beta1``) and ``apollo_factorize`` compute U_low with the twin's direction
(``apollo_lowrank._low_rank_direction``) and the fused kernels around it.

Bits: every elementwise operation is the twin's; the projection and the low-rank moments (their codes too) are the
twin's bits.  The sums (Σθ², the channel norms of G, U_low and G_low, the norm of the scaled update) are made in a
fixed order in double (kernels/apollo8bit.cu) where the twin uses NumPy's / CUB's float32 order: α, s, the norm and
so the step coefficient and the Fira state may differ from the twin's by the rounding of a float32 sum (a sum of at
most two terms cannot differ).  Deterministic (no atomics), independent of the other tensors of a batch.
"""

from __future__ import annotations

import math

import numpy as np

from . import apollo_lowrank, quant
from . import state as S
from ..core import backend, kernels, workspace
from .apollo_proj import shaped_ws
from .common import F32, rho_of, ws

# kernels/apollo8bit.cu's AP_THREADS (threads of the launches with partial sums) and AP_SCALAR_THREADS (ap_scalars,
# one block), and the span of its sums' layouts: CHUNK columns per block (ROW layout), TILE rows per block (COL
# layout).  The order of every sum is a function of the shape and these constants.
THREADS, SCALAR_THREADS, CHUNK, TILE = 256, 1024, 4096, 64
_FILE = "apollo8bit.cu"
# flags of ap_scalars
SCALE_PARAM, NEED_NORM, FIRA, FRONT, DECAY, SCALE_WD, CLIP, BIAS = (1 << i for i in range(8))


def enabled(xp, cfg) -> bool:
    return xp is not np and cfg.use_cuda_kernel and not backend.force_twin()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layout(rows: int, cols: int, col: bool) -> tuple[int, int]:
    """(blocks, partials) of the ROW (``col`` False) or COL layout over a rows×cols matrix (kernels/apollo8bit.cu)."""
    if col:
        tiles = _cdiv(rows, TILE)
        return tiles * _cdiv(cols, THREADS), tiles * cols
    nch = _cdiv(cols, CHUNK)
    return rows * nch, rows * nch


def _span(col: bool):
    return np.int64(TILE if col else CHUNK)


def _parts(xp, key: str, n: int, want: bool):
    return workspace.get(xp, key, n, np.float64) if want else None


def update(xp, cfg, st, p, g, *, t: int, lr, shape, projector) -> None:
    """One APOLLO step (``apollo._update``'s rule) with the fused kernels; ``p`` updated in place, ``g`` only read."""
    r_, c_, right, _ = S.apollo_shape(shape)
    rank, n = cfg.apollo_rank, p.size
    b = 1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay)
    projector.refresh(st, t, cfg.apollo_update_proj_gap)
    need_norm = cfg.enable_fira_for_apollo or cfg.d > 0
    chan = 0 if cfg.apollo_scale_type == "tensor" else (1 if right else 2)
    col = chan == 2
    pt, draws = projector.prepare(xp, st, rank, r_, c_, right, cfg.apollo_cache_proj, fused=True)
    for job in draws:
        job()
    projector.keep(st, pt, cfg.apollo_cache_proj)

    # G's pass: the GEMM's float32 input and the partial sums of G² and θ²
    g32, gm = shaped_ws(xp, "g32", (r_, c_))
    nb, npart = _layout(r_, c_, col)
    part_g = _parts(xp, "a8.ap_part_g", npart, need_norm)
    part_p = _parts(xp, "a8.ap_part_p", npart, cfg.scale_parameter)
    k = kernels.get(_FILE, "ap_grad", g.dtype)
    k((nb,), (THREADS,), (g, g32, p, part_g, part_p, np.int64(r_), np.int64(c_), np.int32(col), _span(col),
                          np.int32(cfg.maximize)))

    lr_, lc_ = (r_, rank) if right else (rank, c_)
    flat, glow = shaped_ws(xp, "a_glow", (lr_, lc_))
    xp.matmul(gm, pt, out=glow) if right else xp.matmul(pt, gm, out=glow)

    # U_low and the partial sums of U_low² and G_low²
    lnb, lpart = _layout(lr_, lc_, col)
    part_u = _parts(xp, "a8.ap_part_u", lpart, True)
    part_l = _parts(xp, "a8.ap_part_l", lpart, True)
    v = m = u_in = None
    v_ema = m_mode = 0
    if cfg.apollo_factorize or (cfg.beta3 is not None and cfg.beta1 is not None):
        u_in = ws(xp, "a_upd", flat.size)
        apollo_lowrank.direction(xp, cfg, st, glow, u_in, ws(xp, "a_tmp", flat.size), b, t, False, row_norms=False)
    else:
        if st.v_low is None:  # 8-bit: the fused EMA kernel (adafactor8bit.cu) gives the exact values
            v = S.ema(xp, st, "v_low", flat, b, square=True, first=t == 1, floor=quant.al_floor(cfg.apollo_eps))
        else:
            v, v_ema = st.v_low, 1
        if cfg.beta1 is not None:
            if st.m_low is None:
                m, m_mode = S.ema(xp, st, "m_low", flat, 1.0 - cfg.beta1, floor=0.0), 1
            else:
                m, m_mode = st.m_low, 2
    k = kernels.get(_FILE, "ap_lowrank", np.float32)
    k((lnb,), (THREADS,), (flat, v, m, u_in, part_u, part_l, np.int64(lr_), np.int64(lc_), np.int32(col),
                           _span(col), np.int32(v_ema), np.int32(m_mode), np.int32(t == 1), F32(b),
                           F32(0.0 if cfg.beta1 is None else 1.0 - cfg.beta1), F32(cfg.apollo_eps)))

    # the scalars (one block), then θ ← θ·decay + G·cs
    nk = 1 if chan == 0 else (r_ if chan == 1 else c_)
    cs = ws(xp, "a8.ap_cs", nk + 1)
    fira = cfg.enable_fira_for_apollo
    bias = None
    if cfg.beta1 is not None and not cfg.relative_step and cfg.bias_correction is not False:
        bc1 = 1.0 - cfg.beta1**t
        bias = F32(math.sqrt(1.0 - cfg.beta2**t) / bc1 if cfg.beta2 is not None else 1.0 / bc1)
    flags = sum(f for f, on in ((SCALE_PARAM, cfg.scale_parameter), (NEED_NORM, need_norm), (FIRA, fira),
                                (FRONT, cfg.apollo_scale_front), (DECAY, cfg.weight_decay != 0),
                                (SCALE_WD, cfg.scale_weight_decay), (CLIP, cfg.d > 0), (BIAS, bias is not None)) if on)
    k = kernels.get(_FILE, "ap_scalars", np.float32)
    k((1,), (SCALAR_THREADS,), (part_p, part_g, part_u, part_l, cs, st.fira_prev if fira else None, np.int64(r_),
                                np.int64(c_), np.int64(lr_), np.int64(lc_), _span(col), np.int32(chan),
                                np.int32(flags), rho_of(cfg, t, lr), F32(math.sqrt(n)), F32(cfg.eps[1]),
                                F32(math.sqrt(cfg.apollo_scale)), F32(1.0 + cfg.fira_margin),
                                F32(math.sqrt(n) * cfg.d), F32(cfg.weight_decay), F32(1.0) if bias is None else bias))
    k = kernels.get(_FILE, "ap_apply", p.dtype)
    backend.launch(k, n, (p, g32, cs, np.int64(n), np.int64(c_), np.int64(nk), np.int32(chan),
                          np.int32(cfg.weight_decay != 0)))

"""APOLLO (Zhu et al., "APOLLO: SGD-like Memory, AdamW-level Performance") as in adafactor8bit 0.4.6:
a random projector and the low-rank update of ``Adafactor8Bit``.

**Projector.**  For the 2-D view G (R×C; > 2-D reshaped to (shape[0], −1)): R ≥ C ("right"): P is r×C and
G_low = G·Pᵀ (R×r); otherwise ("left") P is R×r and G_low = Pᵀ·G (r×C).  P = N(0, 1)/√r drawn from the parameter's
``current_proj_seed``.  Seeds come from an optimizer-wide counter starting at 1, handed out in the order APOLLO
parameters are first stepped.  Refresh when t − last_proj_step ≥ gap (steps 1, 1 + gap, ...): current_proj_seed :=
apollo_seed, apollo_seed := next_seed(current_proj_seed).  Moments are not reset on refresh.

The projector (seeds, the default draw, the ``apollo_proj_fn`` hook) is ``flatopt.adafactor8bit.apollo_proj``; the low-rank
moments and direction U_low are ``flatopt.adafactor8bit.apollo_lowrank``.  This module is the twin (NumPy, and CuPy
under ``use_cuda_kernel=False`` or ``FLATOPT_FORCE_TWIN=1``); on a device the step is ``apollo_fused`` (the kernels
of ``kernels/apollo8bit.cu`` around the same GEMM: the same elementwise bits, its sums in another fixed order).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import state as S
from . import apollo_fused, apollo_lowrank, fira
from ..core import blocks, parallel, shards, workspace
from .apollo_lowrank import row_tasks
from .apollo_proj import ApolloProjector
from .common import F32, alpha_rho, grad32, sumsq, ws


# Elements of G per projection-GEMM task.  A GEMM cut into short row ranges repacks P for every range, so the
# ranges are longer than the elementwise ``TASK``.  Re-measure: ``python -m benchmarks.threads_probe apollo``.
GEMM_TASK = 1 << 20


def _project(xp, gm, pt, glow, right: bool, threads: bool) -> None:
    """G_low = G·Pᵀ ("right") or Pᵀ·G ("left") into ``glow``.  NumPy: cut by the shape alone into row ranges of G
    ("right") or column ranges ("left") of about ``GEMM_TASK`` elements — the same GEMMs in every mode (an uncut
    GEMM gave other bits than the cut ones), run on our threads when ``threads`` (with the BLAS capped)."""
    if xp is not np:
        xp.matmul(gm, pt, out=glow) if right else xp.matmul(pt, gm, out=glow)
        return
    if right:
        row_tasks(xp, gm.shape[0], gm.shape[1], lambda i0, i1: np.matmul(gm[i0:i1], pt, out=glow[i0:i1]), threads,
                   GEMM_TASK)
        return
    rows, cols = gm.shape
    step = max(1, GEMM_TASK // max(rows, 1))
    tasks = [((min(j + step, cols) - j) * rows, "apollo",
              functools.partial(lambda j0, j1: np.matmul(pt, gm[:, j0:j1], out=glow[:, j0:j1]), j, min(j + step, cols)))
             for j in range(0, cols, step)]
    parallel.run_tasks(tasks, serial=not threads)


def update(xp, cfg, st, p, g, *, t: int, lr, shape, projector: ApolloProjector, threads: bool = False) -> None:
    """See ``_update``; with ``threads`` on NumPy the BLAS is capped at one thread for the step (``threadpoolctl``
    when installed, as for Muon): the projection GEMM is cut into row ranges on our threads instead, and no idle
    BLAS worker spins against the elementwise passes (after a threaded GEMM they ran no faster on two threads
    than on one; re-measure: ``python -m benchmarks.threads_probe spin``).  On a device with
    ``use_cuda_kernel`` (unless ``FLATOPT_FORCE_TWIN``) the step is ``apollo_fused.update`` (the fused kernels)."""
    if apollo_fused.enabled(xp, cfg):
        apollo_fused.update(xp, cfg, st, p, g, t=t, lr=lr, shape=shape, projector=projector)
        return
    with shards.blas_capped(xp is np) as capped:
        _update(xp, cfg, st, p, g, t=t, lr=lr, shape=shape, projector=projector, threads=threads, capped=capped)


def _update(xp, cfg, st, p, g, *, t: int, lr, shape, projector: ApolloProjector, threads: bool,
            capped: bool) -> None:
    """One APOLLO step of Adafactor8Bit (non-finite gradient entries are read as 0, as in the original).  With
    ``threads`` (NumPy): P's blocks are drawn on the workers while the caller makes the passes over G and θ (Σθ²;
    G's channel norms or ‖G‖², which double as its finiteness check), then joins the draw; the projection GEMM
    (``_project``), the low-rank moments and θ·decay + G·(coef·s) run over ranges on all threads; the bits do not
    depend on it."""
    r_, c_, right, _ = S.apollo_shape(shape)
    b = 1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay)
    projector.refresh(st, t, cfg.apollo_update_proj_gap)
    need_norm = cfg.enable_fira_for_apollo or cfg.d > 0
    got = {}
    pt, draws = projector.prepare(xp, st, cfg.apollo_rank, r_, c_, right, cfg.apollo_cache_proj)

    def g_stat(g32):  # G's squared channel norms (channel) or ‖G‖² (tensor)
        if cfg.apollo_scale_type == "channel":
            return _channel_sumsq(xp, g32.reshape(r_, c_), right, False)
        return sumsq(xp, g32)

    def g_passes():
        got["ar"] = alpha_rho(xp, cfg, p, t, lr)
        if need_norm and xp is np and g.dtype == np.float32 and not cfg.maximize:
            # the statistic of G as given doubles as the finiteness check of grad32 (a non-finite entry, or an
            # overflowing square, makes it non-finite: then G is sanitised and it is measured again)
            stat = g_stat(g)
            if np.isfinite(np.add.reduce(stat, axis=None)):
                got["g32"], got["ng2"] = g, stat
                return
        got["g32"] = g32 = grad32(xp, cfg, g, nan_to_zero=True, writable=False)
        if need_norm:
            got["ng2"] = g_stat(g32)

    if xp is np:  # P's blocks on the workers while the caller makes the passes over G and θ, then joins them
        parallel.run_beside_tasks(g_passes, draws, serial=not threads)
    else:
        for job in (*draws, g_passes):
            job()
    projector.keep(st, pt, cfg.apollo_cache_proj)
    g32, (alpha, rho) = got["g32"], got["ar"]
    gm = g32.reshape(r_, c_)
    lr_, lc_ = (r_, cfg.apollo_rank) if right else (cfg.apollo_rank, c_)
    nl = lr_ * lc_
    glow = ws(xp, "a_glow", nl).reshape(lr_, lc_)
    _project(xp, gm, pt, glow, right, threads and capped)
    upd_low = ws(xp, "a_upd", nl)
    tmp = ws(xp, "a_tmp", nl)
    norms = apollo_lowrank.direction(xp, cfg, st, glow, upd_low, tmp, b, t, threads,
                                      row_norms=right and cfg.apollo_scale_type == "channel")
    # scaling factor s: per channel (norm over the low-rank axis) or for the whole tensor
    u2 = upd_low.reshape(lr_, lc_)
    if norms is not None:  # ‖U_low,i‖², ‖G_low,i‖², measured by the range tasks
        s = np.sqrt(norms[0]).reshape(lr_, 1) / (np.sqrt(norms[1]).reshape(lr_, 1) + F32(1e-8))
    elif cfg.apollo_scale_type == "channel":
        spec = "ij,ij->i" if right else "ij,ij->j"
        shp = (lr_, 1) if right else (1, lc_)
        s = xp.sqrt(xp.einsum(spec, u2, u2)).reshape(shp) / (xp.sqrt(xp.einsum(spec, glow, glow)).reshape(shp)
                                                              + F32(1e-8))
    else:
        s = xp.sqrt(sumsq(xp, upd_low)) / (xp.sqrt(sumsq(xp, glow.reshape(-1))) + F32(1e-8))
    s = s.astype(np.float32)
    sq = F32(math.sqrt(cfg.apollo_scale))
    if cfg.apollo_scale_front:
        s = s * sq
    if need_norm:
        if cfg.apollo_scale_type == "channel":
            nrm = xp.sqrt(xp.sum(got["ng2"].reshape(s.shape) * (s * s)))
        else:
            nrm = xp.sqrt(got["ng2"]) * s
        nrm = xp.asarray(nrm, dtype=np.float32)
    final = s * fira.factor(xp, st.fira_prev, nrm, cfg.fira_margin) if cfg.enable_fira_for_apollo else s
    if not cfg.apollo_scale_front:
        final = final * sq
    coef = -alpha
    if cfg.d > 0:
        coef = coef / xp.maximum(nrm / F32(math.sqrt(p.size) * cfg.d), F32(1.0))
    decay = None
    if cfg.weight_decay != 0:
        c = alpha if cfg.scale_weight_decay else rho
        decay = F32(1.0) - c * F32(cfg.weight_decay)
    if cfg.beta1 is not None and not cfg.relative_step and cfg.bias_correction is not False:
        bc1 = 1.0 - cfg.beta1**t
        coef = coef * F32(math.sqrt(1.0 - cfg.beta2**t) / bc1 if cfg.beta2 is not None else 1.0 / bc1)
    # p + (coef·G)·s in torch's addcmul; here G·(coef·s): one pass less.  Per channel, cs is (R, 1) or (1, C)
    cs = xp.asarray(coef * final, dtype=np.float32)
    pm = p.reshape(r_, c_)

    per_row = cfg.apollo_scale_type == "channel" and right  # cs is (R, 1); (1, C) on the left; a scalar (tensor)

    def apply(i0, i1):
        out = workspace.get(xp, "a8.apollo_upd", (i1 - i0) * c_, np.float32).reshape(i1 - i0, c_)
        if per_row and xp is np:  # one factor per row: einsum's loop beats ufunc broadcasting (threads_probe apollo)
            np.einsum("ij,i->ij", gm[i0:i1], cs[i0:i1, 0], out=out)
        else:
            xp.multiply(gm[i0:i1], cs[i0:i1] if per_row else cs, out=out)
        pb = pm[i0:i1]
        if decay is not None:
            xp.multiply(pb, decay, out=pb, casting="unsafe")
        xp.add(pb, out, out=pb, casting="unsafe")

    row_tasks(xp, r_, c_, apply, threads)


def _channel_sumsq(xp, gm, right: bool, threads: bool):
    """Σ_j G_ij² per row ("right") or Σ_i G_ij² per column, over row ranges (column sums folded in range order)."""
    r_, c_ = gm.shape
    if right:
        if xp is not np:  # one range; cupy.einsum has no out= (it raises TypeError)
            return xp.einsum("ij,ij->i", gm, gm)
        out = xp.empty(r_, np.float32)
        row_tasks(xp, r_, c_, lambda i0, i1: xp.einsum("ij,ij->i", gm[i0:i1], gm[i0:i1], out=out[i0:i1]), threads)
        return out
    parts = {}

    def part(i0, i1):
        parts[i0] = xp.einsum("ij,ij->j", gm[i0:i1], gm[i0:i1])

    row_tasks(xp, r_, c_, part, threads)
    return blocks.fold_keyed(parts)



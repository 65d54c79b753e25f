"""APOLLO (Zhu et al., "APOLLO: SGD-like Memory, AdamW-level Performance") as in adafactor8bit 0.4.6 (§6 of
``reference/adafactor8bit.md``): a random projector and the low-rank update of ``Adafactor8Bit``.

**Projector.**  For the 2-D view G (R×C; > 2-D reshaped to (shape[0], −1)): R ≥ C ("right"): P is r×C and
G_low = G·Pᵀ (R×r); otherwise ("left") P is R×r and G_low = Pᵀ·G (r×C).  P = N(0, 1)/√r drawn from the parameter's
``current_proj_seed``.  Seeds come from an optimizer-wide counter starting at 1, handed out in the order APOLLO
parameters are first stepped.  Refresh when t − last_proj_step ≥ gap (steps 1, 1 + gap, ...): current_proj_seed :=
apollo_seed, apollo_seed := next_seed(current_proj_seed).  Moments are not reset on refresh.

``ApolloProjector(proj_fn, next_seed)`` is the documented hook for exact comparisons (a testing aid):
``proj_fn(seed, shape) -> array`` returns the *unscaled* N(0, 1) matrix and ``next_seed(seed) -> int`` advances a
seed; ``proj_fn`` may be called from a flatopt worker thread (one call at a time per parameter).  The defaults use NumPy's PCG64 (``default_rng(seed)``) on NumPy arrays and CuPy's generator on CuPy arrays —
not bit-compatible with the original's torch generators, nor with each other; tests inject torch-generated P and
the original's ``next_seed``.  P is regenerated every step unless ``apollo_cache_proj`` (then it is kept in memory,
never in the checkpoint, and rebuilt from the seed after a load).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _a8_state as S
from . import _blocks, _came, _fira, _parallel, _shards, _workspace
from ._a8_common import F32, TASK, alpha_rho, clip_, grad32, m_ema, ranges, sumsq, ws
from . import quant


def _default_proj(seed: int, shape, xp=np):
    if xp is np:
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return xp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)


def _default_next_seed(seed: int) -> int:
    return int(np.random.default_rng(seed).integers(0, 2**63 - 1))


class ApolloProjector:
    """Seeded APOLLO projection matrices with an injectable source (see the module docstring)."""

    def __init__(self, proj_fn=None, next_seed=None):
        self.proj_fn = proj_fn
        self.next_seed = next_seed or _default_next_seed

    def refresh(self, st, t: int, gap: int) -> bool:
        if t - st.last_proj_step >= gap:
            st.current_proj_seed = int(st.apollo_seed)
            st.apollo_seed = int(self.next_seed(st.current_proj_seed))
            st.last_proj_step = t
            st.proj = None
            return True
        return False

    def matrix(self, xp, st, rank: int, r_: int, c_: int, right: bool, cache: bool):
        """Pᵀ (C×r for "right", r×R for "left"), float32 (a transposed view of P/√r)."""
        if st.proj is not None and st.proj[0] == st.current_proj_seed:
            return st.proj[1]
        shape = (rank, c_) if right else (r_, rank)
        raw = self.proj_fn(st.current_proj_seed, shape) if self.proj_fn else _default_proj(st.current_proj_seed,
                                                                                              shape, xp)
        raw = xp.array(raw, dtype=np.float32, copy=True)  # (never write into a caller's array)
        xp.divide(raw, F32(math.sqrt(rank)), out=raw)
        pt = raw.T  # a transposed view: BLAS reads it in place
        if cache:
            st.proj = (st.current_proj_seed, pt)
        return pt


def _row_tasks(xp, rows: int, cols: int, fn, threads: bool) -> None:
    """fn(i0, i1) over row ranges of about ``TASK`` elements (cut by the shape alone, so every reduction a range
    makes is folded in the same order whatever the threads), on the threads when ``threads`` (NumPy; the caller
    must not itself be a worker task), else inline; CuPy: one range."""
    if xp is not np:
        fn(0, rows)
        return
    step = max(1, TASK // max(cols, 1))
    tasks = [((min(i + step, rows) - i) * cols, "apollo", functools.partial(fn, i, min(i + step, rows)))
             for i in range(0, rows, step)]
    _parallel.run_tasks(tasks, serial=not threads)


def update(xp, cfg, st, p, g, *, t: int, lr, shape, projector: ApolloProjector, threads: bool = False) -> None:
    """See ``_update``; with ``threads`` on NumPy the BLAS is capped at one thread for the step (``threadpoolctl``
    when installed, as for Muon): the projection GEMM is cut into row ranges on our threads instead, and no idle
    BLAS worker spins against the elementwise passes (measured: they ran no faster on two threads than on one
    after a threaded GEMM; with the cap the low-rank passes went 13.0 -> 7.6 ms)."""
    with _shards.blas_capped(threads and xp is np) as capped:
        _update(xp, cfg, st, p, g, t=t, lr=lr, shape=shape, projector=projector, threads=threads, capped=capped)


def _update(xp, cfg, st, p, g, *, t: int, lr, shape, projector: ApolloProjector, threads: bool,
            capped: bool) -> None:
    """One APOLLO step of Adafactor8Bit (non-finite gradient entries are read as 0, as in the original).  With
    ``threads`` (NumPy): P is drawn on a worker while the caller makes the passes over G and θ (its sanitising
    check, Σθ², G's channel norms), and θ·decay + G·(coef·s) runs over row ranges on all threads
    (``_row_tasks``); the bits do not depend on it."""
    r_, c_, right, _ = S.apollo_shape(shape)
    b = 1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay)
    projector.refresh(st, t, cfg.apollo_update_proj_gap)
    need_norm = cfg.enable_fira_for_apollo or cfg.d > 0
    got = {}

    def make_proj():  # P's generation (single-threaded in NumPy, GIL released) beside the passes over G and θ
        got["pt"] = projector.matrix(xp, st, cfg.apollo_rank, r_, c_, right, cfg.apollo_cache_proj)

    def g_passes():
        got["g32"] = g32 = grad32(xp, cfg, g, nan_to_zero=True, writable=False)
        got["ar"] = alpha_rho(xp, cfg, p, t, lr)
        if need_norm and cfg.apollo_scale_type == "channel":
            got["ng2"] = _channel_sumsq(xp, g32.reshape(r_, c_), right, False)

    if xp is np:
        _parallel.run_beside(make_proj, g_passes, serial=not threads)
    else:
        make_proj()
        g_passes()
    pt, g32, (alpha, rho) = got["pt"], got["g32"], got["ar"]
    gm = g32.reshape(r_, c_)
    lr_, lc_ = (r_, cfg.apollo_rank) if right else (cfg.apollo_rank, c_)
    nl = lr_ * lc_
    glow = ws(xp, "a_glow", nl).reshape(lr_, lc_)
    if right and xp is np:  # row ranges of G (the same GEMMs in every mode), on our threads when ``threads``
        _row_tasks(xp, r_, c_, lambda i0, i1: np.matmul(gm[i0:i1], pt, out=glow[i0:i1]), threads and capped)
    else:
        xp.matmul(gm, pt, out=glow) if right else xp.matmul(pt, gm, out=glow)
    upd_low = ws(xp, "a_upd", nl)
    tmp = ws(xp, "a_tmp", nl)
    if xp is np and not cfg.apollo_factorize and not (cfg.beta3 is not None and cfg.beta1 is not None):
        _plain_direction_ranges(cfg, st, glow.reshape(-1), upd_low, tmp, b, t, threads)
    else:
        _low_rank_direction(xp, cfg, st, glow, upd_low.reshape(lr_, lc_), tmp, b, t)
    # scaling factor s: per channel (norm over the low-rank axis) or for the whole tensor
    u2 = upd_low.reshape(lr_, lc_)
    if cfg.apollo_scale_type == "channel":
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
            nrm = xp.sqrt(sumsq(xp, g32)) * s
        nrm = xp.asarray(nrm, dtype=np.float32)
    final = s * _fira.factor(xp, st.fira_prev, nrm, cfg.fira_margin) if cfg.enable_fira_for_apollo else s
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

    def apply(i0, i1):
        out = _workspace.get(xp, "a8.apollo_upd", (i1 - i0) * c_, np.float32).reshape(i1 - i0, c_)
        xp.multiply(gm[i0:i1], cs[i0:i1] if cs.ndim == 2 and cs.shape[0] == r_ else cs, out=out)
        pb = pm[i0:i1]
        if decay is not None:
            xp.multiply(pb, decay, out=pb, casting="unsafe")
        xp.add(pb, out, out=pb, casting="unsafe")

    _row_tasks(xp, r_, c_, apply, threads)


def _channel_sumsq(xp, gm, right: bool, threads: bool):
    """Σ_j G_ij² per row ("right") or Σ_i G_ij² per column, over row ranges (column sums folded in range order)."""
    r_, c_ = gm.shape
    if right:
        out = xp.empty(r_, np.float32)
        _row_tasks(xp, r_, c_, lambda i0, i1: xp.einsum("ij,ij->i", gm[i0:i1], gm[i0:i1], out=out[i0:i1]), threads)
        return out
    parts = {}

    def part(i0, i1):
        parts[i0] = xp.einsum("ij,ij->j", gm[i0:i1], gm[i0:i1])

    _row_tasks(xp, r_, c_, part, threads)
    first, *rest = (parts[i0] for i0 in sorted(parts))
    return _blocks.fold(rest, first)


def _low_rank_direction(xp, cfg, st, glow, out, tmp, b: float, t: int) -> None:
    """The low-rank adaptive direction U_low (written into ``out``), updating the low-rank moments."""
    lr_, lc_ = glow.shape
    flat, o = glow.reshape(-1), out.reshape(-1)
    ae = F32(cfg.apollo_eps)
    if cfg.apollo_factorize:
        g2 = xp.multiply(glow, glow, out=tmp.reshape(lr_, lc_))
        rm = (g2.mean(axis=-1) + F32(quant.FLT_MIN)).astype(np.float32)
        cm = (g2.mean(axis=-2) + F32(quant.FLT_MIN)).astype(np.float32)
        rv, cv = st.row_var_low, st.col_var_low
        for v, x in ((rv, rm), (cv, cm)):
            if t == 1:
                xp.multiply(x, F32(b), out=v)
            else:
                xp.multiply(v, F32(1.0 - b), out=v)
                xp.add(v, x * F32(b), out=v)
        if cfg.beta1 is not None and cfg.beta3 is not None:
            rbar = xp.maximum(rv.mean(), F32(quant.FLT_MIN))
            u = xp.multiply(glow, (F32(1.0) / xp.sqrt(rv / rbar))[:, None], out=tmp.reshape(lr_, lc_))
            xp.multiply(u, (F32(1.0) / xp.sqrt(cv))[None, :], out=u)
            clip_(xp, tmp, cfg.d)
            m = m_ema(xp, st, "m_low", tmp, cfg.beta1, o)
            _came.factored_confidence(xp, cfg, st, tmp, m, (1, lr_, lc_), o, lo_rank=True,
                                      mean_floor=quant.FLT_MIN)
            return
        vest = (rv[:, None] * cv[None, :]) / xp.maximum(rv.mean(), ae)
        src = m_ema(xp, st, "m_low", flat, cfg.beta1, tmp) if cfg.beta1 is not None else flat
        xp.divide(src.reshape(lr_, lc_), xp.sqrt(vest) + ae, out=out)
        return
    v = S.ema(xp, st, "v_low", flat, b, square=True, first=t == 1, floor=quant.al_floor(cfg.apollo_eps))
    if cfg.beta3 is not None and cfg.beta1 is not None:
        eps_sq = max(cfg.apollo_eps**2, quant.FLT_MIN)
        xp.maximum(v, F32(eps_sq), out=tmp)
        xp.sqrt(tmp, out=tmp)
        xp.divide(F32(1.0), tmp, out=tmp)
        xp.multiply(flat, tmp, out=tmp)
        clip_(xp, tmp, cfg.d)
        m = m_ema(xp, st, "m_low", tmp, cfg.beta1, o)
        _came.elementwise_confidence(xp, cfg, st, tmp, m, o, eps_sq=eps_sq)
        return
    src = m_ema(xp, st, "m_low", flat, cfg.beta1, o) if cfg.beta1 is not None else flat
    xp.sqrt(v, out=tmp)
    xp.add(tmp, ae, out=tmp)
    xp.divide(src, tmp, out=o)


def _plain_direction_ranges(cfg, st, flat, o, tmp, b: float, t: int, threads: bool) -> None:
    """NumPy, the plain path (no factorization, no CAME): v ← EMA of G_low², m ← EMA of G_low, U_low = m/(√v + ε)
    over ranges aligned to the codec blocks, on the threads when ``threads`` (elementwise, blockwise codecs: the
    same bits as the whole-slot ``_low_rank_direction``)."""
    n, ae = flat.size, F32(cfg.apollo_eps)
    vx = ws(np, "a_vlow", n) if st.v_low is None else None  # exact values of a quantized state
    mx = ws(np, "a_mlow", n) if cfg.beta1 is not None and st.m_low is None else None
    floor = quant.al_floor(cfg.apollo_eps)

    def task(lo, hi):
        v = S.ema_range(np, st, "v_low", lo, hi, flat[lo:hi], b, None if vx is None else vx[lo:hi], floor=floor,
                        square=True, first=t == 1)
        src = flat[lo:hi]
        if cfg.beta1 is not None:
            src = S.ema_range(np, st, "m_low", lo, hi, src, 1.0 - cfg.beta1, None if mx is None else mx[lo:hi],
                              floor=0.0)
        tb = tmp[lo:hi]
        np.sqrt(v, out=tb)
        np.add(tb, ae, out=tb)
        np.divide(src, tb, out=o[lo:hi])

    _parallel.run_tasks([(c, "apollo", functools.partial(task, lo, hi)) for c, lo, hi in ranges(np, n, S.align(st))],
                        serial=not threads)

"""The fused CUDA steps of ``Adafactor8Bit``'s non-APOLLO paths (private; kernels ``a8f_*`` of
``kernels/adafactor8bit.cu``).  The twin — the array-agnostic code of ``adafactor8bit.paths`` / ``flat`` run with
CuPy arrays — defines what is correct; ``use_cuda_kernel=False`` or ``FLATOPT_FORCE_TWIN=1`` runs it instead.

Launches per step, on the current stream, no host synchronisation (every data-dependent scalar — Σθ², α, ΣU², the
clip — is made by ``a8f_scalars`` into a 4-float device array that the later kernels read):

* factored (Adafactor, optionally with the first moment): ``a8f_rows`` (row sums of G², the row EMA, 1/R, Σθ² per
  row) → [``a8f_m_step``: m ← lerp(m, G, 1 − β1), requantized] → ``a8f_col_parts`` (column sums of G² and
  W = Σ_i G²/R_i, or Σ_i m²/R_i, over 64 rows at a time) → ``a8f_col_fin`` (the partials folded in order, the column
  EMA) → ``a8f_al_encode`` (R and C requantized; none when both are float32) → ``a8f_factors`` (per matrix: r̄, the
  factors, its share of ΣU²) → ``a8f_scalars`` (ΣU², α, the step scale, the decay) → ``a8f_apply``: 7–8 launches;
* CAME: the same statistics, factors and scalars (mode 1: the RMS clip of U instead of a step scale),
  ``a8f_m_step`` (U formed, m ← lerp(m, U, 1 − β1) requantized, U − m kept), ``a8f_rows``, ``a8f_col_parts``,
  ``a8f_col_fin`` over (U − m)² with the confidence EMAs, ``a8f_al_encode``, ``a8f_factors`` (the confidence
  factors), ``a8f_apply`` on m: 13 launches (with Fira 15: ``a8f_usq_rows``, the rows' shares of ΣU² of the step,
  and ``a8f_scalars`` for the limiter);
* elementwise (Adam- or Adafactor-style): the second moment (``a8_al_ema``, or the float32 state updated inside the
  next kernel), [``a8f_m_step``], ``a8f_flat_u`` (U and the partials of ΣU² and Σθ² per 4096 elements),
  ``a8f_scalars``, ``a8f_flat_apply``: 4–5 launches; the momentum-only rule (1-D with ``beta1``, by default) adds
  ``a8f_scalars`` (the clip) and ``a8f_m_step`` (m ← lerp(m, U/clip, 1 − β1), the step is m) after ``a8f_flat_u``:
  5–6 launches; SGD mode (no second moment) likewise: 3–4 launches.

In a ``step_batch`` the default factored step and the elementwise step with a float32 second moment (both without a
first moment) run segmented over all tensors of a group instead (``adafactor8bit.segmented``: the same device
functions, the same bits, one launch per pass for the group).

Not fused (the twin runs): APOLLO (``adafactor8bit.apollo``) and ``use_cuda_kernel=False``.  ``maximize``,
``lag_norm`` and the Fira limiter (its state ``fira_prev``, ``prev_update_norm``, ``lag_fira_scale`` updated on the
device by ``a8f_scalars``) are fused.  Scratch is the calling thread's workspace (``core.workspace``, keys
``a8k.*``): nothing is allocated per step once it has grown.

Bits.  Every elementwise operation is the twin's in the twin's order and precision (a float32 state combined with
float32 or float64 operands as NumPy/CuPy promote them; compiled with ``--fmad=false``), and the codecs are the
twin's (``a8_codec.cuh``).  The sums are not in the twin's order (its CuPy reductions add in CUB's or NumPy's
order; the kernels use fixed per-thread strides, a shared-memory tree and partials folded in a fixed order, all
chosen from the sizes only, so the same inputs give the same bits whatever else is in the batch): the row and
column sums of G² (and of (U − m)² for CAME), W, r̄, Σθ², ΣU² and Σm².  Each differs from the twin's by a few ulps
of the sum; through the EMAs, factors, α and the clip that moves a state's value by a few ulps, which can flip an
8-bit code whose value lies within those ulps of a rounding boundary (the elements that code scales then move by up
to one quantization level of their update), and θ by a few ulps per step.  When those sums are exact (e.g. dyadic
inputs on shapes whose rows and columns have at most two entries) and no data-dependent scalar is needed (``d = 0``,
``scale_parameter=False``) the fused step gives the twin's bits and codes exactly; ``tests/test_adafactor8bit_fused.py``
checks both cases.  One more, theoretical, difference: the twin's state kernels choose torch.lerp's branch on
|float32(w)| < 0.5 and its array code on |w| < 0.5; the fused kernels use the latter (they differ for w within 3e-8
below 0.5 only).
"""

from __future__ import annotations

import math

import numpy as np

from . import quant
from . import state as S
from .common import Scalars, eps1_of
from ..core import backend, blocks, kernels, workspace

THREADS = 256  # A8F_THREADS in the .cu file
ROWS = 64  # A8F_ROWS
CHUNK = 4096  # A8F_CHUNK
MAX_GRID = 1 << 16

_i32, _i64, _f32 = np.int32, np.int64, np.float32


def supported(cfg, st) -> bool:
    """Whether this parameter's step has a fused path: every non-APOLLO one, unless ``use_cuda_kernel=False``."""
    return cfg.use_cuda_kernel and st.apollo_seed is None


def kernel_step(cfg, st, p, g, *, t: int, lr) -> bool:
    """One fused step of ``p`` (in place); False when this configuration has no fused path (the twin runs)."""
    shape = st.sizes["shape"]
    if not supported(cfg, st):
        return False
    if p.size == 0:
        return True
    sgd = S.is_sgd(cfg)
    b = 0.0 if sgd else (1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay))
    if len(shape) >= 2 and cfg.factored and not sgd:
        _factored(cfg, st, p, g, shape, t, lr, b)
    else:
        _flat(cfg, st, p, g, t, lr, b, sgd)
    return True


# ------------------------------------------------------------------------------------------------- helpers
def _k(name, dtype):
    return kernels.get("adafactor8bit.cu", name, dtype)


def _ws(cp, key, n, dtype=np.float32):
    return workspace.get(cp, "a8k." + key, n, dtype)


def weight_lo(w: float) -> _i32:
    """The kernels' ``lo`` flag of a lerp weight ``w``: which of state.lerp_'s two forms runs."""
    return _i32(abs(w) < 0.5)  # state.lerp_'s branch


def _slot(cp, st, slot):
    """(codes, bits, scale, min_log, block, exact values, quantized) of a non-negative slot: the exact values are
    the float32 state itself (updated in place) or scratch that ``a8f_al_encode`` requantizes."""
    arr = getattr(st, slot)
    if arr is not None:
        return (arr, _i32(8), arr, arr, _i32(st.cfg.block_size), arr, _i32(0))
    q = getattr(st, f"{slot}_q")
    return (q, _i32(q.dtype.itemsize * 8), getattr(st, f"{slot}_scale"), getattr(st, f"{slot}_min_log"),
            _i32(st.cfg.block_size), _ws(cp, "x." + slot, st.sizes[slot]), _i32(1))


def _encode(cp, st, slots, floor: float) -> None:
    """Requantize the quantized ones of two slots (one launch; none when both are float32)."""
    qs = [(s, _slot(cp, st, s)) for s in slots if getattr(st, s) is None]
    if not qs:
        return
    bs = st.cfg.block_size

    def args(slot, a):
        n = st.sizes[slot]
        return (a[0], a[2], a[3], a[5], _i64(n), _i64(quant.nblocks(n, bs)))

    a1 = args(*qs[0])
    a2 = args(*qs[-1])
    nb2 = a2[5] if len(qs) == 2 else 0
    _k("a8f_al_encode", np.float32)((int(a1[5] + nb2),), (THREADS,),
                                     a1 + a2[:5] + (qs[0][1][1], _i32(bs), _f32(floor)))


def _m_step(cp, cfg, st, g, mode, rf, cf, r, c, scal, clip, res, m2parts=None):
    """m ← lerp(m, u, 1 − β1) (u: G, CAME's U, or the momentum-only rule's clipped U), requantized; returns the exact
    values; ``m2parts``: Σm² per block there."""
    n = g.size
    mb = cfg.m_block_size
    w = 1.0 - cfg.beta1
    if st.m is not None:
        q, am, quantized, mx, fmt = _ws(cp, "noq", 1, np.uint8), st.m, 0, st.m, 0
    else:
        q, am, quantized = st.m_q, st.m_scale, 1
        mx = _ws(cp, "m", n)
        fmt = ("uf8", "uf4", "d8", "d4").index(cfg.m_quant_type)
    mp = quant.qmap(cp, quant.m_bits(cfg.m_quant_type))
    _k("a8f_m_step", g.dtype)((quant.nblocks(n, mb),), (THREADS,),
                              (g, _i32(mode), rf, cf, _i64(r), _i64(c), scal, _i32(clip), q, am, _i32(quantized),
                               mx, res, _i64(n), _i32(mb), _i32(fmt), _f32(w), weight_lo(w), mp, _i32(mp.size),
                               _i32(cfg.maximize and mode != 2), scal if m2parts is None else m2parts,
                               _i32(m2parts is not None)))
    return mx


def _factors(dt, R, C, wsum, use_w, bdim, r, c, eps1, rf, cf, ub):
    _k("a8f_factors", dt)((min(bdim, MAX_GRID),), (THREADS,),
                          (R, C, wsum, _i32(use_w), _i64(bdim), _i64(r), _i64(c), _f32(eps1), rf, cf, ub))


def _scalars(cfg, st, sc, n, mode, dt, *, ub, uparts, use_u, nu, pparts, npp, scal, negate=False, d=None):
    """α, the step scale (``Scalars.step_scale``: clip, Fira, ``lag_norm``, ``negate``) and the decay into scal."""
    mult_kind, mult = (0, 1.0) if sc.mult is None else ((1 if sc.mult[0] == "mul" else 2), sc.mult[1])
    d = cfg.d if d is None else d
    fira = cfg.enable_fira_for_adafactor
    prev = st.prev_update_norm if cfg.lag_norm else scal
    fprev = st.fira_prev if fira else scal
    lagf = st.lag_fira_scale if fira and cfg.lag_norm else scal
    _k("a8f_scalars", dt)((1,), (THREADS,),
                          (_i32(mode), ub, uparts, _i32(use_u), _i64(nu), pparts, _i64(npp), _f32(sc.rho),
                           _i32(cfg.scale_parameter), _f32(cfg.eps[1]), _i32(mult_kind), _f32(mult),
                           _f32(math.sqrt(n)), _f32(math.sqrt(n) * d), _f32(d), _i32(d > 0),
                           _i32(cfg.weight_decay != 0), _f32(cfg.weight_decay), _i32(cfg.scale_weight_decay), prev,
                           _i32(cfg.lag_norm), fprev, lagf, _i32(fira), _f32(1.0 + cfg.fira_margin), _i32(negate),
                           scal))


# ------------------------------------------------------------------------------------------------- factored
def _factored(cfg, st, p, g, shape, t, lr, b) -> None:
    cp = backend.cupy()
    dt = p.dtype
    bdim, r, c = blocks.factor_dims(shape)
    n, nr, nc = p.size, bdim * r, bdim * c
    came = cfg.beta3 is not None and cfg.beta1 is not None
    momentum = cfg.beta1 is not None and not came
    eps1 = eps1_of(cfg)
    floor = quant.al_floor(eps1)
    sc = Scalars(cp, cfg, st, n, t, lr, adam=False, sgd=False)
    parts = -(-r // ROWS)
    inv, prow = _ws(cp, "inv", nr, dt), _ws(cp, "prow", nr, dt)
    rf, cf = _ws(cp, "rf", nr, dt), _ws(cp, "cf", nc, dt)
    cparts, wparts, wsum = _ws(cp, "cparts", parts * nc, dt), _ws(cp, "wparts", parts * nc, dt), _ws(cp, "wsum", nc, dt)
    scal, ub = _ws(cp, "scal", 4), _ws(cp, "ub", bdim, dt)
    need_p = bool(cfg.scale_parameter)
    rows, cols, fin = _k("a8f_rows", dt), _k("a8f_col_parts", dt), _k("a8f_col_fin", dt)
    tiles = -(-c // 128)

    def statistics(x, mode, rslot, cslot, w, add, m=None):
        """Row and column statistics of x² (mode 0: G, fused with W; mode 1: U − m) and the two EMAs."""
        ra, ca = _slot(cp, st, rslot), _slot(cp, st, cslot)
        rows((min(nr, MAX_GRID),), (THREADS,), (x, _i32(mode), _i64(nr), _i64(c)) + ra
             + (_f32(w), weight_lo(w), _f32(add), inv, p, prow, _i32(need_p and mode == 0)))
        if momentum and mode == 0:
            m = _m_step(cp, cfg, st, g, 0, rf, cf, r, c, scal, 0, scal)
        fused = _i32(mode == 0)
        cols((min(tiles * parts * bdim, MAX_GRID),), (128,),
             (x, _i32(mode), m if m is not None else scal, _i32(m is not None), inv, fused, _i64(bdim), _i64(r),
              _i64(c), cparts, wparts))
        backend.launch(fin, nc, (cparts, wparts, fused, _i64(parts), _i64(nc), _i64(r)) + ca
                       + (_f32(w), weight_lo(w), _f32(add), wsum))
        _encode(cp, st, (rslot, cslot), floor)
        return ra[5], ca[5], m

    R, C, m = statistics(g, 0, "row_var", "col_var", b, eps1)
    clip = cfg.d > 0
    need_u = clip or cfg.enable_fira_for_adafactor
    _factors(dt, R, C, wsum, need_u, bdim, r, c, eps1, rf, cf, ub)
    _scalars(cfg, st, sc, n, 1 if came else 0, dt, ub=ub, uparts=scal, use_u=1 if need_u else 0, nu=bdim,
             pparts=prow, npp=nr, scal=scal, negate=cfg.maximize and cfg.beta1 is None)
    x = g
    if came:
        res = _ws(cp, "res", n)
        m = _m_step(cp, cfg, st, g, 1, rf, cf, r, c, scal, clip, res)
        CR, CC, _ = statistics(res, 1, "conf_row", "conf_col", 1.0 - cfg.beta3, cfg.eps_came)
        _factors(dt, CR, CC, wsum, 0, bdim, r, c, eps1, rf, cf, ub)
        if cfg.enable_fira_for_adafactor:  # ΣU² of the step m·factors per row (into inv), then the Fira factor
            _k("a8f_usq_rows", dt)((min(nr, MAX_GRID),), (THREADS,), (m, rf, cf, _i64(nr), _i64(r), _i64(c), inv))
            _scalars(cfg, st, sc, n, 0, dt, ub=inv, uparts=scal, use_u=1, nu=nr, pparts=prow, npp=nr, scal=scal,
                     d=0.0)
    if m is not None:
        x = m
    backend.launch(_k("a8f_apply", dt), n, (p, x, _i32(m is not None), rf, cf, _i64(n),
                                             _i64(r), _i64(c), scal, _i32(cfg.weight_decay != 0),
                                             _i32(cfg.enable_fira_for_adafactor)))


# ------------------------------------------------------------------------------------------------- elementwise
def _flat(cfg, st, p, g, t, lr, b, sgd) -> None:
    cp = backend.cupy()
    dt = p.dtype
    n = p.size
    adam = (not cfg.factored) and cfg.beta2 is not None and cfg.beta3 is None
    eps1 = eps1_of(cfg)
    eps_g2 = 0.0 if adam else eps1
    sc = Scalars(cp, cfg, st, n, t, lr, adam=adam, sgd=sgd)
    scal = _ws(cp, "scal", 4)
    if sgd:
        v = scal  # (no second moment)
    elif st.variance is None:
        v, q, scale = _ws(cp, "v", n), st.variance_q, st.variance_scale  # the EMA of state.ema_range's kernel
        _k("a8_al_ema", dt)((scale.size,), (THREADS,),
                            (q, _i32(q.dtype.itemsize * 8), scale, st.variance_min_log, g, v, _i64(n),
                             _i32(cfg.block_size), _f32(b), _i32(1), _f32(eps_g2), _f32(quant.al_floor(eps1)), _i32(0)))
    else:
        v = st.variance
    nparts = -(-n // CHUNK)
    u, pparts, uparts = _ws(cp, "u", n), _ws(cp, "pparts", nparts, dt), _ws(cp, "uparts", nparts)
    mo1d = (not adam) if cfg.momentum_only_1d is None else cfg.momentum_only_1d
    # the momentum-only rule: m <- EMA of the clipped U, the step is m
    mo1d = mo1d and cfg.beta1 is not None and not sgd
    m = _m_step(cp, cfg, st, g, 0, pparts, pparts, 1, 1, scal, 0, scal) if cfg.beta1 is not None and not mo1d else None
    fira = cfg.enable_fira_for_adafactor
    need_u, need_p = cfg.d > 0 or (fira and not mo1d), bool(cfg.scale_parameter)
    _k("a8f_flat_u", dt)((nparts,), (THREADS,),
                         (g, v, _i32(st.variance is None), _f32(b), _f32(1.0 - b), _f32(b * eps_g2),
                          m if m is not None else scal, _i32(m is not None), _i32(adam), _f32(sc.eps_denom),
                          _f32(max(eps1 * eps1, quant.FLT_MIN)), u, p, pparts, uparts, _i64(n), _i32(need_u),
                          _i32(need_p), _i32(cfg.maximize), _i32(sgd),
                          _f32(1.0 - cfg.beta1 if cfg.beta1 is not None else 1.0)))
    parts = dict(ub=pparts, uparts=uparts, use_u=2 if need_u else 0, nu=nparts, pparts=pparts, npp=nparts, scal=scal)
    if mo1d:  # the clip divisor (scal[3]), m from U/clip (with Σm² per block for Fira), then the step's scalars
        _scalars(cfg, st, sc, n, 1, dt, **parts)
        nb = quant.nblocks(n, cfg.m_block_size)
        m2 = _ws(cp, "m2parts", nb) if fira else None
        u = _m_step(cp, cfg, st, g, 2, pparts, pparts, 1, 1, scal, cfg.d > 0, u, m2)
        parts.update(uparts=scal if m2 is None else m2, use_u=2 if fira else 0, nu=nb)
    _scalars(cfg, st, sc, n, 0, dt, d=0.0 if mo1d else None, **parts)
    backend.launch(_k("a8f_flat_apply", dt), n, (p, u, _i64(n), scal, _i32(cfg.weight_decay != 0), _i32(fira)))

"""The non-APOLLO update paths of ``Adafactor8Bit`` (private): factored, unfactored (Adafactor- and Adam-style),
SGD and CAME, plus the scalars and the final apply shared with the APOLLO path.

Formulas: ``reference/adafactor8bit.md`` §4–§5 (the original's pure-PyTorch path, float32, in its operation order).
Data-dependent scalars (α, norms, clip denominators, the Fira factor) are 0-d float32 arrays of the parameter's
array module, so on CuPy they stay on the device (no host synchronisation).
"""

from __future__ import annotations

import math

import numpy as np

from . import _a8_state as S
from . import _came, _fira, _workspace, quant

F32 = np.float32


def eps1_of(cfg) -> float:
    return 1e-30 if cfg.eps[0] is None else float(cfg.eps[0])


def ws(xp, key, n):
    return _workspace.get(xp, key, n, np.float32)


def grad32(xp, cfg, g, *, nan_to_zero=False, writable=True):
    """The float32 gradient (negated when ``maximize``); ``g`` itself is never written.  A float32 ``g`` is used
    as is when the caller only reads it (``writable=False``) and no sanitising is needed."""
    if xp is np and nan_to_zero and g.dtype == np.float32 and not cfg.maximize and not writable:
        if np.isfinite(np.add.reduce(g)):  # host check (NumPy only): a non-finite entry makes the sum non-finite
            return g
    elif not writable and not nan_to_zero and g.dtype == np.float32 and not cfg.maximize:
        return g
    out = ws(xp, "g32", g.size)
    if cfg.maximize:
        xp.negative(g, out=out, casting="same_kind")
    else:
        out[...] = g
    if nan_to_zero:
        xp.copyto(out, F32(0.0), where=~xp.isfinite(out))
    return out


def norm(xp, x):
    return xp.sqrt(xp.dot(x, x)).astype(np.float32)


def alpha_rho(xp, cfg, p, t: int, lr):
    """(α, ρ): ρ = scale·(min(lr, 1/√t) if relative_step else lr), α = ρ·max(RMS(p), eps2) if scale_parameter."""
    base, scale = lr
    rho = F32(scale * (min(base, 1.0 / math.sqrt(t)) if cfg.relative_step else base))
    if not cfg.scale_parameter:
        return rho, rho  # a NumPy float32 scalar: a kernel argument on CuPy, no upload
    rms = xp.sqrt(xp.dot(p, p)).astype(np.float32) / F32(math.sqrt(p.size))
    return xp.maximum(rms, F32(cfg.eps[1])) * rho, rho


def decay(xp, cfg, p, alpha, rho) -> None:
    """p ← p·(1 − c·weight_decay), c = α (scale_weight_decay) or ρ; before the update."""
    if cfg.weight_decay != 0:
        c = alpha if cfg.scale_weight_decay else rho
        xp.multiply(p, F32(1.0) - c * F32(cfg.weight_decay), out=p, casting="unsafe")


def apply(xp, st, p, upd, alpha, *, d: float, fira: bool, margin: float) -> None:
    """p ← p − α/max(1, RMS(u)/d)·(f·u), f the Fira factor when enabled (``upd`` is scratch and is overwritten)."""
    n = upd.size
    if fira:
        nrm = norm(xp, upd)
        bad = ~xp.isfinite(nrm)
        xp.copyto(upd, F32(0.0), where=bad)
        nrm = xp.where(bad, F32(0.0), nrm)
        f = _fira.factor(xp, st.fira_prev, nrm, margin)
        xp.multiply(upd, f, out=upd)
    elif d > 0:
        nrm = norm(xp, upd)
    coef = -alpha / xp.maximum(nrm / F32(math.sqrt(n) * d), F32(1.0)) if d > 0 else -alpha
    xp.multiply(upd, coef.astype(np.float32), out=upd)
    xp.add(p, upd, out=p, casting="unsafe")


def clip_(xp, u, d: float) -> None:
    if d > 0:
        xp.divide(u, xp.maximum(norm(xp, u) / F32(math.sqrt(u.size)) / F32(d), F32(1.0)), out=u)


def m_ema(xp, st, slot, x, beta1, tmp):
    """The first-moment EMA m ← lerp(m, x, 1 − β1); requantizes the stored codes, returns the exact values."""
    return S.ema(xp, st, slot, x, 1.0 - beta1, floor=0.0)


def update(xp, cfg, st, p, g, *, t: int, lr, shape) -> None:
    """One non-APOLLO step of Adafactor8Bit on the flat buffers ``p`` (in place) and ``g``."""
    n = p.size
    sgd = S.is_sgd(cfg)
    eps1 = eps1_of(cfg)
    adam = (not cfg.factored) and cfg.beta2 is not None and cfg.beta3 is None
    came = cfg.beta3 is not None and cfg.beta1 is not None and len(shape) >= 2 and cfg.factored
    g32 = grad32(xp, cfg, g, writable=came)
    b = 0.0 if sgd else (1.0 - cfg.beta2 if cfg.beta2 is not None else math.pow(t, cfg.beta2_decay))
    alpha, rho = alpha_rho(xp, cfg, p, t, lr)
    eps_denom = eps1 if adam else 0.0
    if cfg.beta1 is not None and not cfg.relative_step and not sgd:
        if (adam if cfg.bias_correction is None else cfg.bias_correction):
            bc1 = 1.0 - cfg.beta1**t
            if cfg.beta2 is not None:
                bc2 = 1.0 - cfg.beta2**t
                alpha = alpha * F32(math.sqrt(bc2) / bc1)
                eps_denom = eps1 * math.sqrt(bc2) if adam else eps_denom
            else:
                alpha = alpha / F32(bc1)
    decay(xp, cfg, p, alpha, rho)
    fira, margin = cfg.enable_fira_for_adafactor, cfg.fira_margin
    tmp, upd = ws(xp, "tmp", n), ws(xp, "upd", n)
    if sgd:
        if cfg.beta1 is not None:
            m = m_ema(xp, st, "m", g32, cfg.beta1, tmp)
            xp.divide(m, F32(1.0 - cfg.beta1), out=upd)
        else:
            upd[...] = g32
        apply(xp, st, p, upd, alpha, d=cfg.d, fira=fira, margin=margin)
    elif len(shape) < 2 or not cfg.factored:
        _full(xp, cfg, st, p, g32, b, alpha, adam, eps_denom, tmp, upd)
    else:
        _factored(xp, cfg, st, p, g32, b, alpha, shape, tmp, upd)


def _full(xp, cfg, st, p, g32, b, alpha, adam, eps_denom, tmp, upd):
    eps1 = eps1_of(cfg)
    eps_sq = F32(max(eps1 * eps1, quant.FLT_MIN))
    eps_g2 = 0.0 if adam else eps1
    mo1d = (not adam) if cfg.momentum_only_1d is None else cfg.momentum_only_1d
    if st.variance is None:  # quantized: the original's lerp form
        v = S.ema(xp, st, "variance", g32, b, square=True, add=eps_g2, floor=quant.al_floor(eps1))
    else:  # float32: v·(1 − b) + b·g² (+ b·eps1)
        v = st.variance
        xp.multiply(v, F32(1.0 - b), out=v)
        xp.multiply(g32, F32(b), out=tmp)
        xp.multiply(tmp, g32, out=tmp)
        xp.add(v, tmp, out=v)
        if eps_g2 > 0:
            xp.add(v, F32(b * eps_g2), out=v)

    def inv_std(out):  # 1/(√v + eps) (Adam-style) or rsqrt(max(v, eps1²))
        if adam:
            xp.sqrt(v, out=out)
            xp.add(out, F32(eps_denom), out=out)
            xp.divide(F32(1.0), out, out=out)
        else:
            xp.maximum(v, eps_sq, out=out)
            xp.sqrt(out, out=out)
            xp.divide(F32(1.0), out, out=out)
        return out

    fira, margin, d = cfg.enable_fira_for_adafactor, cfg.fira_margin, cfg.d
    if cfg.beta1 is not None and mo1d:
        u = xp.multiply(g32, inv_std(upd), out=upd)
        clip_(xp, u, d)
        m = m_ema(xp, st, "m", u, cfg.beta1, tmp)
        upd[...] = m
        apply(xp, st, p, upd, alpha, d=0.0, fira=fira, margin=margin)
        return
    if cfg.beta1 is not None:
        m = m_ema(xp, st, "m", g32, cfg.beta1, tmp)
        xp.multiply(m, inv_std(upd), out=upd)
    elif adam:
        xp.sqrt(v, out=upd)
        xp.add(upd, F32(eps_denom), out=upd)
        xp.divide(g32, upd, out=upd)
    else:
        xp.multiply(g32, inv_std(upd), out=upd)
    apply(xp, st, p, upd, alpha, d=d, fira=fira, margin=margin)


def factored_inv(xp, cfg, st, g32, b, shape, tmp):
    """EMA the row/column factors of g² + eps1; return (inv_row (B,R,1), inv_col (B,1,C)) from exact values."""
    eps1 = eps1_of(cfg)
    bsz, r_, c_ = math.prod(shape[:-2]), shape[-2], shape[-1]
    g2 = xp.multiply(g32, g32, out=tmp).reshape(bsz, r_, c_)
    row_mean = xp.add(g2.mean(axis=-1), F32(eps1)).astype(np.float32).reshape(-1)
    col_mean = xp.add(g2.mean(axis=-2), F32(eps1)).astype(np.float32).reshape(-1)
    floor = quant.al_floor(eps1)
    rv = S.ema(xp, st, "row_var", row_mean, b, floor=floor)
    cv = S.ema(xp, st, "col_var", col_mean, b, floor=floor)
    rbar = xp.maximum(rv.reshape(bsz, r_).mean(axis=-1), F32(eps1)).astype(np.float32)
    inv_row = F32(1.0) / xp.sqrt(rv.reshape(bsz, r_) / rbar[:, None])
    inv_col = F32(1.0) / xp.sqrt(cv.reshape(bsz, c_))
    return inv_row[:, :, None], inv_col[:, None, :]


def _factored(xp, cfg, st, p, g32, b, alpha, shape, tmp, upd):
    bsz, r_, c_ = math.prod(shape[:-2]), shape[-2], shape[-1]
    inv_row, inv_col = factored_inv(xp, cfg, st, g32, b, shape, tmp)
    fira, margin = cfg.enable_fira_for_adafactor, cfg.fira_margin
    g3, u3 = g32.reshape(bsz, r_, c_), upd.reshape(bsz, r_, c_)
    if cfg.beta3 is not None and cfg.beta1 is not None:
        xp.multiply(g3, inv_row, out=g3)
        xp.multiply(g3, inv_col, out=g3)
        clip_(xp, g32, cfg.d)
        m = m_ema(xp, st, "m", g32, cfg.beta1, tmp)
        _came.factored_confidence(xp, cfg, st, g32, m, (bsz, r_, c_), upd, lo_rank=False)
        apply(xp, st, p, upd, alpha, d=0.0, fira=fira, margin=margin)
        return
    src = m_ema(xp, st, "m", g32, cfg.beta1, tmp) if cfg.beta1 is not None else g32
    xp.multiply(src.reshape(bsz, r_, c_), inv_row, out=u3)
    xp.multiply(u3, inv_col, out=u3)
    apply(xp, st, p, upd, alpha, d=cfg.d, fira=fira, margin=margin)

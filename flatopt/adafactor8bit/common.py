"""Helpers shared by the update paths of ``Adafactor8Bit`` (private): the float32 gradient copy, α and ρ, the RMS clip,
the first-moment EMA, the step's scalars (``Scalars``) and the codec-aligned ranges of the elementwise passes.

Data-dependent scalars (α, norms, clip denominators, the Fira factor) are 0-d arrays of the parameter's array
module, so on CuPy they stay on the device (no host synchronisation).
"""

from __future__ import annotations

import math

import numpy as np

from . import state as S
from ..core import blocks, workspace
from . import fira as _fira

F32 = np.float32

def eps1_of(cfg) -> float:
    return 1e-30 if cfg.eps[0] is None else float(cfg.eps[0])


def ws(xp, key, n):
    return workspace.get(xp, key, n, np.float32)


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


def sumsq(xp, x):
    """Σx² of a flat array: ``core.blocks.sumsq`` (einsum) on NumPy — no BLAS call: a threaded BLAS's idle workers spin
    for a while after each call and slow the elementwise passes that follow on the other threads, and the bits do
    not depend on the BLAS thread count — and ``dot`` on CuPy."""
    return blocks.sumsq(np, x, None) if xp is np else xp.dot(x, x)


def norm(xp, x):
    return xp.sqrt(sumsq(xp, x)).astype(np.float32)


def rho_of(cfg, t: int, lr) -> np.float32:
    """ρ = scale·(min(lr, 1/√t) if relative_step else lr), ``lr`` the driver's (lr, lr_scale) pair; a NumPy float32
    scalar (a kernel argument on CuPy, no upload)."""
    base, scale = lr
    return F32(scale * (min(base, 1.0 / math.sqrt(t)) if cfg.relative_step else base))


def scaled(xp, cfg, rho, ssq_p, n: int):
    """α = ρ·max(RMS(θ), eps2) from Σθ² when ``scale_parameter``, else ρ."""
    if not cfg.scale_parameter:
        return rho
    rms = xp.sqrt(xp.asarray(ssq_p, dtype=np.float32)) / F32(math.sqrt(n))
    return xp.maximum(rms, F32(cfg.eps[1])) * rho


def alpha_rho(xp, cfg, p, t: int, lr):
    """(α, ρ) of a whole-tensor step (the APOLLO path)."""
    rho = rho_of(cfg, t, lr)
    return scaled(xp, cfg, rho, sumsq(xp, p) if cfg.scale_parameter else None, p.size), rho


def clip_(xp, u, d: float) -> None:
    if d > 0:
        xp.divide(u, xp.maximum(norm(xp, u) / F32(math.sqrt(u.size)) / F32(d), F32(1.0)), out=u)


def m_ema(xp, st, slot, x, beta1, tmp):
    """The first-moment EMA m ← lerp(m, x, 1 − β1); requantizes the stored codes, returns the exact values."""
    return S.ema(xp, st, slot, x, 1.0 - beta1, floor=0.0)


# ------------------------------------------------------------------------------------ the stepped paths
# Elements per task of the elementwise (flat) passes on NumPy (rounded up to whole codec blocks); one codec chunk
# (``quant._CHUNK``), so that a task's NumPy calls are long enough to run in parallel.  Re-measure:
# ``python -m benchmarks.run --only adafactor8bit`` with this constant at 1 << 16 and 1 << 17.
TASK = 1 << 17


class Scalars:
    """The step's scalars: ρ, α = ρ·max(RMS(θ), eps2) (RMS before decay) with the bias corrections, the decay
    factor 1 − c·λ, and the step scale s with θ ← θ·decay − s·U: s = α·f/max(1, ‖U‖/(√n·d)) (f the Fira factor;
    no clip for d = 0; ``lag_norm``: the previous step's ‖U‖ and Fira factor), negated for ``maximize`` when U is
    formed from the raw gradient.  0-d arrays of ``xp`` where data-dependent (no host synchronisation on CuPy)."""

    def __init__(self, xp, cfg, st, n, t, lr, *, adam, sgd):
        self.xp, self.cfg, self.st, self.n = xp, cfg, st, n
        self.rho = rho_of(cfg, t, lr)
        self.mult, eps1 = None, eps1_of(cfg)
        self.eps_denom = eps1 if adam else 0.0
        if cfg.beta1 is not None and not cfg.relative_step and not sgd:
            if (adam if cfg.bias_correction is None else cfg.bias_correction):
                bc1 = 1.0 - cfg.beta1**t
                if cfg.beta2 is not None:
                    bc2 = 1.0 - cfg.beta2**t
                    self.mult = ("mul", F32(math.sqrt(bc2) / bc1))
                    self.eps_denom = eps1 * math.sqrt(bc2) if adam else self.eps_denom
                else:
                    self.mult = ("div", F32(bc1))

    def alpha(self, ssq_p):
        alpha = scaled(self.xp, self.cfg, self.rho, ssq_p, self.n)
        if self.mult is not None:
            alpha = alpha * self.mult[1] if self.mult[0] == "mul" else alpha / self.mult[1]
        return alpha

    def decay(self, alpha):
        cfg = self.cfg
        if cfg.weight_decay == 0:
            return None
        c = alpha if cfg.scale_weight_decay else self.rho
        return F32(1.0) - c * F32(cfg.weight_decay)

    def step_scale(self, alpha, ssq_u, *, d: float, negate: bool = False):
        """s (see the class doc) from ΣU² (None when neither the clip nor Fira needs it)."""
        xp, cfg, st = self.xp, self.cfg, self.st
        fira = cfg.enable_fira_for_adafactor
        if not fira and not d > 0:
            s = alpha
        else:
            nrm = xp.sqrt(xp.asarray(ssq_u, dtype=np.float32))
            bad = ~xp.isfinite(nrm)
            if fira:  # the limiter reads a non-finite norm as 0 (and the update is dropped below)
                nrm = xp.where(bad, F32(0.0), nrm)
            if cfg.lag_norm:  # the previous step's norm and Fira factor; this step's are kept for the next
                used = st.prev_update_norm.reshape(()).copy()
                st.prev_update_norm[...] = xp.where(bad, F32(0.0), nrm)  # a non-finite norm is not carried over
                if fira:
                    f = st.lag_fira_scale.reshape(()).copy()
                    st.lag_fira_scale[...] = _fira.factor(xp, st.fira_prev, nrm, cfg.fira_margin)
                nrm = used
            elif fira:
                f = _fira.factor(xp, st.fira_prev, nrm, cfg.fira_margin)
            s = alpha * f if fira else alpha
            if d > 0:
                s = s / xp.maximum(nrm / F32(math.sqrt(self.n) * d), F32(1.0))
            if fira:  # an update whose norm is not finite is dropped (U's non-finite entries are zeroed too)
                s = xp.where(bad, F32(0.0), s)
        return -s if negate else s


def ranges(xp, n: int, align: int):
    """``(cost, lo, hi)`` ranges of about ``TASK`` elements starting at multiples of ``align`` (CuPy: one)."""
    if xp is not np:
        return ((n, 0, n),)
    step = max(1, -(-TASK // align)) * align
    return tuple((min(lo + step, n) - lo, lo, min(lo + step, n)) for lo in range(0, n, step))


def src_chunk(xp, cfg, g, lo, hi):
    """g[lo:hi], negated into per-thread scratch for ``maximize`` (``g`` is never written)."""
    if not cfg.maximize:
        return g[lo:hi]
    out = workspace.get(xp, "a8.negg", hi - lo, np.float32)
    xp.negative(g[lo:hi], out=out, casting="same_kind")
    return out

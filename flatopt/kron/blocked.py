"""Blocked matrix products that skip the known zeros of KronPsgd's triangular factors (NumPy; private).

A dense KronPsgd factor Q is upper triangular, and so is the step D = triu(...) of its update; the Gram matrices
of its fit are symmetric.  A plain GEMM spends n³ (or n²·m) multiply-adds where a third to a half of them multiply
known zeros or recompute a mirror image, so these products recurse on 2×2 blocks: the zero block is skipped, the
triangular diagonal blocks recurse, the general blocks are one GEMM each, and a symmetric result computes its upper
blocks and mirrors them.  Costs: D·Q ≈ n³/3, T·X or X·T ≈ n²·m/2 (plus recursion), X·Xᵀ ≈ n²·m/2.

Results equal the full product up to float rounding (a different summation order: sums are split at block
boundaries); the zero block of a triangular product is exactly 0, as in the full product of finite inputs.  The
split points depend only on the shapes, so results are deterministic.  Below ``LEAF`` rows, or on CuPy (cuBLAS
runs the full product faster than a recursion of small launches), the plain product is used.
"""

from __future__ import annotations

import numpy as np

from ..core import workspace

# No recursion at or below this size: smaller GEMMs lose efficiency (``python -m benchmarks.run --only kron``).
LEAF = 256


def _split(n: int) -> int:
    return (n // 2 + 63) // 64 * 64  # a multiple of 64 near the middle (GEMM-friendly)


def _tmp(shape, dtype, depth: int):
    return workspace.get(np, f"kronblk{depth}", shape[0] * shape[1], dtype).reshape(shape)


def upper_upper(xp, d, q, out, depth: int = 0):
    """out = D·Q for upper-triangular D and Q (n × n)."""
    n = d.shape[0]
    if xp is not np or n <= LEAF:
        return xp.matmul(d, q, out=out)
    h = _split(n)
    upper_upper(xp, d[:h, :h], q[:h, :h], out[:h, :h], depth + 1)
    upper_upper(xp, d[h:, h:], q[h:, h:], out[h:, h:], depth + 1)
    np.matmul(d[:h, :h], q[:h, h:], out=out[:h, h:])
    t = _tmp((h, n - h), out.dtype, depth)
    np.matmul(d[:h, h:], q[h:, h:], out=t)
    out[:h, h:] += t
    out[h:, :h] = 0
    return out


def tri_mul(xp, t, x, out, *, left: bool, lower: bool, depth: int = 0):
    """out = T·X (``left``) or X·T for a triangular T (n × n, upper unless ``lower``) and a 2-D X."""
    n = t.shape[0]
    if xp is not np or n <= LEAF or x.ndim != 2:
        return xp.matmul(t, x, out=out) if left else xp.matmul(x, t, out=out)
    h = _split(n)
    lo, hi = slice(None, h), slice(h, None)

    def cut(a, s):  # the rows (T·X) or columns (X·T) of a that meet T's rows/columns s
        return a[s] if left else a[:, s]

    tri_mul(xp, t[lo, lo], cut(x, lo), cut(out, lo), left=left, lower=lower, depth=depth + 1)
    tri_mul(xp, t[hi, hi], cut(x, hi), cut(out, hi), left=left, lower=lower, depth=depth + 1)
    # the off-diagonal block of T adds into one half of out
    if lower:
        tb, dst, src = t[hi, lo], (hi if left else lo), (lo if left else hi)
    else:
        tb, dst, src = t[lo, hi], (lo if left else hi), (hi if left else lo)
    target = cut(out, dst)
    tmp = _tmp(target.shape, out.dtype, depth)
    np.matmul(tb, cut(x, src), out=tmp) if left else np.matmul(cut(x, src), tb, out=tmp)
    target += tmp
    return out


def gram(xp, x, out, rows: bool, depth: int = 0):
    """out = X·Xᵀ (``rows``) or Xᵀ·X: the upper blocks, mirrored."""
    n = out.shape[0]
    if xp is not np or n <= LEAF:
        return xp.matmul(x, x.T, out=out) if rows else xp.matmul(x.T, x, out=out)
    h = _split(n)
    a, b = (x[:h], x[h:]) if rows else (x[:, :h], x[:, h:])
    gram(xp, a, out[:h, :h], rows, depth + 1)
    gram(xp, b, out[h:, h:], rows, depth + 1)
    if rows:
        np.matmul(a, b.T, out=out[:h, h:])
    else:
        np.matmul(a.T, b, out=out[:h, h:])
    out[h:, :h] = out[:h, h:].T
    return out

"""A 16-bit AdamW step on one 16M buffer: flatopt's write-back modes (``flatopt.Precision``) against torch's fused
AdamW on bfloat16 parameters, and the bytes per parameter of each mode (parameter + ``state_nbytes``).

    python -m benchmarks.precision_probe
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import flatopt


def median_ms(f, k: int = 7) -> float:
    f()
    f()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main() -> None:
    import ml_dtypes
    import torch

    torch.set_num_threads(2)
    n = 1 << 24
    rng = np.random.default_rng(0)
    p32 = rng.standard_normal(n).astype(np.float32)
    g32 = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    tp = torch.tensor(p32).to(torch.bfloat16)
    tp.grad = torch.tensor(g32).to(torch.bfloat16)
    topt = torch.optim.AdamW([tp], lr=1e-3, fused=True)
    t_torch = median_ms(topt.step)
    p, opt = p32.copy(), flatopt.AdamW(lr=1e-3)
    print(f"torch fused AdamW, bfloat16: {t_torch:.1f} ms; flatopt AdamW float32: "
          f"{median_ms(lambda: opt.step('w', (n,), p, g32)):.1f} ms")
    for mode in ("nearest", "stochastic", "kahan", "master"):
        p, g = p32.astype(ml_dtypes.bfloat16), g32.astype(ml_dtypes.bfloat16)
        opt = flatopt.AdamW(lr=1e-3, precision=flatopt.Precision(writeback=mode))
        t = median_ms(lambda: opt.step("w", (n,), p, g))
        print(f"flatopt AdamW bfloat16 {mode:10s} {t:7.1f} ms  {t_torch / t:.2f}x torch fused  "
              f"{2 + opt.state_nbytes() / n:.1f} B/param")


if __name__ == "__main__":
    main()

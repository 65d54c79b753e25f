"""Lion's sign on the NumPy path: ``numpy.sign`` then the multiply against ``lower_numpy.signed_mul`` (the
branch-free int8 form), ns per element on random signs.

    python -m benchmarks.sign_probe
"""

from __future__ import annotations

import time

import numpy as np

from flatopt.core.elementwise.lower_numpy import signed_mul


def per_element(f, n: int, repeats: int = 5, calls: int = 1000) -> float:
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best.append((time.perf_counter() - t0) / calls / n * 1e9)
    return min(best)


def main() -> None:
    for n in (1 << 14, 1 << 16, 1 << 18):
        c = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        out, spare, k = np.empty_like(c), np.empty_like(c), np.float32(-1e-3)
        a = per_element(lambda: np.multiply(np.sign(c, out=out), k, out=out), n)
        b = per_element(lambda: signed_mul(np, c, k, out, spare), n)
        print(f"{n:7d} float32: numpy.sign then multiply {a:.2f} ns/element, signed_mul {b:.2f} ns/element")


if __name__ == "__main__":
    main()

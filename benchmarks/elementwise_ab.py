"""In-process A/B of the hand-written and the generated elementwise paths (issue #28's transition): one 16M
float32 buffer walked in the driver's chunks on one thread, the paths interleaved, medians of the repetitions.

    python -m benchmarks.elementwise_ab [--n 16777216] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flatopt import adam, adamw, lion, nadamw, qhadamw, radam, sgd
from flatopt.core import driver, native
from flatopt.core.elementwise import run

CASES = {
    "adamw": (adamw, adamw.AdamWConfig(lr=1e-3, weight_decay=1e-2)),
    "adam": (adam, adam.AdamConfig(lr=1e-3, weight_decay=1e-2)),
    "sgd": (sgd, sgd.SGDConfig(lr=1e-3, momentum=0.9, weight_decay=1e-4)),
    "nadamw": (nadamw, nadamw.NAdamWConfig(lr=1e-3)),
    "qhadamw": (qhadamw, qhadamw.QHAdamWConfig(lr=1e-3, nus=(0.7, 0.8))),
    "radam": (radam, radam.RAdamConfig(lr=1e-3, weight_decay=1e-2)),
    "lion": (lion, lion.LionConfig(lr=1e-4, weight_decay=1e-2)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    n, ch = a.n, driver.CHUNK
    rng = np.random.default_rng(0)
    assert native.status()[0], native.status()[1]
    real_step = native.step
    print(f"n={n} float32, chunk {ch}, one thread; medians of {a.reps} interleaved runs (ms)")
    print("algorithm  hand numpy  gen numpy  ratio   hand C   gen C  ratio")
    for name, (mod, cfg) in CASES.items():
        p = rng.standard_normal(n).astype(np.float32)
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        st = mod.init(np, cfg, (n,), np.float32)
        scratch = [np.empty(ch, np.float32) for _ in range(3)]
        d = mod.DEF
        cls_name = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "nadamw": "NAdamW", "qhadamw": "QHAdamW",
                    "radam": "RAdam", "lion": "Lion"}[name]
        nscr = getattr(mod, cls_name).scratch_buffers  # the hand twins took as many

        def chunks(fn, t):
            for lo in range(0, n, ch):
                hi = min(lo + ch, n)
                sv = type(st)(**{k: (None if v is None else v[lo:hi]) for k, v in vars(st).items()})
                fn(sv, p[lo:hi], g[lo:hi], t, [s[:hi - lo] for s in scratch[:nscr]])

        def hand_np(sv, pc, gc, t, sc):
            native.step = lambda *x: False
            try:
                mod.hand_update(np, cfg, sv, pc, gc, t=t, lr=cfg.lr, scratch=sc)
            finally:
                native.step = real_step

        paths = {
            "hand_np": hand_np,
            "gen_np": lambda sv, pc, gc, t, sc: run.numpy_update(d, np, cfg, sv, pc, gc, t=t, lr=cfg.lr, scratch=sc),
            "hand_c": lambda sv, pc, gc, t, sc: mod.hand_update(np, cfg, sv, pc, gc, t=t, lr=cfg.lr, scratch=sc),
            "gen_c": lambda sv, pc, gc, t, sc: run.native_update(d, cfg, sv, pc, gc, t=t, lr=cfg.lr),
        }
        times = {k: [] for k in paths}
        for r in range(a.reps + 1):
            for k, fn in paths.items():
                t0 = time.perf_counter()
                chunks(fn, 2 + r)
                if r:  # the first round warms up
                    times[k].append((time.perf_counter() - t0) * 1e3)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name:<10} {m['hand_np']:10.1f} {m['gen_np']:10.1f} {m['gen_np'] / m['hand_np']:6.3f} "
              f"{m['hand_c']:8.1f} {m['gen_c']:7.1f} {m['gen_c'] / m['hand_c']:6.3f}")


if __name__ == "__main__":
    main()

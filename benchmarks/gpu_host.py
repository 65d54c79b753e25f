"""Launches, host synchronisations and host time per ``step_batch`` on the GPU path, measured without a GPU.

``python -m benchmarks.gpu_host [--quick] [--repeats N]`` installs the CuPy stand-in of ``tests/cuda_emu``
(``fakecupy``) and replaces the emulator's kernel execution by a no-op that only counts the launch, so that what is
timed is the host side: flatopt's Python plus the stand-in's (a CuPy call on a real GPU costs its own ~5 µs of
CPU, which the stand-in does not reproduce: the time model below adds it).  For each workload it reports, for a
steady-state step (the 3rd and later):

* ``launches``: fused kernel launches + other device operations (CuPy ufuncs, copies, fills; a host-to-device copy
  counts as one);
* ``syncs``: host synchronisations (``fakecupy`` counts every device-to-host read, ``synchronize`` and
  ``Event.done``);
* ``allocs``: device allocations;
* ``host_us``: the median wall time of one ``step_batch`` call (no-op kernels), in µs, less the time spent inside
  the stand-in's CuPy calls (its checks and the NumPy arithmetic standing for device work: GEMMs, ufuncs,
  reductions, solves): flatopt's own Python, without CuPy's per-call cost, which the estimate adds per launch;
* ``est_us``: an **estimate**, not a measurement: max(host_us + 5 µs × launches, GPU time), GPU time = Σ over
  launches of max(2 µs, bytes / 4.8 TB/s) (an H200's HBM bandwidth, the vendor's figure).

``--numpy`` times the NumPy path of the same workloads instead (no stand-in).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flatopt  # noqa: E402
from flatopt import OptItem  # noqa: E402

from .bench_adamw import transformer_shapes  # noqa: E402

LAUNCH_US = 5.0  # CuPy's Python plus the driver, per launch (estimate)
MIN_KERNEL_US = 2.0
BANDWIDTH = 4.8e12  # bytes/s
GEMM_FLOPS = 60e12  # FP32 GEMM, FLOP/s (an H200 without TF32; gpu-audit.md §2.1)


def _factories():
    """name -> (optimizer factory, bytes moved per element (float32), GEMM FLOP for the workload's shapes)."""
    f = flatopt
    big = 1024 * 1024
    ns_flop = 5 * (2 * 1024 ** 3 * 3)  # Muon: 5 Newton-Schulz iterations, three 1024^3 GEMMs each (2 FLOP/MAC)
    return {
        "adamw": (lambda: f.AdamW(lr=1e-3, weight_decay=1e-2), 7 * 4, 0),
        "sgd": (lambda: f.SGD(lr=1e-2, momentum=0.9, weight_decay=1e-4), 5 * 4, 0),
        "adam": (lambda: f.Adam(lr=1e-3, weight_decay=1e-2), 7 * 4, 0),
        "nadamw": (lambda: f.NAdamW(lr=1e-3), 7 * 4, 0),
        "radam": (lambda: f.RAdam(lr=1e-3), 7 * 4, 0),
        "qhadamw": (lambda: f.QHAdamW(lr=1e-3), 7 * 4, 0),
        "adopt": (lambda: f.Adopt(lr=1e-3), 7 * 4, 0),
        "ademamix": (lambda: f.AdEMAMix(lr=1e-3), 9 * 4, 0),
        "lion": (lambda: f.Lion(lr=1e-4, weight_decay=1e-2), 5 * 4, 0),
        "sophia": (lambda: f.Sophia(lr=1e-4), 6 * 4, 0),
        "lamb": (lambda: f.Lamb(lr=1e-3), (6 + 4) * 4, 0),  # moments + partials (p g m v), then the apply (p m v)
        "mars": (lambda: f.Mars(lr=3e-3), (2 + 9) * 4, 0),  # the partials of ||c||² (g g_prev), then the step
        "adafactor": (lambda: f.Adafactor(), 6 * 4, 0),  # reads g three times and p twice, writes p
        "af8": (lambda: f.Adafactor8Bit(lr=1e-2), 3 * 4 + 1, 0),
        "af8m": (lambda: f.Adafactor8Bit(lr=1e-2, beta1=0.9), 3 * 4 + 2 + 1, 0),
        "came": (lambda: f.Adafactor8Bit(lr=1e-2, beta1=0.9, beta3=0.9999), 3 * 4 + 2 + 2, 0),
        "apollo": (lambda: f.Adafactor8Bit(lr=1e-2, beta1=0.9, apollo_rank=256), 3 * 4 + 2, 2 * 2 * 256 * big),
        "muon": (lambda: f.Muon(lr=2e-2), 3 * 4 + 5 * 6 * 4, ns_flop),
        "kron": (lambda: f.KronPsgd(lr=1e-3, update_probability=1.0), 3 * 4 + 20 * 4, 14 * 2 * 1024 ** 3),
    }


def workloads(kind: str, quick: bool):
    b = transformer_shapes(d=128, layers=6, vocab=1024, ctx=256) if quick else transformer_shapes()
    tag = " (small)" if quick else " (24.2M)"
    if kind in ("adamw", "sgd", "adam", "nadamw", "radam", "qhadamw", "adopt", "ademamix",
                "lion", "sophia", "lamb", "mars"):
        return [("76 tensors" + tag, b), ("500 x 64", [(64,)] * 500)]
    if kind == "adafactor":
        return [("76 tensors" + tag, b), ("1024 x 1024", [(1024, 1024)]) if quick else ("4096 x 4096", [(4096, 4096)])]
    if kind == "af8":
        return [("76 tensors" + tag, b), ("2048 x 1024", [(2048, 1024)])]
    if kind in ("af8m", "came", "apollo"):
        return [("2048 x 1024", [(2048, 1024)])]
    return [("1024 x 1024", [(1024, 1024)])]


def make_opt(kind: str):
    return _factories()[kind][0]()


def _noop_kernels(emu):
    """Replace the emulator's execution by a counting no-op (argument count still checked)."""

    def call(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        if len(args) != len(self.params):
            raise emu.EmulatorError(f"{self.expr}: {len(args)} arguments for {len(self.params)} parameters")
        emu.stats.launches += 1
        emu.stats.by_kernel[self.expr] = emu.stats.by_kernel.get(self.expr, 0) + 1

    emu.Kernel.__call__ = call


def run_gpu(kind, shapes, repeats):
    from tests.cuda_emu import emu, fakecupy

    _noop_kernels(emu)
    with fakecupy.installed() as cp:
        rng = np.random.default_rng(0)
        items = []
        for i, s in enumerate(shapes):
            n = math.prod(s)
            items.append(OptItem(f"p{i}", s, cp.asarray(rng.standard_normal(n, dtype=np.float32)),
                                 cp.asarray(rng.standard_normal(n, dtype=np.float32))))
        opt = make_opt(kind)
        for _ in range(2):
            opt.step_batch(items)
        st = fakecupy.stats
        st.reset()
        ops0 = st.ops
        opt.step_batch(items)
        launches, other = st.launches, st.ops - ops0
        syncs, allocs = st.syncs, st.allocs
        times = []
        for _ in range(repeats):
            c0 = st.call_s
            t0 = time.perf_counter()
            opt.step_batch(items)
            times.append(time.perf_counter() - t0 - (st.call_s - c0))  # less the time inside the stand-in's calls
        host = statistics.median(times) * 1e6
    n = sum(math.prod(s) for s in shapes)
    total = launches + other
    _, nbytes, flop = _factories()[kind]
    gpu = max(MIN_KERNEL_US * total, n * nbytes / BANDWIDTH * 1e6 + flop / GEMM_FLOPS * 1e6)
    est = max(host + LAUNCH_US * total, gpu)
    return dict(launches=f"{total} ({launches}+{other})", syncs=syncs, allocs=allocs, host_us=host, est_us=est)


def run_numpy(kind, shapes, repeats):
    rng = np.random.default_rng(0)
    items = []
    for i, s in enumerate(shapes):
        n = math.prod(s)
        items.append(OptItem(f"p{i}", s, rng.standard_normal(n, dtype=np.float32),
                             rng.standard_normal(n, dtype=np.float32)))
    opt = make_opt(kind)
    for _ in range(3):
        opt.step_batch(items)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step_batch(items)
        times.append(time.perf_counter() - t0)
    return dict(host_us=statistics.median(times) * 1e6)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller 76-tensor set")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--numpy", action="store_true", help="time the NumPy path instead")
    ap.add_argument("--only", default=",".join(_factories()),
                    help="comma-separated: " + ",".join(_factories()))
    args = ap.parse_args(argv)
    for kind in args.only.split(","):
        for label, shapes in workloads(kind, args.quick):
            fn = run_numpy if args.numpy else run_gpu
            r = fn(kind, shapes, args.repeats)
            print(f"{kind:6s} {label:22s} " + "  ".join(
                f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()

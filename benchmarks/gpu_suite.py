"""The GPU benchmark suite: flatopt on CuPy against the PyTorch references on the same device, in one process.

``python -m benchmarks.gpu_suite [--only adamw,sgd,...] [--repeats 20] [--peak-gbs 4800]`` (also run by
``python -m benchmarks.gpu_check``, section "Timings").  For each workload of issue #19 it times a steady-state step
of flatopt and of the reference after warm-up steps, median over ``--repeats`` steps measured with CUDA events of
each library, and prints flatopt's time, the reference's, the speed ratio (reference time / flatopt time: > 1 means
flatopt is faster) and flatopt's achieved bandwidth as a fraction of the device's peak (bytes a fused step must move:
see ``benchmarks.gpu_host._factories``).

| kind | workloads | reference |
|---|---|---|
| adamw | one 16M buffer, 76 tensors (24.2M), 500 × 64 | ``torch.optim.AdamW(fused=True)`` |
| sgd | the same | ``torch.optim.SGD(momentum=0.9, weight_decay=1e-4, fused=True)`` |
| adafactor | 76 tensors, 4096 × 4096 | ``torch.optim.Adafactor`` (foreach) — its defaults differ from flatopt's (no
  relative step, no update clipping): a time comparison, not the same arithmetic |
| af8, af8m, came | 2048 × 1024 | adafactor8bit 0.4.6 with ``use_cuda_kernel=True`` (its JIT-built CUDA kernels; where
  the build fails it falls back to PyTorch with a warning, and the row says so) |
| muon | 1024 × 1024 | ``torch.optim.Muon`` (its Newton–Schulz runs in bfloat16, flatopt's in float32) |
| kron | 1024 × 1024, a preconditioner update every step | kron_torch 0.3.3 ``Kron`` (eager) |

Without a CUDA device, ``--dry`` runs every row on the CuPy stand-in of ``tests/cuda_emu`` against torch on the CPU
with wall-clock timing: that proves the suite runs (the smoke test does it), its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flatopt  # noqa: E402

from .bench_adamw import transformer_shapes  # noqa: E402
from .gpu_host import _factories  # noqa: E402

KINDS = ("adamw", "sgd", "adafactor", "af8", "af8m", "came", "muon", "kron")


def workloads(kind: str, quick: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    b = transformer_shapes(d=128, layers=6, vocab=1024, ctx=256) if quick else transformer_shapes()
    tag = "76 tensors" + (" (small)" if quick else f" ({sum(math.prod(s) for s in b) / 1e6:.1f}M)")
    if kind in ("adamw", "sgd"):
        return [("one 16M buffer", [(1 << 16,)] if quick else [(1 << 24,)]), (tag, b), ("500 x 64", [(64,)] * 500)]
    if kind == "adafactor":
        return [(tag, b), ("4096 x 4096", [(256, 256)] if quick else [(4096, 4096)])]
    if kind in ("af8", "af8m", "came"):
        return [("2048 x 1024", [(256, 128)] if quick else [(2048, 1024)])]
    return [("1024 x 1024", [(128, 128)] if quick else [(1024, 1024)])]


# ----- the references (torch) -----------------------------------------------------------------------------------

def _torch_ref(kind: str, params):
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused=True), "torch AdamW fused"
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-4, fused=True), "torch SGD fused"
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, foreach=True), "torch Adafactor foreach"
    if kind in ("af8", "af8m", "came"):
        import adafactor8bit.optimizer as a8

        extra = {"af8": {}, "af8m": {"beta1": 0.9}, "came": {"beta1": 0.9, "beta3": 0.9999}}[kind]
        opt = a8.Adafactor8Bit(params, lr=1e-2, use_cuda_kernel=True, **extra)
        # its JIT build of the CUDA kernels happens once; where it fails it logs and runs its PyTorch path
        cuda = bool(a8._load_cuda_module(True))
        return opt, "adafactor8bit 0.4.6 " + ("CUDA kernels" if cuda else "(its kernels did not build: PyTorch path)")
    if kind == "muon":
        return torch.optim.Muon(params, lr=2e-2, weight_decay=0.0), "torch Muon (bf16 NS)"
    if kind == "kron":
        from .bench_kron import _eager_kron_torch

        kt = _eager_kron_torch()
        return kt.Kron(params, lr=1e-3, preconditioner_update_probability=1.0), "kron_torch Kron eager"
    raise ValueError(kind)


# ----- timing ---------------------------------------------------------------------------------------------------

def _median_ms(step, sync, event_pair, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        if event_pair is None:
            t0 = time.perf_counter()
            step()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            start, end, elapsed = event_pair()
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(elapsed(start, end))
    return float(np.median(times))


def run_row(kind: str, shapes, *, dry: bool, repeats: int, warmup: int) -> dict:
    import torch

    factory, nbytes, _ = _factories()[kind]
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal(math.prod(s), dtype=np.float32) * 0.1,
             rng.standard_normal(math.prod(s), dtype=np.float32) * 0.01) for s in shapes]
    n = sum(p.size for p, _ in data)

    with contextlib.ExitStack() as stack:
        if dry:
            from tests.cuda_emu import fakecupy

            cp = stack.enter_context(fakecupy.installed())
            fl_events = None
            tdev = "cpu"
            t_events = None
            fl_sync = t_sync = lambda: None  # noqa: E731
        else:
            from flatopt.core import backend

            cp = backend.cupy()
            tdev = "cuda"
            fl_sync = cp.cuda.Device().synchronize
            t_sync = torch.cuda.synchronize

            def fl_events():
                return cp.cuda.Event(), cp.cuda.Event(), cp.cuda.get_elapsed_time

            def t_events():
                return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                        lambda a, b: a.elapsed_time(b))

        opt = factory()
        items = [flatopt.OptItem(f"p{i}", s, cp.asarray(p), cp.asarray(g)) for i, (s, (p, g)) in enumerate(zip(shapes, data))]
        ms = _median_ms(lambda: opt.step_batch(items), fl_sync, fl_events, repeats, warmup)

        params = []
        for s, (p, g) in zip(shapes, data):
            t = torch.nn.Parameter(torch.from_numpy(p.reshape(s).copy()).to(tdev))
            t.grad = torch.from_numpy(g.reshape(s).copy()).to(tdev)
            params.append(t)
        try:
            ref, ref_name = _torch_ref(kind, params)

            def ref_step():
                with contextlib.redirect_stdout(io.StringIO()):  # kron_torch prints on its first step
                    ref.step()

            ref_ms = _median_ms(ref_step, t_sync, t_events, repeats, warmup)
        except Exception as e:  # a missing package or a reference that cannot run here: the row says why
            ref, ref_name, ref_ms = None, f"not run: {type(e).__name__}: {e}"[:120], math.nan
    return dict(ms=ms, ref_ms=ref_ms, ref=ref_name, gbs=n * nbytes / (ms * 1e-3) / 1e9, n=n)


def table(kinds, *, dry: bool, quick: bool, repeats: int, warmup: int, peak_gbs: float) -> list[str]:
    rows = ["| optimizer | workload | flatopt ms | reference | reference ms | speed vs reference | flatopt bandwidth "
            "(of peak) |", "|---|---|---:|---|---:|---:|---:|"]
    for kind in kinds:
        for label, shapes in workloads(kind, quick):
            r = run_row(kind, shapes, dry=dry, repeats=repeats, warmup=warmup)
            ratio = "—" if math.isnan(r["ref_ms"]) else f"{r['ref_ms'] / r['ms']:.2f}×"
            ref_ms = "—" if math.isnan(r["ref_ms"]) else f"{r['ref_ms']:.3f}"
            rows.append(f"| {kind} | {label} | {r['ms']:.3f} | {r['ref']} | {ref_ms} | {ratio} | "
                        f"{r['gbs']:.0f} GB/s ({r['gbs'] / peak_gbs:.0%}) |")
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(KINDS), help="comma-separated kinds: " + ",".join(KINDS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth (H200: 4800)")
    ap.add_argument("--quick", action="store_true", help="small shapes")
    ap.add_argument("--dry", action="store_true", help="on the CuPy stand-in and torch on the CPU (no device)")
    args = ap.parse_args(argv)
    kinds = args.only.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--only: unknown kind(s) {bad}; known: {', '.join(KINDS)}")
    table(kinds, dry=args.dry, quick=args.quick, repeats=args.repeats, warmup=args.warmup, peak_gbs=args.peak_gbs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

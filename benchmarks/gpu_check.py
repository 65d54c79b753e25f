"""The one-command GPU check: ``python -m benchmarks.gpu_check [--out benchmarks/results/gpu.md] [--quick]``.

For the day a CUDA device is lent (and to rehearse it without one).  In one process tree, in well under 8 minutes on
one GPU, it writes a Markdown report with:

1. **the GPU tests** — ``tests/test_gpu.py``, the kernel/twin and CuPy tests of every family and the NVRTC compile
   test, run with pytest; on a real device they run on it, without one on the emulated device of ``tests/cuda_emu``
   (CUDA kernels executed on the CPU, CuPy's API held to CuPy 14's signatures);
2. **parity on large shapes** (a real device only) — every fused kernel against its array-agnostic twin
   (``FLATOPT_FORCE_TWIN=1``) bit for bit (Adafactor's within rounding: its sums add in another order than the
   twin's), and CuPy against NumPy (max relative difference), on buffers of training
   size: AdamW and SGD on 16M elements, Adafactor on 4096×4096, Adafactor8Bit on 2048×1024;
3. **timings** (a real device only) — the GPU benchmark suite, ``benchmarks.gpu_suite``: median step time by CUDA
   events after warm-up, flatopt against torch fused AdamW / SGD, torch Adafactor, adafactor8bit's CUDA kernels, torch
   Muon and kron_torch on the workloads of issue #19, with the achieved bandwidth as a fraction of the device's
   (``--peak-gbs``, H200: 4800 GB/s).

Each section is time-boxed; a section that cannot run (no device, no torch) says why in the report instead.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ["tests/test_gpu.py", "tests/test_kernels_compile.py", "tests/test_device_paths.py"]
FAMILY_TESTS = ["tests/test_adafactor.py", "tests/test_adafactor8bit.py", "tests/test_kron.py", "tests/test_muon.py",
                "tests/test_muon_adamw.py", "tests/test_sgd_adamw.py"]
FAMILY_SELECT = "gpu or cupy or kernel or twin"


def _device() -> tuple[bool, str]:
    from flatopt.core import backend

    if not backend.gpu_available():
        return False, "no CUDA device answers: tests on the emulated device (tests/cuda_emu), no parity or timings"
    cp = backend.cupy()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return True, f"{name}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}"


def _pytest(args: list[str], timeout: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
        summary = lines[-1] if lines else f"pytest printed nothing (exit {out.returncode})"
        failed = [ln for ln in out.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        text = summary + ("\n\n" + "\n".join(f"    {ln}" for ln in failed[:40]) if failed else "")
    except subprocess.TimeoutExpired:
        text = f"timed out after {timeout} s"
    return text, time.perf_counter() - t0


def _parity(quick: bool) -> list[str]:
    """Kernel vs twin (bits) and CuPy vs NumPy (max relative difference) on training-size buffers."""
    import flatopt
    from flatopt.core import backend

    cp = backend.cupy()
    cases = [
        ("AdamW", lambda: flatopt.AdamW(lr=1e-3), (1 << 22,) if quick else (1 << 24,)),
        ("SGD momentum", lambda: flatopt.SGD(lr=1e-2, momentum=0.9), (1 << 22,) if quick else (1 << 24,)),
        ("Adafactor", lambda: flatopt.Adafactor(), (1024, 1024) if quick else (4096, 4096)),
        ("Adafactor8Bit factored", lambda: flatopt.Adafactor8Bit(lr=1e-2), (2048, 1024)),
        ("Adafactor8Bit AdamW-style", lambda: flatopt.Adafactor8Bit(lr=1e-3, factored=False, beta1=0.9, beta2=0.999),
         (2048, 1024)),
    ]
    rows = ["| optimizer | shape | kernel ≡ twin | CuPy vs NumPy (max rel. diff., 3 steps) |", "|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for label, make, shape in cases:
        n = int(np.prod(shape))
        p0 = rng.standard_normal(n, dtype=np.float32)
        grads = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
        out = {}
        for mode in ("kernel", "twin", "numpy"):
            os.environ["FLATOPT_FORCE_TWIN"] = "1" if mode == "twin" else "0"
            opt = make()
            p = p0.copy() if mode == "numpy" else cp.asarray(p0)
            for g in grads:
                opt.step("w", shape, p, g if mode == "numpy" else cp.asarray(g))
            out[mode] = backend.to_numpy(p)
        os.environ.pop("FLATOPT_FORCE_TWIN", None)
        same = out["kernel"].tobytes() == out["twin"].tobytes()

        def rel(a, b):
            return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

        # Adafactor's kernel adds its sums in another order than the twin (kernels/adafactor.cu): rounding expected
        twin = "yes" if same else f"no: max rel. diff. {rel(out['kernel'], out['twin']):.2e}"
        if not same and label != "Adafactor":
            twin = f"**{twin}**"
        rows.append(f"| {label} | {shape} | {twin} | {rel(out['kernel'], out['numpy']):.2e} |")
    return rows


def _time_cuda(step, repeats: int = 20, warmup: int = 5) -> float:
    from flatopt.core import backend

    cp = backend.cupy()
    for _ in range(warmup):
        step()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def _timings(peak_gbs: float) -> list[str]:
    """The GPU benchmark suite (``benchmarks.gpu_suite``): flatopt vs the PyTorch references on every workload."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return ["torch is not importable: no reference timings"]
    from benchmarks import gpu_suite

    return gpu_suite.table(gpu_suite.KINDS, dry=False, quick=False, repeats=20, warmup=5, peak_gbs=peak_gbs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.md", help="report path")
    ap.add_argument("--quick", action="store_true", help="smaller parity shapes, the GPU tests only")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth (H200: 4800)")
    args = ap.parse_args(argv)
    if not args.out.parent.is_dir():
        ap.error(f"--out: folder {args.out.parent} does not exist")
    real, device = _device()
    lines = [f"# GPU check — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"Device: {device}  ", f"Host: {platform.processor() or platform.machine()}, Python "
             f"{platform.python_version()}, NumPy {np.__version__}  ",
             f"Command: `python -m benchmarks.gpu_check{' --quick' if args.quick else ''}`", ""]
    lines += ["## GPU tests", ""]
    text, secs = _pytest(GPU_TESTS, timeout=300)
    lines += [f"`{' '.join(GPU_TESTS)}` ({secs:.0f} s): {text}", ""]
    if not args.quick:
        text, secs = _pytest([*FAMILY_TESTS, "-k", FAMILY_SELECT], timeout=240)
        lines += [f"family tests `-k \"{FAMILY_SELECT}\"` ({secs:.0f} s): {text}", ""]
    lines += ["## Parity on large shapes", ""]
    lines += _parity(args.quick) if real else ["not run: " + device]
    lines += ["", "## Timings (median of 20 steps by CUDA events, after 5 warm-up steps)", ""]
    lines += _timings(args.peak_gbs) if real and not args.quick else ["not run: " + (device if not real else "--quick")]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one-command GPU check: ``python -m benchmarks.gpu_check [--out benchmarks/results/gpu.md] [--quick]``.

For the day a CUDA device is lent (and to rehearse it without one).  In one process tree, in under 10 minutes on
one GPU (each section time-boxed), it writes a Markdown report with:

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

4. **every registry optimizer's step** (a real device only) — median step time on the 76-tensor transformer set
   (24.2M parameters, float32) and the bytes it must move (parameters and gradients read, parameters and state
   written) as a fraction of ``--peak-gbs``;
5. **subnormals** (a real device only) — flatopt's kernels keep float32 subnormals as the CPU does (they are compiled
   without -ftz=true): AdamW on subnormal gradients against NumPy, the CuPy twin (whose ufuncs flush) beside it; an
   all-zero 8-bit block keeps a finite scale and min_log; the fused 8-bit decode of every AL8 code against CuPy's
   ``exp2`` bit for bit;
6. **multi-GPU placement** (two devices or more) — a step of parameters on device 1 while device 0 is current: it
   completes, and the state lives on device 1;
7. **NCCL** (CuPy with NCCL) — one process per device: ``flatopt.distributed``'s NCCL backend all-reduces and
   broadcasts float16/float32/float64/int32/int64 buffers, and a strided buffer is refused.

Each section is time-boxed and guarded: a section that cannot run (no device, no torch, one device, no NCCL) or that
fails says so in the report, and the report is rewritten after every section, so a failure or a timeout later on
leaves what ran.  ``--dry-run`` writes the report without a device (every device section says why it did not run;
the smoke test runs it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
import traceback
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


def _registry_timings(peak_gbs: float, quick: bool, budget_s: float = 100.0) -> list[str]:
    """Every registry optimizer's steady-state step on the 76-tensor set, with its bandwidth."""
    from flatopt.core import backend
    from tests.registry import REGISTRY

    from .bench_adamw import transformer_shapes

    cp = backend.cupy()
    shapes = transformer_shapes(d=128, layers=6, vocab=1024, ctx=256) if quick else transformer_shapes()
    rows = ["| optimizer | ms / step | bytes moved / step | bandwidth (of peak) |", "|---|---:|---:|---:|"]
    rng = np.random.default_rng(0)
    deadline = time.perf_counter() + budget_s
    for name, spec in sorted(REGISTRY.items()):
        if time.perf_counter() > deadline:
            rows.append(f"| {name} | not run: the section's {budget_s} s were spent | | |")
            continue
        try:
            import flatopt

            params = {f"p{i}": (s, cp.asarray(rng.standard_normal(s, dtype=np.float32))) for i, s in enumerate(shapes)}
            if spec.make_for is not None:
                opt = spec.make_for({n: s for n, (s, _) in params.items()})
            else:
                opt = spec.make()
            grads = {n: cp.asarray(rng.standard_normal(s, dtype=np.float32)) for n, (s, _) in params.items()}
            items = [flatopt.OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())]

            def step(opt=opt, items=items):
                opt.step_batch(items)
                opt.end_iteration()

            ms = _time_cuda(step, repeats=10, warmup=3)
            nbytes = sum(int(p.nbytes) for _, p in params.values())
            moved = 3 * nbytes + 2 * int(opt.state_nbytes())  # p read + written, g read, the state read + written
            gbs = moved / (ms * 1e-3) / 1e9
            rows.append(f"| {name} | {ms:.3f} | {moved / 1e6:.0f} MB | {gbs:.0f} GB/s ({gbs / peak_gbs:.0%}) |")
        except Exception as exc:  # noqa: BLE001 - one row's failure is reported, the others still run
            rows.append(f"| {name} | **failed**: {type(exc).__name__}: {str(exc)[:200]} | | |")
        print(rows[-1], flush=True)
    return rows


_A8DEC = """
template <typename T>
__global__ void a8dec(const unsigned int* q, const float* sc, const float* ml, float* out, long long n, int per) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a8_al_value(q[i], sc[i / per], ml[i / per], (T)254);
}
"""


def _subnormals() -> list[str]:
    """Subnormal float32 inputs: kernels vs NumPy (flatopt's kernels keep subnormals), the CuPy twin beside them."""
    import flatopt
    from flatopt.adafactor8bit import quant
    from flatopt.core import backend, kernels

    cp = backend.cupy()
    out = []
    tiny = np.float32(np.finfo(np.float32).tiny)
    g = (np.arange(1, 4097, dtype=np.float32) * np.float32(1e-3)) * tiny  # subnormal gradients
    p0 = np.zeros(g.size, np.float32)
    res = {}
    for mode in ("numpy", "kernel", "twin"):
        os.environ["FLATOPT_FORCE_TWIN"] = "1" if mode == "twin" else "0"
        opt = flatopt.AdamW(lr=1e-3, eps=0.0)
        p = p0.copy() if mode == "numpy" else cp.asarray(p0)
        opt.step("w", g.shape, p, g if mode == "numpy" else cp.asarray(g))
        res[mode] = (backend.to_numpy(p), backend.to_numpy(opt.state_dict().buffers["m/w"]))
    os.environ.pop("FLATOPT_FORCE_TWIN", None)
    same = res["kernel"][0].tobytes() == res["numpy"][0].tobytes()
    out.append(f"* AdamW, 4096 subnormal gradients, one step: kernel ≡ NumPy: **{'yes' if same else 'no'}**; "
               f"CuPy twin ≡ NumPy: {'yes' if res['twin'][0].tobytes() == res['numpy'][0].tobytes() else 'no'} "
               f"(its ufuncs flush subnormals)")
    for mode in ("numpy", "kernel", "twin"):
        out.append(f"  * {mode}: non-zero first moments {int(np.count_nonzero(res[mode][1]))} of {g.size}")
    # an all-zero 8-bit block: finite scale and min_log (fused Adafactor8Bit, AdamW-style AL8)
    opt = flatopt.Adafactor8Bit(lr=1e-3, factored=False, beta1=0.9, beta2=0.999, min_8bit_size=0)
    p = cp.zeros(4096, cp.float32)
    opt.step("w", (4096,), p, cp.zeros(4096, cp.float32))
    bufs = opt.state_dict().buffers
    bad = [k for k, v in bufs.items() if ("scale" in k or "min_log" in k) and not np.isfinite(backend.to_numpy(v)).all()]
    out.append(f"* Adafactor8Bit on an all-zero gradient: non-finite scale/min_log buffers: {bad or 'none'}")
    # every AL8 code decoded by the fused decode (a8_codec.cuh) and by the twin (CuPy's exp2), bit for bit
    rng = np.random.default_rng(1)
    blocks, per = 512, 256
    q = np.tile(np.arange(256, dtype=np.uint32), blocks)
    sc = rng.uniform(1e-3, 250.0, blocks).astype(np.float32)
    ml = rng.uniform(-126.0, 0.0, blocks).astype(np.float32)
    header = (kernels.KERNEL_DIR / "a8_codec.cuh").read_text()
    fn = backend.raw_function(("gpu_check", "a8dec"), '#line 1 "a8_codec.cuh"\n' + header + _A8DEC, ["a8dec<float>"],
                              "a8dec<float>")
    dev = cp.empty(q.size, cp.float32)
    fn(((q.size + 255) // 256,), (256,), (cp.asarray(q), cp.asarray(sc), cp.asarray(ml), dev, np.int64(q.size),
                                          np.int32(per)))
    twin = cp.empty(q.size, cp.float32)
    quant.al_decode(cp, cp.asarray(q.astype(np.uint8)), cp.asarray(sc), cp.asarray(ml), twin, block=per, fmt="al8")
    diff = int(cp.count_nonzero(dev.view(cp.uint32) != twin.view(cp.uint32)))
    out.append(f"* AL8 decode, 256 codes x {blocks} (scale, min_log): fused ≠ twin in **{diff}** of {q.size}")
    return out


def _placement() -> list[str]:
    """A step of parameters on device 1 while device 0 is current."""
    import flatopt
    from flatopt.core import backend

    cp = backend.cupy()
    if cp.cuda.runtime.getDeviceCount() < 2:
        return ["not run: one device"]
    out = []
    for name, make in (("AdamW", lambda: flatopt.AdamW(lr=1e-3)), ("Adafactor", lambda: flatopt.Adafactor()),
                       ("Adafactor8Bit", lambda: flatopt.Adafactor8Bit(lr=1e-3, min_8bit_size=0)),
                       ("Muon", lambda: flatopt.Muon(lr=0.02)), ("KronPsgd", lambda: flatopt.KronPsgd(lr=1e-3))):
        try:
            with cp.cuda.Device(1):
                p = cp.asarray(np.random.default_rng(0).standard_normal((256, 128), dtype=np.float32))
                g = cp.asarray(np.random.default_rng(1).standard_normal((256, 128), dtype=np.float32))
            opt = make()
            with cp.cuda.Device(0):
                for _ in range(2):
                    opt.step("w", (256, 128), p, g)
            cp.cuda.Device(1).synchronize()
            devs = {int(b.device.id) for b in opt.state_dict().buffers.values() if backend.is_cupy_array(b)}
            out.append(f"* {name}: step completed; state buffers on device(s) {sorted(devs) or '—'}"
                       f"{'' if devs <= {1} else ' **(not the parameters device)**'}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"* {name}: **failed**: {type(exc).__name__}: {str(exc)[:300]}")
    return out


def _nccl_worker(rank: int, world: int, uid, queue) -> None:
    try:
        from flatopt.core import backend
        from flatopt.distributed import comm as comm_mod

        cp = backend.cupy()
        nccl = backend.nccl()
        with cp.cuda.Device(rank):
            comm = nccl.NcclCommunicator(world, uid, rank)
            be = comm_mod.NcclBackend(comm)
            ok = []
            for dt in ("float16", "float32", "float64", "int32", "int64"):
                x = cp.full(1000, rank + 1, dt)
                be.allreduce_sum([x])
                y = cp.full(1000, rank, dt)
                be.broadcast([(0, y)])
                cp.cuda.get_current_stream().synchronize()
                ok.append(bool((x == world * (world + 1) // 2).all()) and bool((y == 0).all()))
            try:
                be.allreduce_sum([cp.zeros(10, cp.float32)[::2]])
                strided = "accepted"
            except ValueError:
                strided = "refused"
        queue.put((rank, all(ok), strided, None))
    except Exception:  # noqa: BLE001
        queue.put((rank, False, "", traceback.format_exc()[-600:]))


def _nccl_check(timeout: int) -> list[str]:
    """flatopt.distributed's NCCL backend, one process per device."""
    import multiprocessing as mp

    from flatopt.core import backend

    cp = backend.cupy()
    try:
        nccl = backend.nccl()
    except ImportError as exc:  # CuPy without its NCCL library
        return [f"not run: {exc} (pip install 'flatopt[distributed-cuda13]')"]
    if not getattr(nccl, "available", False):
        return ["not run: CuPy has no NCCL (pip install 'flatopt[distributed-cuda13]')"]
    world = cp.cuda.runtime.getDeviceCount()
    uid = nccl.get_unique_id()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, uid, queue)) for r in range(world)]
    for pr in procs:
        pr.start()
    results = []
    try:
        for _ in procs:
            results.append(queue.get(timeout=timeout))
    except Exception as exc:  # noqa: BLE001 - a hung rank
        results.append((-1, False, "", f"timed out waiting for the ranks: {exc!r}"))
    for pr in procs:
        pr.join(5)
        if pr.is_alive():
            pr.kill()
    out = [f"* {world} process(es), one per device"]
    for rank, ok, strided, err in sorted(results, key=lambda r: r[0]):
        out.append(f"* rank {rank}: all-reduce and broadcast of 5 dtypes {'correct' if ok else '**wrong**'}; "
                   f"strided buffer {strided or '?'}" + (f"\n\n```\n{err}\n```" if err else ""))
    return out


def _section(lines: list[str], out: Path, title: str, run, why_not: str | None = None) -> None:
    """Append a section: its rows, or why it did not run, or the error that stopped it; then write the report."""
    lines += [f"## {title}", ""]
    if why_not is not None:
        lines.append(f"not run: {why_not}")
    else:
        t0 = time.perf_counter()
        try:
            lines += run()
            lines.append(f"\n({time.perf_counter() - t0:.0f} s)")
        except Exception:  # noqa: BLE001 - the report keeps what ran; the failure is part of it
            lines += ["**section failed:**", "", "```", traceback.format_exc()[-3000:], "```"]
    lines.append("")
    out.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.md", help="report path")
    ap.add_argument("--quick", action="store_true", help="smaller parity shapes, the GPU tests only")
    ap.add_argument("--dry-run", action="store_true", help="no device sections, no tests: the report's skeleton")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth (H200: 4800)")
    args = ap.parse_args(argv)
    if not args.out.parent.is_dir():
        ap.error(f"--out: folder {args.out.parent} does not exist")
    try:
        real, device = (False, "--dry-run") if args.dry_run else _device()
    except Exception as exc:  # noqa: BLE001 - CuPy present but broken: still a report
        real, device = False, f"CuPy failed: {type(exc).__name__}: {exc}"
    flags = " --quick" if args.quick else (" --dry-run" if args.dry_run else "")
    lines = [f"# GPU check — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"Device: {device}  ", f"Host: {platform.processor() or platform.machine()}, Python "
             f"{platform.python_version()}, NumPy {np.__version__}  ",
             f"Command: `python -m benchmarks.gpu_check{flags}`", ""]
    no_dev = None if real else device

    def tests():
        text, secs = _pytest(GPU_TESTS, timeout=180)
        rows = [f"`{' '.join(GPU_TESTS)}` ({secs:.0f} s): {text}", ""]
        if not args.quick:
            text, secs = _pytest([*FAMILY_TESTS, "-k", FAMILY_SELECT], timeout=120)
            rows += [f"family tests `-k \"{FAMILY_SELECT}\"` ({secs:.0f} s): {text}"]
        return rows

    _section(lines, args.out, "GPU tests", tests, "--dry-run" if args.dry_run else None)
    _section(lines, args.out, "Parity on large shapes", lambda: _parity(args.quick), no_dev)
    _section(lines, args.out, "Subnormals (FTZ) and the 8-bit decode", _subnormals, no_dev)
    _section(lines, args.out, "Multi-GPU placement", _placement, no_dev)
    _section(lines, args.out, "NCCL, one process per device", lambda: _nccl_check(120), no_dev)
    _section(lines, args.out, "Every optimizer's step (76 tensors, float32; median of 10 by CUDA events)",
             lambda: _registry_timings(args.peak_gbs, args.quick), no_dev)
    _section(lines, args.out, "Timings against the references (median of 20 steps by CUDA events, after 5 warm-up "
             "steps)", lambda: _timings(args.peak_gbs), no_dev or ("--quick" if args.quick else None))
    print("\n".join(lines))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

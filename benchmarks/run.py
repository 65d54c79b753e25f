"""Run the benchmarks: ``python -m benchmarks.run [--quick] [--only adamw,sgd,...] [--repeats N] [--threads T]
[--markdown PATH] [--png PATH]``.

Imports every ``benchmarks/bench_*.py`` (or those named by ``--only``), skipping with a note a module whose reference
package is not installed, pins torch and flatopt to the same number of threads (2 by default), prints the machine,
times every case with the harness and prints the table; ``--markdown`` writes it as Markdown and ``--png`` draws the
ratios as a bar chart when matplotlib is importable (it is not a dependency of flatopt).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pkgutil
import platform
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _warm_allocator() -> bool:
    """Put glibc's allocator in the state of a long training run: a process that has freed large tensors has its
    dynamic mmap threshold raised (up to 32 MiB), so per-step temporaries of a few MiB come from the heap instead of
    fresh, page-faulting mmaps.  Fixing it up front makes every suite see that state, whatever ran before it (a
    fresh process would otherwise charge the reference implementations' temporaries page faults that a real run
    does not pay; flatopt allocates nothing per step).  False where glibc's ``mallopt`` is not available."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 64 << 20))


def _set_threads(threads: int) -> None:
    # Before numpy/torch are imported: the elementwise paths never call BLAS, but keep any BLAS/OpenMP pool from
    # oversubscribing the cores the optimizers use.  OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are left as they are.
    os.environ["FLATOPT_NUM_THREADS"] = str(threads)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(threads)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_lines(threads: int) -> list[str]:
    import numpy as np

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        import torch

        torch_v = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        torch_v = "torch not installed"
    try:
        load = "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:  # pragma: no cover
        load = "load average n/a"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"machine: {_cpu_model()}, {os.cpu_count()} logical CPUs ({usable} usable), {load}",
        f"software: Python {platform.python_version()}, numpy {np.__version__}, {torch_v}, "
        f"flatopt threads {threads}",
        f"date: {now}",
    ]


def discover() -> list[str]:
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))


def load_cases(names: list[str], quick: bool, log=print) -> list:
    cases = []
    for name in names:
        try:
            mod = importlib.import_module(f"benchmarks.bench_{name}")
            got = mod.cases(quick)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or str(exc)
            log(f"note: skipping bench_{name}: reference package {missing!r} is not installed")
            continue
        cases.extend(got)
    return cases


def write_png(results, path: str, log=print) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"note: matplotlib is not installed; not writing {path}")
        return False
    rows = [r for r in results if r.ratio is not None]
    labels = [f"{r.case.suite} {r.case.workload.split(',')[0]} | {r.case.impl}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    colors = ["tab:orange" if r.case.impl == "flatopt" else ("tab:gray" if r.case.baseline else "tab:blue")
              for r in rows]
    ax.barh(range(len(rows)), [r.ratio for r in rows], color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("speed relative to the baseline of the workload (> 1 is faster; log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, seconds)")
    ap.add_argument("--only", default="", help="comma-separated suites, e.g. adamw,adafactor (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per case (default 11, quick 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch and flatopt threads (default 2)")
    ap.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    ap.add_argument("--png", metavar="PATH", help="write a bar chart of the ratios (needs matplotlib)")
    args = ap.parse_args(argv)
    _set_threads(args.threads)
    warm = _warm_allocator()
    from .harness import SETTLE_S, markdown, run_cases

    repeats = args.repeats or (3 if args.quick else 11)
    available = discover()
    names = available
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        for w in wanted:
            if w not in available:
                print(f"note: no benchmarks/bench_{w}.py; available: {', '.join(available)}")
        names = [w for w in wanted if w in available]
    header = machine_lines(args.threads) + [
        "allocator: glibc mmap threshold fixed at 32 MiB (a long run's state)" if warm else "allocator: as started"]
    for line in header:
        print(line)
    cases = load_cases(names, args.quick)
    if not cases:
        print("nothing to run")
        return 1
    print(f"{len(cases)} cases, {repeats} timed steps each (median; ratio = baseline median / median):")
    results = run_cases(cases, repeats, settle_s=0.0 if args.quick else SETTLE_S)  # quick: a smoke test
    table = markdown(results)
    print()
    print(table)
    if args.markdown:
        text = "\n".join(f"- {line}" for line in header) + f"\n- {repeats} timed steps per case" + (
            " (quick sizes)" if args.quick else "") + "\n\n" + table
        Path(args.markdown).write_text(text)
        print(f"wrote {args.markdown}")
    if args.png and write_png(results, args.png):
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # pragma: no cover
        traceback.print_exc()
        sys.exit(130)

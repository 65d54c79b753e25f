"""Grid, waves and a bandwidth model of the generated elementwise kernels, per workload, without a GPU.

``python -m benchmarks.kernel_model [--quick] [--dtype float32|float64] [--only adamw,sgd] [--chunks]``

For the workloads of ``benchmarks.gpu_suite`` (one 16M buffer: the per-tensor kernel; the 76 tensors of a transformer
and 500 × 64: one multi-tensor launch over ``core.multi_tensor.CHUNK``-element chunks) and each generated definition
(``core/elementwise``; its flag set of the configuration ``benchmarks.gpu_host`` benchmarks), it prints per kernel:

* ``regs``, ``spill``: registers per thread and spill bytes (stores + loads) from ptxas' report for sm_90, compiled
  with NVRTC as ``tests/test_kernels_compile.py`` reads them (``n/a`` without CuPy's NVRTC: then 4 blocks/SM are
  assumed);
* ``blk/SM``: resident blocks per SM from the registers alone (256 threads per block, registers allocated per warp
  in units of 256, 64K registers and 2048 threads per SM; the kernels use no shared memory), and ``slots`` = 132 SMs
  (an H200) × blk/SM;
* ``grid``, ``waves`` = grid / slots;
* ``MB``: bytes moved per step (every array the flag set reads, once, and every array it writes, once);
* ``roof us``: MB at the bandwidth (4.8 TB/s, the H200's HBM figure: ``benchmarks.gpu_host.BANDWIDTH``);
* ``model us``: the blocks list-scheduled in launch order onto the slots, each block taking its bytes at an equal
  share of the bandwidth (bandwidth / slots), at least ``gpu_host.MIN_KERNEL_US`` (a launch's fixed cost).  This
  charges the last wave's tail in full (a real tail runs faster, as fewer blocks share the bandwidth) and assumes a
  block's start (the table reads) is hidden by the other resident blocks: an estimate, not a measurement;
* ``ratio`` = model / roof.

``--chunks`` adds, for the first algorithm's 76-tensor multi-tensor launch, the same model at other chunk sizes and
for a persistent grid (one block per slot, walking the chunk list with a stride of the grid): the choice of
``CHUNK``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flatopt.core import backend, kernels  # noqa: E402
from flatopt.core import multi_tensor as mt  # noqa: E402
from flatopt.core.elementwise import emit, run  # noqa: E402
from flatopt.core.elementwise.define import REGISTRY  # noqa: E402

from .gpu_host import BANDWIDTH, MIN_KERNEL_US, _factories  # noqa: E402
from .gpu_suite import workloads  # noqa: E402

SMS = 132  # an H200
REGS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM_MAX = 32
ASSUMED_BLOCKS_PER_SM = 4  # without ptxas' report


def ptxas_report(filename: str) -> dict[str, tuple[int, int]] | None:
    """{name expression: (registers, spill bytes)} of every kernel of ``filename`` for sm_90, or None without NVRTC."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        return None
    names = kernels.name_expressions(filename)
    prog = nvrtc.createProgram(kernels.source(filename), filename, [], [])
    try:
        for expr in names:
            nvrtc.addNameExpression(prog, expr)
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", *backend.NVRTC_OPTIONS, "--ptxas-options=-v"])
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, e): e for e in names}
    finally:
        nvrtc.destroyProgram(prog)
    out = {}
    for part in log.split("Function properties for ")[1:]:
        part = part.split("Compiling entry function")[0]
        name = part.split()[0]
        if name not in lowered:
            continue
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
        regs = re.search(r"Used (\d+) registers", part)
        out[lowered[name]] = (int(regs.group(1)) if regs else 0, int(spills.group(1)) + int(spills.group(2)))
    return out


def blocks_per_sm(regs: int | None, threads: int = emit.THREADS) -> int:
    if regs is None:
        return ASSUMED_BLOCKS_PER_SM
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = REGS_PER_SM // (per_warp * (threads // 32))
    return min(by_regs, THREADS_PER_SM // threads, BLOCKS_PER_SM_MAX)


def step_blocks(n: int) -> list[int]:
    """Elements per block of the per-tensor kernel (``run.bind``'s grid, a grid-stride loop of 4 per thread)."""
    per = emit.THREADS * emit.ELEMS
    grid = min(math.ceil(n / per), 65535 * 8)
    work = [0] * grid
    for k, lo in enumerate(range(0, n, per)):
        work[k % grid] += min(per, n - lo)
    return work


def multi_blocks(sizes: list[int], chunk: int) -> list[int]:
    """Elements per block of a multi-tensor launch (``core.multi_tensor.Group``: one block per chunk)."""
    return [min(chunk, n - lo) for n in sizes for lo in range(0, n, chunk)]


def makespan(work: list[int], slots: int, nbytes: int) -> float:
    """Seconds: blocks in launch order onto the first free of ``slots``, each at bandwidth / slots."""
    share = BANDWIDTH / slots
    free = [0.0] * min(slots, len(work))
    for w in work:
        t = heapq.heappop(free)
        heapq.heappush(free, t + w * nbytes / share)
    return max(free) if free else 0.0


def persistent(work: list[int], slots: int, nbytes: int) -> float:
    """Seconds for a persistent grid of ``slots`` blocks, block b taking chunks b, b + slots, ..."""
    per = [0] * slots
    for k, w in enumerate(work):
        per[k % slots] += w
    return max(per) * nbytes / (BANDWIDTH / slots)


def bytes_per_element(d, fs: int, itemsize: int) -> int:
    prog = d.program_at(fs)
    return (len(prog.reads) + len(prog.outputs)) * itemsize


def rows(only: list[str] | None, quick: bool, dtype: np.dtype) -> list[dict]:
    out = []
    factories = _factories()
    ctype = kernels.CTYPES[dtype]
    for algo in sorted(REGISTRY):
        if only and algo not in only:
            continue
        d = REGISTRY[algo]
        cfg = factories[algo][0]().config
        fs = d.flags_of(cfg, 2)  # a steady-state step (SGD's first step differs)
        report = ptxas_report(run.cuda_file(d))
        nbytes = bytes_per_element(d, fs, dtype.itemsize)
        for label, shapes in workloads("adamw", quick):
            sizes = [math.prod(s) for s in shapes]
            kind = "step" if len(sizes) == 1 else "multi"
            expr = f"{emit.cuda_name(d, fs, kind)}<{ctype}>"
            regs, spill = report[expr] if report else (None, None)
            slots = SMS * blocks_per_sm(regs)
            work = step_blocks(sizes[0]) if kind == "step" else multi_blocks(sizes, mt.CHUNK)
            roof = sum(sizes) * nbytes / BANDWIDTH
            model = max(makespan(work, slots, nbytes), MIN_KERNEL_US * 1e-6)
            out.append(dict(algo=algo, fs=fs, kernel=expr, workload=label, regs=regs, spill=spill,
                            bpsm=blocks_per_sm(regs), slots=slots, grid=len(work), waves=len(work) / slots,
                            mb=sum(sizes) * nbytes / 1e6, roof=roof * 1e6, model=model * 1e6, ratio=model / roof))
    return out


def chunk_table(algo: str, quick: bool, dtype: np.dtype) -> list[tuple]:
    d = REGISTRY[algo]
    fs = d.flags_of(_factories()[algo][0]().config, 2)
    report = ptxas_report(run.cuda_file(d))
    expr = f"{emit.cuda_name(d, fs, 'multi')}<{kernels.CTYPES[dtype]}>"
    slots = SMS * blocks_per_sm(report[expr][0] if report else None)
    label, shapes = workloads("adamw", quick)[1]
    sizes = [math.prod(s) for s in shapes]
    nbytes = bytes_per_element(d, fs, dtype.itemsize)
    roof = sum(sizes) * nbytes / BANDWIDTH
    out = []
    for chunk in (1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15):
        work = multi_blocks(sizes, chunk)
        t = makespan(work, slots, nbytes)
        out.append((f"chunks of {chunk}", len(work), len(work) / slots, t * 1e6, t / roof))
    for chunk in (1 << 10, 1 << 12):
        t = persistent(multi_blocks(sizes, chunk), slots, nbytes)
        out.append((f"persistent grid, chunks of {chunk}", slots, 1.0, t * 1e6, t / roof))
    return [(expr, label, slots, roof * 1e6)] + out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the suite's small workloads")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--only", default="", help="comma-separated algorithms")
    ap.add_argument("--chunks", action="store_true", help="also the chunk-size comparison")
    args = ap.parse_args(argv)
    dtype = np.dtype(args.dtype)
    only = [a for a in args.only.split(",") if a] or None
    print(f"H200 model: {SMS} SMs, {REGS_PER_SM} registers and {THREADS_PER_SM} threads per SM, "
          f"{BANDWIDTH / 1e12:.1f} TB/s; {emit.THREADS} threads per block, {emit.ELEMS} elements per thread per "
          f"group, multi-tensor chunk {mt.CHUNK}; {dtype.name}")
    print("| algorithm | kernel | workload | regs | spill | blk/SM | slots | grid | waves | MB | roof us | model us | "
          "ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows(only, args.quick, dtype):
        regs = "n/a" if r["regs"] is None else r["regs"]
        spill = "n/a" if r["spill"] is None else r["spill"]
        print(f"| {r['algo']} | `{r['kernel']}` | {r['workload']} | {regs} | {spill} | {r['bpsm']} | {r['slots']} | "
              f"{r['grid']} | {r['waves']:.2f} | {r['mb']:.1f} | {r['roof']:.1f} | {r['model']:.1f} | "
              f"{r['ratio']:.2f}x |")
    if args.chunks:
        algo = only[0] if only else "adamw"
        (expr, label, slots, roof), *table = chunk_table(algo, args.quick, dtype)
        print(f"\n{algo} `{expr}`, {label}, {slots} slots, roofline {roof:.1f} us")
        print("| blocks | grid | waves | model us | ratio |")
        print("|---|---|---|---|---|")
        for name, grid, waves, t, ratio in table:
            print(f"| {name} | {grid} | {waves:.2f} | {t:.1f} | {ratio:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

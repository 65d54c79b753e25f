"""Probes behind the threading claims in benchmarks/README.md (not a benchmark suite; prints medians).

``python -m benchmarks.threads_probe`` measures, on this machine:

1. **spin** — two threads of elementwise NumPy work right after a threaded GEMM, and after a 0.2 s pause (OpenBLAS's
   idle workers spin for a while after a call and take a core from the threads that run next);
2. **codec** — uf8 decode + encode of 1M elements per thread, serially and on two threads, with 32K and 128K codec
   chunks (short NumPy calls hand the GIL over at every call and do not run in parallel); the d8 encoder's
   nearest-entry search, exact against the table look-up of ``flatopt.adafactor8bit.nearest_lut``;
3. **adafactor** — ``Adafactor.step_batch`` on the transformer-like set with the BLAS held at one thread (GEMV
   statistics sums, ``adafactor.factored_passes.BLAS_MIN``) and without (einsum sums), in-process A/B (needs threadpoolctl);
4. **apollo** — the 256×1024 APOLLO projection of a 2048×1024 weight: NumPy's float32 ziggurat
   (``default_rng(seed).standard_normal``) against flatopt's blocked counter-based draw (``adafactor8bit.apollo_proj.draw``, one
   thread), and the projection GEMM G·Pᵀ on one thread cut into row ranges of 128 and 1024 rows (each range
   repacks P; ``adafactor8bit.apollo.GEMM_TASK``); θ's per-row scaling by einsum against a broadcast multiply (one thread); with
   torch installed, the GEMM on two threads as flatopt runs it (NumPy's BLAS, two row halves) against ``torch.mm``;
5. **scaling** — Adafactor's column and row scaling of U on one thread (2048×1024 in blocks of 256 rows): the column
   factor broadcast row by row against tiled over k rows (``adafactor.factored_passes.TILE``); the apply (x·column factor,
   ·row factor, θ −= U) with the row factor by an out-of-place einsum against an in-place broadcast multiply; and
   whether the row-sum GEMV releases the GIL as ``np.matmul`` and as ``np.dot``;
6. **sizes** — settled in-process A/B of the task sizes: ``core.blocks.BLOCK``/``TASK`` at 128K/256K against
   256K/512K elements (Adafactor's transformer-like set, Adafactor8Bit's factored fp32 step), and
   ``adafactor8bit.apollo_lowrank.TASK`` at 128K against 256K (Adafactor8Bit's APOLLO r = 256 fp32 step), 2048×1024 weights,
   and the elementwise chunk ``core.driver.CHUNK`` at 64K against 128K elements (AdamW, Lion, QHAdamW on one 16M buffer
   and on the transformer-like set);
7. **ranges** — settled in-process A/B of ``core.cpu_plan.RANGE``, the task of a generated algorithm's large item
   (one call of its compiled pass each): 512K, 1M and 2M against one call per 128K chunk and against torch's
   fused step (AdamW, SGD with momentum; one 16M buffer and the transformer-like set), wall and process CPU time;
8. **interop** — AdamW's 16M step right after a torch forward/backward pass and 0.3 s after it: wall time, and the
   CPU time of flatopt's threads and of torch's threads while it runs (torch's OpenMP workers spin after their
   region); run it with and without ``OMP_WAIT_POLICY=PASSIVE``;
9. **isa** — the generated AdamW loop alone on one thread, built for SSE2, AVX2, AVX-512 and x86-64-v4 one at a
   time: from memory (NumPy's alignment and 64-byte aligned) and in the cache, against ``torch._fused_adamw_`` on
   one thread;
10. **native** — the compiled CPU passes (``core/native.py``): the time of their first-use build; the memory floor of
   a Lion step (two NumPy adds per chunk that read p, g, m and write p, m once); settled in-process A/B against the
   NumPy twins they replace (the same bits): SGD, AdamW, Lion, QHAdamW, Sophia, Lamb and Mars on one 16M buffer and
   on the transformer-like set.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _median_ms(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def spin(repeats: int = 7) -> None:
    a = np.random.rand(2048, 1024).astype(np.float32)
    b = np.random.rand(1024, 256).astype(np.float32)
    c = np.empty((2048, 256), np.float32)
    xs = [np.random.rand(1 << 20).astype(np.float32) for _ in range(2)]
    ys = [np.empty(1 << 20, np.float32) for _ in range(2)]
    pool = ThreadPoolExecutor(1)

    def work(k):
        for _ in range(20):
            np.multiply(xs[k], xs[k], out=ys[k])
            np.sqrt(ys[k], out=ys[k])

    def two():
        f = pool.submit(work, 1)
        work(0)
        f.result()

    two()
    after_gemm = _median_ms(two, repeats, before=lambda: np.matmul(a, b, out=c))
    after_pause = _median_ms(two, repeats, before=lambda: time.sleep(0.2))
    print(f"spin: two threads of elementwise work {after_gemm:.1f} ms right after a GEMM, {after_pause:.1f} ms after a "
          f"0.2 s pause ({after_gemm / after_pause:.2f}x)")


def codec(repeats: int = 7) -> None:
    from flatopt.adafactor8bit import quant

    n = 1 << 20
    rng = np.random.default_rng(0)
    saved = quant._CHUNK  # noqa: SLF001
    try:
        for chunk in (1 << 15, 1 << 17):
            quant._CHUNK = chunk  # noqa: SLF001
            ms = [(rng.standard_normal(n) * 1e-3).astype(np.float32) for _ in range(2)]
            qs = [quant.m_init(np, n, 256, "uf8") for _ in range(2)]
            outs = [np.empty(n, np.float32) for _ in range(2)]

            def work(k):
                quant.m_decode(np, qs[k][0], qs[k][1], outs[k], mblock=256, fmt="uf8")
                quant.m_encode(np, ms[k], qs[k][0], qs[k][1], mblock=256, fmt="uf8")

            def serial():
                work(0)
                work(1)

            def two():
                th = threading.Thread(target=work, args=(1,))
                th.start()
                work(0)
                th.join()

            s, t = _median_ms(serial, repeats), _median_ms(two, repeats)
            print(f"codec: uf8 decode+encode, 2 x 1M elements, {chunk >> 10}K chunks: serial {s:.2f} ms, two threads "
                  f"{t:.2f} ms ({s / t:.2f}x)")
    finally:
        quant._CHUNK = saved  # noqa: SLF001
    x = (rng.standard_normal(1 << 17) * 0.1).astype(np.float32)
    mp, codes = quant.dynamic_map(8), np.empty(1 << 17, np.uint8)
    exact = _median_ms(lambda: [codes.__setitem__(slice(i, i + 1024), quant._nearest(np, x[i:i + 1024], mp))  # noqa: SLF001
                                for i in range(0, x.size, 1024)], 3)
    table = _median_ms(lambda: quant._nearest_into(np, x, mp, codes), repeats)  # noqa: SLF001
    print(f"codec: d8 nearest-entry search of 128K elements, exact in 1,024-element slices {exact:.1f} ms, table "
          f"look-up {table:.2f} ms ({exact / table:.0f}x)")


def adafactor(repeats: int = 12) -> None:
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        print("adafactor: needs threadpoolctl (pip install threadpoolctl)")
        return
    import flatopt
    from flatopt.core import shards
    from flatopt import adafactor as af_mod

    from .bench_adamw import make_data, transformer_shapes

    shapes = transformer_shapes()
    sets = [[flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, make_data(shapes)))]
            for _ in range(2)]
    opts = [flatopt.Adafactor(), flatopt.Adafactor()]
    real = shards.cap_enter

    def run(k):
        af_mod._shards.cap_enter = real if k == 0 else (lambda: False)  # noqa: SLF001
        try:
            t_end = time.perf_counter() + 0.25  # settle, as the harness does
            opts[k].step_batch(sets[k])
            while time.perf_counter() < t_end:
                opts[k].step_batch(sets[k])
            t0 = time.perf_counter()
            opts[k].step_batch(sets[k])
            return (time.perf_counter() - t0) * 1e3
        finally:
            af_mod._shards.cap_enter = real  # noqa: SLF001

    times = {0: [], 1: []}
    for r in range(repeats):
        for k in ((0, 1) if r % 2 else (1, 0)):
            times[k].append(run(k))
    g, e = statistics.median(times[0]), statistics.median(times[1])
    print(f"adafactor: transformer-like set, BLAS held at one thread (GEMV sums) {g:.1f} ms, einsum sums {e:.1f} ms "
          f"({e / g:.2f}x)")


def apollo(repeats: int = 15) -> None:
    from flatopt.adafactor8bit import apollo_proj
    from flatopt.core import shards

    rank, cols, rows = 256, 1024, 2048
    n = rank * cols
    buf = np.empty(n, np.float32)

    def blocked():
        for lo in range(0, n, apollo_proj.PROJ_BLOCK):
            apollo_proj.draw(np, 7, lo, buf[lo:lo + apollo_proj.PROJ_BLOCK], 1.0)

    zig = _median_ms(lambda: np.random.default_rng(7).standard_normal((rank, cols), dtype=np.float32), repeats)
    bm = _median_ms(blocked, repeats)
    print(f"apollo: {rank}x{cols} projection, float32 ziggurat {zig:.2f} ms, blocked counter-based draw {bm:.2f} ms "
          f"(one thread, {zig / bm:.1f}x)")
    rng = np.random.default_rng(0)
    g = rng.standard_normal((rows, cols), dtype=np.float32)
    pt = buf.reshape(rank, cols).T
    out = np.empty((rows, rank), np.float32)

    def ranges(step):
        return lambda: [np.matmul(g[i:i + step], pt, out=out[i:i + step]) for i in range(0, rows, step)]

    cs = rng.random(rows, dtype=np.float32)
    th = np.zeros((rows, cols), np.float32)
    tmp = np.empty((128, cols), np.float32)

    def scale(einsum):
        def run():
            for i in range(0, rows, 128):
                if einsum:
                    np.einsum("ij,i->ij", g[i:i + 128], cs[i:i + 128], out=tmp)
                else:
                    np.multiply(g[i:i + 128], cs[i:i + 128, None], out=tmp)
                np.add(th[i:i + 128], tmp, out=th[i:i + 128])
        return run

    bcast, ein = _median_ms(scale(False), repeats), _median_ms(scale(True), repeats)
    print(f"apollo: θ += G·s per row ({rows}x{cols}, 128-row ranges, one thread): broadcast multiply {bcast:.2f} ms, "
          f"einsum {ein:.2f} ms ({bcast / ein:.2f}x)")
    with shards.blas_capped() as capped:
        if not capped:
            print("apollo: the GEMM probe needs threadpoolctl (pip install threadpoolctl)")
            return
        short, long_ = _median_ms(ranges(128), repeats), _median_ms(ranges(1024), repeats)
    print(f"apollo: G·Pᵀ ({rows}x{cols}·{cols}x{rank}) on one thread in 128-row ranges {short:.1f} ms, in 1024-row "
          f"ranges {long_:.1f} ms ({short / long_:.2f}x)")
    try:
        import torch
    except ImportError:
        return
    # the same GEMM on two threads: NumPy's BLAS in two row halves on two threads (as flatopt's APOLLO step runs
    # it) against torch.mm (the original's; torch's CPU wheel links MKL), interleaved after settling
    pool = ThreadPoolExecutor(1)

    def halves():
        with shards.blas_capped():
            f = pool.submit(np.matmul, g[rows // 2:], pt, out=out[rows // 2:])
            np.matmul(g[:rows // 2], pt, out=out[:rows // 2])
            f.result()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    tg, tp = torch.from_numpy(g), torch.from_numpy(np.ascontiguousarray(pt.T))
    times = {"numpy": [], "torch": []}
    try:
        for _ in range(repeats):
            for name, fn in (("numpy", halves), ("torch", lambda: torch.mm(tg, tp.T))):
                fn()
                times[name].append(_median_ms(fn, 1))
    finally:
        torch.set_num_threads(threads)
    blas, mm = statistics.median(times["numpy"]), statistics.median(times["torch"])
    print(f"apollo: G·Pᵀ on two threads: NumPy's BLAS in row halves {blas:.1f} ms, torch.mm {mm:.1f} ms "
          f"({blas / mm:.2f}x)")


def scaling(repeats: int = 21) -> None:
    from flatopt.adafactor import factored_passes

    rows, cols, rb = 2048, 1024, 256
    n, blk = rows * cols, rb * cols
    rng = np.random.default_rng(0)
    g, p = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    rowv, colv = rng.random(rows, dtype=np.float32), rng.random(cols, dtype=np.float32)
    k = -(-factored_passes.TILE // cols)
    tile = np.tile(colv, k)
    v, u = np.empty(blk, np.float32), np.empty(blk, np.float32)

    def col(tiled):
        def run():
            for lo in range(0, n, blk):
                if tiled:
                    np.multiply(g[lo:lo + blk].reshape(-1, k * cols), tile, out=v.reshape(-1, k * cols))
                else:
                    np.multiply(g[lo:lo + blk].reshape(rb, cols), colv, out=v.reshape(rb, cols))
        return run

    def apply(einsum):
        def run():
            for lo in range(0, n, blk):
                i0 = lo // cols
                v2 = v.reshape(rb, cols)
                np.multiply(g[lo:lo + blk].reshape(-1, k * cols), tile, out=v.reshape(-1, k * cols))
                if einsum:
                    np.einsum("ij,i->ij", v2, rowv[i0:i0 + rb], out=u.reshape(rb, cols))
                    p[lo:lo + blk] -= u
                else:
                    v2 *= rowv[i0:i0 + rb, None]
                    p[lo:lo + blk] -= v
        return run

    times = {name: [] for name in ("rows", "tiled", "einsum", "in place")}
    fns = {"rows": col(False), "tiled": col(True), "einsum": apply(True), "in place": apply(False)}
    for _ in range(repeats):  # interleaved
        for name, fn in fns.items():
            times[name].append(_median_ms(fn, 1))
    m = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"scaling: x·column factor ({rows}x{cols}, {rb}-row blocks, one thread) row by row {m['rows']:.2f} ms, "
          f"tiled over {k} rows {m['tiled']:.2f} ms ({m['rows'] / m['tiled']:.2f}x)")
    print(f"scaling: U's apply, row factor by einsum {m['einsum']:.2f} ms, in place {m['in place']:.2f} ms "
          f"({m['einsum'] / m['in place']:.2f}x)")
    # Does the row-sum GEMV release the GIL?  A call that does waits for a spinning Python thread to hand the GIL
    # back (up to the 5 ms switch interval); one that holds it returns at its own speed.
    s2, ones, rows_out = v.reshape(rb, cols), np.ones(cols, np.float32), np.empty(rb, np.float32)
    stop, spins = threading.Event(), [0]

    def spin():
        while not stop.is_set():
            spins[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        while spins[0] < 1000:  # spinning (sleep hands it the GIL)
            time.sleep(0.001)
        held = {name: _median_ms(fn, 7) for name, fn in (
            ("np.matmul", lambda: np.matmul(s2, ones, out=rows_out)), ("np.dot", lambda: np.dot(s2, ones, out=rows_out)))}
    finally:
        stop.set()
        spinner.join()
    print("scaling: matrix-vector product beside a spinning Python thread: " + ", ".join(
        f"{name} {ms:.2f} ms ({'releases' if ms > 1.0 else 'holds'} the GIL)" for name, ms in held.items()))


def _ab(label: str, make_step, variants: dict, repeats: int, prefix: str = "sizes", cpu: bool = False) -> None:
    """Settled, interleaved in-process A/B: ``variants`` maps a name to {(module, attribute): value}; each variant
    steps its own optimizer and data (``make_step()`` -> step, or ``make_step[name]()``) with those constants set
    (restored afterwards).  ``cpu``: also the process CPU time of each timed step (every thread of the process),
    and the load average."""
    steps = {name: (make_step[name] if isinstance(make_step, dict) else make_step)() for name in variants}
    times = {name: [] for name in variants}
    cpus = {name: [] for name in variants}
    load = os.getloadavg()[0]
    names = list(variants)
    for r in range(repeats):
        for name in (names if r % 2 else names[::-1]):
            saved = {(m, a): getattr(m, a) for m, a in variants[name]}
            try:
                for (m, a), v in variants[name].items():
                    setattr(m, a, v)
                t_end = time.perf_counter() + 0.25  # settle, as the harness does
                steps[name]()
                while time.perf_counter() < t_end:
                    steps[name]()
                t0, c0 = time.perf_counter(), time.process_time()
                steps[name]()
                cpus[name].append((time.process_time() - c0) * 1e3)
                times[name].append((time.perf_counter() - t0) * 1e3)
            finally:
                for (m, a), v in saved.items():
                    setattr(m, a, v)
    meds = {n: statistics.median(times[n]) for n in names}
    if cpu:
        print(f"{prefix}: {label} (medians of {repeats}, load average {load:.1f} to {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{n} {meds[n]:.2f} ms wall, {statistics.median(cpus[n]):.2f} ms CPU" for n in names))
        return
    print(f"{prefix}: {label}: " + ", ".join(f"{n} {meds[n]:.2f} ms" for n in names)
          + f" ({meds[names[0]] / meds[names[1]]:.2f}x)")


def sizes(repeats: int = 15) -> None:
    import flatopt
    from flatopt.adafactor8bit import apollo_lowrank
    from flatopt.core import blocks as _blocks
    from flatopt.core import driver as _driver

    from .bench_adamw import make_data, transformer_shapes

    shapes = transformer_shapes()
    rng = np.random.default_rng(0)

    def adafactor_set():
        items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, make_data(shapes)))]
        opt = flatopt.Adafactor()
        return lambda: opt.step_batch(items)

    def a8(**options):
        def make():
            p = rng.standard_normal(2048 * 1024, dtype=np.float32) * 0.05
            g = rng.standard_normal(2048 * 1024, dtype=np.float32)
            opt = flatopt.Adafactor8Bit(**options)
            return lambda: opt.step("w", (2048, 1024), p, g)
        return make

    blocks = {"128K/256K": {(_blocks, "BLOCK"): 1 << 17, (_blocks, "TASK"): 1 << 18},
              "256K/512K": {(_blocks, "BLOCK"): 1 << 18, (_blocks, "TASK"): 1 << 19}}
    _ab("Adafactor transformer-like set, core.blocks.BLOCK/TASK", adafactor_set, blocks, repeats)
    _ab("Adafactor8Bit factored fp32, core.blocks.BLOCK/TASK", a8(quantize=False), blocks, repeats)
    _ab("Adafactor8Bit APOLLO r=256 fp32, adafactor8bit.apollo_lowrank.TASK", a8(
        apollo_rank=256, beta1=0.9, beta2=0.999, relative_step=False, lr=1e-3, scale_parameter=False, d=0.0,
        quantize=False), {"128K": {(apollo_lowrank, "TASK"): 1 << 17}, "256K": {(apollo_lowrank, "TASK"): 1 << 18}},
        repeats)

    def elementwise(make_opt, shapes_):
        def make():
            data = make_data(shapes_)
            items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes_, data))]
            opt = make_opt()  # its step plan, built at its first step, takes the chunk of its variant
            return lambda: opt.step_batch(items)
        return make

    chunks = {"64K": {(_driver, "CHUNK"): 1 << 16}, "128K": {(_driver, "CHUNK"): 1 << 17}}
    for label, make_opt in (("AdamW", lambda: flatopt.AdamW(lr=1e-3, weight_decay=1e-2)),
                            ("Lion", lambda: flatopt.Lion(lr=1e-4, weight_decay=0.1)),
                            ("QHAdamW", lambda: flatopt.QHAdamW(lr=1e-3))):
        _ab(f"{label} one 16M buffer, core.driver.CHUNK", elementwise(make_opt, [(1 << 24,)]), chunks, repeats)
        _ab(f"{label} transformer-like set, core.driver.CHUNK", elementwise(make_opt, shapes), chunks, repeats)


def ranges(repeats: int = 15) -> None:
    """``core.cpu_plan.RANGE``: the elements per task of a generated algorithm's large item (one call of its compiled
    pass per task) at 512K, 1M and 2M, against one call per 128K chunk (``Hooks.ranges`` off, as a hand-written
    pass runs) and torch's fused step (``torch.optim.AdamW(fused=True)``, SGD ``fused=True``) when torch is
    installed."""
    import flatopt
    from flatopt.core import cpu_plan

    from .bench_adamw import make_data, transformer_shapes

    def make(make_opt, shapes, chunks=False):
        def build():
            items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, make_data(shapes)))]
            opt = make_opt()  # its step plan, built at its first step, takes the RANGE of its variant
            if chunks:
                opt.hooks = opt.hooks.replace(ranges=False)
            return lambda: opt.step_batch(items)
        return build

    def make_torch(torch_opt, shapes):
        def build():
            params = []
            for s, (p, g) in zip(shapes, make_data(shapes)):
                params.append(torch.nn.Parameter(torch.from_numpy(p).reshape(s)))
                params[-1].grad = torch.from_numpy(g).reshape(s)
            return torch_opt(params).step
        return build

    try:
        import torch
    except ImportError:
        torch = None
    sizes_ = {"512K": 1 << 19, "1M": 1 << 20, "2M": 1 << 21}
    variants = {"chunks": {}, **{k: {(cpu_plan, "RANGE"): v} for k, v in sizes_.items()}}
    for label, make_opt, torch_opt in (
            ("AdamW", lambda: flatopt.AdamW(lr=1e-3, weight_decay=1e-2),
             lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2, fused=True)),
            ("SGD momentum", lambda: flatopt.SGD(lr=1e-2, momentum=0.9),
             lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True))):
        for wl, shapes in (("one 16M buffer", [(1 << 24,)]), ("transformer-like set", transformer_shapes())):
            makers = {"chunks": make(make_opt, shapes, chunks=True), **{k: make(make_opt, shapes) for k in sizes_}}
            if torch is not None:
                makers["torch fused"] = make_torch(torch_opt, shapes)
            _ab(f"{label} {wl}, core.cpu_plan.RANGE", makers, {**variants, **({"torch fused": {}} if torch else {})},
                repeats, "ranges", cpu=True)


def interop(repeats: int = 12) -> None:
    """AdamW's 16M step right after torch's forward and backward pass (``bench_adamw``'s workload (d)) and 0.3 s
    after it: the wall time and the CPU time of flatopt's threads and of the process's other threads (torch's) while
    the step runs, from ``/proc/self/task/*/schedstat`` (Linux).  Run it with and without ``OMP_WAIT_POLICY=PASSIVE``."""
    import flatopt

    from .bench_adamw import make_data, torch_forward_backward

    def thread_ns() -> dict:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    out[int(tid)] = int(f.read().split()[0])
            except OSError:  # the thread ended
                pass
        return out

    (p, g), = make_data([(1 << 24,)])
    opt = flatopt.AdamW(lr=1e-3, weight_decay=1e-2)
    items = [flatopt.OptItem("p", p.shape, p, g)]
    forward_backward = torch_forward_backward(False)
    for _ in range(3):
        opt.step_batch(items)
        forward_backward()
    res: dict = {"right after": [], "0.3 s after": []}
    for _ in range(repeats):
        for when, rows in res.items():
            forward_backward()
            if when != "right after":
                time.sleep(0.3)
            ours = {threading.main_thread().native_id} | {t.native_id for t in threading.enumerate()
                                                          if t.name.startswith("flatopt")}
            a, t0 = thread_ns(), time.perf_counter()
            opt.step_batch(items)
            wall, b = time.perf_counter() - t0, thread_ns()
            d = {tid: (b[tid] - a.get(tid, 0)) / 1e6 for tid in b}
            rows.append((wall * 1e3, sum(v for t, v in d.items() if t in ours),
                         sum(v for t, v in d.items() if t not in ours)))
    for when, rows in res.items():
        w, mine, other = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"interop: AdamW 16M {when} torch's forward/backward (OMP_WAIT_POLICY="
              f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, load {os.getloadavg()[0]:.1f}): {w:.2f} ms wall, "
              f"flatopt's threads {mine:.2f} ms CPU, the other threads {other:.2f} ms CPU")


def isa(repeats: int = 15) -> None:
    """The generated AdamW loop (weight decay, float32) alone on one thread, built for one instruction set at a time
    (``-DFLATOPT_NO_CLONES`` plus the flags, as ``tests/test_native.py`` builds each clone): thread CPU time of one
    16M-element call from memory, of 1024 calls on 16K elements in the cache, and from memory with the four arrays
    aligned to 64 bytes; beside it ``torch._fused_adamw_`` on one thread (when torch is installed)."""
    import ctypes
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from flatopt import adamw
    from flatopt.core import native as _native
    from flatopt.core.elementwise import run as _run

    cc = shutil.which(os.environ.get("FLATOPT_CC", "cc"))
    if cc is None:
        print("isa: no C compiler")
        return
    n, small = 1 << 24, 1 << 14
    rng = np.random.default_rng(0)

    def arrays(size, align):
        out = []
        for k in range(4):
            buf = np.empty(size + 16, np.float32)
            skip = (-buf.ctypes.data % 64 if align else (16 - buf.ctypes.data) % 64) // 4  # 0 or 16 past a line
            a = buf[skip:skip + size]
            a[...] = rng.standard_normal(size) * (0.1 if k == 1 else 1.0) if k < 2 else 0.0
            out.append(a)
        return out

    cfg = adamw.AdamWConfig(lr=1e-3, weight_decay=1e-2)
    fs, packed = adamw.DEF.flags_of(cfg, 5), _run.values(adamw.DEF, cfg, 5, 1e-3).packed
    scalars = (ctypes.c_double * (len(packed) // 8)).from_buffer_copy(packed)
    sets = {"memory": arrays(n, False), "memory, 64-byte aligned": arrays(n, True), "cache": arrays(small, False)}
    ptrs = {k: (ctypes.c_void_p * 4)(*[a.ctypes.data for a in v]) for k, v in sets.items()}
    builds = {"SSE2": "-mno-avx", "AVX2": "-mavx2", "AVX-512": "-mavx512f", "x86-64-v4": "-march=x86-64-v4"}
    with tempfile.TemporaryDirectory() as d:
        fns = {}
        for name, flag in builds.items():
            so = str(Path(d) / f"{name}.so")
            res = subprocess.run([cc, *_native.FLAGS, "-DFLATOPT_NO_CLONES", flag, "-o", so,
                                  *map(str, _native._sources()), "-lm"], capture_output=True)  # noqa: SLF001
            if res.returncode == 0:
                fn = ctypes.CDLL(so).flatopt_gen_adamw
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                fns[name] = fn
        calls = {f"{name}, {where}": (lambda fn=fn, where=where: [fn(0, fs, ptrs[where], small, scalars)
                                                                   for _ in range(n // small)]
                                      if where == "cache" else fn(0, fs, ptrs[where], n, scalars))
                 for name, fn in fns.items() for where in sets}
        try:
            import torch

            torch.set_num_threads(1)
            tp, tg, tm, tv = (torch.from_numpy(a) for a in sets["memory"])
            step = torch.tensor(5.0)
            calls["torch._fused_adamw_, one thread, memory"] = lambda: torch._fused_adamw_(
                [tp], [tg], [tm], [tv], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8,
                amsgrad=False, maximize=False)
        except ImportError:
            pass
        times: dict = {k: [] for k in calls}
        for _ in range(repeats):
            for k, fn in calls.items():
                c0 = time.thread_time()
                fn()
                times[k].append((time.thread_time() - c0) * 1e3)
    print(f"isa: AdamW, 16M float32 elements, one thread, thread CPU (medians of {repeats}, load "
          f"{os.getloadavg()[0]:.1f}): " + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in times.items()))


def native(repeats: int = 11, quick: bool = False) -> None:
    import flatopt
    from flatopt.core import native as _native

    from .bench_adamw import make_data, transformer_shapes

    ok, where = _native.status()
    print(f"native: {where}")
    if not ok:
        return
    import os
    import shutil
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:  # the first-use build, timed (the README's "about 2 s")
        t0 = time.perf_counter()
        compile_to = _native._compiler(shutil.which(os.environ.get("FLATOPT_CC", "cc")))  # noqa: SLF001
        failed = compile_to(str(Path(d) / "x.so"), ())
        print(f"native: build {time.perf_counter() - t0:.2f} s" + (f" ({failed})" if failed else ""))
    compiled = dict(_native._state)  # noqa: SLF001 - the loaded library
    variants = {"compiled": {(_native, "_state"): compiled},
                "NumPy twin": {(_native, "_state"): {"lib": None, "why": "the A/B's twin side"}}}
    workloads = ([("one 256K buffer", [(1 << 18,)])] if quick else
                 [("one 16M buffer", [(1 << 24,)]), ("transformer-like set", transformer_shapes())])

    def make(make_opt, shapes):
        def build():
            items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, make_data(shapes)))]
            opt = make_opt()
            return lambda: opt.step_batch(items)
        return build

    # The memory floor of a Lion step: read p, g, m and write p, m once (two NumPy adds per chunk, on the threads, in
    # the driver's chunks): no step with that state can be much faster on this machine.
    from flatopt.core import driver as _driver, parallel as _parallel

    n = (1 << 18) if quick else (1 << 24)
    p_, g_, m_ = (np.ones(n, np.float32) for _ in range(3))

    def chunk(a, b):
        np.add(p_[a:b], g_[a:b], out=p_[a:b])
        np.add(m_[a:b], g_[a:b], out=m_[a:b])

    tasks = [(min(_driver.CHUNK, n - a), "floor", (lambda a=a: chunk(a, a + _driver.CHUNK)))
             for a in range(0, n, _driver.CHUNK)]
    _parallel.run_tasks(tasks)
    print(f"native: memory floor of a Lion step, {n >> 20 or n / (1 << 20)}M buffer, two threads: "
          f"{_median_ms(lambda: _parallel.run_tasks(tasks), repeats):.2f} ms")
    for label, make_opt in (("SGD momentum", lambda: flatopt.SGD(lr=1e-2, momentum=0.9)),
                            ("AdamW", lambda: flatopt.AdamW(lr=1e-3, weight_decay=1e-2)),
                            ("Lion", lambda: flatopt.Lion(lr=1e-4, weight_decay=0.1)),
                            ("QHAdamW", lambda: flatopt.QHAdamW(lr=1e-3)),
                            ("Sophia", lambda: flatopt.Sophia(lr=1e-4)),
                            ("Lamb", lambda: flatopt.Lamb(lr=1e-3)),
                            ("Mars", lambda: flatopt.Mars(lr=3e-3))):
        for wl, shapes in workloads:
            _ab(f"{label} {wl}, compiled pass vs NumPy twin", make(make_opt, shapes), variants, repeats, "native")


if __name__ == "__main__":
    wanted = sys.argv[1:] or ["spin", "codec", "adafactor", "apollo", "scaling", "sizes", "ranges", "interop", "isa",
                              "native"]
    for name in wanted:
        {"spin": spin, "codec": codec, "adafactor": adafactor, "apollo": apollo, "scaling": scaling,
         "sizes": sizes, "ranges": ranges, "interop": interop, "isa": isa, "native": native}[name]()

"""KronPsgd: flatopt vs kron_torch 0.3.3 ``Kron`` in eager mode, on the same parameters, in one process.

Both sides update the preconditioner at every step (``update_probability=1.0``: the first ~500 steps of the default
schedule, the expensive regime) with their default factor layout (dense triangular factors up to 8192, diagonal
factors for 1-D tensors).  The baseline is kron_torch eager with ``torch.set_num_threads(2)``; torch.compile is
bypassed (its first CPU step takes ~45 s and it is not what an eager user runs).  The last column is the
**preconditioner** bytes per parameter (the momentum adds 4 bytes per parameter on both sides).

Workloads: (a) an MLP block (512x512, 512x2048, 2048x512 + biases); (b) a small convnet (4-D kernels merged to
2-D by each library's own rule, + biases: kron_torch's signed-difference rule views (O, I, 3, 3) as (O·I·3) x 3,
so it builds an (O·I·3)² factor when O·I·3 <= 8192; flatopt's most-square rule gives O x 9I; this workload
measures that difference in time and memory, the others identical layouts); (c) a tall embedding-like matrix
4096x64 plus 64 bias-sized vectors (diagonal-factor overhead).
"""

from __future__ import annotations

import contextlib
import io
import math
import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import numpy as np  # noqa: E402

import flatopt  # noqa: E402

from .harness import Case  # noqa: E402

SUITE = "kron"
HP = dict(lr=3e-4, weight_decay=1e-2)


def workloads(quick: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    if quick:
        return [
            ("(a) MLP block 128/512", [(128, 128), (128,), (128, 512), (512,), (512, 128), (128,)]),
            ("(b) convnet 3x3 kernels", [(16, 3, 3, 3), (16,), (32, 8, 3, 3), (32,), (10, 32), (10,)]),
            ("(c) 1024x32 + 32 vectors", [(1024, 32)] + [(32,)] * 32),
        ]
    return [
        ("(a) MLP block 512/2048", [(512, 512), (512,), (512, 2048), (2048,), (2048, 512), (512,)]),
        ("(b) convnet 3x3 kernels", [(64, 3, 3, 3), (64,), (128, 64, 3, 3), (128,), (256, 128, 3, 3), (256,),
                                     (10, 256), (10,)]),
        ("(c) 4096x64 + 64 vectors", [(4096, 64)] + [(64,)] * 64),
    ]


def make_data(shapes, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(math.prod(s), dtype=np.float32),
             rng.standard_normal(math.prod(s), dtype=np.float32) * 0.1) for s in shapes]


def flatopt_case(workload, shapes, **knobs) -> Case:
    holder: dict = {}

    def setup():
        data = make_data(shapes)
        opt = flatopt.KronPsgd(update_probability=1.0, **HP, **knobs)
        items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, data))]
        holder["opt"], holder["n"] = opt, sum(p.size for p, _ in data)
        return lambda: opt.step_batch(items)

    def bpp():
        return holder.pop("opt").preconditioner_nbytes() / holder["n"]

    note = "step_batch" + "".join(f", {k}={v!r}" for k, v in knobs.items())
    return Case(SUITE, workload, "flatopt", setup, state_bytes_per_param=bpp, note=note)


def _eager_kron_torch():
    """kron_torch.kron with its torch.compile wrappers bypassed (eager even if torch was imported before)."""
    import kron_torch.kron as kt  # noqa: PLC0415

    for fn in ("_update_precond", "_precond_grad", "_clip_update_rms", "_balance_Q"):
        f = getattr(kt, fn)
        setattr(kt, fn, getattr(f, "_torchdynamo_orig_callable", f))
    return kt


def kron_torch_case(workload, shapes) -> Case:
    holder: dict = {}

    def setup():
        import torch  # noqa: PLC0415

        torch.set_num_threads(2)
        kt = _eager_kron_torch()
        params = []
        for s, (p, g) in zip(shapes, make_data(shapes)):
            t = torch.nn.Parameter(torch.from_numpy(p.reshape(s).copy()))
            t.grad = torch.from_numpy(g.reshape(s).copy())
            params.append(t)
        opt = kt.Kron(params, preconditioner_update_probability=1.0, **HP)
        holder["opt"], holder["n"] = opt, sum(t.numel() for t in params)

        def step():
            with contextlib.redirect_stdout(io.StringIO()):  # kron_torch prints sizes on its first step
                opt.step()

        return step

    def bpp():
        opt = holder.pop("opt")
        qbytes = sum(q.numel() * q.element_size() for st in opt.state.values() for q in st["Q"])
        return qbytes / holder["n"]

    return Case(SUITE, workload, "kron_torch 0.3.3 eager", setup, baseline=True, state_bytes_per_param=bpp,
                note="2 threads")


def cases(quick: bool) -> list[Case]:
    try:
        import kron_torch  # noqa: F401, PLC0415
        import torch  # noqa: F401, PLC0415

        have_ref = True
    except ImportError:
        have_ref = False
    out = []
    for workload, shapes in workloads(quick):
        if have_ref:
            out.append(kron_torch_case(workload, shapes))
        out.append(flatopt_case(workload, shapes))
        if any(len(s) > 2 for s in shapes):  # like for like: kron_torch's merge of >2-D shapes
            out.append(flatopt_case(workload, shapes, merge_rule="kron_torch"))
    return out

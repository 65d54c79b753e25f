"""Soap: flatopt vs pytorch-optimizer 4.1.0 ``SOAP`` (the official rule), on the same matrices, in one process.

Workload: the matrices of AdamW's 76-tensor transformer-like set (``bench_adamw.transformer_shapes``: token and
position embeddings 8192x512 and 2048x512, 6 layers of four 512x512 attention matrices, 512x2048 and 2048x512 MLP
matrices: 38 matrices, 24.1M elements; the biases and norms are left out, a vector is Adam on both sides).  Both
sides with ``max_precond_dim=2048``: the 8192 side of the token embedding uses the identity (an 8192² statistic
and its ``eigh`` are what no one runs; the official default 10000 would build it).  Every other option is the
official default, ``precondition_frequency=10``.  The first step (an ``eigh`` per axis) runs in the untimed
warm-up; the median of single steps is a step without a refresh (one step in ten adds a QR and a product per
axis), so workload (b10) times ten consecutive steps of one layer's six matrices: every timed call
holds exactly one refresh, the amortised cost.  The baseline is pytorch-optimizer with
``torch.set_num_threads(2)``; flatopt steps the set with one ``step_batch`` (items serially, on NumPy's BLAS at
2 threads).  The last column is the state bytes per parameter (m, v, the statistics and the bases).
"""

from __future__ import annotations

import math

import flatopt

from .bench_adamw import make_data, transformer_shapes
from .harness import Case

SUITE = "soap"
HP = dict(lr=3e-3, betas=(0.95, 0.95), weight_decay=1e-2, eps=1e-8, precondition_frequency=10)
MAX_DIM = 2048


def workloads(quick: bool) -> list[tuple[str, list[tuple[int, ...]], int]]:
    """(name, shapes, optimizer steps per timed call): the set's matrices one step at a time (the median is a step
    without a refresh), and one layer's matrices ten steps at a time (exactly one refresh per timed call)."""
    d = 64 if quick else 512
    shapes = [s for s in (transformer_shapes(d=64, layers=1, vocab=512, ctx=128) if quick else transformer_shapes())
              if len(s) == 2]
    total = sum(math.prod(s) for s in shapes)
    layer = [(d, d)] * 4 + [(d, 4 * d), (4 * d, d)]
    return [(f"(b) transformer-like matrices, {len(shapes)}, {total / 1e6:.1f}M", shapes, 1),
            (f"(b10) one layer's 6 matrices (d {d}), 10 steps = 1 refresh", layer, 10)]


def flatopt_case(workload, shapes, reps) -> Case:
    holder: dict = {}

    def setup():
        data = make_data(shapes)
        opt = flatopt.Soap(max_precond_dim=MAX_DIM, **HP)
        items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, data))]
        holder["opt"], holder["n"] = opt, sum(p.size for p, _ in data)

        def step():
            for _ in range(reps):
                opt.step_batch(items)

        return step

    def bpp():
        return holder.pop("opt").state_nbytes() / holder["n"]

    return Case(SUITE, workload, "flatopt", setup, state_bytes_per_param=bpp, note="step_batch")


def reference_case(workload, shapes, reps) -> Case:
    holder: dict = {}

    def setup():
        import torch  # noqa: PLC0415
        from pytorch_optimizer import SOAP  # noqa: PLC0415

        torch.set_num_threads(2)
        params = []
        for s, (p, g) in zip(shapes, make_data(shapes)):
            t = torch.nn.Parameter(torch.from_numpy(p.reshape(s).copy()))
            t.grad = torch.from_numpy(g.reshape(s).copy())
            params.append(t)
        opt = SOAP(params, max_precondition_dim=MAX_DIM, merge_dims=False, precondition_1d=False,
                   correct_bias=True, normalize_gradient=False, **HP)
        holder["opt"], holder["n"] = opt, sum(t.numel() for t in params)

        def step():
            for _ in range(reps):
                opt.step()

        return step

    def bpp():
        opt = holder.pop("opt")
        total = 0
        for st in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                total += st[key].numel() * st[key].element_size()
            for key in ("GG", "Q"):
                total += sum(m.numel() * m.element_size() for m in st[key] if len(m))
        return total / holder["n"]

    return Case(SUITE, workload, "pytorch-optimizer 4.1.0 SOAP", setup, baseline=True, state_bytes_per_param=bpp,
                note="2 threads")


def cases(quick: bool) -> list[Case]:
    import pytorch_optimizer  # noqa: F401, PLC0415 - ImportError: the runner skips this suite with a note

    out = []
    for workload, shapes, reps in workloads(quick):
        out.append(reference_case(workload, shapes, reps))
        out.append(flatopt_case(workload, shapes, reps))
    return out

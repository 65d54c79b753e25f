"""Stiefel: flatopt vs geoopt 0.5.1 ``RiemannianSGD`` on ``EuclideanStiefel``, on the same matrices, in one process.

Workload: the matrices of AdamW's 76-tensor transformer-like set (``bench_adamw.transformer_shapes``: 8192x512,
2048x512, 24 x 512x512, 6 x 512x2048, 6 x 2048x512: 38 matrices, 24.1M elements), momentum 0.9, lr 1e-3.  geoopt's
``EuclideanStiefel`` needs tall matrices (n >= p), so its parameters are the tall orientation (the 512x2048 ones
transposed, as a geoopt user would store them); flatopt steps the matrices as they are (wide ones through a
transposed view).  Both start on the manifold (flatopt's first step, which projects the start, runs in the
untimed warm-up).  The baseline is geoopt with ``torch.set_num_threads(2)``; flatopt steps the set with one
``step_batch`` (items serially, on NumPy's BLAS/LAPACK at 2 threads).  The last column is the state bytes per
parameter (the momentum buffer).
"""

from __future__ import annotations

import math

import numpy as np

import flatopt

from .bench_adamw import make_data, transformer_shapes
from .harness import Case

SUITE = "stiefel"
HP = dict(lr=1e-3, momentum=0.9)


def workloads(quick: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    if quick:
        shapes = [s for s in transformer_shapes(d=64, layers=1, vocab=512, ctx=128) if len(s) == 2]
        return [(f"(b) transformer-like matrices, {len(shapes)} (d 64)", shapes)]
    shapes = [s for s in transformer_shapes() if len(s) == 2]
    total = sum(math.prod(s) for s in shapes)
    return [(f"(b) transformer-like matrices, {len(shapes)}, {total / 1e6:.1f}M", shapes)]


def _tall(p, shape):
    x = p.reshape(shape)
    return np.ascontiguousarray(x.T) if shape[0] < shape[1] else x.copy()


def flatopt_case(workload, shapes) -> Case:
    holder: dict = {}

    def setup():
        data = make_data(shapes)
        opt = flatopt.Stiefel(**HP)
        items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, data))]
        holder["opt"], holder["n"] = opt, sum(p.size for p, _ in data)
        return lambda: opt.step_batch(items)

    def bpp():
        return holder.pop("opt").state_nbytes() / holder["n"]

    return Case(SUITE, workload, "flatopt", setup, state_bytes_per_param=bpp, note="step_batch")


def reference_case(workload, shapes) -> Case:
    holder: dict = {}

    def setup():
        import geoopt  # noqa: PLC0415
        import torch  # noqa: PLC0415

        torch.set_num_threads(2)
        manifold = geoopt.EuclideanStiefel()
        params = []
        for s, (p, g) in zip(shapes, make_data(shapes)):
            x = manifold.projx(torch.from_numpy(_tall(p, s)))
            t = geoopt.ManifoldParameter(x, manifold=manifold)
            t.grad = torch.from_numpy(_tall(g, s))
            params.append(t)
        opt = geoopt.optim.RiemannianSGD(params, **HP)
        for t in params:
            opt.state[t]["momentum_buffer"] = torch.zeros_like(t)
        holder["opt"], holder["n"] = opt, sum(t.numel() for t in params)
        return opt.step  # (its in-place grad.add_(p, alpha=0) leaves p.grad as it was)

    def bpp():
        opt = holder.pop("opt")
        total = sum(st["momentum_buffer"].numel() * 4 for st in opt.state.values())
        return total / holder["n"]

    return Case(SUITE, workload, "geoopt 0.5.1 RiemannianSGD", setup, baseline=True, state_bytes_per_param=bpp,
                note="2 threads")


def cases(quick: bool) -> list[Case]:
    import geoopt  # noqa: F401, PLC0415 - ImportError: the runner skips this suite with a note

    out = []
    for workload, shapes in workloads(quick):
        out.append(reference_case(workload, shapes))
        out.append(flatopt_case(workload, shapes))
    return out

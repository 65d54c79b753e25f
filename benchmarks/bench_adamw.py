"""AdamW: flatopt vs ``torch.optim.AdamW`` (fused, foreach and single-tensor) on the three workloads of issue 2.

(a) one 16M-element float32 buffer; (b) a transformer-like set of 76 tensors (24.2M elements: token and position
embeddings 8192x512 and 2048x512, 6 layers of four 512x512 attention matrices, 512x2048 and 2048x512 MLP matrices
with their biases and two layer norms each, a final norm); (c) 500 tensors of 64 elements.  flatopt steps every workload with one
``step_batch``; torch steps its param list with ``optimizer.step()``.  The baseline is ``fused=True``.

(d) is (a) as a training loop that lets torch compute the gradients runs it: each timed step follows, untimed, a
forward and backward pass of a small MLP in torch (GEMMs and elementwise kernels on torch's OpenMP threads, which
keep spinning on the cores for a while after their last parallel region), for torch fused and flatopt alike.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import flatopt

from .harness import Case

SUITE = "adamw"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def transformer_shapes(d: int = 512, layers: int = 6, vocab: int = 8192, ctx: int = 2048) -> list[tuple[int, ...]]:
    """Token embedding, position embedding, ``layers`` x (q, k, v, o, MLP up/down + biases, 2 norms with bias),
    final norm: 4 + 12 per layer tensors (76, 24.2M elements for the defaults)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4  # attention q, k, v, o
        shapes += [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # MLP
        shapes += [(d,)] * 4  # two layer norms (weight, bias)
    shapes += [(d,), (d,)]  # final norm
    return shapes


def workloads(quick: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    if quick:
        return [
            ("(a) one 256K fp32 buffer", [(1 << 18,)]),
            ("(b) transformer-like, 16 small tensors", transformer_shapes(d=64, layers=1, vocab=512, ctx=128)),
            ("(c) 100 x 64-element tensors", [(64,)] * 100),
        ]
    shapes_b = transformer_shapes()
    total_b = sum(math.prod(s) for s in shapes_b)
    return [
        ("(a) one 16M fp32 buffer", [(16 * 1024 * 1024,)]),
        (f"(b) transformer-like, {len(shapes_b)} tensors, {total_b / 1e6:.1f}M", shapes_b),
        ("(c) 500 x 64-element tensors", [(64,)] * 500),
    ]


def torch_forward_backward(quick: bool):
    """(d)'s prelude: the forward and backward pass of an MLP (64 x 1024 -> 2048 -> 1024, GELU; quick: 256 wide)
    in torch, on torch's threads; returns the function that runs one."""
    gen = torch.Generator().manual_seed(0)
    width = 256 if quick else 1024
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
    x = torch.randn(64, width, generator=gen)

    def run():
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    return run


def make_data(shapes, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Flat float32 (param, grad) pairs; the same data for every implementation of a workload."""
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        n = math.prod(s)
        out.append((rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32) * 0.1))
    return out


def flatopt_case(suite, workload, shapes, make_opt, note="step_batch", prelude=None) -> Case:
    holder: dict = {}

    def setup():
        data = make_data(shapes)
        opt = make_opt()
        items = [flatopt.OptItem(f"p{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, data))]
        holder["opt"], holder["n"] = opt, sum(p.size for p, _ in data)

        def step():
            opt.step_batch(items)

        return step

    def bpp():
        return holder.pop("opt").state_nbytes() / holder["n"]

    return Case(suite, workload, "flatopt", setup, state_bytes_per_param=bpp, note=note, prelude=prelude)


def torch_case(suite, workload, shapes, make_opt, impl, *, baseline=False, prelude=None) -> Case:
    holder: dict = {}

    def setup():
        params = []
        for s, (p, g) in zip(shapes, make_data(shapes)):
            t = torch.nn.Parameter(torch.from_numpy(p).reshape(s))
            t.grad = torch.from_numpy(g).reshape(s)
            params.append(t)
        opt = make_opt(params)
        holder["opt"], holder["n"] = opt, sum(t.numel() for t in params)
        return opt.step

    def bpp():
        opt = holder.pop("opt")
        nbytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                     if torch.is_tensor(v))
        return nbytes / holder["n"]

    return Case(suite, workload, impl, setup, baseline=baseline, state_bytes_per_param=bpp, prelude=prelude)


def cases(quick: bool) -> list[Case]:
    out = []
    for workload, shapes in workloads(quick):
        out.append(torch_case(SUITE, workload, shapes, lambda ps: torch.optim.AdamW(ps, **HP, fused=True),
                              "torch fused", baseline=True))
        out.append(torch_case(SUITE, workload, shapes, lambda ps: torch.optim.AdamW(ps, **HP, foreach=True),
                              "torch foreach"))
        out.append(torch_case(SUITE, workload, shapes, lambda ps: torch.optim.AdamW(ps, **HP, foreach=False),
                              "torch single-tensor"))
        out.append(flatopt_case(SUITE, workload, shapes, lambda: flatopt.AdamW(**HP)))
    shapes = workloads(quick)[0][1]
    workload = f"(d) {workloads(quick)[0][0][4:]}, after torch fwd/bwd"
    prelude = torch_forward_backward(quick)
    out.append(torch_case(SUITE, workload, shapes, lambda ps: torch.optim.AdamW(ps, **HP, fused=True), "torch fused",
                          baseline=True, prelude=prelude))
    out.append(flatopt_case(SUITE, workload, shapes, lambda: flatopt.AdamW(**HP), prelude=prelude))
    return out

"""Muon and MuonAdamW.

Suite ``muon``: flatopt ``Muon`` (float32 Newton–Schulz on NumPy/OpenBLAS) vs ``torch.optim.Muon`` (bfloat16
Newton–Schulz, the baseline) on the benchmark's matrices — 6 layers of four 512x512 attention matrices, 512x2048 and
2048x512 (36 matrices; quick: 1 layer) — with ``torch.set_num_threads(2)``; flatopt with ``workers=1`` (items serial, multi-threaded BLAS) and with its
default (matrices on min(cores, 8) fixed threads, BLAS capped at one thread through threadpoolctl).  Suite ``muon_adamw``: ``MuonAdamW.step_batch`` on a
transformer-like model (Muon on the hidden matrices, AdamW on embeddings, biases and norms), serial loop
(``concurrent=False, muon_workers=1``, the baseline) vs ``step_batch`` with concurrent groups, with
``muon_workers=1`` and with the default workers.
"""

from __future__ import annotations

import math

import numpy as np

import flatopt

from .harness import Case

SUITE = "muon"


def matrix_shapes(layers: int, d: int = 512) -> list[tuple[int, int]]:
    return [s for _ in range(layers) for s in [(d, d)] * 4 + [(d, 4 * d), (4 * d, d)]]


def _data(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(math.prod(s), dtype=np.float32), rng.standard_normal(math.prod(s), dtype=np.float32))
            for s in shapes]


def _flatopt_muon(shapes, workers):
    def setup():
        opt = flatopt.Muon(lr=0.02, weight_decay=0.1, workers=workers)
        items = [flatopt.OptItem(f"m{i}", s, p, g) for i, (s, (p, g)) in enumerate(zip(shapes, _data(shapes)))]
        opt.assign_shards([(it.name, it.shape) for it in items])
        return lambda: opt.step_batch(items)

    return setup


def _torch_muon(shapes):
    def setup():
        import torch

        torch.set_num_threads(2)
        ws = []
        for s, (p, g) in zip(shapes, _data(shapes)):
            w = torch.nn.Parameter(torch.from_numpy(p.reshape(s).copy()))
            w.grad = torch.from_numpy(g.reshape(s).copy())
            ws.append(w)
        opt = torch.optim.Muon(ws, lr=0.02, weight_decay=0.1)
        return opt.step

    return setup


def model_shapes(layers: int, d: int = 512, vocab: int = 8192, ctx: int = 1024) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"wte": (vocab, d), "wpe": (ctx, d), "ln_f": (d,)}
    for i in range(layers):
        for j, s in enumerate([(d, d)] * 4 + [(d, 4 * d), (4 * d, d)]):
            shapes[f"h{i}.w{j}"] = s
        for j, s in enumerate([(d,)] * 4 + [(4 * d,), (d,)] + [(d,)] * 4):
            shapes[f"h{i}.b{j}"] = s
    return shapes


def _muon_adamw(shapes, concurrent, workers):
    def setup():
        muon = [n for n, s in shapes.items() if len(s) == 2 and not n.startswith("w")]
        opt = flatopt.MuonAdamW(shapes, muon, concurrent=concurrent, muon_workers=workers,
                                muon={"weight_decay": 0.1})
        data = _data(list(shapes.values()))
        items = [flatopt.OptItem(n, s, p, g) for (n, s), (p, g) in zip(shapes.items(), data)]
        return lambda: opt.step_batch(items)

    return setup


def cases(quick: bool) -> list[Case]:
    layers = 1 if quick else 6
    mats = matrix_shapes(layers)
    w1 = f"{len(mats)} matrices ({layers} x 4x512², 512x2048, 2048x512)"
    out = [
        Case(SUITE, w1, "torch.optim.Muon", _torch_muon(mats), baseline=True, note="bf16 NS, 2 threads"),
        Case(SUITE, w1, "flatopt Muon workers=1", _flatopt_muon(mats, 1), note="fp32 NS, items serial, BLAS threads"),
        Case(SUITE, w1, "flatopt Muon default", _flatopt_muon(mats, None),
             note="fp32 NS, workers=min(cores, 8), BLAS capped at 1"),
    ]
    one = [(512, 512)] if quick else [(1024, 1024)]
    w0 = f"one {one[0][0]}x{one[0][1]} matrix stepped alone"
    out += [
        Case(SUITE, w0, "torch.optim.Muon", _torch_muon(one), baseline=True, note="bf16 NS, 2 threads"),
        Case(SUITE, w0, "flatopt Muon", _flatopt_muon(one, None),
             note="fp32 NS; A·A and B·X in row blocks on flatopt's threads, BLAS at 1 thread"),
    ]
    shapes = model_shapes(layers, vocab=2048 if quick else 8192)
    n = sum(math.prod(s) for s in shapes.values())
    w2 = f"transformer-like, {len(shapes)} tensors, {n / 1e6:.1f}M"
    out += [
        Case("muon_adamw", w2, "flatopt serial loop", _muon_adamw(shapes, False, 1), baseline=True,
             note="concurrent=False, muon_workers=1"),
        Case("muon_adamw", w2, "flatopt step_batch muon_workers=1", _muon_adamw(shapes, True, 1),
             note="groups concurrent"),
        Case("muon_adamw", w2, "flatopt step_batch default", _muon_adamw(shapes, True, None),
             note="groups concurrent, Muon matrices on fixed threads, BLAS capped"),
    ]
    return out

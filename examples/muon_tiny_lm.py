"""MuonAdamW on a small transformer-like language model with an embedding and a tied output head.

A character-level model of the Zen of Python (the text ships with Python, in the ``this`` module): the context of
the last ``k`` characters is embedded (token + position embeddings), mixed by averaging, passed through a residual
MLP block with RMS norms, and decoded by the **tied** output head ``logits = norm(h) @ embedᵀ``.  Forward and
backward passes are hand-written NumPy.

MuonAdamW gets an explicit manifest: the two hidden matrices of the MLP go to Muon; the embedding, the position
table and the norm gains go to AdamW.  The output head is declared as an alias of the embedding
(``aliases={"head": "embed"}``): both names are passed with the same buffers and the tied weight is updated once,
with the sum of its two gradient contributions.  For comparison the same model is trained with plain AdamW.

    python examples/muon_tiny_lm.py --steps 400
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flatopt  # noqa: E402
from _cli import Formatter, blas_single_thread, positive_int  # noqa: E402

EPS = 1e-6


def zen_text() -> str:
    """The Zen of Python, rot13-encoded in the standard library's ``this`` (which prints it when first imported)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: PLC0415

    return codecs.decode(this.s, "rot13")


def dataset(k: int):
    text = zen_text()
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], np.int64)
    x = np.stack([ids[i : i + k] for i in range(len(ids) - k)])
    y = ids[k:]
    return x, y, vocab


def shapes_for(vocab: int, k: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"embed": (vocab, d), "pos": (k, d), "ln1.gain": (d,), "mlp.w1": (d, 4 * d), "mlp.w2": (4 * d, d),
            "lnf.gain": (d,)}


def init(shapes, seed=0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = {}
    for n, s in shapes.items():
        if n.endswith("gain"):
            p[n] = flatopt.flat_view(np.ones(s, dtype))
        else:
            p[n] = flatopt.flat_view((rng.standard_normal(s) * (0.5 / np.sqrt(s[0]))).astype(dtype))
    return p


def _rmsnorm(x, g):
    rms = np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS)
    n = x / rms
    return n * g, (n, rms)


def _rmsnorm_back(dy, g, cache):
    n, rms = cache
    dg = (dy * n).sum(axis=0)
    dn = dy * g
    return (dn - n * (dn * n).mean(axis=-1, keepdims=True)) / rms, dg


def loss_and_grads(p, shapes, x, y):
    """Cross-entropy and flat gradients; the tied embedding's gradient sums the input and the head parts."""
    V, d = shapes["embed"]
    k = shapes["pos"][0]
    E = p["embed"].reshape(V, d)
    P = p["pos"].reshape(k, d)
    W1 = p["mlp.w1"].reshape(d, 4 * d)
    W2 = p["mlp.w2"].reshape(4 * d, d)
    B = x.shape[0]
    h = (E[x] + P).mean(axis=1)  # (B, d): the token mixer
    n1, c1 = _rmsnorm(h, p["ln1.gain"])
    a = n1 @ W1
    r = np.maximum(a, 0)
    h2 = h + r @ W2
    nf, cf = _rmsnorm(h2, p["lnf.gain"])
    logits = nf @ E.T  # the tied head
    logits -= logits.max(axis=1, keepdims=True)
    pr = np.exp(logits)
    pr /= pr.sum(axis=1, keepdims=True)
    loss = float(-np.log(pr[np.arange(B), y] + 1e-12).mean())
    dl = pr
    dl[np.arange(B), y] -= 1
    dl /= B
    dE = dl.T @ nf
    dh2, dgf = _rmsnorm_back(dl @ E, p["lnf.gain"], cf)
    dW2 = r.T @ dh2
    da = (dh2 @ W2.T) * (a > 0)
    dW1 = n1.T @ da
    dh_mlp, dg1 = _rmsnorm_back(da @ W1.T, p["ln1.gain"], c1)
    de = np.broadcast_to(((dh2 + dh_mlp) / k)[:, None, :], (B, k, d))
    dP = de.sum(axis=0)
    np.add.at(dE, x, de)
    g = {"embed": dE, "pos": dP, "ln1.gain": dg1, "mlp.w1": dW1, "mlp.w2": dW2, "lnf.gain": dgf}
    return loss, {n: np.ascontiguousarray(v, dtype=p[n].dtype).ravel() for n, v in g.items()}


def make_muon_adamw(shapes, lr=0.02, ratio=0.1):
    return flatopt.MuonAdamW(dict(shapes), muon_names=["mlp.w1", "mlp.w2"], lr=lr, adamw_lr_ratio=ratio,
                             muon={"layout": "in_out"}, aliases={"head": "embed"})


def train(make_opt, steps=300, k=8, d=64, batch=64, seed=0, tied_items=True, verbose=False):
    x, y, vocab = dataset(k)
    shapes = shapes_for(len(vocab), k, d)
    p = init(shapes, seed)
    opt = make_opt(shapes)
    rng = np.random.default_rng(seed + 1)
    losses = []
    for step in range(steps):
        idx = rng.integers(0, len(x), batch)
        loss, g = loss_and_grads(p, shapes, x[idx], y[idx])
        items = [flatopt.OptItem(n, shapes[n], p[n], g[n]) for n in shapes]
        if tied_items:  # the head is the embedding: same param and grad memory, one update
            items.append(flatopt.OptItem("head", shapes["embed"], p["embed"], g["embed"]))
        opt.step_batch(items)
        opt.end_iteration()
        losses.append(loss)
        if verbose and step % 100 == 0:
            print(f"  step {step:4d}  loss {np.mean(losses[-20:]):.3f}")
    return losses, p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--steps", type=positive_int, default=400, help="training steps")
    args = ap.parse_args(argv)
    x, _, vocab = dataset(8)
    print(f"Zen of Python: {len(x)} contexts of 8 characters, vocabulary {len(vocab)}")
    print("MuonAdamW (Muon: mlp.w1, mlp.w2; AdamW: embed (tied head), pos, gains)")
    with blas_single_thread():
        lm, _ = train(make_muon_adamw, args.steps, verbose=True)
        print("AdamW on everything")
        la, _ = train(lambda s: flatopt.AdamW(lr=3e-3, weight_decay=0.0), args.steps, tied_items=False,
                      verbose=True)
    print(f"final loss (mean of the last 50 steps): MuonAdamW {np.mean(lm[-50:]):.3f}, AdamW {np.mean(la[-50:]):.3f}")
    return lm, la


if __name__ == "__main__":
    main()

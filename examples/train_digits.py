"""The main job: train a small MLP on the handwritten digits bundled with scikit-learn, once per optimizer.

The forward and backward passes are written by hand in NumPy (or CuPy with ``--device cupy``); the parameters
live in flat buffers that the optimizers update in place.  Every optimizer starts from the same initialisation
and sees the same mini-batches.  At the end it prints a table (final train loss, test accuracy, ms per step,
optimizer-state bytes per parameter) and writes the loss curves to a PNG (when matplotlib is installed).

    python examples/train_digits.py                        # every optimizer, default size
    python examples/train_digits.py --optimizers adamw,sgd --epochs 40 --hidden 256

The model's matrix products are tiny, so the BLAS is held at one thread during training (through threadpoolctl
when it is installed; ``OPENBLAS_NUM_THREADS=1`` does the same without it): OpenBLAS's own threads would otherwise
spin against flatopt's worker threads on the same cores (on a 2-core machine that made the run several times
slower: benchmarks/README.md).
Losses and accuracies are deterministic for a given machine, NumPy/BLAS build and seed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import flatopt  # noqa: E402
from _cli import Formatter, blas_single_thread, check_output, name_list, positive_int  # noqa: E402
from flatopt import OptItem  # noqa: E402
from flatopt.routing import Group, Router, Select  # noqa: E402


# ----------------------------------------------------------------------------------------------- the data
def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


# ---------------------------------------------------------------------------------------------- the model
def param_shapes(hidden: int, depth: int = 2) -> dict[str, tuple[int, ...]]:
    """An MLP 64 -> hidden (x depth) -> 10, each layer a weight matrix, a bias, and a norm gain."""
    shapes = {}
    fan_in = 64
    for i in range(depth):
        shapes[f"layer{i}.weight"] = (fan_in, hidden)
        shapes[f"layer{i}.bias"] = (hidden,)
        shapes[f"layer{i}.gain"] = (hidden,)
        fan_in = hidden
    shapes["head.weight"] = (fan_in, 10)
    shapes["head.bias"] = (10,)
    return shapes


def init_params(shapes, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in shapes.items():
        if name.endswith("weight"):
            params[name] = flatopt.flat_view((rng.standard_normal(shape) * math.sqrt(2.0 / shape[0])).astype(np.float32))
        elif name.endswith("gain"):
            params[name] = np.ones(math.prod(shape), np.float32)
        else:
            params[name] = np.zeros(math.prod(shape), np.float32)
    return params


def forward_backward(xp, params, shapes, x, y):
    """Cross-entropy loss and flat gradients of an MLP with ReLU, a per-unit gain, and a softmax head."""
    depth = sum(1 for n in shapes if n.endswith(".gain"))
    acts, pre = [x], []
    h = x
    for i in range(depth):
        w = params[f"layer{i}.weight"].reshape(shapes[f"layer{i}.weight"])
        z = h @ w + params[f"layer{i}.bias"]
        pre.append(z)
        h = xp.maximum(z, 0) * params[f"layer{i}.gain"]
        acts.append(h)
    logits = h @ params["head.weight"].reshape(shapes["head.weight"]) + params["head.bias"]
    logits = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = -xp.log(p[xp.arange(n), y] + 1e-12).mean()
    d = p
    d[xp.arange(n), y] -= 1
    d /= n
    grads = {"head.weight": (h.T @ d).ravel(), "head.bias": d.sum(axis=0)}
    dh = d @ params["head.weight"].reshape(shapes["head.weight"]).T
    for i in reversed(range(depth)):
        relu = xp.maximum(pre[i], 0)
        grads[f"layer{i}.gain"] = (dh * relu).sum(axis=0)
        dz = dh * params[f"layer{i}.gain"] * (pre[i] > 0)
        grads[f"layer{i}.weight"] = (acts[i].T @ dz).ravel()
        grads[f"layer{i}.bias"] = dz.sum(axis=0)
        if i:
            dh = dz @ params[f"layer{i}.weight"].reshape(shapes[f"layer{i}.weight"]).T
    return loss, {k: xp.ascontiguousarray(v.astype(xp.float32)) for k, v in grads.items()}


def accuracy(xp, params, shapes, x, y) -> float:
    depth = sum(1 for n in shapes if n.endswith(".gain"))
    h = x
    for i in range(depth):
        z = h @ params[f"layer{i}.weight"].reshape(shapes[f"layer{i}.weight"]) + params[f"layer{i}.bias"]
        h = xp.maximum(z, 0) * params[f"layer{i}.gain"]
    logits = h @ params["head.weight"].reshape(shapes["head.weight"]) + params["head.bias"]
    return float((logits.argmax(axis=1) == y).mean())


# ----------------------------------------------------------------------------------------- the optimizers
def optimizer_factories(shapes) -> dict:
    """name -> factory(); each optimizer flatopt has, with settings that suit this small problem."""
    hidden_matrices = [n for n, s in shapes.items() if n.startswith("layer") and len(s) == 2]
    return {
        "sgd": lambda: flatopt.SGD(lr=0.1, momentum=0.9, nesterov=True),
        "adamw": lambda: flatopt.AdamW(lr=3e-3, weight_decay=1e-4),
        "adafactor": lambda: flatopt.Adafactor(),  # the paper's relative step: no lr to tune
        # 8-bit states; blocks of 128 so that this small model's states are quantized at all
        "adafactor8bit": lambda: flatopt.Adafactor8Bit(block_size=128),
        "adam": lambda: flatopt.Adam(lr=3e-3),
        "nadamw": lambda: flatopt.NAdamW(lr=3e-3, weight_decay=1e-4),
        "radam": lambda: flatopt.RAdam(lr=1e-2),  # its rectification scales the early steps down (r_t ~ 0.2 at t = 100)
        "qhadamw": lambda: flatopt.QHAdamW(lr=3e-3, weight_decay=1e-4),
        "adopt": lambda: flatopt.Adopt(lr=3e-3, weight_decay=1e-4, decoupled=True),
        # AdEMAMix: a slow momentum (β3 0.999 for this run of 660 steps) mixed in, α and β3 warmed up over about the run
        "ademamix": lambda: flatopt.AdEMAMix(lr=1e-3, betas=(0.9, 0.999, 0.999), alpha=5.0, t_alpha_beta3=700,
                                             weight_decay=1e-4),
        "lion": lambda: flatopt.Lion(lr=1e-3, weight_decay=1e-3),  # Lion: below AdamW's lr (sign steps)
        "lamb": lambda: flatopt.Lamb(lr=1e-2, weight_decay=1e-4),
        "mars": lambda: flatopt.Mars(lr=3e-3),
        # Sophia: its Hessian estimate is fed every HESSIAN_EVERY steps by the loop below (update_hessian)
        "sophia": lambda: flatopt.Sophia(lr=1e-3, weight_decay=1e-4),
        "soap": lambda: flatopt.Soap(lr=3e-3, weight_decay=1e-4),
        # Stiefel keeps the hidden weight matrices orthonormal (the per-unit gains carry their scale); AdamW the rest
        "stiefel": lambda: Router([
            Group("stiefel", flatopt.Stiefel(lr=0.05, momentum=0.9), Select(patterns=hidden_matrices)),
            Group("adamw", flatopt.AdamW(lr=3e-3, weight_decay=1e-4), Select(patterns=["*"])),
        ]),
        "kron_psgd": lambda: flatopt.KronPsgd(lr=3e-3),
        "muon_adamw": lambda: flatopt.MuonAdamW(shapes, muon_names=hidden_matrices, lr=0.01, adamw_lr_ratio=0.3,
                                                muon={"layout": "in_out"}),
        # Schedule-Free: measured at its evaluation point x (eval_point below), trained at y
        "schedulefree_adamw": lambda: flatopt.ScheduleFreeAdamW(lr=3e-3, weight_decay=1e-4),
    }


# ------------------------------------------------------------------------------------------------ training
@contextlib.contextmanager
def eval_point(opt, params):
    """Inside: the parameters at the point a Schedule-Free optimizer evaluates at (``opt.eval(params)`` writes x,
    ``opt.train(params)`` after writes the training point y back); other optimizers' parameters as they are."""
    if not hasattr(opt, "eval") or not opt.state_names():
        yield
        return
    opt.eval(params)
    try:
        yield
    finally:
        opt.train(params)


HESSIAN_EVERY = 10  # Sophia's Hessian refresh period k (its paper: 10)


def train(name, factory, shapes, data, *, epochs, batch, seed, xp, log_every, order_seed=None, evaluate=False):
    """Train from ``init_params(shapes, seed)`` on mini-batches drawn with ``order_seed`` (default ``seed + 1``).
    With ``evaluate``, the loss on the whole training set and on the held-out set is recorded after every epoch
    (``train_losses``, ``test_losses``)."""
    (xtr, ytr), (xte, yte) = data
    params = {k: xp.asarray(v) for k, v in init_params(shapes, seed).items()}
    opt = factory()
    rng = np.random.default_rng(seed + 1 if order_seed is None else order_seed)
    curve, step_ms, train_losses, test_losses = [], [], [], []
    n = len(xtr)
    for epoch in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n - batch + 1, batch):
            idx = order[start : start + batch]
            loss, grads = forward_backward(xp, params, shapes, xtr[idx], ytr[idx])
            items = [OptItem(k, shapes[k], params[k], grads[k]) for k in shapes]
            t0 = time.perf_counter()
            opt.step_batch(items)
            if hasattr(opt, "update_hessian") and len(curve) % HESSIAN_EVERY == 0:
                # Sophia's diagonal Hessian estimate: the batch-size-scaled squared mini-batch gradient (an
                # empirical-Fisher stand-in for its Gauss-Newton-Bartlett estimator, which samples the labels)
                for k in shapes:
                    opt.update_hessian(k, shapes[k], grads[k] * grads[k] * batch)
            opt.end_iteration()
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            curve.append(float(loss))
        if evaluate:
            with eval_point(opt, params):
                train_losses.append(float(forward_backward(xp, params, shapes, xtr, ytr)[0]))
                test_losses.append(float(forward_backward(xp, params, shapes, xte, yte)[0]))
        if log_every and (epoch + 1) % log_every == 0:
            print(f"  {name:12s} epoch {epoch + 1:3d}/{epochs}  loss {np.mean(curve[-(n // batch):]):.4f}",
                  flush=True)
    state = opt.state_dict()
    state_bytes = sum(int(b.nbytes) for b in state.buffers.values())
    n_params = sum(math.prod(s) for s in shapes.values())
    final = float(np.mean(curve[-max(1, n // batch):]))
    with eval_point(opt, params):
        test_acc = accuracy(xp, params, shapes, xte, yte)
    return {
        "name": name,
        "curve": curve,
        "final_loss": final,
        "test_acc": test_acc,
        "ms_per_step": float(np.median(step_ms)),
        "state_bytes_per_param": state_bytes / n_params,
        "state": state,
        "train_losses": train_losses,
        "test_losses": test_losses,
    }


def table(results) -> str:
    lines = ["| optimizer | final train loss | test accuracy | ms/step (median) | state bytes/param |",
             "|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['final_loss']:.4f} | {100 * r['test_acc']:.1f}% | "
                     f"{r['ms_per_step']:.3f} | {r['state_bytes_per_param']:.3f} |")
    return "\n".join(lines)


# the PNG's panels: one per family, so that no two curves of a panel share a colour
FAMILIES = [
    ("SGD and the Adam family", ["sgd", "adam", "adamw", "nadamw", "radam", "qhadamw", "adopt",
                                 "ademamix"]),
    ("sign, trust ratio, variance reduction, curvature", ["lion", "lamb", "mars", "sophia"]),
    ("factored second moments (low memory)", ["adafactor", "adafactor8bit"]),
    ("matrix preconditioners and manifolds", ["soap", "kron_psgd", "muon_adamw", "stiefel"]),
]
STYLES = [("tab:blue", "-"), ("tab:orange", "--"), ("tab:green", "-."), ("tab:red", ":"), ("tab:purple", "-"),
          ("tab:brown", "--"), ("tab:pink", "-."), ("tab:gray", ":")]


def _smooth(curve):
    c = np.asarray(curve)
    k = max(1, len(c) // 100)
    return np.arange(len(c) - k + 1) + k - 1, np.convolve(c, np.ones(k) / k, mode="valid")


def plot(results, path: Path) -> bool:
    """The loss curves as small multiples: one panel per family (``FAMILIES``; optimizers of none in a last one),
    each optimizer in its own colour and line style over the others in light grey, legends clear of the curves."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_name = {r["name"]: r for r in results}
    known = {n for _, names in FAMILIES for n in names}
    panels = [(title, [n for n in names if n in by_name]) for title, names in FAMILIES]
    panels.append(("other", [n for n in by_name if n not in known]))
    panels = [(title, names) for title, names in panels if names]
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.9 * rows), sharex=True, sharey=True, squeeze=False)
    curves = {n: _smooth(r["curve"]) for n, r in by_name.items()}
    lo = min(float(y.min()) for _, y in curves.values())
    hi = max(float(y.max()) for _, y in curves.values())
    for ax, (title, names) in zip(axes.flat, panels):
        for n, (x, y) in curves.items():
            if n not in names:
                ax.plot(x, y, color="0.85", lw=0.8, zorder=1)
        for (colour, style), n in zip(STYLES, names):
            x, y = curves[n]
            ax.plot(x, y, color=colour, ls=style, lw=1.6, label=n, zorder=2)
        ax.set_yscale("log")
        ax.set_ylim(max(lo, 1e-12) / 2, hi * 30)  # headroom above the starts: the legend sits there
        ax.set_title(title, fontsize=10)
        ax.legend(loc="upper right", ncol=3, fontsize=8, frameon=False)
        ax.grid(True, which="major", color="0.92", lw=0.6)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("train loss (moving average)")
    fig.suptitle("flatopt optimizers on scikit-learn digits (MLP, hand-written NumPy backprop); grey: the others",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> list[dict]:
    names_all = list(optimizer_factories(param_shapes(1, 1)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--optimizers", type=name_list(names_all), default="all",
                    help=f"comma-separated subset of {','.join(names_all)}, or 'all'")
    ap.add_argument("--epochs", type=positive_int, default=30, help="passes over the training images")
    ap.add_argument("--hidden", type=positive_int, default=128, help="units per hidden layer")
    ap.add_argument("--depth", type=positive_int, default=2, help="hidden layers")
    ap.add_argument("--batch", type=positive_int, default=64, help="mini-batch size (at most the 1438 training "
                    "images)")
    ap.add_argument("--seed", type=int, default=0, help="initialisation, data split and mini-batch order")
    ap.add_argument("--device", choices=["numpy", "cupy"], default="numpy", help="array backend (cupy: a CUDA GPU)")
    ap.add_argument("--png", default="digits_loss.png", help="where to write the loss curves ('' to skip)")
    ap.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")
    args = ap.parse_args(argv)
    if args.batch > 1438:
        ap.error(f"--batch {args.batch}: larger than the 1438 training images")
    check_output(ap, args.png, "--png")

    if args.device == "cupy":
        from flatopt.core import backend

        if not backend.gpu_available():
            ap.error("--device cupy: no CUDA device answers")
        xp = backend.cupy()
    else:
        xp = np
    shapes = param_shapes(args.hidden, args.depth)
    factories = optimizer_factories(shapes)
    names = args.optimizers
    (xtr, ytr), (xte, yte) = load_data(args.seed)
    data = ((xp.asarray(xtr), xp.asarray(ytr)), (xp.asarray(xte), xp.asarray(yte)))
    n_params = sum(math.prod(s) for s in shapes.values())
    print(f"digits: {len(xtr)} train / {len(xte)} test images, MLP with {n_params} parameters, "
          f"{args.epochs} epochs of batch {args.batch}, on {args.device}", flush=True)
    results = []
    t0 = time.perf_counter()
    with blas_single_thread():
        for name in names:
            r = train(name, factories[name], shapes, data, epochs=args.epochs, batch=args.batch, seed=args.seed,
                      xp=xp, log_every=0 if args.quiet else max(1, args.epochs // 3))
            results.append(r)
    print()
    print(table(results))
    print(f"\ntrained in {time.perf_counter() - t0:.1f} s")
    if args.png:
        print(f"loss curves: {args.png}" if plot(results, Path(args.png)) else "(matplotlib not installed: no plot)")
    return results


if __name__ == "__main__":
    main()

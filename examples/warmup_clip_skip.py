"""A learning-rate schedule with warm-up through ``set_lr`` (``flatopt.schedules``), global gradient-norm clipping,
and skipping non-finite steps consistently — the loop most training code needs, in a few lines.

Every 25th step the gradients are poisoned with a NaN (as a loss spike or an fp16 overflow would); the loop
detects it with ``flatopt.gradients.all_finite`` and skips the whole step: no parameter, moment or step count
changes.  Otherwise the gradients are clipped to a global norm of 1 and the optimizer steps.

    python examples/warmup_clip_skip.py --steps 300
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flatopt  # noqa: E402
import train_digits as td  # noqa: E402
from _cli import Formatter, blas_single_thread, positive_int  # noqa: E402
from flatopt import gradients, schedules  # noqa: E402


def run(steps=300, peak_lr=3e-3, warmup=30, max_norm=1.0, poison_every=25, hidden=64, verbose=True):
    shapes = td.param_shapes(hidden)
    (x, y), (xt, yt) = td.load_data()
    params = td.init_params(shapes)
    opt = flatopt.AdamW(lr=peak_lr, weight_decay=1e-4)
    # linear warm-up to peak_lr (peak_lr·(step+1)/warmup), then cosine decay to 10% of it at the last step
    # (a run no longer than the warm-up only warms up)
    lr_at = (schedules.cosine(peak_lr, total_steps=steps, warmup_steps=warmup, floor=0.1 * peak_lr) if steps > warmup
             else schedules.linear_warmup(peak_lr, max(warmup, 1)))
    rng = np.random.default_rng(0)
    skipped, losses = 0, []
    for step in range(steps):
        idx = rng.integers(0, len(x), 64)
        loss, grads = td.forward_backward(np, params, shapes, x[idx], y[idx])
        if poison_every and step % poison_every == poison_every - 1:
            grads["layer0.weight"][7] = np.nan
        bufs = [grads[k] for k in shapes]
        if not bool(gradients.all_finite(bufs)):  # one host decision per iteration
            skipped += 1
            continue
        norm = gradients.clip_by_global_norm(bufs, max_norm)
        opt.set_lr(lr_at(step))  # the schedule is counted in loop steps, skipped ones too
        opt.step_batch([flatopt.OptItem(k, shapes[k], params[k], grads[k]) for k in shapes])
        opt.end_iteration()
        losses.append(float(loss))
        if verbose and step % 50 == 0:
            print(f"step {step:4d}  lr {opt.lr:.2e}  grad norm {float(norm):7.3f}  loss {float(loss):.4f}")
    acc = td.accuracy(np, params, shapes, xt, yt)
    if verbose:
        print(f"skipped {skipped} poisoned steps; test accuracy {100 * acc:.1f}%")
    return {"skipped": skipped, "losses": losses, "acc": acc, "params": params, "opt": opt}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--steps", type=positive_int, default=300, help="training steps")
    args = ap.parse_args(argv)
    with blas_single_thread():
        return run(args.steps)


if __name__ == "__main__":
    main()

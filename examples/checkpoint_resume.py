"""Checkpoint, crash, resume — bit for bit.

Trains the digits MLP for N steps without interruption, then again with a "crash" after k steps: the optimizer
is written to disk with ``flatopt.save`` (with the parameters, which are the caller's buffers), the process state
is thrown away, a fresh optimizer loads the file and training continues.  The two runs' weights are compared
byte for byte.

    python examples/checkpoint_resume.py --optimizer adamw --steps 40 --crash-at 17
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flatopt  # noqa: E402
import train_digits as td  # noqa: E402
from _cli import Formatter, blas_single_thread, nonnegative_int, positive_int  # noqa: E402


def batches(n_train: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n_train)
        for s in range(0, n_train - batch + 1, batch):
            yield order[s : s + batch]


def train(factory, shapes, data, params, steps, start=0, opt=None, batch=64):
    (x, y), _ = data
    opt = opt or factory()
    it = batches(len(x), batch, seed=3)
    for _ in range(start):  # the data order is a function of the step: skip what was consumed
        next(it)
    for _ in range(start, steps):
        idx = next(it)
        _, grads = td.forward_backward(np, params, shapes, x[idx], y[idx])
        opt.step_batch([flatopt.OptItem(k, shapes[k], params[k], grads[k]) for k in shapes])
        opt.end_iteration()
    return opt


def run(name="adamw", steps=40, crash_at=17, hidden=64, verbose=True) -> bool:
    shapes = td.param_shapes(hidden)
    factory = td.optimizer_factories(shapes)[name]
    data = td.load_data()
    straight = td.init_params(shapes)
    train(factory, shapes, data, straight, steps)

    resumed = td.init_params(shapes)
    opt = train(factory, shapes, data, resumed, crash_at)
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "run.npz"
        flatopt.save(ckpt, opt)
        np.savez(Path(d) / "params.npz", **resumed)
        del opt, resumed  # the crash
        with np.load(Path(d) / "params.npz") as z:
            resumed = {k: z[k].copy() for k in z.files}
        opt = factory()
        assert opt.load_state_dict(flatopt.load(ckpt)), "checkpoint refused"
    train(factory, shapes, data, resumed, steps, start=crash_at, opt=opt)
    same = all(straight[k].tobytes() == resumed[k].tobytes() for k in shapes)
    if verbose:
        print(f"{name}: {steps} steps straight vs crash at {crash_at} + resume: "
              f"{'bit-identical' if same else 'DIFFERENT'}")
    return same


def main(argv=None) -> int:
    names_all = list(td.optimizer_factories(td.param_shapes(1, 1)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--optimizer", choices=names_all + ["all"], default="all", help="which optimizer to run")
    ap.add_argument("--steps", type=positive_int, default=40, help="optimizer steps in all")
    ap.add_argument("--crash-at", type=nonnegative_int, default=17, help="the step after which to crash (< --steps)")
    a = ap.parse_args(argv)
    if a.crash_at >= a.steps:
        ap.error(f"--crash-at {a.crash_at}: must be less than --steps {a.steps}")
    names = names_all if a.optimizer == "all" else [a.optimizer]
    with blas_single_thread():
        ok = [run(n, a.steps, a.crash_at) for n in names]
    print("every run resumed bit for bit" if all(ok) else "a resumed run DIFFERS: exit code 1")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())

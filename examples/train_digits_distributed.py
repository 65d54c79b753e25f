"""Data-parallel training of the digits MLP (examples/train_digits.py) with optimizer state sharded across ranks.

Each rank computes the gradients of its slice of every mini-batch, ``allreduce_mean`` averages them, and
``Sharded`` steps: each rank holds and updates only the optimizer state of the parameters (or, for AdamW, the
ranges of large buffers) it owns, then the new values are broadcast.  With ``--check`` (default on) every rank
also steps an unsharded replica with the same averaged gradients and compares the parameters bit for bit at the
end, and exits with 1 when they differ.  Prints the optimizer-state bytes each rank holds, next to the
single-process figure.

    mpiexec -n 2 python examples/train_digits_distributed.py
    mpiexec -n 2 python examples/train_digits_distributed.py --optimizers adamw,muon_adamw,kron_psgd --epochs 10
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpi4py import MPI  # noqa: E402

import flatopt  # noqa: E402
from flatopt import OptItem  # noqa: E402
from flatopt.distributed import Sharded, allreduce_mean  # noqa: E402
from _cli import Formatter, blas_single_thread, name_list, positive_int  # noqa: E402
from train_digits import accuracy, forward_backward, init_params, load_data, param_shapes  # noqa: E402


def factories(shapes) -> dict:
    muon = sorted(n for n, s in shapes.items() if len(s) == 2 and not n.startswith("head"))
    return {
        "sgd": lambda: flatopt.SGD(lr=0.1, momentum=0.9, nesterov=True),
        "adamw": lambda: flatopt.AdamW(lr=3e-3, weight_decay=1e-4),
        "adafactor": lambda: flatopt.Adafactor(lr=1e-2),
        "muon_adamw": lambda: flatopt.MuonAdamW(params=shapes, muon_names=muon, lr=0.02, adamw_lr_ratio=0.15),
        "kron_psgd": lambda: flatopt.KronPsgd(lr=3e-3),
    }


def costs(shapes) -> dict:
    """Plan loads closer to the state bytes than the default (element counts), where the two differ much."""
    muon = set(n for n, s in shapes.items() if len(s) == 2 and not n.startswith("head"))
    return {
        "muon_adamw": lambda n, s: math.prod(s) * (1 if n in muon else 2),  # Muon: 1 buffer, AdamW: 2
        "adafactor": lambda n, s: sum(s) if len(s) == 2 else math.prod(s),  # factored: a row and a column
    }


def train(name, factory, shapes, data, args, comm):
    (xtr, ytr), (xte, yte) = data
    rank, world = comm.Get_rank(), comm.Get_size()
    params = init_params(shapes, args.seed)
    replica = {k: v.copy() for k, v in params.items()} if args.check else None
    opt = Sharded(factory, comm, split_min=args.split_min, cost=costs(shapes).get(name))
    single = factory() if args.check else None
    order_rng = np.random.default_rng(args.seed + 1)
    losses, ms = [], []
    for _ in range(args.epochs):
        order = order_rng.permutation(len(xtr))
        for start in range(0, len(xtr) - args.batch + 1, args.batch):
            idx = order[start : start + args.batch][rank::world]  # this rank's slice of the global batch
            loss, grads = forward_backward(np, params, shapes, xtr[idx], ytr[idx])
            t0 = time.perf_counter()
            allreduce_mean([grads[k] for k in shapes], comm)
            opt.step_batch([OptItem(k, shapes[k], params[k], grads[k]) for k in shapes])
            opt.end_iteration()
            ms.append((time.perf_counter() - t0) * 1e3)
            if single is not None:
                single.step_batch([OptItem(k, shapes[k], replica[k], grads[k]) for k in shapes])
                single.end_iteration()
            losses.append(comm.allreduce(float(loss)) / world)
    per_rank = comm.allgather(opt.state_nbytes())
    same = None
    if single is not None:
        mine = all(params[k].tobytes() == replica[k].tobytes() for k in shapes)
        same = all(comm.allgather(mine))
    return {"name": name, "loss": float(np.mean(losses[-10:])), "acc": accuracy(np, params, shapes, xte, yte),
            "ms": float(np.median(ms)), "per_rank": per_rank,
            "single": opt_state_bytes(single) if single is not None else sum(per_rank), "same": same}


def opt_state_bytes(opt) -> int:
    return sum(int(b.nbytes) for b in opt.state_dict().buffers.values())


def main(argv=None) -> int:
    names_all = list(factories(param_shapes(1, 1)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--optimizers", type=name_list(names_all), default="adamw,muon_adamw",
                    help=f"comma-separated subset of {','.join(names_all)}, or 'all'")
    ap.add_argument("--epochs", type=positive_int, default=5, help="passes over the training images")
    ap.add_argument("--hidden", type=positive_int, default=128, help="units per hidden layer")
    ap.add_argument("--batch", type=positive_int, default=64, help="global mini-batch (split over the ranks)")
    ap.add_argument("--seed", type=int, default=0, help="initialisation, data split and mini-batch order")
    ap.add_argument("--split-min", type=positive_int, default=4096,
                    help="AdamW/SGD buffers this large are split in ranges")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the unsharded replica")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    if not comm.Get_size() <= args.batch <= 1438:
        ap.error(f"--batch {args.batch}: needs at least one image per rank ({comm.Get_size()}) and at most the 1438 "
                 "training images")
    shapes = param_shapes(args.hidden)
    data = load_data(args.seed)
    table = factories(shapes)
    with blas_single_thread():
        rows = [train(n, table[n], shapes, data, args, comm) for n in args.optimizers]
    differs = [r["name"] for r in rows if r["same"] is False]
    if comm.Get_rank() == 0:
        n_params = sum(int(np.prod(s)) for s in shapes.values())
        print(f"digits MLP, {n_params} parameters, {comm.Get_size()} ranks, {args.epochs} epochs")
        print("| optimizer | loss | test acc | ms/step | state bytes per rank | single-process | bit-identical |")
        print("|---|---:|---:|---:|---|---:|---|")
        for r in rows:
            same = {None: "not checked", True: "yes", False: "NO"}[r["same"]]
            print(f"| {r['name']} | {r['loss']:.4f} | {100 * r['acc']:.1f}% | {r['ms']:.3f} | "
                  f"{' / '.join(map(str, r['per_rank']))} | {r['single']} | {same} |")
        verdict = ("not checked (--no-check)" if not args.check else
                   f"NO ({', '.join(differs)}): exit code 1" if differs else "yes")
        print("state bytes per rank measured with Sharded.state_nbytes(); bit-identical: " + verdict,
              flush=True)
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())

"""Does 8-bit Adafactor reach the float32 Adafactor loss?  On the scikit-learn digits MLP of ``train_digits.py``.

For each seed every run starts from the same initialisation and sees the same mini-batches; the runs differ only in
how ``Adafactor8Bit`` stores its state.  Compared is the loss on the **whole training set** and on the **held-out
20 %**, evaluated after every epoch and averaged over the last ``--last`` epochs, as the relative difference to
the float32 run of the same seed; reported as the median and the range over ``--seeds`` seeds.  The yardstick is
float32 against itself: the same float32 run with the mini-batches reshuffled (another batch-order seed).  Its
difference to float32 is run-to-run noise, so a gap smaller than that noise is no measurable gap.

Runs (lr 3e-3, beta1 0.9, beta2 0.999, no relative step):

* ``fp32``, ``fp32 reshuffled`` (the noise control);
* ``8-bit``: the defaults (``block_size=2048``, ``min_8bit_size=4096``).  On this model that stores **only the
  first moment m of the two hidden weight matrices** in 8 bits (uf8, blocks of 256); their factored second moments
  (row and column vectors of 64–128 values) stay float32, because a quantized vector would occupy a whole block of
  2048 codes and be larger (the printout lists the stored slots);
* ``8-bit d8 momentum``: the same with the first moment in Dettmers' signed dynamic code instead of uf8;
* ``8-bit AL8 factors``: ``block_size=128``, so the row/column second moments are AL8-quantized too (the original
  adafactor8bit 0.4.6 does this at its default block size: it pads short vectors to a block).

Measured (``--seeds 12``: seeds 0–11, 20 epochs, hidden 128; difference to float32, median [min, max]):

| run | train loss | train loss half-way (epoch 10) | held-out loss |
|---|---:|---:|---:|
| fp32 reshuffled (the noise) | +0.2 % [−6.6, +13.7] | +0.6 % [−8.5, +9.0] | −2.7 % [−8.0, +4.9] |
| 8-bit (uf8 m) | +1.9 % [−3.3, +11.9] | +4.2 % [+1.1, +11.5] | +0.3 % [−4.1, +8.5] |
| 8-bit d8 momentum | −0.3 % [−3.3, +2.9] | +0.1 % [−1.1, +1.0] | −0.2 % [−2.2, +1.9] |
| 8-bit AL8 factors | −26.4 % [−40.7, +3.6] | −6.3 % [−12.4, −2.3] | +3.1 % [−5.8, +8.6] |

**With the default layout 8-bit Adafactor ends within float32's own run-to-run noise**: fp32 against itself differs
by a median |Δ| of 3.0 % (train) / 2.9 % (held-out), the 8-bit gap is +1.9 % / +0.3 % (median test accuracy 97.5 %
against 97.2 %).  The final train-loss gap is noisy: seeds 0–5 alone (the default run) give a median of +6.2 %,
still inside the fp32 range.  **The uf8 first moment has a small real cost**, seen half-way while the paired runs
are still close: +4.2 % train loss, on 12 of 12 seeds (at hidden 64: +10.7 % after 6 of 12 epochs on 16 of 16
seeds, +2.9 % at the end).  Cause: uf8 is a linear code with steps of absmax/128 per block of 256; 12–17 % of the
non-zero momentum entries are rounded to zero at every requantization, and the factored normalisation rsqrt(V̂)
amplifies exactly those small entries (rarely active pixels and units): weighted by rsqrt(V̂) the stored momentum
is 3–21 % off (d8: 1.5–2.5 %, though its plain relative error is no smaller).  The momentum of those entries
restarts from zero every step, so they learn more slowly; d8 keeps small values and tracks float32 to about 1 %.

**Quantizing the factored second moment (AL8) is not within a few percent**: with beta2 = 0.999 the EMA moves a
value by 0.1 % of its distance to the new sample per step, far less than half an AL8 code step (12 % here: a block
spans ~85 octaves, because rows and columns that never get a gradient sit near eps1 = 1e-30), so round-to-nearest
requantization freezes the stored second moment (after step 100 under 0.3 % of its codes change per step; at the
end stored/exact-EMA ratios range 0.2–8.6).  The steps come out larger: training loss 26 % lower, held-out loss 3 %
higher.  Both effects belong to the original algorithm, adafactor8bit 0.4.6 (CPU path): fed the same gradients its
weights match flatopt's to 1e-7 for 50 steps (then a uf8 rounding tie flips a code), trained on its own (seeds 0–2,
uf8 and AL8 layouts) its losses are 1.5 % (train) / 3.4 % (held-out) from flatopt's at most, and at its default
block size it quantizes these factors too (flatopt keeps them float32 where a block would be larger).

The last table runs the AdamW-style 8-bit preset and the hybrid routing adafactor8bit's README recommends (APOLLO
on matrices, float32 for biases and gains, Fira) on one seed.

    python examples/adafactor8bit_digits.py              # 6 seeds: about half a minute (benchmarks/README.md)
    python examples/adafactor8bit_digits.py --seeds 12 --epochs 40
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flatopt  # noqa: E402
from flatopt.adafactor8bit import hybrid_groups  # noqa: E402
from _cli import Formatter, blas_single_thread, name_list, nonnegative_int, positive_int  # noqa: E402
from train_digits import load_data, param_shapes, table, train  # noqa: E402

COMMON = dict(lr=3e-3, relative_step=False, beta1=0.9, beta2=0.999)
FP32, NOISE = "fp32", "fp32 reshuffled"
RESHUFFLE = 1000  # the noise control draws its mini-batches with batch-order seed + RESHUFFLE


def variants(min_8bit_size: int) -> dict:
    """name -> (factory, batch-order offset): the Adafactor runs compared per seed."""
    q = dict(COMMON, min_8bit_size=min_8bit_size)
    a8 = flatopt.Adafactor8Bit
    return {
        FP32: (lambda: a8(quantize=False, **q), 0),
        NOISE: (lambda: a8(quantize=False, **q), RESHUFFLE),
        "8-bit": (lambda: a8(quantize=True, **q), 0),
        "8-bit d8 momentum": (lambda: a8(quantize=True, m_quant_type="d8", **q), 0),
        "8-bit AL8 factors": (lambda: a8(quantize=True, block_size=128, **q), 0),
    }


def other_presets(min_8bit_size: int) -> dict:
    adam = dict(lr=3e-3, factored=False, beta1=0.9, beta2=0.999, relative_step=False, scale_parameter=False,
                scale_weight_decay=False, d=0.0, eps=(1e-8, 1e-3), min_8bit_size=min_8bit_size)
    q = dict(COMMON, min_8bit_size=min_8bit_size)
    return {
        "adamw-style fp32": lambda: flatopt.Adafactor8Bit(**dict(adam, quantize=False)),
        "adamw-style 8-bit": lambda: flatopt.Adafactor8Bit(**dict(adam, quantize=True)),
        "hybrid (APOLLO r=16, Fira)": lambda: flatopt.Adafactor8Bit(
            **q, weight_decay=1e-4, enable_fira_for_adafactor=True, groups=hybrid_groups(16, 1e-4)),
    }


def stored_8bit(state) -> dict[str, list[str]]:
    """parameter -> the state slots stored quantized (from ``state_dict``: codes are kept under ``<slot>_q``)."""
    out: dict[str, list[str]] = {}
    for key in state.buffers:
        slot, name = key.split("/", 1)
        if slot.endswith("_q"):
            out.setdefault(name, []).append(slot[:-2])
    return {n: sorted(s) for n, s in sorted(out.items())}


def final(r: dict, last: int, upto: int | None = None) -> tuple[float, float]:
    """(train loss, held-out loss), each the mean of the evaluations after the last ``last`` epochs (of the first
    ``upto`` epochs when given)."""
    end = len(r["train_losses"]) if upto is None else upto
    lo = max(0, end - last)
    return float(np.mean(r["train_losses"][lo:end])), float(np.mean(r["test_losses"][lo:end]))


def compare(seeds, *, epochs: int, hidden: int, batch: int, min_8bit_size: int, last: int,
            names=None) -> dict:
    """Train every variant (or those in ``names``, always with fp32) for each seed.

    Returns {"runs": {variant: [result per seed]}, "gaps": {variant: {"train": [...], "test": [...],
    "train_half": [...]}}}, the gaps in % per seed, 100·(loss / fp32 loss − 1), losses as in ``final`` (train_half:
    the training loss half-way, after ``epochs // 2`` epochs, while the paired runs are still close)."""
    table_ = variants(min_8bit_size)
    names = [FP32] + [n for n in (names or table_) if n != FP32]
    shapes = param_shapes(hidden)
    runs: dict[str, list] = {n: [] for n in names}
    for seed in seeds:
        data = load_data(seed)
        for n in names:
            factory, offset = table_[n]
            runs[n].append(train(n, factory, shapes, data, epochs=epochs, batch=batch, seed=seed, xp=np,
                                 log_every=0, order_seed=seed + 1 + offset, evaluate=True))
    gaps = {}
    for n in names[1:]:
        pairs = [(final(r, last), final(f, last)) for r, f in zip(runs[n], runs[FP32])]
        gaps[n] = {k: [100 * (a[i] / b[i] - 1) for a, b in pairs] for i, k in enumerate(("train", "test"))}
        mid = max(1, epochs // 2)
        half = [(final(r, last, mid)[0], final(f, last, mid)[0]) for r, f in zip(runs[n], runs[FP32])]
        gaps[n]["train_half"] = [100 * (a / b - 1) for a, b in half]
    return {"runs": runs, "gaps": gaps}


def _spread(v) -> str:
    return f"{np.median(v):+5.1f} % [{min(v):+.1f}, {max(v):+.1f}]"


def report(res: dict, *, last: int, per_seed: bool = False) -> str:
    runs, gaps = res["runs"], res["gaps"]
    n_seeds, epochs = len(runs[FP32]), len(runs[FP32][0]["train_losses"])
    lines = [f"loss on the whole training set and on the held-out set, mean after the last {last} epochs; Δ: "
             f"difference to fp32 of the same seed, median [min, max] over {n_seeds} seeds (half-way: after "
             f"{epochs // 2} epochs)",
             "| run | state bytes/param | train loss | Δ train loss | Δ train loss half-way | held-out loss "
             "| Δ held-out loss | test accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, rs in runs.items():
        tr, te = zip(*(final(r, last) for r in rs))
        g = gaps.get(n)
        cells = [_spread(g[k]) if g else "—" for k in ("train", "train_half", "test")]
        lines.append(f"| {n} | {rs[0]['state_bytes_per_param']:.3f} | {np.median(tr):.4f} | {cells[0]} | {cells[1]} "
                     f"| {np.median(te):.4f} | {cells[2]} | {100 * np.median([r['test_acc'] for r in rs]):.1f}% |")
    if per_seed:
        lines.append("")
        for n, g in gaps.items():
            for k in ("train", "train_half", "test"):
                lines.append(f"{n:18s} Δ {k:10s} per seed: " + " ".join(f"{x:+5.1f}" for x in g[k]))
    if NOISE in gaps:
        lines.append("")
        for n in (v for v in gaps if v != NOISE):
            for k, what in (("train", "train loss"), ("test", "held-out loss")):
                lines.append(f"{n} vs fp32, {what}: {verdict(gaps[n][k], gaps[NOISE][k])}")
    return "\n".join(lines)


def verdict(gap, noise) -> str:
    """The median gap against fp32's own run-to-run differences (fp32 vs fp32 with reshuffled mini-batches)."""
    shift, typical, widest = float(np.median(gap)), float(np.median(np.abs(noise))), float(np.max(np.abs(noise)))
    if abs(shift) <= typical:
        where = "within the typical"
    elif abs(shift) <= widest:
        where = "beyond the typical but within the largest"
    else:
        where = "beyond the largest"
    return (f"median {shift:+.1f} %, higher on {sum(g > 0 for g in gap)} of {len(gap)} seeds — {where} run-to-run "
            f"difference of fp32 itself (fp32 vs reshuffled: median |Δ| {typical:.1f} %, largest {widest:.1f} %, "
            f"higher on {sum(g > 0 for g in noise)} of {len(noise)})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--seeds", type=positive_int, default=6, help="seeds 0 .. N-1")
    ap.add_argument("--epochs", type=positive_int, default=20, help="passes over the training images")
    ap.add_argument("--last", type=positive_int, default=5, help="average the losses after this many last epochs")
    ap.add_argument("--hidden", type=positive_int, default=128, help="units per hidden layer")
    ap.add_argument("--batch", type=positive_int, default=64, help="mini-batch size")
    ap.add_argument("--min-8bit-size", type=nonnegative_int, default=4096,
                    help="parameters with at least this many elements are quantized")
    ap.add_argument("--variants", type=name_list(list(variants(0))), default="all",
                    help=f"comma-separated subset of {list(variants(0))} or 'all'")
    ap.add_argument("--per-seed", action="store_true", help="also print every seed's Δ")
    ap.add_argument("--no-presets", action="store_true", help="skip the AdamW-style and hybrid table")
    ap.add_argument("--preset-epochs", type=positive_int, default=None, help="epochs of that table (default: --epochs)")
    args = ap.parse_args(argv)
    if args.last > args.epochs:
        ap.error(f"--last {args.last}: more than --epochs {args.epochs}")
    if args.batch > 1438:
        ap.error(f"--batch {args.batch}: larger than the 1438 training images")
    names = args.variants
    shapes = param_shapes(args.hidden)
    print(f"MLP with {sum(math.prod(s) for s in shapes.values())} parameters, {args.epochs} epochs of batch "
          f"{args.batch}, seeds 0..{args.seeds - 1}", flush=True)
    with blas_single_thread():  # see train_digits.py: the model's tiny GEMMs must not spin BLAS threads
        res = compare(range(args.seeds), epochs=args.epochs, hidden=args.hidden, batch=args.batch,
                      min_8bit_size=args.min_8bit_size, last=args.last, names=names)
    for n, rs in res["runs"].items():
        if n != FP32 and n != NOISE:
            layout = stored_8bit(rs[0]["state"])
            print(f"  {n}: stored 8-bit: " + ("; ".join(f"{p} {s}" for p, s in layout.items()) or "nothing"))
    print(report(res, last=args.last, per_seed=args.per_seed))
    if not args.no_presets:
        data = load_data(0)
        epochs = args.preset_epochs or args.epochs
        with blas_single_thread():
            res["presets"] = [train(n, f, shapes, data, epochs=epochs, batch=args.batch, seed=0, xp=np, log_every=0)
                              for n, f in other_presets(args.min_8bit_size).items()]
        print(f"\nother presets, seed 0, {epochs} epochs (final train loss: mean mini-batch loss of the last epoch)")
        print(table(res["presets"]))
    return res


if __name__ == "__main__":
    main()

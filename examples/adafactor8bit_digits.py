"""8-bit Adafactor versus float32 Adafactor on the scikit-learn digits MLP of ``train_digits.py``.

Same initialisation, same mini-batches; the only difference is whether Adafactor8Bit stores its states quantized
(AL8 second moments, uf8 first moment; weights ≥ ``min_8bit_size`` elements) or in float32.  Also runs the seed
README's hybrid routing (APOLLO on matrices, float32 for biases and gains, Fira) and the AdamW-style 8-bit preset.
Prints the final losses, the relative gap to float32, and the optimizer-state bytes per parameter.

    python examples/adafactor8bit_digits.py            # < 1 minute
    python examples/adafactor8bit_digits.py --hidden 256 --epochs 40
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
from train_digits import load_data, param_shapes, table, train  # noqa: E402

COMMON = dict(lr=3e-3, relative_step=False, beta1=0.9, beta2=0.999)


def factories(min_8bit_size: int) -> dict:
    q = dict(COMMON, min_8bit_size=min_8bit_size)
    adam = dict(lr=3e-3, factored=False, beta1=0.9, beta2=0.999, relative_step=False, scale_parameter=False,
                scale_weight_decay=False, d=0.0, eps=(1e-8, 1e-3), min_8bit_size=min_8bit_size)
    return {
        "adafactor fp32": lambda: flatopt.Adafactor8Bit(quantize=False, **q),
        "adafactor 8-bit": lambda: flatopt.Adafactor8Bit(quantize=True, **q),
        "adamw-style fp32": lambda: flatopt.Adafactor8Bit(**dict(adam, quantize=False)),
        "adamw-style 8-bit": lambda: flatopt.Adafactor8Bit(**dict(adam, quantize=True)),
        "hybrid (APOLLO r=16, Fira)": lambda: flatopt.Adafactor8Bit(
            **q, weight_decay=1e-4, enable_fira_for_adafactor=True, groups=hybrid_groups(16, 1e-4)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-8bit-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shapes = param_shapes(args.hidden)
    data = load_data(args.seed)
    print(f"MLP with {sum(math.prod(s) for s in shapes.values())} parameters; quantized tensors: "
          f"{[n for n, s in shapes.items() if math.prod(s) >= args.min_8bit_size]}")
    results = [train(name, f, shapes, data, epochs=args.epochs, batch=args.batch, seed=args.seed, xp=np,
                     log_every=0) for name, f in factories(args.min_8bit_size).items()]
    print(table(results))
    by = {r["name"]: r["final_loss"] for r in results}
    for q, ref in (("adafactor 8-bit", "adafactor fp32"), ("adamw-style 8-bit", "adamw-style fp32")):
        print(f"{q}: final loss {by[q]:.4f} vs {by[ref]:.4f} in float32 ({100 * (by[q] / by[ref] - 1):+.1f} %)")
    return results


if __name__ == "__main__":
    main()

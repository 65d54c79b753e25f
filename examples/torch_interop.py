"""PyTorch computes the gradients, flatopt updates the parameters in place through zero-copy views.

On the CPU, ``flatopt.flat_view(tensor.detach().numpy())`` is a 1-D NumPy view of the tensor's memory (it raises
for a non-contiguous tensor, where ``reshape(-1)`` would silently copy), so flatopt writes straight into the model's parameters and reads ``.grad`` without a copy.  On a GPU,
``cupy.from_dlpack(tensor.detach())`` gives the same zero-copy view of a CUDA tensor (see ``views`` below).

The script trains a small torch model twice from the same initialisation, once with ``torch.optim.AdamW`` and
once with ``flatopt.AdamW`` on the views, prints how far apart the two sets of weights are after each step, and
ends with "matches torch.optim.AdamW" when every step is within the rounding bound (at most 2·(step)·2⁻²³: one
float32 rounding difference per step, fed back through the gradients); otherwise it says so and exits with 1.

JAX: JAX arrays are immutable, so in-place updates cannot alias them.  Keep the parameters in NumPy (or CuPy)
buffers owned by your loop, hand them to ``jax.numpy.asarray`` (it copies them, on the CPU too; on a GPU DLPack,
``jax.dlpack.from_dlpack``, is the way to try sharing memory) for the forward/backward pass, convert the gradients
back with ``np.asarray`` (or ``cupy.from_dlpack``), and let flatopt update your buffers in place.

    python examples/torch_interop.py --steps 20
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flatopt  # noqa: E402
from _cli import Formatter, positive_int  # noqa: E402

EPS32 = 2.0**-23


def within_rounding(diffs: list[float]) -> bool:
    """Every step's max |Δweight| within one float32 rounding difference per step so far (weights of magnitude
    < 1, fed back through the gradients): ``diff after step i ≤ 2·i·2⁻²³``."""
    return all(d <= 2 * (i + 1) * EPS32 for i, d in enumerate(diffs))


def views(tensor):
    """A flat, zero-copy NumPy (CPU) or CuPy (CUDA, through DLPack) view of a contiguous tensor."""
    t = tensor.detach()
    if not t.is_contiguous():
        raise ValueError("flatopt needs contiguous parameters (call .contiguous() once when building the model)")
    if t.is_cuda:
        from flatopt.core import backend

        return flatopt.flat_view(backend.cupy().from_dlpack(t))
    return flatopt.flat_view(t.numpy())


def make_model(torch, seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )


def run(steps: int = 20, lr: float = 1e-2, weight_decay: float = 1e-2, verbose: bool = True) -> list[float]:
    """Train both copies; return the max |Δweight| between them after each step."""
    import torch

    model_t = make_model(torch, 0)
    model_f = copy.deepcopy(model_t)
    opt_t = torch.optim.AdamW(model_t.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    opt_f = flatopt.AdamW(lr=lr, weight_decay=weight_decay)
    named = list(model_f.named_parameters())
    gen = torch.Generator().manual_seed(1)
    diffs = []
    for step in range(steps):
        x = torch.randn(32, 20, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        for model in (model_t, model_f):
            # set_to_none=False: torch's default zero_grad() sets .grad to None and the next backward allocates new
            # tensors, so views of the gradients cached across steps would silently keep reading the old ones
            # (flatopt would step with stale gradients); here the views are taken afresh after each backward
            model.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt_t.step()
        opt_f.step_batch([flatopt.OptItem(n, tuple(p.shape), views(p), views(p.grad)) for n, p in named])
        opt_f.end_iteration()
        with torch.no_grad():
            diff = max(float((a - b).abs().max()) for a, b in zip(model_t.parameters(), model_f.parameters()))
        diffs.append(diff)
        if verbose:
            print(f"step {step + 1:3d}: max |torch AdamW − flatopt AdamW| = {diff:.3e}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--steps", type=positive_int, default=20, help="training steps")
    args = ap.parse_args(argv)
    diffs = run(args.steps)
    if within_rounding(diffs):
        print(f"matches torch.optim.AdamW: {args.steps} steps, largest difference {max(diffs):.1e} "
              f"(within float32 rounding)")
        return 0
    print(f"DIFFERS from torch.optim.AdamW: largest difference {max(diffs):.1e}, more than float32 rounding explains")
    return 1


if __name__ == "__main__":
    sys.exit(main())

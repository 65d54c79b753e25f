"""A user's training script, as a type checker sees it: ``tests/test_typing.py`` checks this file with
``mypy --strict`` (so the public API's annotations are what users get) and runs ``main()`` (so it is real code).

The ``# type: ignore[...]`` lines are mistakes the annotations must catch: under ``--strict`` an ignore that no error
needs is itself an error (``warn_unused_ignores``), so if a signature became ``Any`` the check would fail.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import flatopt
from flatopt import schedules
from flatopt.routing import Group, Router, Select

if TYPE_CHECKING:
    from typing_extensions import assert_type


def train(opt: flatopt.Optimizer, steps: int) -> float:
    """Any optimizer through the protocol: flat views of the model's arrays, a schedule, clipping, a checkpoint."""
    rng = np.random.default_rng(0)
    flat, views = flatopt.pack({"w": (4, 3), "b": (3,)})
    views["w"][...] = rng.standard_normal((4, 3))
    grad_flat, grads = flatopt.pack_like(views)
    lr = schedules.cosine(1e-2, total_steps=steps, warmup_steps=2)
    for step in range(steps):
        grads["w"][...] = views["w"]  # the gradient of ½‖w‖²
        grads["b"][...] = views["b"]
        norm = flatopt.gradients.clip_by_global_norm([grad_flat], max_norm=1.0)
        if not bool(flatopt.gradients.all_finite([grad_flat])):
            continue
        opt.set_lr(lr(step))
        opt.step_batch([flatopt.OptItem(name, v.shape, flatopt.flat_view(v), flatopt.flat_view(grads[name]))
                        for name, v in views.items()])
        opt.end_iteration()
    state = opt.state_dict()
    if state is not None:
        with tempfile.TemporaryDirectory() as tmp:
            flatopt.save(Path(tmp) / "opt.npz", opt)
            loaded: flatopt.OptimizerState = flatopt.load(Path(tmp) / "opt.npz")
            ok: bool = opt.load_state_dict(loaded)
            assert ok
    return float(norm) + float(np.abs(flat).sum())


def main() -> None:
    adamw = flatopt.AdamW(lr=1e-3, betas=(0.9, 0.95), lr_scale={"b": 0.5})
    sgd = flatopt.SGD(0.1, momentum=0.9, lr_scale=lambda name: 1.0)
    adafactor = flatopt.Adafactor().with_lr(1e-2)
    a8 = flatopt.Adafactor8Bit(lr=1e-2, groups=[("b*", {"quantize": False}), (["w"], {"weight_decay": 0.0})])
    kron = flatopt.KronPsgd(1e-3, clip=None).with_momentum(0.9)
    router = Router([Group("muon", flatopt.Muon(lr=0.02), Select(names=["w"])),
                     Group("rest", flatopt.AdamW(), Select.all(), lr_ratio=0.015)])
    catalogue = [flatopt.Lion(lr=1e-4, betas=(0.9, 0.99)), flatopt.Lamb(), flatopt.RAdam(decoupled_weight_decay=True)]
    optimizers: list[flatopt.Optimizer] = [adamw, sgd, adafactor, a8, kron, router, *catalogue]
    losses = [train(opt, 4) for opt in optimizers]
    assert all(np.isfinite(losses))

    mixed = flatopt.MuonAdamW({"w": (4, 3), "b": ((3,), np.float32)}, ["w"], lr=0.02)
    w, b = np.ones(12, np.float32), np.ones(3, np.float32)
    mixed.try_step_with_lrs(0.02, 3e-4, {"w": w, "b": b}, {"w": w.copy(), "b": None})
    rows: list[list[object]] = mixed.manifest()
    assert rows and isinstance(mixed.muon, flatopt.Muon) and mixed.lr == 0.02

    scale: float = adamw.lr_scale("b")
    base: float | None = adafactor.lr
    names: list[str] = adamw.state_names()
    assert scale == 0.5 and base is not None and names == ["b", "w"]

    if TYPE_CHECKING:  # what the checker infers, without running anything
        assert_type(flatopt.load("x.npz"), flatopt.OptimizerState)
        assert_type(adamw.state_dict(), flatopt.OptimizerState)
        assert_type(adamw.load_state_dict(adamw.state_dict(), strict=True), bool)
        assert_type(flatopt.pack({"w": (2, 2)})[1], dict[str, flatopt.core.types.Array])
        assert_type(schedules.linear_warmup(1e-3, 10)(5), float)
        assert_type(kron.preconditioner_shape((4, 3)), tuple[int, ...])

        # mistakes the annotations catch
        adamw.step("w", (4, 3), w)  # type: ignore[call-arg]
        adamw.set_lr("0.1")  # type: ignore[arg-type]
        flatopt.AdamW(lr=1e-3, betas=0.9)  # type: ignore[arg-type]
        flatopt.SGD(lr=0.1, lr_scale=0.5)  # type: ignore[arg-type]
        flatopt.load(42)  # type: ignore[arg-type]
        flatopt.save("x.npz", {"state": 1})  # type: ignore[arg-type]
        flatopt.Muon(workers="4")  # type: ignore[arg-type]
        Select(names=["w"], predicate=lambda name: True)  # type: ignore[arg-type, misc]
        mixed.load_state_dict("checkpoint.npz")  # type: ignore[arg-type]
        adamw.state_dict().buffers.missing  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()

"""Adafactor8Bit: flatopt (NumPy) vs the original adafactor8bit 0.4.6 (its pure-PyTorch CPU path,
``use_cuda_kernel=False``) and ``torch.optim.AdamW``; optimizer-state bytes per parameter for each configuration.

Workload: one 2048×1024 float32 weight (the reference's memory table) — quick mode: 512×256.  Per configuration the
original is the baseline; ``state_bytes_per_param`` reports each implementation's measured state (the original's
by summing the tensors of its ``optimizer.state``, torch AdamW's likewise: 8 B/param).  Both implementations step
the same gradients; the APOLLO projection is regenerated every step in both (``apollo_cache_proj`` False).
"""

from __future__ import annotations

import math

import numpy as np

import flatopt

from .harness import Case

SUITE = "adafactor8bit"

CONFIGS = {  # the state layouts of adafactor8bit 0.4.6's README (quantize=True unless said)
    "factored AL8": dict(),
    "factored fp32": dict(quantize=False),
    "factored AL8 + uf8 m": dict(beta1=0.9),
    "factored AL8 + uf4 m": dict(beta1=0.9, m_quant_type="uf4"),
    "factored AL8 + d8 m": dict(beta1=0.9, m_quant_type="d8"),
    "CAME AL8/AL8/uf8": dict(beta1=0.9, beta2=0.999, beta3=0.9999, relative_step=False, scale_parameter=False,
                             lr=1e-3),
    "AdamW-style AL8 + uf8": dict(factored=False, beta1=0.9, beta2=0.999, relative_step=False, lr=1e-3,
                                  scale_parameter=False, d=0.0),
    "AdamW-style AL16 + uf8": dict(factored=False, beta1=0.9, beta2=0.999, relative_step=False, lr=1e-3,
                                   scale_parameter=False, d=0.0, v_quant_type="al16"),
    "AdamW-style fp32": dict(factored=False, beta1=0.9, beta2=0.999, relative_step=False, lr=1e-3,
                             scale_parameter=False, d=0.0, quantize=False),
    "APOLLO r=256 AL8 + uf8": dict(apollo_rank=256, beta1=0.9, beta2=0.999, relative_step=False, lr=1e-3,
                                   scale_parameter=False, d=0.0),
    "APOLLO r=256 fp32": dict(apollo_rank=256, beta1=0.9, beta2=0.999, relative_step=False, lr=1e-3,
                              scale_parameter=False, d=0.0, quantize=False),
    "APOLLO-mini r=1 tensor": dict(apollo_rank=1, apollo_scale_type="tensor"),
    "APOLLO r=256 factorize + uf8": dict(apollo_rank=256, beta1=0.9, apollo_factorize=True),
    "APOLLO r=256 factorize + CAME": dict(apollo_rank=256, beta1=0.9, beta2=0.999, beta3=0.9999, relative_step=False,
                                          lr=1e-3, scale_parameter=False, d=0.0, apollo_factorize=True),
}
QUICK = ("factored AL8", "factored AL8 + uf8 m", "AdamW-style AL8 + uf8", "APOLLO r=256 AL8 + uf8")


def _data(shape):
    rng = np.random.default_rng(0)
    n = math.prod(shape)
    return rng.standard_normal(n, dtype=np.float32) * 0.05, rng.standard_normal(n, dtype=np.float32)


def _flatopt_case(shape, options):
    holder = {}

    def setup():
        p, g = _data(shape)
        opt = flatopt.Adafactor8Bit(**options)
        holder["opt"], holder["n"] = opt, p.size

        def step():
            opt.step("w", shape, p, g)

        return step

    return setup, lambda: holder["opt"].state_nbytes() / holder["n"]


def _torch_state_bytes(opt, n):
    import torch

    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total / n


def _original_case(shape, options):
    holder = {}

    def setup():
        import torch
        from adafactor8bit import Adafactor8Bit

        p, g = _data(shape)
        w = torch.nn.Parameter(torch.from_numpy(p.reshape(shape)))
        w.grad = torch.from_numpy(g.reshape(shape))
        opt = Adafactor8Bit([w], use_cuda_kernel=False, **options)
        holder["opt"], holder["n"] = opt, p.size
        return opt.step

    return setup, lambda: _torch_state_bytes(holder["opt"], holder["n"])


def _adamw_case(shape):
    holder = {}

    def setup():
        import torch

        p, g = _data(shape)
        w = torch.nn.Parameter(torch.from_numpy(p.reshape(shape)))
        w.grad = torch.from_numpy(g.reshape(shape))
        opt = torch.optim.AdamW([w], lr=1e-3)
        holder["opt"], holder["n"] = opt, p.size
        return opt.step

    return setup, lambda: _torch_state_bytes(holder["opt"], holder["n"])


def cases(quick: bool) -> list[Case]:
    shape = (512, 256) if quick else (2048, 1024)
    workload_shape = f"{shape[0]}x{shape[1]} fp32"
    try:
        import adafactor8bit  # noqa: F401

        have_original = True
    except ImportError:
        have_original = False
    out = []
    for name, options in CONFIGS.items():
        if quick and name not in QUICK:
            continue
        wl = f"{name}, {workload_shape}"
        if have_original:
            setup, bpp = _original_case(shape, options)
            out.append(Case(SUITE, wl, "adafactor8bit 0.4.6 (CPU)", setup, baseline=True, state_bytes_per_param=bpp))
        setup, bpp = _flatopt_case(shape, options)
        out.append(Case(SUITE, wl, "flatopt (NumPy)", setup, baseline=not have_original, state_bytes_per_param=bpp,
                        note="state kept as stored: codes + per-block scale/min_log"))
    try:
        import torch  # noqa: F401

        setup, bpp = _adamw_case(shape)
        out.append(Case(SUITE, f"torch AdamW, {workload_shape}", "torch.optim.AdamW", setup, baseline=True,
                        state_bytes_per_param=bpp))
    except ImportError:
        pass
    return out

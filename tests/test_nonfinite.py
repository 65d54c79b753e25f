"""The non-finite gradient policy of every optimizer, as documented in docs/contract.md ("Non-finite gradients"),
checked.

flatopt never repairs gradients silently on its own (the reference implementations don't either, except where
noted): a NaN or Inf in ``grad`` reaches the parameter as each algorithm's arithmetic carries it.  The supported
workflow is ``flatopt.gradients.all_finite`` + skipping the step (examples/warmup_clip_skip.py), which changes
nothing at all.

* ``element``: elementwise algorithms (SGD, AdamW, MuonAdamW's AdamW group): only the poisoned elements (and
  their moments) become non-finite;
* ``tensor``: algorithms with per-tensor statistics (Adafactor's factors and RMS, Muon's norm, KronPsgd's RMS clip,
  Soap's eigenbasis projections):
  a NaN makes the whole parameter non-finite, an infinity at least its own element (KronPsgd keeps its
  preconditioner Q finite);
* ``sign``: Lion and Sophia step by sign(m)·(a ratio clipped at 1): a NaN poisons its element, an infinity gives a
  finite step of ±η (the momentum keeps the infinity);
* ``clip``: Adopt clips the normalised gradient at ±t^¼: a NaN poisons its element, an infinity gives a finite
  step (the second moment keeps the infinity);
* ``matrix``: Stiefel (tangent projection and QR per matrix): as ``tensor`` for each matrix of a batch — a NaN makes
  its own matrix non-finite, the other matrices of the batch are independent and stay finite; a 1×1 matrix
  stays finite (St(1, 1) = {±1}: the QR of a 1×1 is ±1 whatever it is given, as LAPACK's);
* ``finite``: Adafactor8Bit reads non-finite entries as 0 on the APOLLO path, and its Fira limiter zeroes an
  update whose norm is non-finite (both as the original package): the parameter stays finite.
"""

from __future__ import annotations

import numpy as np
import pytest

from .helpers import make_params, rng_arrays
from .registry import FLAG_SPACE, REGISTRY, flag_cases, policy_of

POLICY = {
    "adafactor": "tensor", "adafactor_manual_beta1_wd": "tensor", "adafactor_beta2_unfactored_scaled": "tensor",
    "adafactor8bit": "tensor",
    "adafactor8bit_adam_d8_fira": "finite",
    "adafactor8bit_apollo_came": lambda shape: "finite" if len(shape) >= 2 else "tensor",
    "kron_psgd": "tensor", "kron_psgd_knobs": "tensor",
    "muon": "tensor",
    "muon_adamw": lambda shape: "tensor" if len(shape) == 2 else "element",
    "soap": lambda shape: "tensor" if len(shape) > 1 else "element",  # vectors: Adam
    "soap_1d_capped": lambda shape: "tensor" if max(shape) <= 8 else "element",
    "stiefel": lambda shape: "finite" if shape[-2:] == (1, 1) else "matrix",
    "stiefel_momentum": lambda shape: "finite" if shape[-2:] == (1, 1) else "matrix",
}
# the elementwise algorithms' entries: their flag space's policy (tests/registry.py)
_ELEMENTWISE = tuple(space.cls for space in FLAG_SPACE.values())
POLICY.update({name: policy_of(spec.make()) for name, spec in REGISTRY.items()
               if type(spec.make()) in _ELEMENTWISE})
CASES = flag_cases()


def test_every_optimizer_has_a_documented_policy():
    assert sorted(POLICY) == sorted(REGISTRY)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_nonfinite_gradient_policy(name, bad):
    spec = REGISTRY[name]
    params = make_params(spec.shapes)
    opt = spec.make_for({n: s for n, (s, _) in params.items()}) if spec.make_for else spec.make()
    _check_policy(opt, params, POLICY[name], bad)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("case", sorted(CASES))
def test_nonfinite_gradient_policy_of_every_flag_combination(case, bad):
    """The elementwise policies hold whichever flags are on (each combination is another operation sequence)."""
    _check_policy(CASES[case].make(), make_params(REGISTRY["adamw"].shapes), CASES[case].policy, bad)


def _check_policy(opt, params, policy_of, bad):
    for it in range(2):
        for n, (s, p) in sorted(params.items()):
            opt.step(n, s, p, rng_arrays(5 + it, s))
    for n, (s, p) in sorted(params.items()):
        g = rng_arrays(9, s)
        g[0] = bad
        with np.errstate(all="ignore"):
            opt.step(n, s, p, g)
        policy = policy_of(s) if callable(policy_of) else policy_of
        nonfinite = int(np.sum(~np.isfinite(p)))
        if policy in ("tensor", "matrix") and not np.isnan(bad):  # an infinity may leave 0·inf = NaN in one place
            assert nonfinite >= 1, (n, s, policy, nonfinite)
        else:
            expected = {"element": 1, "tensor": p.size, "finite": 0, "sign": int(np.isnan(bad)), "clip": int(np.isnan(bad)),
                        "matrix": int(np.prod(s[-2:]))}[policy]
            assert nonfinite == expected, (n, s, policy, nonfinite)

"""The one registry of every optimizer: the contract suite (test_contract.py) runs over all of it.

A new algorithm joins with one entry: a factory for a fresh optimizer (keyword overrides allowed), the shapes it
accepts, and a learning rate at which it must decrease a quadratic and the Rosenbrock function.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import flatopt


@dataclasses.dataclass(frozen=True)
class Spec:
    make: Callable[..., object]  # make(**overrides) -> a fresh optimizer
    shapes: tuple = ((7,), (4, 3), (2, 3, 4), (1,), (5, 1))
    quadratic_lr: float = 0.05  # lr for the convergence checks (passed to make(lr=...))
    rosenbrock_lr: float = 0.01
    converge_steps: int = 300
    converges_on: tuple = ("quadratic", "rosenbrock")  # a manifold optimizer may not reach 0.1x on the quadratic
    set_lr_changes_update: bool = True  # a step with lr/2 differs from a step with lr
    # random valid hyper-parameters for the fuzz tests: fuzz(rng: random.Random) -> kwargs for make()
    fuzz: Callable[..., dict] | None = None
    # For optimizers whose parameters are fixed at construction (a manifest, e.g. MuonAdamW):
    # make_for({name: shape}) -> a fresh optimizer for exactly those parameters (tests with varying shapes use it).
    make_for: Callable[[dict], object] | None = None


_MA_SHAPES = ((4, 3), (6, 5), (7,), (3, 7))


def _muon_adamw_for(shapes: dict, lr=0.02, weight_decay=0.01, **kw):
    """MuonAdamW over a manifest of ``shapes``: every 2-D name on Muon, the rest on AdamW (lr ratio 0.5 so that
    the AdamW half moves visibly in the contract's tests)."""
    shapes = dict(shapes)
    muon = [n for n, s in shapes.items() if len(s) == 2 and min(s) > 0]
    if not muon:  # the Muon group may not be empty: add a matrix that is never stepped (missing gradient = no-op)
        shapes["unused_matrix"], muon = (2, 2), ["unused_matrix"]
    return flatopt.MuonAdamW(params=shapes, muon_names=muon, lr=lr, adamw_lr_ratio=0.5,
                             muon={"weight_decay": weight_decay}, adamw={"weight_decay": weight_decay}, **kw)


def _muon_adamw_contract(lr=0.02, **kw):
    """The names and shapes test_contract.py steps with a fixed manifest: p<i> of ``make_params(shapes)``,
    ``w<shape>``, ``w`` (shapes[1]) and ``x`` (8, 6)."""
    names = {f"p{i}": s for i, s in enumerate(_MA_SHAPES)}
    names.update({f"w{s}": s for s in _MA_SHAPES})
    names.update({"w": _MA_SHAPES[1], "x": (8, 6)})
    return _muon_adamw_for(names, lr=lr, **kw)


REGISTRY: dict[str, Spec] = {
    "sgd": Spec(make=lambda lr=0.05, **kw: flatopt.SGD(lr=lr, **kw), rosenbrock_lr=1e-3, converge_steps=2000,
                fuzz=lambda r: dict(lr=r.uniform(0, 0.5), momentum=r.choice([0.0, r.uniform(0, 0.99)]),
                                    weight_decay=r.choice([0.0, r.uniform(0, 0.1)]))),
    "sgd_nesterov": Spec(
        make=lambda lr=0.02, **kw: flatopt.SGD(lr=lr, momentum=0.9, nesterov=True, **{"weight_decay": 1e-4, **kw}),
        rosenbrock_lr=2e-4, converge_steps=2000,
    ),
    "sgd_dampened": Spec(make=lambda lr=0.02, **kw: flatopt.SGD(lr=lr, momentum=0.5, dampening=0.3, **kw),
                         rosenbrock_lr=5e-4, converge_steps=2000),
    "adamw": Spec(make=lambda lr=0.05, **kw: flatopt.AdamW(lr=lr, **kw),
                  fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999)),
                                      eps=r.choice([1e-8, 1e-3, 0.0]), weight_decay=r.uniform(0, 0.2),
                                      amsgrad=r.random() < 0.5)),
    "adamw_amsgrad": Spec(make=lambda lr=0.05, **kw: flatopt.AdamW(lr=lr, amsgrad=True, weight_decay=0.0, **kw)),
    "muon": Spec(make=lambda lr=0.02, **kw: flatopt.Muon(lr=lr, **{"weight_decay": 0.01, **kw}),
                 shapes=((4, 3), (6, 5), (3, 7)), quadratic_lr=0.05, rosenbrock_lr=0.01),
    "muon_adamw": Spec(make=_muon_adamw_contract, shapes=_MA_SHAPES, make_for=_muon_adamw_for,
                       quadratic_lr=0.05, rosenbrock_lr=0.01),
    "adafactor": Spec(make=lambda lr=None, **kw: flatopt.Adafactor(lr=lr, **kw), quadratic_lr=None, rosenbrock_lr=None),
    "adafactor8bit": Spec(make=lambda lr=0.05, **kw: flatopt.Adafactor8Bit(lr=lr, relative_step=False, beta1=0.9, min_8bit_size=0, block_size=128, m_block_size=32, **{"weight_decay": 1e-3, **kw})),
    "adafactor8bit_adam_d8_fira": Spec(make=lambda lr=0.05, **kw: flatopt.Adafactor8Bit(lr=lr, relative_step=False, scale_parameter=False, factored=False, beta1=0.9, beta2=0.999, eps=(1e-8, 1e-3), d=0.0, m_quant_type="d8", v_quant_type="al16", min_8bit_size=0, block_size=128, m_block_size=32, enable_fira_for_adafactor=True, **kw)),
    "adafactor8bit_apollo_came": Spec(make=lambda lr=0.05, **kw: flatopt.Adafactor8Bit(lr=lr, relative_step=False, scale_parameter=False, beta1=0.9, beta2=0.999, beta3=0.999, apollo_rank=2, apollo_update_proj_gap=2, min_8bit_size=0, block_size=128, m_block_size=32, m_quant_type="uf4", groups=[("*", {})], **kw), rosenbrock_lr=0.01),
    "adafactor_manual_beta1_wd": Spec(make=lambda lr=0.05, **kw: flatopt.Adafactor(lr=lr, beta1=0.9, **{"weight_decay": 1e-3, **kw}), rosenbrock_lr=0.01),
    "adafactor_beta2_unfactored_scaled": Spec(make=lambda lr=0.05, **kw: flatopt.Adafactor(lr=lr, beta2=0.999, factored=False, scale_parameter=True, **kw)),
    "adam": Spec(make=lambda lr=0.05, **kw: flatopt.Adam(lr=lr, **{"weight_decay": 1e-3, **kw}),
                 fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999)),
                                     eps=r.choice([1e-8, 1e-3]), weight_decay=r.choice([0.0, r.uniform(0, 0.1)]),
                                     amsgrad=r.random() < 0.5)),
    "adam_amsgrad": Spec(make=lambda lr=0.05, **kw: flatopt.Adam(lr=lr, amsgrad=True, **kw)),
    "nadamw": Spec(make=lambda lr=0.05, **kw: flatopt.NAdamW(lr=lr, **kw),
                   fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999)),
                                       eps=r.choice([1e-8, 1e-3]), weight_decay=r.uniform(0, 0.2))),
    "radam": Spec(make=lambda lr=0.05, **kw: flatopt.RAdam(lr=lr, **{"weight_decay": 1e-3, **kw}), rosenbrock_lr=2e-3,
                  fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0.5, 0.9999)),
                                      eps=r.choice([1e-8, 1e-3]), weight_decay=r.uniform(0, 0.1),
                                      decoupled_weight_decay=r.random() < 0.5, threshold=r.choice([4.0, 5.0]))),
    "radam_decoupled": Spec(make=lambda lr=0.05, **kw: flatopt.RAdam(lr=lr, betas=(0.9, 0.99),
                                                                     decoupled_weight_decay=True,
                                                                     **{"weight_decay": 1e-2, **kw}),
                            rosenbrock_lr=2e-3),
    "qhadamw": Spec(make=lambda lr=0.05, **kw: flatopt.QHAdamW(lr=lr, **kw),
                    fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.999), r.uniform(0, 0.9999)),
                                        nus=(r.uniform(0, 1), r.choice([1.0, r.uniform(0, 1)])),
                                        eps=r.choice([1e-8, 1e-3]), weight_decay=r.uniform(0, 0.2))),
    "qhadamw_nu2": Spec(make=lambda lr=0.05, **kw: flatopt.QHAdamW(lr=lr, betas=(0.9, 0.99), nus=(0.8, 0.9), **kw)),
    "adopt": Spec(make=lambda lr=0.05, **kw: flatopt.Adopt(lr=lr, **{"weight_decay": 1e-3, **kw}),
                  fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999)),
                                      eps=r.choice([1e-6, 1e-3, 0.0]), weight_decay=r.choice([0.0, r.uniform(0, 0.1)]),
                                      decoupled=r.random() < 0.5)),
    "adopt_decoupled": Spec(make=lambda lr=0.05, **kw: flatopt.Adopt(lr=lr, betas=(0.9, 0.99), decoupled=True,
                                                                     **{"weight_decay": 1e-2, **kw})),
    "ademamix": Spec(make=lambda lr=0.05, **kw: flatopt.AdEMAMix(lr=lr, **{"weight_decay": 1e-3, **kw}),
                     rosenbrock_lr=2e-3,
                     fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999),
                                                                     r.uniform(0.99, 1.0)),
                                         alpha=r.uniform(0, 10), t_alpha_beta3=r.choice([None, r.uniform(1, 100)]),
                                         eps=r.choice([1e-8, 1e-3]), weight_decay=r.choice([0.0, r.uniform(0, 0.1)]))),
    "ademamix_warmup": Spec(make=lambda lr=0.05, **kw: flatopt.AdEMAMix(lr=lr, betas=(0.9, 0.99, 0.999), alpha=2.0,
                                                                        t_alpha_beta3=50, **kw),
                            rosenbrock_lr=2e-3),
    "lion": Spec(make=lambda lr=0.01, **kw: flatopt.Lion(lr=lr, **{"weight_decay": 0.1, **kw}), quadratic_lr=0.01,
                 rosenbrock_lr=1e-3, converge_steps=1000,
                 fuzz=lambda r: dict(lr=r.uniform(0, 0.05), betas=(r.uniform(0, 0.99), r.uniform(0, 0.999)),
                                     weight_decay=r.choice([0.0, r.uniform(0, 1.0)]))),
    "lamb": Spec(make=lambda lr=0.05, **kw: flatopt.Lamb(lr=lr, **kw),
                 fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999)),
                                     eps=r.choice([1e-6, 1e-3]), weight_decay=r.choice([0.0, r.uniform(0, 0.2)]))),
    "mars": Spec(make=lambda lr=0.05, **kw: flatopt.Mars(lr=lr, **{"weight_decay": 1e-2, **kw}),
                 fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0, 0.99), r.uniform(0, 0.9999)),
                                     eps=r.choice([1e-8, 1e-3]), weight_decay=r.uniform(0, 0.2),
                                     gamma=r.uniform(0, 0.1), clip_c=r.random() < 0.5)),
    "sophia": Spec(make=lambda lr=0.05, **kw: flatopt.Sophia(lr=lr, **{"weight_decay": 1e-2, **kw}),
                   rosenbrock_lr=2e-3, converge_steps=1000,
                   fuzz=lambda r: dict(lr=r.uniform(0, 0.05), betas=(r.uniform(0, 0.99), r.uniform(0, 0.999)),
                                       rho=r.uniform(0, 0.1), weight_decay=r.uniform(0, 0.2))),
    "schedulefree_adamw": Spec(make=lambda lr=0.05, **kw: flatopt.ScheduleFreeAdamW(lr=lr, **kw),
                               fuzz=lambda r: dict(lr=r.uniform(0, 0.1), betas=(r.uniform(0.05, 0.99),
                                                                                 r.uniform(0, 0.9999)),
                                                   eps=r.choice([1e-8, 1e-3]),
                                                   weight_decay=r.choice([0.0, r.uniform(0, 0.1)]),
                                                   warmup_steps=r.choice([0, 3]), r=r.choice([0.0, 0.5]),
                                                   weight_lr_power=r.choice([2.0, 0.0]))),
    "schedulefree_adamw_warmup_wd": Spec(make=lambda lr=0.05, **kw: flatopt.ScheduleFreeAdamW(
        lr=lr, **{"weight_decay": 1e-3, "warmup_steps": 5, "r": 0.5, **kw})),
    "kron_psgd": Spec(make=lambda lr=0.03, **kw: flatopt.KronPsgd(lr=lr, **kw), quadratic_lr=0.03, rosenbrock_lr=0.03),
    "kron_psgd_knobs": Spec(make=lambda lr=0.03, **kw: flatopt.KronPsgd(lr=lr, memory_save_mode="one_diag", momentum_into_precond_update=False, update_probability=0.5, precond_dtype="param", **{"weight_decay": 1e-3, **kw}), quadratic_lr=0.03, rosenbrock_lr=0.03),
    "soap": Spec(make=lambda lr=0.01, **kw: flatopt.Soap(lr=lr, betas=(0.9, 0.99), precondition_frequency=2, max_precond_dim=512, **{"weight_decay": 1e-3, **kw}), shapes=((7,), (4, 3), (2, 3, 4), (1,), (5, 1), (3, 3)), quadratic_lr=0.05, rosenbrock_lr=0.01),
    "soap_1d_capped": Spec(make=lambda lr=0.01, **kw: flatopt.Soap(lr=lr, shampoo_beta=0.9, precondition_1d=True, max_precond_dim=8, precondition_frequency=1, **kw), shapes=((1,), (4, 3), (2, 7, 4), (9,), (8, 6)), quadratic_lr=0.05, rosenbrock_lr=0.01),
    "stiefel": Spec(make=lambda lr=0.05, **kw: flatopt.Stiefel(lr=lr, **kw), shapes=((3, 5), (4, 3), (2, 3, 4), (5, 1), (1, 1)), rosenbrock_lr=1e-3, converges_on=("rosenbrock",)),
    "stiefel_momentum": Spec(make=lambda lr=0.05, **kw: flatopt.Stiefel(lr=lr, momentum=0.9, **kw), shapes=((3, 5), (4, 3), (2, 4, 2), (1, 6)), rosenbrock_lr=1e-3, converges_on=("rosenbrock",)),
}


# The elementwise algorithms' flag space: the options that change the operation sequence of a step (the branches of
# the NumPy path, the flag bits of the compiled pass and of the CUDA kernels), each with its settings by label, the
# "off" one first (label ""), over a base of non-default hyper-parameters.  flag_cases() takes every valid
# combination; the bit-identity tables of test_native.py, test_multi_tensor.py and test_nonfinite.py derive from it.
@dataclasses.dataclass(frozen=True)
class FlagSpace:
    cls: type
    base: dict
    options: dict  # kwarg -> {label: value}; the first label is "" (the option off)
    policy: str | Callable[[dict], str] = "element"  # the non-finite gradient policy (test_nonfinite.py), by config
    min_steps: int = 0  # steps a bit-identity test needs to reach every branch


_WD = {"": 0.0, "wd": 0.1}
FLAG_SPACE: dict[str, FlagSpace] = {
    "sgd": FlagSpace(flatopt.SGD, dict(lr=0.05), {"weight_decay": _WD, "momentum": {"": 0.0, "momentum": 0.9},
                                                  "dampening": {"": 0.0, "dampening": 0.3},
                                                  "nesterov": {"": False, "nesterov": True}}),
    "adamw": FlagSpace(flatopt.AdamW, dict(lr=1e-2, betas=(0.8, 0.95)),
                       {"weight_decay": _WD, "amsgrad": {"": False, "amsgrad": True}}),
    "adam": FlagSpace(flatopt.Adam, dict(lr=1e-2, betas=(0.8, 0.95)),
                      {"weight_decay": _WD, "amsgrad": {"": False, "amsgrad": True}}),
    "nadamw": FlagSpace(flatopt.NAdamW, dict(lr=1e-2, betas=(0.8, 0.95)), {"weight_decay": _WD}),
    # rectified from t = 5 on (rho_inf = 19, threshold 4)
    "radam": FlagSpace(flatopt.RAdam, dict(lr=1e-2, betas=(0.8, 0.9), threshold=4.0),
                       {"weight_decay": _WD, "decoupled_weight_decay": {"": False, "decoupled": True}},
                       min_steps=5),
    "qhadamw": FlagSpace(flatopt.QHAdamW, dict(lr=1e-2, betas=(0.8, 0.95)),
                         {"weight_decay": _WD, "nus": {"": (1.0, 1.0), "nu1_nu2": (0.6, 0.8), "nu1": (0.6, 1.0),
                                                       "nu2": (1.0, 0.8)}}),
    "adopt": FlagSpace(flatopt.Adopt, dict(lr=1e-2, betas=(0.8, 0.95)),
                       {"weight_decay": _WD, "decoupled": {"": False, "decoupled": True}}, policy="clip"),
    "ademamix": FlagSpace(flatopt.AdEMAMix, dict(lr=1e-2, betas=(0.8, 0.95, 0.99), alpha=3.0, t_alpha_beta3=3),
                          {"weight_decay": _WD}),
    "lion": FlagSpace(flatopt.Lion, dict(lr=1e-3, betas=(0.8, 0.95)), {"weight_decay": {"": 0.0, "wd": 0.5}},
                      policy="sign"),
    # big: the averaging weight's lerp branch (c >= 0.5: steps 1 and 2 at a constant lr)
    "schedulefree_adamw": FlagSpace(flatopt.ScheduleFreeAdamW, dict(lr=1e-2, betas=(0.8, 0.95)),
                                    {"weight_decay": _WD}, min_steps=3),
    "sophia": FlagSpace(flatopt.Sophia, dict(lr=1e-3, betas=(0.9, 0.95), rho=0.5), {"weight_decay": _WD},
                        policy="sign"),
    "lamb": FlagSpace(flatopt.Lamb, dict(lr=1e-2, betas=(0.8, 0.99)), {"weight_decay": _WD}),
    "mars": FlagSpace(flatopt.Mars, dict(lr=1e-2, betas=(0.9, 0.95), gamma=0.05),
                      {"weight_decay": _WD, "clip_c": {"": True, "noclip": False}},
                      policy=lambda cfg: "tensor" if cfg["clip_c"] else "element"),  # the clip's norm
}


# cautious=True (the config base core.elementwise.define.Cautious): an option of every algorithm whose config has the
# field, derived from the definitions; its mask's count is a per-tensor sum (a reduction level: FlagCase.launches)
for _space in FLAG_SPACE.values():
    if "cautious" in {f.name for f in dataclasses.fields(_space.cls.config_cls)}:
        _space.options["cautious"] = {"": False, "cautious": True}


# and the contract suite (every test over REGISTRY) runs each such algorithm's registry entry with the flag on
for _algo, _space in FLAG_SPACE.items():
    if "cautious" in _space.options and _algo in REGISTRY:
        REGISTRY[f"{_algo}_cautious"] = dataclasses.replace(
            REGISTRY[_algo], make=functools.partial(REGISTRY[_algo].make, cautious=True))


@dataclasses.dataclass(frozen=True)
class FlagCase:
    algorithm: str
    labels: tuple  # the options on, by label
    kwargs: dict

    @property
    def space(self) -> FlagSpace:
        return FLAG_SPACE[self.algorithm]

    def make(self, **overrides):
        return self.space.cls(**{**self.space.base, **self.kwargs, **overrides})

    @property
    def policy(self) -> str:
        return policy_of(self.make())

    @property
    def launches(self) -> int:
        """Multi-tensor launches per group at a step that sums over the tensor (steps 1 and 2: Adopt's first sets v
        alone)."""
        return max(self.launches_at(t) for t in (1, 2))

    def launches_at(self, t: int) -> int:
        """Multi-tensor launches per group at step count t, from the definition's split of that step's flag set:
        each reduction level's partials and fold, then the map (2·levels + 1: three for Lamb, Mars's clip or a
        cautious mask, five for Mars's clip and mask), or one where the flag set has no sum."""
        from flatopt.core.elementwise.define import REGISTRY as DEFINITIONS  # noqa: PLC0415

        d = DEFINITIONS.get(self.algorithm)
        if d is None:
            return 1
        sp = d.split_at(d.flags_of(self.make().config, t, d.example_host))
        return 1 if sp is None else 2 * len(sp.levels) + 1


def policy_of(opt) -> str:
    """The non-finite gradient policy of an elementwise optimizer (its flag space's, for its config)."""
    space = next(sp for sp in FLAG_SPACE.values() if type(opt) is sp.cls)
    return space.policy(opt.state_dict().config) if callable(space.policy) else space.policy


def flag_cases(algorithms=None) -> dict[str, FlagCase]:
    """Every valid combination of the flag space (a combination the constructor refuses, e.g. Nesterov without
    momentum, is left out), by id: ``algorithm[-label...]``."""
    out = {}
    for algo in algorithms or FLAG_SPACE:
        space = FLAG_SPACE[algo]
        for combo in itertools.product(*(opts.items() for opts in space.options.values())):
            case = FlagCase(algo, tuple(lab for lab, _ in combo if lab),
                            dict(zip(space.options, (v for _, v in combo))))
            try:
                case.make()
            except ValueError:
                continue
            out["-".join((algo, *case.labels))] = case
    return out


def richest_cases(cases=None) -> dict[str, FlagCase]:
    """Per algorithm, the case of ``cases`` (default: every valid one) with the most options on (ties: the first in
    flag_cases order)."""
    best: dict[str, tuple[str, FlagCase]] = {}
    for cid, case in (flag_cases() if cases is None else cases).items():
        if case.algorithm not in best or len(case.labels) > len(best[case.algorithm][1].labels):
            best[case.algorithm] = (cid, case)
    return dict(best.values())

"""Hyper-parameter validation over the registry: every float field of every config dataclass refuses inf, -inf
and nan with an error naming the field; ``set_lr`` refuses them and an lr beyond float32 (nothing changes); and
MuonAdamW's tied names share one param buffer with or without a gradient."""

from __future__ import annotations

import dataclasses
import inspect
import math

import numpy as np
import pytest

import flatopt
from flatopt import errors as E
from flatopt.core.validate import LR_MAX, check_lr, check_range
from tests.helpers import assert_states_equal, make_params, rng_arrays, run_steps
from tests.registry import REGISTRY

BAD = (math.inf, -math.inf, math.nan)


def _configs(opt) -> list:
    """The config dataclasses an optimizer is built from (MuonAdamW: both halves)."""
    if isinstance(opt, flatopt.MuonAdamW):
        return [opt.muon.config, opt.adamw.config]
    return [opt.config]


def _float_fields(cfg) -> list[tuple[str, int | None]]:
    """(field, index or None) of every float hyper-parameter of a config dataclass, tuples item by item."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, (tuple, list)) and any(isinstance(x, float) for x in v):
            out += [(f.name, i) for i in range(len(v))]
        elif isinstance(v, float) or (v is None and "float" in str(f.type)):
            out.append((f.name, None))
    return out


def _with(cfg, field, index, bad):
    if index is None:
        return {field: bad}
    v = list(getattr(cfg, field))
    v[index] = bad
    return {field: tuple(v)}


CASES = sorted({(type(cfg).__name__, key, field, index)
                for key, spec in REGISTRY.items() for cfg in _configs(spec.make())
                for field, index in _float_fields(cfg)})


def test_every_config_has_float_fields():
    names = {c[0] for c in CASES}
    assert {"SGDConfig", "AdamWConfig", "AdafactorConfig", "Adafactor8BitConfig", "KronPsgdConfig",
            "MuonConfig"} <= names


@pytest.mark.parametrize("cls_name, key, field, index", CASES)
def test_non_finite_float_field_rejected_naming_it(cls_name, key, field, index):
    for cfg in _configs(REGISTRY[key].make()):
        if type(cfg).__name__ != cls_name:
            continue
        for bad in BAD:
            with pytest.raises(ValueError, match=field.split("[")[0]) as info:
                dataclasses.replace(cfg, **_with(cfg, field, index, bad))
            assert "finite" in str(info.value) or "must be in" in str(info.value), str(info.value)


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_constructor_rejects_non_finite_keyword(key):
    """The public constructors refuse a non-finite value of every float keyword they take (and of lr)."""
    spec = REGISTRY[key]
    opt = spec.make()
    if isinstance(opt, flatopt.MuonAdamW):
        for bad in BAD:
            for kw in (dict(lr=bad), dict(adamw_lr_ratio=bad), dict(muon={"weight_decay": bad}),
                       dict(adamw={"eps": bad}), dict(lr=1e300)):
                with pytest.raises(ValueError, match="lr|ratio|weight_decay|eps"):
                    flatopt.MuonAdamW({"w": (3, 2), "b": (2,)}, ["w"], **kw)
        return
    params = inspect.signature(type(opt).__init__).parameters
    for cfg in _configs(opt):
        for field, index in _float_fields(cfg):
            if field not in params:
                continue
            for bad in BAD:  # the class itself (registry entries fix some keywords)
                with pytest.raises(ValueError, match=field.split("[")[0]):
                    type(opt)(**{"lr": 0.01, **_with(cfg, field, index, bad)})
    with pytest.raises(ValueError, match="lr"):
        spec.make(lr=1e300)


@pytest.mark.parametrize("key", sorted(REGISTRY))
@pytest.mark.parametrize("bad", BAD + (1e300, -1.0))
def test_set_lr_rejects_and_changes_nothing(key, bad):
    spec = REGISTRY[key]
    opt = spec.make()
    params = make_params(spec.shapes)
    run_steps(opt, params, 1)
    before, lr = opt.state_dict(), opt.lr
    with pytest.raises(ValueError, match="lr"):
        opt.set_lr(bad)
    assert opt.lr == lr
    assert_states_equal(opt.state_dict(), before)


def test_one_rule_in_the_validator():
    for bad in BAD:
        with pytest.raises(ValueError, match="X: f must be finite"):
            check_range("X", "f", bad, -math.inf, math.inf)  # an infinite bound is no bound, never "inf allowed"
    with pytest.raises(TypeError, match="real number"):
        check_range("X", "f", True, 0, 1)
    assert check_lr(LR_MAX) == LR_MAX
    with pytest.raises(ValueError, match="lr must be in"):
        check_lr(LR_MAX * 2)


def test_lr_times_lr_scale_must_be_finite_in_the_param_dtype():
    """A finite lr whose product with lr_scale overflows the dtype is refused per parameter, before any change."""
    opt = flatopt.AdamW(lr=1e38, lr_scale={"w": 1e10})
    w, g = rng_arrays(0, (4,)), rng_arrays(1, (4,))
    w0 = w.copy()
    with pytest.raises(ValueError, match="'w'.*not finite in float32"):
        opt.step("w", (4,), w, g)
    assert np.array_equal(w, w0) and opt.state_names() == []
    opt.step("w", (4,), w.astype(np.float64), g.astype(np.float64))  # 1e48 is finite in float64


# ------------------------------------------------------------------------------- MuonAdamW tied aliases
def _tied():
    manifest = {"embed": (6, 4), "h.w": (4, 4)}
    return flatopt.MuonAdamW(manifest, ["h.w"], aliases={"lm_head": "embed"}, adamw_lr_ratio=1.0)


@pytest.mark.parametrize("grad_on", ["alias", "name", "neither"])
def test_tied_alias_with_another_buffer_is_refused_with_or_without_grad(grad_on):
    from flatopt import OptItem

    opt = _tied()
    e, h = rng_arrays(0, (6, 4)), rng_arrays(1, (4, 4))
    ge, gh = rng_arrays(2, (6, 4)), rng_arrays(3, (4, 4))
    opt.step_batch([OptItem("embed", (6, 4), e, ge), OptItem("h.w", (4, 4), h, gh)])
    before, e0, h0 = opt.state_dict(), e.copy(), h.copy()
    stale = e.copy()
    items = [OptItem("embed", (6, 4), e, ge if grad_on == "name" else None),
             OptItem("lm_head", (6, 4), stale, ge if grad_on == "alias" else None),
             OptItem("h.w", (4, 4), h, gh)]
    for order in (items, items[::-1]):
        with pytest.raises(E.TiedParameterMismatch, match="lm_head|embed"):
            opt.step_batch(order)
    assert np.array_equal(e, e0) and np.array_equal(h, h0)
    assert_states_equal(opt.state_dict(), before)
    # the same memory passes, with the gradient on either name
    opt.step_batch([OptItem("embed", (6, 4), e, None), OptItem("lm_head", (6, 4), e, ge)])
    assert opt.state_dict().params["embed"]["t"] == 2

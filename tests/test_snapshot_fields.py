"""A malformed snapshot is refused before anything changes (audit D3, D7): for every optimizer of the registry and
every field (``step``, ``config``, ``params`` and each parameter's ``shape``/``dtype``/``t``/scalar state,
``buffers``, ``extra`` and the algorithm's extra counters, the recorded lr), ``load_state_dict`` returns ``False``
naming the field (``strict=True``: :class:`flatopt.IncompatibleStateError`), the optimizer's ``state_dict()`` is
unchanged and its next step gives the bits of a twin that never saw the snapshot.  Nothing is coerced (``"7"``,
``2.5``, ``True`` for an int).  ``flatopt.save`` refuses to write such a snapshot and ``flatopt.load`` to return one.
"""

from __future__ import annotations

import copy
import json
import math
import zipfile

import numpy as np
import pytest

import flatopt
from flatopt import CheckpointError
from tests.helpers import assert_bits_equal, assert_states_equal, make_params, run_steps
from tests.registry import REGISTRY

_GONE = object()

# (field path, bad value, words the refusal names); "*" is the first parameter name of the snapshot
COMMON = [
    ("step", None, "'step'"), ("step", "7", "'step'"), ("step", 2.5, "'step'"), ("step", -1, "'step'"),
    ("step", True, "'step'"),
    ("extra", None, "'extra'"), ("extra", "x", "'extra'"), ("extra", ["x"], "'extra'"),
    ("config", None, "'config'"), ("config", "x", "'config'"),
    ("params", None, "'params'"), ("params", ["x"], "'params'"),
    ("buffers", None, "'buffers'"),
    ("params.*", None, "params["), ("params.*", "x", "params["),
    ("params.*.t", -1, "['t']"), ("params.*.t", 2.5, "['t']"), ("params.*.t", "7", "['t']"),
    ("params.*.t", None, "['t']"), ("params.*.t", True, "['t']"), ("params.*.t", _GONE, "['t']"),
    ("params.*.dtype", None, "['dtype']"), ("params.*.dtype", "int32", "['dtype']"), ("params.*.dtype", 4, "['dtype']"),
    ("params.*.shape", None, "['shape']"), ("params.*.shape", "x", "['shape']"), ("params.*.shape", [-1], "['shape']"),
    ("params.*.shape", [True], "['shape']"), ("params.*.shape", [2.5], "['shape']"),
    ("extra.lr", -1.0, "lr"), ("extra.lr", math.nan, "lr"), ("extra.lr", math.inf, "lr"), ("extra.lr", "0.1", "lr"),
    ("extra.lr", None, "lr"),
]
_BASE_META = {"shape", "dtype", "t", "group"}


def _specific(key: str) -> list[tuple[str, object, str]]:
    """The algorithm's own scalar state (per parameter and optimizer-wide), each made null, a str and a float."""
    st = _trained(key, 2)[0].state_dict()
    out = []
    fields = {f for meta in st.params.values() for f in meta} - _BASE_META
    for f in sorted(fields):
        first = next(n for n in sorted(st.params) if f in st.params[n])
        for bad in (None, "7", 2.5):
            if not isinstance(st.params[first][f], float) or not isinstance(bad, float):
                out.append((f"params.{first}.{f}", bad, repr(f)))
    for f in sorted(set(st.extra) - {"lr", "groups"}):
        out += [(f"extra.{f}", bad, f) for bad in (None, "7", 2.5, 0)]
    return out


def _trained(key: str, steps: int, seed: int = 0):
    spec = REGISTRY[key]
    opt = spec.make()
    params = make_params(spec.shapes, seed=seed)
    run_steps(opt, params, steps)
    return opt, params


def _mutated(state: flatopt.OptimizerState, path: str, value):
    bad = copy.deepcopy(state)
    parts = path.split(".")
    if parts[0] == "params" and len(parts) > 1:
        name = sorted(bad.params)[0] if parts[1] == "*" else parts[1]
        parts = ["params", name, *parts[2:]]
    if len(parts) == 1:
        setattr(bad, parts[0], value)
        return bad
    obj = getattr(bad, parts[0])
    for p in parts[1:-1]:
        obj = obj[p]
    if value is _GONE:
        del obj[parts[-1]]
    else:
        obj[parts[-1]] = value
    return bad


def _check_refused(key: str, cases) -> None:
    """Load each malformed snapshot into an optimizer trained alongside a twin: refused, nothing changed, and the
    next step equals the twin's bit for bit."""
    opt, params = _trained(key, 2)
    twin, twin_params = _trained(key, 2)
    source = _trained(key, 3, seed=5)[0].state_dict()  # other values everywhere: a partial load would show
    before = opt.state_dict()
    for path, value, needle in cases:
        if path.startswith("params.") and not source.params:
            continue
        bad = _mutated(source, path, value)
        what = f"{key}: {path} = {value!r}"
        assert opt.load_state_dict(bad) is False, what
        notes = " ".join(opt.last_load_notes)
        if key != "muon_adamw":  # (MuonAdamW's record errors name the record's part in their own words)
            assert needle in notes, (what, notes)
        with pytest.raises(flatopt.IncompatibleStateError):
            opt.load_state_dict(bad, strict=True)
        assert_states_equal(opt.state_dict(), before)
    run_steps(opt, params, 1, start=2)
    run_steps(twin, twin_params, 1, start=2)
    assert_states_equal(opt.state_dict(), twin.state_dict())
    for name in params:
        assert_bits_equal(params[name][1], twin_params[name][1], f"{key}: {name} after the refusals")


@pytest.mark.parametrize("key", sorted(REGISTRY))
@pytest.mark.parametrize("case", COMMON, ids=[f"{p}={v!r}" if v is not _GONE else f"{p}=absent" for p, v, _ in COMMON])
def test_a_malformed_field_is_refused_and_changes_nothing(key, case):
    _check_refused(key, [case])


# the registry entries whose snapshots hold scalar state of their own (the others: see the test below)
WITH_SCALARS = ["adafactor8bit", "adafactor8bit_adam_d8_fira", "adafactor8bit_apollo_came", "kron_psgd",
                "kron_psgd_knobs", "schedulefree_adamw", "schedulefree_adamw_cautious",
                "schedulefree_adamw_warmup_wd", "stiefel", "stiefel_momentum"]


@pytest.mark.parametrize("key", WITH_SCALARS)
def test_a_malformed_algorithm_scalar_is_refused_and_changes_nothing(key):
    cases = _specific(key)
    assert cases
    _check_refused(key, cases)


def test_the_list_of_algorithms_with_scalar_state_is_complete():
    assert sorted(k for k in REGISTRY if _specific(k)) == WITH_SCALARS


def test_the_audit_reproduction_half_loaded_adamw(tmp_path):
    """audit D3: ``extra = None`` saved, loaded and given to a stepped optimizer left it half-loaded."""
    g = np.ones(4, np.float32)
    src, q = flatopt.AdamW(), np.zeros(4, np.float32)
    for _ in range(5):
        src.step("w", (4,), q, g)
    bad = flatopt.OptimizerState(**{**src.state_dict().__dict__, "extra": None})
    with pytest.raises(ValueError, match="malformed snapshot.*'extra'"):
        flatopt.save(tmp_path / "bad.npz", bad)
    opt = flatopt.AdamW()
    opt.step("w", (4,), np.zeros(4, np.float32), g)
    assert opt.load_state_dict(bad) is False and "'extra'" in opt.last_load_notes[0]
    assert opt.state_dict().params["w"]["t"] == 1


@pytest.mark.parametrize("path,value", [("step", None), ("step", "7"), ("params.*.t", -1), ("params.*.t", 2.5),
                                        ("params.*.dtype", None), ("extra", "x"), ("config", None),
                                        ("extra.lr", -1.0)])
def test_save_refuses_and_load_refuses_a_malformed_snapshot(tmp_path, path, value):
    good = _trained("adamw", 2)[0].state_dict()
    with pytest.raises(ValueError, match="refusing to save a malformed snapshot"):
        flatopt.save(tmp_path / "c.npz", _mutated(good, path, value))
    assert list(tmp_path.iterdir()) == []
    # the same snapshot written by hand (as another tool or an edited header would): load refuses to return it
    flatopt.save(tmp_path / "c.npz", good)
    with zipfile.ZipFile(tmp_path / "c.npz") as z:
        members = {n: z.read(n) for n in z.namelist()}
    import io

    header = json.loads(np.load(io.BytesIO(members["header.npy"])).tobytes())
    bad = _mutated(flatopt.OptimizerState(header["algorithm"], header["config"], header["config_key"],
                                          header["step"], header["params"], {}, header["extra"]), path, value)
    header.update(config=bad.config, step=bad.step, params=bad.params, extra=bad.extra)
    buf = io.BytesIO()
    np.save(buf, np.frombuffer(json.dumps(header).encode(), np.uint8))
    members["header.npy"] = buf.getvalue()
    with zipfile.ZipFile(tmp_path / "bad.npz", "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(CheckpointError, match="bad.npz: malformed snapshot"):
        flatopt.load(tmp_path / "bad.npz")


def test_a_snapshot_with_t_zero_loads():
    """Sophia's ``update_hessian`` creates a state before the first step (t = 0): such a snapshot is valid."""
    s = flatopt.Sophia(lr=0.01)
    s.update_hessian("w", (3,), np.ones(3, np.float32))
    st = s.state_dict()
    assert st.params["w"]["t"] == 0
    assert flatopt.Sophia(lr=0.01).load_state_dict(st) is True


def test_adafactor8bit_restore_hparams_refuses_group_overrides_it_cannot_apply():
    """With ``restore_hparams`` the groups' overrides come from the snapshot: ones that do not make a configuration
    are refused before anything changes (they raised after the slots were installed)."""
    key = "adafactor8bit_apollo_came"
    opt, params = _trained(key, 2)
    source = _trained(key, 3, seed=5)[0].state_dict()
    assert source.config["groups"][0]["select"]
    bad = _mutated(source, "config.groups", [{**source.config["groups"][0], "overrides": {"beta1": "x"}}])
    before = opt.state_dict()
    assert opt.load_state_dict(bad, restore_hparams=True) is False
    assert "'config'" in opt.last_load_notes[0] and "beta1" in opt.last_load_notes[0]
    assert_states_equal(opt.state_dict(), before)

"""``load_state_dict`` says why it refuses: ``False`` with the reason in ``last_load_notes`` (naming the algorithm,
the configuration field, the parameter or the format version), ``strict=True`` raising
:class:`flatopt.IncompatibleStateError` with that message, and a path or a dict as a ``TypeError`` that points to
``flatopt.load``; for every optimizer of the registry, a Router and ``distributed.Sharded``."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

import flatopt
from flatopt.routing import Group, IncompatibleState, Router, Select
from tests.helpers import assert_states_equal, make_params, run_steps
from tests.registry import REGISTRY


def _trained(key):
    spec = REGISTRY[key]
    opt = spec.make()
    run_steps(opt, make_params(spec.shapes), 2)
    return opt


def _refuses(opt, state, *needles, **kw):
    """``False`` with nothing changed and every needle in ``last_load_notes``; strict raises the same message."""
    before = opt.state_dict()
    assert opt.load_state_dict(state, **kw) is False
    notes = " ".join(opt.last_load_notes)
    for n in needles:
        assert n in notes, (n, notes)
    with pytest.raises(flatopt.IncompatibleStateError) as info:
        opt.load_state_dict(state, strict=True, **kw)
    assert str(info.value) == opt.last_load_notes[0]
    assert_states_equal(opt.state_dict(), before)


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_reasons_name_the_algorithm_the_version_and_the_parameter(key):
    opt = _trained(key)
    mine = opt.state_dict()
    other = _trained("adamw" if key.startswith("sgd") else "sgd").state_dict()
    _refuses(opt, other, repr(other.algorithm))
    newer = copy.deepcopy(mine)
    newer.format_version += 1
    _refuses(opt, newer, "format version", str(newer.format_version))
    with_buffers = sorted({k.split("/", 1)[1] for k in mine.buffers})
    if with_buffers:
        bad = copy.deepcopy(mine)
        name = with_buffers[0]
        bad.params[name]["shape"] = [99, 98]
        _refuses(opt, bad, name.split(".")[-1])
    assert opt.load_state_dict(mine, strict=True) is True and opt.last_load_notes == []


@pytest.mark.parametrize("key", sorted(REGISTRY))
@pytest.mark.parametrize("wrong", ["ckpt.npz", Path("ckpt.npz"), {"algorithm": "x"}])
def test_a_path_or_a_dict_is_a_type_error_pointing_to_load(key, wrong):
    opt = REGISTRY[key].make()
    with pytest.raises(TypeError, match=r"flatopt\.load"):
        opt.load_state_dict(wrong)


def test_a_config_field_that_matters_is_named():
    a = flatopt.AdamW(amsgrad=True)
    a.step("w", (3,), np.zeros(3, np.float32), np.ones(3, np.float32))
    _refuses(flatopt.AdamW(amsgrad=False), a.state_dict(), "'amsgrad'", "True", "False")
    m = flatopt.Muon(momentum_convention="sgd")
    m.step("w", (3, 2), np.zeros(6, np.float32), np.ones(6, np.float32))
    _refuses(flatopt.Muon(), m.state_dict(), "'momentum_convention'")


def test_adafactor8bit_without_migration_says_so():
    a = flatopt.Adafactor8Bit(lr=0.01, relative_step=False, block_size=128, min_8bit_size=0)
    a.step("w", (300,), np.zeros(300, np.float32), np.ones(300, np.float32))
    b = flatopt.Adafactor8Bit(lr=0.01, relative_step=False, block_size=256, min_8bit_size=0)
    _refuses(b, a.state_dict(), "'block_size'", "migrat", migrate=False)


def test_router_names_the_group_and_the_reason():
    def make(amsgrad):
        return Router([Group("mat", flatopt.AdamW(amsgrad=amsgrad), Select(patterns=["*.w"])),
                       Group("rest", flatopt.SGD(lr=0.1), Select.all())])

    a = make(True)
    a.step_batch([flatopt.OptItem("l.w", (2, 2), np.zeros(4, np.float32), np.ones(4, np.float32))])
    b = make(False)
    _refuses(b, a.state_dict(), "'mat'", "'amsgrad'")
    with pytest.raises(IncompatibleState):
        b.load_state_dict(a.state_dict(), strict=True)
    with pytest.raises(TypeError, match=r"flatopt\.load"):
        b.load_state_dict("ckpt.npz")


def test_muon_adamw_notes_and_strict():
    opt = _trained("muon_adamw")
    other = _trained("adamw").state_dict()
    _refuses(opt, other, "'adamw'")
    assert isinstance(opt.last_load_error, flatopt.errors.RecordVersionMismatch)


def test_sharded_single_rank_notes_and_strict():
    mpi = pytest.importorskip("mpi4py.MPI")
    from flatopt.distributed import Sharded

    a = flatopt.AdamW(amsgrad=True)
    a.step("w", (3,), np.zeros(3, np.float32), np.ones(3, np.float32))
    s = Sharded(flatopt.AdamW(), mpi.COMM_SELF)
    assert s.load_state_dict(a.state_dict()) is False
    assert "'amsgrad'" in s.last_load_notes[0]
    with pytest.raises(flatopt.IncompatibleStateError, match="amsgrad"):
        s.load_state_dict(a.state_dict(), strict=True)
    with pytest.raises(TypeError, match=r"flatopt\.load"):
        s.load_state_dict("ckpt.npz")

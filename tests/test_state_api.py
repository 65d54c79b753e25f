"""The state inspection API (``iteration``, ``state_names``, ``state_nbytes``, ``reset``) on every optimizer,
thread-safe while another thread creates names (audit D12); MuonAdamW names another algorithm's snapshot; a
``step_batch`` given one ``OptItem`` or a mapping says what it takes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import flatopt
from flatopt.core import driver
from flatopt.routing import Group, Router, Select
from tests.helpers import make_for, make_params, run_steps
from tests.registry import REGISTRY


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_every_optimizer_has_the_state_inspection_api(key):
    spec = REGISTRY[key]
    params = make_params(spec.shapes)
    opt = make_for(spec, params)
    assert opt.iteration == 0 and opt.state_names() == [] and opt.state_nbytes() == 0
    run_steps(opt, params, 2)
    assert opt.iteration == 2
    assert opt.state_names() == sorted(opt.state_dict().params)
    assert opt.state_nbytes() == sum(v.nbytes for v in opt.state_dict().buffers.values())
    first = opt.state_names()[0]
    opt.reset(first)
    assert first not in opt.state_names()


def test_muon_adamw_reset_takes_an_alias_and_refuses_an_unknown_name():
    opt = flatopt.MuonAdamW(params={"w": (4, 3), "b": (3,)}, muon_names=["w"], aliases={"tied": "w"})
    opt.step_batch([flatopt.OptItem("w", (4, 3), np.zeros(12, np.float32), np.ones(12, np.float32)),
                    flatopt.OptItem("b", (3,), np.zeros(3, np.float32), np.ones(3, np.float32))])
    assert opt.state_names() == ["b", "w"] and opt.state_nbytes() == (12 + 3 + 3) * 4
    opt.reset("tied")
    assert opt.state_names() == ["b"]
    with pytest.raises(flatopt.errors.UnknownParameter, match="'nope'"):
        opt.reset("nope")


def test_muon_adamw_names_another_algorithms_snapshot():
    """It said ``RecordVersionMismatch ... version None``."""
    opt = flatopt.MuonAdamW(params={"w": (4, 3)}, muon_names=["w"])
    other = flatopt.AdamW()
    other.step("w", (4, 3), np.zeros(12, np.float32), np.ones(12, np.float32))
    assert opt.load_state_dict(other.state_dict()) is False
    assert opt.last_load_notes == ["the snapshot is of algorithm 'adamw', this optimizer is 'muon_adamw' (a "
                                   "MuonAdamW)"]
    assert isinstance(opt.last_load_error, flatopt.errors.RecordVersionMismatch)


def test_state_nbytes_is_safe_while_another_thread_adds_names(monkeypatch):
    """audit D12: ``dictionary changed size during iteration``.  Deterministic: the reader pauses inside its walk
    over the states until the other thread's steps have added names (or, when those steps wait for the reader,
    for a moment), then goes on."""
    opt = flatopt.AdamW()
    for i in range(3):
        opt.step(f"a{i}", (4,), np.zeros(4, np.float32), np.ones(4, np.float32))
    in_walk, added = threading.Event(), threading.Event()
    real = driver.persistent_fields

    def pausing(state):
        if threading.current_thread() is reader and not in_walk.is_set():
            in_walk.set()
            added.wait(0.5)
        return real(state)

    monkeypatch.setattr(driver, "persistent_fields", pausing)
    errors: list[BaseException] = []
    out: list[int] = []

    def read():
        try:
            out.append(opt.state_nbytes())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def write():
        in_walk.wait(5)
        for i in range(50):
            opt.step(f"b{i}", (4,), np.zeros(4, np.float32), np.ones(4, np.float32))
        added.set()

    reader = threading.Thread(target=read)
    writer = threading.Thread(target=write)
    reader.start()
    writer.start()
    reader.join(10)
    writer.join(10)
    assert not errors, errors
    assert out == [3 * 2 * 4 * 4]  # the states as they were when it was called (the steps waited)
    assert opt.state_nbytes() == 53 * 2 * 4 * 4


def _router():
    return Router([Group("mat", flatopt.AdamW(), Select(patterns=["*.w"])), Group("rest", flatopt.SGD(lr=0.1),
                                                                               Select.all())])


@pytest.mark.parametrize("make", [lambda: REGISTRY["adamw"].make(), lambda: REGISTRY["kron_psgd"].make(),
                                  lambda: REGISTRY["muon_adamw"].make(), _router],
                         ids=["adamw", "kron_psgd", "muon_adamw", "router"])
def test_step_batch_given_one_item_or_a_mapping_says_what_it_takes(make):
    """It failed with "missing 3 required positional arguments"."""
    opt = make()
    p, g = np.zeros(12, np.float32), np.ones(12, np.float32)
    item = flatopt.OptItem("p0", (4, 3), p, g)
    with pytest.raises(TypeError, match=r"takes a list of OptItem, got one OptItem \('p0'\): pass \[item\]"):
        opt.step_batch(item)
    with pytest.raises(TypeError, match="takes a list of OptItem.*got a dict"):
        opt.step_batch({"p0": item})
    with pytest.raises(TypeError, match=r"item 1 must be an OptItem\(name, shape, param, grad\).*got str"):
        opt.step_batch([item, "p1"])
    assert opt.state_dict().params == {} and not p.any()
    opt.step_batch((item,))  # a tuple of items is a batch
    assert p.any()

"""The README's Quickstart resumes bit for bit: its loop calls ``set_lr`` after each step (a warm-up), and the
learning rate in effect is training state, so a run checkpointed at any step of the warm-up, saved with
``flatopt.save``, loaded into an optimizer built as the README shows and continued gives the uninterrupted run's
bits (AdamW, MuonAdamW, Adafactor8Bit).  Also: what ``last_load_notes`` says about the lr, with and without
``restore_hparams``, and a snapshot written before the lr was recorded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flatopt
from tests.helpers import assert_bits_equal

README = Path(__file__).resolve().parents[1] / "README.md"
WARMUP = 10
STEPS = WARMUP + 3

MAKERS = {
    # as the Quickstart builds it (and the README's resume line: the same arguments)
    "adamw": lambda: flatopt.AdamW(lr=1e-2, weight_decay=0.0, lr_scale={"b": 0.5}),
    "muon_adamw": lambda: flatopt.MuonAdamW(params={"w": (64, 32), "b": (32,)}, muon_names=["w"], lr=1e-2,
                                            lr_scale={"b": 0.5}),
    "adafactor8bit": lambda: flatopt.Adafactor8Bit(lr=1e-2, relative_step=False, beta1=0.9, min_8bit_size=0,
                                                   block_size=128, m_block_size=32, lr_scale={"b": 0.5}),
}


def _problem():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(64 * 32).astype(np.float32)
    b = np.zeros(32, np.float32)
    target = rng.standard_normal(64 * 32).astype(np.float32)
    return w, b, target


def _loop(opt, w, b, target, start, stop):
    """The Quickstart's loop body, steps ``start`` .. ``stop - 1``."""
    for step in range(start, stop):
        gw, gb = w - target, b - 1.0
        opt.step_batch([flatopt.OptItem("w", (64, 32), w, gw), flatopt.OptItem("b", (32,), b, gb)])
        opt.end_iteration()
        opt.set_lr(1e-2 * min(1.0, (step + 1) / WARMUP))  # warm-up through set_lr


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_the_quickstart_resumes_bit_for_bit_from_every_warmup_step(kind, tmp_path):
    make = MAKERS[kind]
    w, b, target = _problem()
    _loop(make(), w, b, target, 0, STEPS)
    for k in range(1, WARMUP + 1):
        w2, b2, _ = _problem()
        opt = make()
        _loop(opt, w2, b2, target, 0, k)
        flatopt.save(tmp_path / "ckpt.npz", opt)
        opt2 = make()
        assert opt2.load_state_dict(flatopt.load(tmp_path / "ckpt.npz"))
        assert opt2.lr == opt.lr == 1e-2 * min(1.0, k / WARMUP)
        _loop(opt2, w2, b2, target, k, STEPS)
        assert_bits_equal(w2, w, f"{kind}: w, resumed after step {k}")
        assert_bits_equal(b2, b, f"{kind}: b, resumed after step {k}")


def test_the_readme_resumes_with_the_same_arguments():
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quickstart"):]
    quick = quick[: quick.index("\n## ", 4)]
    assert 'opt = flatopt.AdamW(lr=1e-2, weight_decay=0.0, lr_scale={"b": 0.5})' in quick
    assert 'opt2 = flatopt.AdamW(lr=1e-2, weight_decay=0.0, lr_scale={"b": 0.5})' in quick


def _stepped(lr_in_effect):
    opt = flatopt.AdamW(lr=0.01, weight_decay=0.0)
    opt.step("w", (3,), np.zeros(3, np.float32), np.ones(3, np.float32))
    opt.set_lr(lr_in_effect)
    return opt


def test_the_notes_tell_the_truth_about_the_lr():
    st = _stepped(0.005).state_dict()
    assert st.extra["lr"] == 0.005
    a = flatopt.AdamW(lr=0.01, weight_decay=0.1)
    assert a.load_state_dict(st) is True and a.lr == 0.005
    assert a.last_load_notes == ["weight_decay: kept 0.1 (snapshot had 0.0)",
                                 "lr: set to 0.005, the learning rate in effect when the snapshot was taken (this "
                                 "object had 0.01)"]
    b = flatopt.AdamW(lr=0.01, weight_decay=0.1)
    assert b.load_state_dict(st, restore_hparams=True) is True and b.lr == 0.005 and b.config.weight_decay == 0.0
    assert "kept" not in " ".join(b.last_load_notes)
    assert "weight_decay: restored 0.0 from the snapshot (this object had 0.1)" in b.last_load_notes
    assert any(n.startswith("lr: set to 0.005") for n in b.last_load_notes)


def test_a_snapshot_without_the_recorded_lr_keeps_todays_behaviour():
    """Written before ``extra["lr"]`` existed: the lr stays this object's (a note says so), unless
    ``restore_hparams`` (then the snapshot's configuration lr, as before)."""
    st = _stepped(0.005).state_dict()
    del st.extra["lr"]
    a = flatopt.AdamW(lr=0.01, weight_decay=0.0)
    assert a.load_state_dict(st) is True and a.lr == 0.01
    assert a.last_load_notes == ["lr: kept 0.01 (snapshot had 0.005)"]
    b = flatopt.AdamW(lr=0.01, weight_decay=0.0)
    assert b.load_state_dict(st, restore_hparams=True) is True and b.lr == 0.005
    assert b.last_load_notes == ["lr: restored 0.005 from the snapshot (this object had 0.01)"]


def test_muon_adamw_restores_both_group_lrs():
    make = MAKERS["muon_adamw"]
    a = make()
    w, b, target = _problem()
    _loop(a, w, b, target, 0, 3)
    c = make()
    assert c.load_state_dict(a.state_dict()) is True
    assert (c.lr, c.muon.lr, c.adamw.lr) == (a.lr, a.muon.lr, a.adamw.lr) == (3e-3, 3e-3, 3e-3 * c.adamw_lr_ratio)

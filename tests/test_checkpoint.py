"""Checkpoint files: round trip, no pickle, clear errors on bad files, atomic writes."""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest

import flatopt
from flatopt import CheckpointError

from .helpers import assert_states_equal, rng_arrays


def _trained(steps=3):
    opt = flatopt.AdamW(lr=0.01, amsgrad=True)
    params = {"w": ((4, 3), rng_arrays(0, (4, 3))), "emb/tok": ((5, 2), rng_arrays(1, (5, 2), np.float64))}
    for i in range(steps):
        for name, (shape, p) in params.items():
            opt.step(name, shape, p, rng_arrays(10 + i, shape, p.dtype))
        opt.end_iteration()
    return opt


def test_round_trip_keeps_every_byte(tmp_path):
    opt = _trained()
    flatopt.save(tmp_path / "c.npz", opt)
    loaded = flatopt.load(tmp_path / "c.npz")
    assert_states_equal(loaded, opt.state_dict())
    assert loaded.buffers["m/emb/tok"].dtype == np.float64  # arrays stored as written


def test_file_has_json_header_and_no_pickle(tmp_path):
    flatopt.save(tmp_path / "c.npz", _trained())
    with zipfile.ZipFile(tmp_path / "c.npz") as z:
        names = z.namelist()
        assert "header.npy" in names
    with np.load(tmp_path / "c.npz", allow_pickle=False) as z:  # would raise on any object array
        header = json.loads(z["header"].tobytes())
        for f in z.files:
            z[f]
    assert header["format"] == "flatopt-checkpoint" and header["format_version"] == 1
    assert header["algorithm"] == "adamw" and header["config"]["amsgrad"] is True


def test_truncated_file_gives_clear_error(tmp_path):
    path = tmp_path / "c.npz"
    flatopt.save(path, _trained())
    data = path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 5):
        (tmp_path / "t.npz").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|corrupted|not a flatopt"):
            flatopt.load(tmp_path / "t.npz")


def test_foreign_files_give_clear_errors(tmp_path):
    np.savez(tmp_path / "foreign.npz", x=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a flatopt checkpoint"):
        flatopt.load(tmp_path / "foreign.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(CheckpointError):
        flatopt.load(tmp_path / "text.npz")
    header = np.frombuffer(json.dumps({"format": "flatopt-checkpoint", "format_version": 99}).encode(), np.uint8)
    np.savez(tmp_path / "newer.npz", header=header)
    with pytest.raises(CheckpointError, match="format version 99"):
        flatopt.load(tmp_path / "newer.npz")
    with pytest.raises(FileNotFoundError):
        flatopt.load(tmp_path / "missing.npz")


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    flatopt.save(path, _trained(1))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        flatopt.save(path, _trained(2))
    assert path.read_bytes() == before  # the old checkpoint is intact
    assert os.listdir(tmp_path) == ["c.npz"]  # no temporary file left behind


def test_load_reports_kept_hyperparameters():
    a = _trained()
    b = flatopt.AdamW(lr=0.5, amsgrad=True, weight_decay=0.0)
    assert b.load_state_dict(a.state_dict()) is True
    # the lr in effect is training state (restored); a constructor hyper-parameter is kept and reported
    assert b.lr == 0.01 and b.config.weight_decay == 0.0
    assert "weight_decay: kept 0.0 (snapshot had 0.01)" in b.last_load_notes
    assert any(n.startswith("lr: set to 0.01") and "had 0.5" in n for n in b.last_load_notes)
    c = flatopt.AdamW(lr=0.5, amsgrad=True, weight_decay=0.0)
    assert c.load_state_dict(a.state_dict(), restore_hparams=True) is True
    assert c.lr == 0.01 and c.config.weight_decay == 0.01
    assert "weight_decay: restored 0.01 from the snapshot (this object had 0.0)" in c.last_load_notes
    assert not any("kept" in n for n in c.last_load_notes), c.last_load_notes


def test_config_that_matters_refuses_to_load():
    a = _trained()
    b = flatopt.AdamW(lr=0.01, amsgrad=False)
    assert b.load_state_dict(a.state_dict()) is False
    assert b.state_dict().params == {}


def test_loaded_state_then_shape_mismatch_raises():
    a = _trained()
    b = flatopt.AdamW(lr=0.01, amsgrad=True)
    assert b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="'w'.*shape"):
        b.step("w", (3, 4), rng_arrays(0, (3, 4)), rng_arrays(1, (3, 4)))


@pytest.mark.parametrize("content", [b"hello, not a checkpoint\n", b"", np.zeros(3).tobytes()],
                         ids=["text", "empty", "raw"])
def test_a_non_zip_file_is_not_a_flatopt_checkpoint(tmp_path, content):
    path = tmp_path / "c.npz"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="is not a flatopt checkpoint") as info:
        flatopt.load(path)
    assert "pickle" not in str(info.value)
    np.save(tmp_path / "a.npy", np.zeros(3))  # a .npy is not a zip either
    with pytest.raises(CheckpointError, match="is not a flatopt checkpoint"):
        flatopt.load(tmp_path / "a.npy")


def test_saving_into_a_missing_folder_names_the_folder(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError) as info:
        flatopt.save(missing / "c.npz", _trained(1))
    assert str(missing) in str(info.value) and ".tmp" not in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.name != "posix", reason="file modes and umask are POSIX")
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_file_mode_honours_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        flatopt.save(tmp_path / "c.npz", _trained(1))
        with open(tmp_path / "plain", "wb"):
            pass
    finally:
        os.umask(old)
    mode = os.stat(tmp_path / "c.npz").st_mode & 0o777
    assert mode == 0o666 & ~umask == os.stat(tmp_path / "plain").st_mode & 0o777


@pytest.mark.skipif(os.name != "posix", reason="folders are fsynced on POSIX only")
def test_the_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None))
        return real_fsync(fd)

    def replace(a, b):
        calls.append(("replace", None))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    flatopt.save(tmp_path / "c.npz", _trained(1))
    kinds = [k for k, _ in calls]
    assert kinds == ["fsync", "replace", "fsync"]  # the file, the rename, then the folder
    if calls[-1][1] is not None:
        assert calls[-1][1] is True and calls[0][1] is False

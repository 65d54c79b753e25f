"""Checkpoint files: round trip, no pickle, clear errors on bad files, atomic writes."""

from __future__ import annotations

import json
import os
import re
import textwrap
import zipfile
from pathlib import Path

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


# ------------------------------------------------------------------------------------ hostile files (audit D5, D6)
def _members(path):
    """``{member name: bytes}`` and the parsed JSON header of a checkpoint."""
    import io

    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    return members, json.loads(np.load(io.BytesIO(members["header.npy"])).tobytes())


def _npy(a) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _write(path, members, header=None, compress=None):
    """A zip of ``members`` (the header replaced by ``header`` when given), stored unless ``compress`` names
    members to deflate."""
    if header is not None:
        members = {**members, "header.npy": _npy(np.frombuffer(json.dumps(header).encode(), np.uint8))}
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data, zipfile.ZIP_DEFLATED if compress and n in compress else zipfile.ZIP_STORED)
    return path


def _load_peak(path):
    """``(exception or None, peak bytes traced)`` of ``flatopt.load(path)`` (NumPy reports to tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        flatopt.load(path)
        err = None
    except Exception as exc:  # noqa: BLE001
        err = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return err, peak


def _npy_header(dtype, shape) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                               "shape": tuple(shape)})
    return buf.getvalue()


def test_a_zip_bomb_member_is_refused_with_bounded_memory(tmp_path):
    """A deflated member of zeros whose header entry matches (audit D5: 5 MB loaded as 5 GiB): refused before it is
    inflated, memory bounded (here 256 MiB inflated from about 256 KB)."""
    n = 64 << 20  # float32 elements: 256 MiB
    members, header = _members(_save_trained(tmp_path))
    header["buffers"] = [{"key": "m/w", "member": "a0", "dtype": "<f4", "shape": [n]}]
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("header.npy", _npy(np.frombuffer(json.dumps(header).encode(), np.uint8)))
        info = zipfile.ZipInfo("a0.npy")
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            f.write(_npy_header("<f4", (n,)))
            chunk = bytes(1 << 20)
            for _ in range(n * 4 // len(chunk)):
                f.write(chunk)
    assert path.stat().st_size < 2 << 20
    err, peak = _load_peak(path)
    assert isinstance(err, CheckpointError) and "compressed" in str(err) and str(path) in str(err), err
    assert peak < 16 << 20, peak


def test_an_inflating_header_is_refused(tmp_path):
    """A deflated header of JSON padded with whitespace (audit D5: 1 MB became 2 GiB); a stored header above the
    cap is refused before it is read."""
    members, header = _members(_save_trained(tmp_path))
    text = json.dumps(header).encode() + b" " * (64 << 20)
    members["header.npy"] = _npy(np.frombuffer(text, np.uint8))
    path = _write(tmp_path / "fat.npz", members, compress={"header.npy"})
    err, peak = _load_peak(path)
    assert isinstance(err, CheckpointError) and "compressed" in str(err), err
    assert peak < 16 << 20, peak


def test_a_stored_header_above_the_cap_is_refused(tmp_path, monkeypatch):
    path = _save_trained(tmp_path)
    size = len(_members(path)[0]["header.npy"])
    monkeypatch.setattr(flatopt.checkpoint, "HEADER_MAX_BYTES", size // 2)
    with pytest.raises(CheckpointError, match="more than the .* allowed"):
        flatopt.load(path)


def test_an_npy_declaring_2_to_the_40_elements_is_refused_without_allocating(tmp_path):
    """audit D6: MemoryError from a 781-byte file."""
    members, header = _members(_save_trained(tmp_path))
    shape = [1 << 40]
    header["buffers"] = [{"key": "m/w", "member": "a0", "dtype": "<f4", "shape": shape}]
    members = {"header.npy": members["header.npy"], "a0.npy": _npy_header("<f4", shape) + bytes(16)}
    err, peak = _load_peak(_write(tmp_path / "huge.npz", members, header))
    assert isinstance(err, CheckpointError) and "need" in str(err), err
    assert peak < 4 << 20


def test_one_member_listed_twice_is_refused(tmp_path):
    """Each member is read once (a header listing one member under many keys would multiply the memory)."""
    members, header = _members(_save_trained(tmp_path))
    header["buffers"].append({**header["buffers"][0], "key": "other/w"})
    with pytest.raises(CheckpointError, match=r"buffers\[\d+\]"):
        flatopt.load(_write(tmp_path / "twice.npz", members, header))


@pytest.mark.parametrize("missing", ["algorithm", "config", "config_key", "step", "params", "extra", "buffers"])
def test_a_header_without_a_field_is_a_checkpoint_error(tmp_path, missing):
    """audit D6: ``KeyError: 'algorithm'`` (read outside the try)."""
    members, header = _members(_save_trained(tmp_path))
    del header[missing]
    with pytest.raises(CheckpointError, match=f"no '{missing}'"):
        flatopt.load(_write(tmp_path / "h.npz", members, header))


def test_a_deeply_nested_header_is_a_checkpoint_error(tmp_path):
    """audit D6: ``RecursionError`` from JSON nested 100,000 deep; nesting past the bound inside a field too."""
    members, header = _members(_save_trained(tmp_path))
    members["header.npy"] = _npy(np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8))
    with pytest.raises(CheckpointError, match="nested too deep"):
        flatopt.load(_write(tmp_path / "deep.npz", members))
    deep: list = []
    for _ in range(200):
        deep = [deep]
    header["extra"] = {"x": deep}
    with pytest.raises(CheckpointError, match="'extra' nests deeper"):
        flatopt.load(_write(tmp_path / "deep2.npz", members, header))


def _central(data: bytes, field_offset: int, value: int, nbytes: int = 2) -> bytes:
    """``data`` with a field of every central-directory entry set to ``value``."""
    out = bytearray(data)
    at = out.find(b"PK\x01\x02")
    while at >= 0:
        out[at + field_offset: at + field_offset + nbytes] = value.to_bytes(nbytes, "little")
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


@pytest.mark.parametrize("what,offset,value,words", [
    ("compression method", 10, 99, "compressed"),  # audit D6: NotImplementedError
    ("version needed", 6, 0x40, "truncated or corrupted.*version"),  # audit D6: NotImplementedError
    ("encryption flag", 8, 1, "encrypted"),  # audit D6: RuntimeError "... is encrypted"
])
def test_central_directory_alterations_are_checkpoint_errors(tmp_path, what, offset, value, words):
    path = _save_trained(tmp_path)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(_central(path.read_bytes(), offset, value))
    try:
        flatopt.load(bad)
    except CheckpointError as exc:
        assert str(bad) in str(exc) and re.search(words, str(exc)), exc
    else:
        pytest.fail(f"{what} altered: loaded")


def test_every_byte_flip_of_the_central_directory_is_refused_or_changes_nothing(tmp_path):
    path = _save_trained(tmp_path)
    data = path.read_bytes()
    good = flatopt.load(path)
    start = data.find(b"PK\x01\x02")
    bad = tmp_path / "flip.npz"
    for i in range(start, len(data)):
        for flip in (0xFF, 0x01):
            mutated = bytearray(data)
            mutated[i] ^= flip
            bad.write_bytes(bytes(mutated))
            try:
                st = flatopt.load(bad)
            except CheckpointError:
                continue
            assert_states_equal(st, good)


def _save_trained(tmp_path, steps=1):
    path = tmp_path / "c.npz"
    flatopt.save(path, _trained(steps))
    return path


# ------------------------------------------------------------------------------ temporaries of killed saves (D11)
def _tmp_name(target: str, pid: int, host: str | None = None, rand: str = "abcd1234") -> str:
    return f".{target}.flatopt-{pid}@{host or flatopt.checkpoint._HOST}-{rand}.tmp"  # noqa: SLF001


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.skipif(os.name != "posix", reason="process liveness is checked on POSIX")
def test_save_removes_only_its_targets_stale_temporaries(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    old = 1_000_000_000  # an mtime far in the past
    files = {
        _tmp_name("c.npz", dead): False,  # a killed save of this target: removed
        _tmp_name("c.npz", dead, rand="zz_99xyz"): False,
        _tmp_name("c.npz", alive): True,  # a save in progress in another process: kept
        _tmp_name("c.npz", os.getpid()): True,  # (this process: another thread may be saving)
        _tmp_name("d.npz", dead): True,  # another target: kept
        _tmp_name("c.npz", dead, host="otherhost"): True,  # another host, recent: kept
        ".c.npz.abcd1234.tmp": True,  # not our pattern: kept
        "c.npz.flatopt-1@x-abcd1234.tmp": True,
    }
    stale_foreign = _tmp_name("c.npz", dead, host="otherhost", rand="old12345")
    files[stale_foreign] = False  # another host's, unchanged for long: removed
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / stale_foreign, (old, old))
    flatopt.save(tmp_path / "c.npz", _trained(1))
    left = set(os.listdir(tmp_path))
    assert left == {"c.npz"} | {n for n, keep in files.items() if keep}


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_a_save_killed_mid_write_leaves_a_temporary_the_next_save_removes(tmp_path):
    """audit D11: kill -9 during ``save`` left orphaned ``.tmp`` files that nothing removed."""
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import os, time, numpy as np, flatopt
        real = np.savez
        def stall(f, **arrays):
            real(f, **arrays)
            f.flush()
            open({str(ready)!r}, "w").close()
            time.sleep(60)
        np.savez = stall
        opt = flatopt.AdamW()
        opt.step("w", (1000,), np.zeros(1000, np.float32), np.ones(1000, np.float32))
        flatopt.save({str(tmp_path / "c.npz")!r}, opt)
    """)
    p = subprocess.Popen([sys.executable, "-c", child], cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the child did not reach the write"
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    ready.unlink()
    litter = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(litter) == 1 and "c.npz" not in os.listdir(tmp_path)
    flatopt.save(tmp_path / "c.npz", _trained(1))
    assert sorted(os.listdir(tmp_path)) == ["c.npz"]

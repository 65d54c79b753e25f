"""Checkpoint files: one ``.npz`` file, no pickle, a JSON header, arrays stored exactly as the optimizer holds them.

Layout: the zip member ``header`` is a UTF-8 JSON document (as a uint8 array) with ``format`` =
``"flatopt-checkpoint"``, ``format_version``, ``algorithm``, ``config``, ``config_key``, ``step``, ``params``,
``extra`` and ``buffers``, a list of ``{"key", "member", "dtype", "shape"}``; each buffer is the member ``a<i>``.
A bfloat16 buffer (a Kahan compensation of bfloat16 parameters) is stored as its uint16 bits with ``"dtype":
"bfloat16"`` in its entry, and read back as ``ml_dtypes.bfloat16`` (imported then; a clear error names the extra
where it is absent).
CuPy arrays are copied to the host when saved; ``load`` returns NumPy arrays, which an optimizer moves to the
backend of the parameter at its next step, so a checkpoint moves freely between NumPy and CuPy.

``save`` writes a temporary file in the target folder, flushes it to disk, renames it over the target and flushes
the folder (POSIX), so a crash never leaves a half-written checkpoint under the target name.  The temporary is named
``.<target>.flatopt-<pid>@<host>-<random>.tmp``; a save removes those of the same target that a killed process
left (``_remove_stale_temporaries``).  The file gets the mode a plain ``open`` would give it (``0o666`` minus the
umask).  ``save`` refuses a malformed snapshot (``ValueError`` naming the field).

``load`` raises :class:`CheckpointError`, naming the file and the reason, for anything but a well-formed checkpoint:
not a zip archive ("is not a flatopt checkpoint"), truncated or corrupted, encrypted or compressed members, a header
without a field or with a malformed snapshot.  Its memory is bounded by the file's size: members must be stored
uncompressed, each is read once, its size is checked against its declared shape and dtype before anything of that
size is allocated, and the JSON header is capped (``HEADER_MAX_BYTES``) and its nesting bounded.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import socket
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .core import backend
from .core.types import FORMAT_VERSION, Optimizer, OptimizerState
from .core.validate import check_snapshot_fields
from .errors import IncompatibleStateError

MAGIC = "flatopt-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupted, foreign or of an unsupported format version."""


def save(path: str | os.PathLike[str], optimizer_or_state: Optimizer | OptimizerState) -> None:
    """Write the optimizer's ``state_dict()`` (or an ``OptimizerState``) to ``path`` atomically."""
    if isinstance(optimizer_or_state, OptimizerState):
        state = optimizer_or_state
    else:
        snapshot = optimizer_or_state.state_dict()
        if snapshot is None:
            raise ValueError(f"{type(optimizer_or_state).__name__} cannot be checkpointed")
        state = snapshot
    try:
        check_snapshot_fields(state)
    except IncompatibleStateError as exc:
        raise ValueError(f"{os.fspath(path)}: refusing to save a malformed snapshot ({exc})") from None
    arrays: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    for i, key in enumerate(sorted(state.buffers)):
        a = np.ascontiguousarray(backend.to_numpy(state.buffers[key]))
        bf16 = a.dtype.name == "bfloat16"
        arrays[f"a{i}"] = a.view(np.uint16) if bf16 else a
        entries.append({"key": key, "member": f"a{i}", "dtype": "bfloat16" if bf16 else a.dtype.str,
                        "shape": list(a.shape)})
    header = {
        "format": MAGIC,
        "format_version": state.format_version,
        "algorithm": state.algorithm,
        "config": state.config,
        "config_key": state.config_key,
        "step": state.step,
        "params": state.params,
        "extra": state.extra,
        "buffers": entries,
    }
    arrays["header"] = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot save checkpoint {str(path)!r}: the folder {str(folder)!r} does not exist "
                                f"(create it first, e.g. Path(...).mkdir(parents=True))")
    _remove_stale_temporaries(folder, path.name)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.flatopt-{os.getpid()}@{_HOST}-", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # the mode a plain open() would give (mkstemp makes 0600)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)


# The temporary file of a save is ".<target name>.flatopt-<pid>@<host>-<random>.tmp" in the target's folder, so
# that the next save of the same target can tell its own litter (a process killed mid-save) from anything else.
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
# A temporary of another host (a shared filesystem) is removed once it has not changed for this long.
STALE_FOREIGN_SECONDS = 24 * 3600


def _remove_stale_temporaries(folder: Path, name: str) -> None:
    """Remove the temporaries earlier saves of ``folder/name`` left behind when killed: only files of our pattern
    for this very target, written on this host by a process that no longer runs (POSIX; elsewhere, and for
    another host's, once unchanged for ``STALE_FOREIGN_SECONDS``).  Another process's save in progress is never
    touched; failures to list or remove are ignored (the save itself goes on)."""
    pattern = re.compile(re.escape(f".{name}.flatopt-") + r"(\d+)@([A-Za-z0-9_.]+)-[A-Za-z0-9_]+\.tmp\Z")
    now = time.time()
    try:
        with os.scandir(folder) as it:
            entries = [(e, m) for e in it if (m := pattern.match(e.name))]
    except OSError:
        return
    for e, m in entries:
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            pid, host = int(m[1]), m[2]
            if host == _HOST and os.name == "posix":
                stale = pid != os.getpid() and not _running(pid)
            else:
                stale = now - e.stat(follow_symlinks=False).st_mtime > STALE_FOREIGN_SECONDS
            if stale:
                os.unlink(e.path)
        except OSError:
            pass


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (POSIX: signal 0 only checks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (e.g. another user's process: it exists)
        return True
    return True


def _umask() -> int:
    """The process umask: from ``/proc/self/status`` where Linux shows it, else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    """Flush the folder entry of the renamed file to disk (POSIX; Windows cannot open a folder for this)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The largest header member ``load`` reads (its JSON): far above any optimizer's (a few KiB per thousand names).
HEADER_MAX_BYTES = 64 << 20
# The npy preamble of a member (magic, version, header length, the dict describing the array) is at most this long.
_NPY_PREAMBLE_MAX = 1 << 16


def load(path: str | os.PathLike[str]) -> OptimizerState:
    """Read a checkpoint written by ``save``; ``CheckpointError`` names the file and what is wrong with a bad one
    (truncated, corrupted, foreign, encrypted or compressed members, a newer format version, a malformed header or
    snapshot).  Memory stays bounded by the file: every member must be stored (``save`` never compresses), each
    array's size is checked against its declared shape and dtype before it is read, the JSON header is capped at
    ``HEADER_MAX_BYTES`` and its nesting depth bounded."""
    path = Path(path)
    with open(path, "rb") as f:  # (FileNotFoundError/IsADirectoryError as open() raises them)
        magic = f.read(4)
        f.seek(0, os.SEEK_END)
        file_size = f.tell()
    if magic != b"PK\x03\x04" and magic != b"PK\x05\x06":  # a zip file (empty zip: end-of-directory record)
        raise CheckpointError(f"{path}: is not a flatopt checkpoint (not a .npz/zip file; flatopt.save writes one)")
    try:
        with zipfile.ZipFile(path) as z:
            members = {info.filename: info for info in z.infolist()}
            if "header.npy" not in members:
                raise CheckpointError(f"{path}: not a flatopt checkpoint (no header)")
            raw = _read_member(z, members["header.npy"], file_size, np.dtype(np.uint8), None, HEADER_MAX_BYTES)
            try:
                header = json.loads(raw.tobytes().decode())
            except RecursionError:
                raise CheckpointError(f"{path}: corrupted header (JSON nested too deep)") from None
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{path}: corrupted header ({exc})") from None
            if not isinstance(header, dict) or header.get("format") != MAGIC:
                raise CheckpointError(f"{path}: not a flatopt checkpoint")
            version = header.get("format_version")
            if version != FORMAT_VERSION:
                raise CheckpointError(
                    f"{path}: format version {version!r} is not supported (this flatopt reads {FORMAT_VERSION})"
                )
            missing = [k for k in ("algorithm", "config", "config_key", "step", "params", "extra", "buffers")
                       if k not in header]
            if missing:
                raise CheckpointError(f"{path}: malformed header (no {', '.join(map(repr, missing))})")
            entries = header["buffers"]
            if not isinstance(entries, list):
                raise CheckpointError(f"{path}: malformed header ('buffers' is not a list)")
            buffers = {}
            used: set[str] = set()  # each member read once: memory stays bounded by the file's size
            for i, e in enumerate(entries):
                key, member, dtype, shape = _entry(e)
                if key is None or f"{member}.npy" not in members or key in buffers or member in used or (
                        member == "header"):
                    raise CheckpointError(f"{path}: malformed header (buffers[{i}] is not a distinct "
                                          f"{{key, member, dtype, shape}} entry of a member of the file)")
                used.add(member)
                try:
                    buffers[key] = _read_member(z, members[f"{member}.npy"], file_size, dtype, shape)
                    if e["dtype"] == "bfloat16":
                        buffers[key] = buffers[key].view(_bfloat16(path))
                except _Mismatch as exc:
                    raise CheckpointError(f"{path}: buffer {key!r} does not match its header entry ({exc})") from None
            state = OptimizerState(
                algorithm=header["algorithm"],
                config=header["config"],
                config_key=header["config_key"],
                step=header["step"],
                params=header["params"],
                buffers=buffers,
                extra=header["extra"],
                format_version=version,
            )
            check_snapshot_fields(state)
    except CheckpointError:
        raise
    except IncompatibleStateError as exc:
        raise CheckpointError(f"{path}: malformed snapshot ({exc})") from None
    except _Mismatch as exc:
        raise CheckpointError(f"{path}: malformed header member ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - zipfile, numpy and json raise many types on a corrupted file
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint ({type(exc).__name__}: {exc})") from None
    return state


class _Mismatch(ValueError):
    """A member is not the array its header entry (or the header member's own rules) declares."""


def _bfloat16(path: Any) -> np.dtype:
    """``ml_dtypes.bfloat16``'s dtype, or :class:`CheckpointError` saying which extra reads ``path``."""
    try:
        import ml_dtypes
    except ImportError:
        raise CheckpointError(f"{path}: holds bfloat16 buffers, which need ml_dtypes (pip install "
                              f"'flatopt[lowp]')") from None
    dt: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dt


def _entry(e: Any) -> tuple[Any, str, np.dtype, tuple[int, ...]]:
    """``(key, member, dtype, shape)`` of a header ``buffers`` entry (``key`` None when it is malformed; a
    ``"bfloat16"`` entry is read as its uint16 bits)."""
    bad = (None, "", np.dtype(np.uint8), ())
    if not isinstance(e, dict):
        return bad
    key, member, dtype, shape = e.get("key"), e.get("member"), e.get("dtype"), e.get("shape")
    if not (isinstance(key, str) and isinstance(member, str) and isinstance(dtype, str) and isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        return bad
    if dtype == "bfloat16":
        return key, member, np.dtype("<u2"), tuple(shape)
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        return bad
    if dt.hasobject or dt.kind not in "biufc" or dt.str != dtype:
        return bad
    return key, member, dt, tuple(shape)


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, file_size: int, dtype: np.dtype,
                 shape: tuple[int, ...] | None, max_bytes: int | None = None) -> np.ndarray:
    """The array of one ``.npy`` member, after checking (before any allocation of its size) that the member is
    stored and not encrypted, lies inside the file, and that its npy header declares ``dtype`` and ``shape``
    (``None``: any 1-D shape, at most ``max_bytes``) with exactly the bytes the member holds."""
    if info.flag_bits & 0x1:
        raise _Mismatch(f"member {info.filename!r} is encrypted")
    if info.compress_type != zipfile.ZIP_STORED:
        raise _Mismatch(f"member {info.filename!r} is compressed (method {info.compress_type}); flatopt.save "
                        f"stores members uncompressed")
    if info.compress_size != info.file_size or info.header_offset + info.file_size > file_size:
        raise _Mismatch(f"member {info.filename!r} declares {info.file_size} bytes, more than the file holds")
    with z.open(info) as member:
        f: Any = member  # (a ZipExtFile: it has readinto)
        preamble = f.read(min(info.file_size, _NPY_PREAMBLE_MAX))
        bio = io.BytesIO(preamble)
        major, _ = np.lib.format.read_magic(bio)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        got_shape, fortran, got_dtype = read_header(bio)
        if got_dtype != dtype or got_dtype.hasobject:
            raise _Mismatch(f"dtype {got_dtype} in the member, {dtype} declared")
        if shape is None:
            if len(got_shape) != 1:
                raise _Mismatch(f"shape {got_shape} in the member, a 1-D array expected")
        elif tuple(got_shape) != shape:
            raise _Mismatch(f"shape {tuple(got_shape)} in the member, {shape} declared")
        if fortran and len(got_shape) > 1:
            raise _Mismatch("a Fortran-ordered array (flatopt.save writes C order)")
        nbytes = math.prod(got_shape) * dtype.itemsize
        if max_bytes is not None and nbytes > max_bytes:
            raise _Mismatch(f"member {info.filename!r} holds {nbytes} bytes, more than the {max_bytes} allowed")
        if bio.tell() + nbytes != info.file_size:
            raise _Mismatch(f"member {info.filename!r} holds {info.file_size - bio.tell()} data bytes, its shape and "
                            f"dtype need {nbytes}")
        out = np.empty(got_shape, dtype)
        view = out.reshape(-1).view(np.uint8).data  # (a memoryview of out's bytes)
        head = preamble[bio.tell():]
        view[: len(head)] = head
        pos = len(head)
        while pos < nbytes:
            n = f.readinto(view[pos: pos + (16 << 20)])  # (in pieces: no second copy of a large member)
            if not n:
                raise EOFError(f"member {info.filename!r} ends early")
            pos += n
        if f.read(1):  # (reading to the end also checks the member's CRC)
            raise _Mismatch(f"member {info.filename!r} is longer than its header says")
    return out

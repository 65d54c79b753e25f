"""Checkpoint files: one ``.npz`` file, no pickle, a JSON header, arrays stored exactly as the optimizer holds them.

Layout: the zip member ``header`` is a UTF-8 JSON document (as a uint8 array) with ``format`` =
``"flatopt-checkpoint"``, ``format_version``, ``algorithm``, ``config``, ``config_key``, ``step``, ``params``,
``extra`` and ``buffers``, a list of ``{"key", "member", "dtype", "shape"}``; each buffer is the member ``a<i>``.
CuPy arrays are copied to the host when saved; ``load`` returns NumPy arrays, which an optimizer moves to the
backend of the parameter at its next step, so a checkpoint moves freely between NumPy and CuPy.

``save`` writes a temporary file in the target folder, flushes it to disk, renames it over the target and flushes
the folder (POSIX), so a crash never leaves a half-written checkpoint under the target name.  The file gets the
mode a plain ``open`` would give it (``0o666`` minus the umask).  ``load`` refuses a file that is not a zip
archive with :class:`CheckpointError` ("is not a flatopt checkpoint").
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .core import backend
from .core.types import FORMAT_VERSION, Optimizer, OptimizerState

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
    arrays: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    for i, key in enumerate(sorted(state.buffers)):
        a = np.ascontiguousarray(backend.to_numpy(state.buffers[key]))
        arrays[f"a{i}"] = a
        entries.append({"key": key, "member": f"a{i}", "dtype": a.dtype.str, "shape": list(a.shape)})
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
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


def load(path: str | os.PathLike[str]) -> OptimizerState:
    """Read a checkpoint written by ``save``; ``CheckpointError`` names what is wrong with a bad file."""
    path = Path(path)
    with open(path, "rb") as f:  # (FileNotFoundError/IsADirectoryError as open() raises them)
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic != b"PK\x05\x06":  # a zip file (empty zip: end-of-directory record)
        raise CheckpointError(f"{path}: is not a flatopt checkpoint (not a .npz/zip file; flatopt.save writes one)")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "header" not in z.files:
                raise CheckpointError(f"{path}: not a flatopt checkpoint (no header)")
            try:
                header = json.loads(z["header"].tobytes().decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{path}: corrupted header ({exc})") from None
            if not isinstance(header, dict) or header.get("format") != MAGIC:
                raise CheckpointError(f"{path}: not a flatopt checkpoint")
            version = header.get("format_version")
            if version != FORMAT_VERSION:
                raise CheckpointError(
                    f"{path}: format version {version!r} is not supported (this flatopt reads {FORMAT_VERSION})"
                )
            buffers = {}
            for e in header["buffers"]:
                a = z[e["member"]]
                if a.dtype.str != e["dtype"] or list(a.shape) != e["shape"]:
                    raise CheckpointError(f"{path}: buffer {e['key']!r} does not match its header entry")
                buffers[e["key"]] = a
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint ({type(exc).__name__}: {exc})") from None
    return OptimizerState(
        algorithm=header["algorithm"],
        config=header["config"],
        config_key=header["config_key"],
        step=header["step"],
        params=header["params"],
        buffers=buffers,
        extra=header["extra"],
        format_version=version,
    )

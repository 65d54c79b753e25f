"""Checkpoint files: one ``.npz`` file, no pickle, a JSON header, arrays stored exactly as the optimizer holds them.

Layout: the zip member ``header`` is a UTF-8 JSON document (as a uint8 array) with ``format`` =
``"flatopt-checkpoint"``, ``format_version``, ``algorithm``, ``config``, ``config_key``, ``step``, ``params``,
``extra`` and ``buffers``, a list of ``{"key", "member", "dtype", "shape"}``; each buffer is the member ``a<i>``.
CuPy arrays are copied to the host when saved; ``load`` returns NumPy arrays, which an optimizer moves to the
backend of the parameter at its next step, so a checkpoint moves freely between NumPy and CuPy.

``save`` writes a temporary file in the target folder, flushes it to disk and renames it over the target, so a
crash never leaves a half-written checkpoint under the target name.
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
from .core.types import FORMAT_VERSION, OptimizerState

MAGIC = "flatopt-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint file is truncated, corrupted, foreign or of an unsupported format version."""


def save(path: str | os.PathLike, optimizer_or_state: Any) -> None:
    """Write the optimizer's ``state_dict()`` (or an ``OptimizerState``) to ``path`` atomically."""
    state = optimizer_or_state
    if not isinstance(state, OptimizerState):
        state = optimizer_or_state.state_dict()
        if state is None:
            raise ValueError(f"{type(optimizer_or_state).__name__} cannot be checkpointed")
    arrays, entries = {}, []
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
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


def load(path: str | os.PathLike) -> OptimizerState:
    """Read a checkpoint written by ``save``; ``CheckpointError`` names what is wrong with a bad file."""
    path = Path(path)
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

"""Command-line helpers shared by the examples: argument types that reject bad values up front (argparse turns the
``ArgumentTypeError`` into a usage message and exit code 2), a help formatter that shows the defaults, an output
path checked before any training starts, and the BLAS thread cap of the hand-written NumPy models."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the module docstring's layout and appends ``(default: ...)`` to every option's help."""


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 0")
    return value


def name_list(choices):
    """A comma-separated subset of ``choices`` (or ``all``), as a list in the order given."""

    def parse(text: str) -> list[str]:
        if text == "all":
            return list(choices)
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or [text]}; choose from {list(choices)} or 'all'")
        return names

    return parse


def check_output(ap: argparse.ArgumentParser, path: str, option: str) -> None:
    """Exit with a usage error (code 2) now, before training, if ``path`` cannot be written later."""
    if not path:
        return
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        ap.error(f"{option} {path}: is a folder; give a file name")
    if not folder.is_dir():
        ap.error(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        ap.error(f"{option} {path}: not writable")


def blas_single_thread():
    """A context that holds the BLAS libraries at one thread, when ``threadpoolctl`` is installed (else a no-op).

    The examples' models are small hand-written NumPy MLPs: their matrix products (64 × 128) are far too small for
    OpenBLAS's threads, which then spin against flatopt's own worker threads on the same cores: on two cores the
    main job ran several times slower with the BLAS on two threads than on one (benchmarks/README.md, "The main
    job").  Holding one thread also
    makes the results independent of the BLAS thread count (a threaded GEMM may sum in another order).
    ``OPENBLAS_NUM_THREADS=1`` in the environment has the same effect without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")

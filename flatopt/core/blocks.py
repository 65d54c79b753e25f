"""The blocked layout and the phase runner of the per-tensor statistics optimizers (Adafactor, Adafactor8Bit).

A tensor's flat buffers are cut into cache-sized *blocks* (``blocks``: whole matrices or ranges of rows of a
(B, r, c) view; ``flat_blocks`` for vectors), blocks into *tasks* of consecutive blocks (``runs``, ``plan``), and a
step is a generator of *phases*: lists of ``(cost, fn)`` tasks over disjoint ranges that may run on any thread, with
the small serial work between them done by the generator itself.  ``run_phased`` runs the phases of many steps
together (one barrier per phase), ``run_serial`` one step inline.  Every per-block reduction goes to its own slot and
is folded in block order (``fold``), so the bits do not depend on the threads.  The layout depends only on the
shape (and on ``BLOCK``, read at call time).  On CuPy a tensor is one block (``limit``).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import parallel, workspace

# Elements per block on NumPy: 1 MiB of float32.  Two threads hand NumPy's GIL over at every call, so longer calls
# scale better over the threads; that outweighs keeping a block's operands in a 2 MiB L2 cache, and longer blocks
# are slower again.  Re-measure (this constant and TASK at 128K/256K against 256K/512K):
# ``python -m benchmarks.threads_probe sizes``.
BLOCK = 1 << 18
# Elements per task of a blocked pass (a run of consecutive blocks handed to one thread at a time).
TASK = 1 << 19
# Elements of a merged run of consecutive blocks for the elementwise work of passes 2 and 3 (forming U, the update):
# bits unchanged, they are per element; every reduction (row and column sums, ΣU², Σθ²) stays per block.
SUPER = 1 << 17
# Elements of pass-1 column partials kept per name at most (the window of blocks whose partials are folded at once).
PARTS = 1 << 20


def factor_dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(B, r, c) of a factored shape: the last two dims are factored, the leading ones are a batch."""
    return math.prod(shape[:-2]), shape[-2], shape[-1]


@functools.lru_cache(maxsize=4096)
def blocks(bdim: int, r: int, c: int, limit: int, align: int = 1) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """Contiguous blocks ``(lo, hi, b0, b1, i0, i1)`` of a (B, r, c) tensor: whole matrices b0:b1 (rows 0:r) when a
    matrix fits in ``limit`` elements, otherwise rows i0:i1 of matrix b0 (b1 = b0 + 1).  With ``align``, the counts
    of matrices or rows per block are rounded to multiples that make the block starts multiples of ``align`` where
    that costs at most a block of 4·``limit`` elements (``aligned`` tells)."""
    out = []
    mat = r * c
    if mat <= limit:
        k = max(1, limit // max(mat, 1))
        step = align // math.gcd(mat, align) if mat else 1
        if step * mat <= 4 * limit:
            k = max(step, k // step * step)
        for b0 in range(0, bdim, k):
            b1 = min(b0 + k, bdim)
            out.append((b0 * mat, b1 * mat, b0, b1, 0, r))
    else:
        rows = max(1, limit // c)
        step = align // math.gcd(c, align)
        if step * c <= 4 * limit:
            rows = max(step, rows // step * step)
        for b in range(bdim):
            for i0 in range(0, r, rows):
                i1 = min(i0 + rows, r)
                out.append((b * mat + i0 * c, b * mat + i1 * c, b, b + 1, i0, i1))
    return tuple(out)


def aligned(bl, align: int) -> bool:
    return all(b[0] % align == 0 for b in bl)


@functools.lru_cache(maxsize=4096)
def flat_blocks(n: int, limit: int) -> tuple[tuple[int, int], ...]:
    return tuple((lo, min(lo + limit, n)) for lo in range(0, n, limit))


@functools.lru_cache(maxsize=4096)
def runs(sizes: tuple[int, ...], k0: int, k1: int, task: int) -> tuple[tuple[int, int, int], ...]:
    """``(cost, a, b)``: blocks k0:k1 cut into runs of consecutive blocks of about ``task`` elements."""
    out = []
    a, acc = k0, 0
    for k in range(k0, k1):
        acc += sizes[k]
        if acc >= task or k == k1 - 1:
            out.append((acc, a, k + 1))
            a, acc = k + 1, 0
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def block_sizes(bl: tuple) -> tuple[int, ...]:
    return tuple(b[1] - b[0] for b in bl)


def _mergeable(a, b, r: int) -> bool:
    if a[1] != b[0]:
        return False
    if a[4] == 0 and a[5] == r and b[4] == 0 and b[5] == r:  # whole matrices
        return True
    return a[2] == b[2] and a[3] == b[3] and a[5] == b[4]  # rows of one matrix


@functools.lru_cache(maxsize=1024)
def plan(bdim: int, r: int, c: int, limit: int, window: int, task: int, sup: int, align: int = 1):
    """The block schedule of a factored shape: ``(blocks, pass-1 runs per window, runs)``; a run is
    ``(cost, k0, k1, supers)`` and a super ``(lo, hi, b0, b1, i0, i1, ka, kb)`` covers blocks ka:kb (merged
    while they stay one contiguous 3-D view of at most ``sup`` elements)."""
    bl = blocks(bdim, r, c, limit, align)
    sizes = block_sizes(bl)

    def with_supers(rs):
        out = []
        for cost, k0, k1 in rs:
            supers = []
            ka = k0
            for k in range(k0 + 1, k1 + 1):
                if k < k1 and _mergeable(bl[k - 1], bl[k], r) and bl[k][1] - bl[ka][0] <= sup:
                    continue
                a, z = bl[ka], bl[k - 1]
                supers.append((a[0], z[1], a[2], z[3], a[4], z[5], ka, k))
                ka = k
            out.append((cost, k0, k1, tuple(supers)))
        return tuple(out)

    wins = tuple(with_supers(runs(sizes, base, min(base + window, len(bl)), task))
                 for base in range(0, len(bl), window))
    return bl, wins, with_supers(runs(sizes, 0, len(bl), task))


def limit(xp, n: int) -> int:
    return BLOCK if xp is np else max(n, 1)


def buffers(xp, size: int, dtype) -> tuple:
    if xp is np:
        return workspace.get(np, "adafactor.u", size, dtype), workspace.get(np, "adafactor.sq", size, dtype)
    return xp.empty(size, dtype), xp.empty(size, dtype)


def sumsq(xp, x, tmp):
    """Σx² of a block (``tmp`` is a scratch block of the same size; NumPy needs none: einsum writes nothing)."""
    if xp is np:
        return np.einsum("i,i->", x, x)
    if tmp is None:
        tmp = workspace.get(xp, "adafactor.sumsq", x.size, x.dtype)
    xp.multiply(x, x, out=tmp)
    return xp.sum(tmp)


def fold(parts: list, acc):
    """acc + parts[0] + parts[1] + ... in block order (the serial loop's order)."""
    for s in parts:
        acc = acc + s
    return acc


def fold_keyed(parts: dict):
    """The partials of ``parts`` (keyed by their range's start) added in key order, the first as the start: the
    order of the serial loop over the ranges, whichever threads made them."""
    first, *rest = (parts[k] for k in sorted(parts))
    return fold(rest, first)


def run_serial(phases) -> None:
    """Run one step's phases inline, in order."""
    for phase in phases:
        for _, fn in phase:
            fn()


def run_phased(steps: list, *, serial: bool = False, first: list | None = None) -> None:
    """Run the phases of many independent steps (``(name, phase generator)``) together: phase k of every step is
    one ``core.parallel.run_tasks`` call (a barrier), the serial work between phases runs on the caller; ``first``:
    other ``(cost, name, fn)`` tasks, run with the first phase."""
    active = steps
    tasks = list(first or ())
    while active or tasks:
        nxt = []
        for name, gen in active:
            try:
                phase = next(gen)
            except StopIteration:
                continue
            except Exception as exc:
                raise parallel.TaskError(f"parameter {name!r}: {type(exc).__name__}: {exc}") from exc
            for cost, fn in phase:
                tasks.append((cost, name, fn))
            nxt.append((name, gen))
        if tasks:
            parallel.run_tasks(tasks, serial=serial)
        active, tasks = nxt, []


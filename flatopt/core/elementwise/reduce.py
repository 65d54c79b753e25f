"""The reduce-then-map stage: a step that calls ``e.sum(x)`` becomes a reduce phase, a fold and a map.

A step may sum any per-element value over the tensor (``e.sum(x)``, ``e.sumsq(x)`` = ``e.sum(x * x)``) and keep
computing with the result: a per-tensor value.  :func:`split` cuts the traced program in three:

* **reduce**: the instructions the summands depend on, run per element; it writes the arrays whose new value it
  computes and that no sum changes (Lamb's m and v), and each summand j into the pseudo-array ``_sum<j>``;
* **the sums**: each ``_sum<j>`` added over the tensor in the fixed blocked order of ``core/sqsum.py`` (the same bits
  on NumPy, the C pass and CUDA: ``core/norms.py`` column sums, ``kernels/sq_sum.cuh``), rounded to the dtype;
* **fold**: the instructions on per-tensor values that depend on a sum, run once per tensor in the dtype (reads: the
  sums as ``_sum<j>``; outputs: the per-tensor scalars ``fold<k>`` the map reads);
* **map**: the rest, per element, with the fold's results as scalars; an array the reduce phase wrote is read back
  (its new value), everything else is recomputed from the inputs with the same operations (the same bits).

A sum of a value that depends on another sum is refused (one reduce phase per step).  Terms are values of the
dtype (a comparison's True is 1).  The blocked order pads with +0 and the kernels' per-thread sums start at +0, so
the sign of a zero sum whose terms are all −0 may differ between paths (sums of squares, of masks, never hit it).

This module also holds the NumPy/CuPy lowerings of a split program (``run.bind`` wraps them for a definition with a
sum): :func:`np_phases` (a tensor in two phases of tasks on the threads: column ranges of the reduce phase, then,
after the fold, chunk ranges of the map; ``core/cpu_tensors.py``), :func:`np_rows` (small tensors of one size as the
rows of (T, n) arrays, the sums per row) and :func:`xp_update` (one whole tensor on CuPy, no host synchronisation).
A definition with a sum keeps its sums' work area in its state's unsaved field ``work``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import numpy as np

from .. import cpu_plan, driver, native, norms, sqsum, workspace
from . import lower_numpy, trace as tr

CHUNK = driver.CHUNK  # elements per task of a phase when a whole tensor runs serially


@dataclasses.dataclass(frozen=True)
class Split:
    """One flag set's program cut at its sums (see the module docstring)."""

    reduce: tr.Program  # arrays: the definition's, then ``sums``; outputs: ``first`` arrays, then the summands
    sums: tuple  # the pseudo-array names "_sum0", ...
    fold: tr.Program  # reads the sums; outputs ("fold<k>", ref): the per-tensor scalars of the map
    map: tr.Program  # scalars: the definition's it uses, then the fold's outputs
    first: tuple  # the arrays the reduce phase writes

    @property
    def folds(self) -> tuple:
        return tuple(n for n, _ in self.fold.outputs)


def _sub(prog: tr.Program, outputs: list, stop: Callable[[tuple], Any], arrays: tuple, scalars: tuple,
         keep_same: bool = False) -> tr.Program:
    """The instructions ``outputs`` need, in their original order and renumbered; ``stop(ref)`` replaces a ref
    (an input of this part) or returns None."""
    need: set = set()
    todo = [r for _, r in outputs]
    while todo:
        ref = todo.pop()
        if stop(ref) is not None or ref[0] != "v" or ref[1] in need:
            continue
        need.add(ref[1])
        todo.extend(prog.instrs[ref[1]].args)
    renum: dict = {}

    def res(ref: tuple) -> tuple:
        s = stop(ref)
        if s is not None:
            return s
        return ("v", renum[ref[1]]) if ref[0] == "v" else ref

    new = []
    for k in sorted(need):
        ins = prog.instrs[k]
        new.append(tr.Instr(ins.op, tuple(res(a) for a in ins.args), ins.is_bool, ins.line))
        renum[k] = len(new) - 1
    outs = tuple((n, res(r)) for n, r in outputs)
    if not keep_same:
        outs = tuple((n, r) for n, r in outs if r != ("in", n))
    used = {r for i in new for r in i.args} | {r for _, r in outs}
    reads = tuple(a for a in arrays if ("in", a) in used)
    scal = tuple(k for k in scalars if ("s", k) in used)
    return tr.Program(prog.algo, prog.flags, tuple(new), outs, reads, scal)


def split(prog: tr.Program, arrays: tuple, scalar_names: tuple) -> Split | None:
    """The program cut at its sums, or None when it has none (``arrays``, ``scalar_names``: the definition's)."""
    ins = prog.instrs
    sums = [k for k, i in enumerate(ins) if i.op == "sum"]
    if not sums:
        return None
    dep, uni = [False] * len(ins), [False] * len(ins)
    for k, i in enumerate(ins):
        vs = [a[1] for a in i.args if a[0] == "v"]
        if i.op == "sum":
            if any(dep[j] for j in vs):
                raise ValueError(f"{prog.algo}.step: a sum of a value that depends on another sum (one reduce "
                                 f"phase per step)")
            if all(a[0] in ("s", "c") or (a[0] == "v" and uni[a[1]]) for a in i.args):
                raise ValueError(f"{prog.algo}.step: e.sum of a per-tensor value (sum a per-element one)")
            dep[k] = uni[k] = True
            continue
        dep[k] = any(dep[j] for j in vs)
        uni[k] = all(a[0] in ("s", "c") or (a[0] == "v" and uni[a[1]]) for a in i.args)
    in_reduce: set = set()
    todo = [ins[k].args[0] for k in sums]
    while todo:
        ref = todo.pop()
        if ref[0] == "v" and ref[1] not in in_reduce:
            in_reduce.add(ref[1])
            todo.extend(ins[ref[1]].args)
    sum_names = tuple(f"_sum{j}" for j in range(len(sums)))
    sum_ref = {("v", k): ("in", n) for k, n in zip(sums, sum_names)}
    written = dict(prog.outputs)
    first = [n for n, r in prog.outputs if r[0] == "v" and r[1] in in_reduce]
    while True:  # drop from `first` any array whose old value the map still reads
        subst = {written[n]: ("in", n) for n in first}
        folded: set = set()
        clash: list = []

        def stop(ref: tuple, subst=subst, folded=folded, clash=clash) -> Any:
            if ref in subst:
                return subst[ref]
            if ref[0] == "in" and ref[1] in first:
                clash.append(ref[1])
                return ref
            if ref[0] == "v" and dep[ref[1]] and uni[ref[1]]:
                folded.add(ref[1])
                return ("s", "?")
            return None

        map_outs = [(n, r) for n, r in prog.outputs if n not in first]
        _sub(prog, map_outs, stop, arrays, scalar_names)
        if not clash:
            break
        first = [n for n in first if n not in clash]
    fold_names = {k: f"fold{j}" for j, k in enumerate(sorted(folded))}
    subst = {written[n]: ("in", n) for n in first}

    def map_stop(ref: tuple) -> Any:
        if ref in subst:
            return subst[ref]
        if ref[0] == "v" and ref[1] in fold_names:
            return ("s", fold_names[ref[1]])
        return None

    mp = _sub(prog, [(n, r) for n, r in prog.outputs if n not in first], map_stop, arrays,
              tuple(scalar_names) + tuple(fold_names.values()))
    fd = _sub(prog, [(fold_names[k], ("v", k)) for k in sorted(fold_names)], lambda r: sum_ref.get(r), sum_names,
              scalar_names, keep_same=True)
    rd = _sub(prog, [(n, written[n]) for n in first] + [(n, ins[k].args[0]) for k, n in zip(sums, sum_names)],
              lambda r: None, tuple(arrays) + sum_names, scalar_names, keep_same=True)
    return Split(rd, sum_names, fd, mp, tuple(first))


# ------------------------------------------------------------------------------------------------ the fold
def fold_values(xp: Any, fold: tr.Program, sums: dict, sc: dict, dt: Any) -> dict:
    """The fold's outputs from the sums (values of the dtype: NumPy scalars, (T,) rows or 1-element device
    arrays), each operation one ufunc rounded to the dtype; no host synchronisation."""
    vals: list = []

    def get(ref: tuple) -> Any:
        kind = ref[0]
        if kind == "in":
            return sums[ref[1]]
        if kind == "s":
            return sc[ref[1]]
        if kind == "c":
            return dt(ref[1])
        return vals[ref[1]]

    with np.errstate(all="ignore"):  # a division the where then discards (Lamb's ψ = 0)
        for ins in fold.instrs:
            a = [get(r) for r in ins.args]
            if ins.op == "where":
                vals.append(xp.where(*a))
            elif ins.op == "sum":  # pragma: no cover - split refuses nested sums
                raise AssertionError
            else:
                vals.append(getattr(xp, lower_numpy.UFUNC[ins.op])(*a))
    return {n: get(r) for n, r in fold.outputs}


# --------------------------------------------------------------------------------------------- NumPy phases
def runners(d: Any, fs: int, xp: Any) -> tuple:
    """(reduce runner, map runner, scratch buffers, boolean buffers) of flag set ``fs`` on ``xp``."""
    return _runners(d, xp)[fs]


@functools.lru_cache(maxsize=None)
def _runners(d: Any, xp: Any) -> dict:
    """``runners`` of every flag set with a sum, made at once and with the largest buffer counts among them: a flag
    set that changes with t (RAdam's rectification) then compiles and allocates nothing on its first step."""
    plans = {}
    for f in d.flag_sets():
        fs = d.index(f)
        sp = d.split_at(fs)
        if sp is not None:
            plans[fs] = (sp, lower_numpy.allocate(sp.reduce), lower_numpy.allocate(sp.map))
    nscr = max(max(rp.scratch, mp.scratch) for _, rp, mp in plans.values())
    nbool = max(max(rp.bools, mp.bools) for _, rp, mp in plans.values())
    return {fs: (lower_numpy.Runner(rp, xp, tuple(d.arrays) + sp.sums), lower_numpy.Runner(mp, xp, tuple(d.arrays)),
                 nscr, nbool) for fs, (sp, rp, mp) in plans.items()}


def _bools(k: int, n: int) -> list:
    return [b[:n] for b in lower_numpy.bool_scratch(np, k, CHUNK)] if n <= CHUNK else lower_numpy.bool_scratch(
        np, k, n)


def work(st: Any, size: int, dtype: Any, xp: Any = np) -> Any:
    """The state's unsaved ``work`` area of ``size`` elements (zero-filled when made)."""
    w = getattr(st, "work", None)  # a field of the state, or an attribute set here (an unsaved one either way)
    if w is None or w.size != size or w.dtype != dtype:
        w = st.work = xp.zeros(size, dtype)
    return w


def _columns(d: Any, fs: int, arrays: tuple, lay: norms.Columns, accs: list, sc: dict, packed: bytes, chunk: int,
             c0: int, c1: int) -> None:
    """Columns [c0, c1) of the column layout (``core.norms``), in row order: the reduce phase, and each summand's
    column sums."""
    r, _, nscr, nbool = runners(d, fs, np)
    k = len(accs)
    bufs = cpu_plan.scratch(arrays[0].dtype, nscr + k, chunk + lay.cols)
    scr, terms = bufs[:nscr], bufs[nscr:]
    dt = arrays[0].dtype.type
    for start, rows, w, col, first in norms.blocks(lay, c0, c1, chunk):
        a, b = start, start + rows * w
        piece = tuple(x[a:b] for x in arrays)
        cols = tuple(acc[col:col + w] for acc in accs)
        if native.gen_columns(d.name, fs, piece, cols, rows, w, first, packed):
            continue  # the same operations in one compiled pass (core/native.py)
        r.run(piece + tuple(s[w:w + b - a] for s in terms), sc, [s[:b - a] for s in scr], _bools(nbool, b - a), dt)
        for acc, s in zip(cols, terms):
            norms.add_rows(acc, s, rows, first)


def _map(d: Any, fs: int, arrays: tuple, sc: dict, packed: bytes, chunk: int, lo: int, hi: int) -> None:
    """Elements [lo, hi) of the map phase."""
    _, m, nscr, nbool = runners(d, fs, np)
    scr = cpu_plan.scratch(arrays[0].dtype, nscr, chunk)
    dt = arrays[0].dtype.type
    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        piece = tuple(x[a:b] for x in arrays)
        if native.gen_map(d.name, fs, piece, packed):
            continue  # the same operations in one compiled pass
        m.run(piece, sc, [s[:b - a] for s in scr], _bools(nbool, b - a), dt)


def np_phases(d: Any, fs: int, arrays: tuple, st: Any, sc: dict, packed: bytes, chunk: int) -> Iterator[Any]:
    """NumPy: flag set ``fs`` (one with a sum) as phases of tasks (``core.cpu_tensors``): column ranges of the
    reduce phase, then (after the sums and the fold, on NumPy scalars of the dtype) chunk ranges of the map.
    ``arrays``: the definition's, whole; ``sc``: the scalars of the dtype by name, ``packed`` the same as doubles
    (the C pass's struct); ``st.work``: the sums' work area."""
    p = arrays[0]
    n = p.size
    if n == 0:
        return
    sp = d.split_at(fs)
    lay = norms.columns(n)
    k = len(sp.sums)
    area = work(st, k * lay.cols + norms.fold_len(lay.nb), p.dtype)  # columns without a term stay 0
    accs = [area[j * lay.cols:(j + 1) * lay.cols] for j in range(k)]
    fw = area[k * lay.cols:]
    yield [(cost, functools.partial(_columns, d, fs, arrays, lay, accs, sc, packed, chunk, c0, c1))
           for cost, c0, c1 in norms.column_ranges(lay, chunk)]
    sums = {name: norms.sq_fold(acc, lay.nb, fw)[0] for name, acc in zip(sp.sums, accs)}
    folded = {name: p.dtype.type(v) for name, v in fold_values(np, sp.fold, sums, sc, p.dtype.type).items()}
    msc = {**sc, **folded}
    mpacked = packed + b"".join(np.float64(folded[f]).tobytes() for f in sp.folds)
    yield [(hi - lo, functools.partial(_map, d, fs, arrays, msc, mpacked, chunk, lo, hi))
           for lo, hi in cpu_plan.ranges(n, chunk)]


def np_rows(d: Any, fs: int, arrays: tuple, sc: dict, work: dict) -> None:
    """NumPy: flag set ``fs`` (one with a sum) on the T rows of (T, n) arrays at once (a bucket of small tensors,
    ``core.cpu_tensors``): the reduce phase on the whole arrays, each sum per row (``core.norms.sq_rows``), the
    fold on (T,) rows, the map with the folded values broadcast per row; ``work``: the bucket's scratch."""
    P = arrays[0]
    rows, n = P.shape
    dt = P.dtype.type
    sp = d.split_at(fs)
    r, m, nscr, nbool = runners(d, fs, np)
    k = len(sp.sums)
    bufs = work.get(fs)
    if bufs is None:
        xlen = sqsum.sq_layout(n)[2]
        bufs = work[fs] = ([np.empty_like(P) for _ in range(nscr)], [np.empty_like(P, bool) for _ in range(nbool)],
                           [np.zeros((rows, xlen), P.dtype) for _ in range(k)],
                           [np.empty(norms.rows_len(rows, n), P.dtype) for _ in range(k)])
    scr, bools, xs, ws = bufs
    r.run(arrays + tuple(x[:, :n] for x in xs), sc, scr, bools, dt)
    sums = {name: norms.sq_rows(x, n, w) for name, x, w in zip(sp.sums, xs, ws)}
    folded = fold_values(np, sp.fold, sums, sc, dt)
    m.run(arrays, {**sc, **{f: v[:, None] for f, v in folded.items()}}, scr, bools, dt)


def xp_update(d: Any, fs: int, xp: Any, arrays: tuple, st: Any, sc: dict) -> None:
    """Flag set ``fs`` (one with a sum) on one whole tensor on the array module ``xp`` (CuPy, or the device
    stand-ins): the reduce phase, each sum by ``sqsum.sq_sum`` (elementwise operations only), the fold on 1-element
    arrays, the map; nothing read back to the host.  ``st.work``: the sums' terms; the scratch comes from
    ``core/workspace.py``."""
    p = arrays[0]
    n = p.size
    if n == 0:
        return
    dt = p.dtype.type
    sp = d.split_at(fs)
    r, m, nscr, nbool = runners(d, fs, xp)
    k = len(sp.sums)
    slen = sqsum.sq_layout(n)[4]
    w = work(st, k * slen, p.dtype, xp)  # the sums' terms (their zero padding persists: per parameter)
    terms = [w[j * slen:(j + 1) * slen] for j in range(k)]
    scr = [workspace.get(xp, f"elementwise.scratch{j}", n, p.dtype) for j in range(nscr)]  # per thread and stream
    bools = lower_numpy.bool_scratch(xp, nbool, n)
    r.run(arrays + tuple(x[:n] for x in terms), sc, scr, bools, dt)
    sums = {name: sqsum.sq_sum(xp, x, n) for name, x in zip(sp.sums, terms)}
    folded = fold_values(xp, sp.fold, sums, sc, dt)
    m.run(arrays, {**sc, **folded}, scr, bools, dt)

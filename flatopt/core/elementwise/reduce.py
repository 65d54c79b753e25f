"""The reduce-then-map stage: a step that calls ``e.sum(x)`` becomes ordered reduction levels, then a map.

A step may sum any per-element value over the tensor (``e.sum(x)``, ``e.sumsq(x)`` = ``e.sum(x * x)``) and keep
computing with the result: a per-tensor value, which may enter another sum (Mars with clip_c and cautious: the
mask's count is a sum of a value made from the clip's norm).  A sum's level is one more than the highest level among
the sums its summand depends on; :func:`split` cuts the traced program into one :class:`Level` per level, in order,
then the map:

* **reduce** (per level): the instructions its summands depend on, run per element, with the earlier levels' fold
  results as scalars; the first level also writes the arrays whose new value it computes and that no sum changes
  (Lamb's m and v), and each summand j goes into the pseudo-array ``_sum<j>``;
* **the sums**: each ``_sum<j>`` added over the tensor in the fixed blocked order of ``core/sqsum.py`` (the same bits
  on NumPy, the C pass and CUDA: ``core/norms.py`` column sums, ``kernels/sq_sum.cuh``), rounded to the dtype;
* **fold** (per level): the instructions on per-tensor values of that level, run once per tensor in the dtype
  (reads: its sums as ``_sum<j>``, the earlier folds' results as scalars; outputs: the per-tensor scalars
  ``fold<k>``, numbered over the whole step, that later levels and the map read);
* **map**: the rest, per element, with every fold's results as scalars; an array the first reduce phase wrote is
  read back (its new value), everything else is recomputed from the inputs with the same operations (the same
  bits).  A later level's reduce phase likewise recomputes what it needs (Mars's m, from the old m and the clip).

The **carry form** (:func:`np_rows`, :func:`xp_update`): a per-element value a reduce phase computes (Lamb's
direction u, Mars's corrected gradient c) and a later part needs is kept in a pseudo-array ``_carry<j>`` that the
reduce phase writes and the later parts read, instead of being recomputed (the same bits: the same operations,
done once).  ``split`` makes it only where the carries and each carry-form part's own scratch fit in the plain
form's scratch count and it runs fewer operations; the carries are then the last scratch buffers, and the map
may write into a carry it has read for the last time.  The phases form (its map runs chunk by chunk in a later
phase) and the compiled C pass and CUDA kernels (where a full-size store and load cost more than recomputing)
run the plain programs.

Terms are values of the dtype (a comparison's True is 1).  The blocked order pads with +0 and the kernels'
per-thread sums start at +0, so the sign of a zero sum whose terms are all −0 may differ between paths (sums of
squares, of masks, never hit it).

This module also holds the NumPy/CuPy lowerings of a split program (``run.bind`` wraps them for a definition with a
sum), each running the levels one after the other: :func:`np_phases` (a tensor in phases of tasks on the threads:
per level, column ranges of its reduce phase, then after the last fold chunk ranges of the map;
``core/cpu_tensors.py``), :func:`np_rows` (small tensors of one size as the rows of (T, n) arrays, the sums per row)
and :func:`xp_update` (one whole tensor on CuPy, no host synchronisation).  The compiled pass has one columns entry
per level (``_columns``, ``_columns1``, ...), the CUDA source a partials and a fold kernel per level (``emit.py``).
A definition with a sum keeps its sums' work area in its state's unsaved field ``work`` (one level's at a time).
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
class Level:
    """One reduction level of a split: a reduce phase, its sums, and the fold of the per-tensor values they give."""

    reduce: tr.Program  # arrays: the definition's, then ``sums``; scalars: the definition's, then earlier folds
    sums: tuple  # the pseudo-array names "_sum<j>" of this level (numbered over the whole step)
    fold: tr.Program  # reads this level's sums (and earlier folds as scalars); outputs ("fold<k>", ref)
    first: tuple = ()  # the arrays this reduce phase writes (the first level only)
    carry: tuple = ()  # the carry form: the pseudo-arrays "_carry<j>" this reduce phase also writes
    carrying: tr.Program | None = None  # the carry form's reduce phase (writes ``carry``; reads earlier levels')

    @property
    def folds(self) -> tuple:
        return tuple(n for n, _ in self.fold.outputs)


@dataclasses.dataclass(frozen=True)
class Split:
    """One flag set's program cut at its sums (see the module docstring): ordered levels, then the map."""

    levels: tuple  # of Level: a level's sums may depend on the folds of the levels before it
    map: tr.Program  # scalars: the definition's it uses, then the folds'
    carried_map: tr.Program | None = None  # the carry form's map (reads every level's ``carry``); None: no carry

    @property
    def carry(self) -> tuple:
        return tuple(n for lv in self.levels for n in lv.carry)

    @property
    def first(self) -> tuple:
        return self.levels[0].first

    @property
    def sums(self) -> tuple:
        return tuple(n for lv in self.levels for n in lv.sums)

    @property
    def folds(self) -> tuple:
        return tuple(n for lv in self.levels for n in lv.folds)

    @property
    def width(self) -> int:
        """The most sums of one level: a work area holds that many (the levels run one after the other)."""
        return max(len(lv.sums) for lv in self.levels)


def _sub(prog: tr.Program, outputs: list, stop: Callable[[tuple], Any], arrays: tuple, scalars: tuple,
         keep_same: bool = False) -> tr.Program:
    """The instructions ``outputs`` need, in their original order and renumbered; ``stop(ref)`` replaces a ref
    (an input of this part) or returns None."""
    need = _need(prog, outputs, stop)
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


def _need(prog: tr.Program, outputs: list, stop: Callable[[tuple], Any]) -> set:
    """The indices of the instructions ``outputs`` need, up to the refs ``stop`` replaces."""
    need: set = set()
    todo = [r for _, r in outputs]
    while todo:
        ref = todo.pop()
        if stop(ref) is not None or ref[0] != "v" or ref[1] in need:
            continue
        need.add(ref[1])
        todo.extend(prog.instrs[ref[1]].args)
    return need


def _levels(prog: tr.Program) -> tuple[list, list]:
    """Per instruction: its level (0 for a value no sum precedes; a sum's is one more than its summand's) and
    whether it is per-tensor (made of scalars, constants and sums only)."""
    lv, uni = [0] * len(prog.instrs), [False] * len(prog.instrs)
    for k, i in enumerate(prog.instrs):
        u = all(a[0] in ("s", "c") or (a[0] == "v" and uni[a[1]]) for a in i.args)
        lv[k] = max((lv[a[1]] for a in i.args if a[0] == "v"), default=0)
        if i.op == "sum":
            if u:
                raise ValueError(f"{prog.algo}.step: e.sum of a per-tensor value (sum a per-element one)")
            lv[k], u = lv[k] + 1, True
        uni[k] = u
    return lv, uni


def split(prog: tr.Program, arrays: tuple, scalar_names: tuple) -> Split | None:
    """The program cut at its sums, or None when it has none (``arrays``, ``scalar_names``: the definition's)."""
    ins = prog.instrs
    sums = [k for k, i in enumerate(ins) if i.op == "sum"]
    if not sums:
        return None
    lv, uni = _levels(prog)
    nlev = max(lv[k] for k in sums)
    per_tensor = {k for k in range(len(ins)) if lv[k] and uni[k]}  # a fold's values (sums included)
    level_sums = [[k for k in sums if lv[k] == L] for L in range(1, nlev + 1)]
    sum_names = {k: f"_sum{j}" for j, k in enumerate(k for ks in level_sums for k in ks)}
    in_reduce: set = set()  # what the first level's summands need
    todo = [ins[k].args[0] for k in level_sums[0]]
    while todo:
        ref = todo.pop()
        if ref[0] == "v" and ref[1] not in in_reduce:
            in_reduce.add(ref[1])
            todo.extend(ins[ref[1]].args)
    written = dict(prog.outputs)
    first = [n for n, r in prog.outputs if r[0] == "v" and r[1] in in_reduce]

    def later_parts(stop: Callable) -> None:  # the map and the reduce phases after the first, through ``stop``
        _sub(prog, [(n, r) for n, r in prog.outputs if n not in first], stop, arrays, scalar_names)
        for ks in level_sums[1:]:
            _sub(prog, [(sum_names[k], ins[k].args[0]) for k in ks], stop, arrays, scalar_names)

    while True:  # drop from `first` any array whose old value a later part still reads
        subst = {written[n]: ("in", n) for n in first}
        folded: set = set()
        clash: list = []

        def stop(ref: tuple, subst=subst, folded=folded, clash=clash) -> Any:
            if ref in subst:
                return subst[ref]
            if ref[0] == "in" and ref[1] in first:
                clash.append(ref[1])
                return ref
            if ref[0] == "v" and ref[1] in per_tensor:
                folded.add(ref[1])
                return ("s", "?")
            return None

        later_parts(stop)
        if not clash:
            break
        first = [n for n in first if n not in clash]
    for L in range(nlev, 1, -1):  # a fold may read the folds of the levels before it
        need = [("x", ("v", k)) for k in folded if lv[k] == L]
        seen: set = set()

        def record(ref: tuple, L=L, seen=seen) -> Any:
            if ref[0] == "v" and ref[1] in per_tensor and (lv[ref[1]] < L or ins[ref[1]].op == "sum"):
                if lv[ref[1]] < L:
                    seen.add(ref[1])
                return ("s", "?")
            return None

        _sub(prog, need, record, arrays, scalar_names)
        folded |= seen
    order = sorted(folded, key=lambda k: (lv[k], k))
    fold_names = {k: f"fold{j}" for j, k in enumerate(order)}
    subst = {written[n]: ("in", n) for n in first}

    def later_stop(ref: tuple) -> Any:
        if ref in subst:
            return subst[ref]
        if ref[0] == "v" and ref[1] in fold_names:
            return ("s", fold_names[ref[1]])
        return None

    levels = []
    for L, ks in enumerate(level_sums, 1):
        names = tuple(sum_names[k] for k in ks)
        before = tuple(fold_names[k] for k in order if lv[k] < L)
        outs = [(n, written[n]) for n in first] if L == 1 else []
        rd = _sub(prog, outs + [(sum_names[k], ins[k].args[0]) for k in ks], later_stop if L > 1 else lambda r: None,
                  tuple(arrays) + names, tuple(scalar_names) + before, keep_same=True)

        def fold_stop(ref: tuple, L=L) -> Any:
            if ref[0] == "v" and ins[ref[1]].op == "sum" and lv[ref[1]] == L:
                return ("in", sum_names[ref[1]])
            if ref[0] == "v" and ref[1] in fold_names and lv[ref[1]] < L:
                return ("s", fold_names[ref[1]])
            return None

        fd = _sub(prog, [(fold_names[k], ("v", k)) for k in order if lv[k] == L], fold_stop, names,
                  tuple(scalar_names) + before, keep_same=True)
        levels.append(Level(rd, names, fd, tuple(first) if L == 1 else ()))
    mp = _sub(prog, [(n, r) for n, r in prog.outputs if n not in first], later_stop, arrays,
              tuple(scalar_names) + tuple(fold_names[k] for k in order))
    sp = Split(tuple(levels), mp)
    return _carry(prog, sp, level_sums, sum_names, first, later_stop, uni, arrays, scalar_names)


def _carry(prog: tr.Program, sp: Split, level_sums: list, sum_names: dict, first: list, later_stop: Callable,
           uni: list, arrays: tuple, scalar_names: tuple) -> Split:
    """``sp`` with its carry form: each per-element value (not a comparison's) that a reduce phase computes and a
    later part (a later reduce phase, the map) reads, kept in a pseudo-array ``_carry<j>`` that the reduce phase
    writes and the later parts read instead of recomputing it; or ``sp`` unchanged when the carries and the
    scratch of the carry form's parts would need more scratch buffers than the plain form's."""
    ins = prog.instrs
    nlev = len(level_sums)
    made: dict = {}  # instruction -> the level whose reduce phase computes it
    carried: set = set()

    def stop_at(L: int) -> Callable:
        def stop(ref: tuple) -> Any:
            s = later_stop(ref)
            if s is not None:
                return s
            if ref[0] == "v" and made.get(ref[1], L) < L:
                carried.add(ref[1])
                return ("in", "?")
            return None
        return stop

    outs = [(n, r) for n, r in prog.outputs if n not in first]
    parts = [[(n, r) for n, r in prog.outputs if n in first] * (L == 1) + [(sum_names[k], ins[k].args[0]) for k in ks]
             for L, ks in enumerate(level_sums, 1)]  # each reduce phase's outputs, in the plain form's order
    for L, part in enumerate(parts, 1):
        for k in _need(prog, part, stop_at(L) if L > 1 else lambda r: None):
            if not uni[k] and not ins[k].is_bool:
                made.setdefault(k, L)
    _need(prog, outs, stop_at(nlev + 1))
    if not carried:
        return sp
    order = sorted(carried, key=lambda k: (made[k], k))
    names = {k: f"_carry{j}" for j, k in enumerate(order)}
    every = tuple(names[k] for k in order)

    def read(L: int) -> Callable:
        def stop(ref: tuple) -> Any:
            s = later_stop(ref)
            if s is not None:
                return s
            return ("in", names[ref[1]]) if ref[0] == "v" and made.get(ref[1], L) < L and ref[1] in names else None
        return stop

    levels = []
    for L, (lv, part) in enumerate(zip(sp.levels, parts), 1):
        mine = [(names[k], ("v", k)) for k in order if made[k] == L]
        rd = _sub(prog, part + mine, read(L) if L > 1 else lambda r: None,
                  tuple(arrays) + lv.sums + every, lv.reduce.scalars, keep_same=True)
        levels.append(dataclasses.replace(lv, carry=tuple(n for n, _ in mine), carrying=rd))
    mp = _sub(prog, outs, read(nlev + 1), tuple(arrays) + every, sp.map.scalars)
    plain = [lower_numpy.allocate(q) for q in (*(lv.reduce for lv in sp.levels), sp.map)]
    carry = [lower_numpy.allocate(lv.carrying) for lv in levels] + [lower_numpy.allocate(mp, every)]
    if (max(q.scratch for q in carry) + len(every) > max(q.scratch for q in plain)
            or max(q.bools for q in carry) > max(q.bools for q in plain)
            or sum(len(q.steps) + len(q.copies) for q in carry) >= sum(len(q.steps) + len(q.copies) for q in plain)):
        return sp
    return Split(tuple(levels), sp.map, mp)


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
            elif ins.op == "sum":  # pragma: no cover - a fold reads its sums as inputs (split)
                raise AssertionError
            else:
                vals.append(getattr(xp, lower_numpy.UFUNC[ins.op])(*a))
    return {n: get(r) for n, r in fold.outputs}


# --------------------------------------------------------------------------------------------- NumPy phases
def runners(d: Any, fs: int, xp: Any) -> tuple:
    """(reduce runners, one per level; map runner; scratch buffers; boolean buffers) of flag set ``fs`` on ``xp``."""
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
            plans[fs] = (sp, [lower_numpy.allocate(lv.reduce) for lv in sp.levels], lower_numpy.allocate(sp.map))
    every = [q for _, rps, mp in plans.values() for q in (*rps, mp)]
    nscr, nbool = max(q.scratch for q in every), max(q.bools for q in every)
    return {fs: (tuple(lower_numpy.Runner(rp, xp, tuple(d.arrays) + lv.sums) for rp, lv in zip(rps, sp.levels)),
                 lower_numpy.Runner(mp, xp, tuple(d.arrays)), nscr, nbool, _carry_runners(d, sp, xp))
            for fs, (sp, rps, mp) in plans.items()}


def _carry_runners(d: Any, sp: Split, xp: Any) -> tuple:
    """(reduce runners, map runner) of the carry form, the carries the last scratch buffers; None without carries."""
    if sp.carried_map is None:
        return None
    names = tuple(d.arrays)
    return (tuple(lower_numpy.Runner(lower_numpy.allocate(lv.carrying), xp, names + lv.sums + sp.carry)
                  for lv in sp.levels),
            lower_numpy.Runner(lower_numpy.allocate(sp.carried_map, sp.carry), xp, names + sp.carry))


def _bools(k: int, n: int) -> list:
    return [b[:n] for b in lower_numpy.bool_scratch(np, k, CHUNK)] if n <= CHUNK else lower_numpy.bool_scratch(
        np, k, n)


def work(st: Any, size: int, dtype: Any, xp: Any = np) -> Any:
    """The state's unsaved ``work`` area of ``size`` elements (zero-filled when made)."""
    w = getattr(st, "work", None)  # a field of the state, or an attribute set here (an unsaved one either way)
    if w is None or w.size != size or w.dtype != dtype:
        w = st.work = xp.zeros(size, dtype)
    return w


def _columns(d: Any, fs: int, level: int, arrays: tuple, lay: norms.Columns, accs: list, sc: dict, packed: bytes,
             chunk: int, c0: int, c1: int) -> None:
    """Columns [c0, c1) of the column layout (``core.norms``), in row order: the reduce phase of ``level``, and
    each of its summands' column sums."""
    rs, _, nscr, nbool, _ = runners(d, fs, np)
    r = rs[level]
    k = len(accs)
    bufs = cpu_plan.scratch(arrays[0].dtype, nscr + k, chunk + lay.cols)
    scr, terms = bufs[:nscr], bufs[nscr:]
    dt = arrays[0].dtype.type
    for start, rows, w, col, first in norms.blocks(lay, c0, c1, chunk):
        a, b = start, start + rows * w
        piece = tuple(x[a:b] for x in arrays)
        cols = tuple(acc[col:col + w] for acc in accs)
        if native.gen_columns(d.name, fs, piece, cols, rows, w, first, packed, level):
            continue  # the same operations in one compiled pass (core/native.py)
        r.run(piece + tuple(s[w:w + b - a] for s in terms), sc, [s[:b - a] for s in scr], _bools(nbool, b - a), dt)
        for acc, s in zip(cols, terms):
            norms.add_rows(acc, s, rows, first)


def _map(d: Any, fs: int, arrays: tuple, sc: dict, packed: bytes, chunk: int, lo: int, hi: int) -> None:
    """Elements [lo, hi) of the map phase."""
    _, m, nscr, nbool, _ = runners(d, fs, np)
    scr = cpu_plan.scratch(arrays[0].dtype, nscr, chunk)
    dt = arrays[0].dtype.type
    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        piece = tuple(x[a:b] for x in arrays)
        if native.gen_map(d.name, fs, piece, packed):
            continue  # the same operations in one compiled pass
        m.run(piece, sc, [s[:b - a] for s in scr], _bools(nbool, b - a), dt)


def np_phases(d: Any, fs: int, arrays: tuple, st: Any, sc: dict, packed: bytes, chunk: int) -> Iterator[Any]:
    """NumPy: flag set ``fs`` (one with a sum) as phases of tasks (``core.cpu_tensors``): per level, column ranges
    of its reduce phase, then (after its sums and its fold, on NumPy scalars of the dtype) the next level; last,
    chunk ranges of the map.  ``arrays``: the definition's, whole; ``sc``: the scalars of the dtype by name,
    ``packed`` the same as doubles (the C pass's struct, the folds appended level by level); ``st.work``: the sums'
    work area (one level's at a time)."""
    p = arrays[0]
    n = p.size
    if n == 0:
        return
    sp = d.split_at(fs)
    lay = norms.columns(n)
    k = sp.width
    area = work(st, k * lay.cols + norms.fold_len(lay.nb), p.dtype)  # columns without a term stay 0
    fw = area[k * lay.cols:]
    for level, lv in enumerate(sp.levels):
        accs = [area[j * lay.cols:(j + 1) * lay.cols] for j in range(len(lv.sums))]
        yield [(cost, functools.partial(_columns, d, fs, level, arrays, lay, accs, sc, packed, chunk, c0, c1))
               for cost, c0, c1 in norms.column_ranges(lay, chunk)]
        sums = {name: norms.sq_fold(acc, lay.nb, fw)[0] for name, acc in zip(lv.sums, accs)}
        folded = {name: p.dtype.type(v) for name, v in fold_values(np, lv.fold, sums, sc, p.dtype.type).items()}
        sc = {**sc, **folded}
        packed = packed + b"".join(np.float64(folded[f]).tobytes() for f in lv.folds)
    yield [(hi - lo, functools.partial(_map, d, fs, arrays, sc, packed, chunk, lo, hi))
           for lo, hi in cpu_plan.ranges(n, chunk)]


def np_rows(d: Any, fs: int, arrays: tuple, sc: dict, work: dict) -> None:
    """NumPy: flag set ``fs`` (one with a sum) on the T rows of (T, n) arrays at once (a bucket of small tensors,
    ``core.cpu_tensors``): per level, its reduce phase on the whole arrays, each sum per row
    (``core.norms.sq_rows``), its fold on (T,) rows; then the map, the folded values broadcast per row; ``work``:
    the bucket's scratch."""
    P = arrays[0]
    rows, n = P.shape
    dt = P.dtype.type
    sp = d.split_at(fs)
    rs, m, nscr, nbool, carried = runners(d, fs, np)
    k = sp.width
    bufs = work.get(fs)
    if bufs is None:
        xlen = sqsum.sq_layout(n)[2]
        bufs = work[fs] = ([np.empty_like(P) for _ in range(nscr)], [np.empty_like(P, bool) for _ in range(nbool)],
                           [np.zeros((rows, xlen), P.dtype) for _ in range(k)],
                           [np.empty(norms.rows_len(rows, n), P.dtype) for _ in range(k)],
                           [np.empty_like(P) for _ in range(k)])
    scr, bools, xs, ws, terms = bufs
    rs, m, scr, carry = _carry_form(rs, m, scr, carried, len(sp.carry))
    rows_sc, fold_sc = dict(sc), dict(sc)  # the folds' values as (T, 1) columns for the runners, (T,) for a fold
    for r, lv in zip(rs, sp.levels):
        # the summands into contiguous (T, n) buffers, then copied into the zero-padded rows of ``sq_rows``: the
        # reduce phase's temporaries may sit in a summand's buffer, and a ufunc writing (T, n) of (T, xlen) goes
        # row by row
        r.run(arrays + tuple(terms[:len(lv.sums)]) + carry, rows_sc, scr, bools, dt)
        for x, term in zip(xs, terms[:len(lv.sums)]):
            np.copyto(x[:, :n], term)
        sums = {name: norms.sq_rows(x, n, w) for name, x, w in zip(lv.sums, xs, ws)}
        for f, v in fold_values(np, lv.fold, sums, fold_sc, dt).items():
            fold_sc[f], rows_sc[f] = v, v[:, None]
    m.run(arrays + carry, rows_sc, scr, bools, dt)


def _carry_form(rs: tuple, m: Any, scr: list, carried: tuple | None, k: int) -> tuple:
    """(reduce runners, map runner, scratch, carries): the carry form's, its ``k`` carries the last ``k`` scratch
    buffers (``split`` made it only where the rest suffices), or the plain form's with no carries."""
    if carried is None:
        return rs, m, scr, ()
    return carried[0], carried[1], scr[:len(scr) - k], tuple(scr[len(scr) - k:])


def scratch(xp: Any, k: int, n: int, dtype: Any) -> list:
    """``k`` float scratch buffers of ``n`` elements from ``core/workspace.py`` (per thread, and on CuPy per device
    and stream)."""
    return [workspace.get(xp, f"elementwise.scratch{j}", n, dtype) for j in range(k)]


def xp_update(d: Any, fs: int, xp: Any, arrays: tuple, st: Any, sc: dict) -> None:
    """Flag set ``fs`` (one with a sum) on one whole tensor on the array module ``xp`` (CuPy, or the device
    stand-ins): per level, its reduce phase, each sum by ``sqsum.sq_sum`` (elementwise operations only), its fold
    on 1-element arrays; then the map; nothing read back to the host.  ``st.work``: the sums' terms (one level's at
    a time); the scratch comes from ``core/workspace.py``."""
    p = arrays[0]
    n = p.size
    if n == 0:
        return
    dt = p.dtype.type
    sp = d.split_at(fs)
    rs, m, nscr, nbool, carried = runners(d, fs, xp)
    k = sp.width
    slen = sqsum.sq_layout(n)[4]
    w = work(st, k * slen, p.dtype, xp)  # the sums' terms (their zero padding persists: per parameter)
    terms = [w[j * slen:(j + 1) * slen] for j in range(k)]
    scr = scratch(xp, nscr, n, p.dtype)
    bools = lower_numpy.bool_scratch(xp, nbool, n)
    rs, m, scr, carry = _carry_form(rs, m, scr, carried, len(sp.carry))
    for r, lv in zip(rs, sp.levels):
        r.run(arrays + tuple(x[:n] for x in terms[:len(lv.sums)]) + carry, sc, scr, bools, dt)
        sums = {name: sqsum.sq_sum(xp, x, n) for name, x in zip(lv.sums, terms)}
        sc = sc | fold_values(xp, lv.fold, sums, sc, dt)  # (a new dict: ``sc`` is the step's cached one)
    m.run(arrays + carry, sc, scr, bools, dt)

"""The NumPy/CuPy path: a program's instructions as in-place ufuncs over a chunk, into preallocated scratch.

A small register allocator gives each instruction's result a buffer: the array it is the new value of (when that
array's old value is no longer read), an array being rewritten in a chain (``p = p * decay`` in place), or the
first free scratch buffer; so AdamW runs through one scratch buffer, as the hand-written NumPy path did.  Nothing
is allocated per step.  Each operation is one ufunc with NumPy's rounding to the dtype; this is the reference the
compiled paths are compared with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import trace as tr

_UFUNC = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative", "sqrt": "sqrt",
          "abs": "absolute", "sign": "sign", "copysign": "copysign", "maximum": "maximum", "minimum": "minimum",
          "isfinite": "isfinite", "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
          "eq": "equal", "ne": "not_equal", "not": "logical_not", "and": "logical_and", "or": "logical_or",
          "cast": "positive"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Steps ``(op, (loc...), out loc)``; a loc is ``("arr", name)``, ``("scr", j)``, ``("bool", j)``,
    ``("s", name)`` or ``("c", value)``.  ``copies``: ``(array, loc)`` run at the end."""

    steps: tuple
    copies: tuple
    scratch: int  # float scratch buffers used
    bools: int  # boolean scratch buffers used


def allocate(prog: tr.Program) -> Plan:
    n = len(prog.instrs)
    end = n
    last: dict = {}
    for k, ins in enumerate(prog.instrs):
        for r in ins.args:
            last[r] = k
    finals: dict = {}
    for name, ref in prog.outputs:
        last[ref] = end
        if ref[0] == "v":
            finals.setdefault(ref, name)
    final_at = {name: ref[1] for name, ref in prog.outputs if ref[0] == "v"}
    writable = [name for name, _ in prog.outputs]
    loc: dict = {("in", a): ("arr", a) for a in prog.reads}
    occupant: dict = {("arr", a): ("in", a) for a in writable}
    nscr = [0, 0]
    steps, copies = [], []

    def free(where: tuple, k: int) -> bool:
        occ = occupant.get(where)
        return occ is None or last.get(occ, -1) <= k

    def place(ref, L):
        occupant[L] = ref
        loc[ref] = L

    for k, ins in enumerate(prog.instrs):
        ref = ("v", k)
        args = tuple(loc.get(a, a) for a in ins.args)
        banned = {args[1]} if ins.op == "where" else set()
        dst = None
        if ins.is_bool:
            kind = "bool"
        else:
            kind = "scr"
            name = finals.get(ref)
            if name is not None and free(("arr", name), k) and ("arr", name) not in banned:
                dst = ("arr", name)
            if dst is None:
                cands = [("arr", a) for a in writable
                         if free(("arr", a), k) and final_at.get(a, -1) > k and last[ref] <= final_at[a]
                         and ("arr", a) not in banned]
                chained = [c for c in cands if c in args]
                dst = (chained or cands or [None])[0]
        if dst is None:
            j = 0
            while not free((kind, j), k) or (kind, j) in banned:
                j += 1
            nscr[kind == "bool"] = max(nscr[kind == "bool"], j + 1)
            dst = (kind, j)
        steps.append((ins.op, args, dst))
        place(ref, dst)
    for name, ref in prog.outputs:
        src = loc.get(ref, ref)
        if src != ("arr", name):
            copies.append((name, src))
    return Plan(tuple(steps), tuple(copies), nscr[0], nscr[1])


class Runner:
    """A plan bound to an array module: ``run(arrays, scalars, scratch, bools)``."""

    def __init__(self, plan: Plan, xp: Any):
        self.plan = plan
        self.ops = [(getattr(xp, _UFUNC[op]) if op != "where" else None, args, dst) for op, args, dst in plan.steps]
        self.xp = xp

    def run(self, arrays: dict, scalars: dict, scratch: list, bools: list) -> None:
        dt = arrays["p"].dtype.type

        def val(L):
            kind = L[0]
            if kind == "arr":
                return arrays[L[1]]
            if kind == "scr":
                return scratch[L[1]]
            if kind == "bool":
                return bools[L[1]]
            if kind == "s":
                return scalars[L[1]]
            return dt(L[1])

        for uf, args, dst in self.ops:
            out = val(dst)
            if uf is None:  # where(c, a, b): out = b, then a where c (out is never a's buffer: allocate bans it)
                c, a, b = (val(x) for x in args)
                if dst != args[2]:
                    self.xp.copyto(out, b)
                self.xp.copyto(out, a, where=c)
            else:
                uf(*(val(x) for x in args), out)
        for name, src in self.plan.copies:
            self.xp.copyto(arrays[name], val(src))

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
    """A plan bound to an array module, as one straight-line Python function (``source`` shows it):
    ``run(arrays, scalars, scratch, bools)`` with the arrays in the definition's order and the scalars a dict of
    values of the dtype."""

    def __init__(self, plan: Plan, xp: Any, arrays: tuple):
        self.plan, self.xp = plan, xp
        names = {("arr", a): a for a in arrays}
        env: dict = {"copyto": xp.copyto}
        consts: dict = {}
        body = []

        def ref(L: tuple) -> str:
            if L in names:
                return names[L]
            if L[0] == "scr":
                return f"_s{L[1]}"
            if L[0] == "bool":
                return f"_b{L[1]}"
            if L[0] == "s":
                return f"sc[{L[1]!r}]"
            return consts.setdefault(L[1], f"_c{len(consts)}")

        for op, args, dst in plan.steps:
            a = [ref(x) for x in args]
            if op == "where":  # out = b, then a where c (out is never a's buffer: allocate bans it)
                if dst != args[2]:
                    body.append(f"copyto({ref(dst)}, {a[2]})")
                body.append(f"copyto({ref(dst)}, {a[1]}, where={a[0]})")
            else:
                env[_UFUNC[op]] = getattr(xp, _UFUNC[op])
                body.append(f"{_UFUNC[op]}({', '.join(a)}, {ref(dst)})")
        body += [f"copyto({name}, {ref(src)})" for name, src in plan.copies]
        head = [f"{', '.join(arrays)}, = arrays"]
        head += [f"_s{j} = scratch[{j}]" for j in range(plan.scratch)]
        head += [f"_b{j} = bools[{j}]" for j in range(plan.bools)]
        head += [f"{name} = dt({value!r})" for value, name in consts.items()]
        self.source = "def run(arrays, sc, scratch, bools, dt):\n" + "".join(f"    {x}\n" for x in head + body)
        exec(compile(self.source, "<flatopt.core.elementwise.lower_numpy>", "exec"), env)  # noqa: S102
        self.run = env["run"]

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

import numpy as np

from .. import workspace
from . import trace as tr

UFUNC = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative", "sqrt": "sqrt",
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


def _fused(prog: tr.Program) -> list:
    """``[(op, args, is_bool, k)]``: the instructions, with ``sign(x)`` followed by its only use ``sign * scalar``
    fused into one ``signmul(x, scalar)`` (NumPy's sign branches per element; :func:`signed_mul` does not)."""
    out, skip = [], set()
    uses: dict = {}
    for ins in prog.instrs:
        for r in ins.args:
            uses[r] = uses.get(r, 0) + 1
    for _, r in prog.outputs:
        uses[r] = uses.get(r, 0) + 1
    for k, ins in enumerate(prog.instrs):
        if k in skip:
            continue
        nxt = prog.instrs[k + 1] if k + 1 < len(prog.instrs) else None
        if (ins.op == "sign" and nxt is not None and nxt.op == "mul" and nxt.args[0] == ("v", k)
                and nxt.args[1][0] in ("s", "c") and uses.get(("v", k)) == 1):
            out.append(("signmul", (ins.args[0], nxt.args[1]), False, k + 1))
            skip.add(k + 1)
            continue
        out.append((ins.op, ins.args, ins.is_bool, k))
    return out


def allocate(prog: tr.Program, spare: tuple = ()) -> Plan:
    """``spare``: input arrays whose buffers may take a result once their value is read for the last time (the
    carries a map reads)."""
    instrs = _fused(prog)
    end = len(prog.instrs)
    last: dict = {}
    for _, args, _, k in instrs:
        for r in args:
            last[r] = k
    finals: dict = {}
    for name, ref in prog.outputs:
        last[ref] = end
        if ref[0] == "v":
            finals.setdefault(ref, name)
    final_at = {name: ref[1] for name, ref in prog.outputs if ref[0] == "v"}
    writable = [name for name, _ in prog.outputs]
    loc: dict = {("in", a): ("arr", a) for a in prog.reads}
    occupant: dict = {("arr", a): ("in", a) for a in (*writable, *spare)}
    nscr = [0, 0]
    steps, copies = [], []

    def free(where: tuple, k: int) -> bool:
        occ = occupant.get(where)
        return occ is None or last.get(occ, -1) <= k

    def scratch(kind: str, k: int, banned: set) -> tuple:
        j = 0
        while not free((kind, j), k) or (kind, j) in banned:
            j += 1
        nscr[kind == "bool"] = max(nscr[kind == "bool"], j + 1)
        return (kind, j)

    for op, refs, is_bool, k in instrs:
        ref = ("v", k)
        args = tuple(loc.get(a, a) for a in refs)
        banned = {args[1]} if op == "where" else set()
        dst = None
        if not is_bool:
            name = finals.get(ref)
            if name is not None and free(("arr", name), k) and ("arr", name) not in banned:
                dst = ("arr", name)
            if dst is None:
                cands = [("arr", a) for a in writable
                         if free(("arr", a), k) and final_at.get(a, -1) > k and last[ref] <= final_at[a]
                         and ("arr", a) not in banned]
                chained = [c for c in cands if c in args]
                dst = (chained or cands or [c for c in (("arr", a) for a in spare) if free(c, k) and c not in banned]
                       or [None])[0]
        if dst is None:
            dst = scratch("bool" if is_bool else "scr", k, banned)
        if op == "signmul":  # a spare buffer for the signs' bytes, neither an operand nor the result
            args = args + (scratch("scr", k, {dst, *args}),)
        steps.append((op, args, dst))
        occupant[dst] = ref
        loc[ref] = dst
    for name, ref in prog.outputs:
        src = loc.get(ref, ref)
        if src != ("arr", name):
            copies.append((name, src))
    return Plan(tuple(steps), tuple(copies), nscr[0], nscr[1])


def signed_mul(xp: Any, c: Any, k: Any, out: Any, spare: Any) -> None:
    """``out = sign(c) * k`` with the bits of ``numpy.sign`` then the multiply.  On NumPy, branch-free: (c > 0) −
    (c < 0) as int8 in the bytes of ``spare`` (a free scratch buffer), times k (the int8 → dtype conversion is
    exact, so every element is the same ±1·k or +0·k product), where ``numpy.sign`` branches per element (slow on
    random signs: benchmarks/README.md, "Lion's sign").  A chunk holding a NaN (sign(NaN) = NaN) takes
    ``numpy.sign``."""
    n = c.size
    if xp is np and n:
        lo = xp.minimum.reduce(c)  # NaN exactly when c holds one (minimum propagates NaN)
        if lo == lo:
            b = spare.view(xp.int8)
            pos, neg = b[:n].view(xp.bool_), b[n:2 * n].view(xp.bool_)
            xp.greater(c, 0, out=pos)
            xp.less(c, 0, out=neg)
            d = b[:n]
            xp.subtract(d, b[n:2 * n], out=d)
            xp.multiply(d, k, out=out, dtype=out.dtype)
            return
    xp.sign(c, out)
    xp.multiply(out, k, out)


# NumPy 2.4 deprecates a positional ``out`` for maximum and minimum (a third positional argument may become a third
# operand): these two take it by keyword; the others keep the positional form (a cheaper call)
_KEYWORD_OUT = frozenset({"maximum", "minimum"})


class Runner:
    """A plan bound to an array module, as one straight-line Python function (``source`` shows it):
    ``run(arrays, scalars, scratch, bools)`` with the arrays in the definition's order and the scalars a dict of
    values of the dtype."""

    def __init__(self, plan: Plan, xp: Any, arrays: tuple):
        self.plan, self.xp, self.names = plan, xp, tuple(arrays)
        names = {("arr", a): a for a in arrays}
        env: dict = {"copyto": xp.copyto, "signed_mul": signed_mul, "xp": xp}
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
            if op == "signmul":
                body.append(f"signed_mul(xp, {a[0]}, {a[1]}, {ref(dst)}, {a[2]})")
            elif op == "cast" and args[0][0] == "bool":  # a comparison's 1/0 in the dtype (no ufunc takes bool)
                body.append(f"copyto({ref(dst)}, {a[0]})")
            elif op == "where":  # out = b, then a where c (out is never a's buffer: allocate bans it)
                if dst != args[2]:
                    body.append(f"copyto({ref(dst)}, {a[2]})")
                body.append(f"copyto({ref(dst)}, {a[1]}, where={a[0]})")
            else:
                env[UFUNC[op]] = getattr(xp, UFUNC[op])
                out = f"out={ref(dst)}" if op in _KEYWORD_OUT else ref(dst)
                body.append(f"{UFUNC[op]}({', '.join(a)}, {out})")
        body += [f"copyto({name}, {ref(src)})" for name, src in plan.copies]
        head = [f"{', '.join(arrays)}, = arrays"]
        head += [f"_s{j} = scratch[{j}]" for j in range(plan.scratch)]
        head += [f"_b{j} = bools[{j}]" for j in range(plan.bools)]
        head += [f"{name} = dt({value!r})" for value, name in consts.items()]
        self.source = "def run(arrays, sc, scratch, bools, dt):\n" + "".join(f"    {x}\n" for x in head + body)
        exec(compile(self.source, "<flatopt.core.elementwise.lower_numpy>", "exec"), env)  # noqa: S102
        self.run = env["run"]


def bool_scratch(xp: Any, k: int, n: int) -> list:
    """``k`` boolean scratch buffers of ``n`` elements from the one scratch mechanism (``core/workspace.py``: per
    thread, and on CuPy per device and stream)."""
    return [workspace.get(xp, f"elementwise.bool{j}", n, bool) for j in range(k)]

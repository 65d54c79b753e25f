"""The tracer: an algorithm's ``step`` run on symbolic values becomes a list of instructions.

Each instruction is one rounded operation (or a comparison, a select, a cast), recorded in the order the step
function performs it; every lowering (``lower_numpy``, ``emit``) executes the list as it is, so the NumPy path, the C
pass and the CUDA kernels make the same rounded operations in the same order by construction.
A value is referred to by an ``Ref``: an input array (``("in", name)``), a per-step scalar (``("s", name)``), a
literal (``("c", float)``) or the result of instruction k (``("v", k)``).  ``bool()`` of a symbolic value raises:
a step may branch on its flags (plain Python bools), never on its data.

The host scalars are traced too (:func:`trace_scalars`): ``scalars(cfg, t, lr)`` run with a symbolic ``lr`` says
which scalars depend on the learning rate, and the double-precision expression that derives each one; the
multi-tensor kernel evaluates those expressions per tensor on the device (``lr = base_lr * lr_scale``), with the
other numbers they use passed as double arguments.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Callable

Ref = tuple  # ("in", name) | ("s", name) | ("c", float) | ("v", index)

# op -> arity; "bool" results: the comparisons and isfinite
ARITY = {"add": 2, "sub": 2, "mul": 2, "div": 2, "neg": 1, "sqrt": 1, "abs": 1, "sign": 1, "copysign": 2,
         "maximum": 2, "minimum": 2, "where": 3, "isfinite": 1, "lt": 2, "le": 2, "gt": 2, "ge": 2, "eq": 2,
         "ne": 2, "not": 1, "and": 2, "or": 2, "cast": 1, "sum": 1}
BOOL_OPS = frozenset({"isfinite", "lt", "le", "gt", "ge", "eq", "ne", "not", "and", "or"})


@dataclasses.dataclass(frozen=True)
class Instr:
    op: str
    args: tuple  # Refs
    is_bool: bool
    line: int  # the line of the step function that performed it (the #line of the generated sources)


@dataclasses.dataclass(frozen=True)
class Program:
    """One flag set's instruction list: the inputs read, the outputs (array name -> the Ref of its new value)."""

    algo: str
    flags: tuple  # ((name, bool), ...)
    instrs: tuple  # Instr
    outputs: tuple  # ((array name, Ref), ...): only the arrays whose value changed
    reads: tuple  # the input arrays read, in the definition's order
    scalars: tuple  # the scalar names used, in the definition's order


class DataDependentBranch(TypeError):
    pass


class Sym:
    """A symbolic array value inside a traced step: its operators (set below from ``_OPERATORS``) record
    instructions."""

    __slots__ = ("t", "ref", "is_bool")
    __array_priority__ = 1000  # a NumPy scalar on the left defers to us
    __hash__ = None  # type: ignore[assignment]  # == is a symbolic comparison (NumPy's convention), not a bool

    def __init__(self, t: "_Tracer", ref: Ref, is_bool: bool = False):
        self.t, self.ref, self.is_bool = t, ref, is_bool

    def __bool__(self) -> bool:
        raise DataDependentBranch(f"data-dependent branch in {self.t.algo}.step: a symbolic value was used as a "
                                  f"Python bool (branch on the flags `f`, or use e.where)")


# the operators of Sym and HostSym: dunder name -> (Sym's op, HostSym's C operator: the four arithmetic ones, which
# are also reversed, ``2 * x``)
_OPERATORS = {"add": ("add", "+"), "sub": ("sub", "-"), "mul": ("mul", "*"), "truediv": ("div", "/"),
              "lt": ("lt", None), "le": ("le", None), "gt": ("gt", None), "ge": ("ge", None), "eq": ("eq", None),
              "ne": ("ne", None), "and": ("and", None), "or": ("or", None)}
for _name, (_op, _c) in _OPERATORS.items():
    setattr(Sym, f"__{_name}__", lambda s, o, op=_op: s.t.emit(op, (s, s.t.lift(o))))
    if _c is not None:
        setattr(Sym, f"__r{_name}__", lambda s, o, op=_op: s.t.emit(op, (s.t.lift(o), s)))
Sym.__invert__ = lambda s: s.t.emit("not", (s,))  # type: ignore[attr-defined]
Sym.__neg__ = lambda s: s.t.emit("neg", (s,))  # type: ignore[attr-defined]


class Intrinsics:
    """``e``: the operations a step may use besides + - * / and the comparisons; each has NumPy's semantics
    (``maximum``/``minimum`` propagate a NaN, ``sign`` of ±0 is 0 and of a NaN the NaN): ``sqrt``, ``abs``,
    ``sign``, ``isfinite``, ``cast`` (a comparison's 1/0 in the dtype), ``copysign``, ``maximum``, ``minimum``,
    ``where(c, x, y)``; then the per-tensor ``sum``, ``sumsq`` and ``cautious``."""

    def __init__(self, t: "_Tracer", flags: dict):
        self._t, self._flags = t, flags

    def sum(self, x: Any) -> Sym:
        """The sum over the tensor of a per-element value, in the blocked order of ``core/sqsum.py`` (rounded to
        the dtype at every addition): a per-tensor value that the step may keep computing with (``reduce.split``
        makes it a reduce phase, a fold and a map)."""
        return self._t.emit("sum", (self._t.lift(x),))

    def sumsq(self, x: Any) -> Sym:
        """``sum(x * x)``: the sum of squares of ``x``."""
        x = self._t.lift(x)
        return self.sum(x * x)

    def cautious(self, u: Any, g: Any) -> Any:
        """The update direction ``u`` (the step subtracts lr·u), masked where it disagrees in sign with ``g`` and
        rescaled, when the definition's flag ``cautious`` is set (Liang et al. 2024, as pytorch-optimizer 4.1.0's
        ``apply_cautious``); else ``u`` itself (no instruction)::

            mask = cast(u·g > 0);   count = Σ mask;   numel = count + Σ (1 − mask)
            u·(mask·((1 / (count + 1))·numel))

        numel: the element count as sums in the dtype (the blocked sums of the reduce stage, so that every path
        derives it alike; exact up to 2^24 elements in float32, beyond that within a rounding of float32(numel));
        ``1 / x · numel`` is torch's ``numel / x`` (``Tensor.__rtruediv__``: a reciprocal, then a product).  The mask
        is a cast of the comparison, not a select: the C loops stay branch-free and vectorise."""
        if "cautious" not in self._flags:
            raise TypeError(f"{self._t.algo}.step: e.cautious needs the flag 'cautious' (a config deriving from "
                            f"core.elementwise.define.Cautious)")
        if not self._flags["cautious"]:
            return u
        u, g = self._t.lift(u), self._t.lift(g)
        mask = self.cast(u * g > 0)
        count = self.sum(mask)
        scale = (1 / (count + 1)) * (count + self.sum(1 - mask))
        return u * (mask * scale)


for _op in ("sqrt", "abs", "sign", "isfinite", "cast", "copysign", "maximum", "minimum", "where"):
    setattr(Intrinsics, _op, lambda self, *xs, op=_op: self._t.emit(op, tuple(map(self._t.lift, xs))))


class _Tracer:
    def __init__(self, algo: str, step: Callable):
        self.algo, self.instrs, self.code = algo, [], step.__code__

    def lift(self, x: Any) -> Sym:
        if isinstance(x, Sym):
            return x
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"{self.algo}.step: {x!r} ({type(x).__name__}) is neither a traced value nor a number")
        return Sym(self, ("c", float(x)))

    def emit(self, op: str, args: tuple) -> Sym:
        if len(args) != ARITY[op]:
            raise TypeError(f"{self.algo}.step: e.{op} takes {ARITY[op]} argument(s), got {len(args)}")
        if op == "where" and not args[0].is_bool:
            raise TypeError(f"{self.algo}.step: e.where's condition must be a comparison or e.isfinite")
        line = _caller_line(self.code)
        is_bool = op in BOOL_OPS
        self.instrs.append(Instr(op, tuple(a.ref for a in args), is_bool, line))
        return Sym(self, ("v", len(self.instrs) - 1), is_bool)


def _caller_line(code: types.CodeType) -> int:
    f = sys._getframe(2)  # noqa: SLF001 - the caller's frame, as inspect.currentframe does, without its cost
    while f is not None and f.f_code is not code:
        f = f.f_back
    return f.f_lineno if f is not None else code.co_firstlineno


class _Named:
    """``s`` and ``f`` inside a traced step: attribute access by name."""

    def __init__(self, what: str, values: dict):
        self._what, self._values = what, values

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no {self._what} named {name!r} (declared: {sorted(self._values)})") from None


def trace(algo: str, step: Callable, arrays: tuple, scalar_names: tuple, flags: dict) -> Program:
    """The instruction list of ``step`` for one flag set.  ``arrays``: the array names in the definition's order
    (p, g, then the state slots); every array but ``g`` may be written."""
    t = _Tracer(algo, step)
    ins = {a: Sym(t, ("in", a)) for a in arrays}
    s = _Named("scalar", {k: Sym(t, ("s", k)) for k in scalar_names})
    out = step(Intrinsics(t, flags), *ins.values(), s=s, f=_Named("flag", dict(flags)))
    if not isinstance(out, dict):
        raise TypeError(f"{algo}.step must return a dict of the arrays it writes")
    outputs = []
    for name, val in out.items():
        if name not in ins or name == arrays[1]:
            raise ValueError(f"{algo}.step returns {name!r}, which is not one of its writable arrays")
        if val is None:
            continue
        ref = t.lift(val).ref
        if ref != ("in", name):
            outputs.append((name, ref))
    used = {r for i in t.instrs for r in i.args} | {r for _, r in outputs}
    reads = tuple(a for a in arrays if ("in", a) in used)
    scal = tuple(k for k in scalar_names if ("s", k) in used)
    return Program(algo, tuple(flags.items()), tuple(t.instrs), tuple(outputs), reads, scal)


# ------------------------------------------------------------------------------------------------ host scalars
class HostSym:
    """A double on the host that depends on the learning rate: a node of a small expression tree."""

    __slots__ = ("node",)

    def __init__(self, node: tuple):
        self.node = node  # ("lr",) | ("k", index) | (op, a, b) | ("neg", a)

    def __bool__(self) -> bool:
        raise DataDependentBranch("a scalar that depends on the learning rate was used as a Python bool")



for _name, (_, _c) in _OPERATORS.items():
    if _c is not None:
        setattr(HostSym, f"__{_name}__", lambda s, o, c=_c: HostSym((c, s.node, _host_node(o))))
        setattr(HostSym, f"__r{_name}__", lambda s, o, c=_c: HostSym((c, _host_node(o), s.node)))
HostSym.__neg__ = lambda s: HostSym(("neg", s.node))  # type: ignore[attr-defined]


def _host_node(o: Any) -> tuple:
    return o.node if isinstance(o, HostSym) else ("num", float(o))


def trace_scalars(scalars: Callable, cfg: Any, t: int, host: tuple = ()) -> tuple[tuple, tuple]:
    """``(shape, numbers)``: for each scalar, in the order ``scalars`` returns them, ``(name, expr)`` with expr
    None for a scalar independent of lr (passed as a number of the dtype) or a C expression in ``lr`` and the
    double arguments ``<name>_<j>``; ``numbers``: ``(argument name, value)`` of those arguments, and of the
    lr-independent scalars ``(name, value)``.  ``host``: a definition's per-parameter host values (plain numbers
    here: a multi-tensor group's members share them)."""
    shape, numbers = [], []
    for name, val in scalars(cfg, t, HostSym(("lr",)), *host).items():
        if not isinstance(val, HostSym):
            shape.append((name, None))
            numbers.append((name, float(val)))
            continue
        k = [0]

        def render(node: tuple) -> str:
            if node[0] == "lr":
                return "lr"
            if node[0] == "num":
                arg = f"{name}_{k[0]}"
                k[0] += 1
                numbers.append((arg, node[1]))
                return arg
            if node[0] == "neg":
                return f"(-{render(node[1])})"
            return f"({render(node[1])} {node[0]} {render(node[2])})"

        shape.append((name, render(val.node)))
    return tuple(shape), tuple(numbers)

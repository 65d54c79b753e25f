"""An elementwise algorithm's definition, and the paths derived from it.

An algorithm module declares (see ``flatopt/adamw.py``)::

    DEF = define("adamw", step, scalars=scalars, flags=flags, slots=("m", "v", "vmax"), example=AdamWConfig())

* ``scalars(cfg, t, lr) -> dict``: the per-step host scalars by name, computed in double;
* ``flags(cfg, t) -> dict``: Python bools that select the operation sequence (never data-dependent);
  ``flag_names`` lists them in a fixed order (a flag set's index: bit k is flag k);
* ``host`` (optional): the names of per-parameter host scalars that the algorithm computes itself once per step
  (from host state it keeps per parameter, e.g. Schedule-Free's averaging weight); the derived ``update`` and
  ``kernel_update`` then receive ``lr`` as the tuple ``(lr, *host values)``, and ``scalars``/``flags`` take the
  values as extra arguments (``scalars(cfg, t, lr, *host)``, ``flags(cfg, t, *host)``); the multi-tensor launch
  takes them per group (``Group.launch(..., host=...)``: its members share them);
* ``slots``: the state arrays, in order (the attribute names of the state object);
* ``step(e, p, g, *slots, s, f) -> dict``: the update of one element, written once with ordinary operators and
  the intrinsics of ``e`` (``trace.Intrinsics``); it returns the new value of each array it writes.

From it (all cached per flag set): the instruction list (``trace``), the NumPy/CuPy path (``lower_numpy``), the C
pass (``emit_c``, compiled by ``core/native.py``) and the CUDA kernels (``emit_cuda``, loaded by
``core/kernels.py``).  ``update``, ``kernel_update`` and ``multi`` are what the optimizer class binds.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from pathlib import Path
from typing import Any, Callable

from . import trace as tr

REGISTRY: dict[str, "Definition"] = {}  # filled as the algorithm modules are imported


class Definition:
    def __init__(self, name: str, step: Callable, *, scalars: Callable, flags: Callable, flag_names: tuple,
                 slots: tuple, example: Any, valid: Callable[[dict], bool] | None = None, host: tuple = ()):
        self.name, self.step_fn, self.scalars_fn, self.flags_fn = name, step, scalars, flags
        self.flag_names, self.slots, self.example = tuple(flag_names), tuple(slots), example
        params = list(inspect.signature(step).parameters)
        self.arrays = tuple(params[1:3]) + self.slots  # p, g, then the slots
        if tuple(params[3:3 + len(self.slots)]) != self.slots:
            raise TypeError(f"{name}.step's arguments after p, g must be its slots {self.slots}")
        self.host = tuple(host)
        self.example_host = (1.0,) * len(self.host)  # the host values the snapshots' scalar shapes are traced with
        self.scalar_names = tuple(scalars(example, 1, 1.0, *self.example_host))
        self.valid = valid or (lambda f: True)
        self.source = Path(inspect.getsourcefile(step) or "?")
        self.first_line = step.__code__.co_firstlineno
        REGISTRY[name] = self

    # ------------------------------------------------------------------------------------------ flag sets
    def flag_sets(self) -> list[dict]:
        """Every valid flag set, in index order."""
        out = []
        for bits in itertools.product((False, True), repeat=len(self.flag_names)):
            f = dict(zip(self.flag_names, reversed(bits)))
            if self.valid(f):
                out.append(f)
        return sorted(out, key=self.index)

    def index(self, f: dict) -> int:
        return sum(1 << k for k, n in enumerate(self.flag_names) if f[n])

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one Definition per algorithm, alive as long as its module
    def program_at(self, fs: int) -> tr.Program:
        """The traced program of flag set number ``fs`` (cached)."""
        f = {n: bool(fs >> k & 1) for k, n in enumerate(self.flag_names)}
        return tr.trace(self.name, self.step_fn, self.arrays, self.scalar_names, f)

    def program(self, f: dict) -> tr.Program:
        return self.program_at(self.index(f))

    def flags_of(self, cfg: Any, t: int, host: tuple = ()) -> int:
        return self._flags_of(cfg, t, host)

    @functools.lru_cache(maxsize=256)  # noqa: B019
    def _flags_of(self, cfg: Any, t: int, host: tuple) -> int:
        f = self.flags_fn(cfg, t, *host)
        if tuple(f) != self.flag_names:
            raise ValueError(f"{self.name}.flags returned {tuple(f)}, declared {self.flag_names}")
        return self.index(f)

    def state_arrays(self, st: Any, p: Any) -> tuple:
        """The slots' arrays of a state (``p`` standing in for an absent one: a flag set that has it never reads
        or writes it)."""
        return tuple(p if getattr(st, k) is None else getattr(st, k) for k in self.slots)


def define(name: str, step: Callable, **kw: Any) -> Definition:
    return Definition(name, step, **kw)

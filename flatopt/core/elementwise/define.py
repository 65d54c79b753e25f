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
* ``wide_maps`` (optional): the CUDA map kernels of its flag sets with a sum take ``__launch_bounds__(256, 1)``
  (ptxas may then use more registers) where the default bound makes ptxas spill (``tests/test_kernels_compile.py``);
* ``step(e, p, g, *slots, s, f) -> dict``: the update of one element, written once with ordinary operators and
  the intrinsics of ``e`` (``trace.Intrinsics``); it returns the new value of each array it writes.

**Reduce, then map.**  A step may sum a per-element value over the whole tensor and keep computing with the
result, a per-tensor value::

    nrm = e.sqrt(e.sumsq(c))                    # e.sumsq(x) = e.sum(x * x)
    c = c / e.maximum(nrm, 1)                   # per-tensor values combine with per-element ones as usual
    frac = e.sum(e.where(mask, 1, 0)) / s.n     # a sum of any traced per-element value (terms of the dtype)

``e.sum(x)`` adds x over the tensor in the fixed blocked order of ``core/sqsum.py``, rounded to the dtype at each
addition: the same bits on NumPy (``core/norms.py``'s column sums), the C pass and CUDA (``kernels/sq_sum.cuh``).
``reduce.split`` cuts such a flag set's program into ordered reduction levels, each a reduce phase (the instructions
its summands need; the first writes the arrays it computes that no sum changes), its sums and a fold (the per-tensor
instructions of that level, run once per tensor in the dtype: its results ``fold<k>`` are scalars of the later
levels and of the map), then a map (the rest, per element); a sum of a value that depends on another sum is in a
later level (Mars's mask count after its clip's norm).  A zero sum of terms that are all −0 may read ±0 by path (the
blocked order pads with +0).  Such a definition's optimizer is not elementwise: ``run.bind_reduce(DEF)`` gives its
``update_fn``, ``np_phases_fn``, ``np_rows_fn``, ``kernel_fn`` (2·levels + 1 launches per tensor: each level's
partials and fold, then the map) and ``multi_tensor`` (as many per dtype group), and its state has an unsaved field
``work`` (the sums' work area, the kernels' partials).  See ``flatopt/lamb.py`` and ``flatopt/mars.py``.
``Definition.split_at(fs)`` gives the split (None for a flag set without a sum), ``has_sums()`` whether any flag set
has one.

**Cautious.**  A config deriving from :class:`Cautious` has the keyword-only field ``cautious`` (a bool, False by
default, checked before the config's own checks); its definition gains the flag ``cautious`` as its last (the
other flag sets keep their numbers, programs and kernels), and its step marks its update direction once::

    p = p + e.cautious(u, g) * s.neg_lr         # u when the flag is off (no instruction)

With the flag on, ``e.cautious`` (``trace.Intrinsics.cautious``) masks u where u·g ≤ 0 and scales it by
numel/(count + 1) (both sums over the tensor), so those flag sets are reduce-then-map programs and
``run.configure`` binds the optimizer to their forms (``run.bind_reduce``).  ``plain_flag_sets()`` lists the flag
sets without a sum.

From it (all cached per flag set): the instruction list (``trace``), the NumPy/CuPy path (``lower_numpy``), the C
pass (``emit.c_source``, compiled by ``core/native.py``) and the CUDA kernels (``emit.cuda_source``, loaded by
``core/kernels.py``); ``run.bind`` gives what the optimizer class binds.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from pathlib import Path
from typing import Any, Callable

from . import reduce, trace as tr

REGISTRY: dict[str, "Definition"] = {}  # filled as the algorithm modules are imported


@dataclasses.dataclass(frozen=True)
class Cautious:
    """The config base of an elementwise algorithm whose step marks its update direction with ``e.cautious``: the
    keyword-only field ``cautious`` (a bool, default False; a snapshot's config without it reads False), checked
    before the subclass's own ``__post_init__``; the definition then gains the flag ``cautious`` (its last)."""

    cautious: bool = dataclasses.field(default=False, kw_only=True)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        own = cls.__dict__.get("__post_init__")
        if own is None or getattr(own, "checks_cautious", False):
            return

        def __post_init__(self: Any) -> None:
            _check_cautious(self)
            own(self)

        __post_init__.checks_cautious = True  # type: ignore[attr-defined]
        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        _check_cautious(self)


def _check_cautious(cfg: Any) -> None:
    if not isinstance(cfg.cautious, bool):
        raise TypeError(f"{type(cfg).__name__.removesuffix('Config')}: cautious must be a bool, got {cfg.cautious!r}")


class Definition:
    def __init__(self, name: str, step: Callable, *, scalars: Callable, flags: Callable, flag_names: tuple,
                 slots: tuple, example: Any, valid: Callable[[dict], bool] | None = None, host: tuple = (),
                 wide_maps: bool = False, register: bool = True):
        self.name, self.step_fn, self.scalars_fn, self.flags_fn = name, step, scalars, flags
        self.cautious = isinstance(example, Cautious)  # the flag ``cautious`` (last): the step calls e.cautious
        self.flag_names = tuple(flag_names) + (("cautious",) if self.cautious else ())
        self.slots, self.example = tuple(slots), example
        params = list(inspect.signature(step).parameters)
        self.arrays = tuple(params[1:3]) + self.slots  # p, g, then the slots
        if tuple(params[3:3 + len(self.slots)]) != self.slots:
            raise TypeError(f"{name}.step's arguments after p, g must be its slots {self.slots}")
        self.host = tuple(host)
        self.wide_maps = wide_maps  # its map kernels after a fold: __launch_bounds__(256, 1) (emit.py, ptxas spills)
        self.example_host = (1.0,) * len(self.host)  # the host values the snapshots' scalar shapes are traced with
        self.scalar_names = tuple(scalars(example, 1, 1.0, *self.example_host))
        self.valid = valid or (lambda f: True)
        self.source = Path(inspect.getsourcefile(step) or "?")
        if register:
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

    # unbounded: the keys are the definitions' flag sets (~150 in all, more than a bound of 64 would keep: the
    # import alone evicted entries that the steps then traced and split again)
    @functools.lru_cache(maxsize=None)  # noqa: B019 - one Definition per algorithm, alive as long as its module
    def program_at(self, fs: int) -> tr.Program:
        """The traced program of flag set number ``fs`` (cached)."""
        f = {n: bool(fs >> k & 1) for k, n in enumerate(self.flag_names)}
        return tr.trace(self.name, self.step_fn, self.arrays, self.scalar_names, f)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - as program_at
    def split_at(self, fs: int) -> "reduce.Split | None":
        """Flag set ``fs``'s program cut at its sums (``reduce.split``), or None when it has no sum."""
        return reduce.split(self.program_at(fs), self.arrays, self.scalar_names)

    def plain_flag_sets(self) -> list[dict]:
        """The flag sets without a sum (elementwise: one C loop and one pair of CUDA kernels each)."""
        return [f for f in self.flag_sets() if self.split_at(self.index(f)) is None]

    def has_sums(self) -> bool:
        """Whether some flag set sums over the tensor (the optimizer is then not elementwise)."""
        return any(self.split_at(self.index(f)) is not None for f in self.flag_sets())

    def program(self, f: dict) -> tr.Program:
        return self.program_at(self.index(f))

    @functools.lru_cache(maxsize=256)  # noqa: B019
    def flags_of(self, cfg: Any, t: int, host: tuple = ()) -> int:
        """The index of the flag set of a step (``host``: the definition's host values)."""
        f = self.flags_fn(cfg, t, *host)
        if self.cautious:
            f = {**f, "cautious": cfg.cautious}
        if tuple(f) != self.flag_names:
            raise ValueError(f"{self.name}.flags returned {tuple(f)}, declared {self.flag_names}")
        return self.index(f)

    def state_arrays(self, st: Any, p: Any) -> tuple:
        """The slots' arrays of a state (``p`` standing in for an absent one: a flag set that has it never reads
        or writes it)."""
        return tuple(p if getattr(st, k) is None else getattr(st, k) for k in self.slots)


def define(name: str, step: Callable, **kw: Any) -> Definition:
    return Definition(name, step, **kw)

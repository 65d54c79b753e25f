"""The optimizer class of an elementwise algorithm, derived from its definition (``ElementwiseOptimizer``).

An algorithm module declares its class with its definition, and keeps its own constructor (the signature users and
``help`` read)::

    class AdamW(ElementwiseOptimizer, definition=DEF, only_if={"vmax": lambda cfg: cfg.amsgrad}):
        def __init__(self, lr=1e-3, ..., *, cautious=False, lr_scale=None, weight_decay_mask=None, precision=None):
            super().__init__(AdamWConfig(lr, ..., cautious=cautious), lr_scale=lr_scale,
                             weight_decay_mask=weight_decay_mask, precision=precision)

From the definition the class receives ``algorithm`` (its name, the checkpoint id), ``config_cls`` (its example
config's type), its state dataclass ``<Class>State`` and ``init_fn``, and the paths: ``run.bind`` (``update_fn``,
``kernel_fn``, ``multi_tensor``, ``scratch_buffers``; ``elementwise``), or, for a definition that sums over the
tensor without ``cautious`` (Lamb, Mars), ``run.bind_reduce`` (those, less the scratch, plus ``np_phases_fn`` and
``np_rows_fn``).  An attribute the class body sets itself is kept.  The state holds one array per slot, in the
definition's order (the snapshot's field names and order), zeros of the parameter's dtype at ``init``; a slot named
in ``only_if`` is allocated only where its condition on the config holds (else ``None``: a flag set that reads it
never runs); ``host_state`` adds per-parameter host numbers with their initial values (saved as JSON scalars); a
``run.bind_reduce`` class's state has the unsaved field ``work`` (the sums' work area, the kernels' partials).
With ``cautious=True`` a ``run.bind`` class's object runs the reduce-then-map forms (``run.configure`` at
construction: the mask's count is a sum).
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Any, Callable, ClassVar, Mapping

from ..driver import PerParamOptimizer
from ..precision import Precision
from ..types import DecayMask, LrScale
from . import run
from .define import Definition

PATHS = """Every path is derived from the definition (``DEF``, its ``step``; ``core/elementwise``): the NumPy/CuPy
path (the reference), the compiled C pass that runs it on the CPU where a C compiler exists (the same bits;
otherwise the NumPy path runs), and the per-tensor and multi-tensor CUDA kernels (the snapshots in
``kernels/generated/``): the same rounded operations in the same order on each."""


class ElementwiseOptimizer(PerParamOptimizer):
    __doc__ = PATHS  # the base of every elementwise algorithm's class (the module docstring says how)

    definition: ClassVar[Definition]

    def __init_subclass__(cls, definition: Definition | None = None,
                          only_if: Mapping[str, Callable[[Any], bool]] | None = None,
                          host_state: Mapping[str, float] | None = None, **kw: Any) -> None:
        if definition is not None:
            _derive(cls, definition, dict(only_if or {}), dict(host_state or {}))
        super().__init_subclass__(**kw)
        if definition is not None and cls.__doc__:
            cls.__doc__ += "\n\n" + textwrap.fill(" ".join(PATHS.split()), 116)

    def __init__(self, config: Any, *, lr_scale: LrScale = None, weight_decay_mask: DecayMask = None,
                 precision: Precision | None = None) -> None:
        super().__init__(config, lr_scale=lr_scale, weight_decay_mask=weight_decay_mask, precision=precision)
        if type(self).elementwise:
            run.configure(self, self.definition)  # cautious: the reduce-then-map forms (run.py)


def _derive(cls: type, d: Definition, only_if: dict, host_state: dict) -> None:
    unknown = sorted(set(only_if) - set(d.slots))
    if unknown:
        raise TypeError(f"{cls.__name__}: only_if names {unknown}, not slots of {d.name} {d.slots}")
    sums = any(d.split_at(d.index(f)) is not None for f in d.flag_sets() if not f.get("cautious"))
    if sums:
        bound = dict(run.bind_reduce(d), elementwise=False)
    else:
        update, kernel, multi, scratch = run.bind(d)
        bound = dict(update_fn=update, kernel_fn=kernel, multi_tensor=multi, scratch_buffers=scratch,
                     elementwise=True)
    fields: list = [(k, Any, dataclasses.field(default=None)) for k in d.slots]
    fields += [(k, float, dataclasses.field(default=v)) for k, v in host_state.items()]
    if sums:
        fields.append(("work", Any, dataclasses.field(default=None, metadata={"persist": False})))
    state = dataclasses.make_dataclass(f"{cls.__name__}State", fields)
    state.__module__ = cls.__module__

    def init(xp: Any, cfg: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        n = math.prod(shape)
        return state(**{k: xp.zeros(n, dtype) for k in d.slots if k not in only_if or only_if[k](cfg)})

    bound.update(algorithm=d.name, config_cls=type(d.example), definition=d, init_fn=init)
    for k, v in bound.items():
        if k not in vars(cls):
            setattr(cls, k, staticmethod(v) if k.endswith("_fn") else v)

"""The extension points of the per-parameter driver, as one typed object (``PerParamOptimizer.hooks``).

An algorithm class changes what the driver does for it only through its ``Hooks``: it starts from the driver's
(``init``, ``update``, ``kernel_update``, ``effective_lr`` bound to the class's ``init_fn``/``update_fn``/
``kernel_fn``) and replaces fields with ``hooks.replace(...)`` in its ``__init__``.  Each field has one signature;
``LrT`` is what the algorithm's step functions receive as ``lr`` (a float for most, Adafactor8Bit's ``(base lr,
lr_scale)`` pair), fixed by ``effective_lr``.  ``run`` and ``prepare`` are ``None`` unless replaced: then the
driver's own execution and validation run, and only then may it keep a batch's work for later steps
(``core.step_plan``), whose checks mirror them.

The checkpoint methods (``_config_key``, ``_config_dict``, ``_extra_state``, ``_check_extra``, ``_load_extra``,
``_build_from_state``) stay methods: each has one signature, and a subclass extends them with ``super()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

import numpy as np

from .types import Array, OptItem

LrT = TypeVar("LrT")
LrT_contra = TypeVar("LrT_contra", contravariant=True)


class InitFn(Protocol):
    def __call__(self, name: str, xp: Any, shape: tuple[int, ...], dtype: np.dtype[Any], /) -> Any:
        """A fresh state for parameter ``name`` (created with ``xp``, on the current device)."""


class UpdateFn(Protocol[LrT_contra]):
    def __call__(self, xp: Any, state: Any, param: Array, grad: Array, /, *, t: int, lr: LrT_contra,
                 scratch: list[Array]) -> None:
        """Update ``param`` (and ``state``) in place: the array-agnostic step (NumPy chunks, or the CuPy twin)."""


class KernelFn(Protocol[LrT_contra]):
    def __call__(self, state: Any, param: Array, grad: Array, /, *, t: int, lr: LrT_contra) -> bool:
        """The fused CUDA step; False: it did nothing and the twin (``update``) runs."""


@dataclasses.dataclass(frozen=True)
class Hooks(Generic[LrT]):
    """What an algorithm plugs into the driver (see the module doc)."""

    init: InitFn
    update: UpdateFn[LrT]
    effective_lr: Callable[[float], LrT]  # the lr_scale of a name -> the ``lr`` its step receives
    kernel_update: KernelFn[LrT]
    check_shape: Callable[[str, tuple[int, ...]], None]  # raise for a shape the algorithm cannot step
    # CuPy: step every ``(item, slot, lr)`` of a step at once (segmented kernels); False: nothing done, per item
    kernel_batch: Callable[[list[Any]], bool] | None = None
    # replaces the driver's execution of the prepared ``(item, slot, lr_scale)`` entries (which advances ``t``)
    run: Callable[[list[Any]], None] | None = None
    # replaces the driver's validation and state creation (no step plans are kept then)
    prepare: Callable[[Sequence[OptItem]], list[Any]] | None = None
    # ``update`` takes a contiguous range of any length and cuts it into pieces of its scratch's length itself where
    # it needs cache-sized chunks (the generated elementwise algorithms: their compiled pass streams each array once,
    # so core.cpu_plan gives it one range per task, one call, instead of one call per chunk)
    ranges: bool = False

    def replace(self, **changes: Any) -> Hooks[Any]:
        """These hooks with ``changes`` (field name -> new value); a replaced ``update`` takes chunks (``ranges``
        False) unless ``changes`` says otherwise."""
        if "update" in changes:
            changes.setdefault("ranges", False)
        return dataclasses.replace(self, **changes)

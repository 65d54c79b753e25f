"""Public types: the ``Optimizer`` protocol, ``OptItem`` and ``OptimizerState``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

FORMAT_VERSION = 1


class OptItem(NamedTuple):
    """One parameter of a ``step_batch``: a name, its logical shape, a flat param buffer and its flat gradient."""

    name: str
    shape: tuple[int, ...]
    param: Any
    grad: Any


@dataclass
class OptimizerState:
    """A complete, versioned snapshot of an optimizer.

    ``buffers`` maps ``"<slot>/<parameter name>"`` to an array (NumPy or CuPy, as stored by the optimizer);
    ``params`` maps each parameter name to its JSON-able metadata (``shape``, ``dtype``, step count ``t`` and any
    scalar state of the algorithm); ``extra`` holds optimizer-wide JSON-able state (iteration counters, RNG
    state, ...).  ``config`` is the full configuration the snapshot was taken with; ``config_key`` the part of it
    that must match for the snapshot to load.
    """

    algorithm: str
    config: dict
    config_key: dict
    step: int = 0
    params: dict[str, dict] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


@runtime_checkable
class Optimizer(Protocol):
    """What every flatopt optimizer implements (see DESIGN §1)."""

    def step(self, name: str, shape: tuple[int, ...], param: Any, grad: Any) -> None: ...

    def step_batch(self, items: Sequence[OptItem]) -> None: ...

    def end_iteration(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def lr_scale(self, name: str) -> float: ...

    def state_dict(self) -> OptimizerState | None: ...

    def load_state_dict(self, state: OptimizerState) -> bool: ...

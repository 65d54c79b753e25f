"""Public types: the ``Optimizer`` protocol, ``OptItem`` and ``OptimizerState``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, TypeAlias, Union, runtime_checkable

FORMAT_VERSION = 1

Array: TypeAlias = Any
"""A NumPy ``ndarray`` or a CuPy ``ndarray`` (parameters, gradients, state buffers).  ``Any`` for the type checker:
CuPy is optional and ships no type information, and one alias covers both backends."""

LrScale: TypeAlias = Union[Mapping[str, float], Callable[[str], float], None]
# which parameters get weight decay: name -> bool (missing names: True) or a callable name -> bool; None: all
DecayMask: TypeAlias = Union[Mapping[str, bool], Callable[[str], bool], None]
"""The ``lr_scale=`` argument of the optimizers: a mapping name -> multiplier (missing names: 1.0), a callable
``name -> multiplier``, or ``None`` (1.0 everywhere)."""

JSONDict: TypeAlias = dict[str, Any]
"""A JSON-able mapping (configuration, per-parameter metadata, optimizer-wide extra state)."""


class OptItem(NamedTuple):
    """One parameter of a ``step_batch``: a name, its logical shape, a flat param buffer and its flat gradient."""

    name: str
    shape: tuple[int, ...]
    param: Array
    grad: Array


@dataclass
class OptimizerState:
    """A complete, versioned snapshot of an optimizer.

    ``buffers`` maps ``"<slot>/<parameter name>"`` to an array (NumPy or CuPy, as stored by the optimizer);
    ``params`` maps each parameter name to its JSON-able metadata (``shape``, ``dtype``, step count ``t`` and any
    scalar state of the algorithm); ``extra`` holds optimizer-wide JSON-able state (iteration counters, RNG
    state, ..., and ``lr``: the learning rate in effect, what ``set_lr`` last set).  ``config`` is the full configuration the snapshot was taken with; ``config_key`` the part of it
    that must match for the snapshot to load.
    """

    algorithm: str
    config: JSONDict
    config_key: JSONDict
    step: int = 0
    params: dict[str, JSONDict] = field(default_factory=dict)
    buffers: dict[str, Array] = field(default_factory=dict)
    extra: JSONDict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


@runtime_checkable
class Optimizer(Protocol):
    """What every flatopt optimizer implements; ``isinstance(opt, flatopt.Optimizer)`` checks for it.

    Parameters are addressed by name.  A parameter is a contiguous 1-D float32/float64 buffer (NumPy, or CuPy on
    the GPU) of ``prod(shape)`` elements that the optimizer updates **in place**; its gradient is a buffer of the
    same size, dtype and backend that is **never written**.  Bad input raises ``ValueError``/``TypeError`` naming
    the parameter before any buffer or state changes.  State is created lazily at a name's first step, and each
    name keeps its own step count, so a parameter without a gradient this iteration is simply not stepped.
    """

    def step(self, name: str, shape: tuple[int, ...], param: Array, grad: Array) -> None:
        """Update parameter ``name`` in place from its gradient.

        ``shape`` is the logical shape (matrix algorithms read rows and columns from it); ``param`` and ``grad``
        are flat, contiguous, of ``prod(shape)`` elements, the same dtype (float32 or float64) and backend, and
        not overlapping.  Raises ``ValueError``/``TypeError`` naming the parameter, changing nothing, for a wrong
        size, dtype, backend, a strided or aliased buffer, or a name seen before with another shape or dtype.
        Equivalent to ``step_batch([OptItem(name, shape, param, grad)])``."""
        ...

    def step_batch(self, items: Sequence[OptItem]) -> None:
        """Update every item's parameter; bit for bit the same as calling ``step`` on each item in order.

        Every item is validated before any is touched, so a bad item changes nothing.  Independent work may run
        on a thread pool (large buffers in chunks, small ones bucketed together; on CuPy each worker on its own
        stream, without host synchronisation).  The same name twice in one batch is an error."""
        ...

    def end_iteration(self) -> None:
        """Mark the end of one training iteration: advance the optimizer-wide counters (the iteration count,
        saved in ``state_dict``; where an algorithm has schedules or refresh cadences, its docstring says which
        counter they follow).  Per-parameter step counts advance inside ``step``."""
        ...

    def set_lr(self, lr: float) -> None:
        """Set the base learning rate from the next step on; ``lr_scale(name)`` still multiplies it per name.
        A schedule is ``opt.set_lr(schedule(step))`` each iteration (``flatopt.schedules``).  A negative or
        non-finite value raises ``ValueError``."""
        ...

    def lr_scale(self, name: str) -> float:
        """The multiplier of the base learning rate for parameter ``name`` (1.0 unless configured with the
        ``lr_scale=`` mapping or callable at construction)."""
        ...

    def state_dict(self) -> OptimizerState | None:
        """A complete, versioned snapshot of the optimizer (arrays copied, on the backend they live on): every
        parameter's state and step count, optimizer-wide counters and RNG state.  ``flatopt.save(path, opt)``
        writes it to one ``.npz`` file without pickle."""
        ...

    def load_state_dict(self, state: OptimizerState) -> bool:
        """Restore a snapshot so that training continues bit for bit as if it had not stopped.

        Returns ``False`` and changes nothing when the snapshot belongs to another algorithm or format version,
        a configuration that changes the state's meaning, or a parameter shape that does not fit; ``True`` when
        it loaded; a snapshot malformed in any field is refused the same way.  The learning rate in effect (what
        ``set_lr`` last set) is training state and is restored; constructor hyper-parameters (betas, ...) stay
        those of this object.  Read a file with ``flatopt.load(path)`` and pass the result."""
        ...

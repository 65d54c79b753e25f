"""flatopt's public exception types.

:class:`IncompatibleStateError` (a ``ValueError``): a snapshot that does not belong to the optimizer it is loaded
into (another algorithm, a configuration field that matters, a parameter shape, a format version); raised by
``load_state_dict(state, strict=True)`` of every optimizer, whose message (also in ``last_load_notes`` after a
non-strict ``False``) names the parameter or field.

The exception family of :class:`flatopt.MuonAdamW` (after ``MuonError`` of the Rust crate ruda-optim 0.21.13, a
fork of Burn's optimizers):

Every error derives from :class:`MuonError`, itself a ``ValueError`` (the dtype and backend errors are also
``TypeError`` s), so code written against the generic Optimizer contract (``ValueError``/``TypeError``) keeps
working, and code that cares can catch the specific class.  Every message names the parameter concerned.

Construction: :class:`InvalidConfig`, :class:`EmptyMuonGroup`, :class:`DuplicateParameter`,
:class:`UnknownParameter`, :class:`ExpectedMatrix` (:class:`EmptyMatrix`).
Step (raised before any state or buffer changes): :class:`InvalidLearningRate`, :class:`UnusedGradients`,
:class:`DuplicateParameter`, :class:`ModelChanged`, :class:`ShapeMismatch`, :class:`DTypeMismatch`,
:class:`DeviceMismatch`, :class:`InvalidBuffer`, :class:`TiedParameterMismatch`, :class:`InvalidStep`.
Loading (``try_load_record``; nothing changes): :class:`IncompatibleRecord` and its subclasses
:class:`RecordVersionMismatch`, :class:`ConventionMismatch`, :class:`ConfigMismatch`, :class:`ManifestMismatch`,
:class:`GroupingMismatch`, :class:`RoleMismatch`, :class:`StateMismatch`.
"""

from __future__ import annotations


class IncompatibleStateError(ValueError):
    """A snapshot (``OptimizerState``) that does not belong to the optimizer it is loaded into; nothing was
    changed.  The message names the parameter or configuration field and what differs."""


class MuonError(ValueError):
    """Base of every MuonAdamW error."""


# ------------------------------------------------------------------------------------------- construction
class InvalidConfig(MuonError):
    """A Muon/AdamW setting, the lr or ``adamw_lr_ratio`` is invalid, or the manifest is malformed."""


class EmptyMuonGroup(MuonError):
    """``muon_names`` is empty (use :class:`flatopt.AdamW` alone if nothing should go to Muon)."""


class DuplicateParameter(MuonError):
    """A name listed twice (in ``muon_names``, in the manifest/aliases, or twice in one step)."""


class UnknownParameter(MuonError):
    """A name that is not in the manifest (``params``) or an alias that points nowhere."""


class ExpectedMatrix(MuonError):
    """A parameter selected for Muon is not 2-D."""


class EmptyMatrix(ExpectedMatrix):
    """A parameter selected for Muon has a zero dimension."""


# ---------------------------------------------------------------------------------------------------- step
class InvalidLearningRate(MuonError):
    """A learning rate (or lr·s, lr·λ, lr_scale) that is negative or not finite in float32."""


class UnusedGradients(UnknownParameter):
    """A gradient for a name the manifest does not know (it would silently not be applied)."""


class ModelChanged(MuonError):
    """An item's shape differs from the shape fixed in the manifest."""


class ShapeMismatch(MuonError):
    """A param or grad buffer whose size does not match the manifest shape."""


class DTypeMismatch(MuonError, TypeError):
    """grad dtype != param dtype, or a dtype other than the manifest's (or than the state's)."""


class DeviceMismatch(MuonError, TypeError):
    """param and grad on different backends (NumPy vs CuPy) or different GPUs."""


class InvalidBuffer(MuonError):
    """A buffer the generic contract rejects (not 1-D contiguous, read-only, param aliasing grad, ...)."""


class TiedParameterMismatch(MuonError):
    """Two names of one tied parameter given with different param (or grad) buffers."""


class InvalidStep(MuonError):
    """A check of a sub-optimizer failed (e.g. state created with another dtype); the message says which."""


# ------------------------------------------------------------------------------------------------- records
class IncompatibleRecord(MuonError, IncompatibleStateError):
    """A record (``OptimizerState``) that does not belong to this optimizer; nothing was changed."""


class RecordVersionMismatch(IncompatibleRecord):
    """Another algorithm or record/format version."""


class ConventionMismatch(IncompatibleRecord):
    """The Muon momentum convention differs ("ema" buffers are (1 − μ) times "sgd" buffers)."""


class ConfigMismatch(IncompatibleRecord):
    """Another Muon/AdamW configuration or ``adamw_lr_ratio`` (the config key differs)."""


class ManifestMismatch(IncompatibleRecord):
    """Another set of parameters, shapes, dtypes or aliases."""


class GroupingMismatch(IncompatibleRecord):
    """The same parameters, but another selection of Muon names."""


class RoleMismatch(IncompatibleRecord):
    """A state stored under a role its parameter does not have (e.g. a Muon buffer for an AdamW parameter)."""


class StateMismatch(IncompatibleRecord):
    """A state whose shape, dtype, step count or buffers do not fit the manifest."""

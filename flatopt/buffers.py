"""Flat buffers without the silent-copy trap: ``flat_view``, ``pack`` and ``pack_like``.

An optimizer updates the 1-D buffer it is given **in place**.  ``param.reshape(-1)`` returns a view only when
``param`` is C-contiguous; on a transposed, Fortran-ordered or sliced array it returns a *copy*, the optimizer
updates the copy and the model never changes, with no error.  :func:`flat_view` returns the view or raises::

    w = flatopt.flat_view(W)              # ValueError if W.T, np.asfortranarray(W), W[:, :k], ...
    opt.step("W", W.shape, w, flatopt.flat_view(dW))

:func:`pack` lays a dict of named shapes out in one flat buffer (what users of flat buffers write by hand) and
returns the buffer and a view of the right shape per name; :func:`pack_like` does the same and copies existing
arrays in.  Each view's ``flat_view`` is its 1-D slice of the buffer, so one buffer can be stepped per name or
(for per-element algorithms such as SGD and AdamW) as a whole.  NumPy and CuPy arrays alike; the CuPy
specifics live in ``flatopt.core.backend``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .core import backend as _backend
from .core.types import Array
from .core.validate import check_shape

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["flat_view", "pack", "pack_like"]


def flat_view(array: Array) -> Array:
    """A 1-D view of the NumPy or CuPy ``array`` that shares its memory (``reshape(-1)`` that never copies).

    Raises ``ValueError`` when ``array`` is not C-contiguous (transposed, Fortran-ordered, sliced along a
    non-leading axis, ...): no 1-D view of it exists, and a copy would be updated instead of the parameter.
    ``TypeError`` for anything that is not a NumPy or CuPy array (a list, a torch tensor: convert it first, e.g.
    ``tensor.numpy()``, which shares memory)."""
    return _backend.flat_view(array)


def pack(shapes: Mapping[str, Sequence[int]], dtype: DTypeLike = np.float32,
         xp: Any = np) -> tuple[Array, dict[str, Array]]:
    """``(flat, views)``: one zero-filled 1-D buffer of ``dtype`` holding every named shape back to back (in the
    mapping's order), and ``{name: view of flat with that shape}``.

    Writing into a view writes into ``flat`` and the other way round, so an optimizer stepping
    ``flat_view(views[name])`` (or ``flat`` as one parameter) updates the arrays the model reads.  ``xp`` is the
    array module (``numpy``, or ``cupy`` for a GPU buffer).  Raises ``ValueError``/``TypeError`` naming the entry
    for a shape that is not a sequence of non-negative ints."""
    if not isinstance(shapes, Mapping):
        raise TypeError(f"pack: shapes must be a mapping name -> shape, got {type(shapes).__name__}")
    layout = []
    offset = 0
    for name, shape in shapes.items():
        shape = check_shape(str(name), shape)
        n = math.prod(shape)
        layout.append((name, shape, offset, n))
        offset += n
    flat = xp.zeros(offset, dtype=dtype)
    return flat, {name: flat[o:o + n].reshape(shape) for name, shape, o, n in layout}


def pack_like(arrays: Mapping[str, Array], dtype: DTypeLike | None = None) -> tuple[Array, dict[str, Array]]:
    """:func:`pack` for existing arrays: ``(flat, views)`` with each array's values copied into its view.  The
    arrays are not changed; use the returned views from now on (they share memory with ``flat``).  ``dtype``
    defaults to the arrays' common dtype; the array module (NumPy or CuPy) is theirs (mixing them is a
    ``TypeError``)."""
    if not isinstance(arrays, Mapping) or not arrays:
        raise TypeError("pack_like: arrays must be a non-empty mapping name -> array")
    xp = _backend.array_module(*arrays.values())
    if dtype is None:
        dtype = xp.result_type(*(a.dtype for a in arrays.values()))
    flat, views = pack({name: a.shape for name, a in arrays.items()}, dtype=dtype, xp=xp)
    for name, a in arrays.items():
        views[name][...] = a
    return flat, views

"""CuPy 14's real call signatures, read from the installed ``cupy`` package (its Python API imports without a GPU).

``check(name, args, kwargs)`` raises the ``TypeError`` real CuPy raises when ``cupy.<name>`` (a function, a ufunc,
``ufunc.<method>`` or ``ndarray.<method>``) is called with arguments its signature does not accept; an unknown
name raises ``AttributeError`` as on CuPy.  Sources of the signatures, in order:

* ``inspect.signature`` of the real function (plain Python functions, CuPy's gufuncs);
* the first line of the docstring (Cython functions, ufuncs, ``ndarray`` methods: CuPy writes the signature there,
  e.g. ``add(x1, x2, /, out=None, \\*, casting='same_kind', dtype=None)``);
* for functions that take ``**kwargs`` (``einsum``), the keywords their source pops (``kwargs.pop('dtype', ...)``):
  CuPy raises ``TypeError: Did not understand the following kwargs`` for any other (``out=`` in particular).

``tests/test_cuda_emu.py`` checks these readings against the installed CuPy.
"""

from __future__ import annotations

import functools
import inspect
import re

try:
    import cupy as _real  # noqa: F401 - the installed CuPy (test extra); imports without a GPU
except Exception:  # pragma: no cover - no CuPy: the stand-in is then only as strict as its hand-written parts
    _real = None

REAL_CUPY = _real


def _split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _sig_from_doc(obj) -> inspect.Signature | None:
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    if not doc:
        return None
    m = re.match(r"^[\w.]+\((.*)\)\s*(->.*)?$", doc[0].strip())
    if not m:
        return None
    parts = []
    for p in _split_params(m.group(1).replace("\\*", "*")):
        if p in ("self",):
            continue
        name, eq, _ = p.partition("=")
        parts.append(f"{name.strip()}=None" if eq else name.strip())
    ns: dict = {}
    try:
        exec(f"def f({', '.join(parts)}): pass", ns)  # noqa: S102 - parameter names from CuPy's own docstrings
    except SyntaxError:
        return None
    return inspect.signature(ns["f"])


def _popped_kwargs(fn) -> frozenset | None:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    if "Did not understand the following kwargs" not in src:
        return None
    return frozenset(re.findall(r"kwargs\.pop\(\s*['\"](\w+)['\"]", src))


class Rule:
    """How to check one callable: a signature to bind, or the keywords a ``**kwargs`` function accepts."""

    def __init__(self, qualname: str, sig: inspect.Signature | None, kwargs_only: frozenset | None = None):
        self.qualname, self.sig, self.kwargs_only = qualname, sig, kwargs_only

    def check(self, args, kwargs) -> None:
        if self.kwargs_only is not None:
            bad = sorted(set(kwargs) - self.kwargs_only)
            if bad:
                raise TypeError(f"cupy.{self.qualname}: Did not understand the following kwargs: {bad} "
                                f"(CuPy accepts {sorted(self.kwargs_only)})")
            return
        if self.sig is None:
            return
        try:
            self.sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"cupy.{self.qualname}{self.sig}: {exc}") from None


@functools.lru_cache(maxsize=None)
def rule(qualname: str) -> Rule:
    """The rule of ``cupy.<qualname>`` (``"einsum"``, ``"add"``, ``"add.reduce"``, ``"ndarray.astype"``)."""
    if _real is None:
        return Rule(qualname, None)
    obj = _real
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module 'cupy' has no attribute {qualname!r} (real CuPy 14 lacks it)")
        obj = getattr(obj, part)
    popped = _popped_kwargs(obj)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        if popped is not None:
            return Rule(qualname, None, popped)
        doc = _sig_from_doc(obj)
        if doc is not None and not any(p.kind is p.VAR_KEYWORD for p in doc.parameters.values()):
            return Rule(qualname, doc)
        return Rule(qualname, sig)  # genuinely open keywords
    if sig is None:
        sig = _sig_from_doc(obj)
    if sig is not None and sig.parameters and next(iter(sig.parameters)) == "self":
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return Rule(qualname, sig)


def has(qualname: str) -> bool:
    try:
        rule(qualname)
        return True
    except AttributeError:
        return False


def check(qualname: str, args, kwargs) -> None:
    rule(qualname).check(args, kwargs)

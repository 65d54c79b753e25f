"""One definition per elementwise algorithm, and the paths derived from it (``define``: the definition;
``trace``: the instruction list; ``lower_numpy``: the NumPy/CuPy path; ``emit``: the C and CUDA sources;
``run``: what an optimizer class binds).  The engine imports no algorithm: the definitions register themselves
(``define.REGISTRY``) when their modules are imported.  ``python -m flatopt.core.elementwise`` prints a lowering
and rewrites the committed snapshots (``flatopt/kernels/generated/``)."""

from .define import REGISTRY, Definition, define

__all__ = ["REGISTRY", "Definition", "define"]

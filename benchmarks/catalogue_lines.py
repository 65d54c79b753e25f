"""The size of the elementwise catalogue, in lines: what carries the math and the paths of the ten elementwise
algorithms that had hand-written C and CUDA (the same ten on any checkout, so that ``--root`` an older one compares;
the algorithms added on the generator since are not counted).

    python -m benchmarks.catalogue_lines [--root PATH]

Counted: the ten elementwise algorithm modules (``flatopt/{sgd,adamw,adam,nadamw,radam,qhadamw,lion,lamb,mars,
sophia}.py``), the generator (``flatopt/core/elementwise/*.py``), ``core/multi_tensor.py``, ``core/native.py``,
``kernels/sq_sum.cuh`` (the blocked sums: once included by Lamb's and Mars's kernels, now pasted by the generator),
``kernels/cpu/elementwise.c`` and the hand-written CUDA of those algorithms (their ``kernels/<algo>.cu`` and the
headers those include) where they exist; the generated snapshots (``kernels/generated/``) are counted apart.  Two
counts per file: all lines, and code lines (not blank, not only a comment, not a docstring: Python docstrings are
found with ``ast``, comments with ``tokenize``; C and CUDA ``//`` and ``/* */`` comments are stripped).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import tokenize
from pathlib import Path

ALGORITHMS = ("sgd", "adamw", "adam", "nadamw", "radam", "qhadamw", "lion", "lamb", "mars", "sophia")
_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"', re.M)
_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def catalogue(root: Path) -> tuple[list[Path], list[Path]]:
    """(the catalogue's files, the generated snapshots) that exist under ``root``."""
    pkg = root / "flatopt"
    files = [pkg / f"{a}.py" for a in ALGORITHMS]
    files += sorted((pkg / "core" / "elementwise").glob("*.py"))
    files += [pkg / "core" / "multi_tensor.py", pkg / "core" / "native.py", pkg / "kernels" / "cpu" / "elementwise.c"]
    cuda = [pkg / "kernels" / f"{a}.cu" for a in ALGORITHMS]
    headers = sorted({pkg / "kernels" / h for cu in cuda if cu.exists() for h in _INCLUDE.findall(cu.read_text())}
                     | {pkg / "kernels" / "sq_sum.cuh"})
    files = [f for f in files + cuda + headers if f.exists()]
    return files, sorted((pkg / "kernels" / "generated").glob("*"))


def code_lines(path: Path) -> int:
    text = path.read_text()
    if path.suffix != ".py":
        return sum(1 for ln in _C_COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text).splitlines()
                   if ln.strip())
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        code.update(ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in docstrings)
    return len(code)


def report(root: Path) -> tuple[int, int, int, int]:
    files, generated = catalogue(root)
    total = [0, 0]
    for f in files:
        n, c = len(f.read_text().splitlines()), code_lines(f)
        total[0] += n
        total[1] += c
        print(f"{n:6d} {c:6d}  {f.relative_to(root)}")
    gen = [sum(len(f.read_text().splitlines()) for f in generated), sum(code_lines(f) for f in generated)]
    print(f"{total[0]:6d} {total[1]:6d}  the elementwise catalogue ({len(files)} files; all lines, code lines)")
    print(f"{gen[0]:6d} {gen[1]:6d}  the generated snapshots apart (kernels/generated/, {len(generated)} files)")
    return total[0], total[1], gen[0], gen[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    report(ap.parse_args().root.resolve())


if __name__ == "__main__":
    main()

"""``python -m flatopt.core.elementwise show <algo> <trace|numpy|c|cuda>`` prints one lowering of a definition;
``python -m flatopt.core.elementwise regen`` rewrites the snapshots in ``flatopt/kernels/generated/``.

The command imports the package ``flatopt`` by name at run time (so that every definition registers itself); the
engine's modules import no algorithm."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from . import emit, lower_numpy, run
from .define import REGISTRY

OUT = Path(__file__).resolve().parent.parent.parent / "kernels" / "generated"


def sources() -> dict[str, str]:
    """{file name under kernels/generated: its text}, from every registered definition."""
    importlib.import_module("flatopt")
    defs = [REGISTRY[k] for k in sorted(REGISTRY)]
    return {"elementwise.c": emit.c_source(defs)} | {f"{d.name}.cu": _cuda(d) for d in defs}


def _cuda(d) -> str:
    return emit.cuda_source(d, run.generated_shape(d), f"flatopt/kernels/{run.cuda_file(d)}")


def show(algo: str, lowering: str) -> str:
    importlib.import_module("flatopt")
    d = REGISTRY[algo]
    if lowering in ("c", "cuda"):
        return emit.c_source([d]) if lowering == "c" else _cuda(d)
    lines = []
    for f in d.flag_sets():
        fs = d.index(f)
        lines.append(f"# {algo} flag set {fs}: {f}")
        sp = d.split_at(fs)  # reduce, then map (reduce.py): each level's parts, then the map
        parts = [("", d.program(f))] if sp is None else \
            [(f"{k}{level or ''}", getattr(lv, k)) for level, lv in enumerate(sp.levels) for k in ("reduce", "fold")] \
            + [("map", sp.map)]
        if sp is not None and sp.carried_map is not None and lowering == "numpy":  # rows, whole tensor: the carries
            parts += [(f"reduce{level or ''} (carry form)", lv.carrying) for level, lv in enumerate(sp.levels)]
            parts += [("map (carry form)", sp.carried_map)]
        for part, prog in parts:
            lines += [f"## {part}"] * bool(part)
            if lowering == "numpy" and not part.startswith("fold"):
                p = lower_numpy.allocate(prog, sp.carry if part == "map (carry form)" else ())
                lines += [f"{dst} = {op}{args}" for op, args, dst in p.steps]
                lines += [f"copy {src} -> {name}" for name, src in p.copies]
                lines += [f"# scratch buffers: {p.scratch}, boolean: {p.bools}"] * (not part)
            else:
                lines += [f"t{k} = {i.op}{i.args}    # line {i.line}" for k, i in enumerate(prog.instrs)]
                lines += [f"{name} <- {ref}" for name, ref in prog.outputs]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["show"] and len(argv) == 3:
        sys.stdout.write(show(argv[1], argv[2]))
        return 0
    if argv == ["regen"]:
        OUT.mkdir(exist_ok=True)
        for name, text in sources().items():
            (OUT / name).write_text(text)
            print(f"wrote {OUT / name}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

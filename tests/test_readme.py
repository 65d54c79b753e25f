"""Every ```python block of README.md and docs/*.md runs as written, and .ci/run installs as the README says.

A block runs in a fresh namespace, in a temporary folder (blocks write checkpoints), with flatopt imported from
this checkout.  A block that needs something a plain test machine may lack starts with a marker comment, which the
reader sees too::

    # needs: mpi4py            (a module that must be importable; several: "# needs: mpi4py, torch")
    # needs: gpu               (a CUDA device that answers)

and is skipped, with that reason, where its need is not met; otherwise it runs like any other block.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"\A#\s*needs:\s*([^\n(]*)")


def blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return out


BLOCKS = blocks()


def unmet(code: str) -> str | None:
    """The reason to skip, from a leading ``# needs:`` marker, or None."""
    m = NEEDS.match(code)
    if not m:
        return None
    for need in (n.strip() for n in m.group(1).split(",") if n.strip()):
        if need == "gpu":
            from flatopt.core import backend  # noqa: PLC0415

            if not backend.gpu_available():
                return "needs a CUDA device"
        elif importlib.util.find_spec(need) is None:
            return f"needs {need}"
    return None


def test_the_docs_have_python_blocks():
    where = {b[0].split(":")[0] for b in BLOCKS}
    assert "README.md" in where and len(BLOCKS) >= 4, where


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block_runs_as_written(where, code, tmp_path, monkeypatch, capsys):
    reason = unmet(code)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})  # noqa: S102 - our own documentation
    capsys.readouterr()


def test_quickstart_prints_the_loss_falling(tmp_path, monkeypatch, capsys):
    code = next(c for w, c in BLOCKS if w.startswith("README.md") and "flatopt.AdamW" in c and "loss" in c)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md:quickstart", "exec"), {"__name__": "__readme__"})  # noqa: S102
    losses = [float(v) for v in re.findall(r"loss\s+([0-9.]+)", capsys.readouterr().out)]
    assert len(losses) >= 3 and all(b < a for a, b in zip(losses, losses[1:])), losses


def test_ci_installs_exactly_as_the_readme_says():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("## Install"):]
    bash = install[install.index("```bash\n") + 8: install.index("```", install.index("```bash\n") + 8)]
    lines = [ln.split("  #")[0].strip() for ln in bash.splitlines() if ln.strip() and not ln.startswith("#")]
    tests = [ln for ln in lines if "[test" in ln]
    assert len(tests) == 1, lines  # one unambiguous line for the tests
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert tests[0] in ci, (tests[0], ci)
    assert "python -m pytest -q" in ci and "python -m pytest -q" in readme
    # and no GPU extra in the two lines: CuPy for a CUDA version is a separate choice
    assert not any("cuda12" in ln or "cuda13" in ln for ln in lines), lines


# ------------------------------------------------------------------- docstrings that stand on their own
PROTOCOL = ("step", "step_batch", "end_iteration", "set_lr", "lr_scale", "state_dict", "load_state_dict")


def _public_classes():
    import flatopt  # noqa: PLC0415
    from flatopt.distributed import Sharded  # noqa: PLC0415 - imports no MPI by itself
    from flatopt.routing import Router, Select  # noqa: PLC0415

    names = [n for n in flatopt.__all__ if isinstance(getattr(flatopt, n), type)]
    return [getattr(flatopt, n) for n in names] + [Router, Select, Sharded]


def test_every_public_class_and_protocol_method_has_a_docstring():
    missing = []
    for cls in _public_classes():
        if not (cls.__doc__ or "").strip():
            missing.append(cls.__name__)
        for attr in PROTOCOL:
            fn = getattr(cls, attr, None)
            if fn is not None and not (getattr(fn, "__doc__", None) or "").strip():
                missing.append(f"{cls.__name__}.{attr}")
    assert not missing, missing


def test_readme_main_job_rows_and_default_match_the_example():
    """The README says how many ``--optimizers`` the main job runs by default, and the main-job table of
    docs/performance.md has one row per optimizer, labelled as the job prints it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples" / "train_digits.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    names = list(job.optimizer_factories(job.param_shapes(1, 1)))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"`--optimizers` defaults to all {len(names)}" in text
    perf = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    section = perf.split("## Main job", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")][1:]
    assert rows == names


def test_help_of_every_optimizer_states_its_rule_arguments_and_defaults():
    """``help(flatopt.AdamW)`` (the class docstring) shows the update rule and defaults (its module's docstring,
    written once there), the constructor's signature line and the keyword arguments every optimizer shares, not a
    pointer to a module doc the reader does not see."""
    import inspect
    import sys

    for cls in _public_classes():
        if not (isinstance(cls, type) and hasattr(cls, "step_batch") and hasattr(cls, "state_dict")):
            continue
        if cls.__module__.startswith(("flatopt.core", "flatopt.routing", "flatopt.distributed")):
            continue
        doc = cls.__doc__ or ""
        rule = inspect.cleandoc(sys.modules[cls.__module__].__doc__ or "").splitlines()[0]
        assert rule in doc, f"{cls.__name__}: its module's docstring is not in help()"
        assert f"``{cls.__name__}(" in doc, f"{cls.__name__}: no signature line"
        assert "lr_scale" in doc and "see the module doc" not in doc, cls.__name__
        takes_mask = "weight_decay_mask" in inspect.signature(cls).parameters
        assert ("weight_decay_mask" in doc) == takes_mask, cls.__name__


def test_docstrings_cite_nothing_a_user_does_not_have():
    """No module of the package points at the project's private design notes (DESIGN.md, reference/*.md, their
    section numbers, or the seeds they came from)."""
    bad = re.compile(r"DESIGN(\.md| §)|reference/[\w-]+\.md|\bRUDA\b|seed crate|[Tt]he seed's (?!stream)|seed README")
    hits = []
    for path in sorted((ROOT / "flatopt").rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if bad.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


# ------------------------------------------------------------------- a front door, and docs a clone can follow
PUBLIC_DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
               *sorted((ROOT / "docs").glob("*.md"))]


def _optimizer_classes() -> list[str]:
    import flatopt  # noqa: PLC0415

    return [n for n in flatopt.__all__ if isinstance(getattr(flatopt, n), type)
            and hasattr(getattr(flatopt, n), "step_batch") and hasattr(getattr(flatopt, n), "state_dict")
            and not getattr(flatopt, n).__module__.startswith(("flatopt.core", "flatopt.routing"))]


def test_readme_is_a_front_door_with_one_row_per_algorithm():
    """At most 150 lines; its Algorithms table has exactly one row per public optimizer, each naming the reference
    it is compared with and its speed against it (a ratio, or what it is made of); the details live in docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    section = text.split("## Algorithms", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| `")]
    assert sorted(r[0].strip("`") for r in rows) == sorted(_optimizer_classes()), rows
    header = next(line for line in section.splitlines() if line.startswith("| class"))
    cols = [c.strip() for c in header.split("|")[1:-1]]
    ref, speed = cols.index("reference"), cols.index("speed vs reference")
    for r in rows:
        assert r[ref] and (re.search(r"\d\.\d+×", r[speed]) or r[speed] == "as its parts"), r


def test_public_docs_send_no_reader_outside_the_clone():
    """A clone has no ``../shared``: README, CONTRIBUTING, docs/ and benchmarks/README.md must not send a reader
    there, and every relative link they hold points at a file of the repository."""
    bad = []
    for path in PUBLIC_DOCS:
        text = path.read_text(encoding="utf-8")
        if "../shared" in text:
            bad.append(f"{path.relative_to(ROOT)}: ../shared")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (path.parent / target).exists():
                bad.append(f"{path.relative_to(ROOT)}: broken link {target}")
    assert not bad, "\n".join(bad)


HISTORY = re.compile(
    r"20\d\d-\d\d-\d\d"                                     # a date
    r"|\b(Xeon|EPYC|Zen \d|vCPU|Sapphire Rapids)\b"          # a machine
    r"|scratch script|not in the repository"                  # code a reader cannot run
    r"|(?<![\w.])\d+(\.\d+)? ?(ms|µs)\b"                     # a timing
    r"|\bcommit (?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"              # a commit id
    r"|\((?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\)")  # "before (1458a46)"


def test_source_comments_explain_code_not_history():
    """Comments and docstrings of the package, the tests and the examples quote no timings, dates, machines,
    commit ids or scripts outside the repository: a tuned constant says why, and names the command that
    re-measures it; the figures are in benchmarks/README.md beside that command."""
    hits = []
    files = [p for d in ("flatopt", "tests", "examples") for p in sorted((ROOT / d).rglob("*"))
             if p.suffix in (".py", ".c", ".cu", ".cuh", ".h") and p != Path(__file__).resolve()]
    for path in files:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_contributing_layout_names_every_file_of_the_package():
    """CONTRIBUTING.md's layout table is true for the tree: every module of ``flatopt/`` and every kernel source is
    named in the row of its folder (a kernel named after an algorithm is covered by "one ``.cu`` per algorithm"),
    every file of ``tests/cuda_emu/`` in the document, and every file the table names exists."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in layout.splitlines():
        if line.startswith("| `"):
            first, rest = line.split("|")[1], "|".join(line.split("|")[2:])
            for folder in re.findall(r"`(flatopt/[\w/]*/)`", first) or ["flatopt/"]:
                rows[folder] = rows.get(folder, "") + first + rest
    pkg = ROOT / "flatopt"
    algorithms = {p.stem for p in pkg.glob("*.py")} | {p.name for p in pkg.iterdir() if p.is_dir()}
    missing = []
    for path in sorted(pkg.rglob("*")):
        if path.suffix not in (".py", ".cu", ".cuh", ".c") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        folder = max((f for f in rows if rel.startswith(f)), key=len)
        name = rel[len(folder):]
        if (path.suffix == ".cu" and path.stem in algorithms) or (name == "__init__.py" and folder == "flatopt/core/"):
            continue  # covered by "one .cu per algorithm"; the engine's package marker holds no code
        if f"`{name}`" not in rows[folder] and f"`{rel}`" not in text:
            missing.append(rel)
    for path in sorted((ROOT / "tests" / "cuda_emu").iterdir()):
        if path.suffix in (".py", ".h", ".cu") and path.name != "__init__.py" and f"`{path.name}`" not in text:
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"not in CONTRIBUTING.md's layout: {missing}"

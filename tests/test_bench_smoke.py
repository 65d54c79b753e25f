"""Smoke test of the benchmark CLI: ``python -m benchmarks.run --quick --only adamw --repeats 2`` runs in seconds
and produces the table (timings are never asserted: the CI machine is shared).  The benchmarks run as subprocesses
or are imported inside a test (``optional.bench``): the test modules never import ``benchmarks/``, whose modules
need torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .optional import bench

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # each test runs a benchmark (tens of seconds)

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_prints_and_writes_the_table(tmp_path):
    md = tmp_path / "bench.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "adamw", "--repeats", "2",
         "--markdown", str(md)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "machine:" in out and "numpy" in out
    header = "| suite | workload | implementation | median ms/step | speed vs baseline | state bytes/param |"
    assert header in out
    table = md.read_text()
    assert header in table
    rows = [line for line in table.splitlines() if line.startswith("| adamw |")]
    assert len(rows) == 14, table  # 3 workloads x (torch fused, foreach, single-tensor, flatopt), (d) x 2
    flat = [r for r in rows if "| flatopt" in r]
    assert len(flat) == 4
    for r in flat:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert float(cells[3]) > 0  # median ms/step
        assert cells[4].endswith("×")  # a ratio to torch fused
        assert float(cells[5]) == pytest.approx(8.0)  # m and v in float32: 8 bytes per parameter
    assert "(baseline)" in table


def test_a_module_whose_reference_is_missing_is_skipped_with_a_note(monkeypatch):
    run = bench("run")

    real = run.importlib.import_module

    def fake_import(name):
        if name == "benchmarks.bench_fake":
            raise ModuleNotFoundError("No module named 'no_such_oracle'", name="no_such_oracle")
        return real(name)

    monkeypatch.setattr(run.importlib, "import_module", fake_import)
    notes = []
    assert run.load_cases(["fake"], quick=True, log=notes.append) == []
    assert notes == ["note: skipping bench_fake: reference package 'no_such_oracle' is not installed"]


def test_threads_probe_runs():
    """``python -m benchmarks.threads_probe codec apollo scaling`` (probes behind the threading claims of
    benchmarks/README.md, APOLLO's and the factored passes' constants) run and print their lines (timings are not
    asserted)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.threads_probe", "codec", "apollo", "scaling"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("codec: uf8 decode+encode") == 2 and "codec: d8 nearest-entry" in proc.stdout, proc.stdout
    assert "apollo: 256x1024 projection" in proc.stdout and "apollo: G·Pᵀ" in proc.stdout, proc.stdout
    assert proc.stdout.count("scaling: ") == 3, proc.stdout
    assert "apollo: G·Pᵀ on two threads" in proc.stdout, proc.stdout  # against torch.mm


def test_threads_probe_sizes_runs(capsys):
    """``python -m benchmarks.threads_probe sizes`` (the A/B behind ``core.blocks.BLOCK``,
    ``adafactor8bit.apollo_lowrank.TASK`` and ``core.driver.CHUNK``) runs one round and prints its nine lines (timings
    are not asserted)."""
    threads_probe = bench("threads_probe")

    threads_probe.sizes(repeats=1)
    out = capsys.readouterr().out
    assert out.count("sizes: ") == 9 and "adafactor8bit.apollo_lowrank.TASK" in out, out
    assert out.count("core.driver.CHUNK: 64K") == 6, out


def test_threads_probe_native_runs(capsys):
    """``python -m benchmarks.threads_probe native`` (the A/B behind the compiled CPU passes' figures) runs one round
    at a small size and prints a line per algorithm (timings are not asserted)."""
    threads_probe = bench("threads_probe")
    from flatopt.core import native

    threads_probe.native(repeats=1, quick=True)
    out = capsys.readouterr().out
    if not native.status()[0]:
        pytest.skip(f"no compiled passes here: {native.status()[1]}")
    assert out.count("compiled pass vs NumPy twin: compiled") == 7 and "native: build " in out, out
    assert "native: memory floor of a Lion step" in out, out


def test_gpu_suite_runs_on_the_stand_in():
    """``benchmarks.gpu_suite --dry``: every row's code path (flatopt on the CuPy stand-in, the torch reference on the
    CPU) runs and prints a row; a reference that cannot run says why instead of a time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--dry", "--quick", "--only", "adamw,sgd,muon",
         "--repeats", "1", "--warmup", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert len(rows) == 3 + 3 + 1, proc.stdout
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert float(cells[2]) > 0 and cells[5].endswith("×"), r  # flatopt ms; a ratio (the reference ran)


def test_kernel_model_prints_grid_and_waves_per_workload():
    """``python -m benchmarks.kernel_model --quick --only sgd --chunks``: a row per workload of the GPU suite with
    the grid and waves of the generated kernel that runs it (registers from ptxas where CuPy's NVRTC is installed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_model", "--quick", "--only", "sgd", "--chunks"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "| algorithm | kernel | workload | regs | spill | blk/SM | slots | grid | waves |" in proc.stdout
    table = [ln for ln in lines if ln.startswith("| sgd |")]
    assert [ln.split("|")[3].strip() for ln in table] == ["one 16M buffer", "76 tensors (small)", "500 x 64"]
    assert "_step<float>" in table[0] and "_multi<float>" in table[1] and "_multi<float>" in table[2]
    grid_500 = int(table[2].split("|")[8])
    assert grid_500 == 500  # one block per 64-element tensor
    assert any(ln.startswith("| persistent grid") for ln in lines)

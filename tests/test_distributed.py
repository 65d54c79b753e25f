"""flatopt.distributed: the ownership plan in-process; the sharded wrapper under real ``mpiexec -n 2`` / ``-n 3``.

The MPI tests spawn tests/mpi_worker.py (see its doc) and skip cleanly when mpi4py or mpiexec is absent; every
spawn has a timeout, so a hang (e.g. bad input on one rank not reaching the others) fails instead of blocking.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import flatopt
from flatopt.distributed.plan import Plan, carve, merge
from tests.helpers import assert_states_equal, grads_for, make_params

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mpi_worker.py"
TIMEOUT = 120


def test_import_flatopt_does_not_import_mpi_or_cupy():
    code = "import sys, flatopt, flatopt.distributed; print('mpi4py' in sys.modules or 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------------ the plan, in-process
def test_plan_is_deterministic_balanced_and_whole_for_matrices():
    batch = [(f"w{i}", (i + 1, 7)) for i in range(9)] + [("emb", (1000, 4))]
    a = Plan(3, split=False, split_min=16).extended(batch)
    b = Plan(3, split=False, split_min=16).extended(list(reversed(batch)))
    assert a.to_json() == b.to_json()  # order inside a batch does not matter
    assert all(len(a.pieces(n)) == 1 for n, _ in batch)
    small = Plan(3, split=False, split_min=16).extended(batch[:-1])
    assert max(small.load) - min(small.load) <= 9 * 7  # greedy, largest first: within one item of balance
    s = Plan(3, split=True, split_min=16).extended(batch)
    ranges = [(p.owner, p.lo, p.hi) for p in s.pieces("emb")]
    assert ranges == [(0, 0, 1333), (1, 1333, 2666), (2, 2666, 4000)]
    assert Plan.from_json(json.loads(json.dumps(s.to_json()))).to_json() == s.to_json()
    # a cost function (e.g. expected state bytes) replaces the element count as the load
    c = Plan(2, split=False, split_min=16, cost=lambda n, shape: 100 if n == "big" else 1)
    c = c.extended([("big", (1,)), ("a", (50,)), ("b", (50,))])
    assert [c.pieces(n)[0].owner for n in ("big", "a", "b")] == [0, 1, 1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_carve_then_merge_is_the_identity(world):
    params = make_params([(40,), (3, 4), (7,)])
    opt = flatopt.AdamW(lr=0.1, amsgrad=True)
    for it in range(2):
        opt.step_batch([flatopt.OptItem(n, s, p, g) for (n, (s, p)), g in
                        zip(sorted(params.items()), [grads_for(params, it)[n] for n in sorted(params)])])
    full = opt.state_dict()
    plan = Plan(world, split=True, split_min=16).extended([(n, s) for n, (s, _) in params.items()])
    shards = {r: carve(full, plan, r) for r in range(world)}
    assert sum(b.nbytes for st in shards.values() for b in st.buffers.values()) == sum(
        b.nbytes for b in full.buffers.values())
    assert_states_equal(merge(shards, plan), full)


def test_carve_refuses_to_split_a_non_elementwise_buffer():
    full = flatopt.OptimizerState("x", {}, {}, 0, {"w": {"shape": [40], "dtype": "float32", "t": 1}},
                                  {"r/w": np.zeros(3, np.float32)})
    plan = Plan(2, split=True, split_min=16).extended([("w", (40,))])
    with pytest.raises(ValueError, match="cannot be split"):
        carve(full, plan, 0)


# ------------------------------------------------------------------------------------------------ under MPI
def _mpiexec() -> str | None:
    for d in (sysconfig.get_path("scripts"), os.path.join(sys.prefix, "bin")):
        p = shutil.which("mpiexec", path=d)
        if p:
            return p
    return shutil.which("mpiexec")


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401, PLC0415
    except ImportError:
        return False
    return _mpiexec() is not None


needs_mpi = pytest.mark.skipif(not _mpi_available(), reason="mpi4py or mpiexec not installed (pip install "
                                                             "'flatopt[distributed]')")


def mpirun(n: int, *args, script: Path = WORKER, timeout: float = TIMEOUT) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [_mpiexec(), "-n", str(n), sys.executable, str(script), *map(str, args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd[1:])} did not finish in {timeout} s (a hang?)\n{exc.stdout}\n{exc.stderr}")
    assert out.returncode == 0, f"{' '.join(cmd[1:])} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def _all_ok(out: str, n: int, mode: str) -> None:
    for r in range(n):
        assert f"RANK {r} OK {mode}" in out, out


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    """Every registry optimizer run sharded on 2 ranks (bit-exact vs single process), checkpointed at step 2."""
    d = tmp_path_factory.mktemp("sharded")
    _all_ok(mpirun(2, "exact", d), 2, "exact")
    return d


@needs_mpi
def test_exact_on_two_ranks_for_every_optimizer_and_state_is_halved(saved_on_two):
    report = json.loads((saved_on_two / "memory-W2.json").read_text())
    assert set(report) == set(__import__("tests.registry", fromlist=["REGISTRY"]).REGISTRY)
    for key, r in report.items():
        assert sum(r["per_rank"]) == r["single"], key
        if r["single"]:
            assert max(r["per_rank"]) <= 0.7 * r["single"], (key, r)


@needs_mpi
def test_exact_on_three_ranks(tmp_path):
    _all_ok(mpirun(3, "exact", tmp_path), 3, "exact")


@needs_mpi
@pytest.mark.parametrize("world", [1, 3])
def test_resharding_a_two_rank_checkpoint(saved_on_two, world):
    _all_ok(mpirun(world, "resume", saved_on_two), world, "resume")


@needs_mpi
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_on_one_rank_raises_on_every_rank(world):
    _all_ok(mpirun(world, "bad"), world, "bad")


@needs_mpi
@pytest.mark.parametrize("world", [2, 3])
def test_16bit_parameters_sharded_are_bit_identical_to_one_process(world, tmp_path):
    """bfloat16 parameters under stochastic, Kahan and master write-back (flatopt.Precision), SGD/AdamW buffers
    cut into ranges: the same bits as one process, and resumed from the shards or the merged snapshot."""
    pytest.importorskip("ml_dtypes")
    _all_ok(mpirun(world, "precision", tmp_path), world, "precision")


@needs_mpi
def test_helpers_and_varying_batches_on_three_ranks():
    _all_ok(mpirun(3, "helpers"), 3, "helpers")


@needs_mpi
def test_distributed_digits_example_runs_on_two_ranks():
    pytest.importorskip("sklearn")
    out = mpirun(2, "--epochs", "1", "--hidden", "32", "--optimizers", "adamw,muon_adamw",
                 script=ROOT / "examples" / "train_digits_distributed.py")
    assert "state bytes per rank" in out and "bit-identical: yes" in out, out


# ---------------------------------------------------------------------------------------------- NCCL (GPU)
def _nccl():
    from flatopt.core import backend  # noqa: PLC0415

    if not backend.gpu_available():
        return None
    nccl = backend.nccl()
    return nccl if getattr(nccl, "available", False) else None


@pytest.mark.skipif(_nccl() is None, reason="needs a GPU and CuPy built with NCCL")
@pytest.mark.parametrize("key", ["adamw", "muon", "adafactor"])
def test_nccl_single_rank_sharded_matches_plain_on_cupy(key):
    from flatopt.core import backend  # noqa: PLC0415
    from flatopt.distributed import Sharded, allreduce_mean, global_norm  # noqa: PLC0415
    from tests.registry import REGISTRY  # noqa: PLC0415

    cp, nccl = backend.cupy(), _nccl()
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    spec = REGISTRY[key]
    host = make_params(spec.shapes)
    runs = []
    for sharded in (False, True):
        params = {n: (s, cp.asarray(p)) for n, (s, p) in host.items()}
        opt = Sharded(spec.make, comm) if sharded else spec.make()
        for it in range(3):
            grads = {n: cp.asarray(g) for n, g in grads_for(host, it).items()}
            if sharded:
                allreduce_mean(list(grads.values()), comm)  # one rank: the identity
            opt.step_batch([flatopt.OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())])
        runs.append({n: p.get() for n, (_, p) in params.items()})
    for n in host:
        assert runs[0][n].tobytes() == runs[1][n].tobytes(), n
    norm = global_norm([cp.ones(4, cp.float32)], comm)
    assert isinstance(norm, cp.ndarray) and float(norm) == 2.0


def test_mpi_allreduce_refuses_bfloat16_before_reducing():
    """MPI has no bfloat16 type: ``allreduce_mean`` over the MPI backend refuses a batch holding one, with the
    reason; float16 (a type MPI sums) goes through."""
    mpi = pytest.importorskip("mpi4py.MPI")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from flatopt.distributed import allreduce_mean

    f16 = np.arange(4, dtype=np.float16)
    allreduce_mean([f16], mpi.COMM_SELF)
    assert f16.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="cannot sum bfloat16"):
        allreduce_mean([np.ones(3, np.float32), np.ones(3, ml_dtypes.bfloat16)], mpi.COMM_SELF)

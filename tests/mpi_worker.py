"""Worker run under ``mpiexec -n W`` by tests/test_distributed.py (not collected by pytest).

    mpiexec -n 2 python tests/mpi_worker.py exact DIR     # every registry optimizer: sharded == single process,
                                                          # bit for bit; saves a sharded checkpoint per optimizer
    mpiexec -n 3 python tests/mpi_worker.py resume DIR    # resume those checkpoints on another world size
    mpiexec -n 2 python tests/mpi_worker.py bad           # bad input on one rank raises on every rank
    mpiexec -n 3 python tests/mpi_worker.py helpers       # allreduce_mean, global_norm, grad_norm
    mpiexec -n 2 python tests/mpi_worker.py precision DIR # bfloat16 parameters under each write-back: sharded ==
                                                          # single process, bit for bit, also after a resume

Each rank prints ``RANK <r> OK <mode>`` at the end; any failure raises (non-zero exit).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

import flatopt  # noqa: E402
from flatopt import OptItem  # noqa: E402
from flatopt.distributed import RemoteStepError, Sharded, allreduce_mean, global_norm, load_merged  # noqa: E402
from tests.helpers import assert_bits_equal, assert_states_equal, grads_for, make_params  # noqa: E402
from tests.registry import REGISTRY  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
SPLIT_MIN = 16  # small, so that the elementwise optimizers' larger buffers are cut into ranges
STEPS, SAVE_AT = 4, 2


def shapes_for(key: str, spec) -> list:
    shapes = list(spec.shapes)
    if key.startswith(("sgd", "adamw")):
        shapes += [(50,), (10, 9)]
    return shapes


def factory(spec, shapes):
    if spec.make_for is not None:
        return lambda: spec.make_for({f"p{i}": tuple(s) for i, s in enumerate(shapes)})
    return spec.make


def items_of(params, grads):
    return [OptItem(n, s, p, grads[n]) for n, (s, p) in sorted(params.items())]


def reference(key, spec):
    """The single-process run: (params after SAVE_AT steps, after STEPS steps, final optimizer)."""
    shapes = shapes_for(key, spec)
    params = make_params(shapes)
    opt = factory(spec, shapes)()
    snaps = {}
    for it in range(STEPS):
        opt.step_batch(items_of(params, grads_for(params, it)))
        opt.end_iteration()
        snaps[it + 1] = {n: p.copy() for n, (_, p) in params.items()}
    return snaps, opt


def run_sharded(sh, params, its):
    for it in its:
        sh.step_batch(items_of(params, grads_for(params, it)))
        sh.end_iteration()


def check_params(params, want, what):
    for n, (_, p) in params.items():
        assert_bits_equal(p, want[n], f"{what} {n}")


def mode_exact(out: Path) -> None:
    report = {}
    for key, spec in REGISTRY.items():
        snaps, ref = reference(key, spec)
        shapes = shapes_for(key, spec)
        params = make_params(shapes)
        sh = Sharded(factory(spec, shapes), COMM, split_min=SPLIT_MIN)
        run_sharded(sh, params, range(SAVE_AT))
        check_params(params, snaps[SAVE_AT], f"{key} W={WORLD} step {SAVE_AT}")
        sh.save(out / key)
        run_sharded(sh, params, range(SAVE_AT, STEPS))
        check_params(params, snaps[STEPS], f"{key} W={WORLD} step {STEPS}")
        assert_states_equal(sh.state_dict(), ref.state_dict())
        mine = sh.state_nbytes()
        per_rank = COMM.allgather(mine)
        total = sum(int(b.nbytes) for b in ref.state_dict().buffers.values())
        assert sum(per_rank) == total, (key, per_rank, total)
        report[key] = {"per_rank": per_rank, "single": total}
    if RANK == 0:
        (out / f"memory-W{WORLD}.json").write_text(json.dumps(report))


def mode_resume(out: Path) -> None:
    for key, spec in REGISTRY.items():
        snaps, _ = reference(key, spec)
        shapes = shapes_for(key, spec)
        params = make_params(shapes)
        for n, (_, p) in params.items():
            p[...] = snaps[SAVE_AT][n]
        sh = Sharded(factory(spec, shapes), COMM, split_min=SPLIT_MIN)
        sh.load(out / key)
        run_sharded(sh, params, range(SAVE_AT, STEPS))
        check_params(params, snaps[STEPS], f"{key} resumed on W={WORLD}")
        if WORLD == 1:  # a plain optimizer resumes from the merged snapshot too
            for n, (_, p) in params.items():
                p[...] = snaps[SAVE_AT][n]
            plain = factory(spec, shapes)()
            assert plain.load_state_dict(load_merged(out / key)) is True, key
            for it in range(SAVE_AT, STEPS):
                plain.step_batch(items_of(params, grads_for(params, it)))
                plain.end_iteration()
            check_params(params, snaps[STEPS], f"{key} plain optimizer from the merged checkpoint")


def expect_everywhere(fn, own_exc, culprit: int) -> str:
    try:
        fn()
    except RemoteStepError as exc:
        assert RANK != culprit, f"rank {RANK} raised RemoteStepError for its own bad input"
        return str(exc)
    except own_exc as exc:
        assert RANK == culprit, f"rank {RANK} raised {exc!r}, expected a RemoteStepError"
        return str(exc)
    raise AssertionError(f"rank {RANK}: no exception")


def mode_bad() -> None:
    culprit = WORLD - 1
    for key in ("adamw", "muon", "kron_psgd", "muon_adamw"):
        spec = REGISTRY[key]
        snaps, _ = reference(key, spec)
        shapes = shapes_for(key, spec)
        params = make_params(shapes)
        sh = Sharded(factory(spec, shapes), COMM, split_min=SPLIT_MIN)
        run_sharded(sh, params, range(2))
        before = sh.state_dict()
        grads = grads_for(params, 2)
        # 1. an integer gradient on one rank only
        bad = dict(grads)
        if RANK == culprit:
            bad["p0"] = bad["p0"].astype(np.int32)
        msg = expect_everywhere(lambda: sh.step_batch(items_of(params, bad)), TypeError, culprit)
        assert "p0" in msg, msg
        # 1b. a gradient of another (accepted) dtype on one rank only: the ranks pass different batches
        if RANK == culprit:
            bad["p0"] = grads["p0"].astype(np.float64)
        expect_everywhere(lambda: sh.step_batch(items_of(params, bad)), RemoteStepError, -1)
        # 2. the ranks pass different batches (one rank drops an item)
        its = items_of(params, grads)
        mism = its[:-1] if RANK == culprit else its
        expect_everywhere(lambda: sh.step_batch(mism), RemoteStepError, -1)
        # 3. a shape only the owner's optimizer rejects (Muon: 1-D), or a name re-used with another shape
        if key == "muon":
            extra = [OptItem("bias", (5,), np.zeros(5, np.float32), np.ones(5, np.float32))]
            owner = sh.plan.extended([("bias", (5,))]).pieces("bias")[0].owner
            expect_everywhere(lambda: sh.step_batch(its + extra), ValueError, owner)
        check_params(params, snaps[2], f"{key}: params changed by a rejected step")
        assert_states_equal(sh.state_dict(), before)
        run_sharded(sh, params, [2])
        check_params(params, snaps[3], f"{key}: step after the rejected ones")
    # 4. an error inside the step itself (after validation) on one rank: every rank raises, none hangs, and the
    #    parameters stay identical across ranks
    def probe(name, shape, j):
        raise RuntimeError(f"probe failure on rank {RANK}")

    params = make_params(shapes_for("kron_psgd", REGISTRY["kron_psgd"]))
    sh = Sharded(lambda: flatopt.KronPsgd(lr=0.03, probe=probe if RANK == culprit else None), COMM)
    expect_everywhere(lambda: sh.step_batch(items_of(params, grads_for(params, 0))), RuntimeError, culprit)
    for n, (_, p) in params.items():
        assert len({x.tobytes() for x in COMM.allgather(p)}) == 1, n
    # 5. checkpoints that do not fit raise on every rank and change nothing
    d = Path(COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None))
    params = make_params([(50,), (4, 3)])
    sgd = Sharded(lambda: flatopt.SGD(lr=0.1, momentum=0.9), COMM, split_min=SPLIT_MIN)
    run_sharded(sgd, params, range(2))
    sgd.save(d)
    other = Sharded(lambda: flatopt.AdamW(lr=0.1), COMM, split_min=SPLIT_MIN)
    try:
        other.load(d)
    except ValueError as exc:
        assert "does not fit" in str(exc), exc
    else:
        raise AssertionError("an SGD checkpoint loaded into AdamW")
    assert other.shard_state_dict().params == {}
    expect_everywhere(lambda: other.load(d / "missing"), FileNotFoundError, RANK)  # every rank fails itself


def mode_helpers() -> None:
    bufs = [np.arange(5, dtype=np.float32) + RANK, np.full(70_000, RANK + 1.0, np.float64)]
    allreduce_mean(bufs, COMM)
    np.testing.assert_allclose(bufs[0], np.arange(5) + (WORLD - 1) / 2, rtol=1e-6)
    np.testing.assert_allclose(bufs[1], (WORLD + 1) / 2)
    for b in bufs:  # every rank holds the same bits
        assert len({x.tobytes() for x in COMM.allgather(b)}) == 1
    mine = [np.full(10, RANK + 1.0, np.float32)]
    norm = global_norm(mine, COMM)
    assert abs(float(norm) - np.sqrt(sum(10 * (r + 1) ** 2 for r in range(WORLD)))) < 1e-9
    sh = Sharded(lambda: flatopt.AdamW(lr=0.1), COMM, split_min=SPLIT_MIN)
    params = make_params([(50,), (3, 4), (7,)])
    grads = grads_for(params, 0)
    sh.step_batch(items_of(params, grads))
    want = np.sqrt(sum(float(np.dot(g.astype(np.float64), g.astype(np.float64))) for g in grads.values()))
    got = float(sh.grad_norm(items_of(params, grads)))
    assert abs(got - want) < 1e-9 * want, (got, want)


def mode_dynamic() -> None:
    """Names that appear in later batches, skipped names, mixed dtypes, MuonAdamW's missing gradients and tied
    aliases: still bit-identical to the single-process run."""
    def run(opt, params, batches):
        for it, names in enumerate(batches):
            grads = grads_for(params, it)
            items = []
            for n in names:
                if n == "tied":  # the alias of p1: the same memory as p1
                    items.append(OptItem("tied", params["p1"][0], params["p1"][1], grads["p1"]))
                elif n.startswith("-"):  # a missing gradient (MuonAdamW: no-op)
                    items.append(OptItem(n[1:], params[n[1:]][0], params[n[1:]][1], None))
                else:
                    items.append(OptItem(n, params[n][0], params[n][1], grads[n]))
            opt.step_batch(items)
            opt.end_iteration()
        return params

    def mixed():
        params = make_params([(40,), (3, 4), (7,), (20,)])
        params["p3"] = (params["p3"][0], params["p3"][1].astype(np.float64))
        return params

    batches = [["p0", "p2"], ["p1", "p2", "p3"], ["p3", "p0", "p1", "p2"], ["p2", "p3"]]
    cases = [(lambda: flatopt.AdamW(lr=0.05, amsgrad=True), mixed, batches),
             (lambda: flatopt.SGD(lr=0.05, momentum=0.9), mixed, batches),
             (lambda: flatopt.Adafactor(lr=0.05), mixed, batches)]
    shapes = {"p0": (6, 5), "p1": (4, 3), "p2": (7,)}
    ma = lambda: flatopt.MuonAdamW(params=shapes, muon_names=["p0", "p1"], aliases={"tied": "p1"},  # noqa: E731
                                   lr=0.02, adamw_lr_ratio=0.5)
    cases.append((ma, lambda: {n: (s, make_params([s], seed=i)["p0"][1]) for i, (n, s) in enumerate(shapes.items())},
                  [["p0", "-p2"], ["tied", "p2"], ["p0", "p1", "-p2"], ["p2", "tied", "p0"]]))
    for make, params_fn, bs in cases:
        want = run(make(), params_fn(), bs)
        got = run(Sharded(make, COMM, split_min=SPLIT_MIN), params_fn(), bs)
        for n in want:
            assert_bits_equal(got[n][1], want[n][1], f"{type(make()).__name__} {n}")


def mode_precision(out: Path) -> None:
    """bfloat16 parameters (split into ranges for SGD/AdamW: the stochastic draw by the index in the whole
    parameter; the Kahan/master buffers sharded like the state) are bit-identical to one process, and a sharded
    checkpoint resumes on this world size and, merged, in a plain optimizer."""
    import ml_dtypes

    shapes = [(7,), (50,), (10, 9), (4, 3), (33,)]
    makers = {"adamw": lambda p: flatopt.AdamW(lr=1e-2, weight_decay=0.1, precision=p),
              "sgd": lambda p: flatopt.SGD(lr=0.05, momentum=0.9, precision=p),
              "muon_adamw": lambda p: flatopt.MuonAdamW(params={f"p{i}": s for i, s in enumerate(shapes)},
                                                         muon_names=["p2", "p3"], adamw_lr_ratio=0.5, precision=p)}

    def params16():
        return {n: (s, p.astype(ml_dtypes.bfloat16)) for n, (s, p) in make_params(shapes).items()}

    def grads16(params, it):
        return {n: g.astype(ml_dtypes.bfloat16) for n, g in grads_for(params, it).items()}

    def run(opt, params, its):
        for it in its:
            opt.step_batch(items_of(params, grads16(params, it)))
            opt.end_iteration()

    for key, make in makers.items():
        for mode in ("stochastic", "kahan", "master"):
            policy = flatopt.Precision(mode, seed=11)
            what = f"{key} {mode} W={WORLD}"
            ref_params = params16()
            ref = make(policy)
            run(ref, ref_params, range(SAVE_AT))
            mid = {n: p.copy() for n, (_, p) in ref_params.items()}
            run(ref, ref_params, range(SAVE_AT, STEPS))
            want = {n: p for n, (_, p) in ref_params.items()}
            params = params16()
            sh = Sharded(lambda: make(policy), COMM, split_min=SPLIT_MIN)
            run(sh, params, range(SAVE_AT))
            if key != "muon_adamw":
                assert any(len(sh.plan.pieces(n)) > 1 for n in params), "some parameter is split into ranges"
            check_params(params, mid, f"{what} step {SAVE_AT}")
            d = out / f"{key}-{mode}"
            sh.save(d)
            run(sh, params, range(SAVE_AT, STEPS))
            check_params(params, want, f"{what} step {STEPS}")
            assert_states_equal(sh.state_dict(), ref.state_dict())
            # resume: a fresh sharded optimizer from the shards, and a plain one from the merged snapshot
            for fresh in (Sharded(lambda: make(policy), COMM, split_min=SPLIT_MIN), make(policy)):
                params = params16()
                for n, (_, p) in params.items():
                    p[...] = mid[n]
                if isinstance(fresh, Sharded):
                    fresh.load(d)
                else:
                    assert fresh.load_state_dict(load_merged(d)) is True, (what, fresh.last_load_notes)
                run(fresh, params, range(SAVE_AT, STEPS))
                check_params(params, want, f"{what} resumed ({type(fresh).__name__})")


def main() -> None:
    mode = sys.argv[1]
    if mode == "exact":
        mode_exact(Path(sys.argv[2]))
    elif mode == "resume":
        mode_resume(Path(sys.argv[2]))
    elif mode == "bad":
        mode_bad()
    elif mode == "precision":
        mode_precision(Path(sys.argv[2]))
    elif mode == "helpers":
        mode_helpers()
        mode_dynamic()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    COMM.Barrier()
    print(f"RANK {RANK} OK {mode}", flush=True)


if __name__ == "__main__":
    main()

"""The all-to-all benchmark with real processes over gloo (a few seconds per launch).

Bounds are structural and loose: this runs on a shared 2-core host where single
timings jump by tens of percent.
"""

from __future__ import annotations

import math
import subprocess
import time
from typing import Any

import pytest

from shardwise.basics import UserError
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.topology import Topology
from shardwise.profiler import allocator, comm
from shardwise.profiler.comm import (
    CommCase,
    CommError,
    CommResult,
    measure_comm,
    measure_comm_many,
    rank_dims,
    worker_env,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """Every worker process the benchmark starts during the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(*args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(comm, "_popen", recording)
    return procs


def _check_shape(r: CommResult, world: int) -> None:
    assert r.world_size == world
    assert r.backend == "gloo"
    for values in (r.fwd_s, r.bwd_s, r.fwd_cv, r.bwd_cv):
        assert len(values) == world
    assert all(t > 0 for t in r.fwd_s + r.bwd_s)
    assert all(math.isfinite(c) and c >= 0 for c in r.fwd_cv + r.bwd_cv)


#: The all-to-all cases of the tests below, by name, timed by one launch of three ranks
#: in fp16 (:func:`launch`): starting the interpreters is most of a launch's cost. (Two
#: ranks and fp32 are timed by `profile_comm` below.)
CASES = {
    "empty": CommCase([64, 0, 32], [0.0, 0.0, 0.0]),
    "plain": CommCase([64, 64, 64], [0.0, 0.0, 0.0]),
    "late": CommCase([64, 64, 64], [0.0, 0.0, 0.2]),
    "small": CommCase([128, 128, 128], [0.0, 0.0, 0.0]),
    "big": CommCase([1024, 1024, 1024], [0.0, 0.0, 0.0]),
}
BATCH = 4096
Launch = tuple[dict[str, CommResult], list[subprocess.Popen[bytes]]]


@pytest.fixture(scope="module")
def launch() -> Launch:
    """Every case of :data:`CASES` timed by one launch, and the processes it started."""
    procs: list[subprocess.Popen[bytes]] = []

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(*args, **kwargs)
        procs.append(proc)
        return proc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comm, "_popen", recording)
        results = measure_comm_many(list(CASES.values()), BATCH, warmups=2, iters=7, dtype="fp16")
    return dict(zip(CASES, results, strict=True)), procs


def test_one_launch_of_three_ranks_times_every_case(launch: Launch) -> None:
    results, spawned = launch
    # One process per rank for all the cases, each exited cleanly.
    assert len(spawned) == 3 and all(p.poll() == 0 for p in spawned)
    for name, case in CASES.items():
        r = results[name]
        _check_shape(r, 3)
        assert (r.dims, r.delays) == (case.dims, case.delays)
        assert (r.batch_size, r.dtype, r.iters) == (BATCH, "fp16", 7)
        # Design §6: the allocator mitigation is checked inside every timing process.
        assert r.allocator_active == (allocator.glibc_version() is not None)


def test_an_empty_rank_still_receives_its_batch_slice(launch: Launch) -> None:
    """A rank that holds no table sends nothing but still receives its batch slice."""
    r = launch[0]["empty"]
    _check_shape(r, 3)  # every rank's forward and backward took time
    assert r.dtype == "fp16" and r.dims[1] == 0


def test_straggler_wait_is_in_the_forward_only(launch: Launch) -> None:
    plain, late = launch[0]["plain"], launch[0]["late"]
    # Ranks 0 and 1 arrive first and wait ~0.2 s for rank 2 ...
    assert min(late.fwd_s[:2]) >= max(plain.fwd_s[:2]) + 0.15
    # ... rank 2's own delay is its (modelled) compute, not communication ...
    assert late.fwd_s[2] < 0.1
    # ... and the backward has no delays.
    assert max(late.bwd_s) < 0.1


def test_more_bytes_cost_more(launch: Launch) -> None:
    small, big = launch[0]["small"], launch[0]["big"]
    assert sum(big.total_s) > sum(small.total_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dims": [], "batch_size": 8}, "world size"),
        ({"dims": [8, -4], "batch_size": 8}, r"dims\[1\]"),
        ({"dims": [8, 4.5], "batch_size": 8}, r"dims\[1\]"),
        ({"dims": [8, 8], "batch_size": 8, "delays": [0.1]}, "delays has 1 entries for 2"),
        ({"dims": [8, 8], "batch_size": 8, "delays": [0.1, -1]}, r"delays\[1\]"),
        ({"dims": [8, 8], "batch_size": 8, "delays": [0.0, math.nan]}, r"delays\[1\]"),
        ({"dims": [8, 8], "batch_size": 0}, "batch_size"),
        ({"dims": [8, 8], "batch_size": 8, "iters": 0}, "iters"),
        ({"dims": [8, 8], "batch_size": 8, "dtype": "bf16"}, "dtype"),
        ({"dims": [8, 8], "batch_size": 8, "backend": "mpi"}, "backend"),
    ],
)
def test_bad_input_is_a_user_error(
    kwargs: dict[str, Any], message: str, spawned: list[subprocess.Popen[bytes]]
) -> None:
    with pytest.raises(UserError, match=message):
        measure_comm(**kwargs)
    assert spawned == []


def test_cases_of_different_world_sizes_are_refused() -> None:
    with pytest.raises(UserError, match="every case needs 2 dims"):
        measure_comm_many([CommCase([8, 8], [0, 0]), CommCase([8, 8, 8], [0, 0, 0])], 8)


def test_worker_failure_surfaces_and_leaves_no_process(
    spawned: list[subprocess.Popen[bytes]],
) -> None:
    with pytest.raises(CommError, match=r"(?s)rank 1 of 2 exited.*injected failure on rank 1"):
        measure_comm_many([CommCase([8, 8], [0.0, 0.0])], 64, crash_rank=1, timeout_s=60)
    assert len(spawned) == 2
    assert all(p.poll() is not None for p in spawned)


def test_timeout_kills_every_worker(spawned: list[subprocess.Popen[bytes]]) -> None:
    # Starting an interpreter with torch alone takes longer than this.
    with pytest.raises(CommError, match="timed out"):
        measure_comm([8, 8, 8], 64, timeout_s=0.3)
    assert len(spawned) == 3
    assert all(p.poll() is not None for p in spawned)


def test_ctrl_c_kills_every_worker(
    spawned: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", interrupt)  # the caller's polling loop
    with pytest.raises(KeyboardInterrupt):
        measure_comm([8, 8], 64)
    monkeypatch.undo()
    assert len(spawned) == 2
    assert all(p.poll() is not None for p in spawned)


def test_worker_env_sets_the_allocator_and_loopback() -> None:
    env = worker_env()
    assert env["MALLOC_MMAP_MAX_"] == "0"
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    assert env["GLOO_SOCKET_IFNAME"] == "lo"


def test_rank_dims_sums_the_columns_each_rank_holds() -> None:
    plan = Plan(
        world_size=3,
        planner="hand",
        topology=Topology(gpus=3, gpu_memory_bytes=1 << 30, device="cpu", batch_size_per_rank=64),
        tables=[
            PlanTable(name="a", rows=10, dim=64, shards=[Shard(rank=0, col_offset=0, cols=64)]),
            PlanTable(
                name="b",
                rows=10,
                dim=32,
                shards=[
                    Shard(rank=0, col_offset=0, cols=16),
                    Shard(rank=2, col_offset=16, cols=16),
                ],
            ),
            PlanTable(name="c", rows=10, dim=8, shards=[Shard(rank=2, col_offset=0, cols=8)]),
        ],
    )
    assert plan.problems() == []
    assert rank_dims(plan) == [80, 0, 24]
    # Row-wise and data-parallel tables send through their own collectives, not this one.
    kinds = plan.model_copy(
        update={
            "tables": [
                *plan.tables,
                PlanTable(
                    name="r",
                    rows=10,
                    dim=16,
                    kind="row_wise",
                    shards=[
                        Shard(rank=r, cols=16, row_offset=4 * r, rows=min(4, 10 - 4 * r))
                        for r in range(3)
                    ],
                ),
                PlanTable(
                    name="d",
                    rows=10,
                    dim=16,
                    kind="data_parallel",
                    shards=[Shard(rank=r, cols=16) for r in range(3)],
                ),
            ]
        }
    )
    assert kinds.problems() == [] and rank_dims(kinds) == [80, 0, 24]


def test_a_case_times_reduce_scatters_and_all_reduces_after_its_all_to_all(tmp_path: Any) -> None:
    """`profile comm` times the row-wise reduce-scatter (and its all-gather) and a
    gradient all-reduce beside each all-to-all, over gloo, and records them for
    `fitted:DIR` to fit."""
    from shardwise.planner.comm.choice import resolve_comm
    from shardwise.profiler.collect import collective_sizes, profile_comm
    from shardwise.profiler.dataset.store import CostDataset

    with pytest.raises(UserError, match=r"all_reduce\[0\]"):
        measure_comm_many([CommCase([4, 4], [0.0, 0.0], all_reduce=[0])], 8)
    # exchanges large enough that their time grows with their bytes on a busy machine too
    # (at 64 a rank, a loaded run once fitted a negative slope: the fit refuses that)
    batch = 1024
    profile_comm(tmp_path / "comm", 4, world_sizes=[2], batch_size=batch)
    for rec in CostDataset.open(tmp_path / "comm").load():
        (width,), (elements,) = collective_sizes(rec["dims"], batch)
        rs, ar = rec["extra"]["collectives"]
        assert (rs["name"], rs["bytes"], rs["world_size"]) == (
            "reduce_scatter",
            2 * batch * width * 4,
            2,
        )
        assert (ar["name"], ar["bytes"], ar["fwd_s"]) == ("all_reduce", 4 * elements, [])
        assert min(rs["fwd_s"] + rs["bwd_s"] + ar["bwd_s"]) > 0
    fitted = resolve_comm(
        f"fitted:{tmp_path / 'comm'}", world=2, device=None, predictor=None, measuring=True
    )
    assert fitted.kind == "modelled"
    assert {name for name, _ in getattr(fitted, "collectives", ())} <= {
        "reduce_scatter",
        "all_reduce",
    }

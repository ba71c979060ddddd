"""`shardwise evaluate --comm`: which comm it used, compute and comm apart (docs/comm.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import shardwise

import shardwise.planner.comm.choice as choice
import shardwise.planner.comm.model as comm
from shardwise.planner.plan import save_plan, table_wise_plan
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology

TABLES = [
    TableSpec(name=f"t{i}", rows=2000, dim=16 * (1 + i % 2), pooling_factor=2) for i in range(4)
]


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A 2-rank plan at a small job batch, all tables on rank 0."""
    save_tables(TABLES, tmp_path / "t.yaml")
    topo = Topology(gpus=2, gpu_memory_bytes=2**34, device="cpu", batch_size_per_rank=16)
    save_plan(table_wise_plan(TABLES, [0, 0, 0, 0], topo, "lopsided"), tmp_path / "p.json")
    return tmp_path / "p.json", tmp_path / "t.yaml"


def test_a_preset_is_named_and_reported_apart_from_compute(files: tuple[Path, Path]) -> None:
    plan, tables = files
    ran = shardwise("evaluate", plan, "--tables", tables, "--repeats", "1", "--comm", "pcie")
    assert ran.code == 0, ran.stderr
    line = comm.PRESETS["pcie"].describe()
    assert ran.lines("comm: ") == [f"comm: {line}"]  # announced before the work
    assert f"comm: {line}" in ran.stdout.splitlines()  # and with the figures
    assert "batch 16/rank (the plan's job batch)" in " ".join(ran.stdout.split())
    assert "compute alone" in ran.stdout and "all-to-all modelled, not measured" in ran.stdout


def test_json_carries_the_comm_and_the_compute_alone(files: tuple[Path, Path]) -> None:
    plan, tables = files
    ran = shardwise(
        "evaluate", plan, "--tables", tables, "--repeats", "2", "--comm", "ethernet", "--json"
    )
    assert ran.code == 0, ran.stderr
    doc: dict[str, Any] = json.loads(ran.stdout)
    assert doc["comm"] == comm.PRESETS["ethernet"].describe() and doc["comm_kind"] == "modelled"
    assert doc["batch_size_per_rank"] == 16 and len(doc["max_compute_per_repeat"]) == 2
    busy, idle = doc["ranks"]
    assert doc["max_compute_s"] == pytest.approx(busy["fwd_compute_s"] + busy["bwd_compute_s"])
    assert doc["max_s"] > doc["max_compute_s"]  # the declared all-to-all is added
    assert idle["fwd_comm_s"] > busy["fwd_comm_s"]  # the empty rank waits for rank 0


def test_auto_declares_where_ranks_share_cores(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shardwise.planner.comm.choice.os.sched_getaffinity", lambda _pid: {0})
    monkeypatch.setattr(choice, "_cuda_count", lambda: 0)
    import shardwise.profiler.evaluate as evaluate

    def no_launch(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("auto must not measure an all-to-all it cannot measure honestly")

    monkeypatch.setattr(evaluate, "measure_comm_many", no_launch)
    plan, tables = files
    ran = shardwise("evaluate", plan, "--tables", tables, "--repeats", "1", "--json")
    assert ran.code == 0, ran.stderr
    got = json.loads(ran.stdout)["comm"]
    assert got.startswith("auto → modelled: nvlink preset")
    assert "2 gloo processes on 1 core(s) measure the OS scheduler" in got


def test_a_bad_comm_lists_the_values_before_any_work(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardwise.profiler.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_plan", None)  # never reached
    plan, tables = files
    ran = shardwise("evaluate", plan, "--tables", tables, "--comm", "infiniband2")
    assert ran.code == 2 and "--comm 'infiniband2' is not a comm model" in ran.stderr
    for value in ("auto", "measured", "model", "fitted:DIR", *comm.PRESETS):
        assert value in ran.stderr
    missing = shardwise("evaluate", plan, "--tables", tables, "--comm", "fitted:nowhere")
    assert missing.code == 2 and "shardwise profile comm --out nowhere" in missing.stderr


def test_a_plan_of_every_kind_prints_each_ranks_kernels_and_comm_parts(tmp_path: Path) -> None:
    """TW + RW + DP on 2 ranks: each rank's kernels at their batches, and each comm part
    with the preset that priced it."""
    from shardwise.planner.kinds import even_row_split
    from shardwise.planner.plan import Plan, PlanTable, Shard

    specs = [
        TableSpec(name="tw", rows=500, dim=16, pooling_factor=2),
        TableSpec(name="rw", rows=4000, dim=32, pooling_factor=4),
        TableSpec(name="dp", rows=100, dim=16, pooling_factor=2),
    ]
    topo = Topology(gpus=2, gpu_memory_bytes=2**34, device="cpu", batch_size_per_rank=16)
    cut = even_row_split(4000, 2)
    plan = Plan(
        world_size=2,
        planner="kinds",
        topology=topo,
        tables=[
            PlanTable(name="tw", rows=500, dim=16, shards=[Shard(rank=0, cols=16)]),
            PlanTable(
                name="rw",
                rows=4000,
                dim=32,
                kind="row_wise",
                shards=[
                    Shard(rank=r, cols=32, row_offset=o, rows=n) for r, (o, n) in enumerate(cut)
                ],
            ),
            PlanTable(
                name="dp",
                rows=100,
                dim=16,
                kind="data_parallel",
                shards=[Shard(rank=r, cols=16) for r in range(2)],
            ),
        ],
    ).with_hash()
    save_tables(specs, tmp_path / "t.yaml")
    save_plan(plan, tmp_path / "p.json")
    args = ("evaluate", tmp_path / "p.json", "--tables", tmp_path / "t.yaml", "--repeats", "1")
    ran = shardwise(*args, "--comm", "hgx-h100")
    assert ran.code == 0, ran.stderr
    text = " ".join(ran.stdout.split())
    assert "│ 0 │ TW/CW fp32 │ 32 │ tw │" in text  # the global batch
    assert "│ 0 │ RW fp32 │ 32 │ rw[0:2000] │" in text
    assert "│ 1 │ RW fp32 │ 32 │ rw[2000:4000] │" in text
    assert "│ 1 │ DP fp32 │ 16 │ dp │" in text  # the rank's own batch
    comm_line = next(line for line in ran.stdout.splitlines() if line.startswith("comm: "))
    assert comm_line.startswith("comm: all-to-all: modelled: hgx-h100 host preset")
    assert "row-wise reduce-scatter/all-gather: modelled by the hgx-h100 host preset" in comm_line
    assert "data-parallel gradient all-reduce: modelled by the hgx-h100 host preset" in comm_line
    assert "row-wise reduce-scatter/all-gather: fwd" in text and "(slowest rank)" in text
    doc: dict[str, Any] = json.loads(shardwise(*args, "--comm", "pcie", "--json").stdout)
    assert [k["batch_size"] for k in doc["rank_kernels"][1]] == [16, 32]
    assert [p["part"] for p in doc["comm_parts"]][1:] == [
        "row-wise reduce-scatter/all-gather",
        "data-parallel gradient all-reduce",
    ]
    assert all(p["priced_by"].startswith("modelled") for p in doc["comm_parts"])
    for key in ("max_s", "comm", "comm_kind", "max_compute_s", "ranks"):  # kept keys
        assert key in doc

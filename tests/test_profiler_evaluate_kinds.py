"""The evaluator times every sharding kind as DMP runs it, and the predictor prices a
plan with the kernels the evaluator times (docs/comm.md, docs/design.md §6)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shardwise.basics import UserError
from shardwise.planner.comm.collectives import ALL_TO_ALL, DATA_PARALLEL, ROW_WISE
from shardwise.planner.comm.model import PRESETS
from shardwise.planner.costmodel import CostPredictor
from shardwise.planner.costmodel.artifact import load_bundled
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.streams import stream_from_spec
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.profiler.compute import ShardLoad, footprint_bytes, measure_compute, row_stream
from shardwise.profiler.evaluate import evaluate_plan, rank_shards

FAST: dict[str, Any] = {"warmups": 1, "iters": 2}


def test_a_row_shard_keeps_exactly_its_ids_and_every_bag() -> None:
    lengths = np.array([3, 0, 2, 1])
    ids = np.array([5, 12, 7, 19, 3, 10])  # bags: [5 12 7] [] [19 3] [10]
    got_lens, got_ids = row_stream((lengths, ids), 5, 8)  # rows 5..12
    assert got_lens.tolist() == [3, 0, 0, 1]  # every bag kept, empty ones too
    assert got_ids.tolist() == [0, 7, 2, 5]  # in range, less the offset, in order
    # The shards of an even cut share out the table's lookups exactly.
    spec = TableSpec(name="t", rows=1000, dim=16, pooling_factor=6.0)
    lens, idx = stream_from_spec(spec, 256, 0)
    cuts = [row_stream((lens, idx), o, n) for o, n in even_row_split(1000, 3)]
    assert all(len(c[0]) == 256 for c in cuts)
    assert np.sum([c[0] for c in cuts], axis=0).tolist() == lens.tolist()
    assert sum(len(c[1]) for c in cuts) == len(idx)
    assert all(c[1].max() < n for c, (_, n) in zip(cuts, even_row_split(1000, 3), strict=True))


def test_a_row_shard_holds_its_rows_and_a_dp_table_reads_the_local_batch() -> None:
    spec = TableSpec(name="big", rows=4000, dim=32, pooling_factor=8.0)
    dp = TableSpec(name="dp", rows=100, dim=16, pooling_factor=2.0)
    loads = [
        ShardLoad(spec, 32, row_offset=1000, rows=1000, group="row_wise"),
        ShardLoad(dp, 16, group="data_parallel", local_batch=True),
    ]
    got = measure_compute(loads, 64, local_batch_size=16, **FAST)
    assert got.kernels == 2 and got.batch_size == 64
    (d, r) = got.kernel_times  # groups by name: data_parallel before row_wise
    assert (d.group, d.batch_size, d.shards) == ("data_parallel", 16, ("dp",))
    assert (r.group, r.batch_size, r.shards) == ("row_wise", 64, ("big[1000:2000]",))
    assert got.fwd_s == pytest.approx(d.fwd_s + r.fwd_s, rel=0.5)
    # Memory counts the rows held and each kernel's batch.
    whole = footprint_bytes([ShardLoad.whole(spec)], 64)
    part = footprint_bytes(loads[:1], 64)
    assert whole - part == 3000 * (32 * 4 + 4)
    assert footprint_bytes(loads[1:], 64, local_batch_size=16) < footprint_bytes(loads[1:], 64)
    with pytest.raises(UserError, match="not a non-empty range"):
        ShardLoad(spec, 32, row_offset=3500, rows=1000)


def _every_kind(topology: Topology) -> tuple[Plan, list[TableSpec]]:
    """A plan holding every kind (fp16 tables too) on ``topology`` (4 ranks, 2 hosts)."""
    w = topology.gpus
    specs = [
        TableSpec(name="tw", rows=300, dim=16, pooling_factor=3.0),
        TableSpec(name="tw16", rows=300, dim=16, pooling_factor=3.0, dtype="fp16"),
        TableSpec(name="cw", rows=200, dim=32, pooling_factor=2.0),
        TableSpec(name="rw", rows=2000, dim=16, pooling_factor=6.0),
        TableSpec(name="twrw", rows=1000, dim=16, pooling_factor=4.0),
        TableSpec(name="grid", rows=1000, dim=32, pooling_factor=4.0),
        TableSpec(name="dp", rows=100, dim=16, pooling_factor=2.0, dtype="fp16"),
    ]

    def rows(n: int, ranks: list[int], cols: int = 16, col: int = 0) -> list[Shard]:
        cut = even_row_split(n, len(ranks))
        return [
            Shard(rank=r, col_offset=col, cols=cols, row_offset=o, rows=k)
            for r, (o, k) in zip(ranks, cut, strict=True)
        ]

    tables = [
        PlanTable(name="tw", rows=300, dim=16, shards=[Shard(rank=0, cols=16)]),
        PlanTable(name="tw16", rows=300, dim=16, dtype="fp16", shards=[Shard(rank=0, cols=16)]),
        PlanTable(
            name="cw",
            rows=200,
            dim=32,
            shards=[Shard(rank=1, cols=16), Shard(rank=3, col_offset=16, cols=16)],
        ),
        PlanTable(name="rw", rows=2000, dim=16, kind="row_wise", shards=rows(2000, list(range(w)))),
        PlanTable(name="twrw", rows=1000, dim=16, kind="table_row_wise", shards=rows(1000, [2, 3])),
        PlanTable(
            name="grid",
            rows=1000,
            dim=32,
            kind="grid",
            shards=rows(1000, [0, 1]) + rows(1000, [2, 3], col=16),
        ),
        PlanTable(
            name="dp",
            rows=100,
            dim=16,
            dtype="fp16",
            kind="data_parallel",
            shards=[Shard(rank=r, cols=16) for r in range(w)],
        ),
    ]
    plan = Plan(world_size=w, planner="every", topology=topology, tables=tables).with_hash()
    return plan, specs


def _kernels(doc: list[list[dict[str, object]]]) -> list[list[tuple[object, ...]]]:
    return [[(k["group"], k["dtype"], k["batch_size"], k["shards"]) for k in r] for r in doc]


def test_the_predictor_prices_the_kernels_the_evaluator_times() -> None:
    topo = Topology(
        gpus=4, gpu_memory_bytes=2**30, device="cpu", batch_size_per_rank=8, gpus_per_host=2
    )
    plan, specs = _every_kind(topo)
    assert plan.problems(specs) == []
    comm = PRESETS["pcie"]
    measured = evaluate_plan(plan, specs, repeats=1, comm=comm, batch_size_per_rank=8)
    predicted = CostPredictor(load_bundled(), comm).predict_plan(plan, specs)
    got = _kernels(measured.rank_kernels)
    assert got == _kernels(predicted.rank_kernels)
    # Rank 0: the fused kernel in each precision, then data-parallel (local batch 8),
    # grid and row-wise (global batch 32), each with exactly its shards.
    assert got[0] == [
        ("fused", "fp32", 32, ["tw"]),
        ("fused", "fp16", 32, ["tw16"]),
        ("data_parallel", "fp16", 8, ["dp"]),
        ("grid", "fp32", 32, ["grid[0:500]"]),
        ("row_wise", "fp32", 32, ["rw[0:500]"]),
    ]
    assert ("table_row_wise", "fp32", 32, ["twrw[500:1000]"]) in got[3]
    # The comm is priced in the same parts, the other kinds' alike to the last digit.
    names = [p["part"] for p in measured.comm_parts]
    assert names == [p["part"] for p in predicted.comm_parts]
    assert names[0] == ALL_TO_ALL and ROW_WISE in names and DATA_PARALLEL in names
    for m, p in zip(measured.comm_parts[1:], predicted.comm_parts[1:], strict=True):
        assert (m["fwd_s"], m["bwd_s"], m["priced_by"]) == (p["fwd_s"], p["bwd_s"], p["priced_by"])
    assert measured.comm == predicted.comm  # one line, every part named with its source
    assert "row-wise reduce-scatter/all-gather: modelled by" in measured.comm


def test_rank_shards_follow_the_plans_kernel_shards() -> None:
    topo = Topology(gpus=4, gpu_memory_bytes=2**30, gpus_per_host=2)
    plan, specs = _every_kind(topo)
    loads = rank_shards(plan, specs)
    rw = next(s for s in loads[1] if s.group == "row_wise")
    assert (rw.spec.rows, rw.row_offset, rw.rows, rw.name) == (2000, 500, 500, "rw[500:1000]")
    assert all(s.rows is None for s in loads[0] if s.group == "fused")
    dp = [s for r in loads for s in r if s.local_batch]
    assert len(dp) == 4 and {s.group for s in dp} == {"data_parallel"}


@pytest.mark.slow
def test_one_host_measures_the_kinds_collectives_beside_the_all_to_all() -> None:
    """2 ranks on 2 cores: the all-to-all, the row-wise reduce-scatter/all-gather and
    the data-parallel all-reduce are measured over gloo, each labelled."""
    topo = Topology(gpus=2, gpu_memory_bytes=2**30, device="cpu", batch_size_per_rank=16)
    specs = [
        TableSpec(name="tw", rows=500, dim=16, pooling_factor=2.0),
        TableSpec(name="rw", rows=2000, dim=32, pooling_factor=4.0),
        TableSpec(name="dp", rows=2000, dim=64, pooling_factor=2.0),
    ]
    plan = Plan(
        world_size=2,
        planner="kinds",
        topology=topo,
        tables=[
            PlanTable(name="tw", rows=500, dim=16, shards=[Shard(rank=0, cols=16)]),
            PlanTable(
                name="rw",
                rows=2000,
                dim=32,
                kind="row_wise",
                shards=[
                    Shard(rank=0, cols=32, rows=1000),
                    Shard(rank=1, cols=32, row_offset=1000, rows=1000),
                ],
            ),
            PlanTable(
                name="dp",
                rows=2000,
                dim=64,
                kind="data_parallel",
                shards=[Shard(rank=0, cols=64), Shard(rank=1, cols=64)],
            ),
        ],
    ).with_hash()
    got = evaluate_plan(plan, specs, repeats=2, batch_size_per_rank=16)
    parts: dict[Any, Any] = {p["part"]: p for p in got.comm_parts}
    assert list(parts) == [ALL_TO_ALL, ROW_WISE, DATA_PARALLEL]
    assert parts[ROW_WISE]["priced_by"].startswith("measured: real gloo reduce-scatter")
    assert parts[DATA_PARALLEL]["priced_by"].startswith("measured: real gloo all-reduce")
    assert all(t > 0 for t in parts[ROW_WISE]["fwd_s"] + parts[ROW_WISE]["bwd_s"])
    assert parts[DATA_PARALLEL]["fwd_s"] == [0.0, 0.0] and min(parts[DATA_PARALLEL]["bwd_s"]) > 0
    # A rank's comm is the sum of its parts (medians of sums and sums of medians agree
    # on 2 repeats up to their order, so within their spread).
    for r, rank in enumerate(got.ranks):
        total = sum(p["bwd_s"][r] for p in parts.values())
        assert rank.bwd_comm_s == pytest.approx(total, rel=0.5)
    assert "row-wise reduce-scatter/all-gather: measured" in got.comm

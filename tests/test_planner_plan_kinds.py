"""plan.json version 2: every sharding kind, its rules, its memory, and version 1 files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.basics import UserError
from shardwise.planner.kinds import even_row_split, row_slice
from shardwise.planner.memory import kind_memory
from shardwise.planner.plan import Plan, PlanTable, Shard, load_plan, save_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

#: A version 1 plan file as the previous release wrote it, with its hash.
V1_FILE = (
    '{"version":1,"world_size":2,"planner":"size-greedy","hash":'
    '"f24432019887eb1835c8258afd4897c61e27a6691631bed211473a3c591ad8ec","topology":'
    '{"gpus":2,"gpu_memory_bytes":1073741824,"device":"cuda","batch_size_per_rank":512,'
    '"memory_reserve":0.15},"tables":[{"name":"a","rows":1000,"dim":16,"dtype":"fp32",'
    '"shards":[{"rank":1,"col_offset":0,"cols":16}]},{"name":"b","rows":50,"dim":32,'
    '"dtype":"fp16","shards":[{"rank":0,"col_offset":0,"cols":16},{"rank":1,'
    '"col_offset":16,"cols":16}]}],"predicted":null,"refinement":null}'
)

TOPO = Topology(gpus=4, gpu_memory_bytes=2**30, batch_size_per_rank=64, gpus_per_host=2)


def rw(rank: int, offset: int, rows: int, cols: int = 16, col_offset: int = 0) -> Shard:
    return Shard(rank=rank, col_offset=col_offset, cols=cols, row_offset=offset, rows=rows)


def plan_of(*tables: PlanTable, topology: Topology = TOPO) -> Plan:
    return Plan(
        world_size=topology.gpus, planner="t", topology=topology, tables=list(tables)
    ).with_hash()


def test_a_version_1_file_loads_keeps_its_hash_and_its_kinds(tmp_path: Path) -> None:
    (tmp_path / "v1.json").write_text(V1_FILE)
    plan = load_plan(tmp_path / "v1.json")
    assert plan.version == 1
    assert [t.kind for t in plan.tables] == ["table_wise", "column_wise"]
    assert plan.problems(require_hash=True) == []
    assert plan.content_hash() == json.loads(V1_FILE)["hash"]
    # Written again, it is still the same version 1 plan (no kind, no row fields).
    save_plan(plan, tmp_path / "again.json")
    doc = json.loads((tmp_path / "again.json").read_text())
    assert doc["version"] == 1
    assert "row_offset" not in json.dumps(doc["tables"])
    assert load_plan(tmp_path / "again.json").problems(require_hash=True) == []


def test_a_version_1_plan_cannot_hold_a_row_kind() -> None:
    plan = plan_of(
        PlanTable(name="a", rows=8, dim=16, kind="row_wise", shards=[rw(0, 0, 4), rw(1, 4, 4)])
    ).model_copy(update={"version": 1})
    assert any("version 1 holds only" in p for p in plan.problems())


def test_every_kind_validates_and_round_trips(tmp_path: Path) -> None:
    plan = plan_of(
        PlanTable(name="tw", rows=10, dim=16, shards=[Shard(rank=0, cols=16)]),
        PlanTable(
            name="cw",
            rows=10,
            dim=16,
            shards=[Shard(rank=0, cols=8), Shard(rank=1, col_offset=8, cols=8)],
        ),
        PlanTable(
            name="rw",
            rows=10,
            dim=16,
            kind="row_wise",
            shards=[rw(r, o, n) for r, (o, n) in enumerate(even_row_split(10, 4))],
        ),
        PlanTable(
            name="twrw", rows=9, dim=16, kind="table_row_wise", shards=[rw(2, 0, 5), rw(3, 5, 4)]
        ),
        PlanTable(
            name="grid",
            rows=6,
            dim=16,
            kind="grid",
            shards=[rw(0, 0, 3, 8), rw(1, 3, 3, 8), rw(2, 0, 3, 8, 8), rw(3, 3, 3, 8, 8)],
        ),
        PlanTable(
            name="dp",
            rows=10,
            dim=16,
            kind="data_parallel",
            shards=[Shard(rank=r, cols=16) for r in range(4)],
        ),
    )
    assert plan.problems() == []
    save_plan(plan, tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again == plan and again.problems(require_hash=True) == []
    assert again.kinds() == {
        "table_wise": 1,
        "column_wise": 1,
        "row_wise": 1,
        "table_row_wise": 1,
        "grid": 1,
        "data_parallel": 1,
    }
    # An even row split as TorchRec cuts it: 3, 3, 3, 1.
    assert [s.rows for s in again.tables[2].shards] == [3, 3, 3, 1]


def test_the_hash_covers_the_kind_and_the_row_ranges() -> None:
    a = plan_of(
        PlanTable(name="t", rows=10, dim=16, kind="row_wise", shards=[rw(0, 0, 5), rw(1, 5, 5)])
    )
    uneven = plan_of(
        PlanTable(name="t", rows=10, dim=16, kind="row_wise", shards=[rw(0, 0, 6), rw(1, 6, 4)])
    )
    host = plan_of(
        PlanTable(
            name="t", rows=10, dim=16, kind="table_row_wise", shards=[rw(0, 0, 5), rw(1, 5, 5)]
        )
    )
    assert len({a.hash, uneven.hash, host.hash}) == 3
    assert all(p.problems() == [] for p in (a, uneven, host))


def test_a_whole_row_range_is_written_as_none() -> None:
    t = PlanTable(name="t", rows=10, dim=16, shards=[Shard(rank=0, cols=16, rows=10)])
    assert t.shards[0].rows is None and t.kind == "table_wise"


@pytest.mark.parametrize(
    ("shards", "kind", "expect"),
    [
        ([rw(0, 0, 4), rw(1, 5, 5)], "row_wise", "rows 4..4 are not placed"),
        ([rw(0, 0, 6), rw(1, 5, 5)], "row_wise", "rows 5..5 are placed twice (rank 1)"),
        ([rw(0, 0, 6)], "row_wise", "rows 6..9 are not placed"),
        ([rw(0, 0, 5), rw(0, 5, 5)], "row_wise", "rank 0 holds two of its row ranges"),
        ([rw(1, 0, 5), rw(2, 5, 5)], "table_row_wise", "must stay on one host"),
        ([rw(0, 0, 5, 8), rw(1, 5, 5, 8)], "row_wise", "shards cover 8 columns of dim 16"),
        ([rw(0, 0, 5), rw(1, 5, 5)], "column_wise", "hold row ranges"),
        ([rw(0, 0, 5), rw(1, 5, 6)], "row_wise", "past the table's 10 rows"),
    ],
)
def test_broken_row_ranges_are_named(shards: list[Shard], kind: str, expect: str) -> None:
    plan = plan_of(PlanTable(name="t", rows=10, dim=16, kind=kind, shards=shards))  # type: ignore[arg-type]
    problems = plan.problems()
    assert any(expect in p for p in problems), problems
    assert all("'t'" in p for p in problems)


def test_a_data_parallel_table_needs_a_whole_copy_on_every_rank() -> None:
    plan = plan_of(
        PlanTable(
            name="d",
            rows=10,
            dim=16,
            kind="data_parallel",
            shards=[Shard(rank=0, cols=16), Shard(rank=1, cols=8), Shard(rank=1, cols=16)],
        )
    )
    text = "\n".join(plan.problems())
    assert "no copy on ranks [2, 3]" in text
    assert "two copies on ranks [1]" in text
    assert "not" in text and "[1]" in text


def test_row_ranges_without_a_kind_are_refused_when_read(tmp_path: Path) -> None:
    plan = plan_of(
        PlanTable(name="t", rows=10, dim=16, kind="row_wise", shards=[rw(0, 0, 5), rw(1, 5, 5)])
    )
    doc = json.loads(plan.model_dump_json())
    del doc["tables"][0]["kind"]
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="need the table's kind"):
        load_plan(tmp_path / "p.json")


def test_memory_by_kind_counts_what_each_rank_holds() -> None:
    spec = TableSpec(name="t", rows=1000, dim=16, pooling_factor=2.0)
    batch, world = 64, 4
    tw = kind_memory("table_wise", 1000, 16, "fp32", 2.0, batch, world)
    rows = kind_memory("row_wise", 250, 16, "fp32", 2.0, batch, world)
    host = kind_memory("table_row_wise", 500, 16, "fp32", 2.0, batch, world, 2)
    dp = kind_memory("data_parallel", 1000, 16, "fp32", 2.0, batch, world)
    assert rows.weights == tw.weights // 4 and rows.optimizer == tw.optimizer // 4
    # A row shard reads its share of the ids but writes an output for every sample.
    assert rows.io == 2 * 64 * 8 + 64 * 4 * 16 * 4
    assert host.io == 2 * 64 * 4 // 2 * 8 + 64 * 4 * 16 * 4
    assert dp.weights == tw.weights and dp.gradients == dp.weights == dp.optimizer
    assert dp.io == 2 * 64 * 8 + 64 * 16 * 4
    assert kind_memory("row_wise", 0, 16, "fp32", 2.0, batch, world).total == 0
    # The plan sums them per rank.
    plan = plan_of(
        PlanTable(
            name="t",
            rows=1000,
            dim=16,
            kind="row_wise",
            shards=[rw(r, o, n) for r, (o, n) in enumerate(even_row_split(1000, 4))],
        ),
        topology=Topology(gpus=4, gpu_memory_bytes=2**30, batch_size_per_rank=batch),
    )
    assert plan.memory_per_rank([spec]) == [rows.total] * 4


def test_a_row_slice_receives_its_share_of_the_lookups() -> None:
    spec = TableSpec(name="t", rows=1000, dim=16, pooling_factor=8.0)
    part = row_slice(spec, 250, 250)
    assert part.rows == 250 and part.pooling_factor == pytest.approx(2.0)
    assert part.name == "t[250:500]" and part.access_hist == spec.access_hist
    assert row_slice(spec, 0, 1000) is spec


def test_kernel_shards_separate_kinds_and_batches() -> None:
    plan = plan_of(
        PlanTable(name="a", rows=10, dim=16, shards=[Shard(rank=0, cols=16)]),
        PlanTable(
            name="r", rows=10, dim=16, kind="table_row_wise", shards=[rw(0, 0, 5), rw(1, 5, 5)]
        ),
        PlanTable(
            name="d",
            rows=10,
            dim=16,
            kind="data_parallel",
            shards=[Shard(rank=r, cols=16) for r in range(4)],
        ),
    )
    specs = [TableSpec(name=n, rows=10, dim=16, pooling_factor=4.0) for n in "ard"]
    ranks = plan.kernel_shards(specs)
    assert [(k.table, k.group, k.local_batch) for k in ranks[0]] == [
        ("a", "fused", False),
        ("r", "table_row_wise", False),
        ("d", "data_parallel", True),
    ]
    assert ranks[1][0].spec.rows == 5 and ranks[1][0].spec.pooling_factor == 2.0
    assert [k.table for k in ranks[3]] == ["d"]


def test_hosts_must_be_whole() -> None:
    with pytest.raises(ValueError, match="whole number of hosts"):
        Topology(gpus=6, gpu_memory_bytes=2**30, gpus_per_host=4)
    assert Topology(gpus=8, gpu_memory_bytes=1, gpus_per_host=4).hosts == 2

"""The bench's tasks: held-out pools of two families, tight and slack memory by the
memory rule, deterministic draws; and its spec's checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.memory import shard_bytes
from shardwise.planner.plan import table_wise_plan
from shardwise.profiler.bench.spec import (
    FULL,
    QUICK,
    RESERVED_SEEDS,
    BenchSpec,
    PoolSpec,
    Shape,
    load_spec,
    parse_spec,
    spec_json,
)
from shardwise.profiler.bench.tasks import draw_tasks, load_pools, pack, pool_tables


def test_pack_finds_the_tight_packing_greedy_misses() -> None:
    # Largest first gives 3+2+2 | 3+2 (max 7); a swap gives 3+3 | 2+2+2 (max 6).
    where, load = pack([3, 3, 2, 2, 2], 2)
    assert max(load) == 6 and sorted(load) == [6, 6]
    assert [
        sum(s for s, b in zip([3, 3, 2, 2, 2], where, strict=True) if b == k) for k in (0, 1)
    ] == load
    assert max(pack([5, 1, 1], 3)[1]) == 5 and pack([4], 1)[1] == [4]


def spec_of(**changes: object) -> BenchSpec:
    base = BenchSpec(
        pools=[PoolSpec(family="heldout", seed=5, count=12)],
        shapes=[Shape(tables=6, gpus=2), Shape(tables=8, gpus=4)],
        tasks=2,
        global_batch=512,
    )
    return base.model_copy(update=changes)


def test_tight_and_slack_tasks_fill_the_fullest_gpu_as_asked() -> None:
    spec = spec_of()
    pool = make_tables(30, seed=2)
    tasks = draw_tasks(spec, {"heldout-5": pool})
    assert len(tasks) == spec.task_count() == 8
    assert tasks == draw_tasks(spec, {"heldout-5": pool})  # deterministic
    assert len({tuple(t.name for t in task.tables) for task in tasks}) == 8
    for task in tasks:
        lo, hi = spec.fills[task.fill_kind]
        topo = task.topology
        assert lo <= task.fill <= hi + 1e-6, task
        assert task.fill_bound <= task.fill
        assert topo.batch_size_per_rank * topo.gpus == spec.global_batch
        sizes = [shard_bytes(t, t.dim, topo.batch_size_per_rank, topo.gpus) for t in task.tables]
        assert task.memory_total == sum(sizes)
        # The packing the fill was set by is a valid plan under the memory rule, and
        # its fullest GPU is the fill's share of the usable memory.
        where, load = pack(sizes, topo.gpus)
        plan = table_wise_plan(task.tables, where, topo, "packing")
        plan.validate_plan(task.tables)
        used = [m.total for m in plan.rank_memory(task.tables)]
        assert max(used) == max(load) and max(used) / topo.usable_bytes == pytest.approx(task.fill)
    kinds = {t.fill_kind for t in tasks}
    assert kinds == {"tight", "slack"}
    assert min(t.fill for t in tasks if t.fill_kind == "tight") >= 0.85


@pytest.mark.slow
def test_pools_are_held_out_families_written_once(tmp_path: Path) -> None:
    spec = spec_of(
        pools=[
            PoolSpec(family="heldout", seed=5, count=12, max_pooling=30),
            PoolSpec(family="broad", seed=6, count=14, max_table_bytes=2**26),
        ],
        shapes=[Shape(tables=4, gpus=2)],
    )
    steps: list[str] = []
    pools = load_pools(spec, tmp_path, None, steps.append)
    assert set(pools) == {"heldout-5", "broad-6"} and len(steps) == 2
    assert all(t.pooling_factor <= 30 for t in pools["heldout-5"])
    assert all(t.size_bytes <= 2**26 for t in pools["broad-6"])
    assert all(t.name.startswith("heldout_") for t in pools["heldout-5"])
    assert all(t.name.startswith("broad_") for t in pools["broad-6"])
    again = load_pools(spec, tmp_path, None, steps.append)
    assert again == pools and len(steps) == 2  # read back, not drawn again
    with pytest.raises(UserError, match="need at least that many"):
        load_pools(spec_of(shapes=[Shape(tables=100, gpus=2)]), tmp_path / "x", None, print)


def test_a_pool_file_and_its_filters(tmp_path: Path) -> None:
    from shardwise.planner.tables import save_tables

    save_tables(make_tables(8, seed=1), tmp_path / "mine.csv")
    pool = PoolSpec(file="mine.csv", max_pooling=20)
    kept = pool_tables(pool, tmp_path)
    assert kept and all(t.pooling_factor <= 20 for t in kept) and pool.key == "mine"
    with pytest.raises(UserError, match="no table"):
        pool_tables(PoolSpec(file="mine.csv", max_pooling=0.001), tmp_path)


def test_the_builtin_specs_follow_the_protocol() -> None:
    for spec in (FULL, QUICK):
        families = {p.family for p in spec.pools}
        assert len(families) >= 2 and families - {"calibrated"}  # one not our generator
        assert all((p.family, p.seed) not in RESERVED_SEEDS for p in spec.pools)
        assert {"tight", "slack"} <= set(spec.fills)
        assert spec.fills["tight"] == (0.85, 0.95)
    assert 4096 <= FULL.global_batch <= 16384
    assert {"bundled", "calibrated", "calibrated+refined"} <= set(FULL.variants)
    assert FULL.calibrates() and not QUICK.calibrates()
    assert load_spec("quick") == (QUICK, None)
    for spec in (FULL, QUICK):  # what the CLI's overriding options go through
        assert parse_spec(json.dumps(spec_json(spec))) == spec


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("pools: [{family: heldout, seed: 2027}]\nshapes: [{tables: 4, gpus: 2}]\n",
         ["line 1", "'pools.0'", "judged on"]),
        ("pools: [{family: broad, seed: 11}]\nshapes: [{tables: 4, gpus: 2}]\n",
         ["pre-training"]),
        ("pools: [{seed: 3}]\nshapes: [{tables: 4, gpus: 2}]\n", ["family", "file"]),
        ("pools: [{family: heldout, seed: 3}]\nshapes: [{tables: 4, gpus: 3}]\n",
         ["not a multiple of W 3"]),
        ("pools: [{family: heldout, seed: 3}]\nshapes: [{tables: 4, gpus: 2}]\n"
         "fills: {tight: [0.95, 0.85]}\n", ["line 3", "'fills'", "low <= high"]),
        ("pools: [{family: heldout, seed: 3}]\nshapes: [{tables: 4, gpus: 2}]\n"
         "variants: [bundled, tuned]\n", ["line 3", "'tuned'"]),
        ("pools: [{family: heldout, seed: 3}]\nshape: []\n", ["'shape'", "Extra inputs"]),
        ("pools: [{family: heldout, seed: 3}]\nshapes: [{tables: 4, gpus: 2}]\n"
         "calibration_minutes: 0.1\n", ["line 3", "at least 0.33 minutes"]),
        ("- 10\n", ["a bench spec is a mapping"]),
    ],
)  # fmt: skip
def test_bad_specs_name_file_line_and_field(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_spec(str(path))
    for f in fragments:
        assert f in str(err.value), str(err.value)


def test_the_calibration_minimum_is_calibrates() -> None:
    from shardwise.profiler.bench.spec import MIN_CALIBRATION_S
    from shardwise.profiler.calibrate.pipeline import MIN_BUDGET_S

    assert MIN_CALIBRATION_S == MIN_BUDGET_S


def test_a_spec_file_parses() -> None:
    spec = parse_spec(
        '{"pools": [{"family": "heldout", "seed": 3, "max_table_bytes": "1MiB"}], '
        '"shapes": [{"tables": 4, "gpus": 2}], "fills": {"tight": [0.9, 0.9]}}'
    )
    assert spec.pools[0].max_table_bytes == 2**20 and spec.task_count() == 1
    assert spec.rank_batch(2) == spec.global_batch // 2


def test_balanced_sizing_leaves_a_giant_to_no_gpu_and_torchrec_cuts_it() -> None:
    """An industrial-like task: one table holds most of the memory. Balanced sizing makes
    it larger than a GPU (cut row-wise over every GPU), packs the others whole around
    its row shards, and fills the fullest GPU as drawn; that placement is a valid plan,
    and TorchRec at full strength plans the task with the giant in row ranges."""
    from shardwise.planner.baselines.torchrec import TorchRecPlanner
    from shardwise.planner.kinds import ROW_KINDS, even_row_split
    from shardwise.planner.plan import Plan, Shard
    from shardwise.planner.tables import TableSpec
    from shardwise.profiler.bench.tasks import balanced_topology, row_wise_load

    giant = TableSpec(name="giant", rows=400_000, dim=64, pooling_factor=4.0)
    tables = [giant, *make_tables(9, seed=4)]
    topo, fill, bound, total, oversized = balanced_topology(tables, 4, 256, 0.9)
    assert oversized == 1 and fill == pytest.approx(0.9, abs=0.01) and bound <= fill
    whole = [shard_bytes(t, t.dim, 256, 4) for t in tables]
    assert whole[0] > topo.usable_bytes and max(whole[1:]) <= topo.usable_bytes
    assert total == sum(row_wise_load(giant, 4, 256)) + sum(whole[1:])
    where, load = pack(whole[1:], 4, row_wise_load(giant, 4, 256))
    shards = [
        [
            Shard(rank=r, cols=giant.dim, row_offset=o, rows=n)
            for r, (o, n) in enumerate(even_row_split(giant.rows, 4))
        ]
    ] + [[Shard(rank=r, cols=t.dim)] for t, r in zip(tables[1:], where, strict=True)]
    kinds = ["row_wise"] + [None] * 9
    plan = Plan.from_shards(tables, shards, topo, "packing", kinds=kinds)  # type: ignore[arg-type]
    assert plan.problems(tables) == []
    assert max(plan.memory_per_rank(tables)) == max(load)
    assert max(load) / topo.usable_bytes == pytest.approx(fill)
    torchrec = TorchRecPlanner().plan(tables, topo)
    assert {t.name: t.kind for t in torchrec.tables}["giant"] in ROW_KINDS
    assert torchrec.problems(tables) == []


def test_an_industrial_pool_spec_draws_balanced_tasks() -> None:
    spec = BenchSpec(
        pools=[PoolSpec(family="industrial", seed=3, count=30, sizing="balanced")],
        shapes=[Shape(tables=12, gpus=4)],
        fills={"tight": (0.85, 0.95)},
        batch_per_rank=64,
    )
    assert parse_spec(json.dumps(spec_json(spec))) == spec
    assert "sizing" not in spec_json(spec_of())["pools"][0]  # old folders resume
    from shardwise.planner.tables import TableSpec

    giant = TableSpec(name="industrial_giant", rows=2_000_000, dim=64, pooling_factor=3.0)
    pool = [giant, *make_tables(29, seed=7)]
    tasks = draw_tasks(spec, {"industrial-3": pool})
    task = tasks[0]
    assert task.id == "industrial-3-T12-W4-tight-0"
    assert 0.85 <= task.fill <= 0.95 + 1e-6
    topo = task.topology
    sizes = [shard_bytes(t, t.dim, 64, 4) for t in task.tables]
    assert task.oversized == sum(b > topo.usable_bytes for b in sizes)
    assert task.oversized >= (giant in task.tables)
    assert load_spec("industrial")[0].pools[0].sizing == "balanced"
    anchor = load_spec("anchor")[0]
    assert [p.family for p in anchor.pools] == ["heavy", "industrial"]
    assert anchor.batch_per_rank == 1024 and anchor.shapes[0].gpus == 8
    assert parse_spec(json.dumps(spec_json(anchor))) == anchor

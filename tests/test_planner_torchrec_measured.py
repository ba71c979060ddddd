"""TorchRec fed measured costs: it asks for our measurements and plans by them."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.baselines.torchrec import TorchRecPlanner
from shardwise.planner.baselines.torchrec_measured import (
    TorchRecMeasuredPlanner,
    TorchRecMeasuredTwCwPlanner,
)
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan
from shardwise.planner.registry import get_planner
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import torchrec_problems
from shardwise.profiler.bench.measure import SingleShardCosts

GiB = 2**30
# Four identical tables: TorchRec's own model prices them alike.
SAME = [TableSpec(name=f"s{i}", rows=10_000, dim=64, pooling_factor=5.0) for i in range(4)]
TOPO = Topology(gpus=2, gpu_memory_bytes=GiB, batch_size_per_rank=128, device="cpu")


def ranks_of(plan: Plan) -> dict[str, list[int]]:
    return {t.name: [s.rank for s in t.shards] for t in plan.tables}


def test_registry_finds_both() -> None:
    planner = get_planner("torchrec-measured")
    assert type(planner) is TorchRecMeasuredPlanner and planner.summary
    assert "row_wise" in planner.sharding_types
    restricted = get_planner("torchrec-measured-tw-cw")
    assert isinstance(restricted, TorchRecMeasuredTwCwPlanner)
    assert restricted.sharding_types == ("table_wise", "column_wise")


def test_without_measurements_it_says_what_it_needs() -> None:
    with pytest.raises(UserError, match="torchrec-measured-tw-cw planner .* no measurements"):
        TorchRecMeasuredTwCwPlanner().plan(SAME, TOPO)


def test_plans_by_the_injected_costs_where_torchrec_disagrees() -> None:
    """s0 measures 30x the others: measured TorchRec gives it a rank of its own;
    TorchRec as shipped, seeing four equal tables, pairs them."""
    calls: list[tuple[str, int, int]] = []

    def measure(spec: TableSpec, cols: int, batch: int) -> tuple[float, float]:
        calls.append((spec.name, cols, batch))
        return (0.010, 0.020) if spec.name == "s0" else (0.0003, 0.0007)

    planner = TorchRecMeasuredTwCwPlanner(measure=measure)
    measured = planner.plan(SAME, TOPO)
    shipped = TorchRecPlanner(sharding_types=["table_wise", "column_wise"]).plan(SAME, TOPO)
    assert measured.problems(SAME) == [] and torchrec_problems(measured) == []
    assert measured.planner == "torchrec-measured-tw-cw"
    # Every shard was priced by us: whole tables at the global batch (128 x 2 ranks).
    assert {name for name, _, _ in calls} == {t.name for t in SAME}
    assert {(cols, batch) for _, cols, batch in calls} == {(64, 256)}
    assert planner.measured == calls
    rank0 = ranks_of(measured)["s0"]
    assert [n for n, r in ranks_of(measured).items() if r == rank0] == ["s0"]
    assert ranks_of(shipped) != ranks_of(measured)
    assert sorted(Counter(r[0] for r in ranks_of(shipped).values()).values()) == [2, 2]


def test_with_real_measurements() -> None:
    """The benchmark's memoized compute measurements drive a valid plan: restricted, one
    measurement per table; unrestricted, also each table's row ranges (2 ranks) at the
    global batch and its data-parallel copy (fp32 tables) at the local batch."""
    tables = [t.model_copy(update={"rows": min(t.rows, 20_000)}) for t in make_tables(6, seed=3)]
    costs = SingleShardCosts()
    plan = TorchRecMeasuredTwCwPlanner(measure=costs).plan(tables, TOPO)
    assert plan.problems(tables) == []
    assert costs.calls == len(tables) and costs.seconds > 0  # one measurement per table
    TorchRecMeasuredTwCwPlanner(measure=costs).plan(tables, TOPO)
    assert costs.calls == len(tables)  # memoized
    full = TorchRecMeasuredPlanner(measure=costs)
    plan = full.plan(tables, TOPO)
    assert plan.problems(tables) == [] and torchrec_problems(plan) == []
    # + 2 row ranges each, and a local-batch copy of each fp32 table (fp16 ones are
    # never data-parallel)
    fp32 = sum(t.dtype == "fp32" for t in tables)
    assert 0 < fp32 < len(tables) and costs.calls == 3 * len(tables) + fp32
    assert {b for _, _, b in full.measured} == {128, 256}


def test_row_kinds_are_priced_by_their_row_ranges() -> None:
    """A row-wise shard is measured as its row range's kernel: that many rows with their
    share of the lookups (named t[a:b]), its width, at the global batch; TorchRec's even
    cut leaves a 3-row table's last rank empty, which costs nothing and is not measured."""
    tables = [*SAME[:2], TableSpec(name="tiny", rows=3, dim=16, pooling_factor=2.0)]
    topo = Topology(gpus=4, gpu_memory_bytes=GiB, batch_size_per_rank=32, device="cpu")
    seen: dict[str, TableSpec] = {}

    def measure(spec: TableSpec, cols: int, batch: int) -> tuple[float, float]:
        seen[spec.name] = spec
        return 1e-4 * spec.pooling_factor, 2e-4 * spec.pooling_factor

    planner = TorchRecMeasuredPlanner(measure=measure, sharding_types=["row_wise"])
    plan = planner.plan(tables, topo)
    assert plan.kinds() == {"row_wise": 3}
    assert plan.problems(tables) == [] and torchrec_problems(plan) == []
    want = {f"{t.name}[{o}:{o + n}]" for t in tables for o, n in even_row_split(t.rows, 4) if n > 0}
    assert set(seen) == want and {b for _, _, b in planner.measured} == {128}
    assert {c for name, c, _ in planner.measured if name.startswith("tiny")} == {16}
    for t in tables:  # the ranges' lookups add up to the table's
        share = sum(s.pooling_factor for n, s in seen.items() if n.startswith(f"{t.name}["))
        assert share == pytest.approx(t.pooling_factor)


def test_data_parallel_is_priced_at_the_local_batch() -> None:
    """A data-parallel copy reads only its rank's samples: the whole table at the
    batch per rank, not the global batch."""
    calls: list[tuple[str, int, int]] = []

    def measure(spec: TableSpec, cols: int, batch: int) -> tuple[float, float]:
        calls.append((spec.name, cols, batch))
        return 1e-4, 2e-4

    tables = SAME[:2]
    planner = TorchRecMeasuredPlanner(measure=measure, sharding_types=["data_parallel"])
    plan = planner.plan(tables, TOPO)
    assert plan.kinds() == {"data_parallel": 2}
    assert plan.problems(tables) == [] and torchrec_problems(plan) == []
    assert set(calls) == {(t.name, t.dim, TOPO.batch_size_per_rank) for t in tables}

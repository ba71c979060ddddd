"""TorchRec fed measured costs: it asks for our measurements and plans by them."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.baselines.torchrec import TorchRecPlanner
from shardwise.planner.baselines.torchrec_measured import TorchRecMeasuredPlanner
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


def test_registry_finds_it() -> None:
    planner = get_planner("torchrec-measured")
    assert isinstance(planner, TorchRecMeasuredPlanner) and planner.summary


def test_without_measurements_it_says_what_it_needs() -> None:
    with pytest.raises(UserError, match="no measurements"):
        TorchRecMeasuredPlanner().plan(SAME, TOPO)


def test_plans_by_the_injected_costs_where_torchrec_disagrees() -> None:
    """s0 measures 30x the others: measured TorchRec gives it a rank of its own;
    TorchRec as shipped, seeing four equal tables, pairs them."""
    calls: list[tuple[str, int, int]] = []

    def measure(spec: TableSpec, cols: int, batch: int) -> tuple[float, float]:
        calls.append((spec.name, cols, batch))
        return (0.010, 0.020) if spec.name == "s0" else (0.0003, 0.0007)

    planner = TorchRecMeasuredPlanner(measure=measure)
    measured = planner.plan(SAME, TOPO)
    shipped = TorchRecPlanner().plan(SAME, TOPO)
    assert measured.problems(SAME) == [] and torchrec_problems(measured) == []
    assert measured.planner == "torchrec-measured"
    # Every shard was priced by us: whole tables at the global batch (128 x 2 ranks).
    assert {name for name, _, _ in calls} == {t.name for t in SAME}
    assert {(cols, batch) for _, cols, batch in calls} == {(64, 256)}
    assert planner.measured == calls
    rank0 = ranks_of(measured)["s0"]
    assert [n for n, r in ranks_of(measured).items() if r == rank0] == ["s0"]
    assert ranks_of(shipped) != ranks_of(measured)
    assert sorted(Counter(r[0] for r in ranks_of(shipped).values()).values()) == [2, 2]


def test_with_real_measurements() -> None:
    """The benchmark's memoized compute measurements drive a valid plan."""
    tables = [t.model_copy(update={"rows": min(t.rows, 20_000)}) for t in make_tables(6, seed=3)]
    costs = SingleShardCosts()
    plan = TorchRecMeasuredPlanner(measure=costs).plan(tables, TOPO)
    assert plan.problems(tables) == []
    assert costs.calls == len(tables) and costs.seconds > 0  # one measurement per table
    TorchRecMeasuredPlanner(measure=costs).plan(tables, TOPO)
    assert costs.calls == len(tables)  # memoized

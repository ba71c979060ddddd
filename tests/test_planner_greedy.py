"""The heuristic baselines: valid, memory-safe, balanced by their own measure."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import make_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.base import Planner, PlannerOptions, run_planner
from shardwise.planner.greedy import GreedyPlanner
from shardwise.planner.plan import InvalidPlanError, Plan, Topology, table_wise_plan
from shardwise.planner.registry import get_planner, planner_names
from shardwise.planner.tables import TableSpec

HEURISTICS = ["random", "size-greedy", "dim-greedy", "lookup-greedy", "size-lookup-greedy"]


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 60),
    seed=st.integers(0, 10**6),
    gpus=st.integers(1, 16),
    slack=st.floats(1.05, 4.0),
    name=st.sampled_from(HEURISTICS),
)
def test_never_over_memory(count: int, seed: int, gpus: int, slack: float, name: str) -> None:
    """Either a valid plan within memory, or a UserError: never a silent overflow."""
    tables = make_tables(count, seed)
    need = max(max(t.size_bytes for t in tables), sum(t.size_bytes for t in tables) / gpus)
    topo = Topology(gpus=gpus, gpu_memory_bytes=int(need * slack / 0.85) + 1)
    try:
        plan = get_planner(name, PlannerOptions(seed=seed)).plan(tables, topo)
    except UserError as e:
        assert "cannot fit" in str(e)
        return
    assert plan.problems(tables) == []
    assert all(m <= topo.usable_bytes for m in plan.memory_per_rank())


@pytest.mark.parametrize("name", HEURISTICS[1:])
def test_greedy_is_within_the_lpt_bound(name: str) -> None:
    """With memory to spare, longest-first greedy keeps max load <= mean + largest item."""
    tables = make_tables(80, seed=3)
    planner = get_planner(name)
    assert isinstance(planner, GreedyPlanner)
    topo = Topology(gpus=8, gpu_memory_bytes=2**40)
    plan = planner.plan(tables, topo)
    by_name = {t.name: t for t in tables}
    loads = [
        sum(planner.cost(by_name[t.name]) for t, _ in shards) for shards in plan.shards_per_rank()
    ]
    costs = [planner.cost(t) for t in tables]
    assert max(loads) <= sum(costs) / 8 + max(costs)
    # ... and far better balanced than chance on its own measure.
    rnd = get_planner("random").plan(tables, topo)
    rnd_loads = [
        sum(planner.cost(by_name[t.name]) for t, _ in shards) for shards in rnd.shards_per_rank()
    ]
    assert max(loads) < max(rnd_loads)


def test_deterministic_and_seeded() -> None:
    tables = make_tables(40)
    topo = Topology(gpus=4, gpu_memory_bytes=2**34)
    for name in HEURISTICS:
        assert get_planner(name).plan(tables, topo) == get_planner(name).plan(tables, topo)
    a = get_planner("random", PlannerOptions(seed=1)).plan(tables, topo)
    b = get_planner("random", PlannerOptions(seed=2)).plan(tables, topo)
    assert a.hash != b.hash


def test_table_larger_than_a_gpu_is_named() -> None:
    big = TableSpec(name="t17", rows=10**8, dim=25 * 4, pooling_factor=1)  # 37.3 GiB
    small = TableSpec(name="t1", rows=10, dim=4, pooling_factor=1)
    topo = Topology(gpus=8, gpu_memory_bytes=32 * 2**30)
    with pytest.raises(UserError) as info:
        get_planner("size-greedy").plan([small, big], topo)
    assert str(info.value).startswith(
        "table t17 needs 37.3 GiB; each GPU has 27.2 GiB after a 15% reserve of 32.0 GiB"
    )


def test_total_too_large() -> None:
    tables = [TableSpec(name=f"t{i}", rows=2**20, dim=64, pooling_factor=1) for i in range(10)]
    with pytest.raises(UserError, match=r"10 tables need 2.5 GiB in total, but 2 GPUs hold"):
        get_planner("dim-greedy").plan(tables, Topology(gpus=2, gpu_memory_bytes=2**30))


def test_registry() -> None:
    assert set(HEURISTICS) | {"torchrec", "neuroshard"} <= set(planner_names())
    with pytest.raises(UserError, match="unknown planner 'best'; choose one of: random"):
        get_planner("best")


def test_run_planner_plans_validates_and_prices() -> None:
    """The one path the CLI, the benchmark and the operator plan through."""
    from shardwise.planner.costmodel import CostPredictor, load_bundled

    tables = make_tables(12)
    topo = Topology(gpus=4, gpu_memory_bytes=2**34, device="cpu")
    predictor = CostPredictor(load_bundled())
    planner = get_planner("size-greedy", PlannerOptions(batch_size_per_rank=64))
    run = run_planner(planner, tables, topo, predictor)
    assert run.plan.problems(tables) == [] and run.seconds >= 0
    assert run.prediction is not None and run.prediction.batch_size_per_rank == 64
    assert run.plan.predicted == run.prediction.predicted()
    assert run.plan.hash == planner.plan(tables, topo).hash
    unpriced = run_planner(planner, tables, topo)
    assert unpriced.plan.predicted is None and unpriced.prediction is None
    # A plan the planner priced itself (NeuroShard's search) keeps its own prediction.
    searched = run_planner(
        get_planner("neuroshard", PlannerOptions(predictor=predictor)), tables, topo, predictor
    )
    assert searched.prediction is None and searched.plan.predicted is not None


def test_run_planner_refuses_an_invalid_plan() -> None:
    class DropsATable(Planner):
        name = "drops-a-table"
        summary = "forgets the first table"

        def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
            return table_wise_plan(tables[1:], [0] * (len(tables) - 1), topology, self.name)

    tables = make_tables(3)
    with pytest.raises(
        InvalidPlanError, match="the drops-a-table planner's plan is not a valid plan"
    ):
        run_planner(DropsATable(), tables, Topology(gpus=2, gpu_memory_bytes=2**34))

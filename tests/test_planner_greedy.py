"""The heuristic baselines: valid, memory-safe, balanced by their own measure."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import make_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.base import Planner, PlannerOptions, check_capacity, run_planner
from shardwise.planner.baselines.greedy import GreedyPlanner
from shardwise.planner.memory import table_bytes
from shardwise.planner.plan import InvalidPlanError, Plan, table_wise_plan
from shardwise.planner.registry import get_planner, planner_names
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

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
    # Memory as the rule counts it (weights + optimizer + I/O at the job's batch).
    sizes = [table_bytes(t, Topology(gpus=gpus, gpu_memory_bytes=1)) for t in tables]
    need = max(max(sizes), sum(sizes) / gpus)
    topo = Topology(gpus=gpus, gpu_memory_bytes=int(need * slack / 0.85) + 1)
    try:
        plan = get_planner(name, PlannerOptions(seed=seed)).plan(tables, topo)
    except UserError as e:
        assert "cannot fit" in str(e)
        return
    assert plan.problems(tables) == []
    assert all(m <= topo.usable_bytes for m in plan.memory_per_rank(tables))
    # Weights alone would have let a tighter plan through: the rule counts more.
    assert sum(plan.memory_per_rank(tables)) > sum(t.size_bytes for t in tables)


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


def test_table_larger_than_a_gpu_goes_row_wise_and_one_larger_than_all_is_named() -> None:
    # 37.3 GiB of weights, 10^8 x 4 B of row-wise state: no 32 GiB GPU holds it whole, so
    # it goes row-wise over the 8; ten times the rows fit nowhere, even row-wise.
    big = TableSpec(name="t17", rows=10**8, dim=25 * 4, pooling_factor=1)
    small = TableSpec(name="t1", rows=10, dim=4, pooling_factor=1)
    topo = Topology(gpus=8, gpu_memory_bytes=32 * 2**30)
    plan = get_planner("size-greedy").plan([small, big], topo)
    assert [t.kind for t in plan.tables] == ["table_wise", "row_wise"]
    assert plan.problems([small, big]) == []
    huge = big.model_copy(update={"rows": 10**9})
    with pytest.raises(UserError) as info:
        get_planner("size-greedy").plan([small, huge], topo)
    text = str(info.value)
    assert text.startswith(
        "table t17 (1000000000 rows x 100 fp32) needs 376.5 GiB whole, and even row-wise over "
        "all 8 GPUs each holds 47.2 GiB (weights 46.6 GiB + optimizer 476.8 MiB + I/O buffers "
        "200.5 MiB) at batch 65536 per rank x 8 ranks"
    ), text
    assert text.endswith(
        "What would fit: GPUs of 55.6 GiB (--gpu-memory, at the 15% reserve), or 15 GPUs (--gpus)."
    ), text


def test_total_too_large() -> None:
    tables = [TableSpec(name=f"t{i}", rows=2**20, dim=64, pooling_factor=1) for i in range(10)]
    with pytest.raises(UserError) as info:
        get_planner("dim-greedy").plan(tables, Topology(gpus=2, gpu_memory_bytes=2**30))
    text = str(info.value)
    assert text.startswith(
        "the 10 tables need 2.9 GiB (weights 2.5 GiB + optimizer 40.0 MiB + I/O buffers "
        "330.0 MiB) in total at batch 65536 per rank x 2 ranks"
    ), text
    # What would fit: GPU memory for half the total, or more GPUs (each adds its memory
    # but also ids and outputs to every shard); no batch, the weights alone are too big.
    assert "GPUs of 1.7 GiB would fit it (--gpu-memory, at the 15% reserve), or 4 GPUs" in text
    assert "no smaller batch fits" in text
    # The bounds it names are the least that pass the total check (packing may need more).
    check_capacity(tables, Topology(gpus=4, gpu_memory_bytes=2**30))
    with pytest.raises(UserError, match="in total"):
        check_capacity(tables, Topology(gpus=3, gpu_memory_bytes=2**30))
    check_capacity(tables, Topology(gpus=2, gpu_memory_bytes=int(1.7 * 2**30) + 2**24))


def test_registry() -> None:
    assert set(HEURISTICS) | {"torchrec", "neuroshard"} <= set(planner_names())
    with pytest.raises(UserError, match="unknown planner 'best'; choose one of: random"):
        get_planner("best")


def test_run_planner_plans_validates_and_prices() -> None:
    """The one path the CLI, the benchmark and the operator plan through."""
    from shardwise.planner.costmodel import CostPredictor, load_bundled

    tables = make_tables(12)
    topo = Topology(gpus=4, gpu_memory_bytes=2**34, device="cpu", batch_size_per_rank=64)
    predictor = CostPredictor(load_bundled())
    planner = get_planner("size-greedy", PlannerOptions())
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

"""The bench's per-task cost-model quality (profiler/bench/quality.py): Spearman and MAPE
of predicted against measured per-rank compute, on fakes whose answers are known; the
heavy spec and the per-rank batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.plan import Plan, PlanCost, RankCost, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.profiler.bench.quality import quality, summary, task_quality
from shardwise.profiler.bench.results import ModelQuality, PlannerResult, TaskResult
from shardwise.profiler.bench.spec import (
    BUILTIN,
    FULL,
    HEAVY,
    QUICK,
    RESERVED_SEEDS,
    BenchSpec,
    PoolSpec,
    Shape,
    load_spec,
    parse_spec,
    spec_json,
)
from shardwise.profiler.bench.tasks import draw_tasks

TABLES = make_tables(9, seed=3)
TOPO = Topology(gpus=4, gpu_memory_bytes=2**36)


class FakePredictor:
    """Prices each rank by ``price(measured compute of that rank)``: the measured
    figures are known to the test, so the metrics' answers are too."""

    def __init__(self, measured: dict[str, list[float]], price: Callable[[float], float]):
        self.measured = measured
        self.price = price
        self.calls = 0

    def predict_plan(self, plan: Plan, tables: list[TableSpec]) -> PlanCost:
        self.calls += 1
        ranks = [
            RankCost(r, 0.25 * self.price(m), 0.75 * self.price(m), 1.0, 1.0)  # comm ignored
            for r, m in enumerate(self.measured[plan.hash])
        ]
        return PlanCost(plan.hash, plan.planner, plan.world_size, 1, "cpu", ranks)


def _plans() -> tuple[dict[str, Plan], dict[str, PlannerResult], dict[str, list[float]]]:
    """Three rows, two of them one placement; rank 3 of ``lopsided`` holds nothing."""
    even = table_wise_plan(TABLES, [i % 4 for i in range(9)], TOPO, "even")
    lopsided = table_wise_plan(TABLES, [0, 0, 0, 0, 1, 1, 2, 2, 2], TOPO, "lopsided")
    measured = {even.hash: [4e-3, 5e-3, 6e-3, 7e-3], lopsided.hash: [9e-3, 2e-3, 3e-3, 0.0]}
    plans = {"a": even, "b": lopsided, "c": even}
    outcomes = {
        row: PlannerResult(
            planner=row,
            status="ok",
            plan_hash=p.hash,
            max_s=max(measured[p.hash]) + 1e-3,
            compute_per_rank=measured[p.hash],
        )
        for row, p in plans.items()
    }
    return plans, outcomes, measured


def _quality(price: Callable[[float], float]) -> tuple[ModelQuality, FakePredictor]:
    plans, outcomes, measured = _plans()
    fake = FakePredictor(measured, price)
    got = quality(plans, outcomes, TABLES, cast(Any, fake), "fake sha256:0")
    return got, fake


def test_a_perfect_predictor_has_rho_1_and_mape_0() -> None:
    q, fake = _quality(lambda m: m)
    # Rows a and c share a placement: one plan; the empty rank is left out.
    assert (q.plans, q.ranks, fake.calls) == (2, 7, 2)
    assert q.spearman == pytest.approx(1.0) and q.mape == pytest.approx(0.0)
    assert q.model == "fake sha256:0"


def test_a_reversed_predictor_has_rho_minus_1_and_a_scaled_one_its_mape() -> None:
    reversed_, _ = _quality(lambda m: 1.0 / m if m else 0.0)  # the empty rank: any price
    assert reversed_.spearman == pytest.approx(-1.0)
    half_again, _ = _quality(lambda m: 1.5 * m)  # right order, 50 % too high everywhere
    assert half_again.spearman == pytest.approx(1.0) and half_again.mape == pytest.approx(0.5)


def test_unmeasured_rows_are_left_out_and_kinds_without_ranks_too() -> None:
    plans, outcomes, measured = _plans()
    outcomes["b"] = PlannerResult(planner="b", status="measure-failed", error="too big")
    fake = FakePredictor(measured, lambda m: m)
    got = task_quality(plans, outcomes, TABLES, {"bundled": ("b", cast(Any, fake))})
    assert set(got) == {"bundled"} and got["bundled"].ranks == 4
    failed = {row: PlannerResult(planner=row, status="plan-failed") for row in plans}
    assert task_quality(plans, failed, TABLES, {"bundled": ("b", cast(Any, fake))}) == {}


def test_summary_takes_medians_over_tasks() -> None:
    def task(name: str, rho: float | None, mape: float) -> TaskResult:
        doc: dict[str, Any] = {
            **dict.fromkeys(TaskResult.__dataclass_fields__, 0),
            "task": name,
            "table_names": [],
            "bound_per_repeat": [],
            "planners": {},
        }
        doc["model_quality"] = {"bundled": ModelQuality("m", 2, 8, rho, mape)}
        return TaskResult.from_json(json.loads(json.dumps(TaskResult(**doc).to_json())))

    got = summary([task("x", 0.2, 0.4), task("y", 0.6, 0.1), task("z", None, 0.2)])
    assert got == {
        "bundled": {
            "tasks": 3,
            "spearman_median": pytest.approx(0.4),
            "spearman_min": 0.2,
            "mape_median": 0.2,
            "mape_max": 0.4,
            "ranks": 24,
        }
    }


# --------------------------------------------------------------------------- the spec


def test_the_heavy_spec_is_valid_and_as_documented() -> None:
    assert BUILTIN["heavy"] is HEAVY and load_spec("heavy") == (HEAVY, None)
    assert parse_spec(json.dumps(spec_json(HEAVY))) == HEAVY  # the CLI's overrides
    (pool,) = HEAVY.pools
    assert pool.family == "heavy" and (pool.family, pool.seed) not in RESERVED_SEEDS
    assert pool.max_table_bytes == 2**30 and pool.max_pooling == 100
    assert all(60 <= s.tables <= 160 and 8 <= s.gpus <= 16 for s in HEAVY.shapes)
    assert HEAVY.fills == {"tight": (0.85, 0.95)} and HEAVY.calibrates()
    assert [HEAVY.rank_batch(s.gpus) for s in HEAVY.shapes] == [1024] * 3
    assert HEAVY.batch_text() == "batch 1024 per rank (global 8192-16384)"
    assert "global_batch" not in spec_json(HEAVY)
    # Each task is calibrated on its own tables, W and memory, as a job is.
    assert HEAVY.calibrate_on == "task" and spec_json(HEAVY)["calibrate_on"] == "task"
    # The other specs read as they did before batch_per_rank and calibrate_on (results
    # folders resume).
    for spec in (FULL, QUICK):
        assert "batch_per_rank" not in spec_json(spec) and spec_json(spec)["global_batch"]
        assert "calibrate_on" not in spec_json(spec) and spec.calibrate_on == "pool"
    with pytest.raises(UserError, match="field 'calibrate_on'"):
        parse_spec("pools: [{family: heavy, seed: 3}]\ncalibrate_on: job\nshapes: []\n")


def test_batch_per_rank_sets_each_tasks_global_batch() -> None:
    spec = BenchSpec(
        pools=[PoolSpec(family="heavy", seed=3, count=12)],
        shapes=[Shape(tables=4, gpus=2), Shape(tables=4, gpus=3)],
        fills={"tight": (0.9, 0.9)},
        batch_per_rank=100,  # no global batch is a multiple of both W
    )
    pool = make_tables(12, seed=1)
    tasks = draw_tasks(spec, {"heavy-3": pool})
    assert [t.topology.batch_size_per_rank * t.topology.gpus for t in tasks] == [200, 300]
    with pytest.raises(UserError, match=r"line 3: field 'batch_per_rank'.*not both"):
        parse_spec(
            "pools: [{family: heavy, seed: 3}]\nglobal_batch: 512\nbatch_per_rank: 64\n"
            "shapes: [{tables: 4, gpus: 2}]\n",
            "s.yaml",
        )
    with pytest.raises(UserError, match="'batch_per_rank'.*greater than or equal to 1"):
        parse_spec("pools: [{family: heavy, seed: 3}]\nbatch_per_rank: 0\nshapes: []\n")

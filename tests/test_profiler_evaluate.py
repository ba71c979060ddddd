"""The evaluator measures plans for real: per-rank compute and all-to-all."""

from __future__ import annotations

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.planner.plan import Topology, table_wise_plan
from shardwise.profiler.evaluate import evaluate_plan

pytestmark = pytest.mark.slow
TABLES = [t.model_copy(update={"rows": min(t.rows, 50_000)}) for t in make_tables(8, seed=2)]
TOPO = Topology(gpus=2, gpu_memory_bytes=2**34)


def test_lopsided_plan_costs_more_on_its_heavy_rank() -> None:
    """Everything on rank 0 vs an even split: measured, not modelled."""
    lopsided = table_wise_plan(TABLES, [0] * 8, TOPO, "all-on-0")
    even = table_wise_plan(TABLES, [i % 2 for i in range(8)], TOPO, "even")
    a = evaluate_plan(lopsided, TABLES, batch_size_per_rank=256, repeats=2)
    b = evaluate_plan(even, TABLES, batch_size_per_rank=256, repeats=2)
    assert a.ranks[1].fwd_compute_s == 0 and a.ranks[1].bwd_compute_s == 0  # empty rank
    assert a.ranks[0].bwd_compute_s > 0 and a.max_s > b.max_s
    assert a.max_over_mean > b.max_over_mean >= 1.0
    # The idle rank waits for the busy one in the forward all-to-all (straggler wait).
    assert a.ranks[1].fwd_comm_s > a.ranks[0].fwd_comm_s
    assert len(a.max_per_repeat) == 2 and a.repeat_cv >= 0
    assert a.allocator_mitigated
    doc = a.to_json()
    assert doc["max_s"] == a.max_s and len(doc["ranks"]) == 2  # type: ignore[arg-type]


def test_plan_must_match_tables() -> None:
    plan = table_wise_plan(TABLES, [0] * 8, TOPO, "x")
    with pytest.raises(UserError, match="not in the plan"):
        evaluate_plan(plan, make_tables(9, seed=2), repeats=1)

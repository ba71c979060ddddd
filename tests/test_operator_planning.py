"""Plan inputs, their hash, and the planner process (:mod:`shardwise.operator.planning`)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from operator_builders import A100

from shardwise.operator.planning import PlanInputs, compute_plan, in_spec_terms, make_request
from shardwise.planner.tables import TableSpec

pytest_plugins = ["k8s.fixtures"]


def inputs(**changes: Any) -> PlanInputs:
    base: dict[str, Any] = {
        "tables": [{"name": "t"}],
        "planner": "lookup-greedy",
        "seed": 0,
        "gpu_type": A100,
        "workers": 2,
        "gpus_per_worker": 2,
        "gpu_memory_bytes": 2**30,
        "memory_reserve": 0.15,
        "batch_size_per_rank": 512,
        "device": "cuda",
    }
    return PlanInputs(**(base | changes))


def test_inputs_hash_is_stable_and_sensitive() -> None:
    assert inputs().hash() == inputs().hash()
    assert inputs().hash() != inputs(workers=3).hash() != inputs(planner="neuroshard").hash()
    assert "spec.planner.gpuMemory" in in_spec_terms("Give more GPU memory (--gpu-memory)")


def test_compute_plan_in_the_planner_process(plan_pool: concurrent.futures.Executor) -> None:
    tables = [TableSpec(name=f"t{i}", rows=10_000, dim=32, pooling_factor=2.0) for i in range(6)]
    ok = plan_pool.submit(compute_plan, make_request(inputs(), tables, None)).result(timeout=120)
    assert ok.error is None and ok.fingerprint
    plan = ok.plan()
    assert plan.planner == "lookup-greedy" and plan.predicted is not None, (
        "greedy plans are priced too"
    )
    assert plan.validate_plan(tables) is plan
    huge = [TableSpec(name="huge", rows=10**9, dim=64, pooling_factor=1.0)]
    bad = plan_pool.submit(compute_plan, make_request(inputs(), huge, None)).result(timeout=120)
    assert bad.plan_json is None and bad.error is not None
    assert bad.error.startswith("table huge is too big for any rank"), bad.error
    assert "(weights 238.4 GiB + optimizer 3.7 GiB + I/O buffers" in bad.error

"""Plan inputs, their hash, and the planner process
(:mod:`shardwise.operator.loop.planner_pool`)."""

from __future__ import annotations

import concurrent.futures
import datetime
import json
from typing import Any

from operator_builders import A100

from shardwise.operator.config import OperatorConfig
from shardwise.operator.decide.records import PlanFailure
from shardwise.operator.loop.planner_pool import compute_plan, in_spec_terms, make_request
from shardwise.operator.models.plan_inputs import PlanInputs
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
    assert in_spec_terms("or 116 GPUs (--gpus).") == (
        "or 116 GPUs (spec.workers.max × spec.gpusPerWorker, on nodes that have them)."
    )


def test_compute_plan_in_the_planner_process(plan_pool: concurrent.futures.Executor) -> None:
    tables = [TableSpec(name=f"t{i}", rows=10_000, dim=32, pooling_factor=2.0) for i in range(6)]
    ok = plan_pool.submit(compute_plan, make_request(inputs(), tables, None)).result(timeout=120)
    assert ok.error is None and ok.fingerprint
    plan = ok.plan()
    assert plan.planner == "lookup-greedy" and plan.predicted is not None, (
        "greedy plans are priced too"
    )
    assert plan.validate_plan(tables) is plan
    assert plan.topology == inputs().topology() and plan.topology.gpus_per_host == 2, (
        "2 worker pods of 2 GPUs: 2 hosts"
    )
    huge = [TableSpec(name="huge", rows=10**9, dim=64, pooling_factor=1.0)]
    bad = plan_pool.submit(compute_plan, make_request(inputs(), huge, None)).result(timeout=120)
    assert bad.plan_json is None and bad.error is not None
    # too big even row-wise over every GPU: the planner's figures, in spec terms
    assert bad.error.startswith("table huge "), bad.error
    assert "row-wise" in bad.error and "(weights " in bad.error, bad.error
    assert "spec.planner.gpuMemory" in bad.error and "--gpu-memory" not in bad.error


def test_compute_live_plan_relieves_the_measured_straggler() -> None:
    """The operator's live re-plan (the closed loop) in the planner's code: a rank whose
    live shard costs are 4x moves shards off; a balanced one moves nothing."""
    from shardwise.operator.loop.planner_pool import LivePlanRequest, compute_live_plan
    from shardwise.planner.live.summary import LiveSummary, RankCost, ShardCost
    from shardwise.planner.plan import table_wise_plan
    from shardwise.planner.topology import Topology

    specs = [TableSpec(name=f"t{i}", rows=1000, dim=16, pooling_factor=2.0) for i in range(8)]
    topo = Topology(gpus=2, gpu_memory_bytes=2**30, device="cpu", batch_size_per_rank=64)
    plan = table_wise_plan(specs, [i % 2 for i in range(8)], topo, planner="test")

    def live(heavy: float) -> str:
        shards = [
            ShardCost(table=t.name, rank=i % 2, cols=16, ms=heavy if i == 0 else 1.0)
            for i, t in enumerate(specs)
        ]
        ranks = [
            RankCost(rank=r, samples=5, fwdComputeMs=c / 3, bwdComputeMs=2 * c / 3)
            for r, c in enumerate((heavy + 3.0, 4.0))
        ]
        return LiveSummary(
            planHash=plan.hash, worldSize=2, batchSizePerRank=64, step=50, steps=1000,
            writtenAt="2026-11-26T12:00:00Z", ranks=ranks, shards=shards,
        ).to_json()  # fmt: skip

    def request(heavy: float) -> LivePlanRequest:
        return LivePlanRequest(
            plan.model_dump_json(),
            json.dumps([t.model_dump(mode="json") for t in specs]),
            topo.model_dump_json(),
            live(heavy),
        )

    out = compute_live_plan(request(4.0))
    assert out.error is None and out.plan_json is not None
    assert out.live["fromMaxMs"] == 7.0 and out.live["predictedMaxMs"] < 7.0
    assert out.live["moves"] >= 1 and out.live["gain"] > 0.1
    assert out.plan().hash != plan.hash and "moving" in out.live["describe"]
    same = compute_live_plan(request(1.0))
    assert same.error is None and same.plan_json is None and same.live["moves"] == 0
    stale = compute_live_plan(
        LivePlanRequest(plan.model_dump_json(), request(1.0).tables_json,
                        topo.model_dump_json(), live(4.0).replace(plan.hash, "f" * 64))
    )  # fmt: skip
    assert stale.plan_json is None and stale.error is not None


def test_a_tables_failure_backs_off_and_an_edited_job_retries_at_once() -> None:
    cfg = OperatorConfig(tables_retry_seconds=30, max_tables_retry_seconds=600)
    assert [cfg.tables_retry_after(n) for n in (1, 2, 3, 5, 6, 99)] == [30, 60, 120, 480, 600, 600]
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    failure = PlanFailure("InvalidTables", "bad", t0 + datetime.timedelta(seconds=60), 2, 3)
    assert not failure.due(t0, generation=3)
    assert failure.due(t0 + datetime.timedelta(seconds=60), generation=3)
    assert failure.due(t0, generation=4)  # the job was edited: no wait
    assert not PlanFailure("Infeasible", "too big").due(t0, generation=9)  # inputs must change

"""Builders for the operator's pure tests (``tests/test_operator_<module>.py``): a spec,
profiling attempts, published models, pods, plan records and an ``Observed``, all at a
fixed time ``NOW``."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

from k8s.helpers import dlrmjob

from shardwise import names
from shardwise.operator.cluster.capacity import NodeInfo
from shardwise.operator.cluster.summaries import ChildRef, JobState, PlanRecord
from shardwise.operator.config import OperatorConfig
from shardwise.operator.crd import parse_spec
from shardwise.operator.decide.reconcile import Observed
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.render import children as render
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

CFG = OperatorConfig()
NOW = datetime.datetime(2026, 5, 1, 12, 0, tzinfo=datetime.UTC)
A100 = "NVIDIA-A100-SXM4-80GB"
JOB = render.JobMeta("dj", "ml", "uid-1", 1)


def spec(gpu_memory: str | None = "2Gi", **changes: Any) -> Any:
    return parse_spec(dlrmjob("dj", "ml", 4, gpu_memory=gpu_memory, **changes)["spec"])


def model(hours_old: float) -> CostModelInfo:
    return CostModelInfo(
        A100, "shardwise-costmodel-x", NOW - datetime.timedelta(hours=hours_old), "fp", "sha", "ml"
    )


def attempt(n: int, state: str, minutes_ago: float = 0.0) -> JobState:
    ref = ChildRef(
        "Job",
        f"dj-profile-x-{n}",
        "ml",
        f"u{n}",
        "1",
        {names.LABEL_ATTEMPT: str(n), names.LABEL_GPU_TYPE: A100},
    )
    finished = NOW - datetime.timedelta(minutes=minutes_ago)
    if state == "active":
        return JobState(ref, active=1)
    if state == "ok":
        return JobState(ref, complete=True, finished=finished)
    return JobState(ref, failure="BackoffLimitExceeded: boom", finished=finished)


def started_attempt(n: int, seconds_ago: float) -> JobState:
    running = attempt(n, "active")
    return dataclasses.replace(running, started_at=NOW - datetime.timedelta(seconds=seconds_ago))


POD_META = {
    "name": "dj-profile-x-1-abcde",
    "namespace": "ml",
    "labels": {names.LABEL_JOB: "dj", names.LABEL_COMPONENT: "profiler"},
    "ownerReferences": [{"kind": "Job", "name": "dj-profile-x-1", "uid": "u1", "controller": True}],
}


def pod(status: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"metadata": {**POD_META, **meta}, "spec": {}, "status": status}


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"name": "profiler", "state": {"waiting": {"reason": reason, "message": message}}}


def observed(**kwargs: Any) -> Observed:
    base: dict[str, Any] = {
        "job": JOB,
        "spec": spec(),
        "spec_problems": [],
        "nodes": [NodeInfo("a", {CFG.gpu_type_label: A100, CFG.gpu_memory_label: "81920"}, gpus=4)],
        "models": {},
        "profiling_jobs": [],
        "plans": [],
        "worker_job": None,
        "service": None,
        "now": NOW,
    }
    return Observed(**(base | kwargs))


def plan_record(name: str, inputs_hash: str, uid: str = "p") -> PlanRecord:
    ref = ChildRef("ConfigMap", name, "ml", uid, "1", {}, {}, ("uid-1",))
    return PlanRecord(
        ref, inputs_hash, {"hash": "a" * 64, "planner": "neuroshard", "tables": 4, "worldSize": 4}
    )


def kinds_plan(
    tables: Sequence[TableSpec], kinds: Sequence[str], topology: Topology, planner: str = "test"
) -> Plan:
    """A plan with table ``i`` cut as ``kinds[i]``: table-wise on rank ``i % gpus``,
    row-wise in TorchRec's even cut over every rank, table-row-wise over host 0's ranks,
    data-parallel on every rank (what a planner may make of a table larger than a GPU)."""
    world, local = topology.gpus, topology.local_world
    shards: list[list[Shard]] = []
    for i, (t, kind) in enumerate(zip(tables, kinds, strict=True)):
        if kind == "table_wise":
            shards.append([Shard(rank=i % world, cols=t.dim)])
        elif kind in ("row_wise", "table_row_wise"):
            ranks = range(world) if kind == "row_wise" else range(local)
            cut = even_row_split(t.rows, len(ranks))
            shards.append(
                [
                    Shard(rank=r, cols=t.dim, row_offset=o, rows=n)
                    for r, (o, n) in zip(ranks, cut, strict=True)
                ]
            )
        elif kind == "data_parallel":
            shards.append([Shard(rank=r, cols=t.dim) for r in range(world)])
        else:
            raise ValueError(kind)
    return Plan.from_shards(tables, shards, topology, planner, kinds=list(kinds))  # type: ignore[arg-type]

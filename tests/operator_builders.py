"""Builders for the operator's pure tests (``tests/test_operator_<module>.py``): a spec,
profiling attempts, published models, pods, plan records and an ``Observed``, all at a
fixed time ``NOW``."""

from __future__ import annotations

import dataclasses
import datetime
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

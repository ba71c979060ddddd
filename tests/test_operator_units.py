"""The operator's pure functions, called directly: names, units, the spec, capacity,
profiling decisions, conditions, rendering, the reconcile decision, planning."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
import typer
from k8s.helpers import dlrmjob
from typer.testing import CliRunner

from shardwise.cli.operator import operator_cmd
from shardwise.operator import constants as c
from shardwise.operator import profiling, render
from shardwise.operator.capacity import (
    NodeInfo,
    Placement,
    Shortfall,
    Taint,
    choose,
    eligible,
    gpu_memory_bytes,
    node_info,
    worker_slots,
)
from shardwise.operator.config import OperatorConfig
from shardwise.operator.costmodels import CostModelInfo, model_info
from shardwise.operator.crd import ProfilingSpec, SpecError, parse_spec
from shardwise.operator.health import HealthServer
from shardwise.operator.lifecycle import Condition, Phase, build_status, phase_of, transition_events
from shardwise.operator.main import RunOptions, exact_names, settings_for
from shardwise.operator.names import MAX_NAME, child_name, plan_configmap_name, slug
from shardwise.operator.observe import (
    ChildRef,
    JobState,
    PlanRecord,
    PodFailure,
    failure_mark,
    job_state,
)
from shardwise.operator.planning import PlanInputs, compute_plan, in_spec_terms, make_request
from shardwise.operator.reconcile import Observed, decide
from shardwise.operator.runner import merge_patch_between
from shardwise.operator.startup import (
    Startup,
    StartupProblem,
    events_selector,
    failed_create,
    job_startup,
    needs_events_check,
    pod_problem,
    pod_state,
    startup_deadline,
)
from shardwise.operator.units import parse_duration, parse_quantity
from shardwise.planner.tables import TableSpec
from shardwise.profiler.publish import build_configmaps

pytest_plugins = ["k8s.fixtures"]
CFG = OperatorConfig()
NOW = datetime.datetime(2026, 5, 1, 12, 0, tzinfo=datetime.UTC)
A100 = "NVIDIA-A100-SXM4-80GB"
JOB = render.JobMeta("dj", "ml", "uid-1", 1)


def spec(gpu_memory: str | None = "2Gi", **changes: Any) -> Any:
    return parse_spec(dlrmjob("dj", "ml", 4, gpu_memory=gpu_memory, **changes)["spec"])


# --------------------------------------------------------------------------- names, units


def test_names_are_deterministic_and_fit_a_dns_label() -> None:
    assert plan_configmap_name("dj", "0123456789abcdef") == "dj-plan-01234567"
    long = child_name("a" * 40, "profile", slug(A100), "10")
    assert len(long) <= MAX_NAME and long == child_name("a" * 40, "profile", slug(A100), "10")
    assert long != child_name("a" * 40, "profile", slug(A100), "11")
    assert slug("cpu") == "cpu" and slug("NVIDIA-H100") != slug("nvidia-h100")


def test_quantities_and_durations() -> None:
    assert parse_quantity("80Gi", "f") == 80 * 2**30
    assert parse_quantity("16GiB", "f") == 16 * 2**30
    assert parse_quantity("80G", "f") == 80 * 10**9
    assert parse_quantity(1024, "f") == 1024
    with pytest.raises(ValueError, match=r"spec\.planner\.gpuMemory: cannot read '80 gigs'"):
        parse_quantity("80 gigs", "spec.planner.gpuMemory")
    assert parse_duration("1h30m", "f") == 5400 and parse_duration("7d", "f") == 7 * 86400
    with pytest.raises(ValueError, match="maxAge"):
        parse_duration("soon", "maxAge")


# --------------------------------------------------------------------------- the spec


def test_spec_problems_name_their_fields() -> None:
    raw = dlrmjob(
        "dj",
        "ml",
        [{"name": "t0", "rows": 10, "dim": 8, "poolingFactor": 1, "accessHist": [0.2] * 17}],
    )
    raw["spec"]["workers"] = {"min": 3, "max": 2}
    with pytest.raises(SpecError) as err:
        parse_spec(raw["spec"])
    assert err.value.problems == ["spec.workers: workers.min (3) must not exceed workers.max (2)"]
    raw["spec"]["workers"] = {"min": 1, "max": 2}
    raw["spec"]["planner"]["gpuMemory"] = "lots"
    raw["spec"]["template"]["volumeMounts"] = [{"name": "ckpt", "mountPath": "/etc/shardwise"}]
    with pytest.raises(SpecError) as err:
        parse_spec(raw["spec"])
    text = "\n".join(err.value.problems)
    assert "spec.tables.inline[0].accessHist (table 't0'): access_hist must sum to 1" in text
    assert "spec.planner.gpuMemory: cannot read 'lots'" in text
    assert "spec.template.volumeMounts[0].name: no volume 'ckpt'" in text
    assert "spec.template.volumeMounts[0].mountPath: /etc/shardwise holds the plan" in text


# --------------------------------------------------------------------------- capacity


def test_capacity_follows_selector_taints_and_readiness() -> None:
    nodes = [
        NodeInfo("a", {CFG.gpu_type_label: A100, "pool": "x"}, gpus=8),
        NodeInfo(
            "b",
            {CFG.gpu_type_label: A100, "pool": "x"},
            gpus=8,
            taints=(Taint("gpu", "", "NoSchedule"),),
        ),
        NodeInfo("c", {CFG.gpu_type_label: "H100", "pool": "x"}, gpus=8, ready=False),
        NodeInfo("d", {CFG.gpu_type_label: "H100", "pool": "y"}, gpus=8),
        NodeInfo("e", {"pool": "x"}, gpus=8),  # no GPU type label
    ]
    assert [n.name for n in eligible(nodes, {"pool": "x"}, [], "cuda", CFG)] == ["a"]
    tolerate = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    usable = eligible(nodes, {"pool": "x"}, tolerate, "cuda", CFG)
    assert [n.name for n in usable] == ["a", "b"]
    assert worker_slots(usable, 4, "cuda", CFG) == {A100: 4}
    assert choose({A100: 4, "H100": 4}, 1, 3, 4) == Placement("H100", 3)  # ties: by name
    short = choose({A100: 1}, 2, 4, 8)
    assert (
        isinstance(short, Shortfall) and "needs at least 2 worker(s) of 8 GPU(s)" in short.message
    )
    assert (
        gpu_memory_bytes(
            [NodeInfo("a", {CFG.gpu_type_label: A100, CFG.gpu_memory_label: "81920"})],
            A100,
            "cuda",
            CFG,
        )
        == 80 * 2**30
    )


def test_node_summary_reads_allocatable_readiness_and_cordon() -> None:
    body = {
        "metadata": {"name": "n", "labels": {"x": "y"}},
        "spec": {"unschedulable": True, "taints": [{"key": "k", "effect": "NoExecute"}]},
        "status": {
            "allocatable": {"nvidia.com/gpu": "4"},
            "conditions": [{"type": "Ready", "status": "False"}],
        },
    }
    info = node_info(body, "nvidia.com/gpu")
    assert (info.gpus, info.ready, info.schedulable, info.taints) == (
        4,
        False,
        False,
        (Taint("k", "", "NoExecute"),),
    )


# --------------------------------------------------------------------------- profiling


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
        {c.LABEL_ATTEMPT: str(n), c.LABEL_GPU_TYPE: A100},
    )
    finished = NOW - datetime.timedelta(minutes=minutes_ago)
    if state == "active":
        return JobState(ref, active=1)
    if state == "ok":
        return JobState(ref, complete=True, finished=finished)
    return JobState(ref, failure="BackoffLimitExceeded: boom", finished=finished)


def decide_p(
    policy: dict[str, Any], m: CostModelInfo | None, jobs: list[JobState]
) -> profiling.Decision:
    return profiling.decide(A100, ProfilingSpec.model_validate(policy), m, jobs, NOW)


def test_profiling_policies() -> None:
    assert decide_p({"policy": "Never"}, None, []).state is profiling.State.SKIPPED
    fresh = decide_p({"policy": "IfStale", "maxAge": "24h"}, model(1), [])
    assert fresh.state is profiling.State.FRESH and fresh.ready and fresh.create is None
    stale = decide_p({"policy": "IfStale", "maxAge": "24h"}, model(48), [])
    assert stale.create == 1 and not stale.ready and "stale" in stale.message
    assert (
        decide_p({"policy": "IfStale"}, None, [attempt(1, "active")]).state
        is profiling.State.RUNNING
    )
    always = decide_p({"policy": "Always"}, model(0.1), [attempt(1, "ok", minutes_ago=5)])
    assert always.state is profiling.State.SUCCEEDED and always.model == model(0.1)
    # an old success whose model went stale: profile again, numbering on
    again = decide_p(
        {"policy": "IfStale", "maxAge": "1h"}, model(30), [attempt(1, "ok", minutes_ago=1800)]
    )
    assert again.create == 2


def test_profiling_backoff_then_fallback() -> None:
    policy = {"policy": "IfStale", "retries": 2, "backoffSeconds": 60}
    waiting = decide_p(policy, None, [attempt(1, "failed", minutes_ago=0.5)])
    assert waiting.state is profiling.State.WAITING and waiting.create is None
    assert waiting.next_attempt_at == NOW + datetime.timedelta(seconds=30)
    assert decide_p(policy, None, [attempt(1, "failed", minutes_ago=2)]).create == 2
    # the second backoff doubles
    second = decide_p(policy, None, [attempt(1, "failed", 10), attempt(2, "failed", minutes_ago=1)])
    assert second.next_attempt_at == NOW + datetime.timedelta(seconds=60)
    failed = [attempt(n, "failed", 10 - n) for n in (1, 2, 3)]
    bundled = decide_p(policy, None, failed)
    assert bundled.state is profiling.State.FAILED and bundled.ready and bundled.model is None
    assert (
        bundled.degraded
        and "failed 3 time(s)" in bundled.degraded
        and "bundled CPU model" in bundled.degraded
    )
    stale = decide_p({**policy, "maxAge": "1h"}, model(48), failed)
    assert stale.model == model(48) and "the stale published model" in (stale.degraded or "")


def test_success_without_a_published_model_waits_then_counts_as_failure() -> None:
    policy = {"policy": "Always", "retries": 0}
    waiting = profiling.decide(
        A100, ProfilingSpec.model_validate(policy), None, [attempt(1, "ok", 0.1)], NOW
    )
    assert (
        waiting.state is profiling.State.WAITING
        and "waiting for its published model" in waiting.message
    )
    late = profiling.decide(
        A100, ProfilingSpec.model_validate(policy), None, [attempt(1, "ok", 5)], NOW
    )
    assert late.state is profiling.State.FAILED and "published no" in (late.degraded or "")


# --------------------------------------------------------------------------- startup

POD_META = {
    "name": "dj-profile-x-1-abcde",
    "namespace": "ml",
    "labels": {c.LABEL_JOB: "dj", c.LABEL_COMPONENT: "profiler"},
    "ownerReferences": [{"kind": "Job", "name": "dj-profile-x-1", "uid": "u1", "controller": True}],
}


def pod(status: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"metadata": {**POD_META, **meta}, "spec": {}, "status": status}


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"name": "profiler", "state": {"waiting": {"reason": reason, "message": message}}}


def test_pod_problems_are_read_from_the_pod_status() -> None:
    unschedulable = pod({
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                        "lastTransitionTime": "2026-05-01T11:59:00Z"}],
    })  # fmt: skip
    state = pod_state(unschedulable)
    assert (state.owner, state.owner_uid, state.job, state.started) == (
        "dj-profile-x-1", "u1", "dj", False,
    )  # fmt: skip
    problem = state.problem
    assert problem is not None and problem.reason == problem.condition_reason == "Unschedulable"
    assert problem.since == NOW - datetime.timedelta(minutes=1)
    assert problem.describe() == (
        "pod dj-profile-x-1-abcde: Unschedulable: 0/1 nodes are available: "
        "1 Insufficient nvidia.com/gpu."
    )
    for reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
        found = pod_problem(pod({"phase": "Pending", "containerStatuses": [waiting(reason, "m")]}))
        assert found is not None and found.reason == reason
        assert (
            found.condition_reason == "ImagePullError" and "container profiler: m" in found.message
        )
    config = pod(
        {"phase": "Pending", "initContainerStatuses": [waiting("CreateContainerConfigError")]}
    )
    assert pod_problem(config).condition_reason == "CreateContainerConfigError"  # type: ignore[union-attr]
    assert (
        pod_problem(pod({"phase": "Pending", "containerStatuses": [waiting("ContainerCreating")]}))
        is None
    )
    running = pod_state(pod({"phase": "Running"}))
    assert running.started and running.problem is None
    assert (
        pod_problem(pod({"phase": "Failed", "containerStatuses": [waiting("ErrImagePull")]}))
        is None
    )


def test_failed_create_is_the_latest_warning_of_the_job() -> None:
    def event(message: str, last: str, type_: str = "Warning") -> dict[str, Any]:
        return {
            "reason": "FailedCreate", "type": type_, "message": message,
            "involvedObject": {"kind": "Job", "name": "dj-profile-x-1"}, "lastTimestamp": last,
        }  # fmt: skip

    found = failed_create([
        event("new", "2026-05-01T12:00:00Z"),
        event("old", "2026-05-01T11:00:00Z"),
        event("normal", "2026-05-01T12:30:00Z", "Normal"),
    ])  # fmt: skip
    assert found is not None and (found.kind, found.name, found.message) == (
        "Job", "dj-profile-x-1", "new",
    )  # fmt: skip
    assert found.describe() == "job dj-profile-x-1: FailedCreate: new"
    assert failed_create([]) is None
    created = NOW - datetime.timedelta(seconds=30)
    job = dataclasses.replace(attempt(1, "active"), ref=dataclasses.replace(
        attempt(1, "active").ref, created=created))  # fmt: skip
    assert events_selector(job) == (
        "involvedObject.kind=Job,involvedObject.name=dj-profile-x-1,involvedObject.uid=u1,"
        "reason=FailedCreate"
    )
    assert needs_events_check(job, [], 5.0) == created + datetime.timedelta(seconds=5)
    mine = pod_state(pod({"phase": "Pending"}))
    assert needs_events_check(job, [mine], 5.0) is None, "it has a pod: nothing to look up"
    assert needs_events_check(dataclasses.replace(job, suspended=True), [], 5.0) is None
    assert needs_events_check(attempt(1, "failed"), [], 5.0) is None
    refused = StartupProblem("Job", job.ref.name, "FailedCreate", "forbidden")
    assert job_startup(job, [], refused) == Startup(False, refused)
    assert job_startup(job, [mine], refused) == Startup(False, None), "pods came after all"
    assert job_startup(job, [pod_state(pod({"phase": "Running"}))]).started
    assert job_startup(dataclasses.replace(job, ready=1), []).started
    later = dataclasses.replace(job, started_at=NOW)
    assert startup_deadline(later, 300) == NOW + datetime.timedelta(seconds=300)
    assert startup_deadline(job, 300) == created + datetime.timedelta(seconds=300)


def started_attempt(n: int, seconds_ago: float) -> JobState:
    running = attempt(n, "active")
    return dataclasses.replace(running, started_at=NOW - datetime.timedelta(seconds=seconds_ago))


def test_profiling_attempt_that_cannot_start_fails_after_the_startup_timeout() -> None:
    policy = ProfilingSpec.model_validate(
        {"policy": "IfStale", "startupTimeoutSeconds": 300, "retries": 1, "backoffSeconds": 60}
    )
    stuck = StartupProblem("Pod", "dj-profile-x-1-abcde", "Unschedulable", "0/1 nodes fit")
    name = "dj-profile-x-1"

    def run(job: JobState, startup: Startup) -> profiling.Decision:
        return profiling.decide(A100, policy, None, [job], NOW, startup={name: startup})

    early = run(started_attempt(1, 100), Startup(False, stuck))
    assert early.state is profiling.State.RUNNING and early.blocked == stuck and not early.marks
    assert early.check_at == NOW + datetime.timedelta(seconds=200)
    assert "Unschedulable: 0/1 nodes fit" in early.message
    assert (
        "fails at 2026-05-01T12:03:20Z (spec.profiling.startupTimeoutSeconds: 300)" in early.message
    )
    assert run(started_attempt(1, 1000), Startup(True)).state is profiling.State.RUNNING
    late = run(started_attempt(1, 301), Startup(False, stuck))
    assert late.state is profiling.State.WAITING and late.create is None
    assert late.next_attempt_at == NOW + datetime.timedelta(seconds=60)
    (mark,) = late.marks
    assert (mark.job, mark.reason, mark.suspend) == (name, "StartupTimeout", True)
    assert mark.message == (
        "no pod started within 300 s (spec.profiling.startupTimeoutSeconds: 300); "
        "pod dj-profile-x-1-abcde: Unschedulable: 0/1 nodes fit"
    )
    # the marked Job, as the next pass (or a restarted operator) reads it back
    body = {
        "metadata": {"name": name, "uid": "u1", "labels": dict(attempt(1, "active").ref.labels),
                     "annotations": {c.ANN_FAILURE: failure_mark(mark.reason, mark.message, NOW)}},
        "spec": {"suspend": True}, "status": {},
    }  # fmt: skip
    marked = job_state(body)
    assert marked.done and marked.failure_reason == "StartupTimeout" and marked.finished == NOW
    assert marked.failure == f"StartupTimeout: {mark.message}"
    again = profiling.decide(A100, policy, None, [marked], NOW)
    assert again.state is profiling.State.WAITING and not again.marks
    assert again.next_attempt_at == late.next_attempt_at
    body["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    assert job_state(body).failure is None, "a Job that completed after all is a success"


def test_deterministic_profiling_failure_is_not_retried() -> None:
    policy = ProfilingSpec.model_validate({"policy": "IfStale", "retries": 2})
    bad = PodFailure("dj-profile-x-1-abcde", "profiler", 2, "Error",
                     "error: --world-size 2 needs 2 GPUs", NOW)  # fmt: skip
    failed = dataclasses.replace(
        attempt(1, "failed"),
        ref=dataclasses.replace(attempt(1, "failed").ref, annotations={c.ANN_SETTINGS_HASH: "h1"}),
    )
    d = profiling.decide(
        A100, policy, None, [failed], NOW, pod_failures={failed.ref.name: bad}, settings_hash="h1"
    )
    assert d.state is profiling.State.FAILED and d.ready and d.create is None
    assert d.fallback_reason == "InvalidProfilingSettings" and d.degraded == d.message
    assert "not retried" in d.message and "error: --world-size 2 needs 2 GPUs" in d.message
    assert [(m.reason, m.suspend) for m in d.marks] == [("InvalidSettings", False)]
    # other settings since then: an ordinary failure, retried after the backoff
    changed = profiling.decide(
        A100, policy, None, [failed], NOW, pod_failures={failed.ref.name: bad}, settings_hash="h2"
    )
    assert changed.state is profiling.State.WAITING and changed.next_attempt_at is not None
    # exit code 1 (a crash, an out-of-memory) is worth another attempt
    crash = dataclasses.replace(bad, exit_code=1)
    assert (
        profiling.decide(A100, policy, None, [failed], NOW, pod_failures={failed.ref.name: crash})
        .state is profiling.State.WAITING
    )  # fmt: skip


def test_decide_stops_profiling_when_suspended_or_never() -> None:
    running = attempt(1, "active")
    for changes in ({"suspend": True}, {"profiling": {"policy": "Never"}}):
        d = decide(observed(spec=spec(**changes), profiling_jobs=[running]))
        assert [(r.kind, r.name, r.uid) for r in d.deletes] == [("Job", running.ref.name, "u1")]
        assert d.stopped and running.ref.name in d.stopped[0]
    done = decide(observed(spec=spec(suspend=True), profiling_jobs=[attempt(1, "failed")]))
    assert done.deletes == [], "a finished attempt stays: it is the record"
    kept = decide(observed(spec=spec(profiling={"policy": "IfStale"}), profiling_jobs=[running]))
    assert kept.deletes == []
    deleting = dataclasses.replace(running, ref=dataclasses.replace(running.ref, deleting=True))
    waiting_for_it = decide(
        observed(spec=spec(profiling={"policy": "IfStale"}), profiling_jobs=[deleting])
    )
    assert waiting_for_it.creates == [] and waiting_for_it.deletes == []


def test_decide_reports_startup_problems_as_conditions() -> None:
    stuck = pod_state(pod({"phase": "Pending", "containerStatuses": [waiting(
        "ImagePullBackOff", 'Back-off pulling image "x"')]}))  # fmt: skip
    d = decide(observed(spec=spec(profiling={"policy": "IfStale"}),
                        profiling_jobs=[started_attempt(1, 10)], pods=[stuck]))  # fmt: skip
    ready = next(x for x in d.conditions if x.type == "CostModelReady")
    assert (ready.status, ready.reason) == (False, "ImagePullError")
    assert (
        'pod dj-profile-x-1-abcde: ImagePullBackOff: container profiler: Back-off pulling image "x"'
        in ready.message
    )
    assert d.requeue_after == pytest.approx(290.0)
    refused = StartupProblem("Job", "dj-profile-x-1", "FailedCreate", "Error creating: forbidden")
    d = decide(observed(spec=spec(profiling={"policy": "IfStale"}),
                        profiling_jobs=[started_attempt(1, 10)],
                        failed_creates={"dj-profile-x-1": refused}))  # fmt: skip
    ready = next(x for x in d.conditions if x.type == "CostModelReady")
    assert ready.reason == "FailedCreate" and "job dj-profile-x-1: FailedCreate" in ready.message
    # a worker pod that cannot be scheduled
    ih = decide(observed()).plan.inputs.hash()  # type: ignore[union-attr]
    plans = [plan_record("dj-plan-aaaaaaaa", ih)]
    first = decide(observed(plans=plans))
    wj = job_state({**first.creates[1], "metadata": {**first.creates[1]["metadata"], "uid": "w1"}})
    worker = pod_state(pod(
        {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                             "reason": "Unschedulable", "message": "no"}]},
        name="dj-workers-0-abcde", labels={c.LABEL_JOB: "dj", c.LABEL_COMPONENT: "worker"},
        ownerReferences=[{"kind": "Job", "name": "dj-workers", "uid": "w1", "controller": True}],
    ))  # fmt: skip
    svc = ChildRef("Service", "dj-workers", "ml", "s", "1")
    d = decide(observed(plans=plans, worker_job=wj, service=svc, pods=[worker]))
    workers = next(x for x in d.conditions if x.type == "WorkersReady")
    assert (workers.status, workers.reason) == (False, "Unschedulable")
    assert workers.message.endswith(
        "a worker cannot start: pod dj-workers-0-abcde: Unschedulable: no"
    )


def test_startup_problems_are_announced_once_per_reason() -> None:
    def status(reason: str, message: str) -> dict[str, Any]:
        cond = Condition("WorkersReady", False, reason, message)
        return build_status(None, [cond], 1, NOW)

    pulling = status("ImagePullError", "pod p: ErrImagePull: x")
    assert [e.type for e in transition_events(None, pulling)] == ["Warning"]
    assert transition_events(pulling, status("ImagePullError", "pod p: ImagePullBackOff: x")) == []
    assert [e.reason for e in transition_events(pulling, status("Unschedulable", "no"))] == [
        "Unschedulable"
    ]
    failed = status("WorkersFailed", "attempt 1")
    assert transition_events(failed, status("WorkersFailed", "attempt 2")), "re-announced"


def test_profiling_jobs_carry_their_settings_hash() -> None:
    s = spec(profiling={"policy": "IfStale"})
    body = render.profiling_job(JOB, s, A100, 3, CFG)
    h = body["metadata"]["annotations"][c.ANN_SETTINGS_HASH]
    assert h == render.profiling_settings_hash(JOB, s, A100, CFG)
    assert (
        h
        == render.profiling_job(JOB, s, A100, 4, CFG)["metadata"]["annotations"][
            c.ANN_SETTINGS_HASH
        ]
    ), "the attempt number is not a setting"
    other = spec(profiling={"policy": "IfStale", "computeSamples": 400})
    assert render.profiling_settings_hash(JOB, other, A100, CFG) != h
    container = body["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_kopf_scans_nothing_for_exact_namespaces() -> None:
    assert settings_for(RunOptions(namespaces=("ml", "team-a"))).scanning.disabled
    assert not settings_for(RunOptions(namespaces=("team-*",))).scanning.disabled
    assert not settings_for(RunOptions(clusterwide=True)).scanning.disabled
    assert not exact_names([]) and not exact_names(["!kube-system"])


def test_model_info_reads_only_chunk_zero() -> None:
    bodies = build_configmaps(
        b"x" * 3000,
        "shardwise-costmodel-a100",
        "ml",
        job="dj",
        component="costmodel",
        chunk_bytes=1000,
        labels={c.LABEL_GPU_TYPE: A100},
        annotations={c.ANN_PUBLISHED_AT: "2026-05-01T10:00:00Z"},
    )
    infos = [model_info(b) for b in bodies]
    assert infos[1:] == [None, None]
    assert infos[0] is not None and infos[0].gpu_type == A100
    assert infos[0].is_fresh(NOW, 3 * 3600) and not infos[0].is_fresh(NOW, 3600)


# --------------------------------------------------------------------------- lifecycle


def test_phase_follows_conditions() -> None:
    running = [
        Condition("Planned", True, "PlanReady", "p"),
        Condition("WorkersReady", False, "Starting", "w"),
    ]
    assert phase_of(running) == (Phase.RUNNING, "w")
    assert phase_of([*running, Condition("Failed", True, "WorkersFailed", "boom")]) == (
        Phase.FAILED,
        "boom",
    )
    assert phase_of([Condition("CostModelReady", False, "Profiling", "m")])[0] is Phase.PROFILING
    assert phase_of([Condition("Capacity", False, "InsufficientCapacity", "c")])[0] is Phase.PENDING


def test_status_keeps_transition_times_and_events_name_changes() -> None:
    first = build_status(None, [Condition("CostModelReady", False, "Profiling", "a")], 1, NOW)
    later = NOW + datetime.timedelta(minutes=5)
    same = build_status(
        first, [Condition("CostModelReady", False, "ProfilingAttemptFailed", "b")], 2, later
    )
    assert (
        same["conditions"][0]["lastTransitionTime"] == first["conditions"][0]["lastTransitionTime"]
    )
    assert same["conditions"][0]["observedGeneration"] == 2 and same["observedGeneration"] == 2
    flipped = build_status(same, [Condition("CostModelReady", True, "Fresh", "c")], 2, later)
    assert flipped["conditions"][0]["lastTransitionTime"] == "2026-05-01T12:05:00Z"
    events = transition_events(first, same)
    assert [(e.type, e.reason) for e in events] == [("Warning", "ProfilingAttemptFailed")]
    assert transition_events(same, same) == []
    retry = build_status(
        same, [Condition("CostModelReady", False, "ProfilingAttemptFailed", "b2")], 2, later
    )
    assert [e.message for e in transition_events(same, retry)] == ["CostModelReady=False: b2"]


# --------------------------------------------------------------------------- rendering


def test_worker_command_honours_the_users_command() -> None:
    custom = spec(template={"image": "x", "command": ["bash", "-c", "run.sh"], "args": ["--fast"]})
    assert render.worker_command(JOB, custom, 3) == (["bash", "-c", "run.sh"], ["--fast"])
    default = spec(template={"image": "x", "checkpointDir": "/ckpt", "args": ["--steps", "5"]})
    cmd, args = render.worker_command(JOB, default, 3)
    assert cmd == list(c.LAUNCHER) and args[0] == "--nnodes=3"
    assert args[-7:] == [
        c.DEFAULT_ENTRY,
        "--tables",
        c.TABLES_PATH,
        "--checkpoint-dir",
        "/ckpt",
        "--steps",
        "5",
    ]
    body = render.worker_job(JOB, custom, "dj-plan-x", "f" * 64, 3, A100, CFG)
    env = {e["name"]: e["value"] for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[c.ENV_NNODES] == "3" and env[c.ENV_RDZV_ENDPOINT] == "dj-workers-0.dj-workers:29500"


def test_template_hash_ignores_suspend_but_not_the_plan() -> None:
    a = render.worker_job(JOB, spec(), "p1", "a" * 64, 2, A100, CFG)
    b = render.worker_job(JOB, spec(suspend=True), "p1", "a" * 64, 2, A100, CFG)
    d = render.worker_job(JOB, spec(), "p2", "b" * 64, 2, A100, CFG)
    key = c.ANN_TEMPLATE_HASH
    assert a["metadata"]["annotations"][key] == b["metadata"]["annotations"][key]
    assert a["metadata"]["annotations"][key] != d["metadata"]["annotations"][key]


def test_cpu_jobs_request_no_gpus_and_profile_without_comm() -> None:
    cpu = spec(planner={"device": "cpu", "gpuMemory": "4Gi"}, gpusPerWorker=4)
    body = render.worker_job(JOB, cpu, "p", "a" * 64, 2, "cpu", CFG)
    pod = body["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0] and "nodeSelector" not in pod
    assert "profile comm" not in render.profiling_script(JOB, cpu, "cpu")
    gpu = spec(gpusPerWorker=8)
    assert "--world-size 2 --world-size 4 --world-size 8" in render.profiling_script(JOB, gpu, A100)


# --------------------------------------------------------------------------- the decision


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


def test_decide_plans_first_then_runs_on_the_plan() -> None:
    first = decide(observed())
    assert first.plan is not None and first.creates == [] and first.plan.model is None
    assert first.plan.inputs.world_size == 4 and first.plan.inputs.gpu_memory_bytes == 2 * 2**30
    from_label = decide(observed(spec=spec(gpu_memory=None))).plan
    assert from_label is not None and from_label.inputs.gpu_memory_bytes == 80 * 2**30
    ih = first.plan.inputs.hash()
    second = decide(observed(plans=[plan_record("dj-plan-aaaaaaaa", ih)]))
    assert second.plan is None
    assert [b["kind"] for b in second.creates] == ["Service", "Job"]
    assert [x.type for x in second.conditions][-1] == "WorkersReady"


def test_decide_replaces_workers_on_a_new_plan_and_collects_old_plans() -> None:
    ih = decide(observed()).plan.inputs.hash()  # type: ignore[union-attr]
    annotations = {
        c.ANN_TEMPLATE_HASH: "stale",
        c.ANN_PLAN: "dj-plan-old",
        c.ANN_GENERATION: "1",
        c.ANN_WORKERS: "2",
    }
    meta = {"name": "dj-workers", "uid": "w1", "labels": {c.LABEL_GPU_TYPE: A100}}
    old = job_state(
        {"metadata": {**meta, "annotations": annotations}, "spec": {}, "status": {"active": 2}}
    )
    plans = [
        plan_record("dj-plan-aaaaaaaa", ih),
        plan_record("dj-plan-old", "x", "o"),
        plan_record("dj-plan-gone", "y", "g"),
    ]
    svc = ChildRef("Service", "dj-workers", "ml", "s", "1")
    d = decide(observed(plans=plans, worker_job=old, service=svc))
    assert [(r.kind, r.name, r.uid) for r in d.deletes] == [
        ("Job", "dj-workers", "w1"),
        ("ConfigMap", "dj-plan-gone", "g"),  # not the one the old workers still mount
    ]
    assert d.creates == [] and any(x.reason == "Replacing" for x in d.conditions)


def test_decide_without_gpu_memory_says_which_field() -> None:
    bare = observed(
        spec=spec(gpu_memory=None),
        nodes=[NodeInfo("a", {CFG.gpu_type_label: A100}, gpus=4)],
    )
    d = decide(bare)
    failed = [x for x in d.conditions if x.type == "Failed"]
    assert (
        failed
        and failed[0].reason == "NoGPUMemory"
        and "spec.planner.gpuMemory" in failed[0].message
    )


def test_merge_patch_between() -> None:
    old = {"a": 1, "b": {"c": 1, "d": 2}, "e": [1]}
    new = {"a": 1, "b": {"c": 2}, "e": [2], "f": 3}
    assert merge_patch_between(old, new) == {"b": {"c": 2, "d": None}, "e": [2], "f": 3}


# --------------------------------------------------------------------------- planning


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
    assert (
        bad.plan_json is None and bad.error is not None and bad.error.startswith("table huge needs")
    )


# --------------------------------------------------------------------------- health, CLI


def test_health_endpoints() -> None:
    ready = threading.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def probe() -> list[int]:
        server = HealthServer(ready, "127.0.0.1", port)
        await server.start()
        codes = []
        for path, flip in (("/healthz", False), ("/readyz", False), ("/readyz", True)):
            if flip:
                ready.set()
            try:
                with await asyncio.to_thread(
                    urllib.request.urlopen, f"http://127.0.0.1:{port}{path}"
                ) as r:
                    codes.append(r.status)
            except urllib.error.HTTPError as err:
                codes.append(err.code)
        await server.stop()
        return codes

    assert asyncio.run(probe()) == [200, 503, 200]


def test_cli_needs_a_scope() -> None:
    from shardwise.cli import main  # noqa: F401  (the package imports cleanly with the command)

    app = typer.Typer()
    app.command()(operator_cmd)
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "--all-namespaces" in result.output
    result = CliRunner().invoke(app, [])
    assert result.exit_code != 0 and "--namespace" in str(result.exception)


def _json(x: Any) -> str:
    return json.dumps(x, sort_keys=True)

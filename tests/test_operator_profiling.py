"""Profiling: a stale GPU type is profiled by a Job that publishes its cost model through
the API; the model is shared; a restart mid-profiling does not start over; failures
are retried with backoff, then the job falls back with a Degraded condition."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k8s.helpers import (
    DJ,
    GPU_TYPE,
    NAMESPACE,
    ROOT,
    add_node,
    condition,
    dlrmjob,
    events_for,
    failed_pod,
    finish_job,
    job_pod,
    status_of,
    table,
    wait_for,
    wait_phase,
)
from k8s.server import EmulatorServer
from kubernetes import client as k8s_client
from operator_builders import A100, NOW, attempt, model, started_attempt

from shardwise import names
from shardwise.names import costmodel_name, profiling_job_name
from shardwise.operator.cluster.startup import Startup, StartupProblem
from shardwise.operator.cluster.summaries import JobState, PodFailure, failure_mark, job_state
from shardwise.operator.crd import ProfilingSpec, TableEntry
from shardwise.operator.decide import profiling
from shardwise.operator.decide.before_plan import waiting_reason
from shardwise.operator.kube import KubeApi
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.pod.publish_model import ModelFacts, publish_cost_model
from shardwise.planner.tables import TableSpec, dump_tables, parse_tables, table_signature

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
MODEL = ROOT / "planner" / "data" / "costmodel-cpu.pt"


def job_signatures(tables: int = 6) -> list[str]:
    """The signatures of :func:`dlrmjob`'s tables (what its calibration covers)."""
    return [table_signature(TableEntry.model_validate(table(i)).to_spec()) for i in range(tables)]


def publish_as_the_pod_would(url: str, job: str, covered: list[str] | None = None) -> list[str]:
    """What the profiling pod's last step does, with the official client: a model
    calibrated on ``covered`` (default: the tables of :func:`dlrmjob`)."""
    api = k8s_client.CoreV1Api(k8s_client.ApiClient(k8s_client.Configuration(host=url)))
    calibration = {
        "fingerprint_key": "a100-test",
        "tables": job_signatures() if covered is None else covered,
        "speed_factors": {"fwd": 0.5, "bwd": 0.25, "comm": 1.0},
        "samples": {"compute": 300, "comm": 0},
        "seconds": 95.0,
        "phases": ["speed", "finetune"],
        "metrics": {"compute": {"mape": 0.08}},
    }
    facts = ModelFacts("a100-test", "NVIDIA A100-SXM4-80GB (108 SMs)", calibration)
    return publish_cost_model(MODEL, GPU_TYPE, NS, api, job=job, facts=facts, minutes=10)


def profiling_jobs(kube: KubeApi) -> list[str]:
    return sorted(
        j["metadata"]["name"]
        for j in kube.list("batch/v1", "jobs", NS, "shardwise.dev/component=profiler")
    )


def test_stale_gpu_type_is_profiled_and_the_model_shared(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("prof", NS, policy="IfStale"))
    status = wait_phase(kube, NS, "prof", "Profiling")
    assert condition(status, "CostModelReady")["reason"] == "Profiling"
    name = profiling_job_name("prof", GPU_TYPE, 1)
    job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": GPU_TYPE}
    assert pod["serviceAccountName"] == "shardwise-profiler" and job["spec"]["backoffLimit"] == 0
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    script = container["command"][2]
    for step in (
        "shardwise calibrate --tables /etc/shardwise-tables/tables.yaml",
        "--gpus 4 --batch-per-rank 4096 --minutes 10",  # 2 workers x 2 GPUs
        "shardwise.operator.pod.publish_model",
    ):
        assert step in script
    assert "base_model" not in script, "nothing published yet: calibrated from the bundled model"
    assert f"--gpu-type {GPU_TYPE} --namespace {NS} --job prof" in script
    # the job's tables, as the operator copied them for the pod
    tables_cm = next(v for v in pod["volumes"] if v["name"] == "tables")["configMap"]["name"]
    copied = kube.get("v1", "configmaps", NS, tables_cm)
    assert copied is not None and copied["immutable"] is True
    specs = parse_tables(copied["data"]["tables.yaml"], "yaml")
    assert [t.name for t in specs] == [f"t{i}" for i in range(6)]
    assert job["metadata"]["annotations"][names.ANN_TABLES_HASH] == profiling.tables_hash(
        job_signatures()
    )
    labels = job["metadata"]["labels"]
    assert (
        labels["shardwise.dev/component"],
        labels["shardwise.dev/attempt"],
        labels["shardwise.dev/gpu-type"],
    ) == (
        "profiler",
        "1",
        GPU_TYPE,
    )
    assert job["metadata"]["ownerReferences"][0]["name"] == "prof"

    published = publish_as_the_pod_would(api_server.url, "prof")
    finish_job(kube, NS, name, ok=True)
    status = wait_phase(kube, NS, "prof", "Running")
    model = status["costModel"]
    assert (model["source"], model["configMap"], model["gpuType"]) == (
        "Published",
        costmodel_name(GPU_TYPE),
        GPU_TYPE,
    )
    assert re.fullmatch(r"[0-9a-f]{16}", model["fingerprint"])
    assert condition(status, "CostModelReady")["reason"] == "Published"
    calibration = model["calibration"]
    assert (calibration["tablesCovered"], calibration["tablesTotal"]) == (6, 6)
    assert calibration["speedFactors"] == {"fwd": 0.5, "bwd": 0.25, "comm": 1.0}
    assert calibration["machine"].startswith("NVIDIA A100") and calibration["budgetMinutes"] == 10
    assert calibration["metrics"] == {"compute.mape": 0.08}
    for cm_name in published:  # a model describes hardware: it outlives the job, no owner
        cm = kube.get("v1", "configmaps", NS, cm_name)
        assert cm is not None and "ownerReferences" not in cm["metadata"]
        assert cm["metadata"]["labels"]["shardwise.dev/component"] == "costmodel"

    kube.create(dlrmjob("prof-two", NS, policy="IfStale"))
    second = wait_phase(kube, NS, "prof-two", "Running")
    assert second["costModel"]["source"] == "Published"
    assert profiling_jobs(kube) == [name], "a fresh model that covers the tables is reused"

    # other tables: the fresh model does not cover them, so they are calibrated on
    others = [*(table(10 + i, rows=90_000) for i in range(3)), {**table(0), "name": "like-t0"}]
    kube.create(dlrmjob("prof-three", NS, others, policy="IfStale"))
    third = profiling_job_name("prof-three", GPU_TYPE, 1)
    wait_for(lambda: kube.get("batch/v1", "jobs", NS, third), what="a calibration for new tables")
    covering = wait_phase(kube, NS, "prof-three", "Profiling")["costModel"]["calibration"]
    assert (covering["tablesCovered"], covering["tablesTotal"]) == (1, 4)
    base = kube.get("batch/v1", "jobs", NS, third)["spec"]["template"]["spec"]
    assert "shardwise.operator.pod.base_model" in base["containers"][0]["command"][2], (
        "calibration starts from the published model"
    )


def test_referenced_tables_are_read_before_profiling(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """A tables ConfigMap that does not exist yet holds profiling back (said in the
    status, read again); once it exists, the pod calibrates on a copy of its tables."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    body = dlrmjob("refp", NS, policy="IfStale")
    body["spec"]["tables"] = {"configMapRef": {"name": "refp-tables", "key": "t.csv"}}
    kube.create(body)
    planned = wait_for(
        lambda: (c := condition(status_of(kube, NS, "refp"), "Planned")) and c,
        what="the missing ConfigMap reported",
    )
    assert (
        planned["reason"] == "TablesNotFound"
        and "refp-tables does not exist" in (planned["message"])
    )
    assert profiling_jobs(kube) == []
    specs = [TableSpec(name=f"c{i}", rows=5000 + i, dim=16, pooling_factor=2.0) for i in range(3)]
    kube.create({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "refp-tables", "namespace": NS},
        "data": {"t.csv": dump_tables(specs, "csv")},
    })  # fmt: skip
    name = profiling_job_name("refp", GPU_TYPE, 1)
    job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    volume = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "tables")
    copied = kube.get("v1", "configmaps", NS, volume["configMap"]["name"])
    assert copied is not None and parse_tables(copied["data"]["tables.yaml"], "yaml") == specs


def test_restart_mid_profiling_resumes_the_running_job(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    first = start_operator()
    kube.create(dlrmjob("resume", NS, policy="IfStale"))
    name = profiling_job_name("resume", GPU_TYPE, 1)
    wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    first.stop()

    start_operator()
    publish_as_the_pod_would(api_server.url, "resume")
    finish_job(kube, NS, name, ok=True)
    status = wait_phase(kube, NS, "resume", "Running")
    assert status["costModel"]["source"] == "Published"
    assert profiling_jobs(kube) == [name]
    assert api_server.emulator.count("create", "jobs") == 2, "one profiling Job, one worker Job"


def test_failed_profiling_is_retried_then_falls_back_degraded(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(
        dlrmjob("flaky", NS, profiling={"policy": "IfStale", "retries": 1, "backoffSeconds": 1})
    )
    for number in (1, 2):
        name = profiling_job_name("flaky", GPU_TYPE, number)
        job = wait_for(
            lambda n=name: kube.get("batch/v1", "jobs", NS, n), what=f"profiling attempt {number}"
        )
        labels = dict(job["spec"]["template"]["metadata"]["labels"])
        failed_pod(
            kube,
            NS,
            f"{name}-x{number}",
            labels,
            1,
            f"CUDA error: out of memory (try {number})",
            job,
        )
        finish_job(kube, NS, name, ok=False)
        if number == 1:
            # announced by its Warning however soon the retry starts (the condition's
            # ProfilingAttemptFailed lasts until attempt 2 runs: 1 s here, or less)
            retrying = wait_for(
                lambda: next(
                    (
                        e
                        for e in events_for(kube, NS, "flaky")
                        if e["reason"] == "ProfilingAttemptFailed"
                    ),
                    None,
                ),
                what="the failed attempt reported",
            )
            assert retrying["type"] == "Warning"
            assert "CUDA error: out of memory (try 1)" in retrying["message"]
            assert status_of(kube, NS, "flaky")["phase"] == "Profiling"

    status = wait_phase(kube, NS, "flaky", "Running")
    degraded = condition(status, "Degraded")
    assert (
        degraded is not None
        and degraded["status"] == "True"
        and degraded["reason"] == "ProfilingFailed"
    )
    assert "failed 2 time(s)" in degraded["message"] and "bundled CPU model" in degraded["message"]
    assert "CUDA error: out of memory (try 2)" in degraded["message"]
    assert status["costModel"]["source"] == "Bundled"
    assert profiling_jobs(kube) == [profiling_job_name("flaky", GPU_TYPE, n) for n in (1, 2)]
    warnings = wait_for(
        lambda: (
            {e["reason"] for e in events_for(kube, NS, "flaky") if e["type"] == "Warning"}
            >= {"ProfilingAttemptFailed", "ProfilingFailed"}
            and events_for(kube, NS, "flaky")
        ),
        what="Warning events for the failed attempt and the fallback",
    )
    assert any(
        "flaky-profile" in e["message"] for e in warnings if e["reason"] == "ProfilingAttemptFailed"
    )
    assert api_server.emulator.count("list", "pods", namespace=NS, selected=True) == 2, (
        "each failed attempt's pods are read once"
    )


def test_policy_never_suspend_and_deletion_stop_profiling(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """An attempt nobody needs any more goes at once, with its pods: it is not left to
    hold its GPUs until its deadline (spec.profiling.timeoutSeconds, hours)."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    changes: dict[str, dict[str, object]] = {
        "never": {"profiling": {"policy": "Never"}},
        "paused": {"suspend": True},
    }
    for name in ("never", "paused", "gone"):
        kube.create(dlrmjob(name, NS, policy="IfStale"))
        job_name = profiling_job_name(name, GPU_TYPE, 1)
        job = wait_for(
            lambda n=job_name: kube.get("batch/v1", "jobs", NS, n),
            what=f"{name}'s profiling Job",
        )
        pod = job_pod(kube, job)  # as the Job controller
        if name == "gone":
            kube.delete(*DJ, NS, name)
        else:
            kube.patch(*DJ, NS, name, {"spec": changes[name]})
        wait_for(
            lambda n=job_name, p=pod["metadata"]["name"]: (
                kube.get("batch/v1", "jobs", NS, n) is None
                and kube.get("v1", "pods", NS, p) is None
            ),
            what=f"{name}'s profiling Job and pod deleted",
        )
    status = wait_phase(kube, NS, "never", "Running")
    assert condition(status, "CostModelReady")["reason"] == "Bundled"
    assert wait_phase(kube, NS, "paused", "Pending")["phase"] == "Pending"
    deletes = [
        c.name for c in api_server.emulator.calls() if c.verb == "delete" and c.plural == "jobs"
    ]
    assert sorted(deletes) == [profiling_job_name(n, GPU_TYPE, 1) for n in ("never", "paused")], (
        "a deleted DLRMJob's children go by the garbage collector"
    )


def test_a_deterministic_failure_is_not_retried(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """The profiler exits 2 (the CLI refused its settings): retrying the same settings
    would fail the same way, so the job falls back at once."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("badset", NS, profiling={"policy": "IfStale", "retries": 2}))
    name = profiling_job_name("badset", GPU_TYPE, 1)
    job = wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), what="the profiling Job")
    labels = dict(job["spec"]["template"]["metadata"]["labels"])
    message = "error: --world-size 4 needs 4 GPUs on this node; it has 2."
    failed_pod(kube, NS, f"{name}-abcde", labels, 2, message, job)
    finish_job(kube, NS, name, ok=False)
    status = wait_phase(kube, NS, "badset", "Running")
    degraded = condition(status, "Degraded")
    assert degraded is not None and degraded["reason"] == "InvalidProfilingSettings"
    assert "not retried" in degraded["message"] and message in degraded["message"]
    assert "exit code 2" in degraded["message"] and "bundled CPU model" in degraded["message"]
    assert profiling_jobs(kube) == [name], "no second attempt"
    marked = kube.get("batch/v1", "jobs", NS, name)
    assert json.loads(marked["metadata"]["annotations"]["shardwise.dev/failure"])["reason"] == (
        "InvalidSettings"
    )
    wait_for(
        lambda: any(
            e["type"] == "Warning" and e["reason"] == "InvalidProfilingSettings"
            for e in events_for(kube, NS, "badset")
        ),
        what="the Warning Event",
    )


# --------------------------------------------------------------------------- profiling.decide


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
    late = decide_p(policy, None, [attempt(1, "failed", minutes_ago=2)])
    assert late.create == 2
    # seen only after its backoff ended (a loaded operator): still announced as a failure
    assert late.retry and waiting_reason(late) == waiting_reason(waiting)
    assert waiting_reason(late) == "ProfilingAttemptFailed" and "attempt 1 failed" in late.message
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
                     "annotations": {
                         names.ANN_FAILURE: failure_mark(mark.reason, mark.message, NOW)}},
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
        ref=dataclasses.replace(
            attempt(1, "failed").ref, annotations={names.ANN_SETTINGS_HASH: "h1"}
        ),
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


def test_a_refused_profiling_pod_falls_back_at_once_until_its_settings_change() -> None:
    """Pod Security refuses the attempt's pod: it will refuse the same pod every time, so
    the attempt fails now (not after the startup timeout), the job falls back at once,
    and only other pod settings (another hash) start a new attempt."""
    policy = ProfilingSpec.model_validate({"policy": "IfStale", "retries": 2})
    name = "dj-profile-x-1"
    refusal = (
        f'Error creating: pods "{name}-x7k2p" is forbidden: violates PodSecurity '
        '"restricted:latest": unrestricted capabilities (container "profiler" must not include '
        '"SYS_ADMIN" in securityContext.capabilities.add)'
    )
    refused = StartupProblem("Job", name, "FailedCreate", refusal)
    assert refused.recurs
    running = dataclasses.replace(
        started_attempt(1, 10),
        ref=dataclasses.replace(
            started_attempt(1, 10).ref,
            annotations={names.ANN_SETTINGS_HASH: "h1"},
        ),
    )
    d = profiling.decide(
        A100, policy, None, [running], NOW,
        startup={name: Startup(False, refused)}, settings_hash="h1",
    )  # fmt: skip
    assert d.state is profiling.State.FAILED and d.ready and d.create is None
    assert d.fallback_reason == "ProfilingPodRefused" and d.model is None
    assert f"job {name}: FailedCreate: {refusal}" in d.message
    assert "(the DLRMJob's spec.template.securityContext, " in d.message
    (mark,) = d.marks
    assert (mark.job, mark.reason, mark.suspend) == (name, "PodRefused", True)
    # read back marked, as the next pass does: still final with these settings ...
    body = {
        "metadata": {"name": name, "uid": "u1", "labels": dict(running.ref.labels),
                     "annotations": {names.ANN_SETTINGS_HASH: "h1",
                                     names.ANN_FAILURE: failure_mark(mark.reason, mark.message,
                                                                     NOW)}},
        "spec": {"suspend": True}, "status": {},
    }  # fmt: skip
    marked = job_state(body)
    again = profiling.decide(A100, policy, None, [marked], NOW, settings_hash="h1")
    assert again.state is profiling.State.FAILED and not again.marks
    assert again.fallback_reason == "ProfilingPodRefused"
    # ... and retried, after the backoff, once the pod's settings changed
    fixed = profiling.decide(
        A100, policy, None, [marked], NOW + datetime.timedelta(seconds=61), settings_hash="h2"
    )
    assert fixed.create == 2
    # a quota exceeded may free up: the attempt waits (bounded by its startup timeout)
    full = StartupProblem("Job", name, "FailedCreate", 'pods "x" is forbidden: exceeded quota: q')
    assert not full.recurs
    waiting = profiling.decide(
        A100, policy, None, [running], NOW, startup={name: Startup(False, full)},
        settings_hash="h1",
    )  # fmt: skip
    assert waiting.state is profiling.State.RUNNING and waiting.blocked == full
    missing = StartupProblem(
        "Pod", f"{name}-x7k2p", "CreateContainerConfigError", 'secret "hf-token" not found'
    )
    assert missing.recurs, "a missing Secret stays missing until someone makes it"
    assert not StartupProblem("Pod", "p", "Unschedulable", "0/1 nodes").recurs

"""Profiling: a stale GPU type is profiled by a Job that publishes its cost model through
the API; the model is shared; a restart mid-profiling does not start over; failures
are retried with backoff, then the job falls back with a Degraded condition."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

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
    wait_for,
    wait_phase,
)
from k8s.server import EmulatorServer
from kubernetes import client as k8s_client

from shardwise.operator.kube import KubeApi
from shardwise.operator.names import costmodel_name, profiling_job_name
from shardwise.operator.publish_model import publish_cost_model

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
MODEL = ROOT / "planner" / "data" / "costmodel-cpu.pt"


def publish_as_the_pod_would(url: str, job: str) -> list[str]:
    """What the profiling pod's last step does, with the official client."""
    api = k8s_client.CoreV1Api(k8s_client.ApiClient(k8s_client.Configuration(host=url)))
    return publish_cost_model(MODEL, GPU_TYPE, NS, api, job=job, fingerprint_key="a100-test")


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
        "shardwise profile compute",
        "--world-size 2",
        "shardwise pretrain",
        "shardwise.operator.publish_model",
    ):
        assert step in script
    assert f"--gpu-type {GPU_TYPE} --namespace {NS} --job prof" in script
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

    names = publish_as_the_pod_would(api_server.url, "prof")
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
    for cm_name in names:  # a model describes hardware: it outlives the job, no owner
        cm = kube.get("v1", "configmaps", NS, cm_name)
        assert cm is not None and "ownerReferences" not in cm["metadata"]
        assert cm["metadata"]["labels"]["shardwise.dev/component"] == "costmodel"

    kube.create(dlrmjob("prof-two", NS, policy="IfStale"))
    second = wait_phase(kube, NS, "prof-two", "Running")
    assert second["costModel"]["source"] == "Published"
    assert profiling_jobs(kube) == [name], "a fresh model is reused, not re-measured"


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
    for attempt in (1, 2):
        name = profiling_job_name("flaky", GPU_TYPE, attempt)
        job = wait_for(
            lambda n=name: kube.get("batch/v1", "jobs", NS, n), what=f"profiling attempt {attempt}"
        )
        labels = dict(job["spec"]["template"]["metadata"]["labels"])
        failed_pod(
            kube,
            NS,
            f"{name}-x{attempt}",
            labels,
            1,
            f"CUDA error: out of memory (try {attempt})",
            job,
        )
        finish_job(kube, NS, name, ok=False)
        if attempt == 1:
            retrying = wait_for(
                lambda: (
                    (c := condition(status_of(kube, NS, "flaky"), "CostModelReady"))
                    and c["reason"] == "ProfilingAttemptFailed"
                    and c
                ),
                what="the failed attempt reported",
            )
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

"""Every pod-creation failure is said on the DLRMJob, truthfully, within 30 s: the
operator on kopf's real engine against the API emulator, which refuses pods as the API
server's admission does (Pod Security by the namespace's label, an unknown
PriorityClass, a ResourceQuota: :mod:`k8s.admission`), beside the stand-in Job
controller that records each refusal as its FailedCreate Event, the scheduler and the
local kubelet (a missing Secret: CreateContainerConfigError). Nothing here posts an
Event or a status by hand; the operator runs with its default timings."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from k8s.helpers import (
    DJ,
    NAMESPACE,
    add_local_node,
    add_node,
    condition,
    cpu_dlrmjob,
    dlrmjob,
    events_for,
    status_of,
    wait_for,
    wait_phase,
)
from k8s.kubelet import LocalCluster, wait_for_local_kubelets
from k8s.server import EmulatorServer

from shardwise.operator.cluster.startup import StartupProblem
from shardwise.operator.kube import KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
#: The target: a refused pod is on the DLRMJob this soon after its Job is made.
SAY_WITHIN = 30.0


@pytest.fixture
def controllers(
    api_server: EmulatorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalCluster]:
    """The Job controller (worker and profiling Jobs), scheduler and kubelet stand-ins."""
    wait_for_local_kubelets(monkeypatch)
    cluster = LocalCluster(
        api_server.url,
        tmp_path / "cluster",
        selector="shardwise.dev/component in (worker,profiler)",
    ).start()
    yield cluster
    cluster.stop()
    assert cluster.errors == [], "\n".join(cluster.errors)


def job_created(kube: KubeApi, name: str) -> float:
    """Wait for Job ``name``; the monotonic time it was seen."""
    wait_for(lambda: kube.get("batch/v1", "jobs", NS, name), 60, 0.1, f"the Job {name}")
    return time.monotonic()


def workers_ready(kube: KubeApi, job: str, reason: str, timeout: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        cond = condition(status_of(kube, NS, job), "WorkersReady")
        return cond if cond is not None and cond["reason"] == reason else None

    found: dict[str, Any] = wait_for(probe, timeout, 0.2, f"WorkersReady={reason}")
    return found


def job_failed_creates(kube: KubeApi, job: str) -> list[dict[str, Any]]:
    return [e for e in events_for(kube, NS, job) if e["reason"] == "FailedCreate"]


def pods_of(kube: KubeApi, job: str) -> list[dict[str, Any]]:
    return kube.list("v1", "pods", NS, f"batch.kubernetes.io/job-name={job}")


def test_pod_security_refuses_the_workers_host_network_and_the_dlrmjob_says_so(
    kube: KubeApi, start_operator: Start, controllers: LocalCluster
) -> None:
    """In a namespace enforcing "restricted", the operator's own pods are admitted; an
    override that breaks it (host networking for RDMA) leaves the Job without pods, and
    the DLRMJob says so within 30 s: the controller's whole message, the field to fix,
    phase Pending, one Warning Event series; fixed, the workers come."""
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    kube.patch("v1", "namespaces", None, NS, {"metadata": {"labels": labels}})
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    template = {"image": "registry.example/shardwise:test",
                "podOverrides": {"spec": {"hostNetwork": True}}}  # fmt: skip
    kube.create(dlrmjob("rdma", NS, template=template))
    t0 = job_created(kube, "rdma-workers")
    cond = workers_ready(kube, "rdma", "FailedCreate", SAY_WITHIN)
    said = time.monotonic() - t0
    print(f"\nFailedCreate on the DLRMJob {said:.1f} s after its worker Job was made")
    assert said <= SAY_WITHIN
    (event,) = job_failed_creates(kube, "rdma-workers")[:1]
    refusal = event["message"].split(" is forbidden: ", 1)[1]
    # On the host's network the worker's ports are host ports (the API server fills them in).
    assert refusal == (
        'violates PodSecurity "restricted:latest": host namespaces (hostNetwork=true), '
        'hostPort (container "worker" uses hostPorts 29500, 9400)'
    )
    assert cond["message"].startswith("0/2 workers ready, 0 active (rdma-workers); a worker ")
    assert f"is forbidden: {refusal} (the DLRMJob's " in cond["message"], "whole, then the field"
    assert cond["message"].endswith(
        "(the DLRMJob's spec.template.podOverrides.spec.hostNetwork)"
    ), "the worker's ports are the operator's: the host network is what the user can change"
    status = status_of(kube, NS, "rdma")
    assert (status["phase"], status["message"]) == ("Pending", cond["message"]), "nothing runs"
    assert pods_of(kube, "rdma-workers") == []
    time.sleep(16)  # the operator reads the Job's Events again meanwhile (15 s)
    said_events = job_failed_creates(kube, "rdma")
    assert len(said_events) == 1 and said_events[0]["type"] == "Warning", said_events
    assert "hostNetwork=true" in said_events[0]["message"]

    kube.patch(*DJ, NS, "rdma", {"spec": {"template": {"podOverrides": None}}})
    fixed = wait_phase(kube, NS, "rdma", "Running", timeout=60)
    assert condition(fixed, "WorkersReady")["reason"] != "FailedCreate"  # type: ignore[index]
    wait_for(lambda: len(pods_of(kube, "rdma-workers")) == 2, 30, what="both worker pods")


def test_a_host_port_refusal_points_at_what_gave_the_pod_host_ports() -> None:
    """On the host's network every container port is a host port: the refusal points at
    hostNetwork, and at the containers only where a user's own container is named."""
    pss = 'pods "w-0-x" is forbidden: violates PodSecurity "restricted:latest": '
    pod = "spec.template.podOverrides.spec"

    def fields(detail: str, component: str = "worker") -> list[str]:
        return StartupProblem("Job", "w", "FailedCreate", pss + detail).fields(component)

    host = "host namespaces (hostNetwork=true), "
    assert fields(host + 'hostPort (container "worker" uses hostPorts 29500, 9400)') == [
        f"{pod}.hostNetwork"
    ]
    sidecar = 'hostPort (containers "sidecar", "worker" use hostPorts 29500, 8080, 9400)'
    assert fields(host + sidecar) == [f"{pod}.hostNetwork", f"{pod}.initContainers/containers"]
    own = 'hostPort (container "sidecar" uses hostPort 8080)'
    assert fields(own) == [f"{pod}.initContainers/containers"], "an explicit hostPort"
    assert fields(own, "profiler") == [f"{pod}.initContainers/containers"]
    assert fields("hostPort (some other wording)") == [f"{pod}.initContainers/containers"]


@pytest.mark.slow
def test_an_unknown_priority_class_stops_profiling_at_once_and_holds_the_workers(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start, controllers: LocalCluster
) -> None:
    """The profiling pod is refused for good: no startup timeout is waited out, the job
    plans with the bundled model, saying why; the workers are refused alike until the
    PriorityClass exists, and then the Job controller's next try makes them."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    template = {"image": "registry.example/shardwise:test",
                "podOverrides": {"spec": {"priorityClassName": "training-high"}}}  # fmt: skip
    kube.create(dlrmjob("prio", NS, policy="IfStale", template=template))
    profiling = next(
        j["metadata"]["name"]
        for j in wait_for(lambda: kube.list("batch/v1", "jobs", NS), 60, what="profiling Job")
    )
    t0 = time.monotonic()
    degraded = wait_for(
        lambda: (c := condition(status_of(kube, NS, "prio"), "Degraded")) and c,
        SAY_WITHIN, 0.2, "Degraded",
    )  # fmt: skip
    print(f"\nprofiling refused and fallen back {time.monotonic() - t0:.1f} s after its Job")
    assert degraded["reason"] == "ProfilingPodRefused"
    assert (
        f'Error creating: pods "{profiling}-" is forbidden: no PriorityClass with name '
        "training-high was found (the DLRMJob's spec.template.podOverrides.spec."
        "priorityClassName)"
    ) in degraded["message"]
    assert "planning with the bundled CPU model" in degraded["message"]

    t1 = job_created(kube, "prio-workers")
    cond = workers_ready(kube, "prio", "FailedCreate", SAY_WITHIN)
    print(f"workers' FailedCreate on the DLRMJob {time.monotonic() - t1:.1f} s after their Job")
    assert (
        'Error creating: pods "prio-workers-0-" is forbidden: no PriorityClass with name '
        "training-high was found"
        in cond["message"]
        or 'pods "prio-workers-1-"' in cond["message"]
    )
    assert status_of(kube, NS, "prio")["phase"] == "Pending"

    kube.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body={
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": "training-high"}, "value": 100000})  # fmt: skip
    wait_phase(kube, NS, "prio", "Running", timeout=60)
    wait_for(lambda: len(pods_of(kube, "prio-workers")) == 2, 30, what="both worker pods")
    profiling_jobs = [
        j for j in kube.list("batch/v1", "jobs", NS) if "profile" in j["metadata"]["name"]
    ]
    assert len(profiling_jobs) == 1, "no second attempt with the same pod"
    assert api_server.emulator.unexpected == []


def test_a_quota_that_holds_one_worker_of_two_is_said(
    kube: KubeApi, start_operator: Start, controllers: LocalCluster
) -> None:
    """The quota admits the first worker pod and refuses the second: the rendezvous
    needs both, so the DLRMJob says why the other is missing."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota",
             "metadata": {"name": "gpus", "namespace": NS},
             "spec": {"hard": {"requests.nvidia.com/gpu": "2"}}}  # fmt: skip
    kube.request("POST", f"/api/v1/namespaces/{NS}/resourcequotas", body=quota)
    add_node(kube, "gpu-1", gpus=2)
    add_node(kube, "gpu-2", gpus=2)
    start_operator()
    kube.create(dlrmjob("quota", NS))
    t0 = job_created(kube, "quota-workers")
    cond = workers_ready(kube, "quota", "FailedCreate", SAY_WITHIN)
    print(f"\nthe quota on the DLRMJob {time.monotonic() - t0:.1f} s after its worker Job")
    assert cond["message"].startswith("0/2 workers ready, 1 active (quota-workers)")
    assert (
        "is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=2, used: "
        "requests.nvidia.com/gpu=2, limited: requests.nvidia.com/gpu=2 (the DLRMJob's "
        "spec.template.resources, spec.workers.max)"
    ) in cond["message"]
    assert status_of(kube, NS, "quota")["phase"] == "Pending"
    assert len(pods_of(kube, "quota-workers")) == 1


def test_a_worker_env_from_a_missing_secret_is_said_until_it_exists(
    kube: KubeApi, start_operator: Start, controllers: LocalCluster
) -> None:
    """The kubelet cannot configure the container (CreateContainerConfigError) and says
    so in the pod's status; the DLRMJob quotes it; made, the Secret lets it start."""
    add_local_node(kube, "cpu-1")
    start_operator()
    body = cpu_dlrmjob("secret", workers=(1, 1), steps=10)
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    body["spec"]["template"]["env"].append(token)
    kube.create(body)
    t0 = job_created(kube, "secret-workers")
    cond = workers_ready(kube, "secret", "CreateContainerConfigError", SAY_WITHIN)
    print(f"\nthe missing Secret on the DLRMJob {time.monotonic() - t0:.1f} s after the Job")
    assert cond["message"].endswith(
        ': CreateContainerConfigError: container worker: secret "hf" not found'
    )
    event = next(e for e in events_for(kube, NS, "secret") if e["type"] == "Warning")
    assert event["reason"] == "CreateContainerConfigError"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf", "namespace": NS},
              "data": {"token": "c2VjcmV0"}}  # fmt: skip
    kube.request("POST", f"/api/v1/namespaces/{NS}/secrets", body=secret)
    pods = controllers.pods
    wait_for(
        lambda: any(r.running or r.exit_code is not None for r in pods("secret-workers")),
        30, what="the worker to start",
    )  # fmt: skip

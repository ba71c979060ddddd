"""Shared clusters: DLRMJobs that queue through Kueue, on kopf's real engine against the
API emulator with the Kueue stand-in (tests/k8s/kueue.py) admitting, preempting and
releasing their Jobs. The pure rules are in tests/test_operator_queueing.py; the Kueue
behaviours relied on are pinned against a real Kueue by tests/test_k8s_contract.py.

No Job controller runs: a worker Job Kueue admits stands for running workers, and the
tests finish it as the Job controller would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from k8s import kueue
from k8s.helpers import (
    GPU_TYPE,
    add_node,
    condition,
    dlrmjob,
    events_for,
    finish_job,
    status_of,
    table,
    wait_for,
    wait_phase,
)
from k8s.helpers import NAMESPACE as NS
from k8s.server import EmulatorServer

from shardwise.operator.kube import KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
T = TypeVar("T")
GPU = "nvidia.com/gpu"
CKPT = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "dlrm-ckpt"}}
#: How often the tests look (seconds). Every look is requests to the emulator, whose
#: handling was most of these tests' CPU; a quarter second is nothing beside the seconds
#: the operator and Kueue take to act.
POLL = 0.25
#: How often the Kueue stand-in syncs (seconds): each sync lists six kinds cluster-wide,
#: requests the emulator serves on the cores the operator and the workers use.
KUEUE_INTERVAL = 0.5


def poll(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    """:func:`wait_for` at :data:`POLL`."""
    return wait_for(probe, timeout, interval=POLL, what=what)


def _cq(gpus: int, preempt: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [
            {
                "coveredResources": [GPU],
                "flavors": [{"name": "a100", "resources": [{"name": GPU, "nominalQuota": gpus}]}],
            }
        ],
    }
    if preempt:
        spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    return {
        "apiVersion": kueue.API,
        "kind": "ClusterQueue",
        "metadata": {"name": "gpus"},
        "spec": spec,
    }


@pytest.fixture
def queue(api_server: EmulatorServer, kube: KubeApi) -> Iterator[Callable[..., None]]:
    """Kueue's CRDs and the stand-in, and a function making the queue: a ResourceFlavor
    on the A100 nodes, a ClusterQueue of ``gpus`` GPUs, LocalQueue ``team-a`` (before
    the operator starts: a namespaced operator does not scan for new CRDs)."""
    kueue.install_kueue_crds(kube)
    running = kueue.KueueCluster(api_server.url, interval=KUEUE_INTERVAL)

    def make(gpus: int, preempt: bool = False, slices: bool = True) -> None:
        flavor = {"apiVersion": kueue.API, "kind": "ResourceFlavor", "metadata": {"name": "a100"},
                  "spec": {"nodeLabels": {"nvidia.com/gpu.product": GPU_TYPE}}}  # fmt: skip
        local = {"apiVersion": kueue.API, "kind": "LocalQueue",
                 "metadata": {"name": "team-a", "namespace": NS},
                 "spec": {"clusterQueue": "gpus"}}  # fmt: skip
        for body in (flavor, _cq(gpus, preempt), local):
            kueue.create_object(kube, body)
        for name, value in (("low", 100), ("high", 1000)):
            kueue.create_object(kube, {"apiVersion": kueue.API, "kind": "WorkloadPriorityClass",
                                       "metadata": {"name": name}, "value": value})  # fmt: skip
        running.controller.elastic_slices = slices  # ElasticJobsViaWorkloadSlices
        running.start()

    yield make
    running.stop()
    assert running.errors == [], running.errors[:1]


def queued(name: str, workers: tuple[int, int], priority: str = "", **kw: Any) -> dict[str, Any]:
    """A DLRMJob of 2-GPU workers in LocalQueue team-a."""
    body = dlrmjob(name, NS, workers=workers, **kw)
    labels = {kueue.QUEUE_LABEL: "team-a"}
    if priority:
        labels[kueue.PRIORITY_LABEL] = priority
    body["metadata"]["labels"] = labels
    return body


def elastic(name: str, workers: tuple[int, int], priority: str = "") -> dict[str, Any]:
    """Resharding on, checkpoints on a PVC, tables heavy enough that the bundled model
    predicts more workers to pay (as in tests/test_operator_resharding.py)."""
    template = {
        "image": "registry.example/shardwise:test",
        "checkpointDir": "/ckpt",
        "volumes": [CKPT],
        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
    }
    return queued(
        name,
        workers,
        priority,
        tables=[table(i, dim=128, pooling=40.0) for i in range(6)],
        template=template,
        resharding={"enabled": True, "debounceSeconds": 0},
    )


def workers_of(kube: KubeApi, name: str) -> dict[str, Any] | None:
    job = kube.get("batch/v1", "jobs", NS, f"{name}-workers")
    return None if job is None or job["metadata"].get("deletionTimestamp") else job


def admitted_at(kube: KubeApi, name: str, workers: int) -> dict[str, Any] | None:
    """The job Running on a worker Job of ``workers`` that Kueue admitted."""
    job, s = workers_of(kube, name), status_of(kube, NS, name)
    if job is None or job["spec"]["suspend"] or job["spec"]["parallelism"] != workers:
        return None
    if (condition(s, "WorkersReady") or {}).get("reason") == "Resizing":
        return None  # grown in place, but the larger slice is not admitted yet
    return s if s.get("phase") == "Running" and s.get("workers") == workers else None


def wait_admitted(kube: KubeApi, name: str, workers: int, timeout: float) -> dict[str, Any]:
    """:func:`admitted_at`, waited for; a timeout shows where the job and its Job are."""
    try:
        return poll(lambda: admitted_at(kube, name, workers), timeout, what=name)
    except AssertionError:
        s, job = status_of(kube, NS, name), workers_of(kube, name)
        conds = [(c["type"], c["reason"], c["message"]) for c in s.get("conditions") or []]
        seen = job and (job["spec"]["suspend"], job["spec"]["parallelism"])
        raise AssertionError(
            f"{name} not Running at {workers} admitted workers in {timeout:.0f} s: phase "
            f"{s.get('phase')}, workers {s.get('workers')}, Job (suspend, parallelism) {seen}, "
            f"conditions {conds}"
        ) from None


def resharded(kube: KubeApi, name: str) -> list[str]:
    """The reshards the job announced (its Resharding=True Events' messages)."""
    return [
        str(e.get("message", "")).split(": ", 1)[-1]
        for e in events_for(kube, NS, name)
        if "Resharding=True" in str(e.get("message", ""))
    ]


def test_two_jobs_in_an_8_gpu_queue_one_runs_one_waits_queued_then_runs(
    kube: KubeApi, start_operator: Start, queue: Callable[..., None]
) -> None:
    add_node(kube, "gpu-1", gpus=8)
    add_node(kube, "gpu-2", gpus=8)
    queue(8)
    start_operator()
    kube.create(queued("first", (1, 4)))
    kube.create(queued("second", (1, 4)))

    def split() -> tuple[str, str] | None:
        phases = {n: status_of(kube, NS, n).get("phase") for n in ("first", "second")}
        running = [n for n, p in phases.items() if p == "Running"]
        waiting = [n for n, p in phases.items() if p == "Queued"]
        return (running[0], waiting[0]) if running and waiting else None

    runs, waits = poll(split, timeout=90, what="one job Running, the other Queued")
    s = wait_admitted(kube, runs, 4, timeout=30)
    assert s["worldSize"] == 8
    admitted = condition(s, "Admitted")
    assert admitted is not None and admitted["status"] == "True"
    assert "ClusterQueue gpus" in admitted["message"]
    job = workers_of(kube, runs)
    assert job is not None
    assert job["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == GPU_TYPE

    # the other waits, sized for the whole queue, its Job suspended, Kueue's reason quoted
    def quoted() -> dict[str, Any] | None:
        c = condition(status_of(kube, NS, waits), "Admitted")
        return c if c is not None and "insufficient" in c["message"] else None

    held = poll(quoted, timeout=30, what=f"{waits}'s Admitted quoting Kueue's reason")
    assert (held["status"], held["reason"]) == ("False", "Queued")
    assert "LocalQueue team-a" in held["message"]
    waiting_job = workers_of(kube, waits)
    assert waiting_job is not None and waiting_job["spec"]["suspend"] is True
    assert waiting_job["spec"]["parallelism"] == 4

    finish_job(kube, NS, f"{runs}-workers", ok=True)
    wait_phase(kube, NS, runs, "Succeeded", timeout=30, interval=POLL)
    wait_admitted(kube, waits, 4, timeout=60)


@pytest.mark.parametrize("slices", [True, False], ids=["slices", "no-slices"])
def test_a_raised_quota_grows_a_running_elastic_job_from_its_checkpoint(
    kube: KubeApi, start_operator: Start, queue: Callable[..., None], slices: bool
) -> None:
    """With Kueue's workload slices the Job grows in place: the same Job, a larger
    slice replacing the admitted one, the plan for the new world written beside the
    old; without them it is replaced and queued afresh. Either way from the checkpoint."""
    add_node(kube, "gpu-1", gpus=8)
    add_node(kube, "gpu-2", gpus=8)
    queue(8, slices=slices)
    start_operator()
    kube.create(elastic("grow", (1, 8)))
    wait_admitted(kube, "grow", 4, timeout=90)
    old = workers_of(kube, "grow")
    assert old is not None
    gated = old["spec"]["template"]["spec"].get("schedulingGates") or []
    assert bool(gated) is slices  # Kueue's webhook answers the elastic annotation

    kube.patch(kueue.API, "clusterqueues", None, "gpus", {"spec": _cq(16, False)["spec"]})
    wait_admitted(kube, "grow", 8, timeout=90)
    assert resharded(kube, "grow") == ["resharding from 4 worker(s) to 8 worker(s) (QuotaChanged)"]
    new = workers_of(kube, "grow")
    assert new is not None
    # the same checkpoint volume and dir: the trainer resumes at its checkpointed step
    pod = new["spec"]["template"]["spec"]
    assert CKPT in pod["volumes"] and "/ckpt" in pod["containers"][0]["args"]
    assert "--nnodes=1:8" in pod["containers"][0]["args"]  # one template, any size
    plans = kube.get("v1", "configmaps", NS, "grow-plans")
    assert plans is not None and {"plan-8.json", "plan-16.json"} <= set(plans["data"])
    if not slices:
        assert new["metadata"]["uid"] != old["metadata"]["uid"]
        return
    assert new["metadata"]["uid"] == old["metadata"]["uid"]  # grown in place
    assert (new["spec"]["parallelism"], new["spec"]["completions"]) == (8, 8)

    def counts() -> list[tuple[int, bool]]:
        return sorted(
            (w["spec"]["podSets"][0]["count"], kueue.is_true(w, "Finished"))
            for w in kueue.workloads_of(kube, new)
        )

    # the larger slice replaced the first (Kueue finishes the old one in a second write)
    want = [(4, True), (8, False)]
    try:
        poll(lambda: counts() == want, timeout=30, what="the slice of 8 replacing 4's")
    except AssertionError:
        assert counts() == want


def test_a_lost_node_shrinks_a_running_elastic_job_in_place(
    kube: KubeApi, start_operator: Start, queue: Callable[..., None]
) -> None:
    """A node lost under a job admitted as a slice: the Job shrinks in place, and Kueue
    keeps the slice admitted at the lower count, giving the rest of its quota back."""
    add_node(kube, "gpu-1", gpus=8)
    add_node(kube, "gpu-2", gpus=8)
    queue(16)
    start_operator()
    kube.create(elastic("shrink", (1, 8)))
    wait_admitted(kube, "shrink", 8, timeout=90)
    old = workers_of(kube, "shrink")
    assert old is not None

    kube.delete("v1", "nodes", None, "gpu-2")
    wait_admitted(kube, "shrink", 4, timeout=90)
    assert resharded(kube, "shrink") == ["resharding from 8 worker(s) to 4 worker(s) (NodeLost)"]
    new = workers_of(kube, "shrink")
    assert new is not None and new["metadata"]["uid"] == old["metadata"]["uid"]
    assert (new["spec"]["parallelism"], new["spec"]["completions"]) == (4, 4)
    plans = kube.get("v1", "configmaps", NS, "shrink-plans")
    assert plans is not None and {"plan-8.json", "plan-16.json"} <= set(plans["data"])

    def slice_of_4() -> dict[str, Any] | None:
        live = [w for w in kueue.workloads_of(kube, new) if not kueue.is_true(w, "Finished")]
        if len(live) != 1 or not kueue.is_true(live[0], "Admitted"):
            return None
        psa = live[0]["status"]["admission"]["podSetAssignments"][0]
        return live[0] if psa["count"] == 4 else None

    wl = poll(slice_of_4, timeout=30, what="the admitted slice shrunk to 4")
    assert wl["spec"]["podSets"][0]["count"] == 4
    usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"][GPU]
    assert usage == "8", usage  # 4 workers x 2 GPUs: the other 8 given back


def test_a_preempted_job_is_admitted_again_at_the_size_the_quota_leaves(
    kube: KubeApi, start_operator: Start, queue: Callable[..., None]
) -> None:
    add_node(kube, "gpu-1", gpus=8)
    add_node(kube, "gpu-2", gpus=8)
    queue(8, preempt=True)
    start_operator()
    kube.create(elastic("low", (1, 4), priority="low"))
    wait_admitted(kube, "low", 4, timeout=90)

    kube.create(queued("high", (2, 2), priority="high"))
    wait_admitted(kube, "high", 2, timeout=90)
    wait_admitted(kube, "low", 2, timeout=90)
    assert resharded(kube, "low") == ["resharding from 4 worker(s) to 2 worker(s) (QuotaChanged)"]
    reasons = {e.get("reason") for e in events_for(kube, NS, "low")}
    assert "Preempted" in reasons, reasons


def test_a_queue_that_does_not_exist_is_named_and_the_job_never_runs(
    kube: KubeApi, start_operator: Start, queue: Callable[..., None]
) -> None:
    add_node(kube, "gpu-1", gpus=8)
    queue(8)
    start_operator()
    body = queued("lost", (1, 2))
    body["metadata"]["labels"][kueue.QUEUE_LABEL] = "no-such-queue"
    kube.create(body)

    def inadmissible() -> dict[str, Any] | None:
        c = condition(status_of(kube, NS, "lost"), "Admitted")
        return c if c is not None and c["reason"] == "Inadmissible" else None

    c = poll(inadmissible, timeout=90, what="lost: Admitted=False Inadmissible")
    assert "LocalQueue no-such-queue doesn't exist" in c["message"]
    assert status_of(kube, NS, "lost")["phase"] == "Queued"
    job = workers_of(kube, "lost")
    assert job is not None and job["spec"]["suspend"] is True

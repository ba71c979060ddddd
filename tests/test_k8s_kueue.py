"""The Kueue stand-in (:mod:`k8s.kueue`) pass by pass: what tests/test_k8s_contract.py
pins against a real Kueue, and the rest of what the operator may lean on (ordering,
quota edits, finished and deleted Jobs, usage, deactivation). One emulator for the
module; each test has a namespace and cluster-scoped objects of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from k8s.kueue import (
    API,
    JOB_UID_LABEL,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    KueueCluster,
    KueueController,
    condition,
    create_object,
    install_kueue_crds,
    is_true,
    workload_name,
    workloads_of,
)
from k8s.kueue_api import format_quantity, parse_quantity, pod_requests
from k8s.server import EmulatorServer

from shardwise.operator.kube import ApiError, KubeApi


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeApi]:
    server = EmulatorServer().start()
    api = KubeApi.for_host(server.url)
    install_kueue_crds(api)
    install_kueue_crds(api)  # idempotent
    yield api
    api.close()
    server.stop()
    assert server.emulator.unexpected == []


class World:
    """One test's queues and Jobs, and the controller's passes over them."""

    def __init__(self, kube: KubeApi) -> None:
        self.kube, self.ns = kube, f"ns-{uuid.uuid4().hex[:6]}"
        self.kueue = KueueController(kube)

    def sync(self, passes: int = 1) -> None:
        for _ in range(passes):
            self.kueue.sync()

    def name(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:6]}"

    def queue(
        self, quotas: dict[str, dict[str, str]], strategy: str | None = None, **spec: Any
    ) -> tuple[str, str]:
        """A LocalQueue into a new ClusterQueue of one resource group: flavor →
        {resource: nominal quota}, each flavor labelled ``pool=<flavor>``."""
        flavors = []
        for flavor, resources in quotas.items():
            body = {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": flavor}}
            create_object(self.kube, {**body, "spec": {"nodeLabels": {"pool": flavor}}})
            quota = [{"name": r, "nominalQuota": q} for r, q in resources.items()]
            flavors.append({"name": flavor, "resources": quota})
        covered = sorted({r for resources in quotas.values() for r in resources})
        cq_spec = {"resourceGroups": [{"coveredResources": covered, "flavors": flavors}], **spec}
        if strategy:
            cq_spec["queueingStrategy"] = strategy
        cq = self.name("cq")
        create_object(self.kube, {"apiVersion": API, "kind": "ClusterQueue",
                                  "metadata": {"name": cq}, "spec": cq_spec})  # fmt: skip
        lq = self.name("lq")
        create_object(self.kube, {"apiVersion": API, "kind": "LocalQueue",
                                  "metadata": {"name": lq, "namespace": self.ns},
                                  "spec": {"clusterQueue": cq}})  # fmt: skip
        return lq, cq

    def priority(self, value: int) -> str:
        name = self.name("prio")
        create_object(self.kube, {"apiVersion": API, "kind": "WorkloadPriorityClass",
                                  "metadata": {"name": name}, "value": value})  # fmt: skip
        return name

    def job(
        self,
        queue: str,
        requests: dict[str, str] | None = None,
        priority: str | None = None,
        suspend: bool = True,
        **spec: Any,
    ) -> dict[str, Any]:
        labels = {QUEUE_LABEL: queue} | ({PRIORITY_LABEL: priority} if priority else {})
        container = {"name": "c", "image": "x", "resources": {"requests": requests or {"cpu": "1"}}}
        pod = {"restartPolicy": "Never", "containers": [container], "nodeSelector": {"own": "x"}}
        return self.kube.create({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": self.name("job"), "namespace": self.ns, "labels": labels},
            "spec": {"suspend": suspend, "template": {"spec": pod}, **spec},
        })  # fmt: skip

    def spec(self, job: dict[str, Any]) -> dict[str, Any]:
        got = self.kube.get("batch/v1", "jobs", self.ns, job["metadata"]["name"]) or {}
        return dict(got.get("spec") or {})

    def workload(self, job: dict[str, Any]) -> dict[str, Any]:
        (wl,) = workloads_of(self.kube, job)
        return wl

    def reserved(self, job: dict[str, Any]) -> dict[str, Any]:
        return condition(self.workload(job), "QuotaReserved") or {}

    def running(self, job: dict[str, Any]) -> bool:
        return self.spec(job).get("suspend") is False

    def cq_status(self, cq: str) -> dict[str, Any]:
        return dict((self.kube.get(API, "clusterqueues", None, cq) or {}).get("status") or {})


PREEMPT = {"withinClusterQueue": "LowerPriority"}


@pytest.fixture
def world(kube: KubeApi) -> World:
    return World(kube)


def test_quantities_as_kueue_reads_and_writes_them() -> None:
    assert parse_quantity("500m", "cpu") == 500 and parse_quantity("2", "cpu") == 2000
    assert parse_quantity("0.1", "cpu") == 100 and parse_quantity("1Gi", "memory") == 2**30
    assert parse_quantity("1e3", "pods") == 1000 and parse_quantity("1500m", "x") == 2
    assert [format_quantity(n, "cpu") for n in (300, 2000, 0)] == ["300m", "2", "0"]
    assert format_quantity(3 * 2**30, "memory") == "3Gi"
    assert format_quantity(1500, "memory") == "1500" and format_quantity(4, "nvidia.com/gpu") == "4"
    template = {"spec": {"containers": [
        {"resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}},
        {"resources": {"requests": {"cpu": "500m"}}},
    ], "initContainers": [{"resources": {"requests": {"cpu": "2"}}}]}}  # fmt: skip
    assert pod_requests(template) == {"cpu": 2000, "memory": 2**30}


def test_a_managed_job_gets_a_workload_as_kueue_makes_it(world: World) -> None:
    lq, _ = world.queue({world.name("f"): {"cpu": "10"}})
    prio = world.priority(50)
    job = world.job(lq, {"cpu": "1"}, priority=prio, parallelism=4, completions=3)
    plain = world.kube.create({"apiVersion": "batch/v1", "kind": "Job",
                               "metadata": {"name": "plain", "namespace": world.ns},
                               "spec": {"suspend": True, "template": {"spec": {
                                   "restartPolicy": "Never",
                                   "containers": [{"name": "c", "image": "x"}]}}}})  # fmt: skip
    world.sync()
    wl, m = world.workload(job), job["metadata"]
    assert wl["metadata"]["name"] == workload_name(m["name"], m["uid"])
    assert wl["metadata"]["name"].startswith(f"job-{m['name']}-")
    assert wl["metadata"]["labels"] == {JOB_UID_LABEL: m["uid"]}
    assert wl["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": m["name"], "uid": m["uid"],
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    podset = wl["spec"]["podSets"][0]
    assert podset["name"] == "main" and podset["count"] == 3
    assert podset["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    assert wl["spec"]["queueName"] == lq and wl["spec"]["priority"] == 50
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": prio,
    }  # fmt: skip
    assert workloads_of(world.kube, plain) == [], "a Job without the queue label is not Kueue's"


def test_a_job_whose_priority_class_is_missing_waits_for_it(world: World) -> None:
    lq, _ = world.queue({world.name("f"): {"cpu": "10"}})
    job = world.job(lq, priority="later")
    world.sync()
    assert workloads_of(world.kube, job) == []
    create_object(world.kube, {"apiVersion": API, "kind": "WorkloadPriorityClass",
                               "metadata": {"name": "later"}, "value": 7})  # fmt: skip
    world.sync()
    assert world.workload(job)["spec"]["priority"] == 7


def test_a_running_managed_job_is_suspended_until_admitted(world: World) -> None:
    job = world.job("no-queue-here", suspend=False)
    world.sync()
    assert world.spec(job)["suspend"] is True
    assert world.reserved(job)["reason"] == "Inadmissible"


def test_pending_messages_name_the_missing_piece(world: World) -> None:
    flavor = world.name("f")
    lq, cq = world.queue({flavor: {"cpu": "1"}})
    gpu = world.job(lq, {"cpu": "1", "nvidia.com/gpu": "1"})
    big = world.job(lq, {"cpu": "2"})
    world.kube.delete(API, "resourceflavors", None, flavor)
    world.sync()
    assert world.reserved(gpu)["message"] == f"ClusterQueue {cq} is inactive"
    assert world.cq_status(cq)["conditions"][0]["reason"] == "FlavorNotFound"
    world.queue({flavor: {"cpu": "1"}})  # the flavor back (and a queue we do not use)
    world.sync()
    assert world.reserved(gpu)["message"] == (
        "couldn't assign flavors to pod set main: resource nvidia.com/gpu unavailable in "
        "ClusterQueue"
    )
    assert world.reserved(big)["message"].endswith("request > maximum capacity (2 > 1)")
    lq2 = world.name("lq")
    create_object(world.kube, {"apiVersion": API, "kind": "LocalQueue",
                               "metadata": {"name": lq2, "namespace": world.ns},
                               "spec": {"clusterQueue": "gone"}})  # fmt: skip
    orphan = world.job(lq2)
    world.sync()
    assert world.reserved(orphan) | {"lastTransitionTime": ""} == {
        "type": "QuotaReserved", "status": "False", "reason": "Inadmissible",
        "message": "ClusterQueue gone doesn't exist", "observedGeneration": 1,
        "lastTransitionTime": "",
    }  # fmt: skip


def test_admission_order_priority_then_age_and_the_queueing_strategies(world: World) -> None:
    flavor = world.name("f")
    lq, cq = world.queue({flavor: {"cpu": "2"}}, "StrictFIFO")
    prio = world.priority(10)
    old, new = world.job(lq, {"cpu": "2"}), world.job(lq, {"cpu": "2"}, priority=prio)
    world.sync()
    assert world.running(new) and not world.running(old), "priority first"
    assert world.reserved(old)["message"].endswith(
        f"insufficient unused quota for cpu in flavor {flavor}, 2 more needed"
    )
    small = world.job(lq, {"cpu": "1"})
    world.sync()
    assert "QuotaReserved" not in str(world.workload(small).get("status")), "StrictFIFO waits"
    world.kube.patch(API, "clusterqueues", None, cq, {"spec": {"queueingStrategy": ""}})
    world.sync()
    assert not world.running(small), "still no room"
    world.kube.patch(API, "clusterqueues", None, cq, {"spec": {"resourceGroups": [
        {"coveredResources": ["cpu"], "flavors": [
            {"name": flavor, "resources": [{"name": "cpu", "nominalQuota": "3"}]}]}]}})  # fmt: skip
    world.sync()
    assert world.running(small) and not world.running(old), "BestEffortFIFO: the next that fits"
    status = world.cq_status(cq)
    assert status["flavorsUsage"] == [
        {"name": flavor, "resources": [{"name": "cpu", "total": "3", "borrowed": "0"}]}
    ]
    assert (status["admittedWorkloads"], status["pendingWorkloads"]) == (2, 1)


@pytest.mark.slow
def test_finished_and_deleted_jobs_give_their_quota_back(world: World) -> None:
    lq, cq = world.queue({world.name("f"): {"cpu": "1"}})
    queued = []
    for _ in range(3):  # one at a time: Jobs made in one second are queued by name
        queued.append(world.job(lq))
        world.sync()
    first, second, third = queued
    assert world.running(first) and not world.running(second)
    done = {"type": "Complete", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    world.kube.patch("batch/v1", "jobs", world.ns, first["metadata"]["name"],
                     {"status": {"conditions": [done]}}, "status")  # fmt: skip
    world.sync()
    finished = condition(world.workload(first), "Finished") or {}
    assert (finished["reason"], finished["message"]) == ("Succeeded", "Job finished successfully")
    assert world.running(second)
    world.kube.delete("batch/v1", "jobs", world.ns, second["metadata"]["name"])
    world.sync(2)
    assert workloads_of(world.kube, second) == []
    assert world.running(third)
    assert world.cq_status(cq)["admittedWorkloads"] == 1


@pytest.mark.slow
def test_preemption_takes_the_fewest_lowest_newest(world: World) -> None:
    flavor = world.name("f")
    lq, cq = world.queue({flavor: {"cpu": "3"}}, preemption=PREEMPT)
    low, mid, high = world.priority(1), world.priority(5), world.priority(100)
    a = world.job(lq, {"cpu": "1"}, priority=mid)
    world.sync()
    b = world.job(lq, {"cpu": "1"}, priority=low)
    world.sync()  # one at a time: jobs made in one second are queued by name
    c = world.job(lq, {"cpu": "1"}, priority=low)
    world.sync()
    assert all(world.running(j) for j in (a, b, c))
    assert world.spec(c)["template"]["spec"]["nodeSelector"] == {"own": "x", "pool": flavor}
    top = world.job(lq, {"cpu": "1"}, priority=high)
    world.sync()
    assert world.running(a) and world.running(b) and not world.running(c), "only c, the newest"
    assert world.spec(c)["template"]["spec"]["nodeSelector"] == {"own": "x"}, "restored"
    wl_c, wl_top = world.workload(c), world.workload(top)
    evicted = condition(wl_c, "Evicted") or {}
    assert evicted["reason"] == "Preempted"
    assert evicted["message"].startswith(
        f"Preempted to accommodate a workload (UID: {wl_top['metadata']['uid']}, JobUID: "
        f"{top['metadata']['uid']}) due to prioritization in the ClusterQueue"
    )
    assert (condition(wl_c, "Preempted") or {})["reason"] == "InClusterQueue"
    assert "admission" not in wl_c["status"] and not is_true(wl_c, "Admitted")
    assert world.reserved(top)["message"].endswith(". Pending the preemption of 1 workload(s)")
    world.sync()
    assert world.running(top) and not world.running(c)
    world.kube.delete("batch/v1", "jobs", world.ns, top["metadata"]["name"])
    world.sync(2)
    readmitted = world.workload(c)
    assert world.running(c) and is_true(readmitted, "Admitted")
    again = condition(readmitted, "Evicted") or {}
    assert (again["status"], again["reason"]) == ("False", "QuotaReserved")
    assert again["message"] == f"Previously: {evicted['message']}"
    assert world.cq_status(cq)["admittedWorkloads"] == 3


@pytest.mark.slow
def test_no_preemption_that_would_not_make_room(world: World) -> None:
    lq, _ = world.queue({world.name("f"): {"cpu": "2"}}, preemption=PREEMPT)
    low, high = world.priority(1), world.priority(2)
    same = world.job(lq, {"cpu": "1"}, priority=high)
    lower = world.job(lq, {"cpu": "1"}, priority=low)
    world.sync()
    big = world.job(lq, {"cpu": "2"}, priority=high)
    world.sync(2)
    assert world.running(same) and world.running(lower) and not world.running(big)
    assert "Pending the preemption" not in world.reserved(big)["message"]


@pytest.mark.slow
def test_kueue_keeps_an_admitted_job_running_unless_deactivated(world: World) -> None:
    lq, _ = world.queue({world.name("f"): {"cpu": "1"}})
    job = world.job(lq)
    world.sync()
    name, wl = job["metadata"]["name"], world.workload(job)
    world.kube.patch("batch/v1", "jobs", world.ns, name, {"spec": {"suspend": True}})
    world.sync()
    assert world.running(job), "Kueue resumes an admitted Job"
    inactive = {"spec": {"active": False}}
    world.kube.patch(API, "workloads", world.ns, wl["metadata"]["name"], inactive)
    world.sync(2)
    wl = world.workload(job)
    assert not world.running(job) and not is_true(wl, "QuotaReserved")
    assert (condition(wl, "Evicted") or {})["reason"] == "Deactivated"


def test_a_workload_made_on_its_own_is_admitted_too(world: World) -> None:
    lq, cq = world.queue({world.name("f"): {"cpu": "1"}})
    pod = {"spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}}
    spec = {"queueName": lq, "podSets": [{"name": "main", "count": 1, "template": pod}]}
    meta = {"name": "plain", "namespace": world.ns}
    create_object(
        world.kube, {"apiVersion": API, "kind": "Workload", "metadata": meta, "spec": spec}
    )
    world.sync(2)
    wl = world.kube.get(API, "workloads", world.ns, "plain") or {}
    assert is_true(wl, "Admitted"), "and not collected: it has no owner"
    assert world.cq_status(cq)["admittedWorkloads"] == 1


@pytest.mark.slow
def test_conditions_are_written_only_when_they_change(world: World) -> None:
    lq, cq = world.queue({world.name("f"): {"cpu": "1"}})
    jobs = [world.job(lq), world.job(lq), world.job("missing")]
    world.sync()
    before = [world.workload(j)["metadata"]["resourceVersion"] for j in jobs]
    cq_before = world.kube.get(API, "clusterqueues", None, cq)
    world.sync(3)
    assert [world.workload(j)["metadata"]["resourceVersion"] for j in jobs] == before
    assert world.kube.get(API, "clusterqueues", None, cq) == cq_before


def test_a_suspended_unstarted_jobs_scheduling_directives_may_change(world: World) -> None:
    """What the emulator now allows, as Kubernetes 1.27+ does (Kueue depends on it)."""
    job = world.job("q")
    name, kube = job["metadata"]["name"], world.kube
    selector = {"spec": {"template": {"spec": {"nodeSelector": {"pool": "a"}}}}}
    kube.patch("batch/v1", "jobs", world.ns, name, selector)
    other = {"spec": {"template": {"spec": {"restartPolicy": "OnFailure"}}}}
    with pytest.raises(ApiError) as err:
        kube.patch("batch/v1", "jobs", world.ns, name, other)
    assert err.value.status == 422 and "spec.template: Invalid value: field is immutable" in str(
        err.value
    )
    started = {"status": {"startTime": "2025-01-01T00:00:00Z"}}
    kube.patch("batch/v1", "jobs", world.ns, name, started, "status")
    moved = {"spec": {"template": {"spec": {"nodeSelector": {"pool": "b"}}}}}
    with pytest.raises(ApiError) as err:
        kube.patch("batch/v1", "jobs", world.ns, name, moved)
    assert err.value.status == 422, "not once it has started"


@pytest.mark.slow
def test_the_stand_in_runs_on_its_own_thread(kube: KubeApi, world: World) -> None:
    from k8s.helpers import wait_for

    lq, _ = world.queue({world.name("f"): {"cpu": "1"}})
    job = world.job(lq)
    cluster = KueueCluster(kube.api_client.configuration.host, interval=0.05).start()
    try:
        wait_for(lambda: world.running(job), 10, what="the Job admitted and resumed")
    finally:
        cluster.stop()
    assert cluster.errors == []

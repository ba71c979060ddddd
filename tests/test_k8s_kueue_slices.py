"""Kueue's elastic workload slices as the stand-in plays them (:mod:`k8s.kueue_slices`),
pass by pass, with the Job controller and scheduler stand-ins making and placing the
pods: what tests/test_k8s_contract.py pins against a real Kueue, and the pod side a
contract test cannot see (no pod runs there)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from k8s.jobcontroller import JobController
from k8s.kueue import (
    API,
    QUEUE_LABEL,
    KueueController,
    condition,
    create_object,
    install_kueue_crds,
    is_true,
    workloads_of,
)
from k8s.kueue_slices import ELASTIC_ANNOTATION, ELASTIC_GATE, REPLACED, REPLACEMENT_FOR
from k8s.scheduler import GATED_MESSAGE, schedule
from k8s.server import EmulatorServer

from shardwise.operator.kube import KubeApi

SELECTOR = "shardwise.dev/slices-test=1"


@pytest.fixture
def kube() -> Iterator[KubeApi]:
    """An emulator of its own for each test: a pass lists the whole cluster."""
    server = EmulatorServer().start()
    api = KubeApi.for_host(server.url)
    install_kueue_crds(api)
    yield api
    api.close()
    server.stop()
    assert server.emulator.unexpected == []


class Slices:
    """One test's queue and elastic Job, and the stand-ins' passes over them."""

    def __init__(self, kube: KubeApi, cpu: str) -> None:
        self.kube, self.ns = kube, f"ns-{uuid.uuid4().hex[:6]}"
        self.kueue = KueueController(kube)
        self.jobs = JobController(kube, SELECTOR)
        flavor = f"f-{uuid.uuid4().hex[:6]}"
        create_object(kube, {"apiVersion": API, "kind": "ResourceFlavor",
                             "metadata": {"name": flavor}, "spec": {}})  # fmt: skip
        quota = [{"name": flavor, "resources": [{"name": "cpu", "nominalQuota": cpu}]}]
        self.cq = f"cq-{uuid.uuid4().hex[:6]}"
        create_object(kube, {"apiVersion": API, "kind": "ClusterQueue",
                             "metadata": {"name": self.cq},
                             "spec": {"resourceGroups": [{"coveredResources": ["cpu"],
                                                          "flavors": quota}]}})  # fmt: skip
        self.lq = f"lq-{uuid.uuid4().hex[:6]}"
        create_object(kube, {"apiVersion": API, "kind": "LocalQueue",
                             "metadata": {"name": self.lq, "namespace": self.ns},
                             "spec": {"clusterQueue": self.cq}})  # fmt: skip

    def job(self, pods: int, elastic: bool = True) -> dict[str, Any]:
        """An Indexed Job of ``pods`` pods of 1 cpu, created suspended in the queue."""
        labels = {QUEUE_LABEL: self.lq, "shardwise.dev/slices-test": "1"}
        meta: dict[str, Any] = {"name": f"job-{uuid.uuid4().hex[:6]}", "namespace": self.ns,
                                "labels": labels}  # fmt: skip
        if elastic:
            meta["annotations"] = {ELASTIC_ANNOTATION: "true"}
        container = {"name": "c", "image": "x", "resources": {"requests": {"cpu": "1"}}}
        return self.kube.create({
            "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"suspend": True, "completionMode": "Indexed", "completions": pods,
                     "parallelism": pods,
                     "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}},
        })  # fmt: skip

    def sync(self, passes: int = 1) -> None:
        """Kueue, then the Job controller, then the scheduler (on no node: pods stay
        unbound, and ungated ones say Unschedulable)."""
        for _ in range(passes):
            self.kueue.sync()
            self.jobs.sync(self.pods())
            schedule(self.kube, self.pods(), [])

    def get(self, job: dict[str, Any]) -> dict[str, Any]:
        return self.kube.get("batch/v1", "jobs", self.ns, job["metadata"]["name"]) or {}

    def scale(self, job: dict[str, Any], pods: int) -> None:
        patch = {"spec": {"parallelism": pods, "completions": pods}}
        self.kube.patch("batch/v1", "jobs", self.ns, job["metadata"]["name"], patch)

    def pods(self) -> list[dict[str, Any]]:
        return [
            p
            for p in self.kube.list("v1", "pods", self.ns)
            if not p["metadata"].get("deletionTimestamp")
        ]

    def gated(self) -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in self.pods()
            if any(g["name"] == ELASTIC_GATE for g in p["spec"].get("schedulingGates") or [])
        )

    def workloads(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return sorted(
            workloads_of(self.kube, job), key=lambda w: w["metadata"]["creationTimestamp"]
        )

    def active(self, job: dict[str, Any]) -> dict[str, Any]:
        """The slice that holds the Job's admission (or its only unfinished one)."""
        live = [w for w in self.workloads(job) if not is_true(w, "Finished")]
        held = [w for w in live if is_true(w, "QuotaReserved")]
        (wl,) = held or live
        return wl

    def used(self) -> str:
        cq = self.kube.get(API, "clusterqueues", None, self.cq) or {}
        usage = (cq.get("status") or {}).get("flavorsUsage") or [{"resources": [{"total": "0"}]}]
        return str(usage[0]["resources"][0]["total"])


def test_an_elastic_job_is_gated_and_its_pods_released_up_to_the_admitted_count(
    kube: KubeApi,
) -> None:
    s = Slices(kube, cpu="3")
    job = s.job(2)
    s.sync()
    template = s.get(job)["spec"]["template"]["spec"]
    assert template["schedulingGates"] == [{"name": ELASTIC_GATE}], "the webhook's gate"
    assert s.workloads(job) == [], "the gate comes before the Workload"
    s.sync(3)
    wl = s.active(job)
    assert wl["metadata"]["annotations"][ELASTIC_ANNOTATION] == "true"
    assert is_true(wl, "Admitted") and s.get(job)["spec"]["suspend"] is False
    assert len(s.pods()) == 2 and s.gated() == [], "released once admitted"
    assert all((p["status"]["conditions"][0]["reason"]) == "Unschedulable" for p in s.pods()), (
        "ungated pods go to the scheduler (no node here)"
    )

    s.scale(job, 4)  # more than the quota holds: the extra pods wait, gated
    s.sync(3)
    assert len(s.pods()) == 4 and len(s.gated()) == 2
    gated_pod = next(p for p in s.pods() if p["metadata"]["name"] == s.gated()[0])
    cond = gated_pod["status"]["conditions"][0]
    assert (cond["reason"], cond["message"]) == ("SchedulingGated", GATED_MESSAGE)


@pytest.mark.slow
def test_a_scale_up_is_a_new_slice_admitted_with_the_old_ones_share_counted_free(
    kube: KubeApi,
) -> None:
    s = Slices(kube, cpu="3")
    job = s.job(2)
    s.sync(4)
    first = s.active(job)
    assert s.used() == "2"

    s.scale(job, 3)
    s.sync()
    new = next(w for w in s.workloads(job) if w["metadata"]["uid"] != first["metadata"]["uid"])
    m = first["metadata"]
    assert new["metadata"]["annotations"][REPLACEMENT_FOR] == f"{m['namespace']}/{m['name']}"
    assert new["spec"]["podSets"][0]["count"] == 3
    s.sync(2)
    old = next(w for w in s.workloads(job) if w["metadata"]["uid"] == m["uid"])
    finished = condition(old, "Finished") or {}
    assert finished.get("status") == "True" and finished["reason"] == REPLACED
    assert finished["message"].startswith(
        f"Replaced to accommodate a workload (UID: {new['metadata']['uid']}"
    )
    assert s.active(job)["metadata"]["uid"] == new["metadata"]["uid"]
    assert is_true(s.active(job), "Admitted") and s.used() == "3", "3 held, not 2 + 3"
    assert s.get(job)["spec"]["suspend"] is False, "never suspended"
    assert len(s.pods()) == 3 and s.gated() == []

    s.scale(job, 5)  # 5 > 3: the new slice waits, the old keeps its admission
    s.sync(3)
    pending = [
        w
        for w in s.workloads(job)
        if not is_true(w, "Finished") and not is_true(w, "QuotaReserved")
    ]
    assert len(pending) == 1
    reserved = condition(pending[0], "QuotaReserved") or {}
    assert "insufficient quota for cpu" in reserved["message"], reserved
    assert is_true(s.active(job), "Admitted") and s.active(job)["spec"]["podSets"][0]["count"] == 3
    assert s.get(job)["spec"]["suspend"] is False and len(s.gated()) == 2


def test_a_scale_down_shrinks_the_admitted_slice_in_place(kube: KubeApi) -> None:
    s = Slices(kube, cpu="3")
    job = s.job(3)
    s.sync(4)
    wl = s.active(job)
    s.scale(job, 1)
    s.sync(2)
    (only,) = s.workloads(job)
    assert only["metadata"]["uid"] == wl["metadata"]["uid"], "no new slice to shrink"
    assert only["spec"]["podSets"][0]["count"] == 1
    psa = only["status"]["admission"]["podSetAssignments"][0]
    assert (psa["count"], psa["resourceUsage"]) == (1, {"cpu": "1"})
    assert s.used() == "1", "the quota given back"
    live = sorted(p["metadata"]["name"] for p in s.pods())
    assert len(live) == 1 and live[0].startswith(f"{job['metadata']['name']}-0-"), (
        "the Job controller removes the highest indexes"
    )


def test_without_the_feature_the_annotation_changes_nothing(kube: KubeApi) -> None:
    s = Slices(kube, cpu="3")
    s.kueue.elastic_slices = False
    job = s.job(2)
    s.sync(4)
    assert "schedulingGates" not in s.get(job)["spec"]["template"]["spec"]
    wl = s.active(job)
    assert ELASTIC_ANNOTATION not in (wl["metadata"].get("annotations") or {})
    assert is_true(wl, "Admitted") and len(s.pods()) == 2


def test_plain_jobs_are_untouched(kube: KubeApi) -> None:
    s = Slices(kube, cpu="3")
    job = s.job(2, elastic=False)
    s.sync(4)
    assert "schedulingGates" not in s.get(job)["spec"]["template"]["spec"]
    assert len(s.workloads(job)) == 1 and len(s.pods()) == 2 and s.gated() == []

"""The operator on kopf's real engine against the API emulator: a DLRMJob from creation
to Running and Succeeded, failure, suspend, a spec change, and deletion.

Everything goes through HTTP as a user (and, for Job and Pod status, the missing
controllers) would; assertions are on the objects and on the requests made.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import yaml
from k8s.helpers import (
    DJ,
    add_node,
    condition,
    dlrmjob,
    events_for,
    failed_pod,
    finish_job,
    set_job_status,
    status_of,
    table,
    wait_for,
    wait_phase,
)
from k8s.helpers import NAMESPACE as NS
from k8s.server import EmulatorServer

from shardwise.operator.kube import KubeApi
from shardwise.planner.plan import Plan

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]


def children(kube: KubeApi, name: str) -> dict[str, list[str]]:
    """What ``kubectl get all,cm -l shardwise.dev/job=NAME`` would list."""
    selector = f"shardwise.dev/job={name}"
    return {
        plural: sorted(o["metadata"]["name"] for o in kube.list(api, plural, NS, selector))
        for api, plural in (
            ("v1", "configmaps"),
            ("batch/v1", "jobs"),
            ("v1", "services"),
            ("v1", "pods"),
        )
    }


def test_happy_path_to_running_and_succeeded(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    job = kube.create(dlrmjob("small", NS))
    status = wait_phase(kube, NS, "small", "Running")

    # the plan: immutable ConfigMap <job>-plan-<hash8>, the same hash in status
    plan_cm_name = status["plan"]["configMap"]
    cm = kube.get("v1", "configmaps", NS, plan_cm_name)
    assert cm is not None and cm["immutable"] is True
    plan = Plan.model_validate_json(cm["data"]["plan.json"])
    assert plan_cm_name == f"small-plan-{plan.hash[:8]}" and plan.hash == status["plan"]["hash"]
    assert plan.validate_plan() is plan and plan.world_size == 4 and len(plan.tables) == 6
    assert [t["name"] for t in yaml.safe_load(cm["data"]["tables.yaml"])["tables"]] == [
        f"t{i}" for i in range(6)
    ]
    assert status["plan"]["planner"] == "neuroshard"
    assert status["plan"]["predictedMaxSeconds"] > 0 and 0 <= status["plan"]["imbalance"] < 1
    assert (status["workers"], status["worldSize"]) == (2, 4)
    assert status["costModel"]["source"] == "Bundled"

    # the workers: one Indexed Job running torchrun with c10d rendezvous on worker 0
    wj = kube.get("batch/v1", "jobs", NS, "small-workers")
    assert wj is not None
    spec = wj["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "shardwise.runtime.launch"]
    assert container["args"][:5] == [
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=small-workers-0.small-workers:29500",
        f"--rdzv_id={job['metadata']['uid']}",
    ]
    assert container["args"][5:] == [
        "-m",
        "shardwise.runtime.train",
        "--tables",
        "/etc/shardwise/tables.yaml",
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHARDWISE_PLAN"] == "/etc/shardwise/plan.json"
    assert (env["SHARDWISE_JOB"], env["SHARDWISE_NAMESPACE"], env["SHARDWISE_PLAN_HASH"]) == (
        "small",
        NS,
        plan.hash,
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "shardwise-plan", "mountPath": "/etc/shardwise", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {"name": "shardwise-plan", "configMap": {"name": plan_cm_name}} in pod["volumes"]
    assert pod["subdomain"] == "small-workers" and pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    svc = kube.get("v1", "services", NS, "small-workers")
    assert svc is not None and svc["spec"]["clusterIP"] == "None"

    # every child: the common labels and a controller reference to the DLRMJob
    assert children(kube, "small") == {
        "configmaps": ["small-live", plan_cm_name],  # the live one: rank 0's summary
        "jobs": ["small-workers"],
        "services": ["small-workers"],
        "pods": [],
    }
    for obj in (cm, wj, svc):
        assert obj["metadata"]["labels"]["shardwise.dev/job"] == "small"
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "DLRMJob",
            job["metadata"]["uid"],
            True,
        )
    assert {
        c: api_server.emulator.count("create", c, namespace=NS)
        for c in ("configmaps", "jobs", "services")
    } == {
        "configmaps": 2,
        "jobs": 1,
        "services": 1,
    }

    # the Job controller reports the pods ready, then done
    set_job_status(kube, NS, "small-workers", active=2, ready=2)
    wait_for(
        lambda: (
            (c := condition(status_of(kube, NS, "small"), "WorkersReady")) and c["status"] == "True"
        ),
        what="WorkersReady",
    )
    finish_job(kube, NS, "small-workers", ok=True)
    status = wait_phase(kube, NS, "small", "Succeeded")
    assert condition(status, "Complete")["reason"] == "WorkersSucceeded"
    assert status["observedGeneration"] == 1
    assert all(
        c["observedGeneration"] == 1 and c["lastTransitionTime"] for c in status["conditions"]
    )
    expected = ["Planning", "PlanReady", "Starting", "Running", "WorkersSucceeded"]
    events = wait_for(
        lambda: (
            (ev := events_for(kube, NS, "small"))
            and set(expected) <= {e["reason"] for e in ev}
            and ev
        ),
        what=f"Events {expected}",
    )
    in_order = [e["reason"] for e in events if e["reason"] in expected]
    assert in_order == expected, "one Event per transition, in order"
    assert all(e["type"] == "Normal" for e in events)
    assert api_server.emulator.count("delete", "jobs") == 0
    assert api_server.emulator.count("patch", "dlrmjobs", name="small", subresource="status") <= 8


def test_worker_failure_names_the_first_failing_pod(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("crash", NS))
    wait_phase(kube, NS, "crash", "Running")
    wj = kube.get("batch/v1", "jobs", NS, "crash-workers")
    assert wj is not None
    labels = {"shardwise.dev/job": "crash", "shardwise.dev/component": "worker"}
    # rank 1 died first (out of memory); rank 0 followed when its peer vanished
    failed_pod(
        kube,
        NS,
        "crash-workers-0-fghij",
        labels,
        1,
        "peer rank 1 exited",
        wj,
        "2026-01-01T10:00:05Z",
    )
    failed_pod(
        kube,
        NS,
        "crash-workers-1-abcde",
        labels,
        137,
        "OOMKilled building DMP",
        wj,
        "2026-01-01T10:00:01Z",
    )
    finish_job(kube, NS, "crash-workers", ok=False)
    status = wait_phase(kube, NS, "crash", "Failed")
    failed = condition(status, "Failed")
    assert failed["reason"] == "WorkersFailed"
    assert "BackoffLimitExceeded" in failed["message"]
    assert (
        "pod crash-workers-1-abcde container worker failed with exit code 137" in failed["message"]
    )
    warning = wait_for(
        lambda: [
            e
            for e in events_for(kube, NS, "crash")
            if e["type"] == "Warning" and e["reason"] == "WorkersFailed"
        ],
        what="a Warning event naming the pod",
    )
    assert "crash-workers-1-abcde" in warning[0]["message"]
    assert api_server.emulator.count("list", "pods", namespace=NS, selected=True) == 1, (
        "failed pods are looked up once"
    )


def test_suspend_and_resume(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("paused", NS, suspend=True, profiling={"policy": "IfStale"}))
    status = wait_phase(kube, NS, "paused", "Pending")
    wait_for(lambda: condition(status_of(kube, NS, "paused"), "Suspended"), what="Suspended")
    assert api_server.emulator.count("create", "jobs") == 0, (
        "nothing is profiled or run while suspended"
    )

    kube.patch(*DJ, NS, "paused", {"spec": {"suspend": False, "profiling": {"policy": "Never"}}})
    status = wait_phase(kube, NS, "paused", "Running")
    assert condition(status, "Suspended") is None
    kube.patch(*DJ, NS, "paused", {"spec": {"suspend": True}})
    wait_for(
        lambda: kube.get("batch/v1", "jobs", NS, "paused-workers")["spec"]["suspend"] is True,
        what="the Job suspended",
    )
    assert wait_phase(kube, NS, "paused", "Pending")["observedGeneration"] == 3
    kube.patch(*DJ, NS, "paused", {"spec": {"suspend": False}})
    wait_for(
        lambda: kube.get("batch/v1", "jobs", NS, "paused-workers")["spec"]["suspend"] is False,
        what="resumed",
    )
    wait_phase(kube, NS, "paused", "Running")
    assert api_server.emulator.count("create", "jobs") == 1, "suspend keeps the Job (and its plan)"
    assert api_server.emulator.count("create", "configmaps") == 2  # the plan and the live one


def test_spec_change_replans_and_replaces_the_workers(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("grow", NS))
    first = wait_phase(kube, NS, "grow", "Running")["plan"]

    # a change the plan does not depend on: no new plan, no new workers
    kube.patch(*DJ, NS, "grow", {"spec": {"profiling": {"maxAge": "24h"}}})
    wait_for(
        lambda: status_of(kube, NS, "grow").get("observedGeneration") == 2,
        what="generation 2 observed",
    )
    assert status_of(kube, NS, "grow")["plan"]["hash"] == first["hash"]

    # one more table: a new plan, the old workers replaced, the old plan removed
    tables = [table(i) for i in range(7)]
    kube.patch(*DJ, NS, "grow", {"spec": {"tables": {"inline": tables}}})
    status = wait_for(
        lambda: (
            (s := status_of(kube, NS, "grow")).get("observedGeneration") == 3
            and s.get("plan", {}).get("hash") != first["hash"]
            and s["phase"] == "Running"
            and s
        ),
        what="a new plan for generation 3",
    )
    new_cm = status["plan"]["configMap"]
    wj = wait_for(
        lambda: (
            (j := kube.get("batch/v1", "jobs", NS, "grow-workers"))
            and {"name": "shardwise-plan", "configMap": {"name": new_cm}}
            in j["spec"]["template"]["spec"]["volumes"]
            and j
        ),
        what="the worker Job on the new plan",
    )
    assert (
        json.loads(kube.get("v1", "configmaps", NS, new_cm)["data"]["plan.json"])["world_size"] == 4
    )
    wait_for(
        lambda: kube.get("v1", "configmaps", NS, first["configMap"]) is None,
        what="the old plan removed",
    )
    assert wj["metadata"]["annotations"]["shardwise.dev/generation"] == "3"
    emu = api_server.emulator
    assert (emu.count("create", "jobs"), emu.count("delete", "jobs")) == (2, 1)
    # two plans and one live ConfigMap (kept across worker Jobs: rank 0 overwrites it)
    assert (emu.count("create", "configmaps"), emu.count("delete", "configmaps")) == (3, 1)
    deletes = [c for c in emu.calls() if c.verb == "delete" and c.plural == "jobs"]
    assert deletes[0].data["propagationPolicy"] == "Foreground", (
        "old workers go before new ones start"
    )


def test_deleting_the_job_cleans_every_child(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("gone", NS))
    wait_phase(kube, NS, "gone", "Running")
    wj = kube.get("batch/v1", "jobs", NS, "gone-workers")
    labels = {"shardwise.dev/job": "gone", "shardwise.dev/component": "worker"}
    failed_pod(kube, NS, "gone-workers-0-aaaaa", labels, 1, "x", owner=wj)  # a pod the Job owns
    assert all(children(kube, "gone")[p] for p in ("configmaps", "jobs", "services", "pods"))
    kube.delete(*DJ, NS, "gone")
    wait_for(
        lambda: kube.get(*DJ, NS, "gone") is None,
        what="the DLRMJob to go (kopf removes its finalizer)",
    )
    wait_for(lambda: not any(children(kube, "gone").values()), what="every child collected")
    assert api_server.emulator.count("delete", "configmaps") == 0, (
        "the garbage collector, not the operator, deletes"
    )

"""Idempotency: a restarted operator, objects that exist before it starts, and a create
that loses a race all converge without duplicate children."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import kmock
from k8s.helpers import NAMESPACE, add_node, dlrmjob, status_of, wait_for, wait_phase
from k8s.server import EmulatorServer

from shardwise.operator.kube import KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE
WRITES = ("create", "delete", "put")


def writes(server: EmulatorServer) -> list[tuple[str, str, str | None]]:
    return [
        (c.verb, c.plural, c.name)
        for c in server.emulator.calls()
        if c.verb in WRITES and c.plural not in ("events",)
    ]


def test_restarted_operator_changes_nothing(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    first = start_operator()
    kube.create(dlrmjob("steady", NS))
    before = wait_phase(kube, NS, "steady", "Running")
    wait_for(
        lambda: status_of(kube, NS, "steady")["message"].startswith("0/2 workers ready"),
        what="settled",
    )
    first.stop()
    writes_before = writes(api_server)
    status_patches = api_server.emulator.count("patch", "dlrmjobs", subresource="status")

    second = start_operator()
    # a user change after the restart proves the new operator is reconciling this job
    kube.patch(
        "shardwise.dev/v1alpha1",
        "dlrmjobs",
        NS,
        "steady",
        {"metadata": {"labels": {"team": "ads"}}},
    )
    kube.patch(
        "batch/v1", "jobs", NS, "steady-workers", {"status": {"active": 2, "ready": 2}}, "status"
    )
    wait_for(
        lambda: status_of(kube, NS, "steady")["message"].startswith("2/2 workers ready"),
        what="the new operator",
    )
    second.stop()
    assert writes(api_server) == writes_before, (
        "no child created, replaced or deleted after the restart"
    )
    after = status_of(kube, NS, "steady")
    assert after["plan"] == before["plan"]
    assert (
        api_server.emulator.count("patch", "dlrmjobs", subresource="status") == status_patches + 1
    )


def test_children_made_before_the_operator_started_are_adopted(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    job = kube.create(dlrmjob("early", NS))
    # e.g. restored from a backup without owner references: our labels, no owner
    kube.create({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "early-workers", "namespace": NS,
                     "labels": {"shardwise.dev/job": "early", "shardwise.dev/component": "worker"}},
        "spec": {"clusterIP": "None", "selector": {"shardwise.dev/job": "early"}},
    })  # fmt: skip
    start_operator()
    wait_phase(kube, NS, "early", "Running")
    svc = wait_for(
        lambda: (
            (s := kube.get("v1", "services", NS, "early-workers"))
            and s["metadata"].get("ownerReferences")
            and s
        ),
        what="the Service adopted",
    )
    assert svc["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert api_server.emulator.count("create", "services") == 1, "only the user's create"


def test_a_create_that_loses_a_race_adopts_the_winner(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """Another writer (an earlier operator still shutting down) creates the Service
    between the operator's look and its create: the 409 adopts it."""
    emulator = api_server.emulator
    raced: list[Any] = []

    async def race(request: kmock.Request) -> Any:
        if raced:
            return None  # fall through to the API
        raced.append(request)
        await emulator._create(request)  # the other writer wins
        return await emulator._create(request)  # and the operator's create gets the 409

    emulator[kmock.method.POST, kmock.resource("", "v1", "services")] << race
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("racy", NS))
    wait_phase(kube, NS, "racy", "Running")
    assert len(raced) == 1
    assert emulator.count("create", "services") == 1, "the operator did not try again"
    assert emulator.count("get", "services", name="racy-workers") == 1, (
        "it looked at the winner once"
    )
    assert len(kube.list("v1", "services", NS, "shardwise.dev/job=racy")) == 1

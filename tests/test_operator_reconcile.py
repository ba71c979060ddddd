"""The reconcile decision, called directly (:func:`shardwise.operator.decide.reconcile.decide`);
its resharding part is in tests/test_operator_resharding_rules.py."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
from operator_builders import (
    A100,
    CFG,
    NOW,
    attempt,
    observed,
    plan_record,
    pod,
    spec,
    started_attempt,
    waiting,
)

from shardwise import names
from shardwise.operator.cluster.capacity import NodeInfo, Placement
from shardwise.operator.cluster.startup import PodState, StartupProblem, pod_state
from shardwise.operator.cluster.summaries import ChildRef, job_state
from shardwise.operator.decide import planning
from shardwise.operator.decide.lifecycle import (
    EventSpec,
    Phase,
    build_status,
    phase_of,
    transition_events,
)
from shardwise.operator.decide.reconcile import Decision, decide
from shardwise.operator.decide.records import PlanFailure


def test_decide_plans_first_then_runs_on_the_plan() -> None:
    first = decide(observed())
    assert first.plan is not None and first.creates == [] and first.plan.model is None
    assert first.plan.inputs.world_size == 4 and first.plan.inputs.gpu_memory_bytes == 2 * 2**30
    from_label = decide(observed(spec=spec(gpu_memory=None))).plan
    assert from_label is not None and from_label.inputs.gpu_memory_bytes == 80 * 2**30
    ih = first.plan.inputs.hash()
    second = decide(observed(plans=[plan_record("dj-plan-aaaaaaaa", ih)]))
    assert second.plan is None
    # the worker Job, its Service, and the ConfigMap rank 0 writes its live summary to
    assert [b["kind"] for b in second.creates] == ["Service", "Job", "ConfigMap"]
    assert second.creates[2]["metadata"]["name"] == names.live_configmap_name("dj")
    assert [x.type for x in second.conditions][-1] == "WorkersReady"


def test_decide_replaces_workers_on_a_new_plan_and_collects_old_plans() -> None:
    ih = decide(observed()).plan.inputs.hash()  # type: ignore[union-attr]
    annotations = {
        names.ANN_TEMPLATE_HASH: "stale",
        names.ANN_PLAN: "dj-plan-old",
        names.ANN_GENERATION: "1",
        names.ANN_WORKERS: "2",
    }
    meta = {"name": "dj-workers", "uid": "w1", "labels": {names.LABEL_GPU_TYPE: A100}}
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
        name="dj-workers-0-abcde", labels={names.LABEL_JOB: "dj", names.LABEL_COMPONENT: "worker"},
        ownerReferences=[{"kind": "Job", "name": "dj-workers", "uid": "w1", "controller": True}],
    ))  # fmt: skip
    svc = ChildRef("Service", "dj-workers", "ml", "s", "1")
    d = decide(observed(plans=plans, worker_job=wj, service=svc, pods=[worker]))
    workers = next(x for x in d.conditions if x.type == "WorkersReady")
    assert (workers.status, workers.reason) == (False, "Unschedulable")
    assert workers.message.endswith(
        "a worker cannot start: pod dj-workers-0-abcde: Unschedulable: no"
    )


def test_workers_that_end_one_by_one_are_finishing_not_starting() -> None:
    """Before the Job controller marks the Job Complete, its pods end one by one: ready
    falls to 0 with some succeeded. That is Finishing, never a Starting flash."""
    ih = decide(observed()).plan.inputs.hash()  # type: ignore[union-attr]
    first = decide(observed(plans=[plan_record("dj-plan-aaaaaaaa", ih)]))
    body = next(b for b in first.creates if b["kind"] == "Job")
    body["metadata"]["uid"] = "w1"
    for status, reason in (
        ({"active": 2, "ready": 2}, "Running"),
        ({"active": 1, "ready": 0, "succeeded": 1}, "Finishing"),
        ({"active": 0, "ready": 0, "succeeded": 2}, "Finishing"),
        ({"active": 0, "ready": 0}, "Starting"),
    ):
        wj = job_state({**body, "status": status})
        d = decide(observed(plans=[plan_record("dj-plan-aaaaaaaa", ih)], worker_job=wj))
        ready = next(x for x in d.conditions if x.type == "WorkersReady")
        assert ready.reason == reason, (status, ready)
        if reason == "Finishing":
            assert f"{status['succeeded']}/" in ready.message and "finished" in ready.message


def test_failed_workers_after_a_node_loss_name_the_node_not_starting() -> None:
    ih = decide(observed()).plan.inputs.hash()  # type: ignore[union-attr]
    first = decide(observed(plans=[plan_record("dj-plan-aaaaaaaa", ih)]))
    body = next(b for b in first.creates if b["kind"] == "Job")
    body["metadata"]["uid"] = "w1"
    wj = job_state({**body, "status": {"active": 1, "ready": 0, "failed": 1}})
    survivor = PodState("dj-workers-0-a", "ml", "dj", names.COMPONENT_WORKER,
                        wj.ref.name, "w1", "Running", True, node="a")  # fmt: skip
    gone = dataclasses.replace(survivor, name="dj-workers-1-b", node="b")
    labels = {CFG.gpu_type_label: A100, CFG.gpu_memory_label: "81920"}
    nodes = [NodeInfo("a", labels, gpus=4), NodeInfo("b", labels, gpus=4, ready=False)]
    d = decide(
        observed(
            plans=[plan_record("dj-plan-aaaaaaaa", ih)],
            worker_job=wj,
            pods=[survivor, gone],
            nodes=nodes,
        )
    )
    ready = next(x for x in d.conditions if x.type == "WorkersReady")
    assert ready.reason == "WorkersLost", ready
    assert "1 worker pod(s) of dj-workers failed after node b was lost" in ready.message
    assert phase_of(d.conditions) == (Phase.RUNNING, ready.message)  # the phase says it too


def _said(*passes: Decision) -> list[EventSpec]:
    """The Events the status writer posts over ``passes``, one status after another."""
    status: dict[str, Any] | None = None
    out: list[EventSpec] = []
    for d in passes:
        new = build_status(status, d.conditions, 1, NOW, d.fields)
        out += transition_events(status, new)
        status = new
    return out


def test_a_failed_planning_keeps_the_cost_model_it_announced() -> None:
    """While a failed planning waits for its retry, the cost model is stated as it was
    when planning began (condition and status), so the retry announces it not again."""
    first = decide(observed())  # policy Never, inline tables
    assert first.plan is not None
    ih = first.plan.inputs.hash()
    later = NOW + datetime.timedelta(seconds=60)
    crashed = PlanFailure("PlanningError", "the planner crashed: boom", later, generation=1)
    waits = decide(observed(plan_failures={ih: crashed}))
    due = decide(observed(plan_failures={ih: crashed}, now=later))
    assert waits.plan is None and due.plan is not None
    assert waits.requeue_after == 60.0
    ready = next(c for c in waits.conditions if c.type == "CostModelReady")
    assert (ready.status, ready.reason) == (True, "PolicyNever")
    assert waits.fields["costModel"] == first.fields["costModel"]
    planned = next(c for c in waits.conditions if c.type == "Planned")
    assert (planned.status, planned.reason) == (False, "PlanningError")
    said = [e.reason for e in _said(first, waits, due, waits, due)]
    assert said.count("PolicyNever") == 1, said
    assert said.count("Planning") == 1, said  # the retry keeps what failed until it ends
    # a planning that never will succeed again: Failed, and the cost model still stated
    never = decide(observed(plan_failures={ih: PlanFailure("Infeasible", "too big")}))
    assert {c.type: c.status for c in never.conditions}["CostModelReady"] is True
    assert {c.type: c.reason for c in never.conditions}["Failed"] == "Infeasible"


def test_nothing_is_profiled_while_a_failed_planning_waits() -> None:
    """IfStale without a published model profiles; not while a failed planning of the
    same inputs waits (the retry profiles if it still has to)."""
    s = spec(policy="IfStale")
    profiles = decide(observed(spec=s))
    assert [b["kind"] for b in profiles.creates] == ["ConfigMap", "Job"]
    ih = planning.plan_inputs(s, Placement(A100, 2), 2 * 2**30).hash()
    later = NOW + datetime.timedelta(seconds=60)
    failed = PlanFailure("PlanningError", "the planner crashed: boom", later, generation=1)
    waits = decide(observed(spec=s, plan_failures={ih: failed}))
    assert waits.creates == [] and waits.plan is None
    ready = next(c for c in waits.conditions if c.type == "CostModelReady")
    assert ready.status is False
    assert [c.reason for c in waits.conditions if c.type == "Planned"] == ["PlanningError"]

"""Pods that cannot start show up in the DLRMJob within seconds, not at a deadline hours
later: a Job whose pods the API refuses (the Job controller's FailedCreate Event), an
unschedulable pod, an image that cannot be pulled, for profiling and worker pods alike;
and a profiling attempt whose pod never starts fails after
``spec.profiling.startupTimeoutSeconds`` and follows the retry path.

The tests act as the missing controllers, with the words a real control plane used
(:mod:`k8s.helpers`): the Job controller's pods and Events, the scheduler's and the
kubelet's pod status.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k8s.helpers import (
    GPU_TYPE,
    NAMESPACE,
    UNSCHEDULABLE_MESSAGE,
    add_node,
    condition,
    dlrmjob,
    events_for,
    exceeded_quota_message,
    failed_create_event,
    forbidden_sa_message,
    image_pull_backoff_message,
    job_pod,
    pod_image_pull_backoff,
    pod_unschedulable,
    set_job_status,
    status_of,
    wait_for,
    wait_phase,
)
from k8s.server import EmulatorServer
from operator_builders import NOW, attempt, pod, waiting

from shardwise.names import profiling_job_name
from shardwise.operator.cluster.startup import (
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
from shardwise.operator.kube import KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
NS = NAMESPACE


def cost_model_reason(kube: KubeApi, name: str, reason: str) -> Any:
    cond = condition(status_of(kube, NS, name), "CostModelReady")
    return cond if cond is not None and cond["reason"] == reason else None


def warning(kube: KubeApi, name: str, reason: str) -> Any:
    return next(
        (e for e in events_for(kube, NS, name) if e["type"] == "Warning" and e["reason"] == reason),
        None,
    )


def profiling_job(kube: KubeApi, job: str, attempt: int = 1) -> dict[str, Any]:
    name = profiling_job_name(job, GPU_TYPE, attempt)
    found: dict[str, Any] = wait_for(
        lambda: kube.get("batch/v1", "jobs", NS, name), what=f"profiling attempt {attempt}"
    )
    return found


def ago(seconds: float) -> str:
    t = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_profiling_pod_that_cannot_be_created_shows_within_seconds(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """The operator's default timings: the first Events read 5 s after the Job's creation.
    A quota exceeded may free up as other pods end: the attempt waits (its startup
    timeout still bounds it), saying why."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("quota", NS, policy="IfStale"))
    job = profiling_job(kube, "quota")
    name = job["metadata"]["name"]
    message = exceeded_quota_message(f"{name}-x7k2p", NS)
    failed_create_event(kube, job, message)  # as the Job controller
    posted = time.monotonic()
    cond = wait_for(
        lambda: cost_model_reason(kube, "quota", "FailedCreate"), 60, 0.2, "FailedCreate"
    )
    elapsed = time.monotonic() - posted
    assert elapsed < 30, elapsed
    print(f"FailedCreate in the DLRMJob's conditions {elapsed:.1f} s after the Event")
    assert cond["status"] == "False" and f"job {name}: FailedCreate: {message}" in cond["message"]
    assert "(spec.profiling.startupTimeoutSeconds: 300)" in cond["message"]
    assert status_of(kube, NS, "quota")["phase"] == "Profiling"
    event = wait_for(lambda: warning(kube, "quota", "FailedCreate"), what="the Warning Event")
    assert name in event["message"] and "exceeded quota: gpus" in event["message"]
    # the quota frees up; the Job controller's next try makes the pod
    job_pod(kube, job)
    wait_for(lambda: cost_model_reason(kube, "quota", "Profiling"), what="profiling again")


def test_a_profiling_pod_refused_for_good_falls_back_at_once(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    """A refusal no retry gets past (here the pods' ServiceAccount is missing) is not
    waited out for spec.profiling.startupTimeoutSeconds: the attempt is marked and
    stopped, the job plans with the bundled model at once and says why, and no second
    attempt is made with the same pod."""
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("nosa", NS, policy="IfStale"))
    job = profiling_job(kube, "nosa")
    name = job["metadata"]["name"]
    message = forbidden_sa_message(name, NS, "shardwise-profiler")
    failed_create_event(kube, job, message)  # as the Job controller
    posted = time.monotonic()
    degraded = wait_for(
        lambda: (c := condition(status_of(kube, NS, "nosa"), "Degraded")) and c,
        60, 0.2, "Degraded",
    )  # fmt: skip
    elapsed = time.monotonic() - posted
    assert elapsed < 30, elapsed
    assert degraded["reason"] == "ProfilingPodRefused"
    assert f"job {name}: FailedCreate: {message}" in degraded["message"]
    assert "(the DLRMJob's spec.profiling.serviceAccountName)" in degraded["message"]
    assert "planning with the bundled CPU model" in degraded["message"]
    status = wait_phase(kube, NS, "nosa", "Running")
    assert condition(status, "Degraded")["reason"] == "ProfilingPodRefused"  # type: ignore[index]
    assert status["costModel"]["source"] == "Bundled"
    marked = kube.get("batch/v1", "jobs", NS, name)
    assert marked is not None and marked["spec"]["suspend"] is True
    mark = json.loads(marked["metadata"]["annotations"]["shardwise.dev/failure"])
    assert mark["reason"] == "PodRefused"
    event = wait_for(lambda: warning(kube, "nosa", "ProfilingPodRefused"), what="the Event")
    assert 'serviceaccount "shardwise-profiler" not found' in event["message"]
    time.sleep(2)
    assert api_server.emulator.count("create", "jobs") == 2, "one attempt, then the workers"


def test_unschedulable_and_image_pull_errors_show_for_profiling_and_worker_pods(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    kube.create(dlrmjob("stuck", NS, policy="IfStale"))
    job = profiling_job(kube, "stuck")
    pod = job_pod(kube, job)
    pod_unschedulable(kube, pod)  # as the scheduler
    cond = wait_for(lambda: cost_model_reason(kube, "stuck", "Unschedulable"), what="Unschedulable")
    assert (
        f"pod {pod['metadata']['name']}: Unschedulable: {UNSCHEDULABLE_MESSAGE}"
        in (cond["message"])
    )
    event = wait_for(lambda: warning(kube, "stuck", "Unschedulable"), what="the Warning Event")
    assert pod["metadata"]["name"] in event["message"]

    # the profiling step is skipped from here on; the workers' image cannot be pulled
    kube.patch("shardwise.dev/v1alpha1", "dlrmjobs", NS, "stuck",
               {"spec": {"profiling": {"policy": "Never"}}})  # fmt: skip
    wait_phase(kube, NS, "stuck", "Running")
    workers = wait_for(lambda: kube.get("batch/v1", "jobs", NS, "stuck-workers"), what="workers")
    set_job_status(kube, NS, "stuck-workers", active=2, ready=0)
    worker = job_pod(kube, workers, "0-abcde")
    pod_image_pull_backoff(kube, worker)  # as the kubelet
    cond = wait_for(
        lambda: (
            (c := condition(status_of(kube, NS, "stuck"), "WorkersReady"))
            and c["reason"] == "ImagePullError"
            and c
        ),
        what="WorkersReady=False, ImagePullError",
    )
    image = workers["spec"]["template"]["spec"]["containers"][0]["image"]
    assert cond["message"].endswith(
        f"a worker cannot start: pod {worker['metadata']['name']}: ImagePullBackOff: "
        f"container worker: {image_pull_backoff_message(image)}"
    )
    wait_for(lambda: warning(kube, "stuck", "ImagePullError"), what="the Warning Event")


def test_a_profiling_attempt_whose_pod_never_starts_fails_after_the_startup_timeout(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    start_operator()
    profiling = {"policy": "IfStale", "startupTimeoutSeconds": 30, "retries": 1,
                 "backoffSeconds": 1}  # fmt: skip
    kube.create(dlrmjob("late", NS, profiling=profiling))
    for number in (1, 2):
        job = profiling_job(kube, "late", number)
        pod = job_pod(kube, job)
        pod_unschedulable(kube, pod)
        # The operator has seen the pod's problem before the Job is late: the Job's
        # watch event can otherwise come first (the timeout then names no cause).
        wait_for(
            lambda n=pod["metadata"]["name"]: (
                (c := cost_model_reason(kube, "late", "Unschedulable")) and n in c["message"]
            ),
            what=f"attempt {number}'s pod seen Unschedulable",
        )
        # as the Job controller that started it 31 s ago
        set_job_status(kube, NS, job["metadata"]["name"], active=1, startTime=ago(31))
        marked = wait_for(
            lambda n=job["metadata"]["name"]: (
                (j := kube.get("batch/v1", "jobs", NS, n))
                and "shardwise.dev/failure" in (j["metadata"].get("annotations") or {})
                and j
            ),
            what=f"attempt {number} marked failed",
        )
        assert marked["spec"]["suspend"] is True, "suspended: the Job controller deletes its pods"
        mark = json.loads(marked["metadata"]["annotations"]["shardwise.dev/failure"])
        assert mark["reason"] == "StartupTimeout"
        assert mark["message"].startswith(
            "no pod started within 30 s (spec.profiling.startupTimeoutSeconds: 30); pod "
        )
        assert mark["message"].endswith(f": Unschedulable: {UNSCHEDULABLE_MESSAGE}")
    status = wait_phase(kube, NS, "late", "Running")
    degraded = condition(status, "Degraded")
    assert degraded is not None and degraded["reason"] == "ProfilingFailed"
    assert "failed 2 time(s)" in degraded["message"] and "StartupTimeout" in degraded["message"]
    assert status["costModel"]["source"] == "Bundled"
    creates = api_server.emulator.count("create", "jobs")
    assert creates == 3, "two attempts and the workers"


# --------------------------------------------------------------------------- pod summaries


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

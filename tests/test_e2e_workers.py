"""End to end on CPU: the operator on kopf's real engine against the API emulator, and
its worker pods run for real by the Job-controller, scheduler and kubelet stand-ins
(tests/k8s/jobcontroller.py, scheduler.py, kubelet.py, podspec.py; fixture
``local_cluster``): torchrun through the launcher, one gloo rank per pod, checkpoints on
a claim the pods share. Nothing here patches a Job's or a pod's status by hand: what
the operator sees is what the processes did. The first tests pin the stand-ins
themselves with ``sh`` pods (seconds); the last trains, reshards and resumes: one
job's life shows a run from step 0 to Succeeded under Pod Security "restricted" and a
node reshard that loses no step.

Every wait is bounded and generous (2 cores, shared with other test runs); the pods'
logs are printed when a test fails.
"""

from __future__ import annotations

import json
import signal
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from k8s import podsecurity
from k8s.helpers import (
    CKPT_CLAIM,
    CKPT_DIR,
    CPU_TABLES,
    add_local_node,
    condition,
    events_for,
    logged_losses,
    resumed_step,
    start_cpu_job,
    status_of,
    stopped_step,
    wait_for,
)
from k8s.helpers import NAMESPACE as NS
from k8s.kubelet import LocalCluster, PodRun, pids_of

from shardwise.operator.kube import ApiError, KubeApi

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
Start = Callable[..., "OperatorThread"]
#: A pod's start (torch and torchrec imports, rendezvous) takes 10-30 s on 2 busy cores.
RUN_TIMEOUT = 240.0
#: The resharding job's length: at ~30 steps/s on one rank, the node is added at step
#: 20 and the reshard (planning 2 workers, stop, checkpoint) takes ~7 s, so ~15 s spare.
STEPS = 600
#: Interval checkpoints: STEPS is not a multiple, so the last step's is the run's final.
EVERY = 80
#: The CPU example's tables read 10x as often: a second CPU worker must be predicted to
#: gain throughput, or the operator rightly declines it. With the example's own tables the
#: bundled model prices one rank's compute at 0.43 ms (0.52 ms measured here) and two
#: ranks' gloo all-to-all at about 0.7 ms, so two workers would be slower per sample.
GROW_TABLES = [{**t, "poolingFactor": 10 * t["poolingFactor"]} for t in CPU_TABLES]


def summary(cluster: LocalCluster) -> dict[str, Any]:
    """Rank 0's run summary (``--summary`` on the checkpoint claim)."""
    path = cluster.kubelet.pvc_dir(NS, CKPT_CLAIM) / "summary.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def worker_job(kube: KubeApi, name: str) -> dict[str, Any] | None:
    return kube.get("batch/v1", "jobs", NS, f"{name}-workers")


# --------------------------------------------------------------------------- the stand-ins
def plain_job(
    name: str,
    script: str,
    *args: str,
    completions: int = 1,
    grace: int = 30,
    backoff: int = 0,
    **pod: Any,
) -> dict[str, Any]:
    """An Indexed Job of ``sh -c script`` pods, labelled as our workers."""
    labels = {"shardwise.dev/job": name, "shardwise.dev/component": "worker"}
    container = {
        "name": "main",
        "image": "registry.example/none:1",
        "command": ["sh", "-c", script, "sh", *args],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **pod.pop("container", {}),
    }
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace,
            "containers": [container], **pod}  # fmt: skip
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": backoff,
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


def job_condition(kube: KubeApi, name: str, type_: str) -> dict[str, Any] | None:
    job = kube.get("batch/v1", "jobs", NS, name) or {}
    return condition(job.get("status") or {}, type_) if job else None


def pods_of(kube: KubeApi, job: str) -> list[dict[str, Any]]:
    return kube.list("v1", "pods", NS, f"batch.kubernetes.io/job-name={job}")


def test_an_indexed_job_runs_as_the_job_controller_scheduler_and_kubelet_would(
    kube: KubeApi, local_cluster: LocalCluster
) -> None:
    """Pods named, labelled, owned and placed as the real controllers do; env, volumes
    (a ConfigMap, a claim both pods share) and the DNS name rewritten for the process."""
    add_local_node(kube, "cpu-1")
    add_local_node(kube, "cpu-2")
    greeting = {"name": "greeting", "namespace": NS}
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": greeting,
                 "data": {"hi.txt": "hello"}})  # fmt: skip
    i = "$JOB_COMPLETION_INDEX"
    script = f'echo "{i} $HOSTNAME $(cat /etc/greeting/hi.txt) $1" > /data/{i}'
    body = plain_job(
        "echo", script, "echo-0.echo:1234", completions=2, subdomain="echo",
        volumes=[{"name": "greeting", "configMap": {"name": "greeting"}},
                 {"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}],
        container={"volumeMounts": [{"name": "greeting", "mountPath": "/etc/greeting"},
                                    {"name": "data", "mountPath": "/data"}]},
    )  # fmt: skip
    job = kube.create(body)
    wait_for(lambda: job_condition(kube, "echo", "Complete"), 60, what="echo Complete")

    status = kube.get("batch/v1", "jobs", NS, "echo")["status"]  # type: ignore[index]
    assert (status["succeeded"], status["active"], status["completedIndexes"]) == (2, 0, "0-1")
    assert status["startTime"] and status["completionTime"]
    assert job_condition(kube, "echo", "SuccessCriteriaMet") is not None
    data = local_cluster.kubelet.pvc_dir(NS, "shared")
    out = {i: (data / str(i)).read_text().split() for i in (0, 1)}
    assert [out[i][:3] for i in (0, 1)] == [["0", "echo-0", "hello"], ["1", "echo-1", "hello"]]
    assert out[0][3] == out[1][3] and out[0][3].startswith("127.0.0.1:"), out
    pods = sorted(pods_of(kube, "echo"), key=lambda p: p["metadata"]["name"])
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["cpu-1", "cpu-2"], "spread"
    for n, pod in enumerate(pods):
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["name"].startswith(f"echo-{n}-") and len(meta["name"]) == len("echo-0-") + 5
        assert meta["labels"]["batch.kubernetes.io/job-completion-index"] == str(n)
        assert meta["annotations"]["batch.kubernetes.io/job-completion-index"] == str(n)
        assert meta["labels"]["batch.kubernetes.io/controller-uid"] == job["metadata"]["uid"]
        (owner,) = meta["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "Job",
            job["metadata"]["uid"],
            True,
        )
        assert (spec["hostname"], spec["subdomain"]) == (f"echo-{n}", "echo")
        term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert (pod["status"]["phase"], term["exitCode"], term["reason"]) == (
            "Succeeded",
            0,
            "Completed",
        )


def test_failures_count_against_the_backoff_limit_and_the_pod_failure_policy(
    kube: KubeApi, local_cluster: LocalCluster
) -> None:
    """What the operator reads of a failed worker: the Job's Failed reason, the pod's
    exit code and termination message; and a pod no node fits stays Unschedulable."""
    add_local_node(kube, "cpu-1")
    kube.create(plain_job("flaky", "echo boom on $HOSTNAME; exit 3", backoff=1))
    fatal = plain_job("fatal", "exit 42", backoff=5)
    fatal["spec"]["podFailurePolicy"] = {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]}  # fmt: skip
    kube.create(fatal)
    kube.create(plain_job("nowhere", "true", nodeSelector={"zone": "moon"}))

    failed = wait_for(lambda: job_condition(kube, "flaky", "Failed"), 60, what="flaky Failed")
    assert (failed["reason"], failed["message"]) == (
        "BackoffLimitExceeded", "Job has reached the specified backoff limit")  # fmt: skip
    pods = pods_of(kube, "flaky")
    assert len(pods) == 2, "one retry (backoffLimit 1)"
    for pod in pods:
        term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert (pod["status"]["phase"], term["exitCode"], term["reason"]) == ("Failed", 3, "Error")
        assert term["message"] == "boom on flaky-0"  # FallbackToLogsOnError
    fail_job = wait_for(lambda: job_condition(kube, "fatal", "Failed"), 60, what="fatal Failed")
    assert fail_job["reason"] == "PodFailurePolicy" and "exit code 42" in fail_job["message"]
    assert len(pods_of(kube, "fatal")) == 1, "FailJob: no retry"
    wait_for(lambda: pods_of(kube, "nowhere"), 30, what="the unschedulable pod")
    cond = wait_for(
        lambda: condition(pods_of(kube, "nowhere")[0].get("status") or {}, "PodScheduled"), 30
    )
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable")
    assert (
        cond["message"]
        == "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    )


def test_deleting_a_job_stops_its_pods_with_sigterm_then_sigkill_after_the_grace(
    kube: KubeApi, local_cluster: LocalCluster
) -> None:
    """A reshard relies on this: a Foreground delete of the worker Job ends only once its
    pods have stopped (SIGTERM, their own time), and nothing outlives the grace period."""
    add_local_node(kube, "cpu-1")
    add_local_node(kube, "cpu-2")
    data = [{"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}]
    mounts = {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    polite = ("trap 'sleep 1; echo bye > /data/bye-$JOB_COMPLETION_INDEX; exit 0' TERM; "
              "echo up; while true; do sleep 0.1; done")  # fmt: skip
    kube.create(plain_job("polite", polite, completions=2, volumes=data, container=mounts))
    stubborn = "trap '' TERM; while true; do sleep 0.1; done"
    kube.create(plain_job("stubborn", stubborn, grace=2))

    def ready(name: str) -> int:
        return int(
            ((kube.get("batch/v1", "jobs", NS, name) or {}).get("status") or {}).get("ready", 0)
        )

    wait_for(lambda: ready("polite") == 2 and ready("stubborn") == 1, 60, what="pods ready")

    # Foreground: the Job stays until its pods have stopped (SIGTERM, the trap's 1 s)
    kube.delete("batch/v1", "jobs", NS, "polite", propagation="Foreground")
    job = kube.get("batch/v1", "jobs", NS, "polite")
    assert job is not None and job["metadata"]["deletionTimestamp"]
    wait_for(
        lambda: all(p["metadata"].get("deletionTimestamp") for p in pods_of(kube, "polite")), 10
    )
    wait_for(lambda: kube.get("batch/v1", "jobs", NS, "polite") is None, 30, what="polite gone")
    shared = local_cluster.kubelet.pvc_dir(NS, "shared")
    assert sorted(p.name for p in shared.iterdir()) == ["bye-0", "bye-1"], "stopped before removal"
    assert pods_of(kube, "polite") == []
    runs = list(local_cluster.pods("polite"))
    assert [r.exit_code for r in runs] == [0, 0] and all(
        "SIGTERM" in "".join(r.history) for r in runs
    )

    # Background: the Job goes at once; its pod ignores SIGTERM and is killed after 2 s
    t0 = time.monotonic()
    kube.delete("batch/v1", "jobs", NS, "stubborn")
    wait_for(lambda: not pods_of(kube, "stubborn"), 30, what="the stubborn pod gone")
    took = time.monotonic() - t0
    (run,) = local_cluster.pods("stubborn")
    assert run.exit_code == 128 + signal.SIGKILL and 2.0 <= took < 10.0, (run.history, took)
    assert pids_of(run.uid, None) == [], "nothing of the pod is left running"


def phase(kube: KubeApi, name: str, want: str) -> dict[str, Any]:
    """The job's status once in phase ``want``: polled every half second (a pod's run is
    tens of seconds; each poll is a request the emulator serves)."""

    def reached() -> dict[str, Any] | None:
        status = status_of(kube, NS, name)
        return status if status.get("phase") == want else None

    return wait_for(reached, RUN_TIMEOUT, interval=0.5, what=f"{name} in phase {want}")


@pytest.mark.slow
def test_a_cpu_job_trains_and_reshards_to_two_workers_that_resume_at_the_stopped_step(
    kube: KubeApi, start_operator: Start, local_cluster: LocalCluster
) -> None:
    """examples/dlrmjob-cpu.yaml's kind of job, one rank per pod, in a namespace that
    enforces Pod Security "restricted" (the emulator's admission refuses a pod that
    breaks it, as the API server does: the operator's pods need no setting from the
    user). One node's worth of workers trains from step 0; a node more, and the
    operator stops the worker (it checkpoints), starts two on a new plan, and they
    resume at the step it stopped and run to Succeeded, the loss falling over the run."""
    restricted = {podsecurity.ENFORCE: "restricted"}
    kube.patch("v1", "namespaces", None, NS, {"metadata": {"labels": restricted}})
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare", "namespace": NS},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}  # fmt: skip
    with pytest.raises(ApiError) as refused:  # the label is enforced: a bare pod is refused
        kube.create(bare)
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in refused.value.message
    add_local_node(kube, "cpu-1")
    start_operator()
    t0 = time.monotonic()
    start_cpu_job(
        kube,
        "grow",
        steps=STEPS,
        tables=GROW_TABLES,
        args=["--checkpoint-every", str(EVERY), "--summary", f"{CKPT_DIR}/summary.json"],
        resharding={"enabled": True, "debounceSeconds": 0},
    )
    first = wait_for(
        lambda: worker_job(kube, "grow"), RUN_TIMEOUT, interval=0.5, what="the first worker Job"
    )
    assert first["spec"]["parallelism"] == 1

    def trained(steps: int) -> bool:
        log = "".join(local_cluster.kubelet.log(p.name) for p in local_cluster.pods("grow-workers"))
        return any(step >= steps for step, _ in logged_losses(log))

    wait_for(lambda: trained(20), RUN_TIMEOUT, interval=0.5, what="the single worker training")
    add_local_node(kube, "cpu-2")

    added = time.monotonic()

    def resharded() -> dict[str, Any] | None:
        s = status_of(kube, NS, "grow")
        r = s.get("resharding") or {}
        return s if r.get("state") == "Done" and r.get("to") == 2 else None

    during = wait_for(resharded, RUN_TIMEOUT, interval=0.2, what="the reshard to 2 workers")
    took = time.monotonic() - added
    record = during["resharding"]
    assert (record["from"], record["to"], record["reason"]) == (1, 2, "NodeAdded")
    assert (during["workers"], during["worldSize"]) == (2, 2)
    # the first run's own summary (written at its stop), before the new workers' replaces it
    (old,) = [p for p in local_cluster.pods("grow-workers") if p.owner == first["metadata"]["uid"]]
    wait_for(lambda: old.exited_at is not None, 30, interval=0.2, what="the old pod exited")
    before = summary(local_cluster)
    status = phase(kube, "grow", "Succeeded")
    print(f"\nnode added -> resharded: {took:.1f} s; -> Succeeded {time.monotonic() - added:.1f} s")

    runs = list(local_cluster.pods("grow-workers"))
    new = [p for p in runs if p.owner != first["metadata"]["uid"]]
    assert len(runs) == 3 and len(new) == 2, [(p.name, p.history) for p in local_cluster.pods()]
    starts = [r.started_at - t0 for r in runs if r.started_at is not None]
    ends = [r.exited_at - t0 for r in runs if r.exited_at is not None]
    print(f"pods started {min(starts):.1f} s after the DLRMJob, exited {max(ends):.1f} s; "
          f"Succeeded {time.monotonic() - t0:.1f} s")  # fmt: skip
    assert old.exit_code == 0 and any("SIGTERM" in h for h in old.history), old.history
    assert [r.exit_code for r in new] == [0, 0]
    assert {r.node for r in new} == {"cpu-1", "cpu-2"}, "one worker per node"
    assert (status["workers"], status["worldSize"]) == (2, 2)
    done = condition(status, "Complete")
    assert done is not None and done["reason"] == "WorkersSucceeded"
    job = worker_job(kube, "grow")
    assert job is not None and job["metadata"]["uid"] != first["metadata"]["uid"]
    assert (job["status"]["succeeded"], job["status"]["completedIndexes"]) == (2, "0-1")

    # both Jobs' pods admitted under restricted, none refused on the way (the old Job's
    # pod is gone from the API: the kubelet removed it once it had stopped)
    pods = pods_of(kube, "grow-workers")
    assert sorted(p["metadata"]["uid"] for p in pods) == sorted(r.uid for r in new)
    for pod in pods:
        assert podsecurity.evaluate("restricted", pod["metadata"], pod["spec"]) == []
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert [e for e in events_for(kube, NS, "grow-workers") if e["reason"] == "FailedCreate"] == []
    assert sorted(r.env["JOB_COMPLETION_INDEX"] for r in new) == ["0", "1"]
    assert old.env["JOB_COMPLETION_INDEX"] == "0"

    def endpoint(run: PodRun) -> str:
        (found,) = [a for a in run.argv if a.startswith("--rdzv_endpoint=")]
        assert found.startswith("--rdzv_endpoint=127.0.0.1:"), found
        return found

    assert endpoint(old) != endpoint(new[0]) == endpoint(new[1]), "a port per Job"
    # the Foreground delete held the old Job until its pod had checkpointed and exited
    assert old.exited_at is not None
    assert all(p.started_at is not None and p.started_at > old.exited_at for p in new)
    old_log = local_cluster.kubelet.log(old.name)
    new_log = "".join(local_cluster.kubelet.log(p.name) for p in new)
    stopped, resumed = stopped_step(old_log), resumed_step(new_log)
    last_logged = max(step for step, _ in logged_losses(old_log))
    print(f"stopped after step {stopped} (last logged {last_logged}), resumed at {resumed}")
    # a clean stop checkpoints the step it ends: nothing is lost, let alone an interval
    assert stopped is not None and resumed == stopped, (stopped, resumed)
    assert resumed >= last_logged > resumed - EVERY
    assert resumed_step(old_log) is None, "the first run started afresh"
    assert (before["world_size"], before["start_step"], before["end_step"]) == (1, 0, stopped)
    assert before["stopped"] == "SIGTERM", before["stopped"]
    run = summary(local_cluster)
    assert (run["world_size"], run["start_step"], run["end_step"]) == (2, resumed, STEPS)
    # the loss falls over the job's life: its first 20 steps (1 rank) against its last 20
    # (2 ranks, after the reshard)
    head = [loss for _, loss in before["losses"][:20]]
    tail = [loss for _, loss in run["losses"][-20:]]
    first_mean, last_mean = statistics.fmean(head), statistics.fmean(tail)
    print(f"loss: first 20 steps {first_mean:.3f}, last 20 {last_mean:.3f}")
    assert len(head) == len(tail) == 20 and last_mean < 0.9 * first_mean, (first_mean, last_mean)
    # the last step is checkpointed as the run ends (STEPS is not a multiple of EVERY)
    ckpt = local_cluster.kubelet.pvc_dir(NS, CKPT_CLAIM)
    assert (ckpt / f"step-{STEPS:09d}").is_dir(), sorted(p.name for p in ckpt.iterdir())
    assert run["checkpoints"][-1].endswith(f"step-{STEPS:09d}"), run["checkpoints"]

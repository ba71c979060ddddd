"""Queueing through Kueue, the pure part: a labelled DLRMJob's Jobs are created
suspended in its LocalQueue, the operator never patches a queued Job's suspend, and
the Job with its Workload becomes the Admitted condition and the phase."""

from __future__ import annotations

import dataclasses
from typing import Any

from operator_builders import CFG, JOB, NOW, observed, plan_record, spec

from shardwise import names
from shardwise.operator.cluster.quota import Quota
from shardwise.operator.cluster.startup import startup_deadline
from shardwise.operator.cluster.summaries import ChildRef, JobState, job_state
from shardwise.operator.cluster.workloads import WorkloadState, active_workload, workload_state
from shardwise.operator.config import OperatorConfig
from shardwise.operator.decide.lifecycle import Phase, phase_of
from shardwise.operator.decide.queueing import admitted_gpus, quota_room
from shardwise.operator.decide.reconcile import Decision, decide
from shardwise.operator.render import children as render

QUEUED_JOB = dataclasses.replace(JOB, queue="team-a", priority_class="high")


def _worker(job: render.JobMeta = QUEUED_JOB, **spec_changes: Any) -> dict[str, Any]:
    return render.worker_job(job, spec(**spec_changes), "dj-plan-a", "h" * 64, 2, "A100", CFG)


def _running(d: Decision, status: dict[str, Any], suspend: bool, uid: str = "w1") -> JobState:
    body = next(b for b in d.creates if b["kind"] == "Job")
    body = {**body, "metadata": {**body["metadata"], "uid": uid}}
    body["spec"] = {**body["spec"], "suspend": suspend}
    return job_state({**body, "status": status})


def _workload(**conds: tuple[str, str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": "job-dj-workers-1a2b3", "labels": {names.LABEL_KUEUE_JOB_UID: "w1"}},
        "spec": {"queueName": "team-a"},
        "status": {
            "conditions": [
                {"type": t, "status": s, "reason": r, "message": m}
                for t, (s, r, m) in conds.items()
            ],
            **({"admission": {"clusterQueue": "gpus"}} if "Admitted" in conds else {}),
        },
    }


def test_a_queued_worker_job_is_labelled_and_created_suspended() -> None:
    body = _worker()
    labels = body["metadata"]["labels"]
    assert labels[names.LABEL_KUEUE_QUEUE] == "team-a"
    assert labels[names.LABEL_KUEUE_PRIORITY] == "high"
    assert body["spec"]["suspend"] is True
    # Kueue reads the pod-set count from parallelism and completions
    assert body["spec"]["parallelism"] == body["spec"]["completions"] == 2
    # without the label, nothing changes
    plain = _worker(JOB)
    assert names.LABEL_KUEUE_QUEUE not in plain["metadata"]["labels"]
    assert plain["spec"]["suspend"] is False
    # a Job moved to another queue is another Job (its hash differs)
    other = _worker(dataclasses.replace(QUEUED_JOB, queue="team-b"))
    ann = names.ANN_TEMPLATE_HASH
    assert other["metadata"]["annotations"][ann] != body["metadata"]["annotations"][ann]


def test_a_queued_job_that_may_reshard_gets_a_worker_job_of_no_fixed_size() -> None:
    """Elastic (Kueue's workload slices may resize it in place): the annotation Kueue
    reads, torchrun given the bounds, the plans directory mounted, and nothing in the
    template naming a size or a plan, so two sizes are the same template."""
    resharding = {"enabled": True}
    body = _worker(resharding=resharding)
    assert body["metadata"]["annotations"][names.ANN_KUEUE_ELASTIC] == "true"
    pod = body["spec"]["template"]["spec"]
    args, env = pod["containers"][0]["args"], pod["containers"][0]["env"]
    assert "--nnodes=1:2" in args and "--max-restarts=4" in args
    values = {e["name"]: e.get("value") for e in env}
    assert values[names.ENV_PLAN] == names.PLAN_DIR and values[names.ENV_ELASTIC] == "1"
    assert names.ENV_PLAN_HASH not in values and values[names.ENV_NNODES] == "1:2"
    mounted = next(v for v in pod["volumes"] if v["name"] == "shardwise-plan")
    assert mounted["configMap"]["name"] == names.plans_configmap_name("dj")
    assert names.LABEL_PLAN_HASH not in body["spec"]["template"]["metadata"]["labels"]
    other = render.worker_job(
        QUEUED_JOB, spec(resharding=resharding), "dj-plan-b", "g" * 64, 1, "A100", CFG
    )
    ann = names.ANN_TEMPLATE_HASH
    assert other["metadata"]["annotations"][ann] == body["metadata"]["annotations"][ann]
    assert other["spec"]["parallelism"] == other["spec"]["completions"] == 1
    # not queued, resharding off, one size, or the user's own command: a fixed size
    for fixed in (
        _worker(JOB, resharding=resharding),
        _worker(),
        _worker(resharding=resharding, workers=(2, 2)),
        _worker(resharding=resharding, template={"image": "x", "command": ["train"]}),
    ):
        assert names.ANN_KUEUE_ELASTIC not in fixed["metadata"]["annotations"]
        assert "--nnodes=1:2" not in fixed["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_growing_slice_speaks_for_the_job_once_kueue_admits_it() -> None:
    """Two Workloads for one Job while it grows through workload slices: the admitted
    one speaks for it and its count is the quota the job holds, until the larger slice
    is admitted and the first is finished."""
    old = WorkloadState(
        "wl-a", "w1", "team-a", admitted=True, count=2, created="2026-11-27T00:00:00Z"
    )
    new = WorkloadState("wl-b", "w1", "team-a", count=4, created="2026-11-27T00:01:00Z")
    assert active_workload([new, old]) == old
    done = dataclasses.replace(old, finished=True, admitted=False)
    grown = dataclasses.replace(new, admitted=True)
    assert active_workload([done, grown]) == grown
    assert active_workload([]) is None
    body = _worker(resharding={"enabled": True})
    body["metadata"] |= {"uid": "w1"}
    body["metadata"]["annotations"][names.ANN_WORKERS] = "4"  # patched up, slice pending
    body["spec"]["template"]["spec"]["schedulingGates"] = [{"name": names.KUEUE_ELASTIC_GATE}]
    body["spec"]["suspend"] = False
    job = job_state(body)
    assert job.slices
    assert admitted_gpus(job, 2, old) == 4  # the admitted slice's 2 workers, not 4
    assert admitted_gpus(job, 2, grown) == 8
    assert not job_state(_worker(resharding={"enabled": True})).slices  # no gate: no slices


def test_profiling_jobs_queue_through_the_charts_queue_or_the_jobs_own() -> None:
    d = decide(observed(job=QUEUED_JOB, spec=spec(profiling={"policy": "IfStale"})))
    prof = next(b for b in d.creates if b["kind"] == "Job")
    assert prof["metadata"]["labels"][names.LABEL_KUEUE_QUEUE] == "team-a"
    assert prof["spec"]["suspend"] is True
    cfg = OperatorConfig(profiling_queue="profiling")
    d = decide(observed(job=JOB, spec=spec(profiling={"policy": "IfStale"}), config=cfg))
    prof = next(b for b in d.creates if b["kind"] == "Job")
    assert prof["metadata"]["labels"][names.LABEL_KUEUE_QUEUE] == "profiling"


def test_a_queued_job_has_no_startup_deadline_until_kueue_admits_it() -> None:
    """A profiling attempt waiting in its queue is not late: it has not started."""
    ref = ChildRef("Job", "dj-profile-x-1", "ml", "u1", "1", created=NOW)
    assert startup_deadline(JobState(ref, suspended=True), 60) is None
    assert startup_deadline(JobState(ref), 60) is not None


def test_workload_summary_reads_kueues_conditions() -> None:
    pending = workload_state(
        _workload(QuotaReserved=("False", "Pending", "couldn't assign flavors to pod set main"))
    )
    assert (pending.job_uid, pending.queue, pending.admitted) == ("w1", "team-a", False)
    assert (pending.reason, pending.misconfigured) == ("Pending", False)
    missing = workload_state(
        _workload(QuotaReserved=("False", "Inadmissible", "LocalQueue team-a doesn't exist"))
    )
    assert missing.misconfigured
    admitted = workload_state(
        _workload(
            QuotaReserved=("True", "QuotaReserved", "ok"), Admitted=("True", "Admitted", "ok")
        )
    )
    assert admitted.admitted and admitted.cluster_queue == "gpus" and admitted.reason == ""
    evicted = workload_state(
        _workload(
            QuotaReserved=("False", "Pending", "waiting"),
            Evicted=("True", "Preempted", "Preempted to accommodate a workload"),
        )
    )
    assert evicted.evicted_reason == "Preempted"


def _decide_queued(status: dict[str, Any], suspend: bool, wl: WorkloadState | None) -> Decision:
    ih = decide(observed(job=QUEUED_JOB)).plan.inputs.hash()  # type: ignore[union-attr]
    plans = [plan_record("dj-plan-aaaaaaaa", ih)]
    first = decide(observed(job=QUEUED_JOB, plans=plans))
    wj = _running(first, status, suspend)
    return decide(observed(job=QUEUED_JOB, plans=plans, worker_job=wj, workload=wl))


def _cond(d: Decision, kind: str) -> Any:
    return next(c for c in d.conditions if c.type == kind)


def test_a_queued_job_is_queued_from_the_pass_that_creates_its_job() -> None:
    """Never a Running flash before Kueue admits it (seen under load: a test took the
    just-created queued job for the running one)."""
    ih = decide(observed(job=QUEUED_JOB)).plan.inputs.hash()  # type: ignore[union-attr]
    d = decide(observed(job=QUEUED_JOB, plans=[plan_record("dj-plan-aaaaaaaa", ih)]))
    assert [b["kind"] for b in d.creates if b["kind"] == "Job"] == ["Job"]
    assert (
        _cond(d, "Admitted").reason == "Queued"
        and "LocalQueue team-a" in _cond(d, "Admitted").message
    )
    assert phase_of(d.conditions)[0] == Phase.QUEUED
    d = decide(observed(job=JOB, plans=[plan_record("dj-plan-aaaaaaaa", ih)]))
    assert (
        _cond(d, "WorkersReady").reason == "Starting" and phase_of(d.conditions)[0] == Phase.RUNNING
    )


def test_waiting_admitted_and_preempted_are_conditions_and_phases() -> None:
    waiting = WorkloadState(
        "wl", "w1", "team-a", reason="Pending", message="insufficient quota for nvidia.com/gpu"
    )
    d = _decide_queued({}, True, waiting)
    admitted = _cond(d, "Admitted")
    assert (admitted.status, admitted.reason) == (False, "Queued")
    assert "LocalQueue team-a" in admitted.message and "insufficient quota" in admitted.message
    assert phase_of(d.conditions)[0] == Phase.QUEUED
    # the operator never patches a queued Job's suspend: it is Kueue's
    assert not any("suspend" in (p.get("spec") or {}) for _, p in d.patches)

    missing = WorkloadState(
        "wl", "w1", "team-a", reason="Inadmissible", message="LocalQueue team-a doesn't exist"
    )
    d = _decide_queued({}, True, missing)
    assert _cond(d, "Admitted").reason == "Inadmissible"
    assert "LocalQueue team-a doesn't exist" in _cond(d, "Admitted").message

    preempted = WorkloadState(
        "wl", "w1", "team-a", reason="Pending", evicted_reason="Preempted",
        evicted_message="Preempted to accommodate a workload (UID: x)",
    )  # fmt: skip
    d = _decide_queued({}, True, preempted)
    assert _cond(d, "Admitted").reason == "Preempted"
    assert phase_of(d.conditions)[0] == Phase.PREEMPTED
    assert _cond(d, "WorkersReady").reason == "Preempted"

    running = WorkloadState("wl", "w1", "team-a", cluster_queue="gpus", admitted=True)
    d = _decide_queued({"active": 4, "ready": 4}, False, running)
    assert _cond(d, "Admitted").status and "ClusterQueue gpus" in _cond(d, "Admitted").message
    assert phase_of(d.conditions)[0] == Phase.RUNNING

    # no Workload yet (or --no-kueue): still Queued, saying why it cannot tell more
    d = _decide_queued({}, True, None)
    assert _cond(d, "Admitted").reason == "Queued"
    assert "Kueue" in _cond(d, "Admitted").message


def test_a_suspended_queued_job_gives_its_quota_back_by_deleting_its_job() -> None:
    ih = decide(observed(job=QUEUED_JOB)).plan.inputs.hash()  # type: ignore[union-attr]
    plans = [plan_record("dj-plan-aaaaaaaa", ih)]
    first = decide(observed(job=QUEUED_JOB, plans=plans))
    wj = _running(first, {"active": 4, "ready": 4}, False)
    d = decide(observed(job=QUEUED_JOB, spec=spec(suspend=True), plans=plans, worker_job=wj))
    assert [r.name for r in d.deletes if r.kind == "Job"] == ["dj-workers"]
    assert not d.patches and not [b for b in d.creates if b["kind"] == "Job"]
    assert _cond(d, "WorkersReady").reason == "Suspended"
    # and none is created while it stays suspended (the plan is kept)
    d = decide(observed(job=QUEUED_JOB, spec=spec(suspend=True), plans=plans))
    assert not [b for b in d.creates if b["kind"] == "Job"] and not d.deletes
    # an unqueued job is still suspended in place
    wj = _running(first, {"active": 4, "ready": 4}, False)
    plain = dataclasses.replace(wj, ref=dataclasses.replace(wj.ref, labels={}))
    d = decide(observed(spec=spec(suspend=True), plans=plans, worker_job=plain))
    assert any(p == {"spec": {"suspend": True}} for _, p in d.patches)


def test_quota_room_is_what_the_queue_has_left_or_its_whole_quota() -> None:
    def q(nominal: int, used: int) -> Quota:
        return Quota("team-a", "gpus", "nvidia.com/gpu", nominal, used)

    assert quota_room(None, 0, 2, 1) == (None, None)
    assert quota_room(q(8, 0), 0, 2, 1)[0] == 4
    assert quota_room(q(8, 8), 8, 2, 1)[0] == 4  # its own admitted share counts as room
    assert quota_room(q(16, 8), 8, 2, 1)[0] == 8  # quota raised: room to grow
    assert quota_room(q(8, 4), 0, 2, 1)[0] == 2  # others hold 4: 2 workers fit now
    # below workers.min: queue at what the whole quota allows, not at nothing
    assert quota_room(q(8, 8), 0, 2, 2)[0] == 4
    room, infeasible = quota_room(q(2, 0), 0, 2, 2)
    assert room is None and infeasible is not None
    assert (infeasible.type, infeasible.status, infeasible.reason) == (
        "Capacity",
        False,
        "Infeasible",
    )
    assert "workers.min 2 x gpusPerWorker 2 = 4 nvidia.com/gpu" in infeasible.message
    assert "ClusterQueue gpus's nominal quota of 2" in infeasible.message


def test_a_queued_job_is_sized_by_its_queues_quota() -> None:
    """One node of 4 GPUs holds 2 workers of 2 GPUs; a queue with 2 GPUs left holds 1."""
    roomy = Quota("team-a", "gpus", "nvidia.com/gpu", 8, 0)
    d = decide(observed(job=QUEUED_JOB, quota=roomy))
    assert d.fields["workers"] == 2
    tight = Quota("team-a", "gpus", "nvidia.com/gpu", 8, 6)
    d = decide(observed(job=QUEUED_JOB, quota=tight))
    assert d.fields["workers"] == 1
    # workers.min above the whole quota: Infeasible, with the figures, and nothing made
    d = decide(observed(job=QUEUED_JOB, spec=spec(workers=(2, 2)), quota=q2()))
    failed = _cond(d, "Failed")
    assert failed.reason == "Infeasible" and "nominal quota of 2" in failed.message
    assert phase_of(d.conditions)[0] == Phase.FAILED and not d.creates and d.plan is None


def q2() -> Quota:
    return Quota("team-a", "gpus", "nvidia.com/gpu", 2, 0)


def test_a_quota_change_is_a_reshard_named_quota_changed() -> None:
    """A running queued job at 1 worker whose queue's quota is raised: the target grows
    to what the nodes hold, and the pending reshard names the quota as its cause."""
    elastic = spec(resharding={"enabled": True, "debounceSeconds": 30})
    tight = Quota("team-a", "gpus", "nvidia.com/gpu", 2, 2)
    ih = decide(observed(job=QUEUED_JOB, spec=elastic, quota=tight)).plan.inputs.hash()  # type: ignore[union-attr]
    plans = [plan_record("dj-plan-aaaaaaaa", ih)]
    first = decide(observed(job=QUEUED_JOB, spec=elastic, quota=tight, plans=plans))
    assert first.fields["workers"] == 1
    wj = _running(first, {"active": 1, "ready": 1}, False)
    raised = Quota("team-a", "gpus", "nvidia.com/gpu", 8, 2)
    d = decide(observed(job=QUEUED_JOB, spec=elastic, quota=raised, plans=plans, worker_job=wj))
    record = d.fields["resharding"]
    assert (record["state"], record["from"], record["to"]) == ("Pending", 1, 2)
    assert record["reason"] == "QuotaChanged"
    # the same job with its quota unchanged does not reshard
    d = decide(observed(job=QUEUED_JOB, spec=elastic, quota=tight, plans=plans, worker_job=wj))
    assert "resharding" not in d.fields

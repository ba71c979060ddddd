"""Queueing through Kueue: what a queued worker Job's state says about the DLRMJob.

A DLRMJob labelled ``kueue.x-k8s.io/queue-name`` gets its Jobs created suspended in
that LocalQueue (:func:`~shardwise.operator.render.children.queued`). From then on
Kueue owns the Job's ``spec.suspend``: it unsuspends the Job when the ClusterQueue's
quota admits it, and suspends it again when it preempts it. The operator never patches
that field on a queued Job (it would fight Kueue); a suspended DLRMJob deletes its
queued Job instead, giving the quota back (:mod:`~shardwise.operator.decide.workers`).

:func:`admission` turns the Job and its Workload into the ``Admitted`` condition, whose
reason sets the phase (``Queued``, ``Preempted``; docs/operator.md). :func:`quota_room`
sizes a queued job: the largest world its bounds and its queue's GPU quota allow, so
that a quota raised or freed grows it and a preemption that leaves less shrinks it,
through the same resharding path as a node change (resharding.py).
"""

from __future__ import annotations

from shardwise import names
from shardwise.operator.cluster.quota import Quota
from shardwise.operator.cluster.summaries import JobState
from shardwise.operator.cluster.workloads import WorkloadState
from shardwise.operator.decide.lifecycle import Condition

QUEUED = "Queued"
PREEMPTED = "Preempted"
ADMITTED = "Admitted"
#: The LocalQueue or its ClusterQueue does not exist or is inactive.
INADMISSIBLE = "Inadmissible"
#: ``workers.min`` needs more GPUs than the queue's whole quota.
INFEASIBLE = "Infeasible"


def queue_of(job: JobState) -> str:
    """The LocalQueue a Job was created in (``""``: not queued)."""
    return job.ref.labels.get(names.LABEL_KUEUE_QUEUE, "")


def admission(job: JobState, workload: WorkloadState | None, reads_workloads: bool) -> Condition:
    """The ``Admitted`` condition of a queued Job: True once Kueue unsuspended it; else
    why it waits, in Kueue's words when its Workload says (``reads_workloads`` False:
    the operator runs with ``--no-kueue`` and cannot tell)."""
    queue = queue_of(job)
    if not job.suspended:
        where = (
            f"ClusterQueue {workload.cluster_queue}" if workload and workload.cluster_queue else ""
        )
        by = f" by {where}" if where else ""
        return Condition(
            "Admitted", True, ADMITTED, f"{job.ref.name} admitted{by} from LocalQueue {queue}"
        )
    if workload is not None and workload.evicted_reason:
        return Condition(
            "Admitted",
            False,
            PREEMPTED if workload.evicted_reason == "Preempted" else QUEUED,
            f"{job.ref.name} was evicted ({workload.evicted_reason}: "
            f"{workload.evicted_message}); it waits in LocalQueue {queue} to be admitted "
            "again and resumes from its checkpoint",
        )
    if workload is not None and workload.reason:
        return Condition(
            "Admitted",
            False,
            INADMISSIBLE if workload.misconfigured else QUEUED,
            f"{job.ref.name} waits in LocalQueue {queue}: {workload.reason}: {workload.message}",
        )
    why = (
        "Kueue has not made its Workload yet (is Kueue installed, managing batch/v1 Jobs?)"
        if reads_workloads
        else "the operator runs with --no-kueue and does not read Workloads"
    )
    return Condition(
        "Admitted", False, QUEUED, f"{job.ref.name} waits in LocalQueue {queue} for Kueue; {why}"
    )


def admitted_gpus(
    job: JobState | None, gpus_per_worker: int, workload: WorkloadState | None = None
) -> int:
    """The GPUs the queue's usage counts for the job's own worker Job: all of it once
    Kueue admitted it (unsuspended), none while it waits or goes; of an elastic Job
    growing in place, only its admitted slice's (the larger one waits for quota)."""
    if job is None or not queue_of(job) or job.suspended or job.ref.deleting or job.done:
        return 0
    if job.slices and workload is not None and workload.admitted and workload.count:
        return workload.count * gpus_per_worker
    return int(job.ref.annotations.get(names.ANN_WORKERS, "0") or 0) * gpus_per_worker


def quota_room(
    quota: Quota | None, own_gpus: int, gpus_per_worker: int, workers_min: int
) -> tuple[int | None, Condition | None]:
    """The most workers the job's queue can hold (``None``: no cap), or why it never
    can (the ``Infeasible`` condition, with the figures).

    The room is the queue's nominal GPU quota less what other workloads hold
    (``quota.used`` less ``own_gpus``, the job's own admitted share). When that is
    below ``workers.min``, the job queues at the size the whole quota allows: Kueue
    holds it until the others finish, rather than the job shrinking to nothing."""
    if quota is None:
        return None, None
    need = workers_min * gpus_per_worker
    if quota.nominal < need:
        message = (
            f"workers.min {workers_min} x gpusPerWorker {gpus_per_worker} = {need} "
            f"{quota.resource} is more than ClusterQueue {quota.cluster_queue}'s nominal quota "
            f"of {quota.nominal} (LocalQueue {quota.local_queue}): Kueue can never admit it; "
            "lower workers.min or raise the quota"
        )
        return None, Condition("Capacity", False, INFEASIBLE, message)
    room = (quota.nominal - quota.used + own_gpus) // gpus_per_worker
    if room < workers_min:
        room = quota.nominal // gpus_per_worker
    return room, None

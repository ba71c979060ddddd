"""What Kueue says about a queued Job: the summary of its Workload.

Kueue makes one ``Workload`` (``kueue.x-k8s.io``) per Job labelled with a queue name,
labels it with the Job's uid, and records there why the Job waits: the
``QuotaReserved`` condition's reason and message ("couldn't assign flavors to pod set
main: insufficient quota …", "LocalQueue q doesn't exist"), and ``Evicted`` with
reason ``Preempted`` when it took the quota back. The Job itself only shows
``spec.suspend``, so the operator reads the Workload to say why (docs/operator.md,
"Queueing through Kueue").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardwise import names

#: ``QuotaReserved`` reasons that mean the queue itself is wrong (it does not exist or
#: is inactive), not that the quota is in use: the job waits until the queue is fixed.
MISCONFIGURED = frozenset({"Inadmissible", "Misconfigured", "Suspended"})


@dataclass(frozen=True)
class WorkloadState:
    """One Workload: whom it queues and where it stands."""

    name: str
    job_uid: str
    queue: str
    #: The ClusterQueue that admitted it (``""``: not admitted).
    cluster_queue: str = ""
    admitted: bool = False
    #: Why it is not admitted: ``QuotaReserved``'s reason and message when False.
    reason: str = ""
    message: str = ""
    #: ``Evicted``'s reason and message while True (e.g. ``Preempted``).
    evicted_reason: str = ""
    evicted_message: str = ""
    finished: bool = False
    #: The pods it asks quota for (its pod set's count).
    count: int = 0
    #: ``metadata.creationTimestamp`` (RFC 3339: orders as text).
    created: str = ""

    @property
    def misconfigured(self) -> bool:
        return self.reason in MISCONFIGURED


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in status.get("conditions") or [] if isinstance(c, dict)}


def workload_state(body: Mapping[str, Any]) -> WorkloadState:
    """Summarize a Workload body (any served version: the fields read are common)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    conds = _conditions(status)

    def true(kind: str) -> bool:
        return str((conds.get(kind) or {}).get("status")) == "True"

    reserved = conds.get("QuotaReserved") or {}
    evicted = conds.get("Evicted") or {}
    waiting = reserved.get("status") == "False"
    return WorkloadState(
        name=str(meta.get("name", "")),
        job_uid=str((meta.get("labels") or {}).get(names.LABEL_KUEUE_JOB_UID, "")),
        queue=str(spec.get("queueName", "")),
        cluster_queue=str((status.get("admission") or {}).get("clusterQueue", "")),
        admitted=true("Admitted"),
        reason=str(reserved.get("reason", "")) if waiting else "",
        message=str(reserved.get("message", "")) if waiting else "",
        evicted_reason=str(evicted.get("reason", "")) if true("Evicted") else "",
        evicted_message=str(evicted.get("message", "")) if true("Evicted") else "",
        finished=true("Finished"),
        count=int(((spec.get("podSets") or [{}])[0] or {}).get("count", 0) or 0),
        created=str(meta.get("creationTimestamp", "")),
    )


def active_workload(workloads: Iterable[WorkloadState]) -> WorkloadState | None:
    """The Workload that speaks for a Job. One, but for an elastic Job growing through
    workload slices: the new slice waits while the old one keeps its admission, and
    is finished once the new one is admitted. So: the newest admitted, unfinished one;
    else the newest unfinished; else the newest."""
    every = sorted(workloads, key=lambda w: (w.created, w.name), reverse=True)
    holding = [w for w in every if w.admitted and not w.finished]
    unfinished = [w for w in every if not w.finished]
    return next(iter(holding or unfinished or every), None)

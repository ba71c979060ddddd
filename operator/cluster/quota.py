"""The GPU quota a Kueue queue holds: summaries of LocalQueues and ClusterQueues.

A LocalQueue (namespaced) points at a ClusterQueue (cluster-scoped), whose
``spec.resourceGroups`` give each flavor's ``nominalQuota`` per resource and whose
``status.flavorsReservation`` (older Kueue: ``flavorsUsage``) what admitted workloads
hold. The operator sizes a queued job from the GPUs left there
(:func:`shardwise.operator.decide.queueing.quota_room`), as it sizes any job from the
nodes' free GPUs. Borrowing within a cohort is not counted: a job sized on its own
queue's nominal quota never depends on another team's idle GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LocalQueueInfo:
    namespace: str
    name: str
    cluster_queue: str


@dataclass(frozen=True)
class ClusterQueueInfo:
    """One ClusterQueue's quota and use of one resource (the GPUs), over its flavors."""

    name: str
    resource: str
    nominal: int
    used: int


@dataclass(frozen=True)
class Quota:
    """What a job's queue holds: for its conditions and its size."""

    local_queue: str
    cluster_queue: str
    resource: str
    nominal: int
    used: int


def local_queue_info(body: Mapping[str, Any]) -> LocalQueueInfo:
    meta = body.get("metadata") or {}
    return LocalQueueInfo(
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        str((body.get("spec") or {}).get("clusterQueue", "")),
    )


def _amount(value: Any) -> int:
    """A count of GPUs from a quantity ("8", 8, "8000m"); 0 when unreadable."""
    text = str(value).strip()
    scale = 1000.0 if text.endswith("m") else 1.0
    try:
        return int(float(text.removesuffix("m")) / scale)
    except ValueError:
        return 0


def _total(flavors: Iterable[Any], resource: str, key: str) -> int:
    return sum(
        _amount(r.get(key, 0))
        for f in flavors
        if isinstance(f, Mapping)
        for r in f.get("resources") or []
        if isinstance(r, Mapping) and r.get("name") == resource
    )


def cluster_queue_info(body: Mapping[str, Any], resource: str) -> ClusterQueueInfo:
    """``resource``'s nominal quota and reserved use, summed over the flavors."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    flavors = [f for g in spec.get("resourceGroups") or [] for f in g.get("flavors") or []]
    held = status.get("flavorsReservation") or status.get("flavorsUsage") or []
    return ClusterQueueInfo(
        str((body.get("metadata") or {}).get("name", "")),
        resource,
        _total(flavors, resource, "nominalQuota"),
        _total(held, resource, "total"),
    )


def quota_of(
    local: LocalQueueInfo | None, clusters: Mapping[str, ClusterQueueInfo]
) -> Quota | None:
    """The quota behind a LocalQueue; ``None`` when either queue is unknown (Kueue's
    Workload then says why the job cannot be admitted)."""
    if local is None or local.cluster_queue not in clusters:
        return None
    cq = clusters[local.cluster_queue]
    return Quota(local.name, cq.name, cq.resource, cq.nominal, cq.used)

"""What every job loop shares (:class:`OperatorContext`), and the kopf indexes it reads
(:class:`Indexes`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardwise.operator.cluster.capacity import GpuPod, NodeInfo
from shardwise.operator.cluster.workloads import WorkloadState
from shardwise.operator.config import OperatorConfig
from shardwise.operator.decide.lifecycle import EventSpec
from shardwise.operator.kube import KubeApi
from shardwise.operator.loop.planner_pool import PlanExecutor
from shardwise.operator.metrics import OperatorMetrics
from shardwise.operator.wakeups import Wakeups

T = TypeVar("T")
Index = Mapping[Any, Iterable[Any]]


@dataclass
class OperatorContext:
    """What every job loop shares."""

    kube: KubeApi
    planner: PlanExecutor
    config: OperatorConfig = field(default_factory=OperatorConfig)
    wakeups: Wakeups = field(default_factory=Wakeups)
    #: Emits an Event (kopf.event in the operator; a list in unit tests).
    emit: Callable[[Mapping[str, Any], EventSpec], None] = lambda body, ev: None
    #: Node summaries last seen, to wake jobs only when capacity really changed.
    nodes_seen: dict[str, NodeInfo] = field(default_factory=dict)
    #: Pods holding GPUs last seen, to wake jobs only when GPU usage really changed.
    gpu_pods_seen: dict[str, GpuPod] = field(default_factory=dict)
    #: What each of our pods last showed (started, problem, deleting), to wake its
    #: job only when that changes.
    pods_seen: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: Kueue Workloads last seen, to wake their namespace's jobs only on a change.
    workloads_seen: dict[str, WorkloadState] = field(default_factory=dict)
    #: Kueue LocalQueues and ClusterQueues last seen (their summaries), likewise.
    queues_seen: dict[str, object] = field(default_factory=dict)
    #: Prometheus series (served on --metrics-port by operator.main).
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)


@dataclass(frozen=True)
class Indexes:
    """The kopf indexes (``sw_*`` handler ids in :mod:`shardwise.operator.handlers`)."""

    jobs: Index
    plans: Index
    services: Index
    models: Index
    nodes: Index
    #: Bound pods holding GPUs, by node: capacity other workloads already use.
    gpu_pods: Index = field(default_factory=dict)
    #: Our own pods (:class:`~shardwise.operator.cluster.startup.PodState`), by job.
    pods: Index = field(default_factory=dict)
    #: Rank 0's live summaries (:func:`~shardwise.operator.cluster.summaries.live_record`), by job.
    live: Index = field(default_factory=dict)
    #: Kueue's Workloads (:class:`~shardwise.operator.cluster.workloads.WorkloadState`),
    #: by (namespace, the uid of the Job each queues).
    workloads: Index = field(default_factory=dict)
    #: Kueue's LocalQueues by (namespace, name), and ClusterQueues by name: quota.
    localqueues: Index = field(default_factory=dict)
    clusterqueues: Index = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Indexes:
        return cls(
            kwargs["sw_jobs"],
            kwargs["sw_plans"],
            kwargs["sw_services"],
            kwargs["sw_models"],
            kwargs["sw_nodes"],
            kwargs.get("sw_gpu_pods", {}),
            kwargs.get("sw_pods", {}),
            kwargs.get("sw_live", {}),
            kwargs.get("sw_workloads", {}),
            kwargs.get("sw_localqueues", {}),
            kwargs.get("sw_clusterqueues", {}),
        )


def values(index: Index, key: Any) -> list[Any]:
    """What ``index`` holds under ``key`` (nothing when the key is absent)."""
    store = index.get(key)
    return list(store) if store is not None else []


async def call(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread: the Kubernetes client blocks."""
    return await asyncio.to_thread(fn, *args)

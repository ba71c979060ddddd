"""Which nodes a job may use, how many workers they hold, and on which GPU type.

Pure functions over :class:`NodeInfo` summaries (what the node index keeps).
Resharding (:mod:`shardwise.operator.decide.resharding`) calls the same functions for its
target worker count when node capacity changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.operator.cluster import node_affinity
from shardwise.operator.config import OperatorConfig

#: The GPU "type" of CPU-only workers (planner.device cpu).
CPU_TYPE = "cpu"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True)
class NodeInfo:
    """What the operator needs to know about a node."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0
    ready: bool = True
    schedulable: bool = True
    taints: tuple[Taint, ...] = ()


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def node_info(body: Mapping[str, Any], gpu_resource: str) -> NodeInfo:
    """Summarize a Node object (allocatable GPUs, Ready condition, cordon, taints)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return NodeInfo(
        name=str(meta.get("name", "")),
        labels=dict(meta.get("labels") or {}),
        gpus=_int((status.get("allocatable") or {}).get(gpu_resource, 0)),
        ready=conditions.get("Ready", "True") == "True",
        schedulable=not spec.get("unschedulable", False),
        taints=tuple(
            Taint(str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
            for t in spec.get("taints") or []
        ),
    )


@dataclass(frozen=True)
class GpuPod:
    """A running or pending pod bound to a node with GPUs requested: what it holds."""

    namespace: str
    job: str  # its shardwise.dev/job label ("" for other workloads)
    component: str  # its shardwise.dev/component label
    node: str
    gpus: int


def pod_gpus(
    body: Mapping[str, Any], gpu_resource: str, job_label: str, component_label: str
) -> GpuPod | None:
    """The GPUs a pod holds on its node, or ``None`` when it holds none (not bound yet,
    finished, or no GPU requested). Extended resources are requested through limits
    (requests, if given, must equal them), so the larger of the two counts."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    phase = (body.get("status") or {}).get("phase")
    node = spec.get("nodeName")
    if not node or phase in ("Succeeded", "Failed"):
        return None
    gpus = 0
    for container in spec.get("containers") or []:
        res = container.get("resources") or {}
        gpus += max(
            _int((res.get("limits") or {}).get(gpu_resource, 0)),
            _int((res.get("requests") or {}).get(gpu_resource, 0)),
        )
    if gpus <= 0:
        return None
    labels = meta.get("labels") or {}
    return GpuPod(
        namespace=str(meta.get("namespace", "")),
        job=str(labels.get(job_label, "")),
        component=str(labels.get(component_label, "")),
        node=str(node),
        gpus=gpus,
    )


def gpu_usage(pods: Iterable[GpuPod], namespace: str, job: str, worker: str) -> dict[str, int]:
    """GPUs per node held by every pod but this job's own workers (which a reshard
    replaces, so their GPUs are the job's to plan with)."""
    used: dict[str, int] = {}
    for p in pods:
        if (p.namespace, p.job, p.component) == (namespace, job, worker):
            continue
        used[p.node] = used.get(p.node, 0) + p.gpus
    return used


def less_used(nodes: Iterable[NodeInfo], used: Mapping[str, int]) -> list[NodeInfo]:
    """The nodes with what other pods hold taken off their allocatable GPUs."""
    return [
        dataclasses.replace(n, gpus=max(0, n.gpus - used.get(n.name, 0))) if n.name in used else n
        for n in nodes
    ]


def _tolerated(taint: Taint, tolerations: Sequence[Mapping[str, Any]]) -> bool:
    if taint.effect == "PreferNoSchedule":
        return True
    for tol in tolerations:
        if tol.get("effect") not in (None, "", taint.effect):
            continue
        if tol.get("operator") == "Exists" and tol.get("key") in (None, "", taint.key):
            return True
        if tol.get("key") == taint.key and str(tol.get("value", "")) == taint.value:
            return True
    return False


def gpu_type(node: NodeInfo, device: str, config: OperatorConfig) -> str | None:
    if device == "cpu":
        return CPU_TYPE
    return node.labels.get(config.gpu_type_label)


def eligible(
    nodes: Iterable[NodeInfo],
    node_selector: Mapping[str, str],
    tolerations: Sequence[Mapping[str, Any]],
    device: str,
    config: OperatorConfig,
    affinity: Mapping[str, Any] | None = None,
) -> list[NodeInfo]:
    """Ready, schedulable nodes matching the selector and the pods' required node
    ``affinity`` (as the scheduler matches it: :mod:`.node_affinity`), with a GPU type,
    whose taints the template tolerates."""
    required = node_affinity.required(affinity)
    out = []
    for node in nodes:
        if not (node.ready and node.schedulable) or gpu_type(node, device, config) is None:
            continue
        if any(node.labels.get(k) != v for k, v in node_selector.items()):
            continue
        if not node_affinity.matches(required, node.name, node.labels):
            continue
        if all(_tolerated(t, tolerations) for t in node.taints):
            out.append(node)
    return sorted(out, key=lambda n: n.name)


def worker_slots(
    nodes: Iterable[NodeInfo], gpus_per_worker: int, device: str, config: OperatorConfig
) -> dict[str, int]:
    """Workers each GPU type can hold: GPUs per node // gpusPerWorker (one per node on CPU)."""
    slots: dict[str, int] = {}
    for node in nodes:
        kind = gpu_type(node, device, config)
        if kind is None:
            continue
        n = 1 if device == "cpu" else node.gpus // gpus_per_worker
        slots[kind] = slots.get(kind, 0) + n
    return slots


@dataclass(frozen=True)
class Placement:
    gpu_type: str
    workers: int


@dataclass(frozen=True)
class Shortfall:
    message: str


def choose(
    slots: Mapping[str, int], minimum: int, maximum: int, gpus_per_worker: int
) -> Placement | Shortfall:
    """The GPU type with the most worker slots (ties: by name), and min(max, slots)
    workers of it; a :class:`Shortfall` saying why when fewer than ``minimum`` fit."""
    if slots:
        best = sorted(slots.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        if best[1] >= minimum:
            return Placement(best[0], min(maximum, best[1]))
    offered = ", ".join(f"{k}: {v}" for k, v in sorted(slots.items())) or "none"
    return Shortfall(
        f"needs at least {minimum} worker(s) of {gpus_per_worker} GPU(s) on one GPU type; "
        f"the eligible nodes hold {offered}"
    )


def gpu_memory_bytes(
    nodes: Iterable[NodeInfo], kind: str, device: str, config: OperatorConfig
) -> int | None:
    """The smallest GPU memory (node label, MiB) among nodes of ``kind``, in bytes."""
    values = [
        _int(n.labels.get(config.gpu_memory_label, ""))
        for n in nodes
        if gpu_type(n, device, config) == kind
    ]
    values = [v for v in values if v > 0]
    return min(values) * 2**20 if values else None

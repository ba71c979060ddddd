"""The kopf handlers: thin, each a call into the pure modules.

- **indexes** (``sw_*``) keep summaries of the cluster as watch events arrive: the
  DLRMJobs' Jobs, plan ConfigMaps, Services and pods (by job), the published cost
  models (by GPU type), the nodes and the pods holding GPUs;
- **event handlers** wake the loop of the DLRMJob an event concerns (every job, for a
  node whose capacity changed or a new cost model in its namespace);
- one **daemon** per DLRMJob runs its reconcile loop
  (:func:`shardwise.operator.loop.runner.run_job`); kopf starts it for every existing job on
  startup, and stops it when the job is deleted (kopf's finalizer holds the deletion
  until then, and the garbage collector removes the children through their owner
  references).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from shardwise import names
from shardwise.operator.cluster.capacity import node_info, pod_gpus
from shardwise.operator.cluster.quota import cluster_queue_info, local_queue_info
from shardwise.operator.cluster.startup import pod_state
from shardwise.operator.cluster.summaries import child_ref, job_state, live_record, plan_record
from shardwise.operator.cluster.workloads import workload_state
from shardwise.operator.context import Indexes, OperatorContext
from shardwise.operator.loop.runner import run_job
from shardwise.operator.models.cost_models import model_info

FINALIZER = f"{names.GROUP}/operator"


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings: our finalizer, server-side label selectors, and only warnings as
    framework Events (the operator posts its own, repeats counted: events.py)."""
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "shardwise-operator"
    settings.watching.label_selectors["batch", "v1", "jobs"] = names.LABEL_JOB
    settings.watching.label_selectors["v1", "services"] = names.LABEL_JOB
    settings.watching.label_selectors["v1", "configmaps"] = names.LABEL_COMPONENT


def register(registry: kopf.OperatorRegistry, ctx: OperatorContext) -> None:
    """Register every handler on ``registry`` (one registry per operator instance)."""
    job_labels = {names.LABEL_JOB: kopf.PRESENT}

    @kopf.index("batch", "v1", "jobs", labels=job_labels, registry=registry, id="sw_jobs")
    async def sw_jobs(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
        return {(namespace, labels[names.LABEL_JOB]): job_state(body)}

    @kopf.index(
        "v1", "configmaps", labels={names.LABEL_COMPONENT: names.COMPONENT_PLAN, **job_labels},
        registry=registry, id="sw_plans",
    )  # fmt: skip
    async def sw_plans(
        body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> Any:
        return {(namespace, labels[names.LABEL_JOB]): plan_record(body)}

    @kopf.index(
        "v1", "configmaps", labels={names.LABEL_COMPONENT: names.COMPONENT_COSTMODEL},
        registry=registry, id="sw_models",
    )  # fmt: skip
    async def sw_models(body: kopf.Body, namespace: str | None, **_: Any) -> Any:
        info = model_info(body)
        return {(namespace, info.gpu_type): info} if info is not None else {}

    @kopf.index(
        "v1", "configmaps", labels={names.LABEL_COMPONENT: names.COMPONENT_LIVE, **job_labels},
        registry=registry, id="sw_live",
    )  # fmt: skip
    async def sw_live(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
        return {(namespace, labels[names.LABEL_JOB]): live_record(body)}

    @kopf.index("v1", "services", labels=job_labels, registry=registry, id="sw_services")
    async def sw_services(
        body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> Any:
        return {(namespace, labels[names.LABEL_JOB]): child_ref({**body, "kind": "Service"})}

    @kopf.index("v1", "nodes", registry=registry, id="sw_nodes")
    async def sw_nodes(body: kopf.Body, **_: Any) -> Any:
        return {"nodes": node_info(body, ctx.config.gpu_resource)}

    @kopf.on.event("batch", "v1", "jobs", labels=job_labels, registry=registry)
    @kopf.on.event("v1", "services", labels=job_labels, registry=registry)
    @kopf.on.event(
        "v1", "configmaps", labels={names.LABEL_COMPONENT: names.COMPONENT_PLAN, **job_labels},
        registry=registry,
    )  # fmt: skip
    async def child_changed(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        ctx.wakeups.wake(namespace, labels.get(names.LABEL_JOB))

    @kopf.on.event(
        "v1", "configmaps", labels={names.LABEL_COMPONENT: names.COMPONENT_LIVE, **job_labels},
        registry=registry, id="sw_live_changed",
    )  # fmt: skip
    async def live_changed(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        """Rank 0 wrote a summary: the loop looks at it now, not at the next resync."""
        ctx.wakeups.wake(namespace, labels.get(names.LABEL_JOB))

    @kopf.on.event(
        "v1",
        "configmaps",
        labels={names.LABEL_COMPONENT: names.COMPONENT_COSTMODEL},
        registry=registry,
    )
    async def model_changed(namespace: str | None, **_: Any) -> None:
        ctx.wakeups.wake_namespace(namespace)

    def _holds_gpus(body: kopf.Body, **_: Any) -> bool:
        return bool((body.get("spec") or {}).get("nodeName"))

    @kopf.index("v1", "pods", when=_holds_gpus, registry=registry, id="sw_gpu_pods")
    async def sw_gpu_pods(body: kopf.Body, **_: Any) -> Any:
        held = pod_gpus(body, ctx.config.gpu_resource, names.LABEL_JOB, names.LABEL_COMPONENT)
        return {"pods": held} if held is not None else {}

    @kopf.on.event("v1", "pods", when=_holds_gpus, registry=registry)
    async def gpu_pod_changed(
        body: kopf.Body, namespace: str | None, name: str, type: str, **_: Any
    ) -> None:
        # Another workload taking or freeing GPUs changes every job's capacity.
        held = (
            None
            if type == "DELETED"
            else pod_gpus(body, ctx.config.gpu_resource, names.LABEL_JOB, names.LABEL_COMPONENT)
        )
        if changed(ctx.gpu_pods_seen, f"{namespace}/{name}", held):
            ctx.wakeups.wake_all()

    @kopf.index("v1", "pods", labels=job_labels, registry=registry, id="sw_pods")
    async def sw_pods(body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> Any:
        return {(namespace, labels[names.LABEL_JOB]): pod_state(body)}

    @kopf.on.event("v1", "pods", labels=job_labels, registry=registry)
    async def own_pod_changed(
        body: kopf.Body, namespace: str | None, name: str, type: str, labels: kopf.Labels, **_: Any
    ) -> None:
        # Wake the job when one of its pods starts, stops or gets stuck (not on every
        # status write of a running pod).
        state = None if type == "DELETED" else pod_state(body)
        seen = (state.started, state.problem, state.deleting) if state is not None else None
        if changed(ctx.pods_seen, f"{namespace}/{name}", seen):
            ctx.wakeups.wake(namespace, labels.get(names.LABEL_JOB))

    @kopf.on.event("v1", "nodes", registry=registry)
    async def node_changed(body: kopf.Body, name: str, type: str, **_: Any) -> None:
        summary = node_info(body, ctx.config.gpu_resource)
        if type == "DELETED":
            ctx.nodes_seen.pop(name, None)
        elif ctx.nodes_seen.get(name) == summary:
            return  # a heartbeat: nothing a job cares about changed
        else:
            ctx.nodes_seen[name] = summary
        ctx.wakeups.wake_all()

    if ctx.config.kueue:
        _register_workloads(registry, ctx)

    @kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
    async def job_changed(namespace: str | None, name: str, **_: Any) -> None:
        ctx.wakeups.wake(namespace, name)

    @kopf.daemon(
        names.GROUP, names.VERSION, names.PLURAL, registry=registry,
        cancellation_backoff=5.0, cancellation_timeout=10.0,
    )  # fmt: skip
    async def dlrmjob(
        body: kopf.Body,
        namespace: str | None,
        name: str,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        await run_job(ctx, body, namespace or "", name, Indexes.from_kwargs(kwargs), stopped)


def changed(seen: dict[str, Any], key: str, value: Any) -> bool:
    """Remember what an object showed (``None``: it is gone); whether that differs from
    what was seen before, so that a job is woken by news, not by every status write."""
    if seen.get(key) == value:
        return False
    if value is None:
        seen.pop(key, None)
    else:
        seen[key] = value
    return True


def _register_workloads(registry: kopf.OperatorRegistry, ctx: OperatorContext) -> None:
    """Kueue's Workloads of our queued Jobs, by the Job's uid (why each waits), and
    the queues' GPU quota (what a queued job is sized by)."""
    queued = {names.LABEL_KUEUE_JOB_UID: kopf.PRESENT}
    group, version, plural = names.KUEUE_GROUP, names.KUEUE_VERSION, names.KUEUE_WORKLOADS

    @kopf.index(group, version, plural, labels=queued, registry=registry, id="sw_workloads")
    async def sw_workloads(body: kopf.Body, namespace: str | None, **_: Any) -> Any:
        state = workload_state(body)
        return {(namespace, state.job_uid): state}

    @kopf.on.event(group, version, plural, labels=queued, registry=registry)
    async def workload_changed(
        body: kopf.Body, namespace: str | None, name: str, type: str, **_: Any
    ) -> None:
        # Admitted, evicted or still waiting: the Job's DLRMJob is not named on the
        # Workload, so its namespace's jobs look (only when what they read changed).
        state = None if type == "DELETED" else workload_state(body)
        if changed(ctx.workloads_seen, f"{namespace}/{name}", state):
            ctx.wakeups.wake_namespace(namespace)

    @kopf.index(group, version, "localqueues", registry=registry, id="sw_localqueues")
    async def sw_localqueues(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
        return {(namespace, name): local_queue_info(body)}

    @kopf.index(group, version, "clusterqueues", registry=registry, id="sw_clusterqueues")
    async def sw_clusterqueues(body: kopf.Body, name: str, **_: Any) -> Any:
        return {name: cluster_queue_info(body, ctx.config.gpu_resource)}

    @kopf.on.event(group, version, "localqueues", registry=registry)
    @kopf.on.event(group, version, "clusterqueues", registry=registry)
    async def queue_changed(body: kopf.Body, name: str, type: str, **_: Any) -> None:
        # Quota raised or freed, a queue made or removed: every queued job's size may
        # change (only when what the jobs read changed, not on every status write).
        meta = body.get("metadata") or {}
        key = f"{body.get('kind')}/{meta.get('namespace', '')}/{name}"
        seen: object = None
        if type != "DELETED":
            seen = (
                local_queue_info(body)
                if body.get("kind") == "LocalQueue"
                else cluster_queue_info(body, ctx.config.gpu_resource)
            )
        if changed(ctx.queues_seen, key, seen):
            ctx.wakeups.wake_all()

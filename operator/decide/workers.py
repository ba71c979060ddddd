"""The workers part of :func:`~shardwise.operator.decide.reconcile.decide`, once the plan
exists: the worker Service and the Indexed worker Job on that plan (replaced when the
plan or the template changes, after the old one is gone), their conditions, and the
plans no worker Job mounts any more."""

from __future__ import annotations

import datetime

from shardwise import names
from shardwise.operator.cluster.capacity import Placement
from shardwise.operator.cluster.startup import StartupProblem, pods_of
from shardwise.operator.cluster.summaries import JobState, PlanRecord
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.decide import profiling
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.decide.planning import plan_fields, plan_message
from shardwise.operator.decide.queueing import QUEUED, admission, queue_of
from shardwise.operator.decide.records import Decision, Observed, Ref
from shardwise.operator.render import children as render
from shardwise.operator.render import elastic


def with_plan(
    o: Observed, d: Decision, spec: DLRMJobSpec, placement: Placement, current: PlanRecord
) -> None:
    """The plan exists: run (or keep running) the workers on it."""
    summary = current.summary
    d.fields["plan"] = plan_fields(current)
    model = summary.get("model") or {}
    d.fields["costModel"] = {
        k: v for k, v in model.items() if k not in ("degraded", "degradedReason")
    }
    source = model.get("source", "Bundled")
    d.conditions.append(
        Condition(
            "CostModelReady",
            True,
            "Published" if source == "Published" else "Bundled",
            f"planned with the {source.lower()} cost model {model.get('configMap', '')}".rstrip(),
        )
    )
    if model.get("degraded"):
        reason = str(model.get("degradedReason") or profiling.PROFILING_FAILED)
        d.conditions.append(Condition("Degraded", True, reason, str(model["degraded"])))
    d.conditions.append(Condition("Planned", True, "PlanReady", plan_message(current)))
    if o.service is None:
        d.creates.append(render.worker_service(o.job))
    desired = render.worker_job(
        o.job,
        spec,
        current.ref.name,
        current.plan_hash,
        placement.workers,
        placement.gpu_type,
        o.config,
    )
    wanted_hash = desired["metadata"]["annotations"][names.ANN_TEMPLATE_HASH]
    wj = o.worker_job
    in_use = {current.ref.name}
    # An elastic Job reads its world's plan from the plans ConfigMap: written first.
    ranks = placement.workers * spec.gpus_per_worker
    copies = [elastic.PlanCopy(current.ref.name, ranks)] if elastic.is_elastic(desired) else []
    if o.job.queue and spec.suspend:
        _give_quota_back(d, wj, in_use)
    elif wj is None:
        d.plan_copies += copies
        d.creates.append(desired)
        if o.live is None:
            d.creates.append(render.live_configmap(o.job))
        made = f"created the worker Job {desired['metadata']['name']} ({placement.workers} pods)"
        if o.job.queue:  # suspended in its queue: never Running before Kueue admits it
            made += f" in LocalQueue {o.job.queue}; waiting for Kueue to admit it"
            d.conditions.append(Condition("Admitted", False, QUEUED, made))
        d.conditions.append(
            Condition("WorkersReady", False, QUEUED if o.job.queue else "Starting", made)
        )
    elif wj.ref.deleting:
        in_use.add(wj.ref.annotations.get(names.ANN_PLAN, ""))
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Replacing",
                f"waiting for the previous worker Job {wj.ref.name} to go",
            )
        )
    elif _resizable(wj, wanted_hash, current, placement.workers):
        d.plan_copies += copies
        d.patches.append(
            (
                Ref("batch/v1", "Job", wj.ref.name),
                elastic.resize_patch(placement.workers, current.ref.name),
            )
        )
        was = wj.ref.annotations.get(names.ANN_WORKERS, "?")
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Resizing",
                f"{_replacing_cause(d)}: resizing {wj.ref.name} in place, {was} → "
                f"{placement.workers} workers (Kueue admits it as a workload slice)",
            )
        )
    elif (
        wj.ref.annotations.get(names.ANN_TEMPLATE_HASH) != wanted_hash
        or wj.ref.annotations.get(names.ANN_PLAN) != current.ref.name
    ):
        in_use.add(wj.ref.annotations.get(names.ANN_PLAN, ""))
        d.deletes.append(Ref("batch/v1", "Job", wj.ref.name, wj.ref.uid))
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Replacing",
                f"{_replacing_cause(d)}: replacing {wj.ref.name}",
            )
        )
    else:
        _worker_conditions(o, d, wj, placement.workers)
        if wj.ref.annotations.get(names.ANN_GENERATION) != str(o.job.generation):
            patch = {"metadata": {"annotations": {names.ANN_GENERATION: str(o.job.generation)}}}
            d.patches.append((Ref("batch/v1", "Job", wj.ref.name), patch))
    for plan in o.plans:
        if plan.ref.name not in in_use and not plan.ref.deleting:
            d.deletes.append(Ref("v1", "ConfigMap", plan.ref.name, plan.ref.uid))


def _resizable(wj: JobState, wanted_hash: str, current: PlanRecord, workers: int) -> bool:
    """The running Job takes the new plan by changing its size in place: Kueue takes it
    as elastic, its template is the wanted one, and the plan is for another size (a
    new plan at the same size replaces the Job: its pods hold the old one)."""
    return (
        wj.slices
        and not wj.done
        and wj.ref.annotations.get(names.ANN_TEMPLATE_HASH) == wanted_hash
        and wj.ref.annotations.get(names.ANN_PLAN) != current.ref.name
        and wj.ref.annotations.get(names.ANN_WORKERS) != str(workers)
    )


def _give_quota_back(d: Decision, wj: JobState | None, in_use: set[str]) -> None:
    """A suspended DLRMJob in a Kueue queue: its worker Job is deleted (the workers
    checkpoint as on any stop), since Kueue owns a queued Job's ``spec.suspend``; the
    Job is queued afresh when ``spec.suspend`` is false again."""
    if wj is not None:
        in_use.add(wj.ref.annotations.get(names.ANN_PLAN, ""))
        if not wj.ref.deleting:
            d.deletes.append(Ref("batch/v1", "Job", wj.ref.name, wj.ref.uid))
    d.conditions.append(
        Condition(
            "WorkersReady",
            False,
            "Suspended",
            "spec.suspend is true: the queued worker Job is deleted, giving its quota back",
        )
    )


def _replacing_cause(d: Decision) -> str:
    """Why the worker Job is replaced: the reshard under way says its cause (a node
    added or lost, a worker lost, the measured imbalance), else the job changed."""
    going = next((c for c in d.conditions if c.type == "Resharding" and c.status), None)
    if going is not None:
        return going.message
    return "the plan or the worker template changed"


def _worker_conditions(o: Observed, d: Decision, wj: JobState, workers: int) -> None:
    if queue_of(wj) and not wj.done:
        admitted = admission(wj, o.workload, o.config.kueue)
        d.conditions.append(admitted)
        if not admitted.status:
            d.conditions.append(Condition("WorkersReady", False, admitted.reason, admitted.message))
            return
        admitted_slice = o.workload if wj.slices else None
        if admitted_slice is not None and 0 < admitted_slice.count < workers:
            # grown in place: the larger slice waits for quota, the workers run on
            d.conditions.append(
                Condition(
                    "WorkersReady",
                    False,
                    "Resizing",
                    f"{wj.ref.name} runs on its admitted slice of {admitted_slice.count} "
                    f"workers (Workload {admitted_slice.name}); Kueue has not admitted the "
                    f"slice of {workers} yet",
                )
            )
            return
    if wj.complete:
        msg = f"all {workers} workers of {wj.ref.name} finished"
        d.conditions += [
            Condition("WorkersReady", False, "Succeeded", msg),
            Condition("Complete", True, "WorkersSucceeded", msg),
        ]
    elif wj.failure is not None:
        cause = f"; first failing: {o.worker_failure}" if o.worker_failure else ""
        msg = f"worker Job {wj.ref.name} failed ({wj.failure}){cause}"
        d.conditions += [
            Condition("WorkersReady", False, "WorkersFailed", msg),
            Condition("Failed", True, "WorkersFailed", msg),
        ]
    elif wj.suspended:
        d.conditions.append(
            Condition("WorkersReady", False, "Suspended", f"{wj.ref.name} is suspended")
        )
    elif wj.succeeded and wj.ready < workers:
        # The workers end one by one before the Job controller marks the Job Complete:
        # they are finishing, not starting.
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Finishing",
                f"{wj.succeeded}/{workers} workers finished, {wj.active} active ({wj.ref.name})",
            )
        )
    else:
        ready = wj.ready >= workers
        counts = f"{wj.ready}/{workers} workers ready, {wj.active} active ({wj.ref.name})"
        problem = None if ready else _worker_problem(o, wj, workers)
        if problem is not None:
            d.conditions.append(
                Condition(
                    "WorkersReady",
                    False,
                    problem.condition_reason,
                    f"{counts}; a worker cannot start: "
                    + problem.with_fields(names.COMPONENT_WORKER),
                )
            )
            return
        if wj.failed and not ready:
            d.conditions.append(_workers_lost(o, wj, workers))
            return
        d.conditions.append(
            Condition("WorkersReady", ready, "Running" if ready else "Starting", counts)
        )


def _workers_lost(o: Observed, wj: JobState, workers: int) -> Condition:
    """Worker pods failed while the Job runs on (its controller restarts them): after a
    node is lost, its pods are gone and their peers stop at their bound. Say so, and
    name the lost nodes the job's pods ran on, rather than "Starting"."""
    down = {n.name for n in o.nodes if not n.ready}
    known = {n.name for n in o.nodes}
    nodes = {p.node for p in pods_of(wj, o.pods) if p.node}
    lost = sorted(n for n in nodes if n in down or n not in known)
    where = f" after node {', '.join(lost)} was lost" if lost else ""
    return Condition(
        "WorkersReady",
        False,
        "WorkersLost",
        f"{wj.failed} worker pod(s) of {wj.ref.name} failed{where}; {wj.ready}/{workers} "
        f"ready, {wj.active} active: the Job restarts them",
    )


def _worker_problem(o: Observed, wj: JobState, workers: int) -> StartupProblem | None:
    """The first startup problem among the worker Job's pods (one pod that cannot start
    holds up the rendezvous of all), or its FailedCreate while it has fewer pods than
    workers (the rest were refused: a quota may take some and not all)."""
    mine = pods_of(wj, o.pods)
    problems = [p.problem for p in mine if p.problem is not None]
    if problems:
        far = datetime.datetime.max.replace(tzinfo=datetime.UTC)
        return min(problems, key=lambda x: (x.since or far, x.name))
    return None if len(mine) >= workers else o.failed_creates.get(wj.ref.name)

"""The reconcile decision: from what is observed now to what should change.

:func:`decide` is pure and level-based: it reads the DLRMJob's spec, the cluster (node
summaries, published cost models) and the job's children (profiling Jobs, plan
ConfigMaps, the worker Job and Service), never its own earlier status (one exception:
``status.resharding``, the debounce clock of resharding; see resharding.py), and
returns the objects to create, patch or delete, the planning to run, and the
conditions. The children are the record (a profiling attempt is a Job, a plan is a
ConfigMap named by its hash and annotated with its inputs' hash), so a restarted
operator decides exactly as the one before it did, and creating twice is impossible by
construction.

This module places the workers (with :func:`shardwise.operator.decide.resharding.reshard`
while a reshard is due or under way), then hands over to the profiling part
(:mod:`~shardwise.operator.decide.before_plan`: no plan for the inputs yet) or the
workers part (:mod:`~shardwise.operator.decide.workers`: the plan exists); the
planning part (:mod:`~shardwise.operator.decide.planning`) serves them all. What it
reads and returns is in :mod:`~shardwise.operator.decide.records`.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardwise import names
from shardwise.operator.cluster.capacity import (
    NodeInfo,
    Placement,
    Shortfall,
    choose,
    eligible,
    less_used,
    worker_slots,
)
from shardwise.operator.cluster.lostnodes import stranded_pods
from shardwise.operator.cluster.startup import pods_of
from shardwise.operator.cluster.summaries import PlanRecord
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.decide import imbalance, live_status, planning
from shardwise.operator.decide import resharding as rs
from shardwise.operator.decide.before_plan import before_plan, stop_profiling
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.decide.queueing import admitted_gpus, queue_of, quota_room
from shardwise.operator.decide.records import (
    Decision,
    LivePlanNeeded,
    Observed,
    PlanFailure,
    PlanNeeded,
    Ref,
)
from shardwise.operator.decide.workers import with_plan
from shardwise.operator.models.plan_inputs import PlanInputs

__all__ = ["Decision", "Observed", "PlanFailure", "PlanNeeded", "Ref", "decide"]


def decide(o: Observed) -> Decision:
    """What should change now; see the module docstring."""
    d = Decision()
    d.force_deletes, due = stranded_pods(o.pods, o.nodes, o.now, o.config.lost_pod_seconds)
    if due is not None:
        d.requeue((due - o.now).total_seconds())
    if o.spec is None:
        msg = "; ".join(o.spec_problems)
        d.conditions = [
            Condition("SpecValid", False, "InvalidSpec", msg),
            Condition("Failed", True, "InvalidSpec", msg),
        ]
        return d
    spec, cfg = o.spec, o.config
    d.conditions.append(Condition("SpecValid", True, "Valid", "the spec is valid"))
    if spec.suspend:
        d.conditions.append(
            Condition(
                "Suspended",
                True,
                "Suspended",
                "spec.suspend is true: no workers run and nothing is profiled",
            )
        )
        stop_profiling(o, d, "spec.suspend")
    elif spec.profiling.policy == "Never":
        stop_profiling(o, d, "spec.profiling.policy Never")
    wj = o.worker_job
    # A queued Job's suspend is Kueue's (queueing.py); a suspended job deletes it instead.
    if wj is not None and not wj.ref.deleting and not queue_of(wj) and wj.suspended != spec.suspend:
        d.patches.append((Ref("batch/v1", "Job", wj.ref.name), {"spec": {"suspend": spec.suspend}}))

    nodes = less_used(
        eligible(
            o.nodes,
            spec.template.node_selector,
            spec.template.tolerations,
            spec.planner.device,
            cfg,
            spec.template.pod_overrides.spec.affinity,
        ),
        o.gpu_usage,
    )
    slots = worker_slots(nodes, spec.gpus_per_worker, spec.planner.device, cfg)
    room, infeasible = quota_room(
        o.quota,
        admitted_gpus(wj, spec.gpus_per_worker, o.workload),
        spec.gpus_per_worker,
        spec.workers.min,
    )
    if infeasible is not None:
        failed = Condition("Failed", True, infeasible.reason, infeasible.message)
        d.conditions += [infeasible, failed]
        return d
    if room is not None:  # a Kueue queue's GPU quota bounds the job as nodes do
        slots = {kind: min(n, room) for kind, n in slots.items()}
    pinned = (
        wj is not None
        and not wj.ref.deleting
        and wj.ref.annotations.get(names.ANN_GENERATION) == str(o.job.generation)
        and names.LABEL_GPU_TYPE in wj.ref.labels
    )
    reshard = rs.Outcome()
    if spec.resharding.enabled:
        reshard = rs.reshard(_situation(o, spec, nodes, slots, pinned, room))
        _take(o, d, reshard)
    placement: Placement | Shortfall
    if reshard.placement is not None:
        placement = reshard.placement
    elif pinned:
        assert wj is not None  # a running job keeps its placement until the spec changes
        placement = Placement(
            wj.ref.labels[names.LABEL_GPU_TYPE], int(wj.ref.annotations.get(names.ANN_WORKERS, "1"))
        )
    else:
        placement = choose(slots, spec.workers.min, spec.workers.max, spec.gpus_per_worker)
    if isinstance(placement, Shortfall):
        d.conditions.append(Condition("Capacity", False, "InsufficientCapacity", placement.message))
        if spec.resharding.enabled and all(x.type != "WaitingForCapacity" for x in d.conditions):
            d.conditions.append(
                Condition("WaitingForCapacity", True, "InsufficientCapacity", placement.message)
            )
        return d
    d.conditions.append(
        Condition(
            "Capacity",
            True,
            "Placed",
            f"{placement.workers} worker(s) x {spec.gpus_per_worker} GPU(s) "
            f"on {placement.gpu_type}",
        )
    )
    d.fields["workers"] = placement.workers
    d.fields["worldSize"] = placement.workers * spec.gpus_per_worker

    memory = planning.memory(o, spec, nodes, placement.gpu_type)
    if memory is None:
        msg = (
            f"spec.planner.gpuMemory is not set and no eligible {placement.gpu_type} node has "
            f"the {cfg.gpu_memory_label} label; set spec.planner.gpuMemory (e.g. 80Gi)"
        )
        d.conditions += [
            Condition("Planned", False, "NoGPUMemory", msg),
            Condition("Failed", True, "NoGPUMemory", msg),
        ]
        return d
    inputs = planning.plan_inputs(spec, placement, memory)
    current = _closed_loop(o, d, spec, inputs) or planning.plan_for(o, inputs.hash())
    if current is not None:
        with_plan(o, d, spec, placement, current)
    elif spec.suspend:  # nothing is profiled or planned: only what failed is said
        planning.report_failure(o, d, inputs)
    else:
        before_plan(o, d, spec, nodes, placement, inputs)
    done = rs.finished(reshard.record, o.worker_job, d.creates, o.now)
    if done is not None:
        assert done.record is not None
        d.fields["resharding"] = done.record.to_status()
        d.conditions = [x for x in d.conditions if x.type != "Resharding"]
        d.conditions += done.conditions
        d.resharded = done.finished
    return d


def _closed_loop(
    o: Observed, d: Decision, spec: DLRMJobSpec, inputs: PlanInputs
) -> PlanRecord | None:
    """Run the closed loop (:mod:`~shardwise.operator.decide.imbalance`); the live re-plan the
    workers should run instead of the declared plan, when the loop adopted one."""
    record = live_status.LoopRecord.from_status(o.imbalance_loop)
    wj = o.worker_job
    mounted = wj.ref.annotations.get(names.ANN_PLAN, "") if wj is not None else ""
    running = next((p for p in o.plans if p.ref.name == mounted), None)
    target = record.live_plan if record is not None else ""
    failure = o.plan_failures.get(target) if target else None
    out = imbalance.step(
        imbalance.LoopInput(
            settings=spec.resharding.on_imbalance,
            record=record,
            live=o.live.summary if o.live is not None else None,
            live_problem=o.live.problem if o.live is not None else None,
            worker=wj,
            running=running,
            base_inputs=inputs.hash(),
            live_plan=planning.plan_for(o, target) if target else None,
            live_plan_failure=(failure.reason, failure.message) if failure is not None else None,
            pods=[p.name for p in pods_of(wj, o.pods)] if wj is not None else [],
            generation=o.job.generation,
            now=o.now,
            checkpoints=bool(spec.template.checkpoint_dir),
        )
    )
    if out.record is not None:
        d.fields["imbalanceLoop"] = out.record.to_status()
    if out.live_fields:
        d.fields["live"] = dict(out.live_fields)
    add_loop_conditions(o, d, out)
    if out.requeue_after is not None:
        d.requeue(out.requeue_after)
    if out.replan is not None:
        d.live_plan = LivePlanNeeded(out.replan, inputs)
    moved = out.record is not None and (
        record is None or (out.record.state, out.record.message) != (record.state, record.message)
    )
    if out.decision is not None and moved:  # counted once, not on every pass
        d.loop_decision = (out.decision, out.gain)
    return planning.plan_for(o, out.use_plan) if out.use_plan else None


def add_loop_conditions(o: Observed, d: Decision, out: imbalance.LoopOutcome) -> None:
    """Add the loop's conditions; of two ``Resharding`` conditions (a node reshard's and
    the loop's), the one under way, else the later reshard's ending, is kept."""
    node = next((c for c in d.conditions if c.type == "Resharding"), None)
    loop = next((c for c in out.conditions if c.type == "Resharding"), None)
    if node is not None and loop is not None:
        rec = rs.Record.from_status(d.fields.get("resharding", o.resharding))
        node_at = rec.started_at if rec is not None else None
        loop_at = out.record.started_at if out.record is not None else None
        later = loop_at is not None and (node_at is None or loop_at > node_at)
        if node.status or (not loop.status and not later):
            loop = None
        else:
            d.conditions.remove(node)
    d.conditions += [c for c in out.conditions if c.type != "Resharding" or c is loop]


def _situation(
    o: Observed,
    spec: DLRMJobSpec,
    nodes: Sequence[NodeInfo],
    slots: dict[str, int],
    pinned: bool,
    quota_workers: int | None,
) -> rs.Situation:
    return rs.Situation(
        record=rs.Record.from_status(o.resharding),
        worker=o.worker_job,
        pinned=pinned,
        slots=slots,
        nodes=o.nodes,
        workers_min=spec.workers.min,
        workers_max=spec.workers.max,
        gpus_per_worker=spec.gpus_per_worker,
        device=spec.planner.device,
        debounce_seconds=spec.resharding.debounce_seconds,
        suspend=spec.suspend,
        now=o.now,
        plan_for=planning.candidates(o, spec, nodes),
        running_seconds=planning.running_seconds(o),
        gpu_usage=o.gpu_usage,
        config=o.config,
        quota_workers=quota_workers,
    )


def _take(o: Observed, d: Decision, out: rs.Outcome) -> None:
    """Record what :func:`~shardwise.operator.decide.resharding.reshard` decided."""
    if out.record is not None:
        d.fields["resharding"] = out.record.to_status()
    d.conditions += out.conditions
    d.deletes += [Ref("batch/v1", "Job", r.name, r.uid) for r in out.deletes]
    if out.requeue_after is not None:
        d.requeue(out.requeue_after)
    if out.plan is not None:
        d.plan = PlanNeeded(out.plan, o.models.get(out.plan.gpu_type), None)

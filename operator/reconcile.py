"""The reconcile decision: from what is observed now to what should change.

:func:`decide` is pure and level-based: it reads the DLRMJob's spec, the cluster (node
summaries, published cost models) and the job's children (profiling Jobs, plan
ConfigMaps, the worker Job and Service), never its own earlier status (one exception:
``status.resharding``, the debounce clock of issue 8; see resharding.py), and returns
the objects to create, patch or delete, the planning to run, and the conditions. The
children are the record (a profiling attempt is a Job, a plan is a ConfigMap named by
its hash and annotated with its inputs' hash), so a restarted operator decides exactly
as the one before it did, and creating twice is impossible by construction.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.operator import constants as c
from shardwise.operator import profiling, render
from shardwise.operator import resharding as rs
from shardwise.operator.capacity import (
    NodeInfo,
    Placement,
    Shortfall,
    choose,
    eligible,
    gpu_memory_bytes,
    gpu_type,
    less_used,
    worker_slots,
)
from shardwise.operator.config import OperatorConfig
from shardwise.operator.costmodels import CostModelInfo
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.lifecycle import Condition
from shardwise.operator.lostnodes import Stranded, stranded_pods
from shardwise.operator.observe import (
    ChildRef,
    JobState,
    PlanRecord,
    PodFailure,
    failure_mark,
    format_time,
)
from shardwise.operator.planning import PlanInputs
from shardwise.operator.render import JobMeta
from shardwise.operator.startup import PodState, StartupProblem, job_startup, pods_of


@dataclass(frozen=True)
class PlanFailure:
    """Planning for an inputs hash failed; ``retry_at`` None means until the inputs change."""

    reason: str
    message: str
    retry_at: datetime.datetime | None = None


@dataclass(frozen=True)
class Observed:
    job: JobMeta
    spec: DLRMJobSpec | None
    spec_problems: Sequence[str]
    nodes: Sequence[NodeInfo]
    models: Mapping[str, CostModelInfo]
    profiling_jobs: Sequence[JobState]
    plans: Sequence[PlanRecord]
    worker_job: JobState | None
    service: ChildRef | None
    now: datetime.datetime
    config: OperatorConfig = field(default_factory=OperatorConfig)
    plan_failures: Mapping[str, PlanFailure] = field(default_factory=dict)
    worker_failure: str | None = None
    #: The first failing pod of each failed profiling attempt, by Job name.
    profiling_pod_failures: Mapping[str, PodFailure] = field(default_factory=dict)
    #: This job's pods (the ``sw_pods`` index): how far each Job's pods got.
    pods: Sequence[PodState] = ()
    #: ``FailedCreate`` Events of the Jobs without pods, by Job name.
    failed_creates: Mapping[str, StartupProblem] = field(default_factory=dict)
    #: ``status.resharding`` as last written: the one earlier state decide reads (the
    #: debounce clock and a reshard under way must survive a restart; see resharding.py).
    resharding: Mapping[str, Any] | None = None
    #: GPUs per node that other pods hold (not this job's own workers).
    gpu_usage: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanNeeded:
    inputs: PlanInputs
    #: The model to plan with; ``None`` means the bundled one.
    model: CostModelInfo | None
    #: Why the model is second best, recorded with the plan.
    degraded: str | None
    #: The Degraded condition's reason that goes with ``degraded``.
    degraded_reason: str = profiling.PROFILING_FAILED


@dataclass(frozen=True)
class Ref:
    api_version: str
    kind: str
    name: str
    uid: str = ""


@dataclass
class Decision:
    creates: list[dict[str, Any]] = field(default_factory=list)
    patches: list[tuple[Ref, dict[str, Any]]] = field(default_factory=list)
    deletes: list[Ref] = field(default_factory=list)
    plan: PlanNeeded | None = None
    conditions: list[Condition] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None
    #: A reshard that finished in this pass (the new worker Job is created): for metrics.
    resharded: rs.Record | None = None
    #: Profiling attempts deleted in this pass, and why (for the log).
    stopped: list[str] = field(default_factory=list)
    #: Terminating pods on lost nodes, to delete at once (see lostnodes.py).
    force_deletes: list[Stranded] = field(default_factory=list)

    def requeue(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.requeue_after = (
            seconds if self.requeue_after is None else min(self.requeue_after, seconds)
        )


_READY_REASON = {
    profiling.State.FRESH: "Fresh",
    profiling.State.SUCCEEDED: "Profiled",
    profiling.State.SKIPPED: "PolicyNever",
}


def _ready_reason(d: profiling.Decision) -> str:
    return d.fallback_reason if d.state is profiling.State.FAILED else _READY_REASON[d.state]


def _waiting_reason(d: profiling.Decision) -> str:
    if d.blocked is not None:
        return d.blocked.condition_reason
    if d.state is profiling.State.WAITING and d.next_attempt_at and "failed" in d.message:
        return "ProfilingAttemptFailed"
    if d.state is profiling.State.WAITING and "succeeded" in d.message:
        return "WaitingForModel"
    return "Profiling"


def _stop_profiling(o: Observed, d: Decision, why: str) -> None:
    """Delete the attempts still running: nothing is profiled while suspended or under
    policy Never, and an attempt left to its deadline would hold its GPUs for hours."""
    for j in o.profiling_jobs:
        if not j.done and not j.ref.deleting:
            d.deletes.append(Ref("batch/v1", "Job", j.ref.name, j.ref.uid))
            d.stopped.append(f"{j.ref.name} ({why})")


def _mark(mark: profiling.Mark, now: datetime.datetime) -> tuple[Ref, dict[str, Any]]:
    patch: dict[str, Any] = {
        "metadata": {"annotations": {c.ANN_FAILURE: failure_mark(mark.reason, mark.message, now)}}
    }
    if mark.suspend:
        patch["spec"] = {"suspend": True}
    return Ref("batch/v1", "Job", mark.job), patch


def _model_status(
    gpu: str, model: CostModelInfo | None, now: datetime.datetime, max_age: float
) -> dict[str, Any]:
    if model is None:
        return {"gpuType": gpu, "source": "Bundled"}
    out: dict[str, Any] = {
        "gpuType": gpu,
        "source": "Published",
        "configMap": model.payload,
        "fingerprint": model.fingerprint,
        "stale": not model.is_fresh(now, max_age),
    }
    if model.published_at:
        out["publishedAt"] = format_time(model.published_at)
    return out


def plan_inputs(spec: DLRMJobSpec, placement: Placement, memory: int) -> PlanInputs:
    tables: Any
    if spec.tables.inline is not None:
        tables = [t.model_dump(mode="json", by_alias=True) for t in spec.tables.inline]
    else:
        assert spec.tables.config_map_ref is not None
        tables = {"configMapRef": spec.tables.config_map_ref.model_dump(by_alias=True)}
    return PlanInputs(
        tables=tables,
        planner=spec.planner.algorithm,
        seed=spec.planner.options.seed,
        gpu_type=placement.gpu_type,
        workers=placement.workers,
        gpus_per_worker=spec.gpus_per_worker,
        gpu_memory_bytes=memory,
        memory_reserve=spec.planner.memory_reserve,
        batch_size_per_rank=spec.planner.batch_size_per_rank,
        device=spec.planner.device,
    )


def _plan_fields(plan: PlanRecord) -> dict[str, Any]:
    s = plan.summary
    out: dict[str, Any] = {
        "configMap": plan.ref.name,
        "hash": plan.plan_hash,
        "planner": s.get("planner", ""),
        "tables": int(s.get("tables", 0)),
        "inputsHash": plan.inputs_hash,
    }
    for key in ("predictedMaxSeconds", "imbalance", "planningSeconds"):
        if isinstance(s.get(key), int | float):
            out[key] = float(s[key])
    # Rounded copies for `kubectl get`'s columns, which print numbers unrounded.
    if "predictedMaxSeconds" in out:
        out["predictedMaxMilliseconds"] = float(f"{1e3 * out['predictedMaxSeconds']:.3g}")
    if "imbalance" in out:
        out["imbalancePercent"] = f"{100 * out['imbalance']:.1f}%"
    return out


def _plan_message(plan: PlanRecord) -> str:
    s = plan.summary
    cost = s.get("predictedMaxSeconds")
    priced = (
        f", predicted max {1e3 * cost:.2f} ms/iter, imbalance {s.get('imbalance', 0):.3f}"
        if isinstance(cost, int | float)
        else ""
    )
    return (
        f"plan {plan.ref.name}: {s.get('tables')} tables on {s.get('worldSize')} GPUs by "
        f"{s.get('planner')}{priced}"
    )


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
        _stop_profiling(o, d, "spec.suspend")
    elif spec.profiling.policy == "Never":
        _stop_profiling(o, d, "spec.profiling.policy Never")
    wj = o.worker_job
    if wj is not None and not wj.ref.deleting and wj.suspended != spec.suspend:
        d.patches.append((Ref("batch/v1", "Job", wj.ref.name), {"spec": {"suspend": spec.suspend}}))

    nodes = less_used(
        eligible(
            o.nodes,
            spec.template.node_selector,
            spec.template.tolerations,
            spec.planner.device,
            cfg,
        ),
        o.gpu_usage,
    )
    placement: Placement | Shortfall
    pinned = (
        wj is not None
        and not wj.ref.deleting
        and wj.ref.annotations.get(c.ANN_GENERATION) == str(o.job.generation)
        and c.LABEL_GPU_TYPE in wj.ref.labels
    )
    override = _resharding(o, d, spec, nodes, pinned) if spec.resharding.enabled else None
    if override is not None:
        placement = override
    elif pinned:
        assert wj is not None  # a running job keeps its placement until the spec changes
        placement = Placement(
            wj.ref.labels[c.LABEL_GPU_TYPE], int(wj.ref.annotations.get(c.ANN_WORKERS, "1"))
        )
    else:
        slots = worker_slots(nodes, spec.gpus_per_worker, spec.planner.device, cfg)
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

    memory = spec.planner.gpu_memory_bytes() or gpu_memory_bytes(
        nodes, placement.gpu_type, spec.planner.device, cfg
    )
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
    inputs = plan_inputs(spec, placement, memory)
    ih = inputs.hash()
    current = next((p for p in o.plans if p.inputs_hash == ih and not p.ref.deleting), None)
    if current is None:
        _before_plan(o, d, spec, nodes, placement, inputs)
    else:
        _with_plan(o, d, spec, placement, current)
    _reshard_finished(o, d)
    return d


def _memory(o: Observed, spec: DLRMJobSpec, nodes: Sequence[NodeInfo], kind: str) -> int | None:
    return spec.planner.gpu_memory_bytes() or gpu_memory_bytes(
        nodes, kind, spec.planner.device, o.config
    )


def _reshard_to(d: Decision, rec: rs.Record) -> Placement:
    d.fields["resharding"] = rec.to_status()
    d.conditions.append(Condition("Resharding", True, rec.reason, f"resharding {rec.describe()}"))
    return Placement(rec.gpu_type, rec.to_workers)


def _wait_for_capacity(o: Observed, d: Decision, rec: rs.Record, message: str) -> Shortfall:
    """Below workers.min: stop the workers (they checkpoint) and wait, woken by nodes."""
    wj = o.worker_job
    if wj is not None and not wj.ref.deleting:
        d.deletes.append(Ref("batch/v1", "Job", wj.ref.name, wj.ref.uid))
    d.fields["resharding"] = rec.to_status()
    d.conditions.append(Condition("WaitingForCapacity", True, rec.reason, message))
    return Shortfall(message)


def _resharding(
    o: Observed, d: Decision, spec: DLRMJobSpec, nodes: Sequence[NodeInfo], pinned: bool
) -> Placement | Shortfall | None:
    """The placement while a reshard is due or under way; ``None``: place as usual.
    The rules are in :mod:`shardwise.operator.resharding`."""
    cfg, wj, now = o.config, o.worker_job, o.now
    prev = rs.Record.from_status(o.resharding)
    device, lo, hi = spec.planner.device, spec.workers.min, spec.workers.max
    slots = worker_slots(nodes, spec.gpus_per_worker, device, cfg)
    if prev is not None and prev.state == rs.STARTED:
        if prev.to_workers == 0:
            again = choose(slots, lo, hi, spec.gpus_per_worker)
            if isinstance(again, Shortfall):
                return _wait_for_capacity(o, d, prev, again.message)
            prev = dataclasses.replace(
                prev, to_workers=again.workers, gpu_type=again.gpu_type,
                reason=rs.CAPACITY_RETURNED,
            )  # fmt: skip
        return _reshard_to(d, prev)
    if not pinned or wj is None or wj.complete or spec.suspend:
        if prev is not None and prev.last_at is not None:
            d.fields["resharding"] = rs.Record(rs.DONE, last_at=prev.last_at).to_status()
        return None
    kind = wj.ref.labels[c.LABEL_GPU_TYPE]
    current = int(wj.ref.annotations.get(c.ANN_WORKERS, "1"))
    to = rs.target(slots.get(kind, 0), lo, hi)
    reason = rs.why(current, to, o.nodes, kind, device, cfg, o.gpu_usage)
    if wj.failure is not None:
        if to >= current:
            return None  # a failure with the capacity intact: the job fails
        last = prev.last_at if prev is not None else None
        lost = rs.Record(rs.STARTED, current, to, rs.WORKER_LOST, kind, now, now, last)
        if to == 0:
            return _wait_for_capacity(o, d, lost, f"{lost.describe()}; waiting for capacity")
        return _reshard_to(d, lost)
    rec = rs.pending(prev, current, to, reason, now)
    if rec is None:
        return None
    if rec.state == rs.DONE:
        d.fields["resharding"] = rec.to_status()
        if rec.to_workers:
            d.conditions.append(
                Condition("Resharding", False, "Resharded", f"resharded {rec.describe()}")
            )
        return None
    rec = dataclasses.replace(rec, gpu_type=kind)
    d.fields["resharding"] = rec.to_status()
    if rec.state == rs.DECLINED:
        d.conditions.append(Condition("Resharding", False, "NoGain", rec.message))
        return None
    due = rs.due_at(rec, spec.resharding.debounce_seconds)
    if now < due:
        d.requeue((due - now).total_seconds())
        return None
    if to == 0:
        rec = rs.start(rec, now)
        return _wait_for_capacity(o, d, rec, f"{rec.describe()}; waiting for capacity")
    if to < current:
        return _reshard_to(d, rs.start(rec, now))
    return _scale_up(o, d, spec, nodes, rec, current)


def _scale_up(
    o: Observed,
    d: Decision,
    spec: DLRMJobSpec,
    nodes: Sequence[NodeInfo],
    rec: rs.Record,
    current: int,
) -> Placement | None:
    """Plan for the larger size first (the workers keep running), then reshard only if
    the plan is predicted to gain; otherwise decline until the target changes."""
    memory = _memory(o, spec, nodes, rec.gpu_type)
    if memory is None:
        return None  # decide reports NoGPUMemory
    candidate = plan_inputs(spec, Placement(rec.gpu_type, rec.to_workers), memory)
    ih = candidate.hash()
    plan = next((p for p in o.plans if p.inputs_hash == ih and not p.ref.deleting), None)
    if plan is None:
        failure = o.plan_failures.get(ih)
        if failure is not None:
            declined = dataclasses.replace(
                rec, state=rs.DECLINED, message=f"no plan for {rec.to_workers}: {failure.message}"
            )
            d.fields["resharding"] = declined.to_status()
            d.conditions.append(Condition("Resharding", False, "NoGain", declined.message))
            return None
        d.plan = PlanNeeded(candidate, o.models.get(rec.gpu_type), None)
        return None
    wj = o.worker_job
    running = wj.ref.annotations.get(c.ANN_PLAN, "") if wj is not None else ""
    before = next((p for p in o.plans if p.ref.name == running), None)

    def seconds(p: PlanRecord | None) -> float | None:
        v = p.summary.get("predictedMaxSeconds") if p is not None else None
        return float(v) if isinstance(v, int | float) else None

    g = rs.gain(current, seconds(before), rec.to_workers, seconds(plan))
    if g < rs.MIN_GAIN:
        msg = (
            f"{rec.to_workers} worker(s) would gain {100 * g:.1f} % throughput "
            f"(< {100 * rs.MIN_GAIN:.0f} %): staying at {current}"
        )
        declined = dataclasses.replace(rec, state=rs.DECLINED, message=msg)
        d.fields["resharding"] = declined.to_status()
        d.conditions.append(Condition("Resharding", False, "NoGain", msg))
        return None
    return _reshard_to(d, rs.start(rec, o.now))


def _reshard_finished(o: Observed, d: Decision) -> None:
    """A started reshard is done once the worker Job at the new size is created (this
    pass) or seen (after a restart between the create and the status write)."""
    rec = rs.Record.from_status(d.fields.get("resharding"))
    if rec is None or rec.state != rs.STARTED or rec.to_workers == 0:
        return
    created = any(
        b.get("kind") == "Job"
        and b["metadata"]["labels"].get(c.LABEL_COMPONENT) == c.COMPONENT_WORKER
        and b["metadata"]["annotations"].get(c.ANN_WORKERS) == str(rec.to_workers)
        for b in d.creates
    )
    wj = o.worker_job
    seen = (
        wj is not None
        and not wj.ref.deleting
        and wj.failure is None
        and wj.ref.annotations.get(c.ANN_WORKERS) == str(rec.to_workers)
        and wj.ref.labels.get(c.LABEL_GPU_TYPE) == rec.gpu_type
    )
    if not (created or seen):
        return
    done = rs.finish(rec, o.now)
    d.fields["resharding"] = done.to_status()
    d.conditions = [x for x in d.conditions if x.type != "Resharding"]
    d.conditions.append(Condition("Resharding", False, "Resharded", f"resharded {rec.describe()}"))
    if created:
        d.resharded = rec


def _before_plan(
    o: Observed,
    d: Decision,
    spec: DLRMJobSpec,
    nodes: Sequence[NodeInfo],
    placement: Placement,
    inputs: PlanInputs,
) -> None:
    """No plan for these inputs yet: profile what is stale, then plan."""
    failure = o.plan_failures.get(inputs.hash())
    if failure is not None and (failure.retry_at is None or o.now < failure.retry_at):
        d.conditions.append(Condition("Planned", False, failure.reason, failure.message))
        if failure.retry_at is None:
            d.conditions.append(Condition("Failed", True, failure.reason, failure.message))
        else:
            d.requeue((failure.retry_at - o.now).total_seconds())
        return
    if spec.suspend:
        return
    device = spec.planner.device
    types = sorted(
        {t for t in (gpu_type(n, device, o.config) for n in nodes) if t} | {placement.gpu_type}
    )
    decisions = {}
    for t in types:
        jobs = [j for j in o.profiling_jobs if j.ref.labels.get(c.LABEL_GPU_TYPE) == t]
        pd = profiling.decide(
            t,
            spec.profiling,
            o.models.get(t),
            jobs,
            o.now,
            publish_grace_seconds=o.config.publish_grace_seconds,
            pod_failures=o.profiling_pod_failures,
            startup={
                j.ref.name: job_startup(j, o.pods, o.failed_creates.get(j.ref.name))
                for j in jobs
                if not j.done
            },
            settings_hash=render.profiling_settings_hash(o.job, spec, t, o.config),
        )
        decisions[t] = pd
        d.patches += [_mark(m, o.now) for m in pd.marks]
        if pd.create is not None:
            d.creates.append(render.profiling_job(o.job, spec, t, pd.create, o.config))
        for at in (pd.next_attempt_at, pd.check_at):
            if at is not None:
                d.requeue((at - o.now).total_seconds())
    d.fields["profiling"] = [
        pd.status() for pd in decisions.values() if spec.profiling.policy != "Never"
    ]
    chosen = decisions[placement.gpu_type]
    d.fields["costModel"] = _model_status(
        chosen.gpu_type, chosen.model, o.now, spec.profiling.max_age_seconds
    )
    if chosen.degraded:
        d.conditions.append(Condition("Degraded", True, chosen.fallback_reason, chosen.degraded))
    if not chosen.ready:
        d.conditions.append(
            Condition("CostModelReady", False, _waiting_reason(chosen), chosen.message)
        )
        return
    d.conditions.append(Condition("CostModelReady", True, _ready_reason(chosen), chosen.message))
    n = len(spec.tables.inline) if spec.tables.inline is not None else "the referenced"
    model = chosen.model.describe() if chosen.model else "the bundled CPU model"
    d.conditions.append(
        Condition(
            "Planned",
            False,
            "Planning",
            f"planning {n} tables for {inputs.world_size} GPUs with {inputs.planner} ({model})",
        )
    )
    d.plan = PlanNeeded(inputs, chosen.model, chosen.degraded, chosen.fallback_reason)


def _with_plan(
    o: Observed, d: Decision, spec: DLRMJobSpec, placement: Placement, current: PlanRecord
) -> None:
    """The plan exists: run (or keep running) the workers on it."""
    summary = current.summary
    d.fields["plan"] = _plan_fields(current)
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
    d.conditions.append(Condition("Planned", True, "PlanReady", _plan_message(current)))
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
    wanted_hash = desired["metadata"]["annotations"][c.ANN_TEMPLATE_HASH]
    wj = o.worker_job
    in_use = {current.ref.name}
    if wj is None:
        d.creates.append(desired)
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Starting",
                f"created the worker Job {desired['metadata']['name']} ({placement.workers} pods)",
            )
        )
    elif wj.ref.deleting:
        in_use.add(wj.ref.annotations.get(c.ANN_PLAN, ""))
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Replacing",
                f"waiting for the previous worker Job {wj.ref.name} to go",
            )
        )
    elif wj.ref.annotations.get(c.ANN_TEMPLATE_HASH) != wanted_hash:
        in_use.add(wj.ref.annotations.get(c.ANN_PLAN, ""))
        d.deletes.append(Ref("batch/v1", "Job", wj.ref.name, wj.ref.uid))
        d.conditions.append(
            Condition(
                "WorkersReady",
                False,
                "Replacing",
                f"the plan or the worker template changed: replacing {wj.ref.name}",
            )
        )
    else:
        _worker_conditions(o, d, wj, placement.workers)
        if wj.ref.annotations.get(c.ANN_GENERATION) != str(o.job.generation):
            patch = {"metadata": {"annotations": {c.ANN_GENERATION: str(o.job.generation)}}}
            d.patches.append((Ref("batch/v1", "Job", wj.ref.name), patch))
    for plan in o.plans:
        if plan.ref.name not in in_use and not plan.ref.deleting:
            d.deletes.append(Ref("v1", "ConfigMap", plan.ref.name, plan.ref.uid))


def _worker_conditions(o: Observed, d: Decision, wj: JobState, workers: int) -> None:
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
    else:
        ready = wj.ready >= workers
        counts = f"{wj.ready}/{workers} workers ready, {wj.active} active ({wj.ref.name})"
        problem = None if ready else _worker_problem(o, wj)
        if problem is not None:
            d.conditions.append(
                Condition(
                    "WorkersReady",
                    False,
                    problem.condition_reason,
                    f"{counts}; a worker cannot start: {problem.describe()}",
                )
            )
            return
        d.conditions.append(
            Condition("WorkersReady", ready, "Running" if ready else "Starting", counts)
        )


def _worker_problem(o: Observed, wj: JobState) -> StartupProblem | None:
    """The first startup problem among the worker Job's pods (one pod that cannot start
    holds up the rendezvous of all), or its FailedCreate while it has no pod."""
    mine = pods_of(wj, o.pods)
    problems = [p.problem for p in mine if p.problem is not None]
    if problems:
        far = datetime.datetime.max.replace(tzinfo=datetime.UTC)
        return min(problems, key=lambda x: (x.since or far, x.name))
    return None if mine else o.failed_creates.get(wj.ref.name)

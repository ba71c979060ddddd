"""The profiling part of :func:`~shardwise.operator.decide.reconcile.decide`, before there is a
plan: profile the GPU types whose published model is stale or does not cover the job's
tables (through :func:`shardwise.operator.decide.profiling.decide`, one GPU type at a time; a
profiling pod calibrates on the job's tables and batch), choose the cost model for the
placement, and ask for the plan once it is ready; and stop the attempts still running
when nothing may be profiled."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from shardwise import names
from shardwise.operator.cluster.capacity import NodeInfo, Placement, gpu_type
from shardwise.operator.cluster.startup import job_startup
from shardwise.operator.cluster.summaries import failure_mark, format_time
from shardwise.operator.crd import DLRMJobSpec, inline_tables
from shardwise.operator.decide import planning, profiling
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.decide.records import Decision, Observed, PlanNeeded, Ref
from shardwise.operator.models.cost_models import CostModelInfo
from shardwise.operator.models.jobtables import JobTables
from shardwise.operator.models.plan_inputs import PlanInputs
from shardwise.operator.render import children as render

_READY_REASON = {
    profiling.State.FRESH: "Fresh",
    profiling.State.SUCCEEDED: "Profiled",
    profiling.State.SKIPPED: "PolicyNever",
}


def _ready_reason(d: profiling.Decision) -> str:
    return d.fallback_reason if d.state is profiling.State.FAILED else _READY_REASON[d.state]


def waiting_reason(d: profiling.Decision) -> str:
    """``CostModelReady``'s reason while the model is not ready."""
    if d.blocked is not None:
        return d.blocked.condition_reason
    if d.retry or (
        d.state is profiling.State.WAITING and d.next_attempt_at and "failed" in d.message
    ):
        return "ProfilingAttemptFailed"
    if d.state is profiling.State.WAITING and "succeeded" in d.message:
        return "WaitingForModel"
    return "Profiling"


def stop_profiling(o: Observed, d: Decision, why: str) -> None:
    """Delete the attempts still running: nothing is profiled while suspended or under
    policy Never, and an attempt left to its deadline would hold its GPUs for hours."""
    for j in o.profiling_jobs:
        if not j.done and not j.ref.deleting:
            d.deletes.append(Ref("batch/v1", "Job", j.ref.name, j.ref.uid))
            d.stopped.append(f"{j.ref.name} ({why})")


def _mark(mark: profiling.Mark, now: datetime.datetime) -> tuple[Ref, dict[str, Any]]:
    patch: dict[str, Any] = {
        "metadata": {
            "annotations": {names.ANN_FAILURE: failure_mark(mark.reason, mark.message, now)}
        }
    }
    if mark.suspend:
        patch["spec"] = {"suspend": True}
    return Ref("batch/v1", "Job", mark.job), patch


def _model_status(
    gpu: str,
    model: CostModelInfo | None,
    now: datetime.datetime,
    max_age: float,
    signatures: Sequence[str] | None,
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
    if model.calibration is not None and signatures is not None:
        cover = profiling.coverage(model, signatures)
        out["calibration"] = model.calibration.status(cover.covered, cover.of)
    return out


def _tables(o: Observed, spec: DLRMJobSpec) -> JobTables:
    """The tables as observed (the referenced ConfigMap is read whatever the policy);
    inline ones need no read (the pure tests give none)."""
    if o.tables is not None:
        return o.tables
    if spec.tables.inline is not None:
        return JobTables.of(inline_tables(spec))
    return JobTables.unreadable(
        "TablesNotFound", "spec.tables.configMapRef: the ConfigMap has not been read yet"
    )


def _unreadable_tables(o: Observed, d: Decision, tables: JobTables) -> None:
    """Nothing to profile on: say why (as planning would) and look again later."""
    assert tables.problem is not None
    d.conditions.append(Condition("Planned", False, tables.reason, tables.problem))
    d.attempts["Planned"] = max(tables.attempts, 1)
    d.requeue(o.config.tables_retry_after(tables.attempts))


def before_plan(
    o: Observed,
    d: Decision,
    spec: DLRMJobSpec,
    nodes: Sequence[NodeInfo],
    placement: Placement,
    inputs: PlanInputs,
) -> None:
    """No plan for these inputs yet: profile what is stale or does not cover the
    tables, then plan.

    The tables come first, whatever the policy: nothing is said about a cost model or
    a planning for tables no one could read. While a planning that failed is not due
    again, the cost model is still stated as it stands (a condition announced once
    stays in the status, so the retry announces nothing again), nothing is profiled,
    and the failure is said instead of planning."""
    device = spec.planner.device
    types = sorted(
        {t for t in (gpu_type(n, device, o.config) for n in nodes) if t} | {placement.gpu_type}
    )
    profiles = spec.profiling.policy != "Never"
    tables = _tables(o, spec)
    if tables.problem is not None:
        _unreadable_tables(o, d, tables)
        return
    failure = planning.waiting_failure(o, inputs)
    signatures = list(tables.signatures)
    table_cm = render.tables_configmap(o.job, list(tables.specs)) if profiles else None
    decisions = {}
    for t in types:
        jobs = [j for j in o.profiling_jobs if j.ref.labels.get(names.LABEL_GPU_TYPE) == t]
        calibration = None
        if table_cm is not None:
            calibration = render.Calibration(
                table_cm["metadata"]["name"],
                profiling.tables_hash(signatures),
                inputs.world_size,
                o.models.get(t),
                # what the plans the pod refines are made for (the type's own memory)
                gpu_memory_bytes=planning.memory(o, spec, nodes, t),
            )
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
            settings_hash=(
                render.profiling_settings_hash(o.job, spec, t, o.config, calibration)
                if calibration is not None
                else ""
            ),
            tables=signatures,
        )
        decisions[t] = pd
        d.patches += [_mark(m, o.now) for m in pd.marks]
        if pd.create is not None and failure is None:
            assert table_cm is not None and calibration is not None  # Never creates nothing
            d.creates += [
                table_cm,
                render.profiling_job(o.job, spec, t, pd.create, o.config, calibration),
            ]
        for at in (pd.next_attempt_at, pd.check_at):
            if at is not None:
                d.requeue((at - o.now).total_seconds())
    d.fields["profiling"] = [pd.status() for pd in decisions.values() if profiles]
    chosen = decisions[placement.gpu_type]
    d.fields["costModel"] = _model_status(
        chosen.gpu_type, chosen.model, o.now, spec.profiling.max_age_seconds, signatures
    )
    if chosen.degraded:
        d.conditions.append(Condition("Degraded", True, chosen.fallback_reason, chosen.degraded))
    reason = _ready_reason(chosen) if chosen.ready else waiting_reason(chosen)
    d.conditions.append(Condition("CostModelReady", chosen.ready, reason, chosen.message))
    if failure is not None:
        planning.report(o, d, failure)
        return
    if not chosen.ready:
        return
    n = len(spec.tables.inline) if spec.tables.inline is not None else len(tables.specs)
    model = chosen.model.describe() if chosen.model else "the bundled CPU model"
    retried = o.plan_failures.get(inputs.hash())
    if retried is not None and retried.generation == o.job.generation:
        # A retry of the same job: the condition keeps what failed until the retry's
        # outcome changes it, so a retry that fails alike posts no Events.
        d.conditions.append(Condition("Planned", False, retried.reason, retried.message))
        d.attempts["Planned"] = retried.attempts
    else:
        d.conditions.append(
            Condition(
                "Planned",
                False,
                "Planning",
                f"planning {n} tables for {inputs.world_size} GPUs with {inputs.planner} ({model})",
            )
        )
    d.plan = PlanNeeded(inputs, chosen.model, chosen.degraded, chosen.fallback_reason)

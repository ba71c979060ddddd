"""The planning part of :func:`~shardwise.operator.decide.reconcile.decide`: the inputs a plan
is made from, the plan the children already hold for them (a plan ConfigMap is named
by its hash and annotated with its inputs' hash), a failed planning, what planning
says about a resharding candidate, and the plan as status shows it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardwise import names
from shardwise.operator.cluster.capacity import NodeInfo, Placement, gpu_memory_bytes
from shardwise.operator.cluster.summaries import PlanRecord
from shardwise.operator.crd import DLRMJobSpec
from shardwise.operator.decide import resharding as rs
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.decide.records import Decision, Observed, PlanFailure
from shardwise.operator.models.plan_inputs import PlanInputs
from shardwise.operator.models.plan_kinds import describe_kinds, status_kinds
from shardwise.operator.models.refined_plans import KIND_MODEL_ONLY, KIND_REFINED, plan_kind_fields


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


def memory(o: Observed, spec: DLRMJobSpec, nodes: Sequence[NodeInfo], kind: str) -> int | None:
    """The GPU memory to plan for: ``spec.planner.gpuMemory``, else the nodes' label."""
    return spec.planner.gpu_memory_bytes() or gpu_memory_bytes(
        nodes, kind, spec.planner.device, o.config
    )


def plan_for(o: Observed, inputs_hash: str) -> PlanRecord | None:
    """The live plan ConfigMap made from these inputs."""
    return next((p for p in o.plans if p.inputs_hash == inputs_hash and not p.ref.deleting), None)


def waiting_failure(o: Observed, inputs: PlanInputs) -> PlanFailure | None:
    """The failure of planning these inputs, while planning them again is not due."""
    failure = o.plan_failures.get(inputs.hash())
    if failure is None or failure.due(o.now, o.job.generation):
        return None
    return failure


def report(o: Observed, d: Decision, failure: PlanFailure) -> None:
    """Say why planning failed (Failed when it never will be again), and come back
    when it is due."""
    d.conditions.append(Condition("Planned", False, failure.reason, failure.message))
    if failure.retry_at is None:
        d.conditions.append(Condition("Failed", True, failure.reason, failure.message))
    else:
        d.requeue((failure.retry_at - o.now).total_seconds())


def report_failure(o: Observed, d: Decision, inputs: PlanInputs) -> bool:
    """Planning for these inputs failed and is not due again: :func:`report` it;
    ``True`` then."""
    failure = waiting_failure(o, inputs)
    if failure is None:
        return False
    report(o, d, failure)
    return True


def candidates(
    o: Observed, spec: DLRMJobSpec, nodes: Sequence[NodeInfo]
) -> Callable[[Placement], rs.Candidate]:
    """What planning says about a placement the workers could grow to (for
    :func:`~shardwise.operator.decide.resharding.reshard`)."""

    def candidate(placement: Placement) -> rs.Candidate:
        gpu_memory = memory(o, spec, nodes, placement.gpu_type)
        if gpu_memory is None:
            return rs.Candidate(None)
        inputs = plan_inputs(spec, placement, gpu_memory)
        ih = inputs.hash()
        failure = o.plan_failures.get(ih)
        return rs.Candidate(inputs, plan_for(o, ih), failure.message if failure else None)

    return candidate


def running_seconds(o: Observed) -> float | None:
    """The predicted seconds per iteration of the plan the workers run on."""
    wj = o.worker_job
    running = wj.ref.annotations.get(names.ANN_PLAN, "") if wj is not None else ""
    return rs.predicted_seconds(next((p for p in o.plans if p.ref.name == running), None))


def plan_fields(plan: PlanRecord) -> dict[str, Any]:
    """``status.plan``."""
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
    out.update(plan_kind_fields(s))
    out.update(status_kinds(s))
    return out


def plan_message(plan: PlanRecord) -> str:
    """The Planned condition's message."""
    s = plan.summary
    cost = s.get("predictedMaxSeconds")
    priced = (
        f", predicted max {1e3 * cost:.2f} ms/iter, imbalance {s.get('imbalance', 0):.3f}"
        if isinstance(cost, int | float)
        else ""
    )
    refined = s.get("refinement") if s.get("kind") == KIND_REFINED else None
    if isinstance(refined, dict) and isinstance(refined.get("finalMaxMs"), int | float):
        how = (
            f"; refined by measurement on {refined.get('device', 'its GPU')}: "
            f"{refined.get('startMaxMs', 0):.2f} -> {refined['finalMaxMs']:.2f} ms measured"
        )
    elif s.get("kind") == KIND_MODEL_ONLY and s.get("why"):
        how = f"; model only: {s['why']}"
    else:
        how = ""
    kinds = describe_kinds(s)
    return (
        f"plan {plan.ref.name}: {s.get('tables')} tables on {s.get('worldSize')} GPUs by "
        f"{s.get('planner')}{f' ({kinds})' if kinds else ''}{priced}{how}"
    )

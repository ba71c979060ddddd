"""The cost models' quality on the plans a benchmark task measured (docs/design.md §14).

The search asks a model one question a million times: what does *this rank* cost?
So each task also records, per model it plans with (``bundled``, and ``calibrated``
when the run calibrates), Spearman's rho and the MAPE of the model's predicted
per-rank compute (fwd + bwd, :meth:`CostPredictor.predict_plan`) against the
evaluator's measured per-rank compute, pooled over the ranks of every distinct plan
measured in the task (every planner's, so the ranks span good and bad placements).
Ranks that hold no kernel are left out: both sides are 0 by construction. The
metrics are pre-training's (:func:`shardwise.profiler.pretrain.report.metrics`).

**Mixed-kind ranks** (a rank holding a kernel other than the fused table-wise/
column-wise one: a row range, a data-parallel copy) get the same figures apart, and
each such rank is kept with its price and measurement (:class:`MixedRank`), so the
run's summary and ``benchmarks/kinds_fidelity.py`` pool them over tasks and runs:
these are the ranks a learned cost for every kind has to get right.

A results folder of the previous schema lacks these figures; :func:`backfill`
recomputes them from the plans and models the folder kept.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.planner.kinds import FUSED_GROUP
from shardwise.planner.plan import Plan, load_plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler.bench.results import MixedRank, ModelQuality, PlannerResult, TaskResult

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

#: The model kinds, in the order the outputs list them.
KINDS = ("bundled", "calibrated")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _priced_ranks(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictor: CostPredictor,
) -> tuple[int, list[MixedRank]]:
    """Every rank holding a kernel in every distinct measured plan, as a
    :class:`MixedRank` (``groups`` empty: fused kernels only), and the plans' count."""
    rows_of: dict[str, list[str]] = {}
    chosen: dict[str, Plan] = {}
    for row, plan in plans.items():
        r = outcomes.get(row)
        if r is None or not r.ok or len(r.compute_per_rank) != plan.world_size:
            continue  # unmeasured, or measured without per-rank figures: nothing to pair
        rows_of.setdefault(plan.hash, []).append(row)
        chosen.setdefault(plan.hash, plan)
    out: list[MixedRank] = []
    for digest, plan in chosen.items():
        first = outcomes[rows_of[digest][0]]
        measured = first.compute_per_rank
        repeats = [rep for rep in first.compute_per_repeat if len(rep) == plan.world_size]
        priced = predictor.predict_plan(plan, tables)
        kernels = plan.kernel_shards(tables)
        for rank, (held, cost, true) in enumerate(
            zip(kernels, priced.ranks, measured, strict=True)
        ):
            if held:
                groups = sorted({k.group for k in held} - {FUSED_GROUP})
                pred = cost.fwd_compute_s + cost.bwd_compute_s
                each = [rep[rank] for rep in repeats]
                out.append(MixedRank(digest, rows_of[digest], rank, groups, pred, true, each))
    return len(chosen), out


def quality(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictor: CostPredictor,
    model: str,
) -> ModelQuality:
    """``predictor``'s per-rank compute against the measured one, over the ranks that
    hold a kernel in every distinct measured plan (``plans`` and ``outcomes`` by row)."""
    return _quality(plans, outcomes, tables, predictor, model)[0]


def _quality(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictor: CostPredictor,
    model: str,
) -> tuple[ModelQuality, list[MixedRank]]:
    from shardwise.profiler.pretrain.report import metrics

    count, ranks = _priced_ranks(plans, outcomes, tables, predictor)
    m = metrics([r.predicted_s for r in ranks], [r.measured_s for r in ranks])
    q = ModelQuality(
        model=model,
        plans=count,
        ranks=len(ranks),
        spearman=_finite(m["spearman"]),
        mape=_finite(m["mape"]),
    )
    return q, [r for r in ranks if r.groups]


def mixed_ranks_of(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictor: CostPredictor,
) -> list[MixedRank]:
    """The mixed-kind ranks of a task's measured plans, priced by ``predictor``: what a
    task's result keeps for its models, for any other model (cross-pricing runs)."""
    return [r for r in _priced_ranks(plans, outcomes, tables, predictor)[1] if r.groups]


def pooled(ranks: Sequence[MixedRank]) -> dict[str, Any]:
    """Spearman's rho and MAPE over ``ranks`` pooled (None where undefined)."""
    from shardwise.profiler.pretrain.report import metrics

    m = metrics([r.predicted_s for r in ranks], [r.measured_s for r in ranks])
    return {"ranks": len(ranks), "spearman": _finite(m["spearman"]), "mape": _finite(m["mape"])}


def mixed_summary(results: Sequence[TaskResult]) -> dict[str, dict[str, Any]]:
    """Per model kind: its mixed-kind ranks pooled over the tasks that recorded them
    (``tasks``), with the tasks recorded before these figures counted apart
    (``unrecorded``)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        got = [t for t in results if kind in t.model_quality]
        if not got:
            continue
        recorded = [t.mixed_kind.get(kind, []) for t in got if t.mixed_kind is not None]
        ranks = [r for task in recorded for r in task]
        out[kind] = {
            **pooled(ranks),
            "tasks": len(recorded),
            "unrecorded": len(got) - len(recorded),
        }
    return out


def summary(results: Sequence[TaskResult]) -> dict[str, dict[str, Any]]:
    """Per model kind: the median over tasks of rho and MAPE, and the worst task's."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        got = [t.model_quality[kind] for t in results if kind in t.model_quality]
        rhos = [q.spearman for q in got if q.spearman is not None]
        mapes = [q.mape for q in got if q.mape is not None]
        if not got:
            continue
        out[kind] = {
            "tasks": len(got),
            "spearman_median": statistics.median(rhos) if rhos else None,
            "spearman_min": min(rhos) if rhos else None,
            "mape_median": statistics.median(mapes) if mapes else None,
            "mape_max": max(mapes) if mapes else None,
            "ranks": sum(q.ranks for q in got),
        }
    return out


def saved_plans(result: TaskResult, plans_dir: Path) -> dict[str, Plan]:
    """The plans a finished task wrote (``plans/<task>/<row>.json``), by row; rows whose
    file is gone are left out."""
    out = {}
    for row, r in result.planners.items():
        path = plans_dir / result.task / f"{row}.json"
        if r.ok and path.is_file():
            out[row] = load_plan(path)
    return out


def task_quality(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictors: Mapping[str, tuple[str, CostPredictor]],
) -> dict[str, ModelQuality]:
    """:func:`quality` for each model kind in ``predictors`` (kind -> (identity,
    predictor)); a kind with no measured rank is left out."""
    return task_quality_and_ranks(plans, outcomes, tables, predictors)[0]


def task_quality_and_ranks(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictors: Mapping[str, tuple[str, CostPredictor]],
) -> tuple[dict[str, ModelQuality], dict[str, list[MixedRank]]]:
    """:func:`task_quality`, and per model kind its mixed-kind ranks (what a task's
    result keeps)."""
    out: dict[str, ModelQuality] = {}
    mixed: dict[str, list[MixedRank]] = {}
    for kind in KINDS:
        if kind in predictors:
            identity, predictor = predictors[kind]
            q, ranks = _quality(plans, outcomes, tables, predictor, identity)
            if q.ranks:
                out[kind] = q
                mixed[kind] = ranks
    return out, mixed

"""The cost models' quality on the plans a benchmark task measured (docs/design.md §14).

The search asks a model one question a million times: what does *this rank* cost?
So each task also records, per model it plans with (``bundled``, and ``calibrated``
when the run calibrates), Spearman's rho and the MAPE of the model's predicted
per-rank compute (fwd + bwd, :meth:`CostPredictor.predict_plan`) against the
evaluator's measured per-rank compute, pooled over the ranks of every distinct plan
measured in the task (every planner's, so the ranks span good and bad placements).
Ranks that hold no shard are left out: both sides are 0 by construction. The
metrics are pre-training's (:func:`shardwise.profiler.pretrain.report.metrics`).

A results folder of the previous schema lacks these figures; :func:`backfill`
recomputes them from the plans and models the folder kept.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.planner.plan import Plan, load_plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler.bench.results import ModelQuality, PlannerResult, TaskResult

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

#: The model kinds, in the order the outputs list them.
KINDS = ("bundled", "calibrated")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def quality(
    plans: Mapping[str, Plan],
    outcomes: Mapping[str, PlannerResult],
    tables: Sequence[TableSpec],
    predictor: CostPredictor,
    model: str,
) -> ModelQuality:
    """``predictor``'s per-rank compute against the measured one, over the ranks that
    hold a shard in every distinct measured plan (``plans`` and ``outcomes`` by row)."""
    from shardwise.profiler.pretrain.report import metrics

    seen: set[str] = set()
    pred: list[float] = []
    true: list[float] = []
    for row, plan in plans.items():
        r = outcomes.get(row)
        if r is None or not r.ok or plan.hash in seen:
            continue
        if len(r.compute_per_rank) != plan.world_size:
            continue  # measured without per-rank figures: nothing to pair
        seen.add(plan.hash)
        priced = predictor.predict_plan(plan, tables)
        for shards, cost, measured in zip(
            plan.shards_per_rank(), priced.ranks, r.compute_per_rank, strict=True
        ):
            if shards:
                pred.append(cost.fwd_compute_s + cost.bwd_compute_s)
                true.append(measured)
    m = metrics(pred, true)
    return ModelQuality(
        model=model,
        plans=len(seen),
        ranks=len(true),
        spearman=_finite(m["spearman"]),
        mape=_finite(m["mape"]),
    )


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
    out = {}
    for kind in KINDS:
        if kind in predictors:
            identity, predictor = predictors[kind]
            q = quality(plans, outcomes, tables, predictor, identity)
            if q.ranks:
                out[kind] = q
    return out

"""One row's figures in one metric over a set of tasks (docs/bench.md): paired ratios
to the references with wins/ties/losses within each task's noise, the ratio to the
balance bound, the worst task against its best baseline, balance and times."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.profiler.bench.results import PlannerResult, TaskResult
from shardwise.profiler.bench.stats import (
    HEURISTICS,
    Paired,
    balance,
    compare,
    geomean,
    paired,
    task_noise,
)

METRICS = ("compute", "total")
REFERENCES = ("torchrec", "torchrec-measured", "best-heuristic")
#: Rows that are baselines: the best baseline of a task is the cheapest of these.
BASELINES = (
    "random",
    *HEURISTICS,
    "torchrec",
    "torchrec-tw-cw",
    "torchrec-measured",
    "torchrec-measured-tw-cw",
)


def cost(r: PlannerResult | None, metric: str) -> float | None:
    """The row's measured cost in ``metric`` (None: no measured plan)."""
    if r is None or not r.ok:
        return None
    return r.compute_max_s if metric == "compute" else r.max_s


@dataclass(frozen=True)
class RowFigures:
    """One row's figures in one metric."""

    row: str
    metric: str
    ok: int
    failed: int  # no plan, or not measurable
    skipped: int  # refinement not possible here
    vs: dict[str, Paired]  # reference -> paired figures
    vs_bound: float | None  # geomean of cost / balance bound (compute: the bound's metric)
    best_baseline_worst: float | None  # the worst task's ratio to its best baseline
    best_baseline_worst_task: str | None
    beyond_noise: int  # tasks worse than their best baseline by more than the noise
    balance_median: float | None
    planning_s_median: float | None
    planning_s_max: float | None
    refine_s_median: float | None
    repeat_cv_median: float | None


def task_noise_of(task: TaskResult, metric: str = "compute") -> float:
    """The task's noise in ``metric``: the median over its distinct measured plans of
    their CV over the repeats."""
    cvs = {
        r.plan_hash: r.compute_repeat_cv if metric == "compute" else r.repeat_cv
        for r in task.planners.values()
        if r.ok
    }
    return task_noise([cv for cv in cvs.values() if cv is not None])


def references(task: TaskResult, metric: str, heuristic: str | None) -> dict[str, float | None]:
    refs = {
        "torchrec": cost(task.planners.get("torchrec"), metric),
        "torchrec-measured": cost(task.planners.get("torchrec-measured"), metric),
        "best-heuristic": cost(task.planners.get(heuristic), metric) if heuristic else None,
    }
    return refs


def best_baseline(task: TaskResult, metric: str) -> float | None:
    xs = [c for b in BASELINES if (c := cost(task.planners.get(b), metric)) is not None]
    return min(xs) if xs else None


def median_or_none(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def row_figures(
    row: str, metric: str, results: Sequence[TaskResult], heuristic: str | None, seed: int
) -> RowFigures:
    outcomes: dict[str, list[Any]] = {ref: [] for ref in REFERENCES}
    mine = [(t, t.planners.get(row)) for t in results if row in t.planners]
    bound_ratios: list[float] = []
    balances: list[float] = []
    worst: tuple[float | None, str | None] = (None, None)
    beyond = 0
    for task, r in mine:
        noise = task_noise_of(task, metric)
        c = cost(r, metric)
        if r is not None and r.status == "skipped":
            continue
        for ref, value in references(task, metric, heuristic).items():
            if ref == row or (ref == "best-heuristic" and row == heuristic):
                continue
            present = ref if ref != "best-heuristic" else heuristic
            if present is None or present not in task.planners:
                continue
            outcomes[ref].append(compare(c, value, noise))
        if c is not None and task.bound_s > 0:
            bound_ratios.append(c / task.bound_s)
        if r is not None and r.ok and (b := balance(r.compute_per_rank)) is not None:
            balances.append(b)
        if row not in BASELINES and (base := best_baseline(task, metric)) is not None:
            ratio = c / base if c is not None else math.inf
            if worst[0] is None or ratio > worst[0]:
                worst = (ratio, task.task)
            if ratio > 1.0 + noise:
                beyond += 1
    oks = [r for _, r in mine if r is not None and r.ok]
    return RowFigures(
        row=row,
        metric=metric,
        ok=len(oks),
        failed=sum(
            1
            for _, r in mine
            if r is not None and r.status in ("plan-failed", "invalid-plan", "measure-failed")
        ),
        skipped=sum(1 for _, r in mine if r is not None and r.status == "skipped"),
        vs={ref: paired(o, seed) for ref, o in outcomes.items() if o},
        vs_bound=geomean(bound_ratios) if metric == "compute" else None,
        best_baseline_worst=worst[0],
        best_baseline_worst_task=worst[1],
        beyond_noise=beyond,
        balance_median=median_or_none(balances),
        planning_s_median=median_or_none([r.planning_s for r in oks if r.planning_s is not None]),
        planning_s_max=max((r.planning_s for r in oks if r.planning_s is not None), default=None),
        refine_s_median=median_or_none([r.refine_s for r in oks if r.refine_s is not None]),
        repeat_cv_median=median_or_none([r.repeat_cv for r in oks if r.repeat_cv is not None]),
    )

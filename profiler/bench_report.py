"""From measured task results to the benchmark's figures (docs/design.md §9).

Per task and planner: the measured max-rank cost and its ratio to four references —
TorchRec as shipped, TorchRec with measured costs, the best of the four greedy
heuristics *on that task*, and the balance bound (the measured single-table compute
summed and divided by W; compute only, and not a strict lower bound: a fused kernel
can cost a little less or more than its tables alone). Per planner: the geometric
mean of each ratio over the tasks where both sides have a measured plan (a planner
that could not plan a task is counted as a failure, never as a ratio), planning
times and the evaluator's repeatability. Every number comes from the evaluator.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardwise.profiler.bench_results import TaskResult

GREEDY = ("size-greedy", "dim-greedy", "lookup-greedy", "size-lookup-greedy")
#: References a plan is compared with (the keys of ``Row.ratios``).
REFERENCES = ("torchrec", "torchrec-measured", "best-heuristic", "bound")
REFERENCE_LABELS = {
    "torchrec": "x TorchRec",
    "torchrec-measured": "x TorchRec-measured",
    "best-heuristic": "x best heuristic",
    "bound": "x balance bound",
}
#: The project's quality targets for NeuroShard: geomean of the ratio over the full benchmark.
TARGETS: dict[str, dict[str, float]] = {
    "neuroshard": {
        "torchrec": 0.80,
        "torchrec-measured": 0.95,
        "best-heuristic": 0.90,
        "bound": 1.15,
    }
}
#: (planner, T, W, seconds): the planning-time target the bench's tasks can check.
PLANNING_TARGETS = (("neuroshard", 80, 8, 2.0),)
CSV_FILE = "summary.csv"
JSON_FILE = "summary.json"
CHART_FILE = "chart.png"


@dataclass(frozen=True)
class Row:
    """One planner on one task, as the CSV has it."""

    task: str
    tables: int
    gpus: int
    planner: str
    status: str
    max_s: float | None
    ratios: dict[str, float | None]
    bound_s: float
    heaviest_table_s: float
    planning_s: float | None
    measure_s: float
    repeat_cv: float | None
    imbalance: float | None
    plan_hash: str | None
    error: str | None


@dataclass(frozen=True)
class PlannerSummary:
    planner: str
    tasks_ok: int
    failures: int
    geomeans: dict[str, float | None]  # reference -> geomean ratio
    counts: dict[str, int]  # reference -> tasks in that geomean
    wins: int  # tasks where this planner's plan measured cheapest (ties count)
    planning_s_median: float | None
    planning_s_max: float | None
    repeat_cv_median: float | None


@dataclass(frozen=True)
class TargetCheck:
    planner: str
    what: str
    value: float | None
    limit: float
    n: int

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value <= self.limit


@dataclass(frozen=True)
class BenchSummary:
    tasks: int
    planners: list[str]
    device: str
    rows: list[Row]
    per_planner: list[PlannerSummary]
    evaluator_cv: dict[str, float | None]  # median, p90, max over every measured plan
    bound_cv_median: float | None
    targets: list[TargetCheck]

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["targets"] = [{**asdict(t), "met": t.met} for t in self.targets]
        doc["notes"] = notes(self.device)
        return doc


def notes(device: str) -> list[str]:
    cpu = device.startswith("cpu")
    return [
        (
            "CPU figures: FBGEMM CPU kernels and gloo all-to-alls on this host, not GPUs."
            if cpu
            else f"measured on {device}."
        ),
        "Both TorchRec baselines are restricted to table_wise/column_wise sharding "
        "(plan.json v1 has no row-wise) and are given each table's pooling factor.",
        "balance bound = sum of each table's measured compute alone (fwd + bwd, "
        "global batch) / W; compute only, so ratios include the all-to-all.",
        "Every cost is the evaluator's measurement (max over ranks of per-rank "
        "medians), all plans of a task measured side by side.",
    ]


def geomean(xs: Sequence[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def references(task: TaskResult) -> dict[str, float]:
    """The task's reference costs that exist (a failed reference has none)."""
    refs: dict[str, float] = {}
    for name in ("torchrec", "torchrec-measured"):
        r = task.planners.get(name)
        if r is not None and r.ok and r.max_s:
            refs[name] = r.max_s
    greedy = [
        r.max_s for n in GREEDY if (r := task.planners.get(n)) is not None and r.ok and r.max_s
    ]
    if greedy:
        refs["best-heuristic"] = min(greedy)
    if task.bound_s > 0:
        refs["bound"] = task.bound_s
    return refs


def _rows(results: Sequence[TaskResult], planners: Sequence[str]) -> list[Row]:
    rows = []
    for task in results:
        refs = references(task)
        for name in planners:
            r = task.planners.get(name)
            if r is None:
                continue
            ratios = {
                ref: (r.max_s / refs[ref] if r.ok and r.max_s is not None and ref in refs else None)
                for ref in REFERENCES
            }
            rows.append(
                Row(
                    task=task.task,
                    tables=task.tables,
                    gpus=task.gpus,
                    planner=name,
                    status=r.status,
                    max_s=r.max_s,
                    ratios=ratios,
                    bound_s=task.bound_s,
                    heaviest_table_s=task.heaviest_table_s,
                    planning_s=r.planning_s,
                    measure_s=r.measure_s,
                    repeat_cv=r.repeat_cv,
                    imbalance=r.imbalance,
                    plan_hash=r.plan_hash,
                    error=r.error,
                )
            )
    return rows


def _percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def summarize(results: Sequence[TaskResult], planners: Sequence[str]) -> BenchSummary:
    rows = _rows(results, planners)
    best = {
        task.task: min((r.max_s for r in task.planners.values() if r.ok and r.max_s), default=None)
        for task in results
    }
    per_planner = []
    for name in planners:
        mine = [r for r in rows if r.planner == name]
        ok = [r for r in mine if r.status == "ok" and r.max_s is not None]
        geo: dict[str, float | None] = {}
        counts: dict[str, int] = {}
        for ref in REFERENCES:
            xs = [x for r in ok if (x := r.ratios[ref]) is not None]
            geo[ref], counts[ref] = geomean(xs), len(xs)
        times = [r.planning_s for r in ok if r.planning_s is not None]
        cvs = [r.repeat_cv for r in ok if r.repeat_cv is not None]
        per_planner.append(
            PlannerSummary(
                planner=name,
                tasks_ok=len(ok),
                failures=len(mine) - len(ok),
                geomeans=geo,
                counts=counts,
                wins=sum(1 for r in ok if _cheapest(r, best[r.task])),
                planning_s_median=statistics.median(times) if times else None,
                planning_s_max=max(times) if times else None,
                repeat_cv_median=statistics.median(cvs) if cvs else None,
            )
        )
    # Repeatability over distinct measurements (planners sharing a plan share one).
    measured = {(r.task, r.plan_hash): r.repeat_cv for r in rows if r.repeat_cv is not None}
    cvs = [cv for cv in measured.values() if cv is not None]
    bound_cvs = [t.bound_cv for t in results if t.bound_per_repeat]
    return BenchSummary(
        tasks=len(results),
        planners=list(planners),
        device=results[0].device if results else "cpu",
        rows=rows,
        per_planner=per_planner,
        evaluator_cv={
            "median": statistics.median(cvs) if cvs else None,
            "p90": _percentile(cvs, 0.9),
            "max": max(cvs) if cvs else None,
            "plans": float(len(cvs)),
        },
        bound_cv_median=statistics.median(bound_cvs) if bound_cvs else None,
        targets=_targets(per_planner, rows),
    )


def _cheapest(row: Row, best: float | None) -> bool:
    return row.max_s is not None and best is not None and row.max_s <= best


def _targets(per_planner: Sequence[PlannerSummary], rows: Sequence[Row]) -> list[TargetCheck]:
    checks = []
    for p in per_planner:
        for ref, limit in TARGETS.get(p.planner, {}).items():
            checks.append(
                TargetCheck(
                    p.planner,
                    f"geomean {REFERENCE_LABELS[ref]}",
                    p.geomeans[ref],
                    limit,
                    p.counts[ref],
                )
            )
    names = {p.planner for p in per_planner}
    for planner, count, gpus, limit in PLANNING_TARGETS:
        times = [
            r.planning_s
            for r in rows
            if r.planner == planner and r.tables == count and r.gpus == gpus and r.planning_s
        ]
        if planner in names and times:
            checks.append(
                TargetCheck(
                    planner,
                    f"planning s, {count} tables x {gpus} GPUs (max)",
                    max(times),
                    limit,
                    len(times),
                )
            )
    return checks


# --------------------------------------------------------------------------- files


def write_csv(summary: BenchSummary, path: Path) -> None:
    fields = ["task", "tables", "gpus", "planner", "status", "max_ms", "bound_ms", "heaviest_ms"]
    fields += [f"ratio_{ref.replace('-', '_')}" for ref in REFERENCES]
    fields += [
        "planning_s",
        "measure_s",
        "repeat_cv",
        "imbalance_max_over_mean",
        "plan_hash",
        "error",
    ]

    def num(x: float | None, scale: float = 1.0) -> str:
        return "" if x is None else f"{x * scale:.6g}"

    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(fields)
        for r in summary.rows:
            w.writerow(
                [r.task, r.tables, r.gpus, r.planner, r.status, num(r.max_s, 1e3)]
                + [num(r.bound_s, 1e3), num(r.heaviest_table_s, 1e3)]
                + [num(r.ratios[ref]) for ref in REFERENCES]
                + [
                    num(r.planning_s),
                    num(r.measure_s),
                    num(r.repeat_cv),
                    num(r.imbalance),
                    r.plan_hash or "",
                    (r.error or "").splitlines()[0] if r.error else "",
                ]
            )


def write_outputs(summary: BenchSummary, out_dir: Path) -> list[Path]:
    """summary.csv, summary.json and chart.png in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(summary, out_dir / CSV_FILE)
    (out_dir / JSON_FILE).write_text(json.dumps(summary.to_json(), indent=1) + "\n", "utf-8")
    paths = [out_dir / CSV_FILE, out_dir / JSON_FILE]
    if summary.rows:
        plot(summary, out_dir / CHART_FILE)
        paths.append(out_dir / CHART_FILE)
    return paths


def plot(summary: BenchSummary, path: Path) -> None:
    """Left: geomean ratio to the balance bound per planner. Right: each task's
    measured cost over its bound, per planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=[1, 2])
    bars = [(p.planner, p.geomeans["bound"]) for p in summary.per_planner if p.geomeans["bound"]]
    bars.sort(key=lambda b: b[1] or 0.0)
    left.barh([b[0] for b in bars], [b[1] or 0.0 for b in bars], color="tab:blue")
    left.axvline(1.0, color="black", lw=0.8, ls="--")
    left.set_xlabel("geomean measured cost / balance bound (lower is better)")
    left.invert_yaxis()
    tasks = list(dict.fromkeys(r.task for r in summary.rows))
    for name in summary.planners:
        pts = [
            (tasks.index(r.task), r.ratios["bound"])
            for r in summary.rows
            if r.planner == name and r.ratios["bound"] is not None
        ]
        if pts:
            right.plot(
                [x for x, _ in pts], [y for _, y in pts], marker="o", ms=4, lw=0.8, label=name
            )
    right.axhline(1.0, color="black", lw=0.8, ls="--")
    right.set_xticks(range(len(tasks)), tasks, rotation=60, ha="right", fontsize=7)
    right.set_ylabel("measured max-rank cost / balance bound")
    right.legend(fontsize=7, ncols=2)
    where = "CPU" if summary.device.startswith("cpu") else summary.device
    fig.suptitle(f"shardwise bench: {summary.tasks} tasks, measured by the evaluator ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

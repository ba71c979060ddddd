"""From measured task results to the benchmark's figures (docs/design.md §9, docs/bench.md).

Two metrics, both the evaluator's: ``compute`` (max over ranks of the measured fwd +
bwd compute: what the targets are stated in) and ``total`` (compute plus the task's
declared comm, the objective planners price). Per row and metric, against TorchRec at
full strength (``torchrec``, every sharding kind: the anchor; ``torchrec-tw-cw``, its
table-wise/column-wise restriction, is a row beside it, so the anchor's strength shows),
TorchRec with measured costs and the best heuristic
(:func:`~shardwise.profiler.bench.stats.best_heuristic`): the paired geomean ratio
with its 95 % bootstrap interval and wins/ties/losses with ties within each task's
noise (:mod:`~shardwise.profiler.bench.stats`). Per row also: the median balance
efficiency (mean/max measured per-rank compute), the ratio to the best baseline of
each task (the cheapest of every non-NeuroShard, unrefined row: the strictest
reference), planning and refinement times, and the target checks. Per model kind:
the median over tasks of its per-rank Spearman's rho and MAPE on the task's measured
plans (:mod:`~shardwise.profiler.bench.quality`).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardwise.profiler.bench.quality import KINDS
from shardwise.profiler.bench.quality import summary as quality_summary
from shardwise.profiler.bench.results import PlannerResult, TaskResult, kinds_text
from shardwise.profiler.bench.stats import (
    HEURISTICS,
    Paired,
    balance,
    best_heuristic,
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
CSV_FILE = "summary.csv"
JSON_FILE = "summary.json"
CHART_FILE = "chart.png"


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


@dataclass(frozen=True)
class Target:
    row: str
    what: str
    value: float | None
    limit: float
    met: bool | None
    detail: str


@dataclass(frozen=True)
class BenchSummary:
    tasks: int
    rows: list[str]
    device: str
    comms: list[str]  # the evaluator's comm descriptions, one per distinct one
    best_heuristic: dict[str, str | None]  # metric -> heuristic
    figures: list[RowFigures]
    noise_median: float | None
    targets: list[Target]
    per_task: list[dict[str, Any]] = field(default_factory=list)
    calibrations: dict[str, Any] = field(default_factory=dict)
    #: Per model kind: medians over tasks of per-rank rho and MAPE
    #: (:func:`shardwise.profiler.bench.quality.summary`).
    model_quality: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Per row, the tables of each sharding kind its plans held, summed over the tasks.
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)

    def figures_of(self, row: str, metric: str) -> RowFigures | None:
        return next((f for f in self.figures if f.row == row and f.metric == metric), None)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["notes"] = notes(self.device)
        return doc


def notes(device: str) -> list[str]:
    where = (
        "CPU figures: FBGEMM's CPU kernels on this host, not GPUs"
        if device.startswith("cpu")
        else f"measured on {device}"
    )
    return [
        f"{where}; every cost is the evaluator's (per-rank medians over the repeats, all "
        "plans of a task measured side by side, interleaved).",
        "compute = max over ranks of the measured fwd + bwd compute; total = compute + "
        "the task's comm (declared model, or measured where each rank has its own core).",
        "torchrec (the anchor) is TorchRec's planner offered every sharding kind its "
        "sharder allows on GPUs (data-parallel, table-, column-, table-column-, row-, "
        "table-row-wise, grid); torchrec-tw-cw the same planner restricted to "
        "table_wise/column_wise; -measured: fed our measured single-shard compute; all "
        "given each table's pooling factor.",
        "ties: within the task's noise (median CV over the repeats of its plans); "
        "intervals: 95 % percentile bootstrap over tasks.",
    ]


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


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _row_figures(
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
        balance_median=_median(balances),
        planning_s_median=_median([r.planning_s for r in oks if r.planning_s is not None]),
        planning_s_max=max((r.planning_s for r in oks if r.planning_s is not None), default=None),
        refine_s_median=_median([r.refine_s for r in oks if r.refine_s is not None]),
        repeat_cv_median=_median([r.repeat_cv for r in oks if r.repeat_cv is not None]),
    )


# --------------------------------------------------------------------------- targets

#: The project's targets (docs/bench.md): compute, calibrated model, refined.
REFINED_ROWS = ("neuroshard[calibrated+refined]", "neuroshard[bundled+refined]")
MODEL_ROWS = ("neuroshard[calibrated]", "neuroshard[bundled]")


def _targets(summary_rows: Sequence[str], figures: Sequence[RowFigures]) -> list[Target]:
    def fig(row: str) -> RowFigures | None:
        return next((f for f in figures if f.row == row and f.metric == "compute"), None)

    out = []
    for rows, limit_tr, label in (
        (REFINED_ROWS, 0.88, "refined"),
        (MODEL_ROWS, 0.92, "model only"),
    ):
        row = next((r for r in rows if r in summary_rows), None)
        f = fig(row) if row else None
        if row is None or f is None:
            continue
        tr = f.vs.get("torchrec")
        hi = tr.interval[1] if tr and tr.interval else None
        out.append(
            Target(
                row,
                f"{label}: compute geomean x TorchRec <= {limit_tr}"
                + (", interval's upper end < 1.0" if label == "refined" else ""),
                tr.geomean if tr else None,
                limit_tr,
                None
                if tr is None or tr.geomean is None
                else tr.geomean <= limit_tr
                and (label != "refined" or (hi is not None and hi < 1.0)),
                _paired_text(tr),
            )
        )
        out.append(
            Target(
                row,
                f"{label}: tasks worse than TorchRec beyond noise = 0",
                None if tr is None else float(tr.losses),
                0.0,
                None if tr is None or tr.geomean is None else tr.losses == 0,
                _paired_text(tr),
            )
        )
        if label == "refined":  # the heavy pool's (docs/design.md §14)
            out.append(
                Target(
                    row,
                    "refined: compute geomean x TorchRec <= 0.85 and median balance >= 0.92",
                    tr.geomean if tr else None,
                    0.85,
                    None
                    if tr is None or tr.geomean is None or f.balance_median is None
                    else tr.geomean <= 0.85 and f.balance_median >= 0.92,
                    f"{_paired_text(tr)}; balance "
                    + ("-" if f.balance_median is None else f"{f.balance_median:.3f}"),
                )
            )
        bh = f.vs.get("best-heuristic")
        out.append(
            Target(
                row,
                f"{label}: compute geomean x best heuristic <= 0.92",
                bh.geomean if bh else None,
                0.92,
                None if bh is None or bh.geomean is None else bh.geomean <= 0.92,
                _paired_text(bh),
            )
        )
        out.append(
            Target(
                row,
                f"{label}: median balance (mean/max measured compute) >= 0.95",
                f.balance_median,
                0.95,
                None if f.balance_median is None else f.balance_median >= 0.95,
                f"{f.ok} tasks",
            )
        )
        out.append(
            Target(
                row,
                f"{label}: tasks worse than the task's best baseline beyond noise = 0",
                float(f.beyond_noise),
                0.0,
                f.beyond_noise == 0,
                f"worst {f.best_baseline_worst_task}: x{f.best_baseline_worst:.3f}"
                if f.best_baseline_worst is not None
                else "no task",
            )
        )
    return out


def _paired_text(p: Paired | None) -> str:
    if p is None or p.geomean is None:
        return "no paired task"
    ci = f" [{p.interval[0]:.3f}, {p.interval[1]:.3f}]" if p.interval else ""
    return f"{p.geomean:.3f}{ci}, n={p.n}, W/T/L {p.wins}/{p.ties}/{p.losses}"


def summarize(
    results: Sequence[TaskResult],
    rows: Sequence[str],
    *,
    seed: int = 0,
    calibrations: dict[str, Any] | None = None,
) -> BenchSummary:
    heuristics = {
        m: best_heuristic(
            [{h: cost(t.planners[h], m) for h in HEURISTICS if h in t.planners} for t in results]
        )
        for m in METRICS
    }
    figures = [_row_figures(r, m, results, heuristics[m], seed) for m in METRICS for r in rows]
    noises = [task_noise_of(t, "compute") for t in results]
    per_task = []
    for t in results:
        base = best_baseline(t, "compute")
        per_task.append(
            {
                "task": t.task,
                "noise": task_noise_of(t),
                "best_baseline_compute_s": base,
                "compute_s": {r: cost(t.planners.get(r), "compute") for r in rows},
                "model_quality": {k: asdict(q) for k, q in t.model_quality.items()},
                "oversized": t.oversized,
                "kinds": {r: t.planners[r].kinds for r in rows if r in t.planners},
            }
        )
    kinds: dict[str, dict[str, int]] = {}
    for row in rows:
        summed: Counter[str] = Counter()
        for t in results:
            r = t.planners.get(row)
            if r is not None and r.plan_hash is not None:
                summed.update(r.kinds)
        kinds[row] = dict(summed)
    return BenchSummary(
        tasks=len(results),
        rows=list(rows),
        device=results[0].device if results else "cpu",
        comms=list(dict.fromkeys(t.comm for t in results)),
        best_heuristic=heuristics,
        figures=figures,
        noise_median=_median(noises),
        targets=_targets(rows, figures),
        per_task=per_task,
        calibrations=dict(calibrations or {}),
        model_quality=quality_summary(results),
        kinds=kinds,
    )


# --------------------------------------------------------------------------- files


def write_csv(summary: BenchSummary, results: Sequence[TaskResult], path: Path) -> None:
    """One line per task and row: both metrics, ratios to the references, balance,
    the task's noise and times, the task's model quality per model kind (the same on
    every row of the task), the plan's tables per sharding kind and the task's tables
    larger than a GPU."""
    fields = ["task", "pool", "fill_kind", "tables", "gpus", "global_batch", "fill"]
    fields += ["row", "status", "compute_ms", "total_ms", "bound_ms", "noise_compute"]
    fields += ["noise_total", "balance"]
    fields += [f"{m}_x_{ref}" for m in METRICS for ref in REFERENCES]
    fields += ["planning_s", "refine_s", "measure_s", "repeat_cv", "plan_hash", "error"]
    fields += [f"{k}_rank_{m}" for k in KINDS for m in ("spearman", "mape")]
    fields += ["kinds", "oversized"]

    def num(x: float | None, scale: float = 1.0) -> str:
        return "" if x is None or not math.isfinite(x) else f"{x * scale:.6g}"

    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(fields)
        for t in results:
            noise = (task_noise_of(t, "compute"), task_noise_of(t, "total"))
            refs = {m: references(t, m, summary.best_heuristic[m]) for m in METRICS}
            quality = []
            for k in KINDS:
                q = t.model_quality.get(k)
                quality += [num(q.spearman), num(q.mape)] if q else ["", ""]
            for row in summary.rows:
                r = t.planners.get(row)
                if r is None:
                    continue
                ratios = []
                for m in METRICS:
                    c = cost(r, m)
                    for ref in REFERENCES:
                        v = refs[m][ref]
                        ratios.append(num(c / v if c is not None and v else None))
                w.writerow(
                    [
                        *(t.task, t.pool, t.fill_kind, t.tables, t.gpus, t.global_batch),
                        *(num(t.fill), row, r.status, num(r.compute_max_s, 1e3)),
                        *(num(r.max_s, 1e3), num(t.bound_s, 1e3)),
                        *(num(noise[0]), num(noise[1])),
                        num(balance(r.compute_per_rank)),
                        *ratios,
                        *(num(r.planning_s), num(r.refine_s), num(r.measure_s)),
                        *(num(r.repeat_cv), r.plan_hash or ""),
                        (r.error or "").splitlines()[0] if r.error else "",
                        *quality,
                        kinds_text(r.kinds),
                        t.oversized,
                    ]
                )


def write_outputs(
    summary: BenchSummary, results: Sequence[TaskResult], out_dir: Path
) -> list[Path]:
    """summary.csv, summary.json and chart.png in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(summary, results, out_dir / CSV_FILE)
    text = json.dumps(_finite(summary.to_json()), indent=1, default=str) + "\n"
    (out_dir / JSON_FILE).write_text(text, "utf-8")
    paths = [out_dir / CSV_FILE, out_dir / JSON_FILE]
    if results:
        plot(summary, results, out_dir / CHART_FILE)
        paths.append(out_dir / CHART_FILE)
    return paths


def _finite(doc: Any) -> Any:
    """``doc`` with every infinite or NaN float as a string (``"inf"``: a row that failed
    where the baseline planned): strict JSON has no such numbers."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return str(doc)
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [_finite(v) for v in doc]
    return doc


def plot(summary: BenchSummary, results: Sequence[TaskResult], path: Path) -> None:
    """Left: each row's compute geomean x TorchRec with its 95 % interval. Right: each
    task's compute ratio to TorchRec per row, the task's noise band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), width_ratios=[1, 2])
    bars = []
    for row in summary.rows:
        f = summary.figures_of(row, "compute")
        p = f.vs.get("torchrec") if f else None
        if p is not None and p.geomean is not None:
            lo, hi = p.interval or (p.geomean, p.geomean)
            bars.append((row, p.geomean, p.geomean - lo, hi - p.geomean))
    bars.sort(key=lambda b: b[1])
    ys = range(len(bars))
    left.barh(list(ys), [b[1] for b in bars], color="tab:blue", alpha=0.7)
    left.errorbar(
        [b[1] for b in bars],
        list(ys),
        xerr=[[b[2] for b in bars], [b[3] for b in bars]],
        fmt="none",
        ecolor="black",
        capsize=3,
    )
    left.set_yticks(list(ys), [b[0] for b in bars], fontsize=8)
    left.axvline(1.0, color="black", lw=0.8, ls="--")
    left.set_xlabel("compute geomean x TorchRec, 95 % CI")
    left.invert_yaxis()
    tasks = [t.task for t in results]
    noise = [task_noise_of(t, "compute") for t in results]
    right.fill_between(
        range(len(tasks)), [1 - n for n in noise], [1 + n for n in noise], color="0.9"
    )
    shown = [row for row in summary.rows if row != "torchrec"]
    for k, row in enumerate(shown):
        pts = []
        for i, t in enumerate(results):
            c, ref = (
                cost(t.planners.get(row), "compute"),
                cost(t.planners.get("torchrec"), "compute"),
            )
            if c is not None and ref:
                pts.append((i + 0.5 * (k / max(len(shown) - 1, 1) - 0.5), c / ref))
        if pts:
            right.plot(
                [x for x, _ in pts], [y for _, y in pts], marker="o", ms=4, ls="none", label=row
            )
    right.axhline(1.0, color="black", lw=0.8, ls="--")
    right.set_xticks(range(len(tasks)), tasks, rotation=70, ha="right", fontsize=6)
    right.set_ylabel("compute / TorchRec's (grey: task noise)")
    right.legend(fontsize=7, ncols=2)
    where = "CPU" if summary.device.startswith("cpu") else summary.device
    fig.suptitle(f"shardwise bench: {summary.tasks} tasks, measured by the evaluator ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

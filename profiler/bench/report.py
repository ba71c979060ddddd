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
plans (:mod:`~shardwise.profiler.bench.quality`), and its mixed-kind ranks pooled.
The targets are :mod:`~shardwise.profiler.bench.targets`; a run over several pools
also gets each pool's compute figures apart.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardwise.profiler.bench.figures import (
    METRICS,
    REFERENCES,
    RowFigures,
    best_baseline,
    cost,
    median_or_none,
    references,
    row_figures,
    task_noise_of,
)
from shardwise.profiler.bench.quality import KINDS, mixed_summary, pooled
from shardwise.profiler.bench.quality import summary as quality_summary
from shardwise.profiler.bench.results import TaskResult, kinds_text
from shardwise.profiler.bench.stats import HEURISTICS, balance, best_heuristic
from shardwise.profiler.bench.targets import Target, targets

CSV_FILE = "summary.csv"
JSON_FILE = "summary.json"
CHART_FILE = "chart.png"


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
    #: Per pool, each row's compute figures on that pool's tasks alone (runs of more
    #: than one pool: the heavy and the industrial pool are judged apart).
    pool_figures: dict[str, list[RowFigures]] = field(default_factory=dict)
    #: Per model kind: its mixed-kind ranks pooled over the tasks
    #: (:func:`shardwise.profiler.bench.quality.mixed_summary`).
    mixed_quality: dict[str, dict[str, Any]] = field(default_factory=dict)

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
    figures = [row_figures(r, m, results, heuristics[m], seed) for m in METRICS for r in rows]
    pools = list(dict.fromkeys(t.pool for t in results))
    pool_figures = {
        key: [
            row_figures(
                r, "compute", [t for t in results if t.pool == key], heuristics["compute"], seed
            )
            for r in rows
        ]
        for key in (pools if len(pools) > 1 else [])
    }
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
        noise_median=median_or_none(noises),
        targets=targets(rows, results, heuristics["compute"], seed, figures),
        per_task=per_task,
        calibrations=dict(calibrations or {}),
        model_quality=quality_summary(results),
        kinds=kinds,
        pool_figures=pool_figures,
        mixed_quality=mixed_summary(results),
    )


# --------------------------------------------------------------------------- files


def write_csv(summary: BenchSummary, results: Sequence[TaskResult], path: Path) -> None:
    """One line per task and row: both metrics, ratios to the references, balance,
    the task's noise and times, the task's model quality per model kind (the same on
    every row of the task), the plan's tables per sharding kind, the task's tables
    larger than a GPU, and each model's figures on the task's mixed-kind ranks."""
    fields = ["task", "pool", "fill_kind", "tables", "gpus", "global_batch", "fill"]
    fields += ["row", "status", "compute_ms", "total_ms", "bound_ms", "noise_compute"]
    fields += ["noise_total", "balance"]
    fields += [f"{m}_x_{ref}" for m in METRICS for ref in REFERENCES]
    fields += ["planning_s", "refine_s", "measure_s", "repeat_cv", "plan_hash", "error"]
    fields += [f"{k}_rank_{m}" for k in KINDS for m in ("spearman", "mape")]
    fields += ["kinds", "oversized"]
    fields += [f"{k}_mixed_{m}" for k in KINDS for m in ("ranks", "spearman", "mape")]

    def num(x: float | None, scale: float = 1.0) -> str:
        return "" if x is None or not math.isfinite(x) else f"{x * scale:.6g}"

    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(fields)
        for t in results:
            noise = (task_noise_of(t, "compute"), task_noise_of(t, "total"))
            refs = {m: references(t, m, summary.best_heuristic[m]) for m in METRICS}
            quality, mixed = [], []
            for k in KINDS:
                q = t.model_quality.get(k)
                quality += [num(q.spearman), num(q.mape)] if q else ["", ""]
                if q is None or t.mixed_kind is None:  # or recorded before the figures
                    mixed += ["", "", ""]
                else:
                    got = pooled(t.mixed_kind.get(k, []))
                    mixed += [str(got["ranks"]), num(got["spearman"]), num(got["mape"])]
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
                        *mixed,
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

"""`shardwise bench`: every planner on held-out tasks, every plan measured (docs/bench.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from shardwise.cli._common import (
    CommOpt,
    MeasureOnOpt,
    deprecated,
    err,
    out,
    progress,
    renamed,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from shardwise.profiler.bench.figures import RowFigures
    from shardwise.profiler.bench.report import BenchSummary
    from shardwise.profiler.bench.results import TaskResult
    from shardwise.profiler.bench.stats import Paired

_SHORT = (
    ("neuroshard", "NS"),
    ("calibrated", "cal"),
    ("bundled", "bun"),
    ("refined", "ref"),
    ("torchrec-measured", "TR-meas"),
    ("torchrec", "TR"),
    ("-tw-cw", "-twcw"),
    ("size-lookup-greedy", "size-lookup"),
    ("-greedy", ""),
)


def short(row: str) -> str:
    """A column header for the per-task table: ``NS[cal+ref]``, ``TR-meas``, ``size``."""
    for long, abbreviated in _SHORT:
        row = row.replace(long, abbreviated)
    return row


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _paired(p: Paired | None) -> tuple[str, str, str]:
    """``0.912``, ``0.871-0.955`` (the 95 % interval) and ``9/3/2`` (W/T/L)."""
    if p is None:
        return "-", "-", "-"
    wtl = f"{p.wins}/{p.ties}/{p.losses}"
    if p.geomean is None:
        return "-", "-", wtl
    ci = f"{p.interval[0]:.3f}-{p.interval[1]:.3f}" if p.interval and p.n > 1 else "-"
    return f"{p.geomean:.3f}", ci, wtl


def task_table(results: list[TaskResult], rows: list[str]) -> Table:
    """Measured max-rank compute (ms) per task and row."""
    from shardwise.profiler.bench.figures import task_noise_of

    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Measured max-rank compute per task, ms (lower is better)",
        caption="fill = our packing's fullest GPU / usable memory; noise = the task's median "
        "CV over repeats; bold = cheapest; NS = neuroshard, TR = torchrec, bun/cal = "
        "bundled/calibrated model, ref = refined; greedy heuristics by their key",
    )
    for col in ("task", "fill", "noise"):
        t.add_column(col, justify="left" if col == "task" else "right", no_wrap=True)
    for name in rows:
        t.add_column(escape(short(name)), justify="right", overflow="fold")
    for task in results:
        ok = [r.compute_max_s for r in task.planners.values() if r.ok and r.compute_max_s]
        best = min(ok) if ok else None
        cells = []
        for name in rows:
            r = task.planners.get(name)
            if r is None:
                cells.append("")
            elif not r.ok:
                cells.append(f"[red]{r.status}[/red]")
            else:
                text = _ms(r.compute_max_s)
                cells.append(f"[bold]{text}[/bold]" if r.compute_max_s == best else text)
        noise = f"{100 * task_noise_of(task):.1f}%"
        t.add_row(task.task, f"{task.fill:.2f}", noise, *cells)
    return t


def figures_table(
    summary: BenchSummary,
    metric: str,
    figures: Sequence[RowFigures] | None = None,
    pool: str | None = None,
    tasks: int | None = None,
) -> Table:
    """Per row: paired geomeans with intervals and W/T/L, balance, the ratio to the
    balance bound (compute), worst task, times; ``figures`` of one ``pool`` if given."""
    what = "max-rank compute" if metric == "compute" else "max-rank compute + comm"
    heuristic = summary.best_heuristic.get(metric) or "none"
    figs = (
        list(figures) if figures is not None else [f for f in summary.figures if f.metric == metric]
    )
    tasks = summary.tasks if tasks is None else tasks
    where = f" on the {pool} pool" if pool else ""
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"{what}{where}: paired geomean ratios over {tasks} tasks, 95 % bootstrap "
        "interval; W/T/L with ties within each task's noise",
        caption=f"TorchRec = torchrec, every sharding kind; heur = the best heuristic "
        f"(best median): {heuristic}; ok/f/s = tasks "
        "measured/failed/skipped; balance = median mean/max measured per-rank compute; "
        "x bound = geomean of compute / the balance bound; "
        "worst = the row's highest ratio to a task's cheapest baseline, >noise = tasks "
        "above it by more than their noise",
    )
    t.add_column("row", no_wrap=True)
    t.add_column("ok/f/s", justify="right", no_wrap=True)
    for ref in ("x TorchRec", "x heur"):
        t.add_column(ref, justify="right", no_wrap=True)
        t.add_column("95% CI", justify="right", no_wrap=True)
        t.add_column("W/T/L", justify="right", no_wrap=True)
    for col in ("balance", "x bound", "worst", ">noise", "plan s", "refine s"):
        t.add_column(col, justify="right", no_wrap=True)
    for row in summary.rows:
        f = next((f for f in figs if f.row == row), None)
        if f is None:
            continue
        t.add_row(
            escape(row),
            f"{f.ok}/{f.failed}/{f.skipped}",
            *_paired(f.vs.get("torchrec")),
            *_paired(f.vs.get("best-heuristic")),
            _num(f.balance_median),
            _num(f.vs_bound),
            _num(f.best_baseline_worst),
            str(f.beyond_noise) if f.best_baseline_worst is not None else "-",
            _num(f.planning_s_median, 2),
            _num(f.refine_s_median, 1),
        )
    return t


def kinds_table(results: list[TaskResult], rows: list[str]) -> Table | None:
    """Per task, the tables of each sharding kind in the plans of the rows that placed
    any table other than whole (the TorchRec rows always), and how many tables no GPU
    of the task holds whole."""
    from shardwise.profiler.bench.results import kinds_text

    shown = [
        name
        for name in rows
        if name.startswith("torchrec")
        or any(set(t.planners[name].kinds) - {"table_wise"} for t in results if name in t.planners)
    ]
    if not shown:
        return None
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Sharding kinds per task (tables of each kind in each row's plan)",
        caption="TW/CW/RW/TWRW/GRID/DP = table-/column-/row-/table-row-wise, grid, "
        "data-parallel; oversized = tables no GPU of the task holds whole",
    )
    t.add_column("task", no_wrap=True)
    t.add_column("oversized", justify="right")
    for name in shown:
        t.add_column(escape(short(name)), overflow="fold")
    for task in results:
        cells = []
        for name in shown:
            r = task.planners.get(name)
            cells.append("" if r is None else kinds_text(r.kinds) or f"[red]{r.status}[/red]")
        t.add_row(task.task, str(task.oversized), *cells)
    return t


def anchor_lines(summary: BenchSummary) -> list[str]:
    """What the anchor is worth: the kinds TorchRec chose, and its restriction's
    ratio to it in both metrics."""
    from shardwise.profiler.bench.results import kinds_text

    if "torchrec" not in summary.rows:
        return []
    lines = [
        "anchor: torchrec = TorchRec's planner offered every sharding kind; its plans held "
        f"{kinds_text(summary.kinds.get('torchrec', {})) or 'no tables'} over "
        f"{summary.tasks} tasks"
    ]
    for row in ("torchrec-tw-cw", "torchrec-measured-tw-cw"):
        if row not in summary.rows:
            continue
        parts = []
        for metric, label in (("compute", "compute"), ("total", "compute + comm")):
            f = summary.figures_of(row, metric)
            geo, ci, wtl = _paired(f.vs.get("torchrec") if f else None)
            parts.append(f"{label} {geo} ({ci}, W/T/L {wtl})")
        lines.append(
            f"  {row} (restricted to table-wise/column-wise; held "
            f"{kinds_text(summary.kinds.get(row, {})) or 'no tables'}) x torchrec: "
            + "; ".join(parts)
        )
    return lines


def quality_table(results: list[TaskResult]) -> Table | None:
    """Per task and model: Spearman's rho and MAPE of the predicted per-rank compute
    against the measured, over the ranks of the task's measured plans."""
    from shardwise.profiler.bench.quality import KINDS

    kinds = [k for k in KINDS if any(k in t.model_quality for t in results)]
    if not kinds:
        return None
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Cost model vs measured per-rank compute (fwd + bwd) on each task's plans",
        caption="rho = Spearman's rank correlation, MAPE = mean absolute % error, over the "
        "ranks holding a shard in every distinct plan the task measured",
    )
    t.add_column("task", no_wrap=True)
    t.add_column("plans", justify="right")
    t.add_column("ranks", justify="right")
    for k in kinds:
        t.add_column(f"{k} rho", justify="right", no_wrap=True)
        t.add_column(f"{k} MAPE", justify="right", no_wrap=True)
    for task in results:
        q0 = next((task.model_quality[k] for k in kinds if k in task.model_quality), None)
        cells = [str(q0.plans), str(q0.ranks)] if q0 else ["-", "-"]
        for k in kinds:
            q = task.model_quality.get(k)
            cells += [_num(q.spearman if q else None, 2), _pct(q.mape if q else None)]
        t.add_row(task.task, *cells)
    return t


def mixed_lines(summary: BenchSummary) -> list[str]:
    """Per model: its per-rank compute on the mixed-kind ranks (a rank holding a kernel
    other than table-wise/column-wise), pooled over the tasks."""
    lines = []
    for kind, q in summary.mixed_quality.items():
        older = (
            f"; {q['unrecorded']} tasks recorded before these figures" if q["unrecorded"] else ""
        )
        if not q["ranks"]:
            what = "none among the measured plans"
        else:
            what = (
                f"{q['ranks']} ranks over {q['tasks']} tasks: Spearman "
                f"{_num(q['spearman'], 2)}, MAPE {_pct(q['mape'])}"
            )
        lines.append(
            f"cost model {kind} on mixed-kind ranks (holding a kernel other than "
            f"table-wise/column-wise, every plan measured): {what}{older}"
        )
    return lines


def print_problems(results: list[TaskResult], most: int = 12) -> None:
    """One line per row without a measured plan: failed, invalid (a planner's bug) or
    skipped refinement, with the first line of why."""
    lines = [
        f"{task.task} {name}: {r.status}: {(r.error or '').splitlines()[0] if r.error else ''}"
        for task in results
        for name, r in task.planners.items()
        if not r.ok
    ]
    for line in lines[:most]:
        cut = line if len(line) <= 200 else line[:199] + "…"
        err.print(escape(cut), highlight=False, soft_wrap=True)
    if len(lines) > most:
        err.print(f"... and {len(lines) - most} more (summary.csv has every one)")


def print_summary(summary: BenchSummary, results: list[TaskResult], quick: bool) -> None:
    out.print(task_table(results, summary.rows))
    kinds = kinds_table(results, summary.rows)
    if kinds is not None:
        out.print(kinds)
    print_problems(results)
    for metric in ("compute", "total"):
        out.print(figures_table(summary, metric))
    for pool, figures in summary.pool_figures.items():
        count = sum(1 for t in results if t.pool == pool)
        out.print(figures_table(summary, "compute", figures, pool, count))
    for line in anchor_lines(summary):
        out.print(line, highlight=False, markup=False)
    table = quality_table(results)
    if table is not None:
        out.print(table)
    for kind, q in summary.model_quality.items():
        out.print(
            f"cost model {kind}: per-rank compute over {q['tasks']} tasks ({q['ranks']} "
            f"ranks): median Spearman {_num(q['spearman_median'], 2)} (lowest "
            f"{_num(q['spearman_min'], 2)}), median MAPE {_pct(q['mape_median'])} "
            f"(highest {_pct(q['mape_max'])})",
            highlight=False,
            markup=False,
        )
    for line in mixed_lines(summary):
        out.print(line, highlight=False, markup=False)
    for key, cal in summary.calibrations.items():
        held = cal.get("heldout") or {}
        base, final = held.get("base") or {}, held.get("final") or {}
        out.print(
            f"calibration {key}: {cal.get('seconds')} s on {cal.get('tables')} tables at "
            f"global batch {cal.get('global_batch')}, phases {'+'.join(cal.get('phases') or [])}; "
            f"held-out plan ranks: per-rank MAPE {_pct(base.get('rank_mape'))} bundled -> "
            f"{_pct(final.get('rank_mape'))} calibrated, σ {_pct(base.get('sigma'))} -> "
            f"{_pct(final.get('sigma'))}, plan-max Spearman "
            f"{_num(base.get('plan_max_spearman'), 2)} -> "
            f"{_num(final.get('plan_max_spearman'), 2)}; verdict: {cal.get('verdict', '-')}",
            highlight=False,
            markup=False,
        )
    if summary.noise_median is not None:
        out.print(f"evaluator noise: median over tasks {100 * summary.noise_median:.1f}%")
    for line in summary.comms:
        out.print(f"comm (evaluator): {line}", highlight=False)
    for target in summary.targets:
        verdict = {True: "[green]met[/green]", False: "[red]not met[/red]", None: "n/a"}
        where = f" ({target.pool} pool)" if target.pool else ""
        text = escape(f"target {target.row}{where}: {target.what}: {target.detail}")
        out.print(f"{text}: {verdict[target.met]}", highlight=False)
    if quick:
        out.print(
            "note: --quick: four small tasks, the bundled model only (no calibration), "
            "8-s refinements; it shows the protocol runs, its figures are not the targets'."
        )
    from shardwise.profiler.bench.report import notes

    for line in notes(summary.device):
        out.print(f"note: {line}", highlight=False)


def _pct(x: object) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, int | float) else "-"


def bench_cmd(
    ctx: typer.Context,
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="Task spec: 'full' (2 held-out pools x 3 shapes x tight/slack memory x 2, "
            "about 25 min on 2 cores), 'quick', 'heavy' (3 tight tasks of 60-100 tables "
            "up to 1 GiB on 8-16 GPUs, about an hour), 'industrial' (2 tight tasks of 40 "
            "tables, some larger than a GPU, on 8 GPUs, each calibrated 5 min), 'anchor' "
            "(the heavy and "
            "industrial pools for --planners torchrec,torchrec-tw-cw), or a .yaml/.json "
            "spec file (docs/bench.md).",
        ),
    ] = "full",
    quick: Annotated[
        bool,
        typer.Option("--quick", help="Same as --tasks quick: 4 small tasks, bundled model only."),
    ] = False,
    planners: Annotated[
        str,
        typer.Option(  # "\\[": rich would take "[...]" for markup and drop it
            help="'all', or a comma list of planners and rows such as torchrec, neuroshard "
            "(every variant of the spec), neuroshard-tw-cw (its table-wise/column-wise "
            "variants), neuroshard\\[calibrated+refined], neuroshard\\[calibrated-tw-cw], "
            "torchrec+refined."
        ),
    ] = "all",
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="Results folder; rerunning into it resumes where it stopped."
        ),
    ] = Path("bench"),
    comm: CommOpt = "auto",
    calibration_minutes: Annotated[
        float | None,
        typer.Option(
            "--calibration-minutes",
            min=0.0,
            help="Calibration budget per pool (0: none, no calibrated rows).",
            show_default="the spec's",
        ),
    ] = None,
    refine_budget: Annotated[
        float | None,
        typer.Option(
            "--refine-budget",
            min=1.0,
            help="Seconds of measured refinement per refined plan.",
            show_default="the spec's",
        ),
    ] = None,
    measure_on: MeasureOnOpt = None,
    old_device: Annotated[str | None, deprecated("--device", "--measure-on")] = None,
) -> None:
    """Plan held-out tasks with every planner and measure every plan.

    Tasks draw T tables from pools of table families the bundled cost model never
    saw, for W GPUs whose memory the best packing fills 85-95 % (tight) or about half
    (slack), at the job's batch (the industrial pool's GPUs are sized by the tables'
    total, so its giant tables fit no GPU whole). Every ratio is to TorchRec's planner
    offered every sharding kind; its table-wise/column-wise restriction is a row beside
    it. NeuroShard plans once with the bundled model and once
    with a model calibrated here on each pool (the heavy and industrial runs: on each
    task's own tables, as `shardwise calibrate` does for a job), each also refined by
    measurement, and restricted to table-wise/column-wise where the spec asks
    (the -tw-cw rows).
    The evaluator measures every plan side by side: compute measured, comm from
    --comm. Prints paired geomean ratios to TorchRec and the best heuristic with 95 %
    bootstrap intervals, wins/ties/losses within the evaluator's noise, balance, the
    target checks (per pool on the heavy and industrial pools, and every kind against
    its table-wise/column-wise restriction), and each cost model's per-rank Spearman
    and MAPE on every task's measured plans, on its mixed-kind ranks apart (pooled over
    runs by benchmarks/kinds_fidelity.py). Writes into --out: bench.json (the run's settings),
    pools/POOL.yaml, models/POOL.pt (or TASK.pt) and calibration/ (calibrated models and samples),
    plans/TASK/ROW.json, results.jsonl (one line a task), summary.csv, summary.json
    and chart.png. Stop it any time: a rerun with the same --out resumes.

    Example: shardwise bench --quick --out bench-quick
    """
    from shardwise.basics import UserError
    from shardwise.profiler.bench.rows import resolve_rows
    from shardwise.profiler.bench.run import run_bench
    from shardwise.profiler.bench.spec import load_spec, parse_spec, spec_json

    device = renamed(ctx, "measure_on", measure_on, old_device)
    if quick and tasks not in ("full", "quick"):
        raise UserError("give either --quick or --tasks SPEC, not both.")
    spec, base = load_spec("quick" if quick else tasks)
    changes: dict[str, float] = {}
    if calibration_minutes is not None:
        changes["calibration_minutes"] = calibration_minutes
    if refine_budget is not None:
        changes["refine_budget_s"] = refine_budget
    if changes:  # validated as a spec file's fields are
        spec = parse_spec(json.dumps({**spec_json(spec), **changes}), "the options")
    rows = resolve_rows(planners, spec)
    shapes = ", ".join(f"T{s.tables} x W{s.gpus}" for s in spec.shapes)
    out.print(
        f"{spec.task_count()} tasks ({', '.join(p.key for p in spec.pools)}; {shapes}; "
        f"memory {', '.join(spec.fills)}; {spec.tasks} each), {spec.batch_text()}, "
        f"{spec.repeats} side-by-side repeats, --comm {comm}; "
        f"{len(rows)} rows: {', '.join(r.name for r in rows)}; results in {out_dir}",
        highlight=False,
        markup=False,
    )
    if spec.calibrates():
        out.print(
            f"calibration: {spec.calibration_minutes:g} min per {spec.calibrate_on} on this "
            f"machine; refinement: {spec.refine_budget_s:g} s per refined plan",
            highlight=False,
        )
    else:
        out.print(
            "calibration: none (the bundled model only); refinement: "
            f"{spec.refine_budget_s:g} s per refined plan",
            highlight=False,
        )
    start = time.perf_counter()
    with progress() as bar:
        job = bar.add_task("starting", total=spec.task_count())
        run = run_bench(
            spec,
            rows,
            out_dir,
            spec_base=base,
            comm=comm,
            device=device,
            on_step=lambda what: bar.update(job, description=what),
            on_task=lambda _result, _fresh: bar.advance(job),
        )
    print_summary(run.summary, run.results, quick=quick or tasks == "quick")
    elapsed = time.perf_counter() - start
    if run.skipped:
        err.print(f"{run.skipped} tasks were already in {out_dir} and were not rerun.")
    out.print(
        f"ran {run.ran} tasks in {elapsed:.0f} s; wrote " + ", ".join(str(p) for p in run.outputs),
        highlight=False,
        markup=False,
    )

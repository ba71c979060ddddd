"""`shardwise bench`: every planner on held-out tasks, every plan measured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from shardwise.cli._common import (
    MeasureOnOpt,
    batch_check,
    calibrate_command,
    choose_model,
    deprecated,
    err,
    model_option,
    out,
    progress,
    renamed,
)
from shardwise.planner.tables import TableSpec
from shardwise.profiler.bench_report import (
    REFERENCE_LABELS,
    REFERENCES,
    BenchSummary,
    notes,
)
from shardwise.profiler.bench_results import TaskResult

_SHORT = {
    "torchrec": "xTR",
    "torchrec-measured": "xTR-meas",
    "best-heuristic": "xheur",
    "bound": "xbound",
}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def task_table(results: list[TaskResult], planners: list[str]) -> Table:
    """Measured max-rank cost (ms) per task and planner, and the task's bound."""
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Measured max-rank embedding cost per task, ms (lower is better)",
        caption="bound = sum of single-table compute / W; 1 table = the costliest table "
        "alone (no table-wise plan beats it); bold = cheapest plan of the task",
    )
    t.add_column("task", no_wrap=True)
    t.add_column("bound", justify="right")
    t.add_column("1 table", justify="right")
    for name in planners:
        t.add_column(name, justify="right", overflow="fold")
    for task in results:
        cells = []
        ok = [r.max_s for r in task.planners.values() if r.ok and r.max_s]
        best = min(ok) if ok else None
        for name in planners:
            r = task.planners.get(name)
            if r is None or not r.ok:
                cells.append("[red]failed[/red]" if r is not None else "")
            else:
                text = _ms(r.max_s)
                cells.append(f"[bold]{text}[/bold]" if r.max_s == best else text)
        t.add_row(task.task, _ms(task.bound_s), _ms(task.heaviest_table_s), *cells)
    return t


def summary_table(summary: BenchSummary) -> Table:
    """Per planner: geomean ratios to each reference, failures, planning time, CV."""
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"Geomean over {summary.tasks} tasks of the measured cost ratio (lower is better)",
        caption="x = measured max-rank cost / the reference's on the same task; "
        + "; ".join(f"{_SHORT[r]}: {REFERENCE_LABELS[r].removeprefix('x ')}" for r in REFERENCES)
        + ". best = tasks where the planner's plan measured cheapest.",
    )
    t.add_column("planner", no_wrap=True)
    for ref in REFERENCES:
        t.add_column(_SHORT[ref], justify="right", no_wrap=True)
    for col in ("ok/fail", "best", "plan s med", "plan s max", "eval CV"):
        t.add_column(col, justify="right", no_wrap=True)
    for p in sorted(summary.per_planner, key=lambda p: p.geomeans["bound"] or float("inf")):
        t.add_row(
            p.planner,
            *(_ratio(p.geomeans[ref]) for ref in REFERENCES),
            f"{p.tasks_ok}/{p.failures}",
            str(p.wins),
            "-" if p.planning_s_median is None else f"{p.planning_s_median:.3f}",
            "-" if p.planning_s_max is None else f"{p.planning_s_max:.3f}",
            "-" if p.repeat_cv_median is None else f"{100 * p.repeat_cv_median:.1f}%",
        )
    return t


def print_summary(summary: BenchSummary, results: list[TaskResult]) -> None:
    out.print(task_table(results, summary.planners))
    out.print(summary_table(summary))
    cv = summary.evaluator_cv
    if cv["median"] is not None:
        out.print(
            f"evaluator repeatability (CV of the max-rank cost over repeats, "
            f"{int(cv['plans'] or 0)} measured plans): median {100 * cv['median']:.1f}%, "
            f"p90 {100 * (cv['p90'] or 0):.1f}%, max {100 * (cv['max'] or 0):.1f}%"
            + (
                f"; balance bound median {100 * summary.bound_cv_median:.1f}%"
                if summary.bound_cv_median is not None
                else ""
            )
        )
    for check in summary.targets:
        verdict = {True: "[green]met[/green]", False: "[red]not met[/red]", None: "n/a"}[check.met]
        value = "-" if check.value is None else f"{check.value:.3f}"
        out.print(
            f"target {check.planner}: {check.what} = {value} (<= {check.limit}, "
            f"{check.n} tasks): {verdict}"
        )
    for line in notes(summary.device):
        out.print(f"note: {line}")


def bench_cmd(
    ctx: typer.Context,
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="Task spec: 'full' (T in 10,20,40,80,160 x W in 2,4,8 x 3 tasks), "
            "'quick', or a .yaml/.json file {tables: [..], gpus: [..], tasks, repeats, "
            "batch_size_per_rank, memory_factor, seed, pool: {seed, count, "
            "max_table_bytes, file}}.",
        ),
    ] = "full",
    quick: Annotated[
        bool, typer.Option("--quick", help="Same as --tasks quick: 4 tasks, minutes.")
    ] = False,
    planners: Annotated[
        str, typer.Option(help="'all' (every registered planner) or a comma list.")
    ] = "all",
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="Results folder; rerunning into it resumes where it stopped."
        ),
    ] = Path("bench"),
    model_path: Annotated[
        Path | None, model_option("for planners that search with one", chosen=True)
    ] = None,
    measure_on: MeasureOnOpt = None,
    old_device: Annotated[str | None, deprecated("--device", "--measure-on")] = None,
) -> None:
    """Plan held-out tasks with every planner and measure every plan.

    Each task draws T tables the bundled cost model never saw and sets a per-GPU
    memory limit; every planner plans it (timed), then the evaluator measures all
    plans side by side, interleaved, so the host's drift hits them alike. Prints
    the measured cost per task and planner, ratios to TorchRec, TorchRec with
    measured costs, the best greedy heuristic and the balance bound (geomeans),
    planning times and the evaluator's repeatability. Writes into --out: bench.json
    (the run's settings), pool.yaml (the held-out tables), plans/TASK/PLANNER.json,
    results.jsonl (one line a task), summary.csv, summary.json and chart.png. Stop it
    any time: a rerun with the same --out skips the tasks already finished.

    Example: shardwise bench --quick --planners all --out bench-quick
    """
    from shardwise.profiler.bench import POOL_FILE, resolve_planners, run_bench
    from shardwise.profiler.bench_spec import load_spec

    device = renamed(ctx, "measure_on", measure_on, old_device)

    if quick and tasks not in ("full", "quick"):
        from shardwise.basics import UserError

        raise UserError("give either --quick or --tasks SPEC, not both.")
    spec, base = load_spec("quick" if quick else tasks)
    names = resolve_planners(planners)
    out.print(
        f"{spec.task_count()} tasks (T {spec.tables} x W {spec.gpus} x {spec.tasks}), "
        f"{len(names)} planners ({', '.join(names)}), {spec.repeats} side-by-side repeats, "
        f"batch {spec.batch_size_per_rank}/rank; results in {out_dir}"
    )

    def pick(pool: list[TableSpec]) -> Path | None:
        """The model for the held-out pool, announced; its file (None: bundled)."""
        from shardwise.planner.costmodel.batch_range import batch_note, trained_batches

        calibrate = calibrate_command(out_dir / POOL_FILE, max(spec.gpus), spec.batch_size_per_rank)
        choice = choose_model(model_path, pool, calibrate, device)
        if choice is None:
            return None
        # Each task prices at its own W; the smallest and largest global batch decide.
        batches = sorted(spec.batch_size_per_rank * w for w in spec.gpus)
        trained = trained_batches(choice.model.metadata)
        outside = [b for b in (batches[0], batches[-1]) if batch_note(trained, b) is not None]
        batch_check(choice, outside[-1] if outside else batches[-1], None, calibrate)
        path: Path | None = choice.path
        return path

    start = time.perf_counter()
    with progress() as bar:
        job = bar.add_task("starting", total=spec.task_count())
        run = run_bench(
            spec,
            names,
            out_dir,
            spec_base=base,
            pick_model=pick,
            device=device,
            on_step=lambda what: bar.update(job, description=what),
            on_task=lambda _result, _fresh: bar.advance(job),
        )
    print_summary(run.summary, run.results)
    elapsed = time.perf_counter() - start
    if run.skipped:
        err.print(f"{run.skipped} tasks were already in {out_dir} and were not rerun.")
    out.print(
        f"ran {run.ran} tasks in {elapsed:.0f} s; wrote " + ", ".join(str(p) for p in run.outputs)
    )

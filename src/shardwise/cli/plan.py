"""`shardwise plan`: place tables on GPUs, with the per-rank and comparison tables."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from shardwise.basics import UserError, check_output_path, format_bytes, parse_bytes
from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    REPEATS_HELP,
    TABLES_HELP,
    calibrate_command,
    check_plot_path,
    cost_predictor,
    deprecated,
    err,
    model_option,
    out,
    progress,
    renamed,
    wrote_then_failed,
)
from shardwise.planner.base import Planner, PlannerOptions, run_planner
from shardwise.planner.plan import (
    DEFAULT_MEMORY_RESERVE,
    InvalidPlanError,
    Plan,
    Topology,
    save_plan,
)
from shardwise.planner.registry import (
    MEASURED_PLANNERS,
    MODEL_PLANNERS,
    get_planner,
    planner_names,
)
from shardwise.planner.report import PlanSummary, plot_plan, rank_loads, summarize
from shardwise.planner.tables import TableSpec, load_tables

if TYPE_CHECKING:
    from shardwise.profiler.bench_measure import SingleShardCosts
    from shardwise.profiler.evaluate import Evaluation

DEFAULT_PLANNER = "neuroshard"
PLANNER_HELP = (
    f"One of: {', '.join(planner_names())}. torchrec-measured first measures each table "
    "alone here (FBGEMM kernels at 128 samples per rank, seconds for 80 tables); "
    "--compare includes it with --measure."
)


def _rank_table(plan: Plan, tables: list[TableSpec]) -> Table:
    has_cost = plan.predicted is not None
    t = Table(
        title=f"{plan.planner}: {len(plan.tables)} tables on {plan.world_size} GPUs, "
        f"plan {plan.hash[:8]}"
    )
    for col in ("rank", "tables", "split", "memory", "mem %", "width", "lookups/sample"):
        t.add_column(col, justify="right")
    if has_cost:
        t.add_column("predicted ms", justify="right")
    cap = plan.topology.usable_bytes
    for r in rank_loads(plan, tables):
        row = [
            str(r.rank),
            str(r.tables),
            str(r.shards),
            format_bytes(r.memory_bytes),
            f"{100 * r.memory_bytes / cap:.0f}%",
            str(r.width),
            f"{r.lookups:,.0f}",
        ]
        if has_cost:
            row.append(f"{1e3 * (r.predicted_seconds or 0.0):.3f}")
        t.add_row(*row)
    return t


def _compare_table(
    rows: list[PlanSummary],
    failures: dict[str, str],
    measured: dict[str, Evaluation | None] | None = None,
    bound_s: float = 0.0,
) -> Table:
    priced = bool(rows) and all(r.predicted_max_seconds is not None for r in rows)

    def score(r: PlanSummary) -> float:
        return (r.predicted_max_seconds or 0.0) if priced else r.max_lookups

    def real(r: PlanSummary) -> float:
        ev = (measured or {}).get(r.planner)
        return ev.max_s if ev is not None else float("inf")

    best = min((score(r) for r in rows), default=0.0)
    best_real = min((real(r) for r in rows), default=float("inf"))
    caption = (
        "predicted = the cost model's max-rank embedding cost (the model named on stderr, "
        "128 samples per rank); measure with --measure or `shardwise evaluate`"
        if priced
        else "lookups = cols x pooling per sample: a cost proxy (no cost model)"
    )
    if measured is not None:
        caption = (
            "measured = the evaluator's max-rank cost, plans interleaved over repeats "
            f"(CPU figures); CV = its spread over repeats; bound = sum of single-table "
            f"compute / W = {1e3 * bound_s:.2f} ms. " + caption
        )
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Planners side by side, worst rank of each (lower is better)",
        caption=caption,
    )
    t.add_column("planner", no_wrap=True)
    cols: tuple[str, ...] = ("predicted ms", "vs best") if priced else ("lookups", "vs best")
    if measured is not None:
        cols = ("measured ms", "vs best", "CV", "x bound", *cols)
    for col in (*cols, "imbal.", "width", "memory", "split", "plan s"):
        t.add_column(col, justify="right", no_wrap=True)
    order = sorted(rows, key=lambda r: (real(r), score(r)))
    for r in order:
        cells = [
            f"{1e3 * score(r):.2f}" if priced else f"{r.max_lookups:,.0f}",
            f"{score(r) / best:.2f}x" if best else "-",
        ]
        if measured is not None:
            ev = measured.get(r.planner)
            cells = [
                f"{1e3 * ev.max_s:.2f}" if ev else "failed",
                f"{ev.max_s / best_real:.2f}x" if ev else "-",
                f"{ev.repeat_cv:.0%}" if ev else "-",
                f"{ev.max_s / bound_s:.2f}" if ev and bound_s else "-",
                *cells,
            ]
        t.add_row(
            r.planner,
            *cells,
            f"{(r.predicted_imbalance if priced else r.lookup_imbalance):.2f}",
            str(r.max_width),
            format_bytes(r.max_memory_bytes),
            str(r.column_wise_tables),
            f"{r.planning_seconds:.2f}",
        )
    for name, why in failures.items():
        t.add_row(name, f"[red]failed: {why}[/red]")
    return t


def _measure(
    plans: dict[str, Plan], tables: list[TableSpec], repeats: int
) -> tuple[dict[str, Evaluation | None], float]:
    """Every plan measured by the evaluator, interleaved (drift hits all alike)."""
    from shardwise.profiler.evaluate import DEFAULT_BATCH_PER_RANK, evaluate_side_by_side

    with progress() as bar:
        task = bar.add_task("measuring", total=None)
        side = evaluate_side_by_side(
            list(plans.values()),
            tables,
            batch_size_per_rank=DEFAULT_BATCH_PER_RANK,
            repeats=repeats,
            on_step=lambda what: bar.update(task, description=what),
        )
    for name, why in zip(plans, side.errors, strict=True):
        if why:
            err.print(f"[yellow]note:[/yellow] {name}'s plan could not be measured: {why}")
    return dict(zip(plans, side.evaluations, strict=True)), side.bound_s


def _give_measurements(
    planners: Mapping[str, Planner], batch_per_rank: int, world: int
) -> SingleShardCosts | None:
    """Hand ``torchrec-measured`` its single-shard costs, measured here on first use at
    the batch every other figure of `shardwise plan` is at (the cost model's and the
    evaluator's ``batch_per_rank`` per rank): the job's own batch, 65,536 per rank,
    would take minutes per table on a CPU. None when no such planner runs."""
    from shardwise.planner.torchrec_measured import TorchRecMeasuredPlanner

    takers = [p for p in planners.values() if isinstance(p, TorchRecMeasuredPlanner)]
    if not takers:
        return None
    from shardwise.profiler.bench_measure import SingleShardCosts

    costs = SingleShardCosts()
    for p in takers:
        p.measure = lambda spec, cols, _batch: costs(spec, cols, batch_per_rank * world)
    return costs


def plan_cmd(
    ctx: typer.Context,
    tables_path: Annotated[Path, typer.Argument(help=f"{TABLES_HELP} to place.")],
    gpus: Annotated[int, typer.Option(min=1, help="Number of GPUs (ranks).")] = 8,
    gpu_memory: Annotated[
        str, typer.Option(help="Memory per GPU, e.g. 16GiB, 80GB, 17179869184.")
    ] = "16GiB",
    planner: Annotated[str, typer.Option(help=PLANNER_HELP)] = DEFAULT_PLANNER,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write plan.json.")] = Path(
        "plan.json"
    ),
    plot: Annotated[
        Path | None, typer.Option(help="Also draw per-rank memory and load as a PNG here.")
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Plan with every planner and print them side by side; "
            "--out gets the --planner's plan.",
        ),
    ] = False,
    reserve: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.95,
            help="Share of each GPU's memory kept free for optimizer state, "
            "buffers and activations.",
        ),
    ] = DEFAULT_MEMORY_RESERVE,
    batch_per_rank: Annotated[
        int,
        typer.Option(
            min=1,
            help=f"{BATCH_PER_RANK_HELP} the job trains with; recorded in the plan, the "
            "workers' default batch, and what TorchRec's planner sizes its buffers by.",
        ),
    ] = 65536,
    target_device: Annotated[
        str,
        typer.Option(
            help="What the plan is for: cuda (GPUs), or cpu for CPU-only training "
            "(the shards' placements)."
        ),
    ] = "cuda",
    seed: Annotated[int, typer.Option(help="Seed for planners that draw (random).")] = 0,
    predict: Annotated[
        bool,
        typer.Option(
            "--predict/--no-predict",
            help="Price every plan with the cost model (see --model) at the "
            "evaluator's 128 samples per rank.",
        ),
    ] = True,
    model_path: Annotated[
        Path | None,
        model_option("that prices the plans and that neuroshard searches with", chosen=True),
    ] = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Also measure every plan with the evaluator (real FBGEMM kernels and "
            "all-to-alls, 128 samples per rank), plans interleaved over the repeats; "
            "about a minute for 80 tables on 8 GPUs and 8 planners on 2 CPU cores. "
            "With --compare, torchrec-measured plans too.",
        ),
    ] = False,
    repeats: Annotated[int, typer.Option(min=1, help=f"{REPEATS_HELP} (with --measure).")] = 3,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
    old_device: Annotated[str | None, deprecated("--device", "--target-device")] = None,
) -> None:
    """Place the tables on GPUs and write the plan.

    Writes plan.json to --out and, with --plot, a PNG of per-GPU memory and load.
    Prints one row per GPU: tables, column-wise splits, memory, summed width and
    lookups per sample (and predicted cost for planners with a cost model).

    Example: shardwise plan tables.yaml --gpus 8 --gpu-memory 4GiB --out plan.json
    --plot plan.png (NeuroShard with the bundled cost model); add --compare --measure
    to see every planner's plan predicted and measured side by side.
    """
    batch_per_rank = renamed(ctx, "batch_per_rank", batch_per_rank, old_batch_size)
    target_device = renamed(ctx, "target_device", target_device, old_device)
    if target_device not in ("cuda", "cpu"):
        raise UserError(f"--target-device must be cuda or cpu, not {target_device!r}.")
    # Before any work: a bad path must not cost minutes of planning and measuring.
    check_output_path(out_path, "--out", "plan.json")
    check_plot_path(plot)
    topology = Topology(
        gpus=gpus,
        gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory"),
        device=target_device,
        batch_size_per_rank=batch_per_rank,
        memory_reserve=reserve,
    )
    if planner not in planner_names():
        get_planner(planner)  # fails with the list of names
    searching = planner in MODEL_PLANNERS or (compare and bool(MODEL_PLANNERS))
    tables = load_tables(tables_path)
    # Plans are priced at the evaluator's batch per rank, which --measure measures at.
    priced_per_rank = PlannerOptions().batch_size_per_rank
    predictor = None
    if predict or searching:
        calibrate = calibrate_command(tables_path, gpus, priced_per_rank)
        predictor = cost_predictor(
            model_path, tables, calibrate, priced_per_rank * gpus, batch_per_rank * gpus
        )
    if predictor is None and planner in MODEL_PLANNERS:
        raise UserError(
            f"the {planner} planner searches with a cost model, and none is installed; "
            "give one with --model (see `shardwise pretrain`) or choose another --planner."
        )
    options = PlannerOptions(seed=seed, predictor=predictor, batch_size_per_rank=priced_per_rank)
    # Planners are built (and their modules imported) before any timing starts.
    names = [planner]
    if compare:
        names += [n for n in planner_names() if n != planner]
    if predictor is None:
        names = [n for n in names if n not in MODEL_PLANNERS]
    if planner not in MEASURED_PLANNERS and not measure:
        # They measure every table first: --compare asks for that only with --measure.
        left_out = [n for n in names if n in MEASURED_PLANNERS]
        names = [n for n in names if n not in MEASURED_PLANNERS]
        if left_out:
            err.print(
                f"note: {', '.join(left_out)} left out: it plans from measured single-table "
                "costs; add --measure to measure them here."
            )
    planners = {n: get_planner(n, options) for n in names}
    costs = _give_measurements(planners, options.batch_size_per_rank, topology.gpus)
    if not predict:
        predictor = None
    plans: dict[str, Plan] = {}
    summaries: list[PlanSummary] = []
    failures: dict[str, str] = {}
    for name, chosen in planners.items():
        measured_before = costs.seconds if costs is not None else 0.0
        try:
            run = run_planner(chosen, tables, topology, predictor)
        except InvalidPlanError:
            raise
        except UserError as e:
            if name == planner:
                raise
            failures[name] = str(e).split(";")[0]
            continue
        plans[name] = run.plan
        measuring = (costs.seconds if costs is not None else 0.0) - measured_before
        summaries.append(summarize(run.plan, tables, run.seconds - measuring))
    if costs is not None and costs.calls:
        err.print(
            f"note: measured {costs.calls} single-table kernels for torchrec-measured in "
            f"{costs.seconds:.1f} s (not counted as its planning time)."
        )
    result = plans[planner]
    out.print(_rank_table(result, tables))
    stats = getattr(planners[planner], "last_stats", None)
    if stats is not None:
        out.print(
            f"{planner} search: {stats.candidates} split states in {stats.seconds:.2f} s, "
            f"{stats.split_tables} table(s) split column-wise, width cap "
            f"{stats.best_scale:g} x mean, local search -{stats.refine_gain:.1%}"
        )
    if compare or measure:
        measured, bound = _measure(plans, tables, repeats) if measure else (None, 0.0)
        out.print(_compare_table(summaries, failures, measured, bound))
    save_plan(result, out_path)
    out.print(f"wrote {out_path} (planner {planner}, hash {result.hash[:8]})")
    if plot is not None:
        try:
            plot_plan(result, tables, plot)
        except (OSError, ValueError) as e:
            raise wrote_then_failed(out_path, plot, "--plot", e) from None
        out.print(f"wrote {plot}")

"""`shardwise plan`: place tables on GPUs, with the per-rank and comparison tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardwise.basics import UserError, check_output_path, parse_bytes
from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    REPEATS_HELP,
    TABLES_HELP,
    CommOpt,
    calibrate_command,
    check_plot_path,
    choose_comm,
    cost_predictor,
    deprecated,
    err,
    model_option,
    out,
    progress,
    renamed,
    warn_plan_kinds,
    wrote_then_failed,
)
from shardwise.cli.plan_tables import compare_table, rank_table
from shardwise.planner.base import Planner, PlannerOptions, run_planner
from shardwise.planner.plan import InvalidPlanError, Plan, save_plan
from shardwise.planner.registry import (
    MEASURED_PLANNERS,
    MODEL_PLANNERS,
    TW_CW_PLANNERS,
    get_planner,
    planner_names,
)
from shardwise.planner.report import PlanSummary, plot_plan, summarize
from shardwise.planner.tables import TableSpec, load_tables
from shardwise.planner.topology import DEFAULT_MEMORY_RESERVE, Topology

if TYPE_CHECKING:
    from shardwise.planner.comm.model import CommModel
    from shardwise.planner.costmodel import CostPredictor
    from shardwise.profiler.bench.measure import SingleShardCosts
    from shardwise.profiler.evaluate import Evaluation

DEFAULT_PLANNER = "neuroshard"
PLANNER_HELP = (
    f"One of: {', '.join(planner_names())}. torchrec-measured first measures each table "
    "alone here (FBGEMM kernels at the job's batch, --batch-per-rank x --gpus; seconds "
    "for 80 tables at 1,024); --compare includes it with --measure."
)


def _measure(
    plans: dict[str, Plan],
    tables: list[TableSpec],
    repeats: int,
    batch_per_rank: int,
    comm: CommModel | None,
) -> tuple[dict[str, Evaluation | None] | None, float]:
    """Every plan measured by the evaluator at the job's batch, interleaved (drift hits
    all alike); nothing (with the reason) when this machine cannot measure that batch
    in reasonable time or memory."""
    from shardwise.profiler.evaluate import evaluate_side_by_side
    from shardwise.profiler.refine.measured import measurable

    world = next(iter(plans.values())).world_size
    why = measurable(tables, batch_per_rank, world, budget_s=MEASURE_ROUND_LIMIT_S)
    if why is not None:
        err.print(f"note: --measure skipped: {why}.")
        return None, 0.0

    # A plan two rows share (a refinement that kept its start) is measured once.
    unique = list({p.hash: p for p in plans.values()}.values())
    with progress() as bar:
        task = bar.add_task("measuring", total=None)
        side = evaluate_side_by_side(
            unique,
            tables,
            batch_size_per_rank=batch_per_rank,
            repeats=repeats,
            on_step=lambda what: bar.update(task, description=what),
            comm=comm,
        )
    by_hash = {p.hash: i for i, p in enumerate(unique)}
    for name, plan in plans.items():
        why = side.errors[by_hash[plan.hash]]
        if why:
            err.print(f"[yellow]note:[/yellow] {name}'s plan could not be measured: {why}")
    return {n: side.evaluations[by_hash[p.hash]] for n, p in plans.items()}, side.bound_s


def _give_measurements(planners: Mapping[str, Planner]) -> SingleShardCosts | None:
    """Hand ``torchrec-measured`` its single-shard costs, measured here on first use at
    the job's batch, as every other figure of `shardwise plan` is. None when no such
    planner runs."""
    from shardwise.planner.baselines.torchrec_measured import TorchRecMeasuredPlanner

    takers = [p for p in planners.values() if isinstance(p, TorchRecMeasuredPlanner)]
    if not takers:
        return None
    from shardwise.profiler.bench.measure import SingleShardCosts

    costs = SingleShardCosts()
    for p in takers:
        p.measure = costs  # at the batch each shard's kernel reads (global, or the rank's)
    return costs


def plan_cmd(
    ctx: typer.Context,
    tables_path: Annotated[Path, typer.Argument(help=f"{TABLES_HELP} to place.")],
    gpus: Annotated[int, typer.Option(min=1, help="Number of GPUs (ranks).")] = 8,
    gpus_per_host: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="GPUs per host (a DLRMJob's gpusPerWorker): the job is --gpus / this many "
            "hosts. Table-row-wise shards stay within a host, and comm crosses hosts over the "
            "slower link (docs/comm.md).",
            show_default="one host holds every GPU",
        ),
    ] = None,
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
    compare_with: Annotated[
        str | None,
        typer.Option(
            "--compare-with",
            help="Compare with these planners only (comma-separated names, e.g. "
            "torchrec,size-greedy); implies --compare.",
            show_default="every planner",
        ),
    ] = None,
    reserve: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.95,
            help="Share of each GPU's memory kept free for what the memory rule does not "
            "count: activations, CUDA/NCCL context, fragmentation (docs/memory.md).",
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
            help="Price every plan with the cost model (see --model) at the job's batch.",
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
            help="Also measure every plan with the evaluator (real FBGEMM kernels at the "
            "job's batch, plus the --comm all-to-all), plans interleaved over the repeats; "
            "about a minute for 80 tables on 8 GPUs, 8 planners and 128 per rank on 2 CPU "
            "cores. With --compare, torchrec-measured plans too.",
        ),
    ] = False,
    repeats: Annotated[int, typer.Option(min=1, help=f"{REPEATS_HELP} (with --measure).")] = 3,
    comm: CommOpt = "auto",
    refine: Annotated[
        str,
        typer.Option(
            help="Measured refinement of the --planner's plan (docs/refinement.md): "
            "measured times each rank's fused kernel here at the job's batch, cuts the "
            "straggler's hot table row-wise or makes a row-wise table whole where "
            "measurement says so (never for a -tw-cw planner), and moves tables off the "
            "measured straggler, all within --refine-budget; auto does so for "
            "neuroshard's plan when this machine runs the job (--target-device cpu, or "
            "cuda with a GPU here); none never.",
        ),
    ] = "auto",
    refine_budget: Annotated[
        float,
        typer.Option(min=1.0, help="Seconds measured refinement may take, all included."),
    ] = 60.0,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
    old_device: Annotated[str | None, deprecated("--device", "--target-device")] = None,
) -> None:
    """Place the tables on GPUs and write the plan.

    Writes plan.json to --out and, with --plot, a PNG of per-GPU memory and load.
    Prints one row per GPU: its tables by kind, memory, summed width and lookups per
    sample (and predicted cost for planners with a cost model). A table no GPU holds
    whole is placed row-wise (table-row-wise within a host when one holds it).

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
    if gpus_per_host is not None and gpus % gpus_per_host:
        raise UserError(
            f"--gpus {gpus} is not a whole number of hosts of --gpus-per-host "
            f"{gpus_per_host}; give a multiple of it."
        )
    topology = Topology(
        gpus=gpus,
        gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory"),
        device=target_device,
        batch_size_per_rank=batch_per_rank,
        memory_reserve=reserve,
        gpus_per_host=gpus_per_host,
    )
    if planner not in planner_names():
        get_planner(planner)  # fails with the list of names
    compare = compare or compare_with is not None
    refining = _refine_mode(refine, target_device, planner)
    searching = planner in MODEL_PLANNERS or (compare and bool(MODEL_PLANNERS))
    tables = load_tables(tables_path)
    # Everything is priced, searched and measured at the job's batch (docs/design.md §6).
    predictor: CostPredictor | None = None
    if predict or searching:
        calibrate = calibrate_command(tables_path, gpus, batch_per_rank)
        predictor = cost_predictor(
            model_path, tables, calibrate, batch_per_rank * gpus, batch_per_rank * gpus
        )
    if predictor is None and planner in MODEL_PLANNERS:
        raise UserError(
            f"the {planner} planner searches with a cost model, and none is installed; "
            "give one with --model (see `shardwise pretrain`) or choose another --planner."
        )
    # One declared comm for the search, the prices and the evaluator (docs/comm.md).
    plan_comm = choose_comm(
        comm, world=gpus, device=target_device, predictor=predictor, measuring=False
    )
    if predictor is not None:
        predictor.comm_model = plan_comm
    options = PlannerOptions(seed=seed, predictor=predictor)
    # Planners are built (and their modules imported) before any timing starts.
    names = [planner]
    if compare_with is not None:
        wanted = [n.strip() for n in compare_with.split(",") if n.strip()]
        for n in wanted:
            if n not in planner_names():
                get_planner(n)  # fails with the list of names
        names += [n for n in dict.fromkeys(wanted) if n != planner]
    elif compare:
        names += [n for n in planner_names() if n != planner]
    if predictor is None:
        names = [n for n in names if n not in MODEL_PLANNERS]
    if planner not in MEASURED_PLANNERS and not measure:
        # They measure every table first: --compare asks for that only with --measure.
        left_out = [n for n in names if n in MEASURED_PLANNERS]
        names = [n for n in names if n not in MEASURED_PLANNERS]
        if left_out:
            err.print(
                f"note: {', '.join(left_out)} left out: "
                f"{'they plan' if len(left_out) > 1 else 'it plans'} from measured "
                "single-shard costs; add --measure to measure them here."
            )
    planners = {n: get_planner(n, options) for n in names}
    costs = _give_measurements(planners)
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
            f"note: measured {costs.calls} single-shard kernels for torchrec-measured in "
            f"{costs.seconds:.1f} s (not counted as its planning time)."
        )
    result = plans[planner]
    _print_search(planner, planners[planner], result)
    if refining:
        alternatives = getattr(planners[planner], "last_alternatives", {})
        refined = _refine(
            result,
            tables,
            plan_comm,
            predictor,
            refine_budget,
            alternatives,
            kinds=planner not in TW_CW_PLANNERS,
        )
        if refined is not None:
            result = refined
            if refined.refinement is not None:  # a row even when no move helped
                plans[f"{planner}+refined"] = refined
                row = summarize(refined, tables, refined.refinement.seconds)
                summaries.append(replace(row, planner=f"{planner}+refined"))
    prediction = predictor.predict_plan(result, tables) if predictor is not None else None
    warn_plan_kinds(predictor, result)
    if prediction is not None and prediction.comm != plan_comm.describe():
        err.print(f"comm of this plan: {prediction.comm}", highlight=False)
    out.print(rank_table(result, tables, prediction))
    if compare or measure:
        eval_comm = (
            choose_comm(
                comm,
                world=gpus,
                device=target_device,
                predictor=predictor,
                measuring=True,
                label="evaluator comm",
            )
            if measure
            else None
        )
        measured, bound = (
            _measure(plans, tables, repeats, batch_per_rank, eval_comm) if measure else (None, 0.0)
        )
        out.print(compare_table(summaries, failures, measured, bound))
    save_plan(result, out_path)
    made = (
        planner
        if result.planner == planner
        else f"{planner}, which measurement led to {result.planner}'s plan"
    )
    out.print(f"wrote {out_path} (planner {made}, hash {result.hash[:8]})")
    if plot is not None:
        try:
            plot_plan(result, tables, plot)
        except (OSError, ValueError) as e:
            raise wrote_then_failed(out_path, plot, "--plot", e) from None
        out.print(f"wrote {plot}")


REFINE_MODES = ("auto", "measured", "none")
#: --measure refuses a batch whose one round of W kernels would take longer than this.
MEASURE_ROUND_LIMIT_S = 120.0


def _refine_mode(value: str, target_device: str, planner: str) -> bool:
    """Whether `plan` refines by measurement: ``auto`` does for a cost-model planner's
    plan when this machine runs the job (a heuristic asked for by name stays as it is)."""
    if value not in REFINE_MODES:
        raise UserError(f"--refine must be one of {', '.join(REFINE_MODES)}, not {value!r}.")
    if value != "auto":
        return value == "measured"
    if planner not in MODEL_PLANNERS:
        return False
    if target_device == "cpu":
        return True
    import torch

    return bool(torch.cuda.is_available())


def _print_search(name: str, planner: Planner, plan: Plan) -> None:
    stats = getattr(planner, "last_stats", None)
    if stats is None:
        return
    line = (
        f"{name} search: {stats.candidates} split states in {stats.steps} beam steps, "
        f"{stats.seconds:.2f} s; {stats.split_tables} table(s) split column-wise"
        + (f", width cap {stats.best_scale:g} x mean" if stats.source == "search" else "")
        + f", local search -{stats.refine_gain:.1%}"
    )
    if stats.stopped:
        line += f"; stopped early: {stats.stopped}"
    if stats.kind_candidates or stats.kind_moves:
        line += (
            f"; kinds: {stats.kind_candidates} kind states, {stats.kind_moves} kind moves "
            f"priced, {stats.kind_seconds:.2f} s"
        )
    out.print(line)
    _print_kinds(name, stats.kinds)
    choice = stats.choice
    if not choice:
        return
    chosen = str(choice["chosen"])
    sigma = float(choice["sigma"])
    line = (
        f"{name} chose {'its search' if chosen == 'search' else chosen + chr(39) + 's plan'} "
        f"by its risk-adjusted max (one σ above the median under the model's error, "
        f"±{100 * sigma:.0f}% on its slowest rank): predicted max "
        f"{1e3 * float(choice['predicted_max']):.2f} ms, risk-adjusted "
        f"{1e3 * float(choice['risk']):.2f} ms"
    )
    if choice.get("cheapest_predicted") != chosen:
        line += f"; the predicted max alone would pick {choice['cheapest_predicted']}"
    out.print(line, highlight=False)
    refused = choice.get("refused")
    if refused:
        tables = list(refused["tables"])
        named = ", ".join(tables[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
        what = (
            f"refused row-wise for {len(tables)} table(s) ({named}): "
            f"{refused['label']}'s plan cutting them"
            if tables
            else f"kept the table-wise/column-wise search's choice: {refused['label']}'s plan"
        )
        out.print(
            f"{name} {what} is priced {1e3 * float(refused['predicted_max']):.2f} ms "
            f"(risk-adjusted {1e3 * float(refused['risk']):.2f} ms), within the model's "
            "error of this one; other kinds are taken only where they pay beyond that",
            highlight=False,
        )
    if stats.ambiguous:
        out.print(
            f"{len(stats.ambiguous)} other candidate(s) within the model's error of it "
            f"({', '.join(stats.ambiguous)}): a toss-up for the model; measured refinement "
            "times them and starts from the fastest where this machine can measure",
            highlight=False,
        )


def _print_kinds(name: str, lines: Sequence[str]) -> None:
    """Why each table not table-wise or column-wise has its kind, and the hot tables the
    search left fused, with both predicted maxima (``SearchStats.kinds``)."""
    if lines:
        out.print(f"{name} kinds (predicted max with each choice vs its alternative):")
    for line in lines:
        out.print(f"  {line}", highlight=False)


def _refine(
    plan: Plan,
    tables: list[TableSpec],
    comm: CommModel,
    predictor: CostPredictor | None,
    budget_s: float,
    alternatives: Mapping[str, Plan],
    *,
    kinds: bool,
) -> Plan | None:
    """The plan after measured refinement, or None (with the reason) when skipped.
    ``kinds``: it may also change a table's kind (not for a planner restricted to
    table-wise and column-wise)."""
    from shardwise.profiler.refine.measured import RefinementSkipped, refine_measured

    try:
        with progress() as bar:
            task = bar.add_task("refining by measurement", total=None)
            refined = refine_measured(
                plan,
                tables,
                comm=comm,
                predictor=predictor,
                budget_s=budget_s,
                on_step=lambda what: bar.update(task, description=what),
                alternatives=alternatives,
                kinds=kinds,
            )
    except RefinementSkipped as skipped:
        err.print(f"note: {skipped}")
        return None
    rec = refined.refinement
    if rec is not None:
        before, after = rec.start_max_compute_seconds, rec.final_max_compute_seconds
        start = f" from {rec.started_from}'s plan (measured faster)" if rec.started_from else ""
        out.print(
            f"measured refinement{start}: {rec.moves} move(s), {rec.kernels_measured} kernels "
            f"timed in {rec.seconds:.1f} s; fresh re-measurement of the slowest rank's compute "
            f"{1e3 * before:.2f} -> {1e3 * after:.2f} ms (its loop believed "
            f"{1e3 * rec.believed_max_compute_seconds:.2f}); {rec.device.upper()} figures"
        )
        for change in rec.kind_changes:
            out.print(f"  kind changed by measurement: {change}", highlight=False)
    return refined

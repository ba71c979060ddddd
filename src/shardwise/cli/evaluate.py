"""`shardwise evaluate`: measure or predict a plan's per-rank embedding cost."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    REPEATS_HELP,
    TABLES_HELP,
    CommOpt,
    MeasureOnOpt,
    batch_check,
    calibrate_command,
    choose_comm,
    choose_model,
    cost_table,
    deprecated,
    load_model,
    measure_device,
    model_option,
    out,
    progress,
    renamed,
)
from shardwise.planner.tables import load_tables

#: Shard names a kernel row lists before it says how many more there are.
_SHOWN_SHARDS = 4


def kernel_table(title: str, doc: dict[str, Any]) -> Any:
    """Each rank's kernels (``rank_kernels``): kinds, precision, batch, shards, times."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("rank", "kernel", "batch", "shards", "fwd ms", "bwd ms"):
        t.add_column(col, justify="left" if col in ("kernel", "shards") else "right")
    for rank, kernels in enumerate(doc.get("rank_kernels") or []):
        if not kernels:
            t.add_row(str(rank), "(none)", "", "", "0.00", "0.00")
        for k in kernels:
            names = list(k["shards"])
            shown = ", ".join(names[:_SHOWN_SHARDS])
            if len(names) > _SHOWN_SHARDS:
                shown += f", … (+{len(names) - _SHOWN_SHARDS})"
            t.add_row(
                str(rank),
                f"{k['kinds']} {k['dtype']}",
                f"{k['batch_size']:,}",
                shown,
                f"{1e3 * k['fwd_s']:.2f}",
                f"{1e3 * k['bwd_s']:.2f}",
            )
    return t


def comm_part_lines(doc: dict[str, Any]) -> list[str]:
    """One line per comm part (when there are several): its slowest rank's fwd and bwd,
    and what priced it."""
    parts = doc.get("comm_parts") or []
    if len(parts) < 2:
        return []
    return [
        f"  {p['part']}: fwd {1e3 * max(p['fwd_s']):.2f} ms, bwd {1e3 * max(p['bwd_s']):.2f} ms "
        f"(slowest rank); {p['priced_by']}"
        for p in parts
    ]


def evaluate_cmd(
    ctx: typer.Context,
    plan_path: Annotated[Path, typer.Argument(help="plan.json from any planner.")],
    tables_path: Annotated[
        Path, typer.Option("--tables", help=f"{TABLES_HELP}: the plan's tables.")
    ],
    predict: Annotated[
        bool,
        typer.Option(
            "--predict",
            help="Print the cost model's prediction (no measurement unless "
            "--measure is also given).",
        ),
    ] = False,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Measure (the default without --predict); with --predict, "
            "print both and the prediction's error.",
        ),
    ] = False,
    model_path: Annotated[Path | None, model_option("for --predict", chosen=True)] = None,
    batch_per_rank: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"{BATCH_PER_RANK_HELP} measured (or predicted) at; each rank's compute "
            "runs at this x the world size.",
            show_default="the plan's job batch, topology.batch_size_per_rank",
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help=f"{REPEATS_HELP}.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    measure_on: MeasureOnOpt = None,
    comm_value: CommOpt = "auto",
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
    old_device: Annotated[str | None, deprecated("--device", "--measure-on")] = None,
) -> None:
    """Measure (or predict) a plan's embedding cost per rank.

    Measuring runs each rank's kernels (one rank at a time, exactly its shards: one
    per sharding-kind group and precision; row-wise shards get the lookups that fall
    in their rows, data-parallel tables the rank's own batch) at the plan's job batch,
    and the comm as --comm says: the all-to-all, and on one host the row-wise
    reduce-scatter and data-parallel all-reduce, measured for real where each rank
    has its own GPU or core, else a declared interconnect or host preset fed with the
    measured compute (docs/comm.md); each comm part says what priced it, and compute
    and comm are reported apart.
    --predict asks the cost model instead, and --predict --measure prints both and
    the prediction's error. Writes no file: prints per-rank tables (JSON with --json)
    on stdout.

    Example: shardwise evaluate plan.json --tables tables.yaml --predict --measure
    """
    import json

    from shardwise.planner.plan import load_plan

    given_batch = renamed(ctx, "batch_per_rank", batch_per_rank, old_batch_size)
    device = measure_device(renamed(ctx, "measure_on", measure_on, old_device))

    plan = load_plan(plan_path)
    tables = load_tables(tables_path)
    plan.validate_plan(tables, source=str(plan_path), require_hash=True)
    # The job's batch unless told otherwise (docs/design.md §6).
    batch_size = given_batch or plan.topology.batch_size_per_rank
    measuring = measure or not predict
    world = plan.world_size
    docs: dict[str, dict[str, Any]] = {}
    predictor = None
    if predict or (measuring and comm_value.strip() in ("model", "learned")):
        from shardwise.planner.costmodel.predictor import CostPredictor

        calibrate = calibrate_command(tables_path, world, batch_size)
        choice = choose_model(model_path, tables, calibrate, device if measure else None)
        if choice is None:
            load_model(None)  # the error that says how to re-create the bundled model
        batch_check(choice, batch_size * world, None, calibrate)
        predictor = CostPredictor(choice.model)
    # Every --comm value is checked before anything is measured.
    measured_comm = None
    if measuring:
        measured_comm = choose_comm(
            comm_value,
            world=world,
            device=device,
            predictor=predictor,
            measuring=True,
            label="comm (measurement)" if predict else "comm",
        )
    if predict and predictor is not None:
        # Measured all-to-alls are what the cost model's network learned to predict.
        priced = "model" if comm_value.strip() == "measured" else comm_value
        predictor.comm_model = choose_comm(
            priced,
            world=world,
            device=device,
            predictor=predictor,
            measuring=False,
            label="comm (prediction)" if measuring else "comm",
        )
        prediction = predictor.predict_plan(plan, tables, batch_size_per_rank=batch_size)
        docs["predicted"] = prediction.to_json()
    if measuring:
        from shardwise.profiler.evaluate import evaluate_plan

        with progress() as bar:
            task = bar.add_task("measuring", total=None)
            result = evaluate_plan(
                plan,
                tables,
                batch_size_per_rank=batch_size,
                repeats=repeats,
                device=device,
                on_step=lambda what: bar.update(task, description=what),
                comm=measured_comm,
            )
        docs["measured"] = result.to_json()
    if len(docs) == 2:
        pred, meas = docs["predicted"], docs["measured"]
        docs["error"] = {
            "max_s": pred["max_s"] / meas["max_s"] - 1.0,
            "per_rank_total": [
                p["total_s"] / m["total_s"] - 1.0 if m["total_s"] else 0.0
                for p, m in zip(pred["ranks"], meas["ranks"], strict=True)
            ],
        }
    if as_json:
        print(json.dumps(docs if len(docs) > 1 else next(iter(docs.values())), indent=1))
        return
    whose = "" if given_batch else " (the plan's job batch)"
    head = f"{plan.planner} plan {plan.hash[:8]}, batch {batch_size:,}/rank{whose}"
    if "predicted" in docs:
        d = docs["predicted"]
        out.print(cost_table(f"{head}: predicted by the cost model", d))
        out.print(
            f"predicted max {1e3 * d['max_s']:.2f} ms (compute alone "
            f"{1e3 * d['max_compute_s']:.2f} ms), imbalance (max/mean) "
            f"{d['imbalance_max_over_mean']:.2f}"
        )
        out.print(f"comm: {d['comm']}", markup=False, highlight=False, soft_wrap=True)
        _print_details(f"{head}: predicted kernels", d)
    if "measured" in docs:
        d = docs["measured"]
        out.print(cost_table(f"{head}: measured on {d['device']}, median of {repeats}", d))
        out.print(
            f"max {1e3 * d['max_s']:.2f} ms (compute alone {1e3 * d['max_compute_s']:.2f} "
            f"ms), imbalance (max/mean) {d['imbalance_max_over_mean']:.2f}, "
            f"repeatability: CV of the max over {repeats} repeats {100 * d['repeat_cv']:.1f}%"
            + ("" if d["allocator_mitigated"] else "; WARNING: allocator mitigation inactive")
        )
        out.print(f"comm: {d['comm']}", markup=False, highlight=False, soft_wrap=True)
        _print_details(f"{head}: measured kernels", d)
        if str(d["device"]).startswith("cpu"):
            comm_note = (
                "gloo all-to-all"
                if d["comm_kind"] == "measured"
                else f"all-to-all {d['comm_kind']}, not measured"
            )
            parts = d.get("comm_parts") or []
            if any(str(p["priced_by"]).startswith("measured") for p in parts[1:]):
                comm_note += ", gloo collectives of the other kinds"
            out.print(f"These are CPU figures (FBGEMM CPU kernels, {comm_note}).")
    if "error" in docs:
        e = docs["error"]
        worst = max(abs(x) for x in e["per_rank_total"])
        out.print(
            f"prediction error: max-rank cost {100 * e['max_s']:+.1f}%, "
            f"worst rank {100 * worst:.1f}%"
        )


def _print_details(title: str, doc: dict[str, Any]) -> None:
    """Each rank's kernels, and each comm part when there are several."""
    out.print(kernel_table(title, doc))
    for line in comm_part_lines(doc):
        out.print(line, markup=False, highlight=False, soft_wrap=True)

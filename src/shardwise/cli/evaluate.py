"""`shardwise evaluate`: measure or predict a plan's per-rank embedding cost."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    REPEATS_HELP,
    TABLES_HELP,
    MeasureOnOpt,
    batch_check,
    calibrate_command,
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
        int,
        typer.Option(
            min=1,
            help=f"{BATCH_PER_RANK_HELP} measured (or predicted) at; each rank's compute "
            "runs at this x the world size.",
        ),
    ] = 128,
    repeats: Annotated[int, typer.Option(min=1, help=f"{REPEATS_HELP}.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    measure_on: MeasureOnOpt = None,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
    old_device: Annotated[str | None, deprecated("--device", "--measure-on")] = None,
) -> None:
    """Measure (or predict) a plan's embedding cost per rank.

    Measuring runs each rank's fused kernel (one rank at a time, exactly its shards)
    and a real all-to-all with the plan's per-rank widths; --predict asks the cost
    model instead, and --predict --measure prints both and the prediction's error.
    Writes no file: prints per-rank tables (JSON with --json) on stdout.

    Example: shardwise evaluate plan.json --tables tables.yaml --predict --measure
    """
    import json

    from shardwise.planner.plan import load_plan

    batch_size = renamed(ctx, "batch_per_rank", batch_per_rank, old_batch_size)
    device = measure_device(renamed(ctx, "measure_on", measure_on, old_device))

    plan = load_plan(plan_path)
    tables = load_tables(tables_path)
    plan.validate_plan(tables, source=str(plan_path), require_hash=True)
    docs: dict[str, dict[str, Any]] = {}
    if predict:
        from shardwise.planner.costmodel.predictor import CostPredictor

        calibrate = calibrate_command(tables_path, plan.world_size, batch_size)
        choice = choose_model(model_path, tables, calibrate, device if measure else None)
        if choice is None:
            load_model(None)  # the error that says how to re-create the bundled model
        batch_check(choice, batch_size * plan.world_size, None, calibrate)
        prediction = CostPredictor(choice.model).predict_plan(
            plan, tables, batch_size_per_rank=batch_size
        )
        docs["predicted"] = prediction.to_json()
    if measure or not predict:
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
    head = f"{plan.planner} plan {plan.hash[:8]}, batch {batch_size}/rank"
    if "predicted" in docs:
        d = docs["predicted"]
        out.print(cost_table(f"{head}: predicted by the cost model", d))
        out.print(
            f"predicted max {1e3 * d['max_s']:.2f} ms, imbalance (max/mean) "
            f"{d['imbalance_max_over_mean']:.2f}"
        )
    if "measured" in docs:
        d = docs["measured"]
        out.print(cost_table(f"{head}: measured on {d['device']}, median of {repeats}", d))
        out.print(
            f"max {1e3 * d['max_s']:.2f} ms, imbalance (max/mean) "
            f"{d['imbalance_max_over_mean']:.2f}, repeatability: CV of the max over "
            f"{repeats} repeats {100 * d['repeat_cv']:.1f}%"
            + ("" if d["allocator_mitigated"] else "; WARNING: allocator mitigation inactive")
        )
        if str(d["device"]).startswith("cpu"):
            out.print("These are CPU figures (FBGEMM CPU kernels, gloo all-to-all).")
    if "error" in docs:
        e = docs["error"]
        worst = max(abs(x) for x in e["per_rank_total"])
        out.print(
            f"prediction error: max-rank cost {100 * e['max_s']:+.1f}%, "
            f"worst rank {100 * worst:.1f}%"
        )

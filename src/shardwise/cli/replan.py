"""`shardwise replan`: re-place a running job's shards by its live measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from shardwise.basics import UserError, check_output_path, format_bytes, parse_bytes
from shardwise.cli._common import MODEL_HELP, TABLES_HELP, out, say
from shardwise.planner.tables import load_tables


def replan_cmd(
    plan_path: Annotated[Path, typer.Option("--plan", help="plan.json the job runs.")],
    tables_path: Annotated[
        Path, typer.Option("--tables", help=f"{TABLES_HELP}: the plan's tables.")
    ],
    live_path: Annotated[
        Path,
        typer.Option(
            "--live",
            help="live.json: the live summary the job's rank 0 writes to its live "
            "ConfigMap (per-rank measured compute, per-shard probe costs).",
        ),
    ],
    out_path: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Where to write the re-planned plan.json."),
    ] = None,
    gpu_memory: Annotated[
        str | None,
        typer.Option(help="Memory per GPU, e.g. 16GiB, 80GB, 17179869184."),
    ] = None,
    max_moves: Annotated[
        int | None,
        typer.Option(min=0, help="Move at most this many shards.", show_default="no limit"),
    ] = None,
    earlier: Annotated[
        list[Path] | None,
        typer.Option(
            "--earlier",
            help="live.json of a plan the job ran before (repeatable): its measured ranks "
            "are evidence for the live prices (a reshard that did not deliver).",
        ),
    ] = None,
    model_path: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help=f"{MODEL_HELP}: the job's calibrated one, whose rank head's kernel "
            "overhead is evidence for a rank's fixed part, and whose prices of a table's "
            "row ranges against it whole let a table change its kind.",
        ),
    ] = None,
) -> None:
    """Re-plan a running job from its live costs (docs/resharding.md).

    Prices each shard as its share of its kernel's per-table work plus a factor times its
    probe cost, fitted with the rank's fixed part on the ranks' measured compute (and
    earlier plans' with --earlier, a calibrated model's overhead with --model); keeps
    the plan's column splits and moves whole table-wise and column-wise shards off the
    straggler under the memory rule (row-wise, table-row-wise, grid and data-parallel
    tables stay where they are, priced on their ranks), pricing each candidate at its
    worst plausible price. With --model, the straggler's hot table-wise tables are also
    tried row-wise and row-wise tables table-wise, each range priced from the probe
    by the model's range/whole ratio, and chosen only when that wins at the worst
    plausible price too. Prints each rank's measured compute beside the priced and
    predicted figures (± what the evidence leaves open), the fit and the moves; with
    --out, writes the plan (the same placement when no move predicts a lower max).

    Example: shardwise replan --plan plan.json --tables tables.yaml --live live.json
    --out new-plan.json
    """
    from shardwise.planner.live.inputs import LiveInputError, load_live
    from shardwise.planner.live.replan import replan
    from shardwise.planner.plan import load_plan, save_plan

    if out_path is not None:
        check_output_path(out_path, "--out", "plan.json")
    plan = load_plan(plan_path)
    tables = load_tables(tables_path)
    live = load_live(live_path)
    history = []
    for path in earlier or []:
        before = load_live(path)
        if before.plan_hash == live.plan_hash:
            raise UserError(
                f"{path}: --earlier is a summary of the plan --live measures "
                f"({live.plan_hash[:8]}); give summaries of plans the job ran before."
            )
        history += before.points()
    head = None
    predictor = None
    if model_path is not None:
        from shardwise.cli._common import load_model
        from shardwise.planner.costmodel.predictor import CostPredictor
        from shardwise.planner.costmodel.rankhead import rank_head_of

        model = load_model(model_path)
        head = rank_head_of(model.metadata, model.source)
        predictor = CostPredictor(model)
        if head is None:
            raise UserError(
                f"{model_path}: the model was not calibrated on a job's ranks (no rank "
                "head); calibrate it (`shardwise calibrate`) or leave --model out."
            )
    topology = plan.topology
    if gpu_memory is not None:
        topology = topology.model_copy(
            update={"gpu_memory_bytes": parse_bytes(gpu_memory, "--gpu-memory")}
        )
    try:
        result = replan(
            plan,
            tables,
            topology,
            live,
            max_moves=max_moves,
            history=history,
            head=head,
            predictor=predictor,
        )
    except LiveInputError as e:
        files = {"plan": plan_path, "tables": tables_path, "live": live_path}
        raise UserError(f"{files.get(e.subject, plan_path)}: {e}") from None
    pods = {r.rank: r.pod for r in live.ranks}
    now = [len(held) for held in plan.shards_per_rank()]
    after = [len(held) for held in result.plan.shards_per_rank()]
    memory = result.plan.memory_per_rank(tables)
    t = Table(
        title=f"{plan.planner} plan {plan.hash[:8]}: live compute at step {live.step:,} of "
        f"{live.steps:,} on {live.device}, batch {live.batch_size_per_rank:,}/rank",
        caption="priced = the plan as it runs, by the live prices "
        f"({result.estimated_shards} shards priced from their rank's leftover compute); "
        "predicted = after the moves, up to its worst plausible price",
    )
    for col in ("rank", "pod", "shards", "measured ms", "priced ms", "predicted ms", "worst"):
        t.add_column(col, justify="right")
    t.add_column("after", justify="right")
    t.add_column("memory after", justify="right")
    for r in range(plan.world_size):
        t.add_row(
            str(r),
            pods.get(r, ""),
            str(now[r]),
            f"{result.current_rank_ms[r]:.2f}",
            f"{result.priced_rank_ms[r]:.2f}",
            f"{result.predicted_rank_ms[r]:.2f}",
            f"{result.risk_rank_ms[r]:.2f}",
            str(after[r]),
            format_bytes(memory[r]),
        )
    out.print(t)
    if result.moves:
        moves = Table(title="moves")
        for col in ("table", "columns", "from rank", "to rank"):
            moves.add_column(col, justify="right")
        cols = {(t.name, s.col_offset): s.cols for t in plan.tables for s in t.shards}
        for m in result.moves:
            c = cols[(m.table, m.col_offset)]
            moves.add_row(
                m.table, f"{m.col_offset}..{m.col_offset + c - 1}", str(m.from_rank), str(m.to_rank)
            )
        out.print(moves)
    out.print(
        f"live prices: {result.fit.describe()}", markup=False, highlight=False, soft_wrap=True
    )
    for line in result.kind_changes:
        out.print(f"kind change: {line}", markup=False, highlight=False, soft_wrap=True)
    for line in result.kind_notes[:5]:
        out.print(f"kind: {line}", markup=False, highlight=False, soft_wrap=True)
    out.print(result.describe(), markup=False, highlight=False, soft_wrap=True)
    if out_path is not None:
        save_plan(result.plan, out_path)
        what = f"plan {result.plan.hash[:8]}" if result.changed else "the same placement"
        say(f"wrote {out_path} ({what}, {format_bytes(result.moved_bytes)} moved)")

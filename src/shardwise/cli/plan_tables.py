"""The tables `shardwise plan` prints: one row per GPU of the chosen plan, and every
planner side by side. Compute and comm are always shown apart (docs/design.md §6)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from shardwise.basics import format_bytes
from shardwise.planner.plan import Plan
from shardwise.planner.report import PlanSummary, describe_kinds, rank_loads
from shardwise.planner.tables import TableSpec

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import PlanPrediction
    from shardwise.profiler.evaluate import Evaluation


def rank_table(
    plan: Plan, tables: list[TableSpec], prediction: PlanPrediction | None = None
) -> Table:
    """Per GPU: tables, splits, memory as TorchRec counts it (and weights alone), width,
    lookups, and the predicted compute and all-to-all apart; measured compute too when
    measured refinement chose the plan."""
    hosts = plan.topology.hosts
    where = f"{plan.world_size} GPUs" + (
        f" ({hosts} hosts x {plan.topology.local_world})" if hosts > 1 else ""
    )
    others = describe_kinds(plan)
    t = Table(
        title=f"{plan.planner}: {len(plan.tables)} tables on {where}, "
        f"plan {plan.hash[:8]}, {plan.topology.batch_size_per_rank:,} samples per GPU",
        caption="kinds = tables on the rank by kind (TW table-wise, CW column-wise, RW "
        "row-wise, TWRW table-row-wise, GRID, DP data-parallel); memory = weights + "
        "optimizer state + I/O buffers at the job's batch, as TorchRec counts it "
        "(docs/memory.md); weights = the embeddings alone; width = the pooled all-to-all's "
        "columns (table- and column-wise shards)" + ("\n" + "; ".join(others) if others else ""),
    )
    for col in ("rank", "kinds", "memory", "weights", "mem %", "width", "lookups/sample"):
        t.add_column(col, justify="right")
    if prediction is not None:
        for col in ("compute ms", "comm ms", "predicted ms"):
            t.add_column(col, justify="right")
    measured = plan.refinement.final_per_rank_compute_seconds if plan.refinement else None
    if measured is not None:
        t.add_column("measured compute ms", justify="right")
    cap = plan.topology.usable_bytes
    for r in rank_loads(plan, tables):
        row = [
            str(r.rank),
            " ".join(f"{k} {n}" for k, n in r.kinds.items()) or "-",
            format_bytes(r.memory_bytes),
            format_bytes(r.weight_bytes),
            f"{100 * r.memory_bytes / cap:.0f}%",
            str(r.width),
            f"{r.lookups:,.0f}",
        ]
        if prediction is not None:
            c = prediction.ranks[r.rank]
            row += [
                f"{1e3 * (c.fwd_compute_s + c.bwd_compute_s):.3f}",
                f"{1e3 * (c.fwd_comm_s + c.bwd_comm_s):.3f}",
                f"{1e3 * c.total_s:.3f}",
            ]
        if measured is not None:
            row.append(f"{1e3 * measured[r.rank]:.3f}")
        t.add_row(*row)
    return t


def compare_table(
    rows: list[PlanSummary],
    failures: dict[str, str],
    measured: dict[str, Evaluation | None] | None = None,
    bound_s: float = 0.0,
) -> Table:
    """Every planner's worst rank: predicted (compute + comm, the model and comm named on
    stderr) and, with --measure, measured compute with the declared comm, and compute
    alone beside it."""
    priced = bool(rows) and all(r.predicted_max_seconds is not None for r in rows)

    def score(r: PlanSummary) -> float:
        return (r.predicted_max_seconds or 0.0) if priced else r.max_lookups

    def real(r: PlanSummary) -> float:
        ev = (measured or {}).get(r.planner)
        return ev.max_s if ev is not None else float("inf")

    best = min((score(r) for r in rows), default=0.0)
    best_real = min((real(r) for r in rows), default=float("inf"))
    caption = (
        "predicted = the cost model's max-rank embedding cost, compute + all-to-all (model "
        "and comm named on stderr), at the job's batch"
        if priced
        else "lookups = cols x pooling per sample: a cost proxy (no cost model)"
    )
    if measured is not None:
        caption = (
            "measured = the evaluator's max-rank cost at the job's batch: FBGEMM compute + the "
            "comm named on stderr; compute = the slowest rank's compute alone; CV = spread "
            f"over repeats; bound = sum of single-table compute / W = {1e3 * bound_s:.2f} ms "
            "(CPU figures). " + caption
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
        cols = ("measured ms", "vs best", "compute ms", "comm ms", "CV", "x bound", *cols)
    for col in (*cols, "imbal.", "width", "memory", "split", "plan s"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in sorted(rows, key=lambda r: (real(r), score(r))):
        cells = [
            f"{1e3 * score(r):.2f}" if priced else f"{r.max_lookups:,.0f}",
            f"{score(r) / best:.2f}x" if best else "-",
        ]
        if measured is not None:
            ev = measured.get(r.planner)
            if ev is None:
                cells = ["failed", "-", "-", "-", "-", "-", *cells]
            else:
                comm_at_max = max(ev.ranks, key=lambda c: c.total_s)
                cells = [
                    f"{1e3 * ev.max_s:.2f}",
                    f"{ev.max_s / best_real:.2f}x",
                    f"{1e3 * ev.max_compute_s:.2f}",
                    f"{1e3 * (comm_at_max.fwd_comm_s + comm_at_max.bwd_comm_s):.2f}",
                    f"{ev.repeat_cv:.0%}",
                    f"{ev.max_compute_s / bound_s:.2f}" if bound_s else "-",
                    *cells,
                ]
        t.add_row(
            r.planner,
            *cells,
            f"{(r.predicted_imbalance if priced else r.lookup_imbalance):.2f}",
            str(r.max_width),
            format_bytes(r.max_memory_bytes),
            " ".join(f"{k} {n}" for k, n in r.split_kinds.items()) or "-",
            f"{r.planning_seconds:.2f}",
        )
    for name, why in failures.items():
        t.add_row(name, f"[red]failed: {why}[/red]")
    return t

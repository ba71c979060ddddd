"""The inputs of a live re-plan, read and checked: the workers' ``live.json``, and the
plan, tables and topology it must agree with, each fault named by its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from shardwise.basics import UserError, read_text
from shardwise.planner.live.summary import LiveSummary
from shardwise.planner.plan import NO_HASH, Plan, plan_shapes, shape_mismatches, spec_shapes
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology


class LiveInputError(UserError):
    """Inputs :func:`replan` cannot work from. ``subject`` names the input at fault
    (``"plan"``, ``"tables"``, ``"topology"`` or ``"live"``), so a command can name
    its file."""

    def __init__(self, subject: str, message: str) -> None:
        super().__init__(message)
        self.subject = subject


def load_live(path: str | Path) -> LiveSummary:
    """Parse ``live.json``; a file that is not one is a :class:`UserError` naming the
    file and each field."""
    p = Path(path)
    text = read_text(p, "live summary")
    try:
        return LiveSummary.model_validate_json(text)
    except ValidationError as err:
        lines = [
            f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']}"
            for e in err.errors()[:20]
        ]
        raise UserError(
            f"{p} is not a live summary (live.json, written by the workers' rank 0):\n- "
            + "\n- ".join(lines)
        ) from None


def check_inputs(
    plan: Plan, tables: Sequence[TableSpec], topology: Topology, live: LiveSummary
) -> None:
    """A :class:`LiveInputError` naming the input at fault when the plan, tables,
    topology and summary do not describe one running job."""
    if not plan.hash:
        raise LiveInputError("plan", NO_HASH)
    if live.plan_hash != plan.hash:
        raise LiveInputError(
            "live",
            f"the live summary's planHash {live.plan_hash[:12]} is not the plan's hash "
            f"{plan.hash[:12]}: it measured another plan (written before a reshard, or "
            "for another job). Re-plan from the summary the workers of this plan write.",
        )
    if live.world_size != plan.world_size:
        raise LiveInputError(
            "live",
            f"the live summary's worldSize is {live.world_size}, the plan's world_size "
            f"{plan.world_size}: it is not a measurement of this plan.",
        )
    if topology.gpus != plan.world_size:
        raise LiveInputError(
            "topology",
            f"the topology has {topology.gpus} GPUs but the plan {plan.world_size} ranks: "
            "re-planning from live costs keeps the world size (a node change reshards "
            "through the planner, not from live costs).",
        )
    shapes = shape_mismatches(plan_shapes(plan), spec_shapes(tables), "plan", "tables")
    if shapes:
        raise LiveInputError(
            "tables", "the tables do not match the plan:\n- " + "\n- ".join(shapes[:20])
        )
    memory = set(plan.memory_problems(tables))
    broken = [p for p in plan.problems(tables) if p not in memory]
    if broken:
        raise LiveInputError("plan", "the plan is not valid:\n- " + "\n- ".join(broken[:20]))
    problems: list[str] = []
    seen: set[int] = set()
    for r in live.ranks:
        if r.rank >= plan.world_size:
            problems.append(f"ranks: rank {r.rank} is outside a world of {plan.world_size}")
        elif r.rank in seen:
            problems.append(f"ranks: rank {r.rank} appears twice")
        seen.add(r.rank)
    measured = {r.rank for r in live.measured()}
    missing = [r for r in range(plan.world_size) if r not in measured]
    if missing and not problems:
        problems.append(
            f"ranks: rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing[:16]))} reported no measured step (samples 0); "
            "re-plan once every rank has: never on missing data"
        )
    # A shard is keyed by its table, rank, first row and first column (ShardCost.key):
    # a row range by its first row, a data-parallel copy by its rank.
    where: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}
    for t in plan.tables:
        for s in t.shards:
            where.setdefault((t.name, s.row_offset, s.col_offset), []).append(
                (s.rank, s.cols, s.row_count(t.rows))
            )
    names = {t.name for t in plan.tables}
    keys: set[tuple[str, int, int, int]] = set()
    for sc in live.shards:
        spots = where.get((sc.table, sc.row_offset, sc.col_offset), [])
        what = f"shards: table {sc.table!r} at column {sc.col_offset}" + (
            f", row {sc.row_offset}" if sc.row_offset else ""
        )
        here = [x for x in spots if x[0] == sc.rank]
        rows = "" if sc.rows is None else f" x {sc.rows} rows"
        if sc.table not in names:
            problems.append(f"shards: table {sc.table!r} is not in the plan")
        elif not spots:
            problems.append(f"{what}: the plan has no shard starting there")
        elif not here or here[0][1] != sc.cols or sc.rows not in (None, here[0][2]):
            _, cols, n = here[0] if here else spots[0]
            ranks = ", ".join(str(r) for r, _, _ in spots)
            problems.append(
                f"{what}: {sc.cols} columns{rows} on rank {sc.rank} in the summary, "
                f"{cols} columns x {n} rows on rank {ranks} in the plan"
            )
        elif sc.key() in keys:
            problems.append(f"{what}: measured twice")
        keys.add(sc.key())
    if problems:
        raise LiveInputError(
            "live",
            "the live summary does not fit the plan:\n- "
            + "\n- ".join(problems[:20])
            + (f"\n- … and {len(problems) - 20} more" if len(problems) > 20 else ""),
        )

"""Why each table has its kind: the lines ``shardwise plan`` prints under the search.

For every table of a splitting kind (the costliest :data:`~.kindmoves.EXPLAIN_CHOSEN`),
the predicted max with it against its best fused alternative (the table whole on one of
the lightest ranks with room, the rest where it is); an oversized table has none. For
the hottest fused tables (:data:`~.kindmoves.EXPLAIN_REFUSED`), what row-wise would have
made the max, and how much its ranges cost together against the whole table: row
ranges cost more than their share of the lookups, which is why a table that fits whole
is often better left whole.
"""

from __future__ import annotations

from shardwise.planner.kinds import SHORT
from shardwise.planner.neuroshard.base import kind_code, option_of
from shardwise.planner.neuroshard.kindmoves import (
    EXPLAIN_CHOSEN,
    EXPLAIN_REFUSED,
    lightest_host,
    move,
    price,
    row_options,
)
from shardwise.planner.neuroshard.problem import Placement, Problem, State
from shardwise.planner.plan import Plan


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def explain(problem: Problem, state: State, placed: Placement) -> list[str]:
    """The module docstring's lines for the chosen state."""
    lines: list[str] = []
    solo = problem.table_solo()
    topo = problem.topology
    coded = [t for t, w in enumerate(state) if option_of(w) is not None]
    for t in sorted(coded, key=lambda t: (-solo[t], t))[:EXPLAIN_CHOSEN]:
        opt = option_of(state[t])
        assert opt is not None
        spec = problem.tables[t]
        head = f"{spec.name}: {opt.describe(topo)}, predicted max {_ms(placed.score)}"
        if t in problem.rule:
            lines.append(f"{head}; no GPU holds it whole")
            continue
        at = sum(1 for u, _ in problem.shard_list(state) if u < t)  # its shard's index
        alts = [
            (got.score, int(r[at]))
            for c, r in move(problem, state, placed.ranks, t, (spec.dim,))
            if (got := price(problem, c, r)) is not None
        ]
        if not alts:
            lines.append(f"{head}; whole it fits no light rank")
            continue
        score, rank = min(alts)
        lines.append(f"{head} vs {_ms(score)} whole on rank {rank}")
    if not problem.searches_kinds:
        return lines
    host = lightest_host(problem, placed)
    fused = [t for t, w in enumerate(state) if option_of(w) is None]
    for t in sorted(fused, key=lambda t: (-solo[t], t))[:EXPLAIN_REFUSED]:
        spec = problem.tables[t]
        for opt in row_options(problem, t, host):
            ((child, ranks),) = move(problem, state, placed.ranks, t, kind_code(opt))
            got = price(problem, child, ranks)
            ranges = problem.base(((t, opt),)).seconds.sum() / max(float(solo[t]), 1e-12)
            as_kind = "did not fit" if got is None else _ms(got.score)
            lines.append(
                f"{spec.name}: refused {opt.describe(topo)}: {as_kind} vs "
                f"{_ms(placed.score)} as placed (its ranges sum {ranges:.2f}x the whole)"
            )
    return lines


def explain_plan(plan: Plan) -> list[str]:
    """A baseline's plan that won as it was made: its tables' kinds, unpriced."""
    return [
        f"{t.name}: {SHORT[t.kind]} as {plan.planner}'s plan placed it"
        for t in plan.tables
        if t.kind not in ("table_wise", "column_wise")
    ]

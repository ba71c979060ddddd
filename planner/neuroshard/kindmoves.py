"""NeuroShard's moves over kinds: which tables a step tries in another kind, the bounded
kind round of the local search, and the lines that explain the choices.

A kind choice has no placement freedom (:mod:`.base`), so a move is a table changing
kind, everything else staying where it is:

- **to row-wise** (or table-row-wise on the lightest host): the costliest fused tables
  whose cost alone exceeds :data:`ROW_MIN_SHARE` of the mean rank's: only such a table
  can lower the max by spreading its lookups, even where it fits whole; its ranges are
  priced as the model prices them (they may cost more than their share);
- **to whole**: a table of a splitting kind back to one fused shard (never an
  oversized one), on one of the lightest ranks with room;
- **to data-parallel**: fp32 tables whose all-to-all bytes saved
  (``2·B·(W-1)·dim·4``, ``B`` per rank) exceed the gradient all-reduce's
  (``2·rows·dim·bytes·(W-1)/W``) and whose copy fits every rank: a vectorized prefilter,
  the model's price decides;
- **switch**: an oversized table between row-wise and table-row-wise on a host.

The beam offers them as children (placed by the greedy like any state); the kind round
prices each of at most :data:`KIND_SOURCES` moves of the placed plan exactly and keeps
the best if it lowers the predicted max.
"""

from __future__ import annotations

import numpy as np

from shardwise.planner.kinds import KindOption
from shardwise.planner.neuroshard.base import kind_code, option_of
from shardwise.planner.neuroshard.problem import F64, I64, Placement, Problem, State
from shardwise.planner.tables import DTYPE_BYTES

#: A table is tried row-wise when alone it costs more than this share of the mean rank.
ROW_MIN_SHARE = 0.5
#: Moves a kind round prices.
KIND_SOURCES = 8
#: A move back to whole tries this many of the lightest ranks with room.
WHOLE_RANKS = 4
#: Hot tables whose row-wise refusal the explanation prices.
EXPLAIN_REFUSED = 5
#: Tables of a splitting kind the explanation prices against their fused alternative.
EXPLAIN_CHOSEN = 10


def with_entry(state: State, t: int, widths: tuple[int, ...]) -> State:
    return (*state[:t], widths, *state[t + 1 :])


def lightest_host(problem: Problem, placed: Placement) -> int:
    local = problem.topology.local_world
    loads = placed.per_rank.reshape(problem.topology.hosts, local).sum(axis=1)
    return int(np.argmin(loads))


def row_options(problem: Problem, t: int, host: int) -> list[KindOption]:
    """Table ``t``'s row-wise choices a step tries: over every rank, and on ``host``."""
    return [
        o
        for o in problem.options(t)
        if o.kind == "row_wise" or (o.kind == "table_row_wise" and o.host == host)
    ]


def hot_tables(problem: Problem, state: State, placed: Placement, k: int) -> list[int]:
    """The ``k`` costliest fused tables worth spreading (module docstring)."""
    solo = problem.table_solo()
    floor = ROW_MIN_SHARE * float(placed.per_rank.mean())
    fused = [t for t, w in enumerate(state) if option_of(w) is None and solo[t] > floor]
    return sorted(fused, key=lambda t: (-solo[t], t))[:k]


def dp_gain(problem: Problem, state: State, placed: Placement) -> F64:
    """Per table, all-to-all bytes a data-parallel copy saves minus the all-reduce bytes
    it adds; ``-inf`` where the table cannot go data-parallel (module docstring)."""
    w = problem.world
    n = len(problem.tables)
    if "data_parallel" not in problem.kinds or w < 2:
        return np.full(n, -np.inf)
    if problem.dp_arrays is None:
        specs = problem.tables
        dim = np.array([t.dim for t in specs], dtype=np.float64)
        rows = np.array([t.rows for t in specs], dtype=np.float64)
        nbytes = np.array([DTYPE_BYTES[t.dtype] for t in specs], dtype=np.float64)
        fp32 = np.array([t.dtype == "fp32" for t in specs])
        saved = 2.0 * problem.batch_per_rank * (w - 1) * dim * 4.0
        cost = 2.0 * rows * dim * nbytes * (w - 1) / w
        copy = 3.0 * rows * dim * nbytes  # weights, optimizer state, gradients
        problem.dp_arrays = (np.where(fp32, saved - cost, -np.inf), copy)
    gain, copy = problem.dp_arrays
    room = problem.cap - float(problem.base_of(state).mem.max())
    fused = np.array([option_of(x) is None and t not in problem.rule for t, x in enumerate(state)])
    out: F64 = np.where(fused & (copy < room) & (gain > 0), gain, -np.inf)
    return out


def kind_children(problem: Problem, state: State, placed: Placement, branch: int) -> list[State]:
    """The states one kind move from ``state`` (module docstring), ``branch`` per move."""
    out: list[State] = []
    solo = problem.table_solo()
    host = lightest_host(problem, placed)
    for t in hot_tables(problem, state, placed, branch):
        out += [with_entry(state, t, kind_code(o)) for o in row_options(problem, t, host)]
    coded = [t for t, w in enumerate(state) if option_of(w) is not None and t not in problem.rule]
    for t in sorted(coded, key=lambda t: (-solo[t], t))[:branch]:
        out.append(with_entry(state, t, (problem.tables[t].dim,)))
    gain = dp_gain(problem, state, placed)
    for t in np.argsort(-gain, kind="stable")[:branch]:
        if np.isfinite(gain[t]) and any(o.kind == "data_parallel" for o in problem.options(int(t))):
            out.append(with_entry(state, int(t), kind_code(KindOption("data_parallel"))))
    for t in sorted(problem.rule):
        now = option_of(state[t])
        for o in row_options(problem, t, host):
            if o != now:
                out.append(with_entry(state, t, kind_code(o)))
    return out


# ------------------------------------------------------------------ moves of a placement


def move(
    problem: Problem, state: State, ranks: I64, t: int, widths: tuple[int, ...]
) -> list[tuple[State, I64]]:
    """Table ``t`` to ``widths`` (a kind's code, or one whole shard), the other shards
    where they are: the resulting states and ranks (a whole shard: one per light rank
    with room, at most :data:`WHOLE_RANKS`)."""
    pairs = problem.shard_list(state)
    table = np.array([p[0] for p in pairs], dtype=np.int64)
    child = with_entry(state, t, widths)
    kept = ranks[table != t]
    if widths[0] < 0:
        return [(child, kept)]
    at = int(np.count_nonzero(table < t))  # the new shard's index in the child's list
    base = problem.base_of(child)
    sh = problem.shards(child)
    mem = np.bincount(kept, weights=np.delete(sh.nbytes, at), minlength=problem.world)
    free = problem.cap - (mem + base.mem)
    need = problem.shard_bytes(t, widths[0])
    load = np.bincount(kept, weights=np.delete(problem.solo(sh), at), minlength=problem.world)
    order = [int(r) for r in np.argsort(load, kind="stable") if free[r] >= need]
    return [(child, np.insert(kept, at, r)) for r in order[:WHOLE_RANKS]]


def price(problem: Problem, state: State, ranks: I64) -> Placement | None:
    """The exact predicted cost of a placement, or None when memory does not hold it."""
    sh = problem.shards(state)
    mem = np.bincount(ranks, weights=sh.nbytes, minlength=problem.world) + sh.base.mem
    if not (mem <= problem.cap).all():
        return None
    return problem.place(sh, ranks)


#: Table ``t`` to these widths (a kind's code, or one whole shard).
Move = tuple[int, tuple[int, ...]]


def round_moves(problem: Problem, state: State, placed: Placement) -> list[Move]:
    """At most :data:`KIND_SOURCES` kind moves of a placed state: the straggler's costliest
    fused tables to a row kind, the tables of a splitting kind back to whole, the best
    data-parallel candidates, the oversized tables' switches."""
    host = lightest_host(problem, placed)
    pairs = problem.shard_list(state)
    straggler = int(np.argmax(placed.per_rank))
    on_straggler = {t for (t, _), r in zip(pairs, placed.ranks, strict=True) if r == straggler}
    solo = problem.table_solo()
    hot = [t for t in hot_tables(problem, state, placed, len(state)) if t in on_straggler][:3]
    moves: list[Move] = []
    for t in hot:
        moves += [(t, kind_code(o)) for o in row_options(problem, t, host)]
    coded = [t for t, w in enumerate(state) if option_of(w) is not None and t not in problem.rule]
    moves += [(t, (problem.tables[t].dim,)) for t in sorted(coded, key=lambda t: -solo[t])[:2]]
    gain = dp_gain(problem, state, placed)
    for t in np.argsort(-gain, kind="stable")[:2]:
        if np.isfinite(gain[t]) and any(o.kind == "data_parallel" for o in problem.options(int(t))):
            moves.append((int(t), kind_code(KindOption("data_parallel"))))
    for t in sorted(problem.rule):
        moves += [
            (t, kind_code(o)) for o in row_options(problem, t, host) if o != option_of(state[t])
        ]
    return moves[:KIND_SOURCES]


def kind_round(
    problem: Problem, state: State, placed: Placement
) -> tuple[tuple[State, Placement] | None, int]:
    """The best of :func:`round_moves` if it lowers the predicted max, else None; and how
    many placements it priced."""
    best: tuple[State, Placement] | None = None
    priced = 0
    for t, widths in round_moves(problem, state, placed):
        for child, ranks in move(problem, state, placed.ranks, t, widths):
            got = price(problem, child, ranks)
            priced += 1
            if got is not None and (best is None or got.score < best[1].score):
                best = (child, got)
    if best is None or not best[1].score < placed.score * (1 - 1e-6):
        return None, priced
    return best, priced

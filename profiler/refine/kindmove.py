"""Measured kind moves: refinement asks the machine whether a table should change its kind.

A kind move (:class:`KindMove`) takes the measured straggler's costliest table-wise table
and cuts it row-wise over every rank (or table-row-wise over its host's ranks), or puts
a row-wise table back whole, table-wise, on the rank with the most free memory. Either
changes every rank (each holds a range of the cut), so the move is judged on all W
ranks: the plan as it is and the plan with the move are timed rank by rank, every
kernel of a rank in one call as the evaluator times it, interleaved over
:data:`KIND_REPEATS` repeats so a drift of this host's speed falls on both. The move is
kept only when the objective (max over ranks of compute plus the declared comm, the
other kinds' collectives included) falls by more than the noise; it is tried only while
those ``2 · W · KIND_REPEATS`` timings fit before the deadline, said so when not.

Runners-up that place kinds differently (``runners_up``: candidates the planner could not
tell from the plan, e.g. its best table-wise/column-wise plan beside one with row-wise
tables) are judged first, the same way, each as a whole plan: the model ranks such plans
within its error, and the moves below can only reach plans one kind change away.

Which tables are offered: a cut pays only for a table that is a large part of a rank's
load (its ranges cost more than their share: each is a kernel of its own), so a
table-wise table is offered when its share of the straggler's lookups × columns (every
kernel's, a range by its share of the rows), times the straggler's measured time,
exceeds :data:`ROW_MIN_SHARE` of the mean rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardwise.planner.comm.collectives import plan_kind_parts
from shardwise.planner.comm.model import CommModel
from shardwise.planner.kinds import (
    FUSED,
    ROW_KINDS,
    V1_KINDS,
    Kind,
    KindOption,
    host_of,
    kind_options,
    local_batch,
)
from shardwise.planner.oversized import kind_shards
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.report import split_kinds
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad, measure_compute
from shardwise.profiler.refine.placement import ITERS, WARMUPS, Timing, noise, objective

#: Interleaved repeats of both plans' W ranks per kind move.
KIND_REPEATS = 2
#: Kind moves tried at most (each costs ``2 · W · KIND_REPEATS`` rank timings).
MAX_KIND_TRIES = 3
#: A table-wise table is offered a cut when it is at least this share of the mean rank.
ROW_MIN_SHARE = 0.5
#: A kind move must lower the objective by this share at least, and beyond the noise.
MIN_GAIN = 0.01


@dataclass(frozen=True)
class KindMove:
    """``table`` takes ``option``'s kind; ``rank``: where a table turned table-wise goes."""

    table: str
    option: KindOption
    rank: int = -1

    def describe(self, plan: Plan) -> str:
        """``"h: table-wise → row-wise over 2 ranks"``."""
        old = next(t.kind for t in plan.tables if t.name == self.table).replace("_", "-")
        if self.option.kind in V1_KINDS:
            return f"{self.table}: {old} → table-wise on rank {self.rank}"
        return f"{self.table}: {old} → {self.option.describe(plan.topology)}"


def apply_kind(plan: Plan, tables: Sequence[TableSpec], move: KindMove) -> Plan:
    """``plan`` with ``move`` made: the table cut as TorchRec cuts it, or whole on
    ``move.rank``; every other table as it was."""
    specs = {t.name: t for t in tables}
    shards: list[list[Shard]] = []
    kinds: list[Kind | None] = []
    for t in plan.tables:
        if t.name != move.table:
            shards.append(list(t.shards))
            kinds.append(None if t.kind in V1_KINDS else t.kind)
        elif move.option.kind in V1_KINDS:
            shards.append([Shard(rank=move.rank, cols=t.dim)])
            kinds.append("table_wise")
        else:
            shards.append(kind_shards(move.option, specs[t.name], plan.topology))
            kinds.append(move.option.kind)
    return Plan.from_shards(
        [specs[t.name] for t in plan.tables],
        shards,
        plan.topology,
        plan.planner,
        kinds=kinds,
    )


def kind_candidates(
    plan: Plan, tables: Sequence[TableSpec], timings: Sequence[Timing]
) -> list[KindMove]:
    """The kind moves worth timing (module docstring): the straggler's costliest
    table-wise table cut, when large enough, then each row-wise table made whole."""
    specs = {t.name: t for t in tables}
    topo = plan.topology
    totals = [t.total for t in timings]
    s = int(np.argmax(totals))
    mean = sum(totals) / len(totals)
    held = plan.shards_per_rank()[s]

    def work(t: PlanTable, sh: Shard) -> float:
        """A-priori weight of a shard: lookups (its rows' share of them) × columns."""
        rows = sh.row_count(t.rows) / t.rows
        w = max(specs[t.name].pooling_factor, 0.05) * sh.cols * rows
        return w / world if local_batch(t.kind) else w

    world = plan.world_size
    rank_work = sum(work(t, sh) for t, sh in held)
    whole = [(t, sh) for t, sh in held if t.kind == "table_wise"]
    out: list[KindMove] = []
    if whole and rank_work > 0:
        hot, hot_shard = max(whole, key=lambda x: work(*x))
        share = work(hot, hot_shard) / rank_work * totals[s]
        if share > ROW_MIN_SHARE * mean:
            for opt in kind_options(specs[hot.name], topo):
                if opt.kind == "row_wise" or (
                    opt.kind == "table_row_wise" and opt.host == host_of(s, topo.local_world)
                ):
                    out.append(KindMove(hot.name, opt))
    used = plan.memory_per_rank(tables)
    roomiest = int(np.argmin(used))
    for t in plan.tables:
        if t.kind in ROW_KINDS and t.kind != "grid" and FUSED in kind_options(specs[t.name], topo):
            out.append(KindMove(t.name, FUSED, roomiest))
    return out


@dataclass
class KindPhase:
    """What the kind moves did: the plan they leave, each change said with its measured
    figures, every step said, and the given plan's and the result's per-rank medians."""

    plan: Plan
    changes: list[str] = field(default_factory=list)
    start_timings: list[Timing] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)
    start_value: float = 0.0
    value: float = 0.0
    kernels: int = 0


def kind_phase(
    plan: Plan,
    tables: Sequence[TableSpec],
    *,
    comm: CommModel | None,
    local_world: int | None,
    seed: int,
    device: str,
    until: float,
    say: Callable[[str], None],
    runners_up: Mapping[str, Plan] | None = None,
) -> KindPhase:
    """Try ``runners_up`` (whole plans of the same tables and topology), then the kind
    moves of :func:`kind_candidates`, each timed on all W ranks beside the plan as it
    is, keeping those that win beyond the noise, while the timings fit before ``until``
    (module docstring)."""
    from shardwise.profiler.evaluate import rank_shards

    per_rank = plan.topology.batch_size_per_rank
    world = plan.world_size
    batch = per_rank * world
    phase = KindPhase(plan)

    def time_rank(loads: Sequence[ShardLoad]) -> Timing:
        if not loads:
            return Timing(0.0, 0.0)
        t0 = time.perf_counter()
        m = measure_compute(
            loads, batch, local_batch_size=per_rank, warmups=WARMUPS, iters=ITERS,
            seed=seed, device=device,
        )  # fmt: skip
        phase.kernels += 1
        return Timing(m.fwd_s, m.bwd_s, m.robust_cv, time.perf_counter() - t0)

    def value(p: Plan, timings: Sequence[Timing]) -> float:
        dims = [0] * world
        for t in p.tables:
            if t.kind in V1_KINDS:
                for sh in t.shards:
                    dims[sh.rank] += sh.cols
        extra = np.zeros(world)
        if comm is not None:
            for part in plan_kind_parts(p, comm, per_rank):
                extra += part.fwd + part.bwd
        return objective(
            timings, dims, comm, per_rank, local_world=local_world, extra=extra.tolist()
        )

    loads = rank_shards(plan, tables)
    t0 = time.perf_counter()
    time_rank(max(loads, key=len))  # a process's first kernel grows its heap: dropped
    first = [time_rank(r) for r in loads]
    round_s = time.perf_counter() - t0
    phase.start_timings = phase.timings = first
    phase.start_value = phase.value = value(plan, first)
    compared = False

    def fits(what: str) -> bool:
        need = 2 * KIND_REPEATS * round_s
        if time.perf_counter() + need <= until:
            return True
        say(
            f"refine: {what} not tried: timing both plans' {world} ranks "
            f"{KIND_REPEATS} times (about {need:.1f} s) does not fit the budget"
        )
        return False

    def judge(cand: Plan, what: str, said: str) -> None:
        """``cand`` against the plan as it is, on all W ranks, interleaved; kept (the
        phase moved to it, recorded as ``what``) only beyond the noise. ``said``: how
        the lines name it."""
        nonlocal round_s, compared
        began = time.perf_counter()
        both = [rank_shards(phase.plan, tables), rank_shards(cand, tables)]
        got: list[list[list[Timing]]] = [[[] for _ in range(world)] for _ in range(2)]
        for rep in range(KIND_REPEATS):
            for r in range(world):
                for which in (0, 1) if (rep + r) % 2 == 0 else (1, 0):
                    got[which][r].append(time_rank(both[which][r]))
        round_s = (time.perf_counter() - began) / (2 * KIND_REPEATS)
        now_t, cand_t = ([_median(ts) for ts in side] for side in got)
        before, after = value(phase.plan, now_t), value(cand, cand_t)
        if not compared:  # the given plan's figures, timed beside its first candidate
            phase.start_timings, phase.start_value, compared = now_t, before, True
        s = max(range(world), key=lambda r: max(now_t[r].total, cand_t[r].total))
        margin = max([MIN_GAIN] + [noise(t) for side in got for t in side[s]])
        line = (
            f"refine: {said}: {_ms(before)} → {_ms(after)} measured on all "
            f"{world} ranks ({KIND_REPEATS} interleaved repeats)"
        )
        if after >= before * (1 - margin):
            say(
                f"{line}: not kept, not below {_ms(before)} by more than the noise margin "
                f"of {100 * margin:.1f} %"
            )
            phase.timings, phase.value = now_t, before
            return
        say(f"{line}: kept")
        phase.plan, phase.timings, phase.value = cand, cand_t, after
        phase.changes.append(f"{what} ({_ms(before)} → {_ms(after)} measured)")

    for name, alt in (runners_up or {}).items():
        kinds = ", ".join(f"{k} {n}" for k, n in split_kinds(alt).items()) or "table-wise only"
        what = f"runner-up {name}'s plan, {kinds}"
        if alt.hash == phase.plan.hash:
            continue
        problems = alt.problems(tables)
        if problems:
            say(f"refine: {what} not tried: {problems[0]}")
            continue
        if not fits(what):
            break
        judge(alt, what, what)
    tried: set[str] = set()
    for _ in range(MAX_KIND_TRIES):
        moves = [
            m for m in kind_candidates(phase.plan, tables, phase.timings) if m.table not in tried
        ]
        if not moves:
            other = "other " if tried else ""
            say(f"refine: no {other}kind move is worth timing (no table-wise table large "
                "enough on the straggler, no row-wise table that fits whole)")  # fmt: skip
            break
        move = moves[0]
        tried.add(move.table)
        what = move.describe(phase.plan)
        if not fits(f"kind move {what}"):
            break
        cand = apply_kind(phase.plan, tables, move)
        problems = cand.problems(tables)
        if problems:
            say(f"refine: kind move {what} not tried: {problems[0]}")
            continue
        judge(cand, what, f"kind move {what}")
    return phase


def _median(timings: Sequence[Timing]) -> Timing:
    med = statistics.median
    cv = max(t.cv for t in timings)
    return Timing(med([t.fwd for t in timings]), med([t.bwd for t in timings]), cv)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"

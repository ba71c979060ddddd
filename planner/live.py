"""Re-planning a running job from its live measurements: the planner's side of the loop.

The workers' live summary (:mod:`shardwise.planner.livecost`) says what each rank's
fused kernels cost per iteration (forward + backward compute) and, from the bounded
probe, what each of its shards costs. :func:`replan` prices every shard from those
figures, keeps the plan's column splits, and moves whole shards between ranks to lower
the predicted max-rank compute, under the same memory rule as every planner.

**Pricing.** A rank's compute is modelled as ``overhead + factor × Σ its shards' live
costs`` (``ShardCost.ms``, keyed by table and column offset), fitted robustly over the
fully probed ranks (:func:`fit_rank_cost`). The probe times shards one at a time and
subtracts an empty call, so it sees each shard's marginal cost; the fused kernels of a
rank also pay a fixed part (launch, outputs, the backward's sort, the optimizer's pass)
whatever they hold, which is the overhead, and the factor brings the parts to the rank's
measured units. Both are one for the job, not one per rank, because a shard's price must
not depend on where it sits: a per-rank factor describes the rank (its device, its
noise, its probe's timing), stays with the rank when its shards move, and would make a
shard's price change by moving it. The overhead stays on every rank that holds a shard,
so the search balances the shards' prices and adds it back. Without two ranks that
differ (or when the fit is not physical) one factor, the ratio of the sums, and no
overhead. A shard without a live cost (its rank's probe has not run, or ran out of
budget) is priced from its rank's measured compute left over after the overhead and the
rank's priced shards, split among such shards in proportion to ``pooling_factor ×
cols`` (pooling floored at 0.05 so a table never read still gets a share): what is
known of the rank is spent on its shards, by the declared specs.

**Search.** Candidates, all moving whole shards (a column shard stays as cut): the plan
as it runs; best-improvement moves and swaps off the predicted max rank from it; a fresh
longest-processing-time greedy (costliest shard first onto the least loaded rank with
room), its ranks relabelled to keep the most bytes where they are, then the same moves
and swaps; and the shortest prefix of the first search's steps within 1 % of the best
candidate. A move never puts two shards of one table on one rank (TorchRec requires
equal widths there, and it would pay two kernels' lookups for one table). The lowest
predicted max wins; among those within 1 % of it, the fewest moved shards, since each
moved shard costs resharding bytes. The job's compute is judged, not its comm: a rank's
measured comm includes its wait for the straggler.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from shardwise.basics import UserError, format_bytes, read_text
from shardwise.planner.livecost import LiveSummary
from shardwise.planner.memory import memory_of
from shardwise.planner.plan import (
    NO_HASH,
    Plan,
    Predicted,
    Shard,
    Topology,
    plan_shapes,
    shape_mismatches,
    spec_shapes,
)
from shardwise.planner.tables import TableSpec

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: The planner name of a re-planned plan: ``"<old planner>+live"``.
LIVE_SUFFIX = "+live"
#: Candidates within this share of the lowest predicted max are a tie: fewest moves wins.
NEAR_TIE = 0.01
#: The smallest pooling factor a shard without a live cost is weighted by.
MIN_POOLING = 0.05
#: Swaps consider the straggler's costliest shards only (a light shard's swap is rarely
#: better than its move), which bounds a round's work at scale.
SWAP_SOURCES = 32
#: A move must lower the straggler by more than this share (float noise, not a gain).
EPS = 1e-9


class LiveInputError(UserError):
    """Inputs :func:`replan` cannot work from. ``subject`` names the input at fault
    (``"plan"``, ``"tables"``, ``"topology"`` or ``"live"``), so a command can name
    its file."""

    def __init__(self, subject: str, message: str) -> None:
        super().__init__(message)
        self.subject = subject


class Move(NamedTuple):
    """One shard moved: ``(table, col_offset, from_rank, to_rank)``."""

    table: str
    col_offset: int
    from_rank: int
    to_rank: int


@dataclass(frozen=True)
class ShardPrices:
    """Every shard of the plan priced in the live summary's milliseconds."""

    #: (table, col_offset) → priced ms per iteration (fwd + bwd).
    ms: dict[tuple[str, int], float]
    #: The job's factor from probe ms to measured ms (see the module's docstring).
    factor: float
    #: Shards priced from their rank's leftover compute (no live cost of their own).
    estimated: int
    #: The fitted fixed cost of a rank that holds any shard (see :func:`fit_rank_cost`).
    overhead: float = 0.0


@dataclass(frozen=True)
class LiveReplan:
    """What :func:`replan` found: the plan to run and the figures that judge it."""

    plan: Plan
    #: Measured compute (fwd + bwd) per rank, as the workers report it.
    current_rank_ms: list[float]
    #: The plan as it runs, priced by the live costs (the search's own baseline).
    priced_rank_ms: list[float]
    #: The chosen plan, priced by the live costs.
    predicted_rank_ms: list[float]
    current_max_ms: float
    predicted_max_ms: float
    #: ``current_max / predicted_max - 1``; 0 when no plan predicts better.
    gain: float
    moves: list[Move]
    #: Weights and optimizer state of the moved shards: what a reshard carries.
    moved_bytes: int
    factor: float
    estimated_shards: int
    seconds: float

    def describe(self) -> str:
        """One line for an Event: what moves and what it predicts."""
        if not self.moves:
            return (
                f"no placement of the live costs predicts a max-rank compute below "
                f"{self.current_max_ms:.1f} ms by more than {NEAR_TIE:.0%}"
            )
        n = len(self.moves)
        return (
            f"moving {n} shard{'s' if n != 1 else ''} ({format_bytes(self.moved_bytes)}) "
            f"predicts max-rank compute {self.current_max_ms:.1f} → "
            f"{self.predicted_max_ms:.1f} ms ({100 * self.gain:+.0f} %)"
        )


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


# --------------------------------------------------------------------------- checks
def _check(plan: Plan, tables: Sequence[TableSpec], topology: Topology, live: LiveSummary) -> None:
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
    where = {(t.name, s.col_offset): (s.rank, s.cols) for t in plan.tables for s in t.shards}
    names = {t.name for t in plan.tables}
    keys: set[tuple[str, int]] = set()
    for sc in live.shards:
        key = (sc.table, sc.col_offset)
        at = where.get(key)
        what = f"shards: table {sc.table!r} at column {sc.col_offset}"
        if sc.table not in names:
            problems.append(f"shards: table {sc.table!r} is not in the plan")
        elif at is None:
            problems.append(f"{what}: the plan has no shard starting there")
        elif at != (sc.rank, sc.cols):
            problems.append(
                f"{what}: {sc.cols} columns on rank {sc.rank} in the summary, "
                f"{at[1]} on rank {at[0]} in the plan"
            )
        elif key in keys:
            problems.append(f"{what}: measured twice")
        keys.add(key)
    if problems:
        raise LiveInputError(
            "live",
            "the live summary does not fit the plan:\n- "
            + "\n- ".join(problems[:20])
            + (f"\n- … and {len(problems) - 20} more" if len(problems) > 20 else ""),
        )


# --------------------------------------------------------------------------- pricing
def price_shards(plan: Plan, tables: Sequence[TableSpec], live: LiveSummary) -> ShardPrices:
    """Every shard of ``plan`` priced in measured ms (the module's docstring says how).
    ``live`` must be a complete summary of ``plan`` (:func:`replan` checks it)."""
    specs = {t.name: t for t in tables}
    compute = {r.rank: r.compute_ms for r in live.measured()}
    probed = {(s.table, s.col_offset): s.ms for s in live.shards}
    per_rank = plan.shards_per_rank()
    points: list[tuple[float, float]] = []
    for rank, held in enumerate(per_rank):
        costs = [probed.get((t.name, s.col_offset)) for t, s in held]
        total = sum(c for c in costs if c is not None)
        if held and None not in costs and total > 0 and compute.get(rank, 0.0) > 0:
            points.append((total, compute[rank]))
    overhead, factor = fit_rank_cost(points)
    ms: dict[tuple[str, int], float] = {}
    estimated = 0
    for rank, held in enumerate(per_rank):
        left = compute.get(rank, 0.0) - (overhead if held else 0.0)
        unknown: list[tuple[tuple[str, int], float]] = []
        for t, s in held:
            key = (t.name, s.col_offset)
            cost = probed.get(key)
            if cost is None:
                unknown.append((key, max(specs[t.name].pooling_factor, MIN_POOLING) * s.cols))
            else:
                ms[key] = factor * cost
                left -= ms[key]
        weight = sum(w for _, w in unknown)
        for key, w in unknown:
            ms[key] = max(left, 0.0) * w / weight
        estimated += len(unknown)
    return ShardPrices(ms, factor, estimated, overhead)


def fit_rank_cost(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(overhead, factor)`` with a rank's compute ≈ overhead + factor × its probed sum,
    over the fully probed ranks (``points``: (probed sum, measured compute)). The
    overhead is what a rank's fused kernels cost whatever they hold (launch, outputs,
    the backward's sort, the optimizer's pass): it stays on every rank that holds a
    shard, so moving shards does not move it. Fitted robustly (Theil–Sen: the median of
    the pairwise slopes, then the median intercept), so one rank's spike does not bend
    it. Without ranks whose sums differ, or when the fit is not physical (a negative
    overhead or factor): no overhead and the median of the ranks' ratios; factor 1 with
    no probed rank."""
    if not points:
        return 0.0, 1.0
    ratio = statistics.median(y / x for x, y in points)
    span = max(x for x, _ in points)
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if abs(x2 - x1) > 1e-6 * span
    ]
    if not slopes:
        return 0.0, ratio
    slope = statistics.median(slopes)
    intercept = statistics.median(y - slope * x for x, y in points)
    if slope <= 0 or intercept < 0:
        return 0.0, ratio
    return intercept, slope


# --------------------------------------------------------------------------- search
@dataclass
class _State:
    """A placement of the fixed shards, with the per-rank sums the search updates."""

    rank: I64
    load: F64
    mem: I64
    count: I64  # [ranks, tables]: shards of each table on each rank

    @classmethod
    def of(cls, rank: I64, cost: F64, mem: I64, table: I64, world: int, n_tables: int) -> _State:
        count = np.zeros((world, n_tables), dtype=np.int64)
        np.add.at(count, (rank, table), 1)
        return cls(
            rank.copy(),
            np.bincount(rank, weights=cost, minlength=world).astype(np.float64),
            np.bincount(rank, weights=mem, minlength=world).astype(np.int64),
            count,
        )

    def copy(self) -> _State:
        return _State(self.rank.copy(), self.load.copy(), self.mem.copy(), self.count.copy())


@dataclass
class _Search:
    """The shards (fixed widths and prices) and the moves the search may make."""

    cost: F64
    mem: I64  # bytes each shard holds under the memory rule at the job's batch
    table: I64
    start: I64  # the rank each shard runs on now
    cap: int
    world: int
    n_tables: int
    max_moves: int | None

    def relocate(self, st: _State, i: int, dst: int) -> None:
        src = int(st.rank[i])
        st.rank[i] = dst
        st.load[src] -= self.cost[i]
        st.load[dst] += self.cost[i]
        st.mem[src] -= self.mem[i]
        st.mem[dst] += self.mem[i]
        st.count[src, self.table[i]] -= 1
        st.count[dst, self.table[i]] += 1

    def moved(self, st: _State) -> int:
        return int(np.count_nonzero(st.rank != self.start))

    def improve(self, st: _State, steps: int | None = None) -> tuple[_State, list[float]]:
        """Best-improvement moves and swaps off the max rank while one lowers it below
        its load (at most ``steps``); each lowers the sorted loads, so it ends (bounded
        rounds anyway). The state, and the predicted max after each step."""
        maxima: list[float] = []
        limit = 4 * len(self.cost) + 64 if steps is None else steps
        for _ in range(limit):
            s = int(np.argmax(st.load))
            best = self._best_off(st, s)
            if best is None:
                break
            a, d, b = best
            self.relocate(st, a, d)
            if b is not None:
                self.relocate(st, b, s)
            maxima.append(float(st.load.max()))
        return self.undo_idle(st), maxima

    def _best_off(self, st: _State, s: int) -> tuple[int, int, int | None] | None:
        """The move or swap off rank ``s`` that leaves the lower of the two ranks' new
        maxima, if below ``s``'s load now: (shard, destination, swap partner)."""
        on_s = np.flatnonzero(st.rank == s)
        if not on_s.size:
            return None
        target = st.load[s] * (1 - EPS)
        budget = None if self.max_moves is None else self.max_moves - self.moved(st)
        ca, ma, ta, oa = self.cost[on_s], self.mem[on_s], self.table[on_s], self.start[on_s]
        # Moves: shard a (rows) to rank d (columns).
        ranks = np.arange(self.world)
        ok = (st.count[:, ta].T == 0) & (st.mem[None, :] + ma[:, None] <= self.cap)
        ok[:, s] = False
        delta = (oa[:, None] != ranks[None, :]).astype(np.int64) - (oa != s)[:, None]
        if budget is not None:
            ok &= delta <= budget
        value = np.maximum(st.load[s] - ca[:, None], st.load[None, :] + ca[:, None])
        value = np.where(ok, value, np.inf)
        k = int(np.argmin(value))
        best_value = float(value.flat[k])
        a, d = divmod(k, self.world)
        best: tuple[int, int, int | None] | None = (
            (int(on_s[a]), d, None) if best_value < target else None
        )
        # Swaps: one of s's costliest shards (rows) for any shard b elsewhere (columns).
        top = np.argsort(-ca, kind="stable")[:SWAP_SOURCES]
        ca, ma, ta, oa = ca[top], ma[top], ta[top], oa[top]
        on_b = np.flatnonzero(st.rank != s)
        if not on_b.size:
            return best
        cb, mb, tb = self.cost[on_b], self.mem[on_b], self.table[on_b]
        db = st.rank[on_b]
        dc = ca[:, None] - cb[None, :]
        value2 = np.maximum(st.load[s] - dc, st.load[db][None, :] + dc)
        useful = (dc > 0) & (value2 < min(target, best_value))
        if not useful.any():
            return best
        ia, ib = np.nonzero(useful)
        same = (ta[ia] == tb[ib]).astype(np.int64)
        dm = ma[ia] - mb[ib]
        d2 = db[ib]
        ok2 = (
            (st.count[d2, ta[ia]] - same == 0)
            & (st.count[s, tb[ib]] - same == 0)
            & ((st.mem[d2] + dm <= self.cap) | (dm <= 0))
            & ((st.mem[s] - dm <= self.cap) | (dm >= 0))
        )
        if budget is not None:
            ob = self.start[on_b][ib]
            moved = (oa[ia] != d2).astype(np.int64) - (oa[ia] != s)
            moved += (ob != s).astype(np.int64) - (ob != d2)
            ok2 &= moved <= budget
        if not ok2.any():
            return best
        v = np.where(ok2, value2[ia, ib], np.inf)
        j = int(np.argmin(v))
        return int(on_s[top[ia[j]]]), int(d2[j]), int(on_b[ib[j]])

    def undo_idle(self, st: _State) -> _State:
        """Moved shards go back where they run when that raises no rank above the
        predicted max: a move that does not lower the max is only resharding bytes."""
        order = np.argsort(-self.mem, kind="stable")
        changed = True
        while changed:
            changed = False
            top = float(st.load.max())
            for i in order:
                src, home = int(st.rank[i]), int(self.start[i])
                if src == home or st.count[home, self.table[i]] > 0:
                    continue
                if st.mem[home] + self.mem[i] > self.cap:
                    continue
                if st.load[home] + self.cost[i] <= top * (1 + EPS):
                    self.relocate(st, int(i), home)
                    changed = True
        return st

    def greedy(self) -> _State | None:
        """Longest processing time first: each shard onto the least loaded rank that
        has room and no shard of its table; None when one does not fit. Its ranks are
        then relabelled (the GPUs are alike) to keep the most bytes where they are."""
        none = np.zeros(0, dtype=np.int64)
        st = _State.of(none, self.cost[:0], none, none, self.world, self.n_tables)
        rank = np.full(len(self.cost), -1, dtype=np.int64)
        for i in np.lexsort((-self.mem, -self.cost)):
            ok = (st.count[:, self.table[i]] == 0) & (st.mem + self.mem[i] <= self.cap)
            if not ok.any():
                return None
            d = int(np.argmin(np.where(ok, st.load, np.inf)))
            rank[i] = d
            st.load[d] += self.cost[i]
            st.mem[d] += self.mem[i]
            st.count[d, self.table[i]] += 1
        keep = np.zeros((self.world, self.world), dtype=np.float64)  # [bin, rank]
        np.add.at(keep, (rank, self.start), self.mem.astype(np.float64) + 1.0)
        label = np.full(self.world, -1, dtype=np.int64)
        for _ in range(self.world):
            b, r = np.unravel_index(int(np.argmax(keep)), keep.shape)
            label[b] = r
            keep[b, :] = -1.0
            keep[:, r] = -1.0
        return _State.of(label[rank], self.cost, self.mem, self.table, self.world, self.n_tables)


# --------------------------------------------------------------------------- replan
def replan(
    plan: Plan,
    tables: Sequence[TableSpec],
    topology: Topology,
    live: LiveSummary,
    *,
    max_moves: int | None = None,
) -> LiveReplan:
    """Re-place ``plan``'s shards on ``topology`` by the live costs in ``live`` (the
    module's docstring says how), moving at most ``max_moves`` shards.

    Memory is the planner's rule (:mod:`shardwise.planner.memory`) at the larger of the
    plan's batch and the batch the job trains at (``live.batch_size_per_rank``), so both
    the plan's validation and the workers' check pass; a rank the running plan already
    fills beyond ``topology`` is never filled further. Pure and fast (well under a
    second for 1,000 tables on 8 ranks). Inputs that do not belong together (a summary
    of another plan or world size, tables not the plan's, ranks not yet measured) are a
    :class:`LiveInputError`.
    """
    t0 = time.perf_counter()
    _check(plan, tables, topology, live)
    prices = price_shards(plan, tables, live)
    specs = {t.name: t for t in tables}
    world = plan.world_size
    batch = max(topology.batch_size_per_rank, live.batch_size_per_rank)
    slots = [(ti, s) for ti, t in enumerate(plan.tables) for s in t.shards]
    cost = np.array([prices.ms[(plan.tables[ti].name, s.col_offset)] for ti, s in slots])
    mems = [
        memory_of(t.rows, s.cols, t.dtype, specs[t.name].pooling_factor, batch, world)
        for t, s in ((plan.tables[ti], s) for ti, s in slots)
    ]
    search = _Search(
        cost=cost.astype(np.float64),
        mem=np.array([m.total for m in mems], dtype=np.int64),
        table=np.array([ti for ti, _ in slots], dtype=np.int64),
        start=np.array([s.rank for _, s in slots], dtype=np.int64),
        cap=topology.usable_bytes,
        world=world,
        n_tables=len(plan.tables),
        max_moves=max_moves,
    )
    now = _State.of(search.start, search.cost, search.mem, search.table, world, len(plan.tables))
    improved, maxima = search.improve(now.copy())
    candidates = [now, improved]
    fresh = search.greedy()
    if fresh is not None:
        candidates += [fresh, search.improve(fresh.copy())[0]]
    if max_moves is not None:
        candidates = [c for c in candidates if search.moved(c) <= max_moves]
    low = min(float(c.load.max()) for c in candidates)
    # The first steps from the running plan that come within the tie of the best: the
    # same gain, give or take 1 %, for fewer moved shards.
    enough = next((k for k, m in enumerate(maxima) if m <= low * (1 + NEAR_TIE)), None)
    if enough is not None and enough + 1 < len(maxima):
        candidates.append(search.improve(now.copy(), steps=enough + 1)[0])
    chosen = min(
        (c for c in candidates if float(c.load.max()) <= low * (1 + NEAR_TIE)),
        key=lambda c: (search.moved(c), float(c.load.max())),
    )
    current = [0.0] * world
    for r in live.measured():
        current[r.rank] = r.compute_ms
    c0 = prices.overhead

    def ranks_ms(st: _State) -> list[float]:
        """A placement's priced compute per rank: its shards, and the fixed overhead."""
        return [float(x) + (c0 if st.count[r].any() else 0.0) for r, x in enumerate(st.load)]

    current_max = max(current)
    predicted_max = max(ranks_ms(chosen))
    gain = current_max / predicted_max - 1 if predicted_max > 0 else 0.0
    if search.moved(chosen) == 0 or gain <= 0:
        chosen, gain = now, 0.0
    moves = [
        Move(plan.tables[ti].name, s.col_offset, s.rank, int(r))
        for (ti, s), r in zip(slots, chosen.rank, strict=True)
        if int(r) != s.rank
    ]
    moved_bytes = sum(
        m.weights + m.optimizer
        for m, r, r0 in zip(mems, chosen.rank, search.start, strict=True)
        if r != r0
    )
    predicted = ranks_ms(chosen)
    per_rank_s = [ms / 1e3 for ms in predicted]
    if not moves:  # the plan that runs, as it is (same topology, same hash)
        new = plan.model_copy(update={"predicted": Predicted.from_costs(per_rank_s)})
    else:
        placed: list[list[Shard]] = [[] for _ in plan.tables]
        for (ti, s), r in zip(slots, chosen.rank, strict=True):
            placed[ti].append(s.model_copy(update={"rank": int(r)}))
        name = plan.planner if plan.planner.endswith(LIVE_SUFFIX) else plan.planner + LIVE_SUFFIX
        specs_in_order = [specs[t.name] for t in plan.tables]
        new = Plan.from_shards(specs_in_order, placed, topology, name, per_rank_s)
    return LiveReplan(
        plan=new,
        current_rank_ms=current,
        priced_rank_ms=ranks_ms(now),
        predicted_rank_ms=predicted,
        current_max_ms=current_max,
        predicted_max_ms=float(max(predicted)),
        gain=gain,
        moves=moves,
        moved_bytes=moved_bytes,
        factor=prices.factor,
        estimated_shards=prices.estimated,
        seconds=time.perf_counter() - t0,
    )

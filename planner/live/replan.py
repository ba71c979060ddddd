"""Re-planning a running job from its live measurements: the planner's side of the loop.

The workers' live summary (:mod:`shardwise.planner.live.summary`) says what each rank's
fused kernels cost per iteration (forward + backward compute) and, from the bounded
probe, what each of its shards costs. :func:`replan` prices every shard from those
figures, keeps the plan's column splits, and moves whole shards between ranks to lower
the predicted max-rank compute, under the same memory rule as every planner.

**Pricing** is :mod:`shardwise.planner.live.prices`'s: every shard in the live
summary's milliseconds, the rank's fixed part fitted apart.

**Kinds.** Only table-wise and column-wise shards move. A row-wise, table-row-wise,
grid or data-parallel table stays where it is (moving a row range changes the cut
TorchRec runs; changing a table's kind is another step), but its shards are priced
like any other, so the ranks that hold them carry their cost and their memory, and
the movable shards balance around them.

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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from shardwise.basics import format_bytes
from shardwise.planner.costmodel.rankhead import RankHead
from shardwise.planner.kinds import V1_KINDS
from shardwise.planner.live.fit import NOISE, LiveFit
from shardwise.planner.live.headprior import head_prior
from shardwise.planner.live.inputs import check_inputs
from shardwise.planner.live.prices import ShardPrices, price_shards
from shardwise.planner.live.summary import LiveSummary, RankPoint, ShardKey
from shardwise.planner.plan import (
    Plan,
    Predicted,
    Shard,
)
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: The planner name of a re-planned plan: ``"<old planner>+live"``.
LIVE_SUFFIX = "+live"
#: Candidates within this share of the lowest predicted max are a tie: fewest moves wins.
NEAR_TIE = 0.01
#: Swaps consider the straggler's costliest shards only (a light shard's swap is rarely
#: better than its move), which bounds a round's work at scale.
SWAP_SOURCES = 32
#: A move must lower the straggler by more than this share (float noise, not a gain).
EPS = 1e-9


class Move(NamedTuple):
    """One shard moved: ``(table, col_offset, from_rank, to_rank)``."""

    table: str
    col_offset: int
    from_rank: int
    to_rank: int


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
    estimated_shards: int
    seconds: float
    #: The fitted prices, their plausible alternatives and what could be checked.
    fit: LiveFit
    #: Each rank of the chosen plan at its worst plausible price, and the worst max.
    risk_rank_ms: list[float]
    risk_max_ms: float
    #: ``current_max / risk_max - 1``: the gain if the evidence is as unkind as it may be.
    risk_gain: float

    @property
    def factor(self) -> float:
        return self.fit.best.factor

    @property
    def uncertainty(self) -> float:
        """How far the gain may be off: the plausible prices' spread (``gain -
        risk_gain``) plus a rank's measurement noise, for the plan measured after as
        for the one measured before."""
        return (self.gain - self.risk_gain) + (1 + self.gain) * NOISE

    def describe(self) -> str:
        """One line for an Event: what moves and what it predicts."""
        if not self.moves:
            worst = " at its worst plausible price" if self.fit.alternatives else ""
            text = (
                f"no placement of the live costs predicts a max-rank compute below "
                f"{self.current_max_ms:.1f} ms by more than {NEAR_TIE:.0%}{worst}"
            )
            return text + (f" ({self.fit.note})" if self.fit.note else "")
        n = len(self.moves)
        return (
            f"moving {n} shard{'s' if n != 1 else ''} ({format_bytes(self.moved_bytes)}) "
            f"predicts max-rank compute {self.current_max_ms:.1f} → "
            f"{self.predicted_max_ms:.1f} ms ({100 * self.gain:+.0f} % ± "
            f"{100 * self.uncertainty:.0f} %)"
        )


# --------------------------------------------------------------------------- search
@dataclass
class _State:
    """A placement of the fixed shards, with the per-rank sums the search updates."""

    rank: I64
    cnt: I64  # shards on each rank
    probe: F64  # their marginals summed (probe ms)
    var: F64  # how far the moved shards' marginals may be off, squared (in and out)
    mem: I64
    count: I64  # [ranks, tables]: shards of each table on each rank
    #: [K, ranks]: under each parameter set, what its shards' measured residuals add
    extra: F64

    @classmethod
    def of(
        cls,
        rank: I64,
        marg: F64,
        var: F64,
        mem: I64,
        table: I64,
        unit: I64,
        world: int,
        n_tables: int,
        start: I64,
        var_out: F64,
        delta: F64,
    ) -> _State:
        count = np.zeros((world, n_tables), dtype=np.int64)
        np.add.at(count, (rank, table), 1)
        gone = rank != start
        moved_var = np.bincount(rank[gone], weights=var[gone], minlength=world) + np.bincount(
            start[gone], weights=var_out[gone], minlength=world
        )
        return cls(
            rank.copy(),
            np.bincount(rank, weights=unit, minlength=world).astype(np.int64),
            np.bincount(rank, weights=marg, minlength=world).astype(np.float64),
            moved_var.astype(np.float64),
            np.bincount(rank, weights=mem, minlength=world).astype(np.int64),
            count,
            np.array(
                [np.bincount(rank, weights=d, minlength=world) for d in delta],
                dtype=np.float64,
            ).reshape(len(delta), world),
        )

    def copy(self) -> _State:
        return _State(
            self.rank.copy(), self.cnt.copy(), self.probe.copy(), self.var.copy(),
            self.mem.copy(), self.count.copy(), self.extra.copy(),
        )  # fmt: skip


@dataclass
class _Search:
    """The shards (fixed widths and marginals) and the moves the search may make. A
    rank's cost is its worst price over the fit's plausible parameters (``params``:
    rows of (fixed part, share, factor)): a move whose gain rests on what was not
    measured is priced as such.

    **Anchored on the measured ranks.** Under each parameter set, what it leaves
    unexplained of a rank's measured compute is spread over that rank's shards in
    proportion to their prices (``delta``: each shard's part, which moves with it): a
    rank is predicted as its measurement plus the price of what moves in, less the
    price of what moves out, and every parameter set reproduces the running plan. A
    parameter set's error on a rank is its error on that rank's shards (the factor off
    prices a heavy shard off), so it goes where they go; the probe's spread counts for
    the moved shards alone."""

    marg: F64  # each shard's marginal, probe ms
    var: F64  # how far it may be off, squared: what moving it in adds to a rank's doubt
    #: What moving it out adds: no more than its price (a shard's leaving never raises
    #: its rank), squared, in the probe's ms.
    var_out: F64
    mem: I64  # bytes each shard holds under the memory rule at the job's batch
    table: I64
    start: I64  # the rank each shard runs on now
    cap: int
    world: int
    n_tables: int
    max_moves: int | None
    #: Shards that may move (table-wise and column-wise); the others stay put.
    movable: npt.NDArray[np.bool_]
    params: F64  # [K, 3]
    unit: I64  # 1 for a shard that holds rows, 0 for an empty row range
    #: [K, shards]: each shard's part of its rank's residual under each parameter set.
    delta: F64

    def state(self, rank: I64) -> _State:
        return _State.of(
            rank, self.marg, self.var, self.mem, self.table, self.unit, self.world,
            self.n_tables, self.start, self.var_out, self.delta,
        )  # fmt: skip

    def risk(self, cnt: npt.ArrayLike, probe: npt.ArrayLike, var: npt.ArrayLike, extra: F64) -> F64:
        """The worst price over the plausible parameters of ranks holding ``cnt``
        shards whose marginals sum to ``probe`` and whose residuals sum to ``extra``
        (one leading row per parameter set), plus the factor times how far the moved
        shards' marginals may be off (``var``, squared) (any shapes that broadcast)."""
        c = np.asarray(cnt, dtype=np.float64)
        m = np.asarray(probe, dtype=np.float64)
        e = np.asarray(extra, dtype=np.float64)
        ndim = max(c.ndim, m.ndim, e.ndim - 1)
        p = self.params.reshape((-1, 3) + (1,) * ndim)
        priced = p[:, 0] * (c > 0) + p[:, 1] * c + p[:, 2] * m + e
        worst = np.max(priced, axis=0)
        out: F64 = worst + self.params[0, 2] * np.sqrt(np.maximum(var, 0.0))
        return out

    def loads(self, st: _State) -> F64:
        return self.risk(st.cnt, st.probe, st.var, st.extra)

    def relocate(self, st: _State, i: int, dst: int) -> None:
        src, home = int(st.rank[i]), int(self.start[i])
        st.rank[i] = dst
        st.cnt[src] -= self.unit[i]
        st.cnt[dst] += self.unit[i]
        st.probe[src] -= self.marg[i]
        st.probe[dst] += self.marg[i]
        # a shard's spread counts on the ranks it moved between, until it is back home
        st.var[src] += self.var_out[i] if src == home else -self.var[i]
        st.var[dst] += -self.var_out[i] if dst == home else self.var[i]
        st.mem[src] -= self.mem[i]
        st.mem[dst] += self.mem[i]
        st.count[src, self.table[i]] -= 1
        st.count[dst, self.table[i]] += 1
        st.extra[:, src] -= self.delta[:, i]
        st.extra[:, dst] += self.delta[:, i]

    def moved(self, st: _State) -> int:
        return int(np.count_nonzero(st.rank != self.start))

    def improve(
        self, st: _State, steps: int | None = None, *, swaps_only: bool = False
    ) -> tuple[_State, list[float]]:
        """Best-improvement moves and swaps off the max rank while one lowers it below
        its cost (at most ``steps``); each lowers the sorted costs, so it ends (bounded
        rounds anyway). The state, and the max after each step."""
        maxima: list[float] = []
        limit = 4 * len(self.marg) + 64 if steps is None else steps
        for _ in range(limit):
            s = int(np.argmax(self.loads(st)))
            best = self._best_off(st, s, swaps_only)
            if best is None:
                break
            a, d, b = best
            self.relocate(st, a, d)
            if b is not None:
                self.relocate(st, b, s)
            maxima.append(float(self.loads(st).max()))
        return self.undo_idle(st), maxima

    def _best_off(
        self, st: _State, s: int, swaps_only: bool = False
    ) -> tuple[int, int, int | None] | None:
        """The move or swap off rank ``s`` that leaves the lower of the two ranks' new
        costs, if below ``s``'s cost now: (shard, destination, swap partner)."""
        on_s = np.flatnonzero((st.rank == s) & self.movable)
        if not on_s.size:
            return None
        target = float(self.risk(st.cnt[s], st.probe[s], st.var[s], st.extra[:, s])) * (1 - EPS)
        budget = None if self.max_moves is None else self.max_moves - self.moved(st)
        ca, ma, ta, oa = self.marg[on_s], self.mem[on_s], self.table[on_s], self.start[on_s]
        ua, va, vo = self.unit[on_s], self.var[on_s], self.var_out[on_s]
        # Moves: shard a (rows) to rank d (columns).
        ranks = np.arange(self.world)
        ok = (st.count[:, ta].T == 0) & (st.mem[None, :] + ma[:, None] <= self.cap)
        ok[:, s] = False
        delta = (oa[:, None] != ranks[None, :]).astype(np.int64) - (oa != s)[:, None]
        if budget is not None:
            ok &= delta <= budget
        da = self.delta[:, on_s]  # [K, a]
        va_out = np.where(oa == s, vo, -va)  # a leaves s: a spread more, or one fewer
        left = self.risk(
            st.cnt[s] - ua, st.probe[s] - ca, st.var[s] + va_out, st.extra[:, s, None] - da
        )
        home_d = oa[:, None] == ranks[None, :]
        there = self.risk(
            st.cnt[None, :] + ua[:, None],
            st.probe[None, :] + ca[:, None],
            st.var[None, :] + np.where(home_d, -vo[:, None], va[:, None]),
            st.extra[:, None, :] + da[:, :, None],
        )
        value = np.maximum(left[:, None], there)
        value = np.where(ok, value, np.inf)
        k = int(np.argmin(value))
        best_value = np.inf if swaps_only else float(value.flat[k])
        a, d = divmod(k, self.world)
        best: tuple[int, int, int | None] | None = (
            (int(on_s[a]), d, None) if best_value < target and not swaps_only else None
        )
        # Swaps: one of s's costliest shards (rows) for any shard b elsewhere (columns).
        top = np.argsort(-ca, kind="stable")[:SWAP_SOURCES]
        ca, ma, ta, oa, ua = ca[top], ma[top], ta[top], oa[top], ua[top]
        va, vo, da = va[top], vo[top], da[:, top]
        on_b = np.flatnonzero((st.rank != s) & self.movable)
        if not on_b.size:
            return best
        cb, mb, tb, ub = self.marg[on_b], self.mem[on_b], self.table[on_b], self.unit[on_b]
        db, ob, vb, vbo = st.rank[on_b], self.start[on_b], self.var[on_b], self.var_out[on_b]
        dc = ca[:, None] - cb[None, :]
        du = ua[:, None] - ub[None, :]
        # spreads of the moved shards: a leaves s for db, b leaves db for s
        dv_here = np.where(oa == s, vo, -va)[:, None] + np.where(ob == s, -vbo, vb)[None, :]
        dv_away = (
            np.where(oa[:, None] == db[None, :], -vo[:, None], va[:, None])
            + np.where(ob == db, vbo, -vb)[None, :]
        )
        de = da[:, :, None] - self.delta[:, on_b][:, None, :]  # [K, a, b]
        here = self.risk(
            st.cnt[s] - du, st.probe[s] - dc, st.var[s] + dv_here, st.extra[:, s, None, None] - de
        )
        away = self.risk(
            st.cnt[db][None, :] + du,
            st.probe[db][None, :] + dc,
            st.var[db][None, :] + dv_away,
            st.extra[:, db][:, None, :] + de,
        )
        value2 = np.maximum(here, away)
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
        max: a move that does not lower the max is only resharding bytes."""
        order = np.argsort(-self.mem, kind="stable")
        changed = True
        while changed:
            changed = False
            top = float(self.loads(st).max())
            for i in order:
                src, home = int(st.rank[i]), int(self.start[i])
                if src == home or st.count[home, self.table[i]] > 0:
                    continue
                if st.mem[home] + self.mem[i] > self.cap:
                    continue
                back = float(
                    self.risk(
                        st.cnt[home] + self.unit[i],
                        st.probe[home] + self.marg[i],
                        st.var[home] - self.var_out[i],
                        st.extra[:, home] + self.delta[:, i],
                    )
                )
                if back <= top * (1 + EPS):
                    self.relocate(st, int(i), home)
                    changed = True
        return st

    def greedy(self) -> _State | None:
        """Longest processing time first: each shard onto the rank whose cost it raises
        least, among those with room and no shard of its table; None when one does not
        fit. Its ranks are then relabelled (the GPUs are alike) to keep the most bytes
        where they are. Shards that stay put are placed first, where they are, and
        keep the ranks' labels."""
        fixed = ~self.movable
        st = _State.of(
            self.start[fixed], self.marg[fixed], self.var[fixed], self.mem[fixed],
            self.table[fixed], self.unit[fixed], self.world, self.n_tables,
            self.start[fixed], self.var_out[fixed], self.delta[:, fixed],
        )  # fmt: skip
        rank = np.where(fixed, self.start, -1).astype(np.int64)
        for i in np.lexsort((-self.mem, -self.marg)):
            if fixed[i]:
                continue
            ok = (st.count[:, self.table[i]] == 0) & (st.mem + self.mem[i] <= self.cap)
            if not ok.any():
                return None
            after = self.risk(
                st.cnt + self.unit[i],
                st.probe + self.marg[i],
                st.var + self.var[i],
                st.extra + self.delta[:, i, None],
            )
            d = int(np.argmin(np.where(ok, after, np.inf)))
            rank[i] = d
            st.cnt[d] += self.unit[i]
            st.probe[d] += self.marg[i]
            st.var[d] += self.var[i]
            st.mem[d] += self.mem[i]
            st.count[d, self.table[i]] += 1
            st.extra[:, d] += self.delta[:, i]
        if fixed.any():  # the ranks are not alike: they hold what stays
            return self.state(rank)
        keep = np.zeros((self.world, self.world), dtype=np.float64)  # [bin, rank]
        np.add.at(keep, (rank, self.start), self.mem.astype(np.float64) + 1.0)
        label = np.full(self.world, -1, dtype=np.int64)
        for _ in range(self.world):
            b, r = np.unravel_index(int(np.argmax(keep)), keep.shape)
            label[b] = r
            keep[b, :] = -1.0
            keep[:, r] = -1.0
        return self.state(label[rank])


def _out_var(prices: ShardPrices, key: ShardKey) -> float:
    """What moving a shard out adds to its rank's doubt (squared, probe ms): its spread,
    but no more than its price, since a shard's leaving never raises its rank."""
    f = prices.fit.best.factor
    return min(prices.spread[key], max(prices.ms[key], 0.0) / f) ** 2 if f > 0 else 0.0


#: A rank's residual scales its shards' prices by at most this factor (or its inverse).
MAX_RESIDUAL_SCALE = 3.0


def _residual_shares(search: _Search, scenarios: F64, measured: F64) -> F64:
    """[K, shards]: under each parameter set, each shard's part of what that set leaves
    unexplained of its rank's measured compute, in proportion to the shard's price
    (scaling the rank's prices by at most :data:`MAX_RESIDUAL_SCALE`)."""
    out = np.zeros((len(scenarios), len(search.marg)), dtype=np.float64)
    cnt = np.bincount(search.start, weights=search.unit, minlength=search.world)
    probe = np.bincount(search.start, weights=search.marg, minlength=search.world)
    for k, (c0, a, f) in enumerate(scenarios):
        part = a * search.unit + f * search.marg  # each shard's own price
        shards = a * cnt + f * probe  # the ranks' shards priced
        resid = measured - c0 * (cnt > 0) - shards
        ok = (measured > 0) & (shards > 0)
        scale = np.where(ok, resid / np.where(ok, shards, 1.0), 0.0)
        scale = np.clip(scale, 1 / MAX_RESIDUAL_SCALE - 1, MAX_RESIDUAL_SCALE - 1)
        out[k] = scale[search.start] * part
    return out


# --------------------------------------------------------------------------- replan
def replan(
    plan: Plan,
    tables: Sequence[TableSpec],
    topology: Topology,
    live: LiveSummary,
    *,
    max_moves: int | None = None,
    history: Sequence[RankPoint] = (),
    head: RankHead | None = None,
) -> LiveReplan:
    """Re-place ``plan``'s shards on ``topology`` by the live costs in ``live`` (the
    module's docstring says how), moving at most ``max_moves`` shards. ``history``:
    measured ranks of other plans this job ran (a reshard that did not deliver);
    ``head``: a calibrated model's rank head, for what it knows of a rank's fixed part.

    Memory is the planner's rule (:mod:`shardwise.planner.memory`) at the larger of the
    plan's batch and the batch the job trains at (``live.batch_size_per_rank``), so both
    the plan's validation and the workers' check pass; a rank the running plan already
    fills beyond ``topology`` is never filled further. Pure and fast (well under a
    second for 1,000 tables on 8 ranks). Inputs that do not belong together (a summary
    of another plan or world size, tables not the plan's, ranks not yet measured) are a
    :class:`LiveInputError`.
    """
    t0 = time.perf_counter()
    check_inputs(plan, tables, topology, live)
    priors = []
    if head is not None:
        prior, _ = head_prior(head, plan, tables, live)
        if prior is not None:
            priors.append(prior)
    prices = price_shards(plan, tables, live, history=history, priors=priors)
    specs = {t.name: t for t in tables}
    world = plan.world_size
    batch = max(topology.batch_size_per_rank, live.batch_size_per_rank)
    local = topology.local_world
    slots = [(ti, s) for ti, t in enumerate(plan.tables) for s in t.shards]
    keys = [(plan.tables[ti].name, s.rank, s.row_offset, s.col_offset) for ti, s in slots]
    mems = [
        t.shard_memory(s, specs[t.name].pooling_factor, batch, world, local)
        for t, s in ((plan.tables[ti], s) for ti, s in slots)
    ]
    fit = prices.fit
    current = [0.0] * world
    for r in live.measured():
        current[r.rank] = r.compute_ms
    scenarios = np.array(
        [(p.overhead, p.share, p.factor) for p in fit.scenarios()], dtype=np.float64
    )
    search = _Search(
        marg=np.array([prices.marginal[k] for k in keys], dtype=np.float64),
        var=np.array([prices.spread[k] ** 2 for k in keys], dtype=np.float64),
        var_out=np.array([_out_var(prices, k) for k in keys], dtype=np.float64),
        mem=np.array([m.total for m in mems], dtype=np.int64),
        table=np.array([ti for ti, _ in slots], dtype=np.int64),
        start=np.array([s.rank for _, s in slots], dtype=np.int64),
        cap=topology.usable_bytes,
        world=world,
        n_tables=len(plan.tables),
        max_moves=max_moves,
        movable=np.array([plan.tables[ti].kind in V1_KINDS for ti, _ in slots], dtype=bool),
        params=scenarios,
        unit=np.array(
            [int(s.row_count(plan.tables[ti].rows) > 0) for ti, s in slots], dtype=np.int64
        ),
        delta=np.zeros((len(scenarios), len(slots)), dtype=np.float64),
    )
    search.delta = _residual_shares(search, scenarios, np.array(current, dtype=np.float64))
    now = search.state(search.start)
    improved, maxima = search.improve(now.copy())
    candidates = [now, improved]
    if not fit.checked:  # swaps alone keep every rank's shard count: no doubt on the share
        candidates.append(search.improve(now.copy(), swaps_only=True)[0])
    fresh = search.greedy()
    if fresh is not None:
        candidates += [fresh, search.improve(fresh.copy())[0]]
    if max_moves is not None:
        candidates = [c for c in candidates if search.moved(c) <= max_moves]
    low = min(float(search.loads(c).max()) for c in candidates)
    # The first steps from the running plan that come within the tie of the best: the
    # same gain, give or take 1 %, for fewer moved shards.
    enough = next((k for k, m in enumerate(maxima) if m <= low * (1 + NEAR_TIE)), None)
    if enough is not None and enough + 1 < len(maxima):
        candidates.append(search.improve(now.copy(), steps=enough + 1)[0])
    chosen = min(
        (c for c in candidates if float(search.loads(c).max()) <= low * (1 + NEAR_TIE)),
        key=lambda c: (search.moved(c), float(search.loads(c).max())),
    )

    def ranks_ms(st: _State) -> list[float]:
        """A placement's priced compute per rank by the best fit, anchored on the
        measured ranks (their residuals under the best fit, moved with their shards)."""
        priced = fit.best.rank_ms(st.cnt > 0, st.cnt, st.probe) + st.extra[0]
        return [float(x) for x in priced]

    def fitted_ms(st: _State) -> list[float]:
        """The same, as the fit alone prices it (its error on the measured ranks)."""
        return [float(x) for x in fit.best.rank_ms(st.cnt > 0, st.cnt, st.probe)]

    current_max = max(current)
    predicted_max = max(ranks_ms(chosen))
    gain = current_max / predicted_max - 1 if predicted_max > 0 else 0.0
    if search.moved(chosen) == 0 or gain <= 0:
        chosen, gain = now, 0.0
    risk = [float(x) for x in search.loads(chosen)]
    risk_max = max(risk)
    risk_gain = current_max / risk_max - 1 if risk_max > 0 and chosen is not now else 0.0
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
        kinds = [t.kind for t in plan.tables]
        new = Plan.from_shards(specs_in_order, placed, topology, name, per_rank_s, kinds=kinds)
    return LiveReplan(
        plan=new,
        current_rank_ms=current,
        priced_rank_ms=fitted_ms(now),
        predicted_rank_ms=predicted,
        current_max_ms=current_max,
        predicted_max_ms=float(max(predicted)),
        gain=gain,
        moves=moves,
        moved_bytes=moved_bytes,
        estimated_shards=prices.estimated,
        seconds=time.perf_counter() - t0,
        fit=fit,
        risk_rank_ms=risk,
        risk_max_ms=risk_max,
        risk_gain=risk_gain,
    )

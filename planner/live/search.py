"""The live re-plan's search: shards (their live prices, memory and spreads) placed on
ranks, moved and swapped off the straggler, each placement priced at its worst
plausible price (:class:`Search`, the docstrings say how). :mod:`.replan` builds it from
the live prices, :mod:`.kinds` from a plan whose table changed its kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shardwise.planner.live.prices import ShardPrices
from shardwise.planner.live.summary import ShardKey

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Swaps consider the straggler's costliest shards only (a light shard's swap is rarely
#: better than its move), which bounds a round's work at scale.
SWAP_SOURCES = 32
#: A move must lower the straggler by more than this share (float noise, not a gain).
EPS = 1e-9


@dataclass
class State:
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
        var_base: F64 | None = None,
    ) -> State:
        count = np.zeros((world, n_tables), dtype=np.int64)
        np.add.at(count, (rank, table), 1)
        gone = rank != start
        moved_var = (
            np.bincount(rank[gone], weights=var[gone], minlength=world)
            + np.bincount(start[gone], weights=var_out[gone], minlength=world)
        ).astype(np.float64)
        if var_base is not None:
            moved_var = moved_var + var_base
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

    def copy(self) -> State:
        return State(
            self.rank.copy(), self.cnt.copy(), self.probe.copy(), self.var.copy(),
            self.mem.copy(), self.count.copy(), self.extra.copy(),
        )  # fmt: skip


@dataclass
class Search:
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
    #: Doubt (squared, probe ms) each rank carries whatever moves: what a changed kind
    #: put there or took away (:mod:`.kinds`); None: none.
    var_base: F64 | None = None

    def state(self, rank: I64) -> State:
        return State.of(
            rank, self.marg, self.var, self.mem, self.table, self.unit, self.world,
            self.n_tables, self.start, self.var_out, self.delta, self.var_base,
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

    def loads(self, st: State) -> F64:
        return self.risk(st.cnt, st.probe, st.var, st.extra)

    def relocate(self, st: State, i: int, dst: int) -> None:
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

    def moved(self, st: State) -> int:
        return int(np.count_nonzero(st.rank != self.start))

    def improve(
        self, st: State, steps: int | None = None, *, swaps_only: bool = False
    ) -> tuple[State, list[float]]:
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
        self, st: State, s: int, swaps_only: bool = False
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

    def undo_idle(self, st: State) -> State:
        """Moved shards go back where they run when that raises no rank above the
        max: a move that does not lower the max is only resharding bytes."""
        order = np.argsort(-self.mem, kind="stable")
        changed = True
        while changed:
            changed = False
            top = float(self.loads(st).max())
            for i in order:
                src, home = int(st.rank[i]), int(self.start[i])
                if not self.movable[i] or src == home or st.count[home, self.table[i]] > 0:
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

    def greedy(self) -> State | None:
        """Longest processing time first: each shard onto the rank whose cost it raises
        least, among those with room and no shard of its table; None when one does not
        fit. Its ranks are then relabelled (the GPUs are alike) to keep the most bytes
        where they are. Shards that stay put are placed first, where they are, and
        keep the ranks' labels."""
        fixed = ~self.movable
        st = State.of(
            self.start[fixed], self.marg[fixed], self.var[fixed], self.mem[fixed],
            self.table[fixed], self.unit[fixed], self.world, self.n_tables,
            self.start[fixed], self.var_out[fixed], self.delta[:, fixed], self.var_base,
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


def out_var(prices: ShardPrices, key: ShardKey) -> float:
    """What moving a shard out adds to its rank's doubt (squared, probe ms): its spread,
    but no more than its price, since a shard's leaving never raises its rank."""
    f = prices.fit.best.factor
    return min(prices.spread[key], max(prices.ms[key], 0.0) / f) ** 2 if f > 0 else 0.0


#: A rank's residual scales its shards' prices by at most this factor (or its inverse).
MAX_RESIDUAL_SCALE = 3.0


def residual_shares(search: Search, scenarios: F64, measured: F64) -> F64:
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

"""Every shard of a running plan priced from the workers' live costs.

**Pricing.** A rank's compute is ``c0 + a·n + f·M``: a fixed part, each of its ``n``
shards' share of the kernels' per-table work, and a factor on its shards' probe costs
``M`` (``ShardCost.ms``, keyed by :meth:`ShardCost.key`: table, rank, first row and
first column, so row ranges and data-parallel copies are shards too). A shard's live
price is therefore ``a + f·m``: its marginal as the probe replays it, plus its share.
:mod:`.fit` fits the three on the fully probed ranks of the running plan, the ranks of
plans the job ran before (``history``), and what measures the fixed part on its own:
the probe's empty calls (``RankCost.probe_empty_ms``) and a calibrated model's rank
head (:func:`.headprior.head_prior`). The parameters are one for the job, not one per
rank, because a shard's price must not depend on where it sits: a per-rank figure
describes the rank (its device, its noise, how its probe ran) and would change a
shard's price by moving it.

A shard without a live cost (its rank's probe has not run, or ran out of budget) is
priced from its rank's measured compute left over after the fixed part and the rank's
priced shards, split among such shards in proportion to ``pooling_factor × cols``
(pooling floored at 0.05 so a table never read still gets a share), times the share of
the table's rows a row range holds, and over the world size for a data-parallel copy
(it reads the rank's own batch): what is known of the rank is spent on its shards, by
the declared specs. Its marginal is then what that price leaves after the share. An
empty row range costs nothing and counts as no shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.planner.kinds import local_batch, lookup_share
from shardwise.planner.live.fit import LiveFit, Point, Prior, empty_prior, fit_live
from shardwise.planner.live.summary import LiveSummary, RankPoint, ShardKey
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.tables import TableSpec

#: The smallest pooling factor a shard without a live cost is weighted by.
MIN_POOLING = 0.05
#: How far a marginal estimated from its rank's leftover may be off (its share).
ESTIMATED_SPREAD = 0.5


@dataclass(frozen=True)
class ShardPrices:
    """Every shard of the plan priced in the live summary's milliseconds."""

    #: :meth:`ShardCost.key` (table, rank, row_offset, col_offset) → priced ms per
    #: iteration (fwd + bwd): its share plus the factor times its marginal.
    ms: dict[ShardKey, float]
    #: The same shards' marginals in the probe's ms (estimated for unprobed shards),
    #: and how far each may be off.
    marginal: dict[ShardKey, float]
    spread: dict[ShardKey, float]
    #: Shards priced from their rank's leftover compute (no live cost of their own).
    estimated: int
    fit: LiveFit

    @property
    def factor(self) -> float:
        return self.fit.best.factor

    @property
    def overhead(self) -> float:
        """The fitted fixed cost of a rank that holds any shard."""
        return self.fit.best.overhead

    @property
    def share(self) -> float:
        """Each shard's fitted share of its kernel's per-table work."""
        return self.fit.best.share


def _key(rank: int, table: str, shard: Shard) -> ShardKey:
    return (table, rank, shard.row_offset, shard.col_offset)


def _empty(t: PlanTable, shard: Shard) -> bool:
    return shard.row_count(t.rows) == 0


def rank_points(plan: Plan, live: LiveSummary) -> list[tuple[int, Point]]:
    """The fully probed ranks of ``plan`` as fit points (their non-empty shards, their
    probe costs summed, their measured compute)."""
    compute = {r.rank: r.compute_ms for r in live.measured()}
    probed = {s.key(): s for s in live.shards}
    out = []
    for rank, held in enumerate(plan.shards_per_rank()):
        costs = [probed.get(_key(rank, t.name, s)) for t, s in held if not _empty(t, s)]
        known = [c for c in costs if c is not None]
        if costs and len(known) == len(costs) and compute.get(rank, 0.0) > 0:
            spread = sum(c.spread_ms**2 for c in known) ** 0.5
            point = Point(len(costs), sum(c.ms for c in known), compute[rank], 1.0, spread)
            out.append((rank, point))
    return out


def price_shards(
    plan: Plan,
    tables: Sequence[TableSpec],
    live: LiveSummary,
    *,
    history: Sequence[RankPoint] = (),
    priors: Sequence[Prior] = (),
) -> ShardPrices:
    """Every shard of ``plan`` priced in measured ms (the module's docstring says how).
    ``live`` must be a complete summary of ``plan`` (:func:`replan` checks it);
    ``history``: ranks of other plans the job ran; ``priors``: what else measured a
    rank's fixed part (the probe's empty calls are added here)."""
    specs = {t.name: t for t in tables}
    compute = {r.rank: r.compute_ms for r in live.measured()}
    probed = {s.key(): s.ms for s in live.shards}
    spreads = {s.key(): s.spread_ms for s in live.shards}
    per_rank = plan.shards_per_rank()
    world = plan.world_size
    points = rank_points(plan, live)
    found = empty_prior([r.probe_empty_ms for r in live.measured()])
    own = [p for p in history if p.plan != live.plan_hash[:12]]
    fit = fit_live(
        [p for _, p in points],
        [Point(p.shards, p.probe_ms, p.compute_ms, 1.0, p.probe_spread) for p in own],
        [*priors, *([found] if found is not None else [])],
        # A negative share (each replayed shard paying a call's work the fused kernel
        # pays once) is told from the fixed part only by the empty calls.
        smallest=min((c for c in probed.values() if c > 0), default=0.0) if found else 0.0,
    )
    c0, a, f = fit.best.overhead, fit.best.share, fit.best.factor
    ms: dict[ShardKey, float] = {}
    marginal: dict[ShardKey, float] = {}
    spread: dict[ShardKey, float] = {}
    estimated = 0
    for rank, held in enumerate(per_rank):
        left = compute.get(rank, 0.0) - (c0 if held else 0.0)
        unknown: list[tuple[ShardKey, float]] = []
        for t, s in held:
            k = _key(rank, t.name, s)
            cost = probed.get(k)
            if _empty(t, s):
                ms[k] = marginal[k] = spread[k] = 0.0
            elif cost is None:
                weight = max(specs[t.name].pooling_factor, MIN_POOLING) * s.cols
                weight *= lookup_share(s.row_count(t.rows), t.rows)
                unknown.append((k, weight / world if local_batch(t.kind) else weight))
            else:
                marginal[k] = cost
                spread[k] = spreads.get(k, 0.0)
                ms[k] = a + f * cost
                left -= ms[k]
        weight = sum(w for _, w in unknown)
        for k, w in unknown:
            ms[k] = max(left, 0.0) * w / weight if weight > 0 else 0.0
            marginal[k] = max(ms[k] - a, 0.0) / f if f > 0 else 0.0
            spread[k] = ESTIMATED_SPREAD * marginal[k]
        estimated += len(unknown)
    return ShardPrices(ms, marginal, spread, estimated, fit)

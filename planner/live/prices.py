"""Every shard of a running plan priced from the workers' live costs.

**Pricing.** A rank's compute is modelled as ``overhead + factor × Σ its shards' live
costs`` (``ShardCost.ms``, keyed by :meth:`ShardCost.key`: table, rank, first row and
first column, so row ranges and data-parallel copies are shards too), fitted robustly over the
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
cols`` (pooling floored at 0.05 so a table never read still gets a share), times the
share of the table's rows a row range holds, and over the world size for a
data-parallel copy (it reads the rank's own batch): what is known of the rank is spent
on its shards, by the declared specs. An empty row range costs nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.planner.kinds import local_batch, lookup_share
from shardwise.planner.live.summary import LiveSummary, ShardKey
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.tables import TableSpec

#: The smallest pooling factor a shard without a live cost is weighted by.
MIN_POOLING = 0.05


@dataclass(frozen=True)
class ShardPrices:
    """Every shard of the plan priced in the live summary's milliseconds."""

    #: :meth:`ShardCost.key` (table, rank, row_offset, col_offset) → priced ms per
    #: iteration (fwd + bwd).
    ms: dict[ShardKey, float]
    #: The job's factor from probe ms to measured ms (see the module's docstring).
    factor: float
    #: Shards priced from their rank's leftover compute (no live cost of their own).
    estimated: int
    #: The fitted fixed cost of a rank that holds any shard (see :func:`fit_rank_cost`).
    overhead: float = 0.0


def price_shards(plan: Plan, tables: Sequence[TableSpec], live: LiveSummary) -> ShardPrices:
    """Every shard of ``plan`` priced in measured ms (the module's docstring says how).
    ``live`` must be a complete summary of ``plan`` (:func:`replan` checks it)."""
    specs = {t.name: t for t in tables}
    compute = {r.rank: r.compute_ms for r in live.measured()}
    probed = {s.key(): s.ms for s in live.shards}
    per_rank = plan.shards_per_rank()
    world = plan.world_size

    def key(rank: int, table: str, shard: Shard) -> ShardKey:
        return (table, rank, shard.row_offset, shard.col_offset)

    def empty(t: PlanTable, shard: Shard) -> bool:
        return shard.row_count(t.rows) == 0

    points: list[tuple[float, float]] = []
    for rank, held in enumerate(per_rank):
        costs = [probed.get(key(rank, t.name, s)) for t, s in held if not empty(t, s)]
        total = sum(c for c in costs if c is not None)
        if held and None not in costs and total > 0 and compute.get(rank, 0.0) > 0:
            points.append((total, compute[rank]))
    overhead, factor = fit_rank_cost(points)
    ms: dict[ShardKey, float] = {}
    estimated = 0
    for rank, held in enumerate(per_rank):
        left = compute.get(rank, 0.0) - (overhead if held else 0.0)
        unknown: list[tuple[ShardKey, float]] = []
        for t, s in held:
            k = key(rank, t.name, s)
            cost = probed.get(k)
            if empty(t, s):
                ms[k] = 0.0
            elif cost is None:
                weight = max(specs[t.name].pooling_factor, MIN_POOLING) * s.cols
                weight *= lookup_share(s.row_count(t.rows), t.rows)
                unknown.append((k, weight / world if local_batch(t.kind) else weight))
            else:
                ms[k] = factor * cost
                left -= ms[k]
        weight = sum(w for _, w in unknown)
        for k, w in unknown:
            ms[k] = max(left, 0.0) * w / weight if weight > 0 else 0.0
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

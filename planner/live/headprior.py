"""A calibrated model's word on a live fit's fixed part (:mod:`.fit`).

A calibration measured each of the job's tables alone at the job's batch (its anchor)
and found that a fused rank costs its anchors less one kernel overhead per extra
table (:mod:`shardwise.planner.costmodel.rankhead`): the overhead is paid once per
kernel, whatever it holds. That is the live fit's fixed part, measured apart from the
running plan, so it can tell a rank's fixed part from its shards' share where the
ranks' totals cannot. It is brought to the live summary's units by the ratio of the
ranks' measured compute to the head's price of the same ranks (their median, so the
rank whose data drifted from the declaration does not set it).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from shardwise.planner.costmodel.rankhead import RankHead
from shardwise.planner.live.fit import PRIOR_SPREAD, Prior
from shardwise.planner.live.summary import LiveSummary
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec, table_signature


def head_prior(
    head: RankHead, plan: Plan, tables: Sequence[TableSpec], live: LiveSummary
) -> tuple[Prior | None, str]:
    """The fixed part as ``head`` prices it, in measured ms, or ``None`` and why not
    (anchors at another batch, no overhead, no rank whose every shard is anchored)."""
    batch = live.batch_size_per_rank * plan.world_size
    if head.batch != batch:
        return None, (
            f"the calibration's anchors were measured at global batch {head.batch:,}, the "
            f"job runs {batch:,}"
        )
    k = 1e3 * (head.overhead[0] + head.overhead[1])
    if k <= 0:
        return None, "the calibration measured no kernel overhead"
    signature = {t.name: table_signature(t) for t in tables}
    compute = {r.rank: r.compute_ms for r in live.measured()}
    ratios = []
    for rank, held in enumerate(plan.shards_per_rank()):
        solo = []
        for t, s in held:
            anchors = head.anchors.get(signature[t.name]) or {}
            if not s.whole_rows or s.cols not in anchors:
                break
            fwd, bwd = anchors[s.cols]
            solo.append(1e3 * (fwd + bwd))
        else:
            priced = sum(solo) - (len(solo) - 1) * k
            if solo and priced > 0 and compute.get(rank, 0.0) > 0:
                ratios.append(compute[rank] / priced)
    if not ratios:
        return None, "no rank of the running plan holds only anchored shards"
    value = statistics.median(ratios) * k
    return Prior(value, PRIOR_SPREAD * value, "the calibrated model's kernel overhead"), ""

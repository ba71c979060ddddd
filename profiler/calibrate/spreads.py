"""A rank head from a calibration's anchors: the factor for tables without one, and how
far off a shard is priced when it is not measured (docs/calibration.md).

The head prices an anchored shard from its measurement. Two kinds of shard are not:
one at a width (or batch) that was not measured, which the network scales from the
table's anchor, and one of a table with no anchor at all, which the network prices
times :attr:`RankHead.unanchored`. How wrong each is, is measured here on the anchors
themselves: the halves predicted from the whole tables, and the whole tables predicted
by the network with the factor. A risk-aware search weighs those spreads
(:meth:`AnchoredHead.sigma`), so it prefers ranks of measured shards when the model
cannot tell plans apart.
"""

from __future__ import annotations

import math

import numpy as np

from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.costmodel.rankhead import RankHead
from shardwise.planner.tables import table_signature
from shardwise.profiler.calibrate.anchors import Anchors
from shardwise.profiler.calibrate.rankfit import FusionFit, log_spread
from shardwise.profiler.calibrate.tasks import Job

#: Spreads used when the anchors cannot measure them (too few pairs).
DEFAULT_SCALED = 0.15
DEFAULT_UNANCHORED = 0.5
MIN_PAIRS = 3


def head_errors(
    network: CostModel,
    anchors: Anchors,
    job: Job,
    sigma: float | None,
    fusion: FusionFit | None = None,
    overhead: tuple[float, float] = (0.0, 0.0),
    local_anchors: Anchors | None = None,
) -> RankHead:
    """The rank head of ``anchors`` over ``network`` (its network and speed factors),
    with ``fusion`` (none: anchors summed as they are), the kernel's ``overhead``, the
    held-out ``sigma`` and the data-parallel copies' ``local_anchors`` (measured at
    the job's batch per rank)."""
    predictor = CostPredictor(network)
    batch = job.global_batch
    whole: list[tuple[float, float]] = []
    whole_nn: list[tuple[float, float]] = []
    halves: list[float] = []
    halves_pred: list[float] = []
    tables = [t for t in job.tables if table_signature(t) in anchors]
    if tables:
        own = predictor.network_compute([[(t, t.dim)] for t in tables], batch)
        for t, nn in zip(tables, own, strict=True):
            got = anchors[table_signature(t)]
            if t.dim in got:
                whole.append(got[t.dim])
                whole_nn.append((float(nn[0]), float(nn[1])))
            half = t.dim // 2
            if t.dim in got and half in got:
                nn_half = predictor.network_compute([[(t, half)]], batch)[0]
                scale = nn_half / np.maximum(nn, 1e-12)
                halves.append(sum(got[half]))
                halves_pred.append(float((np.asarray(got[t.dim]) * scale).sum()))
    factor = (1.0, 1.0)
    unanchored = DEFAULT_UNANCHORED
    if len(whole) >= MIN_PAIRS:
        m, p = np.asarray(whole), np.asarray(whole_nn)
        ratio = np.log(np.maximum(m, 1e-12) / np.maximum(p, 1e-12))
        factor = (math.exp(float(np.median(ratio[:, 0]))), math.exp(float(np.median(ratio[:, 1]))))
        unanchored = log_spread((p * np.asarray(factor)).sum(axis=1), m.sum(axis=1)) or unanchored
    scaled = DEFAULT_SCALED
    if len(halves) >= MIN_PAIRS:
        scaled = log_spread(halves_pred, halves) or scaled
    kwargs = {}
    if fusion is not None:
        kwargs = {"fwd": fusion.fwd, "bwd": fusion.bwd, "mean": fusion.mean, "std": fusion.std}
        kwargs |= {"lo": fusion.lo, "hi": fusion.hi}
    return RankHead(
        batch=batch,
        anchors=anchors,
        unanchored=factor,
        overhead=overhead,
        sigma=sigma,
        sigma_scaled=max(scaled, 1e-3),
        sigma_unanchored=max(unanchored, 1e-3),
        local_batch=job.batch_per_rank if local_anchors else None,
        local_anchors=dict(local_anchors or {}),
        **kwargs,  # type: ignore[arg-type]
    )

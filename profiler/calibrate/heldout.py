"""How well a model predicts the job's held-out tables: per kernel and per plan-like group.

The test samples are kernels of *test tables only* (never trained on), each about
one rank's share of the job at the job's batch (:mod:`.tasks`). Two questions:

- **per kernel**: MAPE and Spearman's rho of fwd + bwd seconds (and fwd, bwd apart);
- **per plan-like group**: a plan's cost is the max over its ranks, so what a planner
  needs is that the *maxima* rank right. Groups of ``gpus`` test kernels (random
  subsets, seeded; all of them when there are few; of half the kernels when there are
  fewer than twice ``gpus``) stand in for plans: the predicted
  max of each group against its measured max, over up to :data:`GROUPS` groups.
  Groups share kernels, so they are not independent; the figure says whether the
  maxima are ranked right, not how sure that is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardwise.planner.costmodel.artifact import CostModel
from shardwise.profiler.calibrate.speed import measured_compute, predict_compute
from shardwise.profiler.pretrain.report import metrics

GROUPS = 200


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


def group_indices(n: int, size: int, seed: int, limit: int = GROUPS) -> list[tuple[int, ...]]:
    """Up to ``limit`` distinct subsets of ``size`` of ``range(n)``: all of them when
    there are that few, else seeded random ones."""
    size = min(size, n)
    if size < 1:
        return []
    if math.comb(n, size) <= limit:
        return list(itertools.combinations(range(n), size))
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < limit:
        seen.add(tuple(sorted(int(i) for i in rng.choice(n, size, replace=False))))
    return sorted(seen)


def heldout_metrics(
    model: CostModel, test_records: Sequence[Mapping[str, Any]], gpus: int, seed: int
) -> dict[str, Any]:
    """Per-kernel and per-group metrics of ``model`` on ``test_records`` (plain JSON;
    NaN becomes null)."""
    if not test_records:
        return {"kernels": 0}
    pred = predict_compute(model, test_records)
    meas = measured_compute(test_records)
    total_p, total_m = pred.sum(axis=1), meas.sum(axis=1)
    kernel = metrics(total_p, total_m)
    out: dict[str, Any] = {
        "kernels": len(test_records),
        "kernel_mape": kernel["mape"],
        "kernel_spearman": kernel["spearman"],
        "fwd_mape": metrics(pred[:, 0], meas[:, 0])["mape"],
        "bwd_mape": metrics(pred[:, 1], meas[:, 1])["mape"],
        # The sign of the error: > 1 predicts too much (the median of predicted / measured).
        "median_ratio": float(np.median(total_p / np.maximum(total_m, 1e-9))),
    }
    # Groups of the job's GPUs; of fewer when there are few kernels, so there are groups.
    size = min(gpus, max(2, len(test_records) // 2))
    groups = group_indices(len(test_records), size, seed)
    if len(groups) >= 2:
        gp = np.array([total_p[list(g)].max() for g in groups])
        gm = np.array([total_m[list(g)].max() for g in groups])
        gmet = metrics(gp, gm)
        out.update(
            groups=len(groups),
            group_size=len(groups[0]),
            group_max_mape=gmet["mape"],
            group_max_spearman=gmet["spearman"],
        )
    result: dict[str, Any] = _clean(out)
    return result


def format_metrics(m: Mapping[str, Any]) -> str:
    """One line: ``kernel MAPE 12.3% Spearman 0.95 · group max Spearman 0.91 (200 of 8)``."""
    if not m.get("kernels"):
        return "no held-out kernels"

    def pct(key: str) -> str:
        v = m.get(key)
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(key: str) -> str:
        v = m.get(key)
        return "-" if v is None else f"{v:.3f}"

    text = (
        f"kernel MAPE {pct('kernel_mape')} (fwd {pct('fwd_mape')}, bwd {pct('bwd_mape')}), "
        f"Spearman {num('kernel_spearman')}, predicted/measured {num('median_ratio')}"
    )
    if m.get("groups"):
        text += (
            f"; group max Spearman {num('group_max_spearman')}, MAPE {pct('group_max_mape')} "
            f"({m['groups']} groups of {m['group_size']})"
        )
    return text

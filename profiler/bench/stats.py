"""The benchmark's statistics (docs/design.md §9), free of any measuring.

- **Paired geomean ratios** over tasks, with a 95 % percentile bootstrap interval
  (tasks resampled with replacement, seeded): each task is one pair (planner,
  reference) measured side by side, so drift between tasks cancels.
- **Wins, ties and losses**, a tie being a difference within the task's noise: the
  median over the task's measured plans of their coefficient of variation over the
  evaluator's repeats (one repeat's spread), in the metric compared. A planner that
  fails where the reference plans loses; the reverse wins; both failing ties.
- **Best heuristic** (the greedy variants; random is not a heuristic here): the one
  whose cost, relative to the heuristics' geomean on each task, has the lowest median
  over tasks. Choosing per task the cheapest of several noisy measurements would pick
  the luckiest draw and flatter nobody but the reference's noise.
- **Balance efficiency**: mean over max of the measured per-rank compute.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: The heuristics "best heuristic" is chosen from (random excluded).
HEURISTICS = ("size-greedy", "dim-greedy", "lookup-greedy", "size-lookup-greedy")
BOOTSTRAP_SAMPLES = 10_000
LEVEL = 0.95


def geomean(xs: Sequence[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def bootstrap_geomean(
    ratios: Sequence[float],
    *,
    samples: int = BOOTSTRAP_SAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the geomean of ``ratios`` (tasks drawn
    with replacement); None without ratios. One ratio gives a zero-width interval:
    report the count with it."""
    if not ratios:
        return None
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), size=(samples, len(logs)))].mean(axis=1)
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(means, [tail, 100.0 - tail])
    return math.exp(float(lo)), math.exp(float(hi))


@dataclass(frozen=True)
class Outcome:
    """One planner against one reference on one task."""

    ratio: float | None  # planner / reference, both measured
    verdict: str  # "win", "tie", "loss"


def compare(mine: float | None, ref: float | None, noise: float) -> Outcome:
    """``mine`` against ``ref`` (None: failed), a tie within ``noise`` (relative) or
    when both failed."""
    if mine is None and ref is None:
        return Outcome(None, "tie")
    if mine is None:
        return Outcome(None, "loss")
    if ref is None:
        return Outcome(None, "win")
    ratio = mine / ref
    if abs(ratio - 1.0) <= noise:
        return Outcome(ratio, "tie")
    return Outcome(ratio, "win" if ratio < 1.0 else "loss")


def cv(xs: Sequence[float]) -> float | None:
    """Coefficient of variation (sample standard deviation over mean); None below two."""
    if len(xs) < 2 or statistics.fmean(xs) == 0:
        return None
    return statistics.stdev(xs) / statistics.fmean(xs)


def task_noise(cvs: Sequence[float]) -> float:
    """A task's noise: the median CV over repeats of its measured plans (0 if none)."""
    return statistics.median(cvs) if cvs else 0.0


def best_heuristic(costs: Sequence[Mapping[str, float | None]]) -> str | None:
    """The heuristic with the lowest median over tasks of its cost over the task's
    geomean of the heuristics' costs; a failure counts as infinitely costly. ``costs``:
    per task, heuristic -> measured cost (None: failed). Ties go to the earlier name
    in :data:`HEURISTICS`. None when no task measured any heuristic."""
    scores: dict[str, list[float]] = {h: [] for h in HEURISTICS}
    for task in costs:
        measured = [c for h in HEURISTICS if (c := task.get(h)) is not None and c > 0]
        if not measured:
            continue
        norm = geomean(measured)
        assert norm is not None
        for h in HEURISTICS:
            if h in task:
                c = task[h]
                scores[h].append(c / norm if c is not None and c > 0 else math.inf)
    ranked = [(statistics.median(v), HEURISTICS.index(h), h) for h, v in scores.items() if v]
    return min(ranked)[2] if ranked else None


def balance(per_rank: Sequence[float]) -> float | None:
    """Mean over max of per-rank costs (1.0: perfectly balanced)."""
    top = max(per_rank, default=0.0)
    return statistics.fmean(per_rank) / top if top > 0 else None


@dataclass(frozen=True)
class Paired:
    """A planner's paired figures against one reference over the tasks."""

    geomean: float | None
    interval: tuple[float, float] | None
    n: int  # tasks with both measured
    wins: int
    ties: int
    losses: int


def paired(outcomes: Sequence[Outcome], seed: int = 0) -> Paired:
    ratios = [o.ratio for o in outcomes if o.ratio is not None]
    return Paired(
        geomean=geomean(ratios),
        interval=bootstrap_geomean(ratios, seed=seed),
        n=len(ratios),
        wins=sum(o.verdict == "win" for o in outcomes),
        ties=sum(o.verdict == "tie" for o in outcomes),
        losses=sum(o.verdict == "loss" for o in outcomes),
    )

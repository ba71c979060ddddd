"""Choosing among candidate plans without trusting the model beyond its error
(docs/design.md §14).

A search minimizes the predicted maximum over ranks, and so it optimizes the model's
errors as eagerly as its truths: a plan can look best only because the model
underprices one of its ranks, and the plan a search selects is, for that very reason,
likelier underpriced than not (the winner's curse). The model's error is known: a
calibration measures the spread ``σ`` of log(predicted / measured) on held-out plan
ranks, and a rank priced from shards no one measured is less certain still
(:meth:`~shardwise.planner.costmodel.rankhead.AnchoredHead.sigma`).

So candidates are compared by a **risk-adjusted maximum**: the measured maximum the
plan stays under five times in six (:data:`QUANTILE`, "predicted max plus one σ" where
one rank dominates). Each rank's compute is its prediction times ``exp(σ_r · z)``, ``z``
standard normal, with draws shared by all candidates (common random numbers,
:data:`DRAWS` of them, a fixed seed: the choice is repeatable), plus its declared
all-to-all. Where the model is sure (σ → 0) this is the predicted maximum; where it
is not, a plan whose straggler is priced from guesses, or whose ranks all sit near the
maximum, pays for the risk.

Candidates whose risk-adjusted maxima lie within the model's error of the best are a
toss-up for the model (:func:`ambiguous`): where the machine can measure, measured
refinement times them and starts from the fastest (docs/refinement.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
DRAWS = 256
#: The share of draws a plan's maximum stays under: one σ above the median.
QUANTILE = 0.84
_SEED = 20230601
#: At most this many candidates are handed on as a toss-up (each costs a measured round).
MAX_AMBIGUOUS = 4


@cache
def _normals(world: int) -> F64:
    """``[DRAWS, world]`` standard normals, each rank's column stratified (every
    1/DRAWS quantile once, then shuffled: a Latin hypercube), so a quantile of one
    rank's draws is exact and the choice does not hinge on a lucky sample."""
    rng = np.random.default_rng(_SEED)
    levels = np.array([NormalDist().inv_cdf((k + 0.5) / DRAWS) for k in range(DRAWS)])
    draws: F64 = np.stack([rng.permutation(levels) for _ in range(world)], axis=1)
    draws.setflags(write=False)
    return draws


def risk_max(
    compute: Sequence[float] | F64, comm: Sequence[float] | F64, sigma: Sequence[float] | F64
) -> float:
    """The :data:`QUANTILE` over the shared draws of max over ranks of
    compute·exp(σ·z) + comm."""
    c = np.asarray(compute, dtype=np.float64)
    s = np.asarray(sigma, dtype=np.float64)
    z = _normals(len(c))
    totals = c * np.exp(s * z) + np.asarray(comm, dtype=np.float64)
    return float(np.quantile(totals.max(axis=1), QUANTILE))


@dataclass(frozen=True)
class Scored:
    """A candidate's predicted maximum, its risk-adjusted maximum, and the spread of
    its predicted straggler (what :func:`ambiguous` bands by)."""

    label: str
    predicted_max: float
    risk: float
    straggler_sigma: float


def score(label: str, compute: F64, comm: F64, sigma: F64) -> Scored:
    """``compute`` and ``comm`` per rank (seconds), ``sigma`` each rank's log spread."""
    total = compute + comm
    top = int(np.argmax(total))
    return Scored(label, float(total[top]), risk_max(compute, comm, sigma), float(sigma[top]))


def ambiguous(scored: Sequence[Scored]) -> list[Scored]:
    """The candidates the model cannot tell from the best by its own error, best first
    (the best included): risk-adjusted maxima within ``exp(√2·σ) - 1`` of the best's, σ the
    best's straggler spread (two plans' errors, each σ, differ by √2·σ), at most
    :data:`MAX_AMBIGUOUS`."""
    if not scored:
        return []
    ranked = sorted(scored, key=lambda s: s.risk)
    return [s for s in ranked if within_error(ranked[0], s)][:MAX_AMBIGUOUS]


def within_error(best: Scored, other: Scored) -> bool:
    """Whether ``other``'s risk-adjusted maximum lies within ``exp(√2·σ) - 1`` of
    ``best``'s (:func:`ambiguous`'s band), σ the best's straggler spread."""
    return other.risk <= best.risk * math.exp(math.sqrt(2.0) * best.straggler_sigma)

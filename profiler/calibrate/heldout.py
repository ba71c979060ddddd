"""How well a model prices the job's held-out plan ranks, and the verdict a user acts on.

The held-out ranks are ranks of candidate plans for the *test* tables (never fitted
on), at the job's batch (:mod:`.plans`). Each model is judged on them as a search
uses it: per rank (Spearman, MAPE, the spread σ of log(predicted / measured)) and per
plan maximum (Spearman), since a plan costs its slowest rank (:mod:`.rankfit`).

The verdict turns σ into advice. A search optimizes a model's errors as eagerly as
its truths, so within ±σ a model cannot tell plans apart: small σ, model-only plans
are reliable; larger, refine by measurement; above :data:`WARN_SIGMA`, every ``plan``
that prices with the model says so with the figure
(:func:`~shardwise.planner.costmodel.rankhead.reliability_warning`).

The same is said of each kind (:func:`kind_metrics`, :func:`kind_verdicts`): over the
held-out ranks holding a shard of that kind, since a row-wise or data-parallel kernel
may be priced far worse than the fused ones that make up most ranks. A kind with fewer
than :data:`MIN_RANKS` such ranks is ``unjudged``, and a plan that uses it says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.costmodel.rankhead import RANK_FEATURES, VERDICT_MIN_RANKS
from shardwise.planner.kinds import V1_KINDS
from shardwise.profiler.calibrate.rankfit import fixed_fusion, predict_samples, rank_metrics
from shardwise.profiler.calibrate.shards import (
    JUDGED_KINDS,
    rank_kernels,
    rank_shards,
    shard_kinds,
)
from shardwise.profiler.calibrate.tasks import Job

#: σ (log) at or below which model-only plans are called reliable.
RELIABLE_SIGMA = 0.08
#: Above this σ, every `plan` with the model prints a warning with the figure.
WARN_SIGMA = 0.15
#: Fewest held-out ranks (and plans) a verdict rests on.
MIN_RANKS = VERDICT_MIN_RANKS
MIN_PLANS = 3


def verdict(
    final: Mapping[str, Any],
    *,
    seconds_per_rank: float | None = None,
    heldout_share: float = 0.25,
    budget_s: float | None = None,
    exhausted: bool = False,
    test_tables: int | None = None,
    every_rank_measured: bool = False,
    kinds: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """``{"level", "sigma", "text"}`` from the calibrated model's held-out metrics.

    Levels: ``reliable``, ``refine``, ``unreliable`` (warned about by every plan), and
    ``unjudged`` when too few held-out ranks were measured (the text says how long a
    run would judge them, from ``seconds_per_rank``, or, when every held-out rank the
    job's few test tables make was measured (``exhausted``), that none would).
    ``every_rank_measured``: the run measured every rank its candidate plans make
    before its deadline (and the noisiest again), so advice to calibrate longer would
    be advice a longer run could not follow: the text says what would help instead.
    ``kinds``: :func:`kind_metrics`, judged one by one under ``"kinds"``."""
    out = _overall(
        final,
        seconds_per_rank=seconds_per_rank,
        heldout_share=heldout_share,
        budget_s=budget_s,
        exhausted=exhausted,
        test_tables=test_tables,
        every_rank_measured=every_rank_measured,
    )
    if kinds is not None:
        out["kinds"] = kind_verdicts(kinds)
    return out


def _level(sigma: float, spearman: float | None) -> str:
    if sigma <= RELIABLE_SIGMA and (spearman or 0.0) >= 0.9:
        return "reliable"
    return "refine" if sigma <= WARN_SIGMA else "unreliable"


def kind_verdicts(kinds: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{kind: {"level", "ranks", "fitted", "sigma", "text"}}`` from
    :func:`kind_metrics`: ``unjudged`` below :data:`MIN_RANKS` held-out ranks holding
    the kind, else the overall verdict's levels on that kind's ranks."""
    out: dict[str, dict[str, Any]] = {}
    for kind, m in kinds.items():
        ranks, fitted = int(m.get("ranks") or 0), int(m.get("fitted") or 0)
        sigma = m.get("sigma")
        words = kind.replace("_", "-")
        if ranks < MIN_RANKS or sigma is None:
            level = "unjudged"
            text = f"{words}: {ranks} held-out rank(s) hold it, and a verdict needs {MIN_RANKS}"
        else:
            level = _level(float(sigma), m.get("rank_spearman"))
            text = f"{words}: {ranks} held-out ranks priced within ±{100 * float(sigma):.0f}%"
        out[kind] = {"level": level, "ranks": ranks, "fitted": fitted, "sigma": sigma}
        out[kind]["text"] = text
    return out


def _overall(
    final: Mapping[str, Any],
    *,
    seconds_per_rank: float | None,
    heldout_share: float,
    budget_s: float | None,
    exhausted: bool,
    test_tables: int | None,
    every_rank_measured: bool,
) -> dict[str, Any]:
    ranks, plans = int(final.get("ranks") or 0), int(final.get("plans") or 0)
    sigma = final.get("sigma")
    if ranks < MIN_RANKS or plans < MIN_PLANS or sigma is None:
        text = (
            f"too short to judge plan ranks: {ranks} held-out rank(s) of {plans} plan(s) "
            f"measured, and a verdict needs {MIN_RANKS} ranks of {MIN_PLANS} plans"
        )
        if exhausted:
            text += (
                f"; this job's {test_tables} test table(s) make no more distinct held-out "
                "ranks, so a longer run would not either: judge the model on `shardwise "
                "plan --measure` instead"
            )
        elif seconds_per_rank and budget_s:
            missing = max(MIN_RANKS - ranks, 0) / max(heldout_share, 0.05)
            need = budget_s + missing * seconds_per_rank
            text += f"; about {math.ceil(need / 60)} minute(s) would (give --minutes)"
        return {"level": "unjudged", "sigma": sigma, "text": text}
    pct = f"±{100 * float(sigma):.0f}%"
    level = _level(float(sigma), final.get("rank_spearman"))
    if level == "reliable":
        text = f"ranks priced within {pct} here: model-only plans are reliable"
    elif level == "refine":
        text = (
            f"ranks priced within {pct} here: plans within that of each other are a toss-up "
            "for the model; measure them (`shardwise plan --refine measured`, or the "
            "operator's measured refinement) where you can"
        )
    else:
        text = (
            f"ranks priced within {pct} only: model-only plans are not reliable here; refine "
            "by measurement (`shardwise plan --refine measured`)"
        )
        if every_rank_measured:
            text += (
                ". Every rank this job's candidate plans make was measured, and again "
                "while the budget lasted, so a longer calibration would not narrow this: it "
                "is how far a rank of these tables strays from its parts on this machine"
            )
        else:
            text += ", or calibrate longer (--minutes): the budget ended before every rank"
    return {"level": level, "sigma": float(sigma), "text": text}


def format_metrics(m: Mapping[str, Any]) -> str:
    """One line: ``per rank Spearman 0.95, MAPE 6.1%, σ 7.9% · plan max Spearman 0.91``."""
    if not m.get("ranks"):
        return "no held-out ranks"

    def num(key: str, pct: bool = False) -> str:
        v = m.get(key)
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:.3f}"

    return (
        f"per rank Spearman {num('rank_spearman')}, MAPE {num('rank_mape', True)}, "
        f"σ {num('sigma', True)}; plan max Spearman {num('plan_max_spearman')} "
        f"({m['ranks']} ranks of {m['plans']} plans)"
    )


# --------------------------------------------------------------------------- judging


def rank_prices(predictor: CostPredictor, records: Sequence[Mapping[str, Any]], job: Job) -> Any:
    """Each rank record's fwd + bwd seconds as ``predictor`` prices a plan's rank: one
    kernel per group, batch and precision (:func:`~.shards.rank_kernels`), summed."""
    by_name = {t.name: t for t in job.tables}
    sets: dict[int, list[tuple[int, list[Any]]]] = {}
    for i, r in enumerate(records):
        shards = rank_shards(r["extra"], by_name)
        for k in rank_kernels(shards, by_name, job.global_batch, job.batch_per_rank):
            sets.setdefault(k.batch, []).append((i, list(k.shards)))
    out = np.zeros(len(records), dtype=np.float64)
    for batch, got in sets.items():
        priced = predictor.compute([s for _, s in got], batch).sum(axis=1)
        np.add.at(out, [i for i, _ in got], priced)
    return out


def record_kinds(records: Sequence[Mapping[str, Any]], job: Job) -> list[frozenset[str]]:
    """The kinds each rank record holds."""
    by_name = {t.name: t for t in job.tables}
    return [shard_kinds(rank_shards(r["extra"], by_name)) for r in records]


def kind_metrics(
    predicted: Sequence[float] | Any,
    measured: Sequence[float] | Any,
    plans: Sequence[str],
    kinds: Sequence[frozenset[str]],
    fitted: Sequence[frozenset[str]] = (),
) -> dict[str, dict[str, Any]]:
    """:func:`~.rankfit.rank_metrics` over the held-out ranks holding each kind of
    :data:`~.shards.JUDGED_KINDS`, with ``fitted``: how many training ranks held it. A
    rank with a row-wise or data-parallel shard counts for each such kind it holds; the
    table-wise and column-wise figures are over ranks of fused shards alone, so that a
    split kind's error does not blur theirs."""
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)

    def holds(kind: str, k: frozenset[str]) -> bool:
        return kind in k and (kind not in V1_KINDS or k <= V1_KINDS)

    out: dict[str, dict[str, Any]] = {}
    for kind in JUDGED_KINDS:
        idx = [i for i, k in enumerate(kinds) if holds(kind, k)]
        got = rank_metrics(p[idx], m[idx], [plans[i] for i in idx])
        got["fitted"] = sum(holds(kind, k) for k in fitted)
        out[kind] = got
    return out


def judge(model: CostModel, records: Sequence[dict[str, Any]], job: Job) -> dict[str, Any]:
    """``model``'s held-out metrics as it prices plans (its own rank head, if any),
    overall and per kind (``"kinds"``)."""
    pred = rank_prices(CostPredictor(model), records, job) if records else np.zeros(0)
    meas = [float(r["fwd_s"]) + float(r["bwd_s"]) for r in records]
    plans = [str(r["extra"].get("plan")) for r in records]
    out = rank_metrics(pred, meas, plans)
    out["kinds"] = kind_metrics(pred, meas, plans, record_kinds(records, job))
    return out


def ablation(
    train: Sequence[Any], test: Sequence[Any], fusion: Any, overhead: tuple[float, float]
) -> list[dict[str, Any]]:
    """Held-out metrics of what explains a rank's cost beyond its parts: none (Σ
    anchors), the kernel's overhead counted once, then a constant factor, each input
    alone with it, all five, and the ones chosen (docs/calibration.md)."""
    if not train or not test:
        return []
    meas = [sum(s.measured) for s in test]
    plans = [s.plan for s in test]
    none = (0.0, 0.0)
    rows: list[tuple[str, Any, tuple[float, float]]] = [
        ("sum of anchors", None, none),
        ("+ overhead once", None, overhead),
        ("+ constant factor", fixed_fusion(train, [], overhead), overhead),
    ]
    rows += [
        (f"+ {name}", fixed_fusion(train, [name], overhead), overhead) for name in RANK_FEATURES
    ]
    rows += [("+ all five", fixed_fusion(train, list(RANK_FEATURES), overhead), overhead)]
    if fusion is not None:
        rows.append(("chosen", fusion, overhead))
    out = []
    for label, fit, k in rows:
        got = rank_metrics(predict_samples(fit, test, k).sum(axis=1), meas, plans)
        out.append({"inputs": label, **got})
    return out

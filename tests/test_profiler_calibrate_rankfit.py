"""The rank head's fit and the judgement of a model on plan ranks: the fusion factor is
recovered when it is there and no input is kept that does not help; the verdict turns
the held-out spread into advice, and a poor model warns on every plan."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardwise.planner.costmodel.rankhead import (
    CHANNELS,
    COUNT,
    RANK_FEATURES,
    SOLO_BWD,
    SOLO_FWD,
    TOUCHED,
    reliability_warning,
)
from shardwise.planner.tables import TableSpec
from shardwise.profiler.calibrate.heldout import verdict
from shardwise.profiler.calibrate.rankfit import (
    RankSample,
    fit_fusion,
    fixed_fusion,
    predict_samples,
    rank_metrics,
    shipped_fusion,
)

T = TableSpec(name="t", rows=100, dim=8, pooling_factor=1.0)


def samples(n: int, truth: float, slope: float = 0.0, noise: float = 0.0) -> list[RankSample]:
    """Ranks of 2-20 shards whose fused kernel costs Σ solo · exp(truth + slope·log n),
    in 8 plans, with log-normal noise."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        count = int(rng.integers(2, 21))
        k = np.zeros(len(CHANNELS))
        k[SOLO_FWD], k[SOLO_BWD] = rng.uniform(1e-3, 5e-3), rng.uniform(2e-3, 9e-3)
        k[COUNT], k[TOUCHED] = count, rng.uniform(1, 500)
        factor = math.exp(truth + slope * math.log(count))
        meas = (
            k[SOLO_FWD] * factor * math.exp(rng.normal(0, noise)),
            k[SOLO_BWD] * factor * math.exp(rng.normal(0, noise)),
        )
        out.append(RankSample(((T, 8),), k[None, :], meas, f"plan{i % 8}"))
    return out


def test_a_constant_factor_is_recovered_and_nothing_else_is_kept() -> None:
    data = samples(60, math.log(1.12), noise=0.03)
    fit = fit_fusion(data)
    assert math.exp(fit.fwd.bias) == pytest.approx(1.12, rel=0.02)
    assert math.exp(fit.bwd.bias) == pytest.approx(1.12, rel=0.02)
    assert fit.fwd.used == [] and fit.bwd.used == []  # no input lowers the error
    pred = predict_samples(fit, data).sum(axis=1)
    meas = np.array([sum(s.measured) for s in data])
    assert float(np.sqrt(np.mean(np.log(pred / meas) ** 2))) < 0.04


def test_an_input_that_explains_the_fusion_is_chosen() -> None:
    data = samples(80, 0.05, slope=0.08, noise=0.01)
    fit = fit_fusion(data)
    assert "log_tables" in fit.fwd.used and "log_tables" in fit.bwd.used
    held = samples(40, 0.05, slope=0.08, noise=0.0)
    meas = np.array([sum(s.measured) for s in held])
    chosen = rank_metrics(predict_samples(fit, held).sum(axis=1), meas, [s.plan for s in held])
    flat = fixed_fusion(data, [])
    constant = rank_metrics(predict_samples(flat, held).sum(axis=1), meas, [s.plan for s in held])
    assert chosen["sigma"] < 0.02 < constant["sigma"]
    assert set(RANK_FEATURES) >= set(fit.fwd.used)


def test_the_shipped_fusion_learns_from_the_held_out_ranks_too() -> None:
    """The held-out tables fuse at 1.3x, the training ones at 1.1x: the training fit
    misses the held-out level, the shipped one sits between the two; the held-out plans,
    named as the training ones are, stay groups of their own."""
    train = samples(40, math.log(1.1), noise=0.01)
    held = samples(40, math.log(1.3), noise=0.01)
    alone = math.exp(fit_fusion(train).fwd.bias)
    both = shipped_fusion(train, held)
    assert alone == pytest.approx(1.1, rel=0.02)
    assert 1.15 < math.exp(both.fwd.bias) < 1.25 and 1.15 < math.exp(both.bwd.bias) < 1.25
    assert {s.plan for s in held} == {s.plan for s in train}  # 8 plans named alike
    relabelled = [RankSample(s.shards, s.kernels, s.measured, f"heldout:{s.plan}") for s in held]
    assert both == fit_fusion([*train, *relabelled])
    assert both != fit_fusion([*train, *held])  # 8 leave-one-out groups, not 16


def test_rank_metrics_per_rank_and_per_plan() -> None:
    meas = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    plans = ["a", "a", "b", "b", "c", "c"]
    perfect = rank_metrics(meas, meas, plans)
    assert perfect["rank_spearman"] == 1.0 and perfect["rank_mape"] == 0.0
    assert perfect["sigma"] == 0.0 and perfect["plan_max_spearman"] == 1.0
    assert (perfect["ranks"], perfect["plans"]) == (6, 3)
    off = rank_metrics([x * 1.1 for x in meas], meas, plans)
    assert off["rank_mape"] == pytest.approx(0.1) and off["sigma"] == pytest.approx(math.log(1.1))
    assert off["median_ratio"] == pytest.approx(1.1)
    swapped = rank_metrics([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], meas, plans)
    assert swapped["rank_spearman"] == -1.0 and swapped["plan_max_spearman"] == -1.0
    assert rank_metrics([], [], []) == {"ranks": 0, "plans": 0}


def test_the_verdict_turns_the_spread_into_advice() -> None:
    base = {"ranks": 20, "plans": 6, "rank_spearman": 0.96}
    good = verdict({**base, "sigma": 0.05})
    assert good["level"] == "reliable" and "±5%" in good["text"] and "reliable" in good["text"]
    fair = verdict({**base, "sigma": 0.11})
    assert fair["level"] == "refine" and "--refine measured" in fair["text"]
    poor = verdict({**base, "sigma": 0.22})
    assert poor["level"] == "unreliable" and "±22%" in poor["text"]
    short = verdict({"ranks": 3, "plans": 2, "sigma": 0.05}, seconds_per_rank=4.0, budget_s=120.0)
    assert short["level"] == "unjudged"
    assert "too short to judge plan ranks" in short["text"] and "minute" in short["text"]
    # every plan with an unreliable model says so with the figure; others stay quiet
    assert "±22%" in (reliability_warning({"calibration": {"verdict": poor}}) or "")
    assert reliability_warning({"calibration": {"verdict": good}}) is None
    assert reliability_warning({}) is None

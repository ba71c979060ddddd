"""The rank head: a calibrated model prices ranks from measured tables, the search
prices exactly what the predictor does, and the choice among candidates does not
trust the model beyond its error (docs/design.md §14)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from shardwise.basics import UserError
from shardwise.planner.comm.model import AlphaBetaComm
from shardwise.planner.costmodel.artifact import CostModel, load_bundled
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.costmodel.rankhead import (
    RANK_FEATURES,
    UNCALIBRATED_SIGMA,
    Fusion,
    RankHead,
    rank_head_from_json,
)
from shardwise.planner.neuroshard import NeuroShardPlanner
from shardwise.planner.neuroshard.beam import SearchStats
from shardwise.planner.neuroshard.problem import Problem
from shardwise.planner.neuroshard.risk import (
    MAX_AMBIGUOUS,
    ambiguous,
    risk_max,
    score,
    within_error,
)
from shardwise.planner.tables import TableSpec, table_signature
from shardwise.planner.topology import Topology

A = TableSpec(name="a", rows=20_000, dim=64, pooling_factor=6.0)
B = TableSpec(name="b", rows=5_000, dim=32, pooling_factor=3.0)
C = TableSpec(name="c", rows=8_000, dim=16, pooling_factor=2.0)  # never anchored
H = TableSpec(name="h", rows=3_000, dim=32, pooling_factor=4.0, dtype="fp16")
BATCH = 1024
ANCHORS = {
    table_signature(A): {64: (2e-3, 5e-3), 32: (1.5e-3, 3e-3)},
    table_signature(B): {32: (1e-3, 2e-3)},
    table_signature(H): {32: (4e-4, 9e-4)},
}


def with_head(head: RankHead, model: CostModel | None = None) -> CostModel:
    model = model or load_bundled()
    metadata = copy.deepcopy(model.metadata)
    metadata.setdefault("calibration", {})["rank_head"] = head.to_json()
    return CostModel(model.compute, model.comm, metadata, "a test model")


def head(**kwargs: object) -> RankHead:
    args: dict[str, object] = {"batch": BATCH, "anchors": ANCHORS, "sigma": 0.06}
    args.update(kwargs)
    return RankHead(**args)  # type: ignore[arg-type]


def test_a_rank_is_priced_from_its_tables_anchors() -> None:
    bias = (math.log(1.1), math.log(1.2))
    p = CostPredictor(
        with_head(head(fwd=Fusion(bias[0]), bwd=Fusion(bias[1]), unanchored=(2.0, 3.0)))
    )
    net = CostPredictor(load_bundled())
    got = p.compute([[(A, 64)], [(A, 32)], [(A, 64), (B, 32)], [(A, 64), (H, 32)]], BATCH)
    np.testing.assert_allclose(got[0], [2e-3 * 1.1, 5e-3 * 1.2], rtol=1e-5)  # its anchor
    np.testing.assert_allclose(got[1], [1.5e-3 * 1.1, 3e-3 * 1.2], rtol=1e-5)  # the half's
    np.testing.assert_allclose(got[2], [3e-3 * 1.1, 7e-3 * 1.2], rtol=1e-5)  # Σ × factor
    # fp16 and fp32 are two kernels, each priced (and factored) apart, then summed
    np.testing.assert_allclose(got[3], [2.4e-3 * 1.1, 5.9e-3 * 1.2], rtol=1e-5)
    # a width not measured: the network's ratio to the table's anchor
    quarter = p.compute([[(A, 16)]], BATCH)[0]
    ratio = net.compute([[(A, 16)]], BATCH)[0] / net.compute([[(A, 64)]], BATCH)[0]
    np.testing.assert_allclose(quarter, np.array([2e-3 * 1.1, 5e-3 * 1.2]) * ratio, rtol=1e-4)
    # another batch: the network's ratio too
    double = p.compute([[(A, 64)]], 2 * BATCH)[0]
    ratio = net.compute([[(A, 64)]], 2 * BATCH)[0] / net.compute([[(A, 64)]], BATCH)[0]
    np.testing.assert_allclose(double, np.array([2e-3 * 1.1, 5e-3 * 1.2]) * ratio, rtol=1e-4)
    # no anchor at all: the network's price times the calibration's factor
    np.testing.assert_allclose(
        p.compute([[(C, 16)]], BATCH)[0],
        net.compute([[(C, 16)]], BATCH)[0] * [2.0 * 1.1, 3.0 * 1.2],
        rtol=1e-4,
    )


def test_a_kernels_own_overhead_is_counted_once() -> None:
    k = (2e-4, 1e-4)
    p = CostPredictor(with_head(head(overhead=k)))
    got = p.compute([[(A, 64)], [(A, 64), (B, 32)], [(A, 64), (B, 32), (A, 32)]], BATCH)
    np.testing.assert_allclose(got[0], [2e-3, 5e-3], rtol=1e-5)  # alone: the anchor
    np.testing.assert_allclose(got[1], [3e-3 - k[0], 7e-3 - k[1]], rtol=1e-5)
    np.testing.assert_allclose(got[2], [4.5e-3 - 2 * k[0], 10e-3 - 2 * k[1]], rtol=1e-5)
    # never below one overhead, however many tiny tables share the kernel
    tiny = {table_signature(B): {32: (1e-4, 1e-4)}}
    q = CostPredictor(with_head(head(anchors=tiny, overhead=(5e-5, 5e-5))))
    assert q.compute([[(B, 32)] * 30], BATCH)[0][0] >= 1e-4


def test_a_kernel_outside_the_calibrated_range_is_priced_at_its_edge() -> None:
    """Every calibrated kernel fused 2-3 shards: a lone shard is priced with the factor
    at the range's edge, not by extending the fitted line (which here would price it at
    e^-3 of its own measurement, and the search would chase that)."""
    n = len(RANK_FEATURES)
    steep = Fusion(0.0, (1.5, 0.0, 0.0, 0.0, 0.0))  # factor grows with the shard count
    mean, std = (math.log(2.5),) + (0.0,) * (n - 1), (0.2,) + (1.0,) * (n - 1)
    lo, hi = (math.log(2),) + (-1e9,) * (n - 1), (math.log(3),) + (1e9,) * (n - 1)
    free = CostPredictor(with_head(head(fwd=steep, mean=mean, std=std)))
    kept = CostPredictor(with_head(head(fwd=steep, mean=mean, std=std, lo=lo, hi=hi)))
    edge = math.exp(1.5 * (math.log(2) - math.log(2.5)) / 0.2)
    assert kept.compute([[(A, 64)]], BATCH)[0][0] == pytest.approx(2e-3 * edge, rel=1e-5)
    assert free.compute([[(A, 64)]], BATCH)[0][0] < 0.1 * kept.compute([[(A, 64)]], BATCH)[0][0]
    # inside the range both price alike
    pair = [[(A, 64), (B, 32)]]
    np.testing.assert_allclose(kept.compute(pair, BATCH), free.compute(pair, BATCH), rtol=1e-6)
    back = head(fwd=steep, mean=mean, std=std, lo=lo, hi=hi)
    assert rank_head_from_json(back.to_json()) == back


def test_a_rank_priced_from_guesses_is_less_certain() -> None:
    p = CostPredictor(with_head(head(sigma_scaled=0.2, sigma_unanchored=0.6)))
    s = p.rank_sigmas(
        [[(A, 64), (B, 32)], [(A, 16), (B, 32)], [(C, 16)], [(A, 64), (C, 16)]], BATCH
    )
    assert s[0] == pytest.approx(0.06)  # every shard measured: the held-out σ
    assert s[0] < s[1] < 0.2 and s[2] == pytest.approx(math.hypot(0.06, 0.6))
    assert s[0] < s[3] < s[2]
    assert CostPredictor(load_bundled()).rank_sigma == UNCALIBRATED_SIGMA


def test_the_head_survives_the_file_and_a_damaged_one_is_named(tmp_path: object) -> None:
    h = head(fwd=Fusion(0.1, (0.0, 0.2, 0.0, 0.0, 0.0)), mean=(1.0,) * 5, std=(2.0,) * 5)
    assert rank_head_from_json(h.to_json()) == h
    doc = h.to_json()
    doc["anchors"][table_signature(A)]["64"] = [1e-3, -1.0]
    with pytest.raises(UserError, match=r"rank_head\.anchors\[.*\]\[64\]\[1\] is -1.0"):
        rank_head_from_json(doc)
    doc = h.to_json()
    doc["fusion"]["features"] = ["log_tables"]
    with pytest.raises(UserError, match=r"rank_head\.fusion\.features is"):
        rank_head_from_json(doc)
    doc = h.to_json()
    doc["fusion"]["bwd"]["coef"] = [0.0] * (len(RANK_FEATURES) - 1)
    with pytest.raises(UserError, match=r"rank_head\.fusion\.bwd\.coef is not a list of 5"):
        rank_head_from_json(doc)


def test_the_search_prices_what_the_predictor_prices() -> None:
    """The search sums the head's channels per rank itself (incrementally); its price of
    a placement must be the predictor's, with a fusion factor that reads every input."""
    fusion = Fusion(0.05, (0.02, -0.03, 0.01, 0.04, -0.02))
    p = CostPredictor(with_head(head(fwd=fusion, bwd=fusion, mean=(1.0,) * 5, std=(2.0,) * 5)))
    tables = [A, B, C, H] + [
        TableSpec(name=f"x{i}", rows=1000 + 500 * i, dim=8 * (1 + i % 4), pooling_factor=1 + i)
        for i in range(8)
    ]
    topo = Topology(gpus=3, gpu_memory_bytes=2**30, batch_size_per_rank=BATCH // 3)
    problem = Problem(tables, topo, p)
    state = problem.whole()
    sh = problem.shards(state)
    ranks = np.random.default_rng(0).integers(0, 3, len(sh.cols))
    compute, _ = problem.costs(sh, ranks)
    pairs = problem.shard_list(state)
    sets = [
        [(tables[t], c) for (t, c), r in zip(pairs, ranks, strict=True) if r == k] for k in range(3)
    ]
    np.testing.assert_allclose(compute, p.compute(sets, problem.global_batch), rtol=1e-4)


def test_the_risk_adjusted_max_and_the_toss_up_band() -> None:
    comm = np.zeros(4)
    assert risk_max([1.0, 2.0, 3.0, 1.0], comm, np.zeros(4)) == pytest.approx(3.0)
    lone = risk_max([3.0, 1.0, 1.0, 1.0], comm, np.full(4, 0.1))
    crowded = risk_max([3.0, 3.0, 3.0, 3.0], comm, np.full(4, 0.1))
    assert 3.0 * math.exp(0.09) < lone < 3.0 * math.exp(0.11)  # one σ above the median
    assert lone < crowded  # many ranks near the max: the max is likelier higher
    scored = [
        score("a", np.array([10.0, 9.0]), np.zeros(2), np.full(2, 0.05)),
        score("b", np.array([10.3, 9.0]), np.zeros(2), np.full(2, 0.05)),
        score("c", np.array([13.0, 9.0]), np.zeros(2), np.full(2, 0.05)),
    ]
    assert [s.label for s in ambiguous(scored)] == ["a", "b"]  # c is clearly worse
    # The band, alone: what the planner uses to hand on its table-wise/column-wise best
    # beyond the cap on toss-ups.
    assert within_error(scored[0], scored[1]) and not within_error(scored[0], scored[2])
    many = [score(f"s{i}", np.array([10.0 + 0.01 * i, 9.0]), np.zeros(2), np.full(2, 0.05))
            for i in range(MAX_AMBIGUOUS + 2)]  # fmt: skip
    assert len(ambiguous(many)) == MAX_AMBIGUOUS
    assert all(within_error(many[0], s) for s in many)


def test_the_choice_prefers_a_measured_plan_over_a_model_artifact() -> None:
    """Two candidates. One looks cheapest only because its slowest rank holds a table
    no one measured (priced by the network with a large spread: a guess a search is
    drawn to, the winner's curse); the other's slowest rank is all measured. The
    predicted max picks the first, the risk-adjusted choice the second."""
    ms = 1e-3
    tables = [
        TableSpec(name="a", rows=20_000, dim=32, pooling_factor=6.0),
        TableSpec(name="b", rows=21_000, dim=32, pooling_factor=6.0),
        TableSpec(name="d", rows=22_000, dim=32, pooling_factor=6.0),
        TableSpec(name="e", rows=23_000, dim=32, pooling_factor=6.0),
        TableSpec(name="u", rows=24_000, dim=32, pooling_factor=6.0),  # never measured
    ]
    work = {"a": 5.0, "b": 3.0, "d": 3.0, "e": 2.0}
    anchors = {table_signature(t): {32: (1e-9, work[t.name] * ms)} for t in tables[:4]}
    net = CostPredictor(load_bundled()).compute([[(tables[4], 32)]], BATCH)[0]
    factor = (1e-9 / net[0], 4.6 * ms / net[1])  # the guess: 4.6 ms, spread 0.8
    model = with_head(head(anchors=anchors, unanchored=factor, sigma_unanchored=0.8, sigma=0.03))
    p = CostPredictor(model)
    p.comm_model = AlphaBetaComm(name="free", alpha_s=0.0, bytes_per_s=1e30, source="a test")
    topo = Topology(gpus=2, gpu_memory_bytes=2**30, batch_size_per_rank=BATCH // 2)
    problem = Problem(tables, topo, p)
    state = problem.whole()
    sh = problem.shards(state)
    artifact = problem.place(sh, np.array([0, 1, 1, 1, 0]))  # a + u | b + d + e
    measured = problem.place(sh, np.array([0, 0, 1, 0, 1]))  # a + b + e | d + u
    np.testing.assert_allclose(artifact.per_rank, [9.6 * ms, 8.0 * ms], rtol=1e-4)
    np.testing.assert_allclose(measured.per_rank, [10.0 * ms, 7.6 * ms], rtol=1e-4)
    stats = SearchStats()
    planner = NeuroShardPlanner()
    pool = [("artifact", state, artifact), ("measured", state, measured)]
    label, _, chosen = planner._choose(problem, pool, stats, frozenset())
    assert label == "measured" and chosen is measured
    assert stats.choice["cheapest_predicted"] == "artifact"
    assert stats.choice["predicted_max"] == pytest.approx(10.0 * ms, rel=1e-4)
    assert stats.choice["sigma"] == pytest.approx(0.03, rel=1e-3)  # its straggler: measured
    # with the guess measured as well (no spread), the cheaper plan wins again
    sure = with_head(head(anchors=anchors, unanchored=factor, sigma_unanchored=1e-3, sigma=0.03))
    q = CostPredictor(sure)
    q.comm_model = p.comm_model
    problem = Problem(tables, topo, q)
    sh = problem.shards(state)
    pool = [(lab, state, problem.place(sh, pl.ranks)) for lab, _, pl in pool]
    assert planner._choose(problem, pool, SearchStats(), frozenset())[0] == "artifact"

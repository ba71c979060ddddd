"""The synthetic generator: determinism, per-table independence, valid specs, and its
aggregate statistics against Meta's published 856-table figures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.planner.access import NUM_BINS
from shardwise.planner.synthetic import (
    DIMS,
    DLRM_T856_TABLES,
    STATS_FILE,
    TableParams,
    aggregate_stats,
    draw_params,
    generate_tables,
    generate_trace,
    published_stats,
    sample_ranks,
    table_counts,
    table_stream,
)

SHARED_STATS = Path(__file__).resolve().parents[2] / "shared" / "data" / "dlrm_locality_stats.json"


@pytest.mark.skipif(
    not SHARED_STATS.is_file(), reason="the team's shared/ is not beside this checkout"
)
def test_packaged_stats_are_the_teams_file() -> None:
    assert json.loads(STATS_FILE.read_text()) == json.loads(SHARED_STATS.read_text())


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_tables_and_streams() -> None:
    assert draw_params(40, seed=7) == draw_params(40, seed=7)
    assert generate_tables(6, seed=7, batch_size=512) == generate_tables(6, seed=7, batch_size=512)
    a = generate_trace(draw_params(6, 7), batch_size=512, seed=7)
    b = generate_trace(draw_params(6, 7), batch_size=512, seed=7)
    assert all(a.__dict__[k].equal(b.__dict__[k]) for k in ("indices", "offsets", "lengths"))


def test_different_seed_different_tables_and_streams() -> None:
    p0, p1 = draw_params(40, seed=0), draw_params(40, seed=1)
    assert [p.rows for p in p0] != [p.rows for p in p1]
    assert [p.pooling_factor for p in p0] != [p.pooling_factor for p in p1]
    # the same table parameters with another stream seed give another batch
    p = p0[0]
    assert not np.array_equal(table_stream(p, 512, 0, 0)[1], table_stream(p, 512, 1, 0)[1])


def test_a_table_is_the_same_alone_or_among_others() -> None:
    seed, batch, k = 11, 1024, 4
    everything = draw_params(10, seed)
    assert draw_params(k + 1, seed)[k] == everything[k]  # a prefix draws the same tables
    trace = generate_trace(everything, batch, seed)
    lengths, indices = table_stream(everything[k], batch, seed, k)
    assert np.array_equal(trace.table_indices(k).numpy(), indices)
    assert np.array_equal(trace.lengths[k].numpy(), lengths)
    solo = generate_tables(k + 1, seed, batch_size=batch)[k]
    assert solo == generate_tables(10, seed, batch_size=batch)[k]


def test_table_counts_are_the_bincount_of_the_stream() -> None:
    p = TableParams("t", rows=5000, dim=16, pooling_factor=3.0, zero_fraction=0.2, skew=1.1)
    _, indices = table_stream(p, 4096, seed=2, table_index=3)
    counts = table_counts(p, 4096, seed=2, table_index=3)
    assert counts.shape == (5000,)
    assert np.array_equal(counts, np.bincount(indices, minlength=5000))


def test_rows_are_a_scattered_permutation_of_ranks() -> None:
    """Hot rows are not 0, 1, 2, ...: the affine bijection scatters them."""
    p = TableParams("t", rows=100_000, dim=16, pooling_factor=10.0, zero_fraction=0.0, skew=1.2)
    counts = table_counts(p, 4096, seed=0, table_index=0)
    hottest = np.argsort(counts)[::-1][:5]
    assert sorted(hottest.tolist()) != list(range(5))


# --------------------------------------------------------------------------- distributions


def test_specs_are_valid_and_varied() -> None:
    params = draw_params(200, seed=0)
    specs = generate_tables(200, seed=0, batch_size=256)
    assert len({s.name for s in specs}) == 200
    for spec, p in zip(specs, params, strict=True):
        assert spec.dim % 4 == 0 and spec.dim in DIMS
        assert (spec.name, spec.rows, spec.dim, spec.dtype) == (p.name, p.rows, p.dim, p.dtype)
        assert len(spec.access_hist) == NUM_BINS
        assert sum(spec.access_hist) == pytest.approx(1.0) or spec.pooling_factor == 0
    rows = np.array([p.rows for p in params])
    assert rows.min() < 1_000 and rows.max() > 1_000_000  # DLRM-like spread of hash sizes
    assert {p.dim for p in params} == set(DIMS)
    assert any(p.zero_fraction > 0.3 for p in params)


def test_zero_length_samples_and_pooling() -> None:
    p = TableParams("t", rows=1000, dim=16, pooling_factor=2.0, zero_fraction=0.4, skew=0.0)
    lengths, indices = table_stream(p, 65536, seed=0, table_index=0)
    assert np.mean(lengths == 0) == pytest.approx(0.4, abs=0.01)
    assert lengths.mean() == pytest.approx(2.0, rel=0.02)
    assert indices.size == lengths.sum() and indices.min() >= 0 and indices.max() < 1000


def test_sample_ranks_follow_the_power_law() -> None:
    rng = np.random.default_rng(0)
    n, rows = 400_000, 1000
    uniform = np.bincount(sample_ranks(n, rows, 0.0, rng), minlength=rows)
    assert uniform.min() > 0.8 * n / rows and uniform.max() < 1.2 * n / rows
    # skew 1: P(rank r) = ln((r+2)/(r+1)) / ln(rows+1)
    zipf = np.bincount(sample_ranks(n, rows, 1.0, rng), minlength=rows) / n
    expected = np.log((np.arange(rows) + 2) / (np.arange(rows) + 1)) / np.log(rows + 1)
    assert zipf[:10] == pytest.approx(expected[:10], rel=0.03)
    # a head offset q flattens the hottest ranks: P(r) = ln((r+q+2)/(r+q+1)) / ln((rows+q+1)/(q+1))
    q = 10.0
    flat = np.bincount(sample_ranks(n, rows, 1.0, rng, head_offset=q), minlength=rows) / n
    r = np.arange(rows)
    expected = np.log((r + q + 2) / (r + q + 1)) / np.log((rows + q + 1) / (q + 1))
    assert flat[:10] == pytest.approx(expected[:10], rel=0.05)
    steep = sample_ranks(n, rows, 2.0, rng)
    assert steep.min() == 0 and steep.max() < rows and np.mean(steep == 0) > 0.4


def test_inconsistent_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="raise zero_fraction"):
        TableParams("t", rows=10, dim=16, pooling_factor=0.5, zero_fraction=0.1, skew=1.0)
    with pytest.raises(ValueError, match="multiple of 4"):
        TableParams("t", rows=10, dim=6, pooling_factor=1.0, zero_fraction=0.0, skew=1.0)
    p = TableParams("t", rows=10, dim=8, pooling_factor=0.0, zero_fraction=0.0, skew=1.0)
    lengths, indices = table_stream(p, 64, 0, 0)
    assert lengths.sum() == 0 and indices.size == 0
    assert dataclasses.replace(p, pooling_factor=0.5, zero_fraction=0.5).mean_nonzero_length == 1


# --------------------------------------------------------------------------- the aggregate

# Tolerances of the aggregate test, and why. The targets are rounded to 3 decimals.
# The calibrated generator (seed 0) measures: num_indices +2.3 %, num_unique +2.7 %,
# avg_reuse -0.3 %, unique-row histogram L1 0.086 (worst bin 0.030, the 2-access bin),
# index-mass histogram L1 0.132 (worst bin 0.027). The first, uncalibrated guess
# missed by num_unique -51 %, L1 0.30 / worst bin 0.15 and L1 0.55 / worst bin 0.20.
# The bounds leave ~1.4x room over the calibrated error (the seed moves it a little)
# and are 3-5x tighter than the uncalibrated one, so a broken calibration fails.
TOTAL_REL_TOL = 0.05  # num_indices and num_unique, relative
REUSE_REL_TOL = 0.05  # avg_reuse = num_indices / num_unique, relative
UNIQUE_L1_TOL = 0.12  # L1 distance of the unique-row histograms (at most 2)
UNIQUE_BIN_TOL = 0.04  # worst single bin of that histogram, absolute
MASS_L1_TOL = 0.18  # L1 distance of the index-mass histograms
MASS_BIN_TOL = 0.04  # worst single bin of that histogram, absolute
AGGREGATE_SEED = 0


@pytest.mark.slow
def test_aggregate_statistics_match_the_published_856_table_figures() -> None:
    target = published_stats()
    params = draw_params(DLRM_T856_TABLES, AGGREGATE_SEED)
    stats = aggregate_stats(params, target["batch_size"], AGGREGATE_SEED)
    assert stats["batch_size"] == target["batch_size"]
    for key in ("num_indices", "num_unique"):
        assert stats[key] == pytest.approx(target[key], rel=TOTAL_REL_TOL), key
    assert stats["avg_reuse"] == pytest.approx(target["avg_reuse"], rel=REUSE_REL_TOL)
    for key, l1_tol, bin_tol in (
        ("unique_row_access_hist", UNIQUE_L1_TOL, UNIQUE_BIN_TOL),
        ("index_mass_by_reuse_hist", MASS_L1_TOL, MASS_BIN_TOL),
    ):
        diff = np.abs(np.asarray(stats[key]) - np.asarray(target[key]))
        assert diff.sum() <= l1_tol, (key, diff.sum(), stats[key])
        assert diff.max() <= bin_tol, (key, int(diff.argmax()), diff.max(), stats[key])

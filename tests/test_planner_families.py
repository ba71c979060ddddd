"""Table families (planner/families.py): bounds, determinism by seed, valid specs,
and `shardwise tables generate --family` / `tables merge`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shardwise.basics import UserError
from shardwise.cli import app
from shardwise.planner import families
from shardwise.planner.access import NUM_BINS
from shardwise.planner.tables import MAX_DIM, MAX_POOLING_FACTOR, MAX_ROWS, TableSpec, load_tables

#: Small histogram batch: the specs are measured on it, so tests stay fast.
BATCH = 256


def _valid(t: TableSpec) -> None:
    """Within TableSpec's bounds, and what a fresh TableSpec accepts again."""
    assert TableSpec.model_validate(t.model_dump()) == t
    assert 0 < t.rows <= MAX_ROWS
    assert 0 < t.dim <= MAX_DIM and t.dim % 4 == 0
    assert 0 <= t.pooling_factor <= MAX_POOLING_FACTOR
    assert len(t.access_hist) == NUM_BINS
    assert math.isclose(sum(t.access_hist), 1.0, abs_tol=1e-3) or t.pooling_factor == 0


def test_broad_params_cover_the_stated_ranges() -> None:
    params = families.broad_params(400, seed=3)
    rows = np.array([p.rows for p in params])
    dims = np.array([p.dim for p in params])
    pooling = np.array([p.pooling_factor for p in params])
    skew = np.array([p.skew for p in params])
    assert rows.min() >= 100 and rows.max() <= 10**8
    # Log-uniform: every decade of rows is drawn, about evenly (400 / 6 per decade).
    decades = np.bincount(np.minimum(np.log10(rows).astype(int), 7) - 2, minlength=6)
    assert decades.min() >= 30, decades
    assert set(dims % 4) == {0} and dims.min() == 4 and dims.max() <= 256
    assert (dims > 128).any()
    assert pooling.min() >= 1.0 and pooling.max() <= 200.0
    assert (pooling > 100).any() and (pooling < 2).any()
    assert skew.min() >= 0 and skew.max() <= 2.0
    assert (skew < 0.2).any() and (skew > 1.8).any()
    assert {p.dtype for p in params} == {"fp16", "fp32"}
    assert any(p.zero_fraction > 0.3 for p in params)


def test_broad_tables_are_valid_and_have_empty_samples() -> None:
    specs = families.broad_tables(40, seed=5, batch_size=BATCH)
    assert [t.name for t in specs] == [f"broad_{k:04d}" for k in range(40)]
    for t in specs:
        _valid(t)
    # Zero-length samples pull some measured pooling factors under the non-empty mean.
    params = families.broad_params(40, seed=5)
    assert any(
        t.pooling_factor < p.mean_nonzero_length * 0.8 for t, p in zip(specs, params, strict=True)
    )


def test_heldout_tables_are_valid_and_differ_from_broad() -> None:
    specs = families.heldout_tables(30, seed=families.HELDOUT_SEED, batch_size=BATCH)
    for t in specs:
        _valid(t)
        assert t.dim in families.HELDOUT_DIMS
        assert t.rows <= families.HELDOUT_ROWS_MAX
    assert any(t.rows < 3000 for t in specs)  # the categorical share
    assert {t.dtype for t in specs} == {"fp16", "fp32"}


def test_heavy_tables_are_big_heavily_read_and_not_powers_of_two() -> None:
    specs = families.heavy_tables(80, seed=4, batch_size=BATCH)
    assert [t.name for t in specs[:2]] == ["heavy_0000", "heavy_0001"]
    for t in specs:
        _valid(t)
        assert 2**20 * 0.99 <= t.size_bytes <= 2**30
        assert t.dim % 4 == 0 and 8 <= t.dim <= 256
        assert t.pooling_factor <= 100.0
    dims = {t.dim for t in specs}
    assert any(d & (d - 1) for d in dims) and len(dims) > 20  # not only powers of two
    assert any(t.size_bytes > 2**28 for t in specs)  # some above 256 MiB
    pooling = sorted(t.pooling_factor for t in specs)
    assert pooling[len(pooling) // 2] < 15 < pooling[-1] / 2  # a heavy right tail
    assert {t.dtype for t in specs} == {"fp16", "fp32"}
    # Empty samples and skews vary: some tables read many rows once, others a few hot.
    once = [t.access_hist[0] for t in specs if t.pooling_factor > 5]
    assert min(once) < 0.5 < max(once)


def test_heavy_pooling_stays_within_100_on_a_tiny_batch() -> None:
    # At 8 samples per batch the negative binomial's spread often passes the mean's
    # bound; the batch is scaled down to it.
    specs = families.heavy_tables(200, seed=1, batch_size=8)
    assert max(t.pooling_factor for t in specs) <= 100.0
    assert any(t.pooling_factor > 60 for t in specs)


def test_industrial_tables_have_giants_among_many_small_ones() -> None:
    specs = families.industrial_tables(120, seed=4, batch_size=BATCH)
    assert [t.name for t in specs[:2]] == ["industrial_0000", "industrial_0001"]
    lo, hi = families.INDUSTRIAL_GIANT_BYTES
    giants = [t for t in specs if t.size_bytes >= lo * 0.99]
    small = [t for t in specs if t not in giants]
    assert 5 <= len(giants) <= 25, len(giants)  # 12 % of 120, within chance
    for t in specs:
        _valid(t)
    for t in giants:
        assert t.size_bytes <= hi and t.dim % 32 == 0 and 64 <= t.dim <= 256
    for t in small:
        assert 2**16 * 0.99 <= t.size_bytes <= 2**27 and t.dim in families.INDUSTRIAL_DIMS
    # The giants hold most of the pool's bytes; the small tables are many.
    assert sum(t.size_bytes for t in giants) > 2 * sum(t.size_bytes for t in small)
    assert {t.dtype for t in specs} == {"fp16", "fp32"}
    assert max(t.pooling_factor for t in specs) <= 50 * 1.2  # measured on a small batch


@pytest.mark.parametrize(("pooling", "empty"), [(0.4, 0.0), (3.0, 0.2), (17.5, 0.1)])
def test_industrial_lengths_are_bounded_multi_hot(pooling: float, empty: float) -> None:
    """Mean the pooling factor, no sample above the cap ceil(2m), the empty share kept."""
    lengths = families.bounded_lengths(pooling, empty, 200_000, np.random.default_rng(1))
    m = pooling / (1 - empty)
    assert lengths.mean() == pytest.approx(pooling, rel=0.02)
    assert lengths.max() <= max(1, math.ceil(2 * m))
    assert (lengths == 0).mean() >= empty * 0.98


def test_hot_cold_counts_give_the_hot_set_its_share() -> None:
    rng = np.random.default_rng(0)
    counts = families.hot_cold_counts(200_000, 1_000_000, 500, 0.6, rng)
    assert counts.sum() == 200_000
    assert counts[:500].sum() / 200_000 == pytest.approx(0.6, abs=0.01)
    assert counts[:500].min() > 150  # flat inside the hot set: 240 each on average
    assert counts[500:].max() <= 5  # the cold rows are read about once
    # every row hot: the whole batch in it
    assert families.hot_cold_counts(10, 4, 9, 0.1, rng).sum() == 10


@pytest.mark.parametrize(("rows", "skew"), [(50, 1.2), (100_000, 0.3), (3_000_000, 1.6)])
def test_zipf_counts_follow_the_discrete_bounded_law(rows: int, skew: float) -> None:
    n = 400_000
    counts = families.zipf_counts(n, rows, skew, np.random.default_rng(0), head=1024)
    assert counts.sum() == n and 0 < np.count_nonzero(counts) <= rows
    # The hottest row's share is the law's 1 / sum_k k^-s (over all ranks, tail included).
    norm = float((np.arange(1, rows + 1, dtype=np.float64) ** -skew).sum())
    assert counts.max() / n == pytest.approx(1 / norm, rel=0.05)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_same_seed_same_tables_and_a_prefix_is_a_smaller_draw(family: str) -> None:
    a = families.generate(family, 6, seed=9, batch_size=BATCH)
    assert a == families.generate(family, 6, seed=9, batch_size=BATCH)
    assert families.generate(family, 3, seed=9, batch_size=BATCH) == a[:3]
    assert a != families.generate(family, 6, seed=10, batch_size=BATCH)


def test_bad_family_count_and_seed_are_user_errors() -> None:
    with pytest.raises(UserError, match="--family"):
        families.generate("wide", 3, seed=0)
    with pytest.raises(UserError, match="--count"):
        families.broad_params(0, seed=0)
    with pytest.raises(UserError, match="--seed"):
        families.heldout_tables(2, seed=-1)


def test_merge_keeps_light_tables_and_refuses_duplicate_names() -> None:
    a = families.generate("broad", 8, seed=1, batch_size=BATCH)
    b = families.generate("heldout", 8, seed=1, batch_size=BATCH)
    assert families.merge_pools([a, b]) == a + b
    light = families.merge_pools([a, b], max_pooling=4.0)
    assert light == [t for t in a + b if t.pooling_factor <= 4.0]
    with pytest.raises(UserError, match="more than one file"):
        families.merge_pools([a, a[:1]])
    with pytest.raises(UserError, match="--max-pooling"):
        families.merge_pools([a], max_pooling=0.0)


def test_cli_generate_family_and_merge(tmp_path: Path) -> None:
    runner = CliRunner()
    common = ["--count", "4", "--seed", "2", "--histogram-batch", str(BATCH)]
    broad, held = tmp_path / "broad.yaml", tmp_path / "held.yaml"
    res = runner.invoke(
        app, ["tables", "generate", "--family", "broad", *common, "--out", str(broad)]
    )
    assert res.exit_code == 0, res.output
    assert load_tables(broad) == families.generate("broad", 4, seed=2, batch_size=BATCH)
    res = runner.invoke(
        app, ["tables", "generate", "--family", "heldout", *common, "--out", str(held)]
    )
    assert res.exit_code == 0, res.output
    heavy = tmp_path / "heavy.yaml"
    res = runner.invoke(
        app, ["tables", "generate", "--family", "heavy", *common, "--out", str(heavy)]
    )
    assert res.exit_code == 0, res.output
    assert load_tables(heavy) == families.generate("heavy", 4, seed=2, batch_size=BATCH)
    industrial = tmp_path / "industrial.yaml"
    res = runner.invoke(
        app, ["tables", "generate", "--family", "industrial", *common, "--out", str(industrial)]
    )
    assert res.exit_code == 0, res.output
    assert load_tables(industrial) == families.generate("industrial", 4, seed=2, batch_size=BATCH)
    merged = tmp_path / "pool.yaml"
    res = runner.invoke(app, ["tables", "merge", str(broad), str(held), "--out", str(merged)])
    assert res.exit_code == 0, res.output
    assert load_tables(merged) == load_tables(broad) + load_tables(held)
    res = runner.invoke(
        app, ["tables", "generate", "--family", "wide", *common, "--out", str(broad)]
    )
    assert isinstance(res.exception, UserError) and "--family" in str(res.exception)
    # The default family is unchanged: the calibrated generator's tables.
    default = tmp_path / "default.yaml"
    res = runner.invoke(app, ["tables", "generate", *common, "--out", str(default)])
    assert res.exit_code == 0, res.output
    assert load_tables(default) == families.generate("calibrated", 4, seed=2, batch_size=BATCH)

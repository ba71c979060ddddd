"""The 17-bin access histogram: exact bin edges, the two raw views, normalization."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.planner.access import (
    BIN_LABELS,
    NUM_BINS,
    bin_of,
    count_histograms,
    normalize,
)
from shardwise.planner.trace import measure_counts


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 2),
        (5, 3),
        (8, 3),
        (9, 4),
        (1024, 10),
        (1025, 11),
        (16384, 14),
        (16385, 15),
        (32768, 15),
        (32769, 16),
        (10**9, 16),
    ],
)
def test_bin_edges(count: int, expected: int) -> None:
    assert int(bin_of(np.array([count]))[0]) == expected


def test_bin_of_every_power_of_two_edge() -> None:
    for k in range(1, NUM_BINS - 1):
        edge = 2**k
        assert bin_of(np.array([edge, edge + 1])).tolist() == [k, min(k + 1, NUM_BINS - 1)]


def test_bin_of_rejects_zero_counts() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        bin_of(np.array([0, 3]))


def test_labels() -> None:
    assert len(BIN_LABELS) == NUM_BINS
    assert BIN_LABELS[0] == "(0,1]" and BIN_LABELS[2] == "(2,4]" and BIN_LABELS[-1] == "32768+"


def test_count_histograms_known_answer() -> None:
    # rows read 1, 1, 2, 3, 4, 40000 times, plus never-read rows that must be ignored
    counts = np.array([1, 0, 1, 2, 3, 0, 4, 40000])
    rows, mass = count_histograms(counts)
    assert rows.tolist() == [2, 1, 2] + [0] * 13 + [1]
    assert mass.tolist() == [2, 2, 7] + [0] * 13 + [40000]
    assert int(mass.sum()) == int(counts.sum())


def test_normalize() -> None:
    assert normalize(np.array([1, 3] + [0] * 15)) == (0.25, 0.75) + (0.0,) * 15
    assert sum(normalize(np.arange(NUM_BINS))) == pytest.approx(1.0)
    assert normalize(np.zeros(NUM_BINS)) == (0.0,) * NUM_BINS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 2**40), min_size=2, max_size=50))
def test_bins_are_monotone_in_count(counts: list[int]) -> None:
    ordered = np.sort(np.array(counts, dtype=np.int64))
    bins = bin_of(ordered)
    assert np.all(np.diff(bins) >= 0)
    assert bins.min() >= 0 and bins.max() < NUM_BINS
    # and each count lies inside its bin: (2^(k-1), 2^k], the last bin open
    for c, k in zip(ordered.tolist(), bins.tolist(), strict=True):
        assert c <= 2**k or k == NUM_BINS - 1
        assert k == 0 or c > 2 ** (k - 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 70000), min_size=1, max_size=200))
def test_fast_measure_equals_count_histograms(counts: list[int]) -> None:
    """The trace measurer bins distinct count values; it must agree with the reference."""
    c = np.array(counts, dtype=np.int64)
    rows, mass = count_histograms(c)
    m = measure_counts(c, batch_size=7)
    assert m.unique_rows.tolist() == rows.tolist()
    assert m.index_mass.tolist() == mass.tolist()
    assert m.num_indices == int(c.sum())
    nonzero = np.flatnonzero(c)
    assert m.max_index == (int(nonzero[-1]) if nonzero.size else -1)

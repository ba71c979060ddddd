"""The 17-bin access histogram that describes a table's locality (docs/design.md §4).

Bin k holds the rows accessed (2^(k-1), 2^k] times in one batch; bin 0 is (0, 1] and
bin 16 is more than 32768. Two views of the same counts exist: the fraction of
*unique rows* per bin (the cost-model feature, ``access_hist``), and the fraction of
*indices* (lookups) per bin (``index_mass``), which the published DLRM statistics
also report.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

NUM_BINS = 17
BIN_LABELS: tuple[str, ...] = (
    "(0,1]",
    *(f"({2 ** (k - 1)},{2**k}]" for k in range(1, NUM_BINS - 1)),
    f"{2 ** (NUM_BINS - 2)}+",
)


def bin_of(counts: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """The bin of each access count (counts must be >= 1)."""
    c = np.asarray(counts, dtype=np.int64)
    if c.size and int(c.min()) < 1:
        raise ValueError("access counts must be >= 1 (only accessed rows have a bin)")
    # ceil(log2(c)) computed exactly on integers: the bit length of c - 1.
    bins = np.zeros(c.shape, dtype=np.int64)
    rest = c - 1
    while np.any(rest):
        bins += rest > 0
        rest >>= 1
    return np.minimum(bins, NUM_BINS - 1)


def count_histograms(
    counts: npt.NDArray[np.integer],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Raw per-bin totals: (unique rows per bin, indices per bin), from per-row counts.

    Rows with a zero count are ignored, so a full ``bincount`` over the table works.
    """
    c = np.asarray(counts, dtype=np.int64)
    c = c[c > 0]
    bins = bin_of(c)
    rows = np.bincount(bins, minlength=NUM_BINS).astype(np.int64)
    mass = np.bincount(bins, weights=c, minlength=NUM_BINS).astype(np.int64)
    return rows, mass


def normalize(hist: npt.NDArray[np.integer] | npt.NDArray[np.floating]) -> tuple[float, ...]:
    """Fractions summing to 1; an all-zero histogram (a table never accessed) stays zero."""
    total = float(np.sum(hist))
    if total == 0:
        return tuple(0.0 for _ in range(NUM_BINS))
    return tuple(float(x) / total for x in hist)

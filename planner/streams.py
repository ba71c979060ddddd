"""A lookup stream for any :class:`TableSpec`, generated from its features alone.

User table files carry no generator parameters (rows, width, pooling factor and a
17-bin histogram only), yet the profiler and the evaluator need real index streams
to time kernels with. :func:`stream_from_spec` builds one batch whose mean pooling is
the spec's pooling factor (exactly, up to rounding to whole lookups) and whose
per-batch unique-row histogram approximates the spec's ``access_hist``:

1. total lookups ``N = round(pooling_factor · B)``;
2. unique rows ``U = N / Σ_k f_k·m_k`` (``f_k`` the spec's fractions, ``m_k`` the mean
   count this module draws inside bin k), split over the bins by largest remainder;
3. each unique row gets a count inside its bin (log-uniform), then the total is
   nudged to exactly ``N`` within the bins' bounds;
4. the rows get distinct random ids ``< rows``; the ``N`` lookups are shuffled and cut
   into samples (a share of empty samples, the rest 1 + a geometric-like spread).

The histogram is reproduced *at the batch size asked for*: a spec measured at batch
65536 and streamed at batch 4096 keeps its shape, where a real trace would shift
towards fewer repeats. When the histogram asks for more unique rows than the table
has, every row is read and the excess lookups raise the counts (the measured
histogram then shifts right: a small table cannot be read with little reuse).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from shardwise.planner.access import NUM_BINS
from shardwise.planner.tables import NO_REUSE_HIST, TableSpec

#: Share of samples with no lookup (when the pooling factor allows it: a pooling
#: factor p < 1 empties 1 - p of the samples). The generator draws it in [0, 0.5];
#: specs do not carry it, so the middle of that range stands in.
EMPTY_SHARE = 0.25

# Integer count range of each bin: bin 0 is exactly 1, bin k is (2^(k-1), 2^k], the
# last bin is open (counts above 32768); it is drawn in (32768, 65536] and may grow.
_LO = np.array([1] + [2 ** (k - 1) + 1 for k in range(1, NUM_BINS)], dtype=np.int64)
_HI = np.array([2**k for k in range(NUM_BINS)], dtype=np.int64)
_HI[-1] = 2 * 2 ** (NUM_BINS - 2)


def _log_uniform_mean(lo: int, hi: int) -> float:
    """Mean of floor-free log-uniform draws on [lo, hi] (the within-bin law used here)."""
    if hi <= lo:
        return float(lo)
    return (hi - lo) / math.log(hi / lo)


#: Mean access count of a row in each bin (log-uniform inside the bin); shared with the cost
#: model, which derives unique rows from a histogram the same way.
BIN_MEAN_COUNT = np.array(
    [_log_uniform_mean(int(a), int(b)) for a, b in zip(_LO, _HI, strict=True)]
)


def _largest_remainder(total: int, weights: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Integers proportional to ``weights`` that sum to ``total`` exactly."""
    share = weights / weights.sum() * total
    out: npt.NDArray[np.int64] = np.floor(share).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(share - out), kind="stable")[:short]] += 1
    return out


def _fix_total(
    counts: npt.NDArray[np.int64],
    lo: npt.NDArray[np.int64],
    hi: npt.NDArray[np.int64],
    total: int,
    rng: np.random.Generator,
) -> None:
    """Move ``counts`` (in place) to sum to ``total`` while staying in [lo, hi].

    Each round spreads the residual over the rows in proportion to their slack
    (a multinomial draw), clipped to the bounds; a few rounds close it.
    """
    for _ in range(64):
        residual = total - int(counts.sum())
        if residual == 0:
            return
        slack = (hi - counts) if residual > 0 else (counts - lo)
        room = int(slack.sum())
        if room == 0:
            break
        step = rng.multinomial(min(abs(residual), room), slack / room)
        np.minimum(step, slack, out=step)
        counts += step if residual > 0 else -step
    residual = total - int(counts.sum())
    if residual:  # only reachable if the bounds cannot hold the total: widen the top
        counts[int(np.argmax(counts))] += residual


def _row_counts(spec: TableSpec, lookups: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Access count of each unique row read in the batch (sums to ``lookups``)."""
    hist = np.asarray(spec.access_hist, dtype=np.float64)
    if hist.sum() <= 0:
        hist = np.asarray(NO_REUSE_HIST, dtype=np.float64)
    hist = hist / hist.sum()
    unique = max(1, round(lookups / float(hist @ BIN_MEAN_COUNT)))
    if unique >= min(spec.rows, lookups):
        # Clipped: every row (or one row per lookup) is read; spread the lookups.
        unique = min(spec.rows, lookups)
        weights = rng.random(unique) + 0.5
        return 1 + _largest_remainder(lookups - unique, weights)
    per_bin = _largest_remainder(unique, hist)
    bins = np.repeat(np.arange(NUM_BINS), per_bin)
    lo, hi = _LO[bins], _HI[bins]
    draw = np.exp(np.log(lo) + rng.random(bins.size) * (np.log(hi + 1) - np.log(lo)))
    counts: npt.NDArray[np.int64] = np.clip(np.floor(draw).astype(np.int64), lo, hi)
    top = hi.copy()
    top[bins == NUM_BINS - 1] = max(lookups, int(_HI[-1]))  # the open bin may grow
    _fix_total(counts, lo, top, lookups, rng)
    return counts


def _lengths(batch_size: int, lookups: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Per-sample lookups summing to ``lookups``: some samples empty, the others
    1 + a multinomial over exponential weights (a geometric-like spread)."""
    lengths = np.zeros(batch_size, dtype=np.int64)
    if lookups == 0:
        return lengths
    filled = min(lookups, max(1, round((1.0 - EMPTY_SHARE) * batch_size)))
    if lookups < batch_size:
        filled = min(filled, lookups)
    samples = rng.choice(batch_size, size=filled, replace=False)
    weights = rng.exponential(size=filled)
    lengths[samples] = 1 + _largest_remainder(lookups - filled, weights)
    return lengths


def stream_from_spec(
    spec: TableSpec, batch_size: int, seed: int, cols: int | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One batch for ``spec``: (lengths [batch_size], indices [sum of lengths]).

    Deterministic in (spec, batch_size, seed). ``cols`` (a column shard's width) does
    not change the stream: every column shard of a table reads the same rows, as
    TorchRec's column-wise sharding does; it is accepted so callers can pass a shard.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if cols is not None and not 0 < cols <= spec.dim:
        raise ValueError(f"cols {cols} must be in 1..{spec.dim} for table {spec.name!r}")
    rng = np.random.default_rng([seed, *spec.name.encode()])
    lookups = round(spec.pooling_factor * batch_size)
    if lookups == 0:
        return np.zeros(batch_size, dtype=np.int64), np.zeros(0, dtype=np.int64)
    counts = _row_counts(spec, lookups, rng)
    ids = rng.choice(spec.rows, size=counts.size, replace=False).astype(np.int64)
    indices = np.repeat(ids, counts)
    rng.shuffle(indices)
    return _lengths(batch_size, lookups, rng), indices

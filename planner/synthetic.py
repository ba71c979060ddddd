"""Seeded generator of DLRM-like embedding tables and their lookup streams (docs/design.md §4).

Each table gets a hash size, a width, a pooling factor (mean lookups per sample, with
zero-length samples) and a Zipf-like skew. Its batch is drawn from those: per-sample
lengths, then row *ranks* from a bounded power law (closed-form inverse CDF, so 887 M
draws take seconds, not a searchsorted over huge CDFs), then rows = an affine
bijection of ranks, so a table's hot rows are scattered rather than 0, 1, 2, ….

The hyper-parameters of the per-table distributions were fitted by
``scripts/calibrate_generator.py`` so that the *aggregate* statistics of 856 tables at
batch 65536 match Meta's open DLRM dataset file ``2021/fbgemm_t856_bs65536.pt``
(:func:`published_stats`). Per-table values are quasi-random (a seed-shifted
low-discrepancy sequence): any prefix of tables covers the distributions evenly, so
the aggregate is close to its expectation for every seed instead of hanging on a few
heavy-tail draws.

Everything derives from ``(seed, table_index)`` through :class:`numpy.random.SeedSequence`
spawn keys: a table's parameters and stream are the same whether it is generated
alone or with others, so the profiler can regenerate any one table later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import numpy.typing as npt

from shardwise.planner.tables import TableSpec
from shardwise.planner.trace import (
    TableMeasure,
    Trace,
    measure_counts,
    spec_from_measure,
    summarize,
    trace_from_streams,
)

#: The published figures the generator is calibrated against: the 856-table file of
#: Meta's open DLRM dataset, shipped as package data (a copy of the team's
#: ``shared/data/dlrm_locality_stats.json``; a test checks the two agree).
STATS_FILE = Path(__file__).with_name("data") / "dlrm_locality_stats.json"
DLRM_T856_DATASET = "2021/fbgemm_t856_bs65536.pt"


def published_stats(dataset: str = DLRM_T856_DATASET) -> dict[str, Any]:
    """One dataset's published aggregate statistics (batch size, totals, histograms)."""
    entry: dict[str, Any] = json.loads(STATS_FILE.read_text())["datasets"][dataset]
    return entry


DLRM_T856_TABLES = 856

# Fixed choices (not fitted). The stats carry no widths: widths are uniform over the
# usual DLRM sizes. Row counts span a tiny categorical feature to a 20 M-id hash; the
# share of zero-length samples is uniform in [0, ZERO_FRACTION_MAX] (raised where
# needed so that non-empty samples average >= 1 lookup); it does not change the
# aggregate statistics, only how a table's lookups spread over samples.
DIMS: tuple[int, ...] = (16, 32, 64, 128)
#: Widths are halved (down to DIMS[0]) until a table's fp32 weights fit this, so that
#: every generated table fits one 4 GiB GPU after the default 15% reserve.
MAX_TABLE_BYTES = 2 * 2**30
ROWS_MIN = 2
ROWS_MAX = 20_000_000
POOLING_MIN = 0.01
POOLING_MAX = 200.0
SKEW_MAX = 2.0
ZERO_FRACTION_MAX = 0.5


@dataclass(frozen=True)
class GeneratorConfig:
    """Hyper-parameters of the per-table distributions.

    log10(rows) ~ Normal, clipped to [ROWS_MIN, ROWS_MAX]; ln(pooling factor) ~ Normal,
    clipped to [POOLING_MIN, POOLING_MAX]; skew ~ Normal clipped to [0, SKEW_MAX]. Pooling
    and skew are correlated with log10(rows) (big hashes tend to be the long id lists).
    ``head_offset`` is the Zipf-Mandelbrot q of every table: without it the hottest rows
    take too much (22 % of all lookups on rows read > 32768 times, against 1.9 %).
    """

    log10_rows_mean: float
    log10_rows_sd: float
    log_pooling_mean: float
    log_pooling_sd: float
    skew_mean: float
    skew_sd: float
    skew_rows_corr: float
    pooling_rows_corr: float
    head_offset: float


# Fitted by scripts/calibrate_generator.py (856 tables, batch 65536, against
# published_stats()); rerun it and paste its output here if the model changes.
FITTED = GeneratorConfig(
    log10_rows_mean=4.9531,
    log10_rows_sd=0.9060,
    log_pooling_mean=2.1912,
    log_pooling_sd=1.0959,
    skew_mean=0.5945,
    skew_sd=1.0395,
    skew_rows_corr=0.1704,
    pooling_rows_corr=0.4886,
    head_offset=80.3782,
)

# Spawn-key roots: one independent stream per purpose and table.
_PARAMS_KEY = 0
_PERM_KEY = 1
_STREAM_KEY = 2
_QMC_DIMS = 5  # rows, pooling, skew, zero fraction, width


@dataclass(frozen=True)
class TableParams:
    """Everything needed to regenerate one table's stream (with the seed and index)."""

    name: str
    rows: int
    dim: int
    pooling_factor: float
    zero_fraction: float
    skew: float
    dtype: str = "fp32"
    head_offset: float = 0.0  # Zipf-Mandelbrot q: flattens the hottest ranks

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1 or self.dim % 4:
            raise ValueError(f"{self.name}: rows must be >= 1 and dim a positive multiple of 4")
        if not 0 <= self.zero_fraction < 1:
            raise ValueError(f"{self.name}: zero_fraction must be in [0, 1)")
        if self.skew < 0 or not math.isfinite(self.skew):
            raise ValueError(f"{self.name}: skew must be a finite number >= 0")
        if self.head_offset < 0 or not math.isfinite(self.head_offset):
            raise ValueError(f"{self.name}: head_offset must be a finite number >= 0")
        if self.pooling_factor < 0 or not math.isfinite(self.pooling_factor):
            raise ValueError(f"{self.name}: pooling_factor must be a finite number >= 0")
        if 0 < self.pooling_factor < (1 - self.zero_fraction) * (1 - 1e-9):
            raise ValueError(
                f"{self.name}: pooling_factor {self.pooling_factor} is below the share of "
                f"non-empty samples {1 - self.zero_fraction}; raise zero_fraction"
            )

    @property
    def mean_nonzero_length(self) -> float:
        """Mean lookups of a non-empty sample."""
        return max(self.pooling_factor / (1 - self.zero_fraction), 1.0)


# --------------------------------------------------------------------------- parameters


def _qmc_directions(dims: int) -> npt.NDArray[np.float64]:
    """Roberts' R_d sequence steps: powers of 1/phi_d, phi_d the root of x^(d+1) = x + 1."""
    phi = 2.0
    for _ in range(64):
        phi = (1 + phi) ** (1 / (dims + 1))
    return np.array([(1 / phi) ** (j + 1) % 1 for j in range(dims)])


def _uniforms(count: int, seed: int) -> npt.NDArray[np.float64]:
    """[count, _QMC_DIMS] low-discrepancy points in (0, 1), shifted by the seed."""
    shift = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_PARAMS_KEY,)))
    k = np.arange(1, count + 1, dtype=np.float64)[:, None]
    u = (shift.random(_QMC_DIMS)[None, :] + k * _qmc_directions(_QMC_DIMS)[None, :]) % 1.0
    return np.clip(u, 1e-9, 1 - 1e-9)


def _correlated(
    base: npt.NDArray[np.float64], own: npt.NDArray[np.float64], rho: float
) -> npt.NDArray[np.float64]:
    """A standard normal with correlation ``rho`` to ``base`` (both standard normals)."""
    out: npt.NDArray[np.float64] = rho * base + math.sqrt(max(1 - rho * rho, 0.0)) * own
    return out


def draw_params(count: int, seed: int, config: GeneratorConfig = FITTED) -> list[TableParams]:
    """Parameters of ``count`` tables; table k's depend only on (seed, k, config)."""
    if count < 1:
        raise ValueError("count must be >= 1")
    if seed < 0:
        raise ValueError("seed must be >= 0")
    u = _uniforms(count, seed)
    normal = NormalDist()
    z = np.vectorize(normal.inv_cdf)(u[:, :3])
    log_rows = config.log10_rows_mean + config.log10_rows_sd * z[:, 0]
    rows = np.clip(np.rint(10.0**log_rows), ROWS_MIN, ROWS_MAX).astype(np.int64)
    z_pool = _correlated(z[:, 0], z[:, 1], config.pooling_rows_corr)
    pooling = np.clip(
        np.exp(config.log_pooling_mean + config.log_pooling_sd * z_pool),
        POOLING_MIN,
        POOLING_MAX,
    )
    z_skew = _correlated(z[:, 0], z[:, 2], config.skew_rows_corr)
    skew = np.clip(config.skew_mean + config.skew_sd * z_skew, 0.0, SKEW_MAX)
    zero = np.maximum(ZERO_FRACTION_MAX * u[:, 3], 1 - pooling)
    dims = np.asarray(DIMS)[np.minimum((u[:, 4] * len(DIMS)).astype(np.int64), len(DIMS) - 1)]
    while np.any(too_big := (rows * dims * 4 > MAX_TABLE_BYTES) & (dims > DIMS[0])):
        dims[too_big] //= 2
    width = max(4, len(str(count - 1)))
    return [
        TableParams(
            name=f"table_{k:0{width}d}",
            rows=int(rows[k]),
            dim=int(dims[k]),
            pooling_factor=float(pooling[k]),
            zero_fraction=float(zero[k]),
            skew=float(skew[k]),
            head_offset=config.head_offset,
        )
        for k in range(count)
    ]


# --------------------------------------------------------------------------- streams


def _stream_rng(seed: int, table_index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STREAM_KEY, table_index)))


def _permutation(rows: int, seed: int, table_index: int) -> tuple[int, int]:
    """(a, b) of the bijection rank -> (a·rank + b) mod rows; independent of batch size."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_PERM_KEY, table_index)))
    if rows == 1:
        return 1, 0
    while True:
        a = int(rng.integers(1, rows))
        if math.gcd(a, rows) == 1:
            return a, int(rng.integers(0, rows))


def sample_lengths(
    p: TableParams, batch_size: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    """Lookups per sample: 0 with probability zero_fraction, else geometric (mean >= 1)."""
    empty = rng.random(batch_size) < p.zero_fraction
    if p.pooling_factor == 0:
        return np.zeros(batch_size, dtype=np.int64)
    lengths = rng.geometric(1.0 / p.mean_nonzero_length, batch_size).astype(np.int64)
    lengths[empty] = 0
    return lengths


def sample_ranks(
    n: int, rows: int, skew: float, rng: np.random.Generator, head_offset: float = 0.0
) -> npt.NDArray[np.int64]:
    """``n`` popularity ranks in [0, rows) with P(rank) ≈ ∝ (rank + 1 + head_offset)^-skew.

    Inverse CDF of the continuous (Zipf-Mandelbrot) power law on x in [q + 1,
    rows + q + 1), rank = floor(x - q - 1): exact, vectorized, and constant time per
    draw whatever the table size.
    """
    q1 = head_offset + 1.0
    x = rng.random(n)
    e = 1.0 - skew
    log_top = math.log((rows + q1) / q1)
    if abs(e * log_top) < 1e-12:  # skew == 1: log-uniform
        x *= log_top
    else:
        x *= math.expm1(e * log_top)
        np.log1p(x, out=x)
        x *= 1.0 / e
    np.exp(x, out=x)
    if head_offset:
        x *= q1
        x -= head_offset
    ranks = x.astype(np.int64)
    ranks -= 1
    np.clip(ranks, 0, rows - 1, out=ranks)
    return ranks


def _lengths_and_ranks(
    p: TableParams, batch_size: int, seed: int, table_index: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    rng = _stream_rng(seed, table_index)
    lengths = sample_lengths(p, batch_size, rng)
    return lengths, sample_ranks(int(lengths.sum()), p.rows, p.skew, rng, p.head_offset)


def table_stream(
    p: TableParams, batch_size: int, seed: int, table_index: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One table's batch: (lengths [batch_size], indices [sum of lengths])."""
    lengths, ranks = _lengths_and_ranks(p, batch_size, seed, table_index)
    a, b = _permutation(p.rows, seed, table_index)
    ranks *= a
    ranks += b
    ranks %= p.rows
    return lengths, ranks


def table_counts(
    p: TableParams, batch_size: int, seed: int, table_index: int
) -> npt.NDArray[np.int64]:
    """Accesses of each row (length ``p.rows``) in the table's batch; equals
    ``bincount`` of :func:`table_stream`'s indices, computed from ranks (cheaper)."""
    _, ranks = _lengths_and_ranks(p, batch_size, seed, table_index)
    by_rank = np.bincount(ranks)
    a, b = _permutation(p.rows, seed, table_index)
    counts = np.zeros(p.rows, dtype=np.int64)
    counts[(a * np.arange(by_rank.size, dtype=np.int64) + b) % p.rows] = by_rank
    return counts


def measure_table(p: TableParams, batch_size: int, seed: int, table_index: int) -> TableMeasure:
    """The table's measured batch statistics (histograms ignore row labels, so ranks do)."""
    _, ranks = _lengths_and_ranks(p, batch_size, seed, table_index)
    return measure_counts(np.bincount(ranks), batch_size)


def measure_tables(
    params: Sequence[TableParams],
    batch_size: int,
    seed: int,
    on_table: Callable[[], None] | None = None,
) -> Iterator[TableMeasure]:
    """:func:`measure_table` of each table in turn; one table's lookups in memory at a time."""
    for k, p in enumerate(params):
        m = measure_table(p, batch_size, seed, k)
        if on_table is not None:
            on_table()
        yield m


# --------------------------------------------------------------------------- public entry points


def generate_trace(params: Sequence[TableParams], batch_size: int, seed: int) -> Trace:
    """The full trace (docs/design.md §4 layout) of the tables; holds every lookup in memory."""
    streams = [table_stream(p, batch_size, seed, k) for k, p in enumerate(params)]
    return trace_from_streams([s[0] for s in streams], [s[1] for s in streams])


def generate_tables(
    count: int,
    seed: int,
    batch_size: int = 65536,
    on_table: Callable[[], None] | None = None,
    config: GeneratorConfig = FITTED,
) -> list[TableSpec]:
    """Specs whose pooling factor and access histogram are measured from each table's
    generated batch, exactly as ``tables from-trace`` measures a real trace."""
    params = draw_params(count, seed, config)
    return [
        spec_from_measure(m, name=p.name, dim=p.dim, rows=p.rows, dtype=p.dtype)
        for p, m in zip(params, measure_tables(params, batch_size, seed, on_table), strict=True)
    ]


def aggregate_stats(
    params: Sequence[TableParams],
    batch_size: int,
    seed: int,
    on_table: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Statistics of all tables' batches together, keyed like ``dlrm_locality_stats.json``."""
    return summarize(measure_tables(params, batch_size, seed, on_table))

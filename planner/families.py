"""Table families beyond the calibrated generator: a broad one to pre-train on, a
held-out one to judge the bundled cost model on (docs/design.md §7), a heavy one to
benchmark plans of big, heavily read tables on (docs/design.md §9, §14), and an
industrial one whose giant tables no GPU of a benchmark task holds whole.

The calibrated generator (:mod:`shardwise.planner.synthetic`) matches Meta's open DLRM
aggregate statistics, so a model trained only on it knows one neighbourhood of tables.

*broad* (pre-training): everything a user may bring, evenly.
    - rows log-uniform on [1e2, 1e8];
    - width a multiple of 4, discrete log-uniform on 4..256;
    - pooling factor (mean lookups per sample, empty samples included) log-uniform on
      [1, 200], with a share of zero-length samples uniform on [0, 0.5];
    - skew uniform on [0, 2] (0: uniform access, 2: heavy Zipf), with a
      Zipf-Mandelbrot head offset of 0 or log-uniform on [1, 100];
    - fp32 or fp16, even odds.
    Streams are the generator's (geometric lengths, power-law ranks), so each spec's
    pooling factor and histogram are measured from a batch, as the generator does.

*heldout* (judging only; never trained on): built differently from both, so that a
model cannot score by having memorized either generator's shapes.
    - rows a mixture: a third categorical (log-uniform on [10, 3000]), the rest hashed
      (log10 rows normal, mean 5.3, sd 0.8, clipped to [1e3, 2e7]);
    - width from (8, 24, 48, 96, 192): not powers of two;
    - lengths Poisson (multi-hot features), not geometric, with a Gamma(0.8, 15)
      rate clipped to [0.2, 120] and a share of empty samples uniform on [0, 0.3];
    - popularity log-normal (row weight exp(sigma·Z), sigma uniform on [0.3, 3]), not
      a power law: the head and tail shapes differ from every Zipf.
    :data:`HELDOUT_SEED` is the seed of the committed held-out set.

*heavy* (benchmarking whole plans at scale, docs/bench.md): big, heavily read tables
outside both generators' laws, the kind of job on which a model's per-rank errors
decide the plan (docs/design.md §14).
    - weights log-uniform on [1 MiB, 1 GiB] (never above 1 GiB), fp32 or fp16 even
      odds; rows follow from the bytes and the width;
    - width a multiple of 4, log-uniform on 8..256 (not only powers of two);
    - pooling factor log-normal (median 8, sigma 1.2: a heavy right tail) clipped to
      [0.5, 100]; lengths negative binomial (dispersion log-uniform on [0.5, 20]) with
      a share of forced-empty samples uniform on [0, 0.4] on top of the NB's own zeros;
    - popularity a *discrete* bounded Zipf law, P(rank k) ∝ (k + 1)^-s with s uniform
      on [0.3, 1.6] per table: exact inverse CDF over the first 16,384 ranks, the
      tail by the closed-form inverse CDF of the continuous law on
      [H + 1/2, rows + 1/2) rounded to ranks, so no table materializes more than
      16,384 weights. Hot rows need no scattering here: a spec holds no row
      identities (histograms ignore labels), and the streams made from a spec
      (:func:`shardwise.planner.streams.stream_from_spec`) scatter them.
    A batch whose mean length lands above 100 (small histogram batches only) is
    scaled down to 100, so every spec's measured pooling factor is at most 100.

*industrial* (benchmarking plans with tables no GPU holds, docs/bench.md): a few giant
id tables among many ordinary feature tables, by laws of neither generator nor of the
families above. Whether a giant is larger than a GPU is the task's memory setting
(the bench sizes GPUs by the tasks' total, docs/bench.md), so the laws are in bytes:
    - each table is giant with probability 0.12 (its own draw): weights log-uniform on
      [256 MiB, 1 GiB], width a multiple of 32 on 64..256; the others log-normal
      weights (median 2 MiB, sigma 1.5) clipped to [64 KiB, 128 MiB], width from
      (8, 16, 32, 48, 64, 128); fp16 or fp32, even odds; rows follow from the bytes;
    - pooling factor: giants log-uniform on [1, 20] (ids and short histories), the
      others log-normal (median 4, sigma 1) clipped to [0.3, 50];
    - lengths *bounded multi-hot*: a share of empty samples uniform on [0, 0.3], the
      others Binomial(L, m / L) with the cap L = max(1, ceil(2m)) for a mean m (a
      history truncated at L ids), not geometric, Poisson or negative binomial;
    - popularity *hot/cold*: a hot set of a share of the rows (log-uniform on
      [1e-4, 1e-2] for giants, [1e-3, 5e-2] for the others) receives a share of the
      lookups uniform on [0.3, 0.9], uniformly; the other rows the rest, uniformly:
      two flat regimes, no power law.

Table ``k`` of a family depends only on ``(seed, k)`` (:class:`numpy.random.SeedSequence`
spawn keys), so a prefix of a larger draw is the smaller draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from shardwise.basics import UserError
from shardwise.planner import synthetic
from shardwise.planner.tables import TableSpec
from shardwise.planner.trace import measure_counts, spec_from_measure

Family = Literal["calibrated", "broad", "heldout", "heavy", "industrial"]
FAMILIES: tuple[str, ...] = get_args(Family)
#: The seed of the held-out family the bundled model is judged on
#: (benchmarks/bundled_model_heldout.py, `make pretrain`).
HELDOUT_SEED = 2027

BROAD_ROWS = (1e2, 1e8)
BROAD_DIM_STEPS = 64  # widths 4 × 1..64 = 4..256
BROAD_POOLING = (1.0, 200.0)
BROAD_ZERO_MAX = 0.5
BROAD_SKEW_MAX = 2.0
BROAD_HEAD_OFFSET_MAX = 100.0

HELDOUT_DIMS: tuple[int, ...] = (8, 24, 48, 96, 192)
HELDOUT_ROWS_MAX = 20_000_000
HELDOUT_POOLING = (0.2, 120.0)
HELDOUT_ZERO_MAX = 0.3
HELDOUT_SIGMA = (0.3, 3.0)

HEAVY_BYTES = (2**20, 2**30)
HEAVY_DIMS = (8, 256)
HEAVY_POOLING_MEDIAN = 8.0
HEAVY_POOLING_SIGMA = 1.2
HEAVY_POOLING = (0.5, 100.0)
HEAVY_ZERO_MAX = 0.4
HEAVY_DISPERSION = (0.5, 20.0)
HEAVY_SKEW = (0.3, 1.6)
#: Ranks drawn exactly from the discrete law; the tail uses the continuous closed form.
HEAVY_HEAD = 1 << 14

INDUSTRIAL_GIANT_SHARE = 0.12
INDUSTRIAL_GIANT_BYTES = (2**28, 2**30)
INDUSTRIAL_GIANT_DIMS = (64, 256)  # multiples of 32
INDUSTRIAL_BYTES_MEDIAN = 2 * 2**20
INDUSTRIAL_BYTES_SIGMA = 1.5
INDUSTRIAL_BYTES = (2**16, 2**27)
INDUSTRIAL_DIMS: tuple[int, ...] = (8, 16, 32, 48, 64, 128)
INDUSTRIAL_GIANT_POOLING = (1.0, 20.0)
INDUSTRIAL_POOLING_MEDIAN = 4.0
INDUSTRIAL_POOLING_SIGMA = 1.0
INDUSTRIAL_POOLING = (0.3, 50.0)
INDUSTRIAL_EMPTY_MAX = 0.3
INDUSTRIAL_GIANT_HOT_ROWS = (1e-4, 1e-2)
INDUSTRIAL_HOT_ROWS = (1e-3, 5e-2)
INDUSTRIAL_HOT_SHARE = (0.3, 0.9)

# Spawn-key roots, apart from the generator's (0..2) so no stream is shared with it.
_BROAD_KEY = 21
_HELDOUT_KEY = 22
_HELDOUT_STREAM_KEY = 23
_HEAVY_KEY = 31
_HEAVY_STREAM_KEY = 32
_INDUSTRIAL_KEY = 41
_INDUSTRIAL_STREAM_KEY = 42
#: The broad family reuses the generator's streams under this seed offset, so broad
#: table k and calibrated table k of the same seed never share a stream.
_BROAD_STREAM_OFFSET = 1 << 40


def _rng(seed: int, *key: int) -> np.random.Generator:
    if seed < 0:
        raise UserError(f"--seed must be >= 0, got {seed}.")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _names(prefix: str, count: int) -> list[str]:
    width = max(4, len(str(count - 1)))
    return [f"{prefix}_{k:0{width}d}" for k in range(count)]


# --------------------------------------------------------------------------- broad


def broad_params(count: int, seed: int) -> list[synthetic.TableParams]:
    """Parameters of ``count`` broad tables (distributions in the module docstring)."""
    if count < 1:
        raise UserError(f"--count must be >= 1, got {count}.")
    out = []
    for k, name in enumerate(_names("broad", count)):
        rng = _rng(seed, _BROAD_KEY, k)
        u = rng.random(8)
        lo, hi = (math.log10(x) for x in BROAD_ROWS)
        rows = round(10 ** (lo + (hi - lo) * u[0]))
        # Discrete log-uniform on 1..steps (as the comm sampler's widths).
        step = min(int((BROAD_DIM_STEPS + 1) ** u[1]), BROAD_DIM_STEPS)
        pooling = math.exp(math.log(BROAD_POOLING[0]) + math.log(BROAD_POOLING[1]) * u[2])
        head = 0.0 if u[5] < 0.5 else 10 ** (math.log10(BROAD_HEAD_OFFSET_MAX) * u[6])
        out.append(
            synthetic.TableParams(
                name=name,
                rows=rows,
                dim=4 * max(step, 1),
                pooling_factor=pooling,
                zero_fraction=BROAD_ZERO_MAX * float(u[3]),
                skew=BROAD_SKEW_MAX * float(u[4]),
                dtype="fp16" if u[7] < 0.5 else "fp32",
                head_offset=head,
            )
        )
    return out


def broad_tables(
    count: int, seed: int, batch_size: int = 65536, on_table: Callable[[], None] | None = None
) -> list[TableSpec]:
    """Broad specs, each pooling factor and histogram measured on a generated batch."""
    params = broad_params(count, seed)
    measures = synthetic.measure_tables(params, batch_size, seed + _BROAD_STREAM_OFFSET, on_table)
    return [
        spec_from_measure(m, name=p.name, dim=p.dim, rows=p.rows, dtype=p.dtype)
        for p, m in zip(params, measures, strict=True)
    ]


# --------------------------------------------------------------------------- held-out


def _heldout_table(name: str, seed: int, k: int, batch_size: int) -> TableSpec:
    rng = _rng(seed, _HELDOUT_KEY, k)
    if rng.random() < 1 / 3:
        rows = round(10 ** rng.uniform(1.0, math.log10(3000)))
    else:
        rows = int(np.clip(round(10 ** rng.normal(5.3, 0.8)), 1000, HELDOUT_ROWS_MAX))
    dim = HELDOUT_DIMS[int(rng.integers(len(HELDOUT_DIMS)))]
    rate = float(np.clip(rng.gamma(0.8, 15.0), *HELDOUT_POOLING))
    zero = rng.uniform(0.0, HELDOUT_ZERO_MAX)
    sigma = rng.uniform(*HELDOUT_SIGMA)
    dtype = "fp16" if rng.random() < 0.3 else "fp32"

    stream = _rng(seed, _HELDOUT_STREAM_KEY, k)
    lengths = stream.poisson(rate, batch_size)
    lengths[stream.random(batch_size) < zero] = 0
    lookups = int(lengths.sum())
    # Log-normal popularity: cumulative weights, then inverse-CDF draws (exact, O(n log r)).
    cdf = np.cumsum(np.exp(sigma * stream.standard_normal(rows)))
    cdf /= cdf[-1]
    draws = np.searchsorted(cdf, stream.random(lookups), side="right")
    counts = np.bincount(np.minimum(draws, rows - 1), minlength=rows)
    return spec_from_measure(
        measure_counts(counts, batch_size), name=name, dim=dim, rows=rows, dtype=dtype
    )


def heldout_tables(
    count: int,
    seed: int = HELDOUT_SEED,
    batch_size: int = 65536,
    on_table: Callable[[], None] | None = None,
) -> list[TableSpec]:
    """Held-out specs (construction in the module docstring), measured on a batch."""
    return _drawn("heldout", _heldout_table, count, seed, batch_size, on_table)


def _drawn(
    prefix: str,
    one: Callable[[str, int, int, int], TableSpec],
    count: int,
    seed: int,
    batch_size: int,
    on_table: Callable[[], None] | None,
) -> list[TableSpec]:
    """``count`` tables ``one(name, seed, k, batch_size)``, named ``<prefix>_<k>``."""
    if count < 1:
        raise UserError(f"--count must be >= 1, got {count}.")
    out = []
    for k, name in enumerate(_names(prefix, count)):
        out.append(one(name, seed, k, batch_size))
        if on_table is not None:
            on_table()
    return out


# --------------------------------------------------------------------------- heavy


def zipf_counts(
    n: int, rows: int, skew: float, rng: np.random.Generator, head: int = HEAVY_HEAD
) -> npt.NDArray[np.int64]:
    """Access counts of the rows read by ``n`` draws from the bounded discrete Zipf law
    P(k) ∝ (k + 1)^-skew on ranks [0, rows), in no particular row order (only the
    counts matter to a histogram). Exact on the first ``head`` ranks; beyond them the
    continuous law on [head + 1/2, rows + 1/2) by its closed-form inverse CDF, rounded
    (the midpoint rule: the tail's mass is within O(head^-skew-1) of the sum's)."""
    h = min(head, rows)
    weights = np.arange(1, h + 1, dtype=np.float64) ** -skew
    head_mass = float(weights.sum())
    lo, hi = h + 0.5, rows + 0.5
    e = 1.0 - skew
    if rows <= h:
        tail_mass = 0.0
    elif abs(e) < 1e-9:
        tail_mass = math.log(hi / lo)
    else:
        tail_mass = (hi**e - lo**e) / e
    n_tail = int(rng.binomial(n, tail_mass / (head_mass + tail_mass))) if tail_mass else 0
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    head_ranks = np.searchsorted(cdf, rng.random(n - n_tail), side="right")
    counts = np.bincount(np.minimum(head_ranks, h - 1), minlength=h)
    if n_tail:
        u = rng.random(n_tail)
        if abs(e) < 1e-9:
            x = lo * np.exp(u * math.log(hi / lo))
        else:
            x = (lo**e + u * (hi**e - lo**e)) ** (1.0 / e)
        tail = np.clip(np.floor(x + 0.5).astype(np.int64), h + 1, rows) - 1
        counts = np.concatenate([counts, np.unique(tail, return_counts=True)[1]])
    return counts


def _heavy_table(name: str, seed: int, k: int, batch_size: int) -> TableSpec:
    rng = _rng(seed, _HEAVY_KEY, k)
    dtype = "fp16" if rng.random() < 0.5 else "fp32"
    lo, hi = (math.log(x) for x in HEAVY_DIMS)
    dim = int(np.clip(4 * round(math.exp(rng.uniform(lo, hi)) / 4), *HEAVY_DIMS))
    lo, hi = (math.log(x) for x in HEAVY_BYTES)
    size = math.exp(rng.uniform(lo, hi))
    rows = max(int(min(size, HEAVY_BYTES[1]) // (dim * (2 if dtype == "fp16" else 4))), 1)
    pooling = float(
        np.clip(HEAVY_POOLING_MEDIAN * math.exp(HEAVY_POOLING_SIGMA * rng.normal()), *HEAVY_POOLING)
    )
    zero = rng.uniform(0.0, HEAVY_ZERO_MAX)
    lo, hi = (math.log(x) for x in HEAVY_DISPERSION)
    dispersion = math.exp(rng.uniform(lo, hi))
    skew = rng.uniform(*HEAVY_SKEW)

    stream = _rng(seed, _HEAVY_STREAM_KEY, k)
    mean = pooling / (1.0 - zero)  # of the samples not forced empty
    lengths = stream.negative_binomial(dispersion, dispersion / (dispersion + mean), batch_size)
    lengths[stream.random(batch_size) < zero] = 0
    most = int(HEAVY_POOLING[1] * batch_size)
    if int(lengths.sum()) > most:  # keep the measured pooling factor within the bound
        lengths = lengths * most // int(lengths.sum())
    counts = zipf_counts(int(lengths.sum()), rows, skew, stream)
    return spec_from_measure(
        measure_counts(counts, batch_size), name=name, dim=dim, rows=rows, dtype=dtype
    )


def heavy_tables(
    count: int,
    seed: int,
    batch_size: int = 65536,
    on_table: Callable[[], None] | None = None,
) -> list[TableSpec]:
    """Heavy specs (construction in the module docstring), measured on a batch."""
    return _drawn("heavy", _heavy_table, count, seed, batch_size, on_table)


# --------------------------------------------------------------------------- industrial


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def hot_cold_counts(
    n: int, rows: int, hot_rows: int, hot_share: float, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    """Access counts of the rows read by ``n`` draws: each draw lands in the first
    ``hot_rows`` rows with probability ``hot_share`` (uniformly among them), else
    uniformly in the others; in no particular row order (a histogram ignores labels)."""
    hot_rows = min(max(hot_rows, 1), rows)
    cold_rows = rows - hot_rows
    n_hot = n if cold_rows == 0 else int(rng.binomial(n, hot_share))
    counts = np.bincount(rng.integers(hot_rows, size=n_hot), minlength=hot_rows)
    if n - n_hot:
        cold = np.unique(rng.integers(cold_rows, size=n - n_hot), return_counts=True)[1]
        counts = np.concatenate([counts, cold])
    return counts.astype(np.int64)


def bounded_lengths(
    pooling: float, empty: float, batch_size: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    """Bounded multi-hot lengths of ``batch_size`` samples (module docstring): a share
    ``empty`` of them empty, the others Binomial(L, m / L) with ``m = pooling / (1 -
    empty)`` and the cap ``L = max(1, ceil(2m))``, so the mean is ``pooling``."""
    mean = pooling / (1.0 - empty)  # of the samples not empty
    cap = max(1, math.ceil(2 * mean))
    lengths = rng.binomial(cap, min(mean / cap, 1.0), batch_size).astype(np.int64)
    lengths[rng.random(batch_size) < empty] = 0
    return lengths


def _industrial_table(name: str, seed: int, k: int, batch_size: int) -> TableSpec:
    rng = _rng(seed, _INDUSTRIAL_KEY, k)
    giant = rng.random() < INDUSTRIAL_GIANT_SHARE
    dtype = "fp16" if rng.random() < 0.5 else "fp32"
    if giant:
        size = _log_uniform(rng, *INDUSTRIAL_GIANT_BYTES)
        lo, hi = INDUSTRIAL_GIANT_DIMS
        dim = 32 * int(rng.integers(lo // 32, hi // 32 + 1))
        pooling = _log_uniform(rng, *INDUSTRIAL_GIANT_POOLING)
        hot_rows = _log_uniform(rng, *INDUSTRIAL_GIANT_HOT_ROWS)
    else:
        size = INDUSTRIAL_BYTES_MEDIAN * math.exp(INDUSTRIAL_BYTES_SIGMA * rng.normal())
        size = float(np.clip(size, *INDUSTRIAL_BYTES))
        dim = INDUSTRIAL_DIMS[int(rng.integers(len(INDUSTRIAL_DIMS)))]
        pooling = INDUSTRIAL_POOLING_MEDIAN * math.exp(INDUSTRIAL_POOLING_SIGMA * rng.normal())
        pooling = float(np.clip(pooling, *INDUSTRIAL_POOLING))
        hot_rows = _log_uniform(rng, *INDUSTRIAL_HOT_ROWS)
    rows = max(int(size // (dim * (2 if dtype == "fp16" else 4))), 1)
    empty = rng.uniform(0.0, INDUSTRIAL_EMPTY_MAX)
    hot_share = rng.uniform(*INDUSTRIAL_HOT_SHARE)

    stream = _rng(seed, _INDUSTRIAL_STREAM_KEY, k)
    lengths = bounded_lengths(pooling, empty, batch_size, stream)
    counts = hot_cold_counts(int(lengths.sum()), rows, round(hot_rows * rows), hot_share, stream)
    return spec_from_measure(
        measure_counts(counts, batch_size), name=name, dim=dim, rows=rows, dtype=dtype
    )


def industrial_tables(
    count: int,
    seed: int,
    batch_size: int = 65536,
    on_table: Callable[[], None] | None = None,
) -> list[TableSpec]:
    """Industrial specs (construction in the module docstring), measured on a batch."""
    return _drawn("industrial", _industrial_table, count, seed, batch_size, on_table)


# --------------------------------------------------------------------------- entry points


def generate(
    family: str,
    count: int,
    seed: int,
    batch_size: int = 65536,
    on_table: Callable[[], None] | None = None,
) -> list[TableSpec]:
    """``count`` tables of ``family`` (one of :data:`FAMILIES`)."""
    if family == "calibrated":
        return synthetic.generate_tables(count, seed, batch_size=batch_size, on_table=on_table)
    if family == "broad":
        return broad_tables(count, seed, batch_size, on_table)
    if family == "heldout":
        return heldout_tables(count, seed, batch_size, on_table)
    if family == "heavy":
        return heavy_tables(count, seed, batch_size, on_table)
    if family == "industrial":
        return industrial_tables(count, seed, batch_size, on_table)
    raise UserError(f"--family {family!r} is not one of {', '.join(FAMILIES)}.")


def merge_pools(
    pools: Sequence[Sequence[TableSpec]], max_pooling: float | None = None
) -> list[TableSpec]:
    """The tables of every pool, in order, keeping those read at most ``max_pooling``
    times per sample (the light tables that large profiling batches pair with).

    Names must be unique across pools: the cost dataset splits train and test by name.
    """
    merged: list[TableSpec] = []
    seen: set[str] = set()
    for pool in pools:
        for t in pool:
            if t.name in seen:
                raise UserError(
                    f"table {t.name!r} is in more than one file; merged pools need unique "
                    "names (generate the families with different prefixes)."
                )
            seen.add(t.name)
            if max_pooling is None or t.pooling_factor <= max_pooling:
                merged.append(t)
    if not merged:
        raise UserError(f"no table has a pooling factor <= --max-pooling {max_pooling}; raise it.")
    return merged

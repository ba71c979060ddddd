"""Index/offset traces in the layout of Meta's open DLRM dataset (docs/design.md §4).

A trace is one batch of lookups for ``T`` tables and ``B`` samples: ``lengths`` is
``[T, B]``, ``offsets`` is flat, ``T·B + 1`` long and table-major (table ``t`` uses
``offsets[t·B : (t+1)·B + 1]``), and ``indices`` is flat. On disk it is a gzip'd
``torch.save`` of a dict with those three keys. This module also *measures* a
trace: per-table row counts, the spec they imply and the aggregate statistics in the
form of ``dlrm_locality_stats.json``; the synthetic generator measures its streams
with the same functions, so a generated spec and a spec read from a trace agree.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from pydantic import ValidationError

from shardwise.basics import UserError
from shardwise.planner.access import NUM_BINS, bin_of, normalize
from shardwise.planner.tables import TableSpec

TRACE_KEYS: tuple[str, ...] = ("indices", "offsets", "lengths")
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class Trace:
    """One batch of embedding lookups for every table, all tensors int64."""

    indices: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_tables(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[1])

    def check(self, source: str = "<trace>") -> None:
        """Raise :class:`UserError` naming ``source`` and the first inconsistency."""
        for key in TRACE_KEYS:
            value = getattr(self, key)
            if not isinstance(value, torch.Tensor):
                raise UserError(f"{source}: {key!r} is a {type(value).__name__}, not a tensor.")
            if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
                raise UserError(f"{source}: {key!r} has dtype {value.dtype}; it must be integers.")
        if self.lengths.dim() != 2:
            raise UserError(
                f"{source}: 'lengths' has shape {tuple(self.lengths.shape)}; it must be "
                "[tables, batch size]."
            )
        if self.offsets.dim() != 1 or self.indices.dim() != 1:
            raise UserError(
                f"{source}: 'offsets' and 'indices' must be flat (1-D); their shapes are "
                f"{tuple(self.offsets.shape)} and {tuple(self.indices.shape)}."
            )
        t, b = self.num_tables, self.batch_size
        if self.offsets.numel() != t * b + 1:
            raise UserError(
                f"{source}: 'offsets' has {self.offsets.numel()} entries but 'lengths' is "
                f"[{t}, {b}], so it needs T·B + 1 = {t * b + 1} (table-major, one start per "
                "sample plus the end)."
            )
        if int(self.offsets[0]) != 0:
            raise UserError(f"{source}: 'offsets' starts at {int(self.offsets[0])}, not 0.")
        if int(self.offsets[-1]) != self.indices.numel():
            raise UserError(
                f"{source}: 'offsets' ends at {int(self.offsets[-1])} but there are "
                f"{self.indices.numel()} indices; the last offset must equal their number."
            )
        diffs = self.offsets[1:] - self.offsets[:-1]
        bad = torch.nonzero(diffs < 0)
        if bad.numel():
            i = int(bad[0, 0])
            raise UserError(
                f"{source}: 'offsets' decreases at position {i + 1} (table {i // b}, sample "
                f"{i % b}): {int(self.offsets[i])} then {int(self.offsets[i + 1])}; offsets "
                "must be non-decreasing."
            )
        bad = torch.nonzero(diffs != self.lengths.reshape(-1).to(diffs.dtype))
        if bad.numel():
            i = int(bad[0, 0])
            raise UserError(
                f"{source}: lengths[{i // b}, {i % b}] is {int(self.lengths.reshape(-1)[i])} "
                f"but the offsets give {int(diffs[i])}; 'lengths' must equal the differences "
                "of consecutive offsets."
            )
        if self.indices.numel() and int(self.indices.min()) < 0:
            first = int(torch.nonzero(self.indices < 0)[0, 0])
            table = int(torch.searchsorted(self.offsets, first, right=True)) - 1
            raise UserError(
                f"{source}: index #{first} (table {table // b}) is {int(self.indices[first])}; "
                "row indices must be >= 0."
            )

    def table_indices(self, t: int) -> torch.Tensor:
        """The lookups of table ``t`` for the whole batch (a view, no copy)."""
        if not 0 <= t < self.num_tables:
            raise IndexError(f"table {t} is outside 0..{self.num_tables - 1}")
        b = self.batch_size
        start, end = int(self.offsets[t * b]), int(self.offsets[(t + 1) * b])
        return self.indices[start:end]

    def table_lengths(self, t: int) -> torch.Tensor:
        """Lookups per sample of table ``t``."""
        return self.lengths[t]


def trace_from_streams(
    lengths: Sequence[npt.NDArray[np.int64]], indices: Sequence[npt.NDArray[np.int64]]
) -> Trace:
    """Assemble per-table (lengths, indices) arrays, in table order, into one trace."""
    if len(lengths) != len(indices) or not lengths:
        raise ValueError("need one lengths and one indices array per table, at least one table")
    lens = torch.from_numpy(np.stack([np.asarray(x, dtype=np.int64) for x in lengths]))
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens.reshape(-1), dim=0, out=offsets[1:])
    flat = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in indices]))
    return Trace(indices=flat, offsets=offsets, lengths=lens)


# --------------------------------------------------------------------------- files


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as a gzip'd torch file holding indices, offsets and lengths."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(p, "wb", compresslevel=1) as f:
        torch.save({k: getattr(trace, k) for k in TRACE_KEYS}, f)  # type: ignore[arg-type]


def _torch_load(data: bytes, source: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a bad file; all mean the same
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"{source}: not a torch file of index/offset tensors ({first}). Expected a gzip'd "
            "torch.save of a dict with 'indices', 'offsets' and 'lengths'."
        ) from None


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace file; every problem is a :class:`UserError`.

    The design's layout is gzip'd; a plain (uncompressed) torch file, as Meta's
    dataset ships, is also read. A dict with the three keys or a 3-tuple
    ``(indices, offsets, lengths)`` is accepted.
    """
    p = Path(path)
    source = str(p)
    try:
        with p.open("rb") as f:
            gzipped = f.read(2) == _GZIP_MAGIC
        if gzipped:
            with gzip.open(p, "rb") as g:
                raw = g.read()
        else:
            raw = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{source}: no such trace file.") from None
    except IsADirectoryError:
        raise UserError(f"{source}: is a directory, not a trace file.") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise UserError(f"{source}: a damaged or truncated gzip file ({err}).") from None
    except OSError as err:
        raise UserError(f"{source}: cannot read it ({err.strerror or err}).") from None
    if not gzipped:
        try:
            obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception:  # any failure: it is not a torch file either
            raise UserError(
                f"{source}: not a gzip file (nor a plain torch file). A trace is a gzip'd "
                "torch.save of a dict with 'indices', 'offsets' and 'lengths' (docs/design.md §4)."
            ) from None
    else:
        obj = _torch_load(raw, source)
    if isinstance(obj, (tuple, list)) and len(obj) == len(TRACE_KEYS):
        obj = dict(zip(TRACE_KEYS, obj, strict=True))
    if not isinstance(obj, dict):
        raise UserError(
            f"{source}: holds a {type(obj).__name__}; expected a dict with 'indices', "
            "'offsets' and 'lengths' (or a tuple of those three tensors)."
        )
    missing = [k for k in TRACE_KEYS if k not in obj]
    if missing:
        raise UserError(
            f"{source}: lacks {', '.join(repr(k) for k in missing)}; a trace holds "
            f"'indices', 'offsets' and 'lengths' (it has {', '.join(map(repr, obj)) or 'none'})."
        )
    trace = Trace(**{k: obj[k] for k in TRACE_KEYS})
    trace.check(source)
    trace.indices, trace.offsets, trace.lengths = (
        x.to(torch.int64) for x in (trace.indices, trace.offsets, trace.lengths)
    )
    return trace


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class TableMeasure:
    """What one table's batch says about it: lookups, and rows/indices per access bin."""

    batch_size: int
    num_indices: int
    unique_rows: npt.NDArray[np.int64]  # rows per bin (17)
    index_mass: npt.NDArray[np.int64]  # indices per bin (17)
    max_index: int  # -1 when the table was never read

    @property
    def num_unique(self) -> int:
        return int(self.unique_rows.sum())

    @property
    def pooling_factor(self) -> float:
        """Mean lookups per sample, zero-length samples included."""
        return self.num_indices / self.batch_size

    @property
    def access_hist(self) -> tuple[float, ...]:
        return normalize(self.unique_rows)


def measure_counts(counts: npt.NDArray[np.integer], batch_size: int) -> TableMeasure:
    """Measure a table from its per-row access counts (index = row or any relabelling).

    Equals :func:`~shardwise.planner.access.count_histograms`, but bins the distinct
    count values only (a table of 10 M rows has a few thousand), which is ~10x faster.
    """
    c = np.asarray(counts, dtype=np.int64)
    freq = np.bincount(c)  # freq[v] = rows accessed exactly v times
    values = np.flatnonzero(freq[1:]) + 1
    bins = bin_of(values)
    rows = np.bincount(bins, weights=freq[values], minlength=NUM_BINS)
    mass = np.bincount(bins, weights=freq[values] * values, minlength=NUM_BINS)
    return TableMeasure(
        batch_size=batch_size,
        num_indices=round(float(mass.sum())),
        unique_rows=np.rint(rows).astype(np.int64),
        index_mass=np.rint(mass).astype(np.int64),
        max_index=_last_nonzero(c),
    )


def _last_nonzero(c: npt.NDArray[np.int64]) -> int:
    """Highest index with a non-zero count, -1 if none (O(1) for ``bincount`` output)."""
    if c.size and c[-1]:
        return int(c.size - 1)
    nonzero = np.flatnonzero(c)
    return int(nonzero[-1]) if nonzero.size else -1


def row_counts(trace: Trace, t: int) -> npt.NDArray[np.int64]:
    """Accesses of each row of table ``t`` (length = max index + 1)."""
    idx = trace.table_indices(t)
    return torch.bincount(idx).numpy().astype(np.int64, copy=False)


def per_table_counts(trace: Trace) -> Iterator[npt.NDArray[np.int64]]:
    """:func:`row_counts` of every table in turn (one table in memory at a time)."""
    for t in range(trace.num_tables):
        yield row_counts(trace, t)


def spec_from_measure(
    m: TableMeasure, *, name: str, dim: int, rows: int | None = None, dtype: str = "fp32"
) -> TableSpec:
    """The spec a measured table implies; ``rows`` defaults to max index + 1."""
    if rows is None:
        rows = max(m.max_index + 1, 1)
    elif m.max_index >= rows:
        raise UserError(
            f"table {name!r}: index {m.max_index} is out of range for {rows} rows; "
            "give a larger row count (or none, to use max index + 1)."
        )
    try:
        return TableSpec(
            name=name,
            rows=rows,
            dim=dim,
            pooling_factor=m.pooling_factor,
            access_hist=m.access_hist,
            dtype=dtype,
        )
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
            for e in err.errors()
        )
        raise UserError(f"table {name!r}: {problems}.") from None


def _per_table(value: Any, count: int, what: str) -> list[Any]:
    if value is None or isinstance(value, (int, str)):
        return [value] * count
    items = list(value)
    if len(items) != count:
        raise UserError(f"{len(items)} {what} given for a trace of {count} tables.")
    return items


def specs_from_trace(
    trace: Trace,
    *,
    names: Sequence[str] | None = None,
    dims: int | Sequence[int] = 64,
    rows: Sequence[int] | None = None,
    dtype: str = "fp32",
) -> list[TableSpec]:
    """One spec per table: measured pooling factor and access histogram.

    The trace carries no widths, so ``dims`` is given (one for all, or one per
    table); ``rows`` defaults to each table's max index + 1.
    """
    t = trace.num_tables
    width = len(str(max(t - 1, 0)))
    name_list = (
        [f"table_{i:0{width}d}" for i in range(t)]
        if names is None
        else _per_table(names, t, "names")
    )
    dim_list = _per_table(dims, t, "dims")
    row_list = _per_table(rows, t, "row counts")
    specs = []
    for i, counts in enumerate(per_table_counts(trace)):
        m = measure_counts(counts, trace.batch_size)
        specs.append(
            spec_from_measure(m, name=name_list[i], dim=dim_list[i], rows=row_list[i], dtype=dtype)
        )
    return specs


def summarize(measures: Iterable[TableMeasure]) -> dict[str, Any]:
    """Aggregate statistics with the keys of a ``dlrm_locality_stats.json`` entry.

    Histograms pool every table's rows (and indices) before normalizing, as the
    published figures do.
    """
    rows = np.zeros(NUM_BINS, dtype=np.int64)
    mass = np.zeros(NUM_BINS, dtype=np.int64)
    num_indices = 0
    batch_sizes: set[int] = set()
    for m in measures:
        rows += m.unique_rows
        mass += m.index_mass
        num_indices += m.num_indices
        batch_sizes.add(m.batch_size)
    if len(batch_sizes) > 1:
        raise ValueError(f"tables measured at different batch sizes: {sorted(batch_sizes)}")
    num_unique = int(rows.sum())
    return {
        "batch_size": batch_sizes.pop() if batch_sizes else 0,
        "num_indices": num_indices,
        "num_unique": num_unique,
        "avg_reuse": num_indices / num_unique if num_unique else 0.0,
        "unique_row_access_hist": list(normalize(rows)),
        "index_mass_by_reuse_hist": list(normalize(mass)),
    }


def trace_stats(trace: Trace) -> dict[str, Any]:
    """:func:`summarize` over every table of a trace."""
    return summarize(measure_counts(c, trace.batch_size) for c in per_table_counts(trace))

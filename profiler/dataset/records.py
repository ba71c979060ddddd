"""The records of a cost dataset (``records.jsonl``): their schema, and the scan that
reads them back.

One JSON object a line, one line per measured sample, appended with one ``write``
and ``fsync``'d (:mod:`shardwise.profiler.dataset.store`). A crash can therefore only
leave the *last* line torn, and a torn line is one without its newline: that one,
and only that one, is an interrupted write, and :class:`RecordScan` reports its
length so that a writer can cut it. A complete line that does not parse was written
whole and changed afterwards (by hand, by another program): cutting it would delete
a measurement somebody may still want, so it stops the scan with a
:class:`~shardwise.basics.UserError` naming the file, the line and the field, and
nothing is deleted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from shardwise.basics import UserError
from shardwise.planner.access import NUM_BINS
from shardwise.planner.tables import TableSpec

RECORDS_FILE = "records.jsonl"
Kind = Literal["compute", "comm"]

Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def canonical_json(obj: Any) -> str:
    """Sorted, compact JSON; NaN and infinity are refused (a ``ValueError``), since
    JSON cannot hold them and the dataset hash is taken over this text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


class StrictModel(BaseModel):
    """Unknown fields and non-finite floats are refused: a typo or a broken number shows
    where it is. (``extra`` is free-form: a NaN there is written as null.)"""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


#: The fields a shard of another kind adds, with the values of a whole table in the
#: fused kernel; a record writes them only where they differ, so records of whole
#: tables (all those measured before row ranges existed) keep their exact text, and
#: the dataset hash over them stays what it was.
KIND_DEFAULTS: dict[str, Any] = {
    "table_rows": None,
    "row_offset": 0,
    "group": "fused",
    "local_batch": False,
}


class TableFeatures(StrictModel):
    """One table (or column shard, or row range) of a compute sample: the cost model's
    input. A row range is described as its kernel sees it (``rows`` and
    ``pooling_factor`` are the range's: :func:`shardwise.planner.kinds.row_slice`),
    with the table's rows in ``table_rows`` and where the range starts."""

    name: str
    base: str = Field(description="the original table; augmented widths share it (split on it)")
    rows: int = Field(gt=0)
    dim: int = Field(gt=0, description="the table's full width")
    cols: int = Field(gt=0, description="the width measured: a shard's, or dim")
    pooling_factor: float = Field(ge=0, allow_inf_nan=False)
    access_hist: tuple[Annotated[float, Field(ge=0)], ...] = Field(
        min_length=NUM_BINS, max_length=NUM_BINS
    )
    dtype: Literal["fp32", "fp16"]
    table_rows: int | None = Field(
        default=None, gt=0, description="a row range's table's rows; None: every row"
    )
    row_offset: int = Field(default=0, ge=0, description="a row range's first row")
    group: str = Field(default="fused", min_length=1, description="the kernel group it ran in")
    local_batch: bool = Field(
        default=False, description="read at the rank's own batch (data-parallel)"
    )

    @model_validator(mode="after")
    def _range_inside(self) -> Self:
        if self.table_rows is None:
            if self.row_offset:
                raise ValueError("row_offset needs table_rows (the table's rows)")
        elif self.row_offset + self.rows > self.table_rows:
            raise ValueError(
                f"rows {self.row_offset}..{self.row_offset + self.rows} are not inside "
                f"the table's {self.table_rows} rows"
            )
        return self

    @model_serializer(mode="wrap")
    def _omit_whole_table_defaults(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key, default in KIND_DEFAULTS.items():
                if key in data and data[key] == default:
                    del data[key]
        return data

    @property
    def row_range(self) -> tuple[int, int] | None:
        """``(row_offset, rows)`` of a row range, None for every row."""
        return None if self.table_rows is None else (self.row_offset, self.rows)

    @classmethod
    def from_spec(
        cls, spec: TableSpec, cols: int | None = None, base: str | None = None
    ) -> TableFeatures:
        """Features of ``spec``; ``base`` defaults to the augmentation's base name."""
        from shardwise.profiler.sampling import base_name

        return cls(
            name=spec.name,
            base=base if base is not None else base_name(spec.name),
            rows=spec.rows,
            dim=spec.dim,
            cols=cols if cols is not None else spec.dim,
            pooling_factor=spec.pooling_factor,
            access_hist=spec.access_hist,
            dtype=spec.dtype,
        )

    @classmethod
    def from_load(
        cls,
        spec: TableSpec,
        cols: int,
        row_range: tuple[int, int] | None = None,
        group: str = "fused",
        local_batch: bool = False,
    ) -> TableFeatures:
        """Features of a shard of ``spec`` (the whole table): ``cols`` wide, holding
        ``row_range`` = (offset, rows) or every row, run in kernel ``group``. A row
        range takes the rows and lookups of :func:`~shardwise.planner.kinds.row_slice`,
        what the cost model prices it as; ``base`` stays the table's, so a table's
        ranges fall in its train/test split."""
        from shardwise.planner.kinds import row_slice
        from shardwise.profiler.sampling import base_name

        seen = spec if row_range is None else row_slice(spec, *row_range)
        ranged = row_range is not None and seen is not spec
        fields = cls.from_spec(seen, cols, base=base_name(spec.name)).model_dump()
        fields.update(
            table_rows=spec.rows if ranged else None,
            row_offset=row_range[0] if ranged and row_range is not None else 0,
            group=group,
            local_batch=local_batch,
        )
        return cls.model_validate(fields)


#: ``ComputeRecord.extra`` key of the kernels a sample ran (:class:`KernelEntry`).
KERNELS_KEY = "kernels"


class KernelEntry(StrictModel):
    """One timed kernel of a compute sample: its group and precision, the batch it
    read (the local batch for data-parallel shards), the record's tables it held (by
    position in ``ComputeRecord.tables``) and its own medians."""

    group: str = Field(min_length=1)
    dtype: Literal["fp32", "fp16"]
    batch_size: int = Field(gt=0)
    tables: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    fwd_s: Seconds
    bwd_s: Seconds


class ComputeRecord(StrictModel):
    """One rank's kernels measured together: medians over ``repeats`` calls of their
    sum and its CV; ``extra["kernels"]`` holds each kernel's own when it ran more than
    the fused kernel of whole tables (:meth:`kernels`)."""

    index: int = Field(ge=0, description="the sample (= sampler task) index")
    fingerprint: str = Field(min_length=1, description="Fingerprint.key() of the measurer")
    batch_size: int = Field(gt=0)
    tables: list[TableFeatures] = Field(min_length=1)
    fwd_s: Seconds
    bwd_s: Seconds = Field(description="backward with the fused optimizer update")
    total_s: Seconds = Field(description="median of fwd+bwd per call (not fwd_s + bwd_s)")
    fwd_cv: Ratio
    bwd_cv: Ratio
    total_cv: Ratio
    repeats: int = Field(ge=1)
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="free-form; ``kernels`` (:data:`KERNELS_KEY`), when present, is trained on",
    )

    @model_validator(mode="after")
    def _kernels_valid(self) -> Self:
        self.kernels()
        return self

    def kernels(self) -> list[KernelEntry]:
        """The kernels this sample ran, one per kernel group and precision, from
        ``extra["kernels"]``; [] for a record that lists none (one fused kernel).
        A malformed list is a ValueError naming the entry."""
        raw = self.extra.get(KERNELS_KEY)
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise ValueError(f"extra.{KERNELS_KEY} must be a list of kernels")
        out = []
        for k, entry in enumerate(raw):
            try:
                kern = KernelEntry.model_validate(entry)
            except ValidationError as err:
                raise ValueError(f"extra.{KERNELS_KEY}[{k}]: {describe_errors(err)}") from None
            bad = [i for i in kern.tables if i >= len(self.tables)]
            if bad:
                raise ValueError(
                    f"extra.{KERNELS_KEY}[{k}]: tables {bad} are not among the record's "
                    f"{len(self.tables)}"
                )
            out.append(kern)
        return out


class CommRecord(StrictModel):
    """One all-to-all measurement: per-rank medians over ``repeats`` and their CV."""

    index: int = Field(ge=0)
    fingerprint: str = Field(min_length=1)
    batch_size: int = Field(gt=0, description="per-rank batch size")
    world_size: int = Field(ge=2)
    dims: list[int] = Field(description="each rank's total output width")
    delays_s: list[Seconds] = Field(description="each rank's start delay (straggler)")
    fwd_s: list[Seconds] = Field(description="per rank, including the straggler wait")
    bwd_s: list[Seconds]
    fwd_cv: list[Ratio]
    bwd_cv: list[Ratio]
    repeats: int = Field(ge=1)
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _per_rank(self) -> Self:
        w = self.world_size
        for field in ("dims", "delays_s", "fwd_s", "bwd_s", "fwd_cv", "bwd_cv"):
            if len(getattr(self, field)) != w:
                raise ValueError(f"{field} needs {w} entries (one per rank)")
        if any(d < 0 or d % 4 for d in self.dims):
            raise ValueError(f"dims must be multiples of 4 and >= 0, got {self.dims}")
        return self


Record = ComputeRecord | CommRecord
RECORD_MODELS: dict[str, type[ComputeRecord] | type[CommRecord]] = {
    "compute": ComputeRecord,
    "comm": CommRecord,
}


def describe_errors(err: ValidationError, limit: int = 3) -> str:
    """Pydantic's errors as ``field: what is wrong`` phrases, the first ``limit`` of them."""
    parts = []
    for e in err.errors()[:limit]:
        where = ".".join(str(p) for p in e["loc"]) or "the line"
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    more = err.error_count() - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _damaged(path: Path, lineno: int, what: str) -> UserError:
    return UserError(
        f"{path}, line {lineno}: {what}. The line is complete (it ends in a newline), so "
        "no interrupted write left it: it was changed after it was written. Nothing was "
        f"deleted. Repair the line, or remove it (e.g. `sed -i '{lineno}d' {path}`) and "
        "its sample is measured again when the run resumes."
    )


class RecordScan:
    """The records of ``path`` in file order, each one validated.

    Only an unterminated last line is skipped (an interrupted append): after the
    iteration ``good_end`` is the byte offset where it starts and ``torn`` its length.
    A complete line that is not a valid record, or that repeats a sample index, raises
    a :class:`UserError`. A missing file holds no records.
    """

    def __init__(self, path: Path, kind: Kind) -> None:
        self.path = path
        self.kind: Kind = kind
        self.model = RECORD_MODELS[kind]
        self.good_end = 0
        self.torn = 0

    def __iter__(self) -> Iterator[Record]:
        return (rec for _, rec in self.numbered())

    def numbered(self) -> Iterator[tuple[int, Record]]:
        """(line number, record) pairs; see the class for what is skipped or refused."""
        first_line: dict[int, int] = {}
        try:
            f = open(self.path, "rb")  # noqa: SIM115 (closed below; a generator holds it)
        except FileNotFoundError:
            return
        except OSError as err:
            raise UserError(f"{self.path}: cannot read the dataset's records ({err}).") from None
        with f:
            for lineno, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):
                    self.torn = len(line)  # the last line: iteration ends here
                    break
                try:
                    rec = self.model.model_validate_json(line)
                except ValidationError as err:
                    what = f"not a valid {self.kind} record ({describe_errors(err)})"
                    raise _damaged(self.path, lineno, what) from None
                if rec.index in first_line:
                    what = (
                        f"sample index {rec.index} repeats (first on line {first_line[rec.index]})"
                    )
                    raise _damaged(self.path, lineno, what)
                first_line[rec.index] = lineno
                self.good_end += len(line)
                yield lineno, rec


__all__ = [
    "KERNELS_KEY",
    "KIND_DEFAULTS",
    "RECORDS_FILE",
    "RECORD_MODELS",
    "CommRecord",
    "ComputeRecord",
    "KernelEntry",
    "Kind",
    "Record",
    "RecordScan",
    "StrictModel",
    "TableFeatures",
    "canonical_json",
    "describe_errors",
]

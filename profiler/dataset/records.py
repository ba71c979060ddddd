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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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


class TableFeatures(StrictModel):
    """One table (or column shard) of a compute sample: the cost model's input."""

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


class ComputeRecord(StrictModel):
    """One fused-kernel measurement: medians over ``repeats`` calls and their CV."""

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
    extra: dict[str, Any] = Field(default_factory=dict, description="free-form, not trained on")


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
    "RECORDS_FILE",
    "RECORD_MODELS",
    "CommRecord",
    "ComputeRecord",
    "Kind",
    "Record",
    "RecordScan",
    "StrictModel",
    "TableFeatures",
    "canonical_json",
    "describe_errors",
]

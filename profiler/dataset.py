"""The cost dataset: an append-only, versioned, crash-safe store of measured costs.

A dataset is a directory:

``dataset.json``
    The manifest: ``schema_version``, ``kind`` (``compute`` or ``comm``), the
    fingerprint of the machine that created it, ``created_at``, and the ``settings``
    that decide which samples are drawn and how they are measured (seed, sampling
    parameters, batch size, repeats …; never the number of samples wanted, so a run
    can be extended). Written atomically (temporary file, fsync, rename).
``records.jsonl``
    One JSON object per line, one line per measured sample (:class:`ComputeRecord`
    or :class:`CommRecord`), appended with a single ``write`` on an ``O_APPEND``
    descriptor and ``fsync``'d before :meth:`CostDataset.append` returns.

Why JSON lines and not Parquet (which docs/design.md §11 names): a sample costs seconds to
measure and must be durable the moment it is measured (Ctrl-C, a killed pod). A
Parquet file is only readable once its footer is written, so per-sample durability
would mean one Parquet file per sample, or buffering samples that a crash then loses.
An appended line is durable on its own, a crash can only tear the *last* line, and
that is easy to detect and cut. The datasets are small (thousands of samples, a few
MB); a trainer that wants columns builds them from :meth:`CostDataset.load` in
milliseconds.

Resuming: opening an existing dataset for writing scans it, cuts a torn or damaged
tail (everything after the last valid line), and :meth:`CostDataset.done_indices`
tells the runner which sample indices to skip. Sample ``i`` is task ``i`` of the
seeded sampler (:mod:`shardwise.profiler.sampling`), so a resumed run measures exactly
what an uninterrupted one would. A damaged line *followed by* valid ones is not a
crash artifact and is refused rather than silently dropped. One writer at a time is
enforced with ``flock`` on the records file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardwise.basics import UserError, write_atomic
from shardwise.planner.access import NUM_BINS
from shardwise.planner.tables import TableSpec
from shardwise.profiler.fingerprint import Fingerprint

log = logging.getLogger(__name__)

#: Bump when a record or manifest field changes meaning; readers refuse other versions.
SCHEMA_VERSION = 1
MANIFEST_FILE = "dataset.json"
RECORDS_FILE = "records.jsonl"
Kind = Literal["compute", "comm"]

Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableFeatures(_Strict):
    """One table (or column shard) of a compute sample: the cost model's input."""

    name: str
    base: str = Field(description="the original table; augmented widths share it (split on it)")
    rows: int = Field(gt=0)
    dim: int = Field(gt=0, description="the table's full width")
    cols: int = Field(gt=0, description="the width measured: a shard's, or dim")
    pooling_factor: float = Field(ge=0, allow_inf_nan=False)
    access_hist: tuple[float, ...] = Field(min_length=NUM_BINS, max_length=NUM_BINS)
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


class ComputeRecord(_Strict):
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


class CommRecord(_Strict):
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


class Manifest(_Strict):
    """``dataset.json``."""

    schema_version: int
    kind: Kind
    fingerprint: dict[str, Any]
    fingerprint_key: str
    created_at: str
    settings: dict[str, Any]
    #: Every fingerprint that appended (key → fields); more than one only when a run
    #: appended anyway despite a mismatch.
    fingerprints: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: Settings of runs that appended anyway with other settings.
    other_settings: list[dict[str, Any]] = Field(default_factory=list)


# --------------------------------------------------------------------------- helpers


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _normalize_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """JSON round trip (tuples become lists), so stored and given settings compare."""
    try:
        out: dict[str, Any] = json.loads(_canonical(dict(settings)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"dataset settings must be plain JSON values: {err}") from None
    return out


def _read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: cannot read the dataset manifest ({err}).") from None
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{path}: dataset schema version {version!r}, but this Shardwise reads version "
            f"{SCHEMA_VERSION}. Re-profile into a new directory or use a matching Shardwise."
        )
    try:
        return Manifest.model_validate(doc)
    except ValidationError as err:
        raise UserError(f"{path}: not a valid dataset manifest:\n{err}") from None


class _Scan:
    """Valid records of a records file in order; a bad tail ends the scan quietly.

    ``good_end`` is the byte offset just past the last valid line once iterated.
    """

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.model = RECORD_MODELS[kind]
        self.good_end = 0
        self.size = 0

    def __iter__(self) -> Iterator[Record]:
        seen: set[int] = set()
        bad: tuple[int, str] | None = None
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                offset += len(line)
                problem = None
                rec: Record | None = None
                if not line.endswith(b"\n"):
                    problem = "torn line (no newline)"
                else:
                    try:
                        rec = self.model.model_validate_json(line)
                    except ValidationError as err:
                        problem = f"{err.error_count()} problem(s): {err.errors()[0]['msg']}"
                if rec is not None and rec.index in seen:
                    problem = f"sample index {rec.index} repeats"
                if problem is not None or rec is None:
                    bad = bad or (lineno, problem or "invalid")
                    continue
                if bad is not None:
                    raise UserError(
                        f"{self.path}, line {bad[0]}: damaged record ({bad[1]}), yet valid "
                        f"records follow it (line {lineno}). That is not what an interrupted "
                        "run leaves; inspect or remove the line by hand."
                    )
                seen.add(rec.index)
                self.good_end = offset
                yield rec
        self.size = offset


# --------------------------------------------------------------------------- dataset


class CostDataset:
    """A cost dataset directory; see the module docstring for the layout and rules.

    Use :meth:`create_or_open` to write (as a context manager, or call :meth:`close`)
    and :meth:`open` to read.
    """

    def __init__(self, directory: Path, manifest: Manifest, writer_key: str | None) -> None:
        self.directory = directory
        self.manifest = manifest
        self._writer_key = writer_key
        self._fd: int | None = None
        self._done: set[int] | None = None
        #: Bytes cut from a torn tail when this writer opened the dataset.
        self.recovered_bytes = 0

    # ------------------------------------------------------------------ opening

    @classmethod
    def create_or_open(
        cls,
        directory: str | Path,
        kind: Kind,
        fingerprint: Fingerprint,
        settings: Mapping[str, Any],
        *,
        allow_mismatch: bool = False,
    ) -> CostDataset:
        """Open ``directory`` to append, creating the dataset if it does not exist.

        An existing dataset of another kind is refused; one measured on another
        fingerprint or with other settings is refused unless ``allow_mismatch``
        (then the difference is recorded in the manifest, and every record keeps
        its own fingerprint key).
        """
        d = Path(directory)
        norm = _normalize_settings(settings)
        key = fingerprint.key()
        manifest_path, records_path = d / MANIFEST_FILE, d / RECORDS_FILE
        if d.exists() and not d.is_dir():
            raise UserError(f"{d} is a file; the dataset output must be a directory.")
        if manifest_path.exists():
            manifest = _read_manifest(d)
            manifest = cls._check_compatible(d, manifest, kind, fingerprint, norm, allow_mismatch)
        else:
            # A crash while creating can leave an empty records file and a temporary
            # manifest; anything else means the directory is not ours to write into.
            leftovers = sorted(p.name for p in d.iterdir()) if d.exists() else []
            ours = {RECORDS_FILE, MANIFEST_FILE + ".tmp"}
            empty_records = not records_path.exists() or records_path.stat().st_size == 0
            if not (set(leftovers) <= ours and empty_records):
                raise UserError(
                    f"{d} exists and is not a Shardwise cost dataset (no {MANIFEST_FILE}; it "
                    f"holds {', '.join(leftovers[:5])}). Choose a new or empty directory."
                )
            d.mkdir(parents=True, exist_ok=True)
            records_path.touch()
            manifest = Manifest(
                schema_version=SCHEMA_VERSION,
                kind=kind,
                fingerprint=fingerprint.to_dict(),
                fingerprint_key=key,
                created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                settings=norm,
                fingerprints={key: fingerprint.to_dict()},
            )
            write_atomic(manifest_path, manifest.model_dump_json(indent=1) + "\n")
        ds = cls(d, manifest, key)
        ds._open_writer()
        return ds

    @staticmethod
    def _check_compatible(
        d: Path,
        manifest: Manifest,
        kind: Kind,
        fingerprint: Fingerprint,
        settings: dict[str, Any],
        allow_mismatch: bool,
    ) -> Manifest:
        if manifest.kind != kind:
            raise UserError(
                f"{d} holds a {manifest.kind} dataset; it cannot take {kind} samples. "
                "Use another directory."
            )
        stored = Fingerprint.from_dict(manifest.fingerprint)
        problems = []
        if not stored.matches(fingerprint):
            problems.append(stored.describe_mismatch(fingerprint))
        if manifest.settings != settings:
            keys = sorted(
                k
                for k in manifest.settings.keys() | settings.keys()
                if manifest.settings.get(k) != settings.get(k)
            )
            diff = "; ".join(
                f"{k}: stored {manifest.settings.get(k)!r}, now {settings.get(k)!r}" for k in keys
            )
            problems.append(f"The run's settings differ from the dataset's ({diff}).")
        if not problems:
            return manifest
        if not allow_mismatch:
            raise UserError(
                f"{d} cannot be resumed by this run. "
                + " ".join(problems)
                + " Mixing them would make the samples incomparable: write to a new "
                "directory, or append anyway (--allow-mismatch) if you "
                "know the difference does not matter."
            )
        log.warning("appending to %s despite: %s", d, " ".join(problems))
        update: dict[str, Any] = {
            "fingerprints": {**manifest.fingerprints, fingerprint.key(): fingerprint.to_dict()}
        }
        if manifest.settings != settings and settings not in manifest.other_settings:
            update["other_settings"] = [*manifest.other_settings, settings]
        new = manifest.model_copy(update=update)
        if new != manifest:
            write_atomic(d / MANIFEST_FILE, new.model_dump_json(indent=1) + "\n")
        return new

    @classmethod
    def open(cls, directory: str | Path) -> CostDataset:
        """Open for reading only; a torn tail is ignored, not cut."""
        d = Path(directory)
        if not (d / MANIFEST_FILE).exists():
            raise UserError(f"{d} is not a Shardwise cost dataset (no {MANIFEST_FILE}).")
        return cls(d, _read_manifest(d), None)

    def _open_writer(self) -> None:
        path = self.directory / RECORDS_FILE
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"{self.directory} is being written by another process; wait for it or "
                "write to another directory."
            ) from None
        try:
            scan = _Scan(path, self.kind)
            done = {r.index for r in scan}
            if scan.good_end < scan.size:
                self.recovered_bytes = scan.size - scan.good_end
                log.warning(
                    "%s: cut %d bytes of an interrupted write after sample %d",
                    path,
                    self.recovered_bytes,
                    len(done),
                )
                os.ftruncate(fd, scan.good_end)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._done = fd, done

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also releases the flock
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ properties

    @property
    def kind(self) -> Kind:
        return self.manifest.kind

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.manifest.settings)

    @property
    def fingerprint(self) -> Fingerprint:
        """The fingerprint the dataset was created on."""
        return Fingerprint.from_dict(self.manifest.fingerprint)

    # ------------------------------------------------------------------ writing

    def done_indices(self) -> set[int]:
        """Sample indices already measured (the runner skips them)."""
        if self._done is not None:
            return set(self._done)
        return {r.index for r in self.models()}

    def append(self, index: int, record: Mapping[str, Any] | Record) -> Record:
        """Validate and durably append sample ``index``; returns the stored record.

        ``index`` and ``fingerprint`` may be left out of ``record``: they are filled in
        (the fingerprint with this writer's key).
        """
        if self._fd is None or self._done is None:
            raise RuntimeError("dataset is not open for writing (use create_or_open)")
        data = dict(record.model_dump() if isinstance(record, BaseModel) else record)
        if data.setdefault("index", index) != index:
            raise ValueError(f"record index {data['index']} differs from index {index}")
        data.setdefault("fingerprint", self._writer_key)
        if index in self._done:
            raise ValueError(f"sample {index} is already in {self.directory}")
        rec = RECORD_MODELS[self.kind].model_validate(data)
        line = (rec.model_dump_json() + "\n").encode()
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self._done.add(index)
        return rec

    # ------------------------------------------------------------------ reading

    def models(self) -> Iterator[Record]:
        """Valid records in append order, as typed models."""
        return iter(_Scan(self.directory / RECORDS_FILE, self.kind))

    def records(self) -> Iterator[dict[str, Any]]:
        """Valid records in append order, as plain dicts (JSON types)."""
        for rec in self.models():
            yield rec.model_dump(mode="json")

    def load(self) -> list[dict[str, Any]]:
        """All records, sorted by sample index (training reads this)."""
        return sorted(self.records(), key=lambda r: int(r["index"]))

    def by_index(self) -> dict[int, dict[str, Any]]:
        return {int(r["index"]): r for r in self.records()}

    def __len__(self) -> int:
        return len(self._done) if self._done is not None else sum(1 for _ in self.models())

    def dataset_hash(self) -> str:
        """sha256 of the content: schema, kind, settings and the records by index.

        Independent of append order, timestamps and the manifest's bookkeeping, so two
        runs that measured the same samples identically hash alike; any changed value
        changes it. The cost-model artifact records it to name its training data.
        """
        h = hashlib.sha256()
        header = {
            "schema_version": self.manifest.schema_version,
            "kind": self.kind,
            "settings": self.manifest.settings,
        }
        h.update(_canonical(header).encode() + b"\n")
        for rec in self.load():
            h.update(_canonical(rec).encode() + b"\n")
        return h.hexdigest()


def coefficient_of_variation(values: list[float]) -> float:
    """Sample standard deviation over mean (0 for fewer than two values or a zero mean);
    the spread every record stores next to its median."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    if mean == 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var) / abs(mean)


__all__ = [
    "MANIFEST_FILE",
    "RECORDS_FILE",
    "SCHEMA_VERSION",
    "CommRecord",
    "ComputeRecord",
    "CostDataset",
    "Kind",
    "Manifest",
    "Record",
    "TableFeatures",
    "coefficient_of_variation",
]

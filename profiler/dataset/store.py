"""The cost dataset: an append-only, versioned, crash-safe store of measured costs.

A dataset is a directory:

``dataset.json``
    The manifest: ``schema_version``, ``kind`` (``compute`` or ``comm``), the
    fingerprint of the machine that created it, ``created_at``, and the ``settings``
    that decide which samples are drawn and how they are measured (seed, sampling
    parameters, batch size, repeats …; never the number of samples wanted, so a run
    can be extended). Written atomically, only by the writer holding the lock
    (:mod:`shardwise.profiler.dataset.manifest`).
``records.jsonl``
    One JSON object per line, one line per measured sample (:class:`ComputeRecord`
    or :class:`CommRecord`), appended with a single ``write`` on an ``O_APPEND``
    descriptor and ``fsync``'d before :meth:`CostDataset.append` returns
    (:mod:`shardwise.profiler.dataset.records`).

Why JSON lines and not Parquet (which docs/design.md §11 names): a sample costs seconds to
measure and must be durable the moment it is measured (Ctrl-C, a killed pod). A
Parquet file is only readable once its footer is written, so per-sample durability
would mean one Parquet file per sample, or buffering samples that a crash then loses.
An appended line is durable on its own, a crash can only tear the *last* line, and
that is easy to detect and cut. The datasets are small (thousands of samples, a few
MB); a trainer that wants columns builds them from :meth:`CostDataset.load` in
milliseconds.

Resuming: opening an existing dataset for writing takes the lock (``flock`` on the
records file: one writer at a time, and the manifest is created under it), scans the
records, cuts an unterminated last line (the only thing an interrupted append
leaves), and :meth:`CostDataset.done_indices` tells the runner which sample indices to
skip. Sample ``i`` is task ``i`` of the seeded sampler
(:mod:`shardwise.profiler.sampling`), so a resumed run measures exactly what an
uninterrupted one would. A complete line that is not a valid record is no crash
artifact: it is refused with its file, line and field, and nothing is cut.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pydantic import BaseModel

from shardwise.basics import UserError
from shardwise.profiler.dataset.manifest import (
    MANIFEST_FILE,
    SCHEMA_VERSION,
    Manifest,
    RecordCheck,
    check_compatible,
    lock_records,
    missing_manifest_error,
    normalize_settings,
    read_manifest,
    rebuild_manifest,
    refuse_unusable,
    remove_stale_temps,
    write_manifest,
)
from shardwise.profiler.dataset.records import (
    RECORD_MODELS,
    RECORDS_FILE,
    CommRecord,
    ComputeRecord,
    Kind,
    Record,
    RecordScan,
    TableFeatures,
    canonical_json,
)
from shardwise.profiler.fingerprint import Fingerprint

log = logging.getLogger(__name__)


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
        its own fingerprint key). The lock is taken before the manifest is read or
        written, so two runs started at once cannot both create the dataset.
        """
        d = Path(directory)
        norm = normalize_settings(settings)
        refuse_unusable(d)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"{d}: cannot create the dataset directory ({err}).") from None
        fd = lock_records(d)
        try:
            if (d / MANIFEST_FILE).exists():
                manifest = read_manifest(d)
                manifest = check_compatible(d, manifest, kind, fingerprint, norm, allow_mismatch)
            else:
                size = os.fstat(fd).st_size
                if size:
                    raise missing_manifest_error(d, size)
                remove_stale_temps(d)
                manifest = Manifest.new(kind, fingerprint, norm)
                write_manifest(d, manifest)
            ds = cls(d, manifest, fingerprint.key())
            ds._start_writing(fd)
        except BaseException:
            os.close(fd)
            raise
        return ds

    @classmethod
    def open(cls, directory: str | Path) -> CostDataset:
        """Open for reading only; an unterminated last line is ignored, not cut."""
        d = Path(directory)
        if not (d / MANIFEST_FILE).exists():
            records = d / RECORDS_FILE
            if records.is_file() and records.stat().st_size:
                raise missing_manifest_error(d, records.stat().st_size)
            raise UserError(
                f"{d / MANIFEST_FILE}: no such file, so {d} is not a Shardwise cost dataset. "
                f"Measure one with `shardwise profile compute|comm --out {d}`."
            )
        return cls(d, read_manifest(d), None)

    @staticmethod
    def repair(
        directory: str | Path,
        kind: Kind,
        fingerprint: Fingerprint,
        settings: Mapping[str, Any],
        check: RecordCheck,
    ) -> int:
        """Rebuild a lost manifest from the records (see
        :func:`~shardwise.profiler.dataset.manifest.rebuild_manifest`); returns the
        records it was rebuilt from, 0 when there was nothing to repair."""
        return rebuild_manifest(directory, kind, fingerprint, settings, check)

    def _start_writing(self, fd: int) -> None:
        """Scan the records under the lock held by ``fd``; cut a torn last line."""
        scan = RecordScan(self.directory / RECORDS_FILE, self.kind)
        done = {r.index for r in scan}
        if scan.torn:
            self.recovered_bytes = scan.torn
            log.warning(
                "%s: cut %d bytes of an interrupted write after sample %d",
                self.directory / RECORDS_FILE,
                scan.torn,
                len(done),
            )
            os.ftruncate(fd, scan.good_end)
            os.fsync(fd)
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

    @property
    def writer_key(self) -> str:
        """The fingerprint key of the machine writing now (what its records carry);
        differs from the creator's only under ``allow_mismatch``."""
        if self._writer_key is None:
            raise RuntimeError("dataset is not open for writing (use create_or_open)")
        return self._writer_key

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
        return iter(RecordScan(self.directory / RECORDS_FILE, self.kind))

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
        h.update(canonical_json(header).encode() + b"\n")
        for rec in self.load():
            h.update(canonical_json(rec).encode() + b"\n")
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
    "RECORD_MODELS",
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

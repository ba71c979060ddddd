"""A cost dataset's manifest (``dataset.json``) and the lock that guards its writers.

The manifest says what the records are: the schema version, the kind, the machine
that measured them (its fingerprint) and the settings that decide which samples are
drawn. One writer at a time holds an exclusive ``flock`` on ``records.jsonl``, and
the manifest is only ever written by the lock holder, through a temporary file of
its own (:func:`shardwise.basics.write_atomic`): two runs started at once into one
new directory cannot both create it, nor leave one's records under the other's
settings. A manifest that was lost can be rebuilt from the records
(:func:`rebuild_manifest`) once every record is shown to be what the given settings
draw, measured on this machine.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from shardwise.basics import UserError, write_atomic
from shardwise.profiler.dataset.records import (
    RECORD_MODELS,
    RECORDS_FILE,
    Kind,
    Record,
    RecordScan,
    StrictModel,
    canonical_json,
)
from shardwise.profiler.fingerprint import Fingerprint

log = logging.getLogger(__name__)

#: Bump when a record or manifest field changes meaning; readers refuse other versions.
SCHEMA_VERSION = 1
MANIFEST_FILE = "dataset.json"
#: What the command line says to rebuild a lost manifest (see :func:`rebuild_manifest`).
REPAIR_HINT = (
    "run the command that measured them again with --repair and the same options "
    "(`shardwise profile compute --tables TABLES --out {d} --repair` or `shardwise profile "
    "comm --out {d} --repair`, with the same --seed and sampling options): it checks that "
    "every record is the sample those options draw, measured on this machine, and then "
    "writes the manifest"
)


class Manifest(StrictModel):
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

    @field_validator("settings", "other_settings")
    @classmethod
    def _plain_json(cls, value: Any) -> Any:
        try:
            canonical_json(value)
        except (TypeError, ValueError):
            raise ValueError("holds NaN, infinity or a value JSON cannot store") from None
        return value

    @classmethod
    def new(cls, kind: Kind, fingerprint: Fingerprint, settings: dict[str, Any]) -> Manifest:
        """The manifest of a dataset created now on ``fingerprint``."""
        return cls(
            schema_version=SCHEMA_VERSION,
            kind=kind,
            fingerprint=fingerprint.to_dict(),
            fingerprint_key=fingerprint.key(),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            settings=settings,
            fingerprints={fingerprint.key(): fingerprint.to_dict()},
        )


def normalize_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """JSON round trip (tuples become lists), so stored and given settings compare."""
    try:
        out: dict[str, Any] = json.loads(canonical_json(dict(settings)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"dataset settings must be plain JSON values: {err}") from None
    return out


# --------------------------------------------------------------------------- reading


#: Deeper JSON than any manifest holds; checked first, so that nothing after it recurses
#: into a document deep enough to exhaust the interpreter's stack.
MAX_DEPTH = 32


def _depth(doc: Any) -> int:
    """How deeply lists and objects nest in ``doc`` (iteratively: no recursion)."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        obj, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(obj, dict):
            stack += [(v, level + 1) for v in obj.values()]
        elif isinstance(obj, list):
            stack += [(v, level + 1) for v in obj]
    return deepest


def _line_of(text: str, loc: tuple[str | int, ...]) -> int | None:
    """The line of the (nested) key ``loc`` in the JSON ``text``, where it can be found."""
    pos, line = 0, None
    for part in loc:
        if isinstance(part, int):
            continue
        key = re.escape(json.dumps(str(part)))
        m = re.compile(key + r"\s*:").search(text, pos)
        if m is None:
            break
        pos, line = m.end(), text.count("\n", 0, m.start()) + 1
    return line


def _problems(doc: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """(field path, what is wrong) for every problem of a parsed manifest: pydantic's,
    then the fingerprints' own fields (pydantic only sees objects there)."""
    found: list[tuple[tuple[str | int, ...], str]] = []
    for key, value in doc.items():
        try:  # json reads "\ud800" as a lone surrogate, which no file can hold again
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            found.append(((key,), "holds an escaped lone surrogate (\\udXXX), not text"))
    try:
        Manifest.model_validate(doc)
    except ValidationError as err:
        found += [
            (tuple(e["loc"]), str(e["msg"]).removeprefix("Value error, ")) for e in err.errors()
        ]
    named: list[tuple[tuple[str | int, ...], Any]] = [(("fingerprint",), doc.get("fingerprint"))]
    if isinstance(doc.get("fingerprints"), dict):
        named += [(("fingerprints", str(k)), v) for k, v in doc["fingerprints"].items()]
    for where, value in named:
        if isinstance(value, dict):
            found += [((*where, f) if f else where, msg) for f, msg in Fingerprint.problems(value)]
    return found


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory``; anything unreadable or invalid is a
    :class:`UserError` naming the file, the line and the field."""
    path = directory / MANIFEST_FILE
    rebuild = "delete it and rebuild it from the records: " + REPAIR_HINT.format(d=directory)
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise UserError(
            f"{path}: cannot read the dataset manifest ({err}). Restore it from a copy, or "
            f"{rebuild}."
        ) from None
    if _depth(doc) > MAX_DEPTH:
        raise UserError(
            f"{path}: nested more than {MAX_DEPTH} levels deep; a dataset manifest is a "
            f"flat record of settings. Restore it from a copy, or {rebuild}."
        )
    if not isinstance(doc, dict):
        raise UserError(
            f"{path}: a dataset manifest is a JSON object, this file holds "
            f"{type(doc).__name__}. Restore it from a copy, or {rebuild}."
        )
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise UserError(
            f"{path}: dataset schema version {version!r}, but this Shardwise reads version "
            f"{SCHEMA_VERSION}. Re-profile into a new directory or use a matching Shardwise."
        )
    found = _problems(doc)
    if found:
        lines = []
        for loc, msg in found[:5]:
            line = _line_of(text, loc[:-1] if msg == "Field required" else loc)
            where = f"line {line}, " if line is not None else ""
            lines.append(f"  {where}{'.'.join(map(str, loc)) or '(the file)'}: {msg}")
        more = f"\n  … and {len(found) - 5} more" if len(found) > 5 else ""
        raise UserError(
            f"{path}: not a valid dataset manifest:\n"
            + "\n".join(lines)
            + more
            + "\nCorrect the field(s) named (a fingerprint holds device, device_type cpu or "
            f"cuda, cores >= 1, torch, fbgemm and python), or {rebuild}."
        )
    return Manifest.model_validate(doc)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Atomically; only the holder of :func:`lock_records` calls it."""
    path = directory / MANIFEST_FILE
    try:
        write_atomic(path, manifest.model_dump_json(indent=1) + "\n")
    except OSError as err:
        raise UserError(f"{path}: cannot write the dataset manifest ({err}).") from None


def missing_manifest_error(directory: Path, records_bytes: int) -> UserError:
    """What to say about records without their manifest, and how to rebuild it."""
    return UserError(
        f"{directory / MANIFEST_FILE} is missing, but {directory / RECORDS_FILE} holds "
        f"{records_bytes} bytes of measured samples: the manifest was deleted or lost. "
        f"To rebuild it from the records, {REPAIR_HINT.format(d=directory)}. To start "
        f"afresh instead, move {RECORDS_FILE} away."
    )


# --------------------------------------------------------------------------- writing


def _is_manifest_temp(name: str) -> bool:
    return name.startswith(MANIFEST_FILE + ".") and name.endswith(".tmp")


def refuse_unusable(d: Path) -> None:
    """Before touching ``d``: refuse a file, a directory of other things, and records
    whose manifest is gone. Files this module writes itself are fine.

    Checked again under the lock; here only so that nothing is created in a
    directory that is not ours. The manifest is looked for *after* the listing, and
    a writer writes it before any record, so a run creating the dataset right now
    is never mistaken for a lost manifest.
    """
    if d.exists() and not d.is_dir():
        raise UserError(f"{d} is a file; the dataset output must be a directory.")
    if not d.is_dir():
        return
    names = sorted(p.name for p in d.iterdir())
    records = d / RECORDS_FILE
    size = records.stat().st_size if records.is_file() else 0
    if (d / MANIFEST_FILE).exists():
        return
    if size:
        raise missing_manifest_error(d, size)
    foreign = [n for n in names if n != RECORDS_FILE and not _is_manifest_temp(n)]
    if foreign:
        raise UserError(
            f"{d} exists and is not a Shardwise cost dataset ({d / MANIFEST_FILE} is missing; "
            f"it holds {', '.join(foreign[:5])}). Choose a new or empty directory."
        )


def lock_records(d: Path) -> int:
    """Open ``records.jsonl`` to append, holding its exclusive lock (a descriptor;
    closing it releases the lock). Another holder is a :class:`UserError`."""
    path = d / RECORDS_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError(
            f"{path}: cannot open the dataset's records to append ({err.strerror}). The "
            "dataset directory must be writable and records.jsonl a file."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            f"{d} is being written by another process; wait for it or write to another directory."
        ) from None
    return fd


def remove_stale_temps(d: Path) -> None:
    """Temporary manifests left by a crash (only the lock holder writes one)."""
    for p in d.iterdir():
        if _is_manifest_temp(p.name):
            p.unlink(missing_ok=True)


def check_compatible(
    d: Path,
    manifest: Manifest,
    kind: Kind,
    fingerprint: Fingerprint,
    settings: dict[str, Any],
    allow_mismatch: bool,
) -> Manifest:
    """The manifest a run may append under, or a :class:`UserError` saying what differs.

    With ``allow_mismatch`` the difference is recorded (the writer's fingerprint and
    settings) and written back; the caller holds the lock.
    """
    if manifest.kind != kind:
        raise UserError(
            f"{d / MANIFEST_FILE}: {d} holds a {manifest.kind} dataset; it cannot take {kind} "
            "samples. Use another directory."
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
            f"{d / MANIFEST_FILE}: this dataset cannot be resumed by this run. "
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
        write_manifest(d, new)
    return new


def _refuse_other_kind(path: Path, kind: Kind) -> None:
    """A repair by the wrong command: the first line is a record of the other kind."""
    with open(path, "rb") as f:
        first = f.readline()
    other: Kind = "comm" if kind == "compute" else "compute"
    try:
        RECORD_MODELS[other].model_validate_json(first)
    except ValidationError:
        return
    raise UserError(
        f"{path}: holds {other} records, not {kind} ones; rebuild its manifest with "
        f"`shardwise profile {other} --out {path.parent} --repair` and the options that "
        "measured them."
    )


#: Says why a record is not the sample the given settings draw, or None when it is.
RecordCheck = Callable[[Record], str | None]


def rebuild_manifest(
    directory: str | Path,
    kind: Kind,
    fingerprint: Fingerprint,
    settings: Mapping[str, Any],
    check: RecordCheck,
) -> int:
    """Write a lost ``dataset.json`` from ``records.jsonl``; returns the records checked.

    The records hold neither the settings nor the full fingerprint (only its key), so
    they come from the caller, and every record must agree: ``check`` passes it (it is
    the sample ``settings`` draw) and its fingerprint key is ``fingerprint``'s. Any
    disagreement is a :class:`UserError` naming the line; nothing is written. A
    dataset that has its manifest, or no records, is left alone (returns 0).
    """
    d = Path(directory)
    if not d.is_dir() or (d / MANIFEST_FILE).exists():
        return 0
    norm = normalize_settings(settings)
    fd = lock_records(d)
    try:
        if (d / MANIFEST_FILE).exists():
            return 0
        _refuse_other_kind(d / RECORDS_FILE, kind)
        key, count, wrong = fingerprint.key(), 0, []
        for lineno, rec in RecordScan(d / RECORDS_FILE, kind).numbered():
            count += 1
            problem = (
                check(rec)
                if rec.fingerprint == key
                else (
                    f"measured on the machine with fingerprint key {rec.fingerprint}, "
                    f"this one is {key} ({fingerprint.describe()}); repair on the machine "
                    "(and --measure-on device) that measured it"
                )
            )
            if problem is not None:
                wrong.append(f"  line {lineno} (sample {rec.index}): {problem}")
        if wrong:
            raise UserError(
                f"{d / RECORDS_FILE}: cannot rebuild {MANIFEST_FILE}, {len(wrong)} of "
                f"{count} records disagree with this run:\n"
                + "\n".join(wrong[:5])
                + ("\n  …" if len(wrong) > 5 else "")
                + "\nGive --repair the options of the command that measured these records; "
                "nothing was written."
            )
        if count == 0:
            return 0
        remove_stale_temps(d)
        write_manifest(d, Manifest.new(kind, fingerprint, norm))
        log.info("%s: rebuilt %s from %d records", d, MANIFEST_FILE, count)
        return count
    finally:
        os.close(fd)


__all__ = [
    "MANIFEST_FILE",
    "SCHEMA_VERSION",
    "Manifest",
    "RecordCheck",
    "check_compatible",
    "lock_records",
    "missing_manifest_error",
    "normalize_settings",
    "read_manifest",
    "rebuild_manifest",
    "refuse_unusable",
    "remove_stale_temps",
    "write_manifest",
]

"""The per-machine cache of calibrated cost models, and the choice of model a command
prices with (docs/model-cache.md).

A model calibrated on one machine holds there: the bundled one was measured on another
CPU and other tables, and is off by several times elsewhere (docs/design.md §6:
machines differ). Calibrated models are therefore kept per hardware fingerprint, each
naming the tables it was calibrated on by their signatures
(:func:`~shardwise.planner.tables.table_signature`):

    <root>/<fingerprint key>/calibrated-<16 hex of the sorted signatures>.pt

``root`` is ``$SHARDWISE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/shardwise/models``,
else ``~/.cache/shardwise/models``. An entry is written whole through a temporary file
of its own, so two calibrations writing one entry leave one of them, whole. A file
there that is damaged, foreign or for another machine is skipped with a one-line
warning: never loaded into a plan, never a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from shardwise.basics import UserError, fsync_dir
from shardwise.planner.costmodel.artifact import CostModel, load_bundled
from shardwise.planner.tables import TableSpec, table_signature

#: Overrides where the cache lives (tests point it at a temporary folder).
ENV_CACHE = "SHARDWISE_MODEL_CACHE"
#: A model file every command uses unless ``--model`` names another.
ENV_MODEL = "SHARDWISE_MODEL"
ENTRY_PREFIX = "calibrated-"
_KEY = re.compile(r"^[0-9a-f]{16}$")

Warn = Callable[[str], None]


def cache_root() -> Path:
    """Where calibrated models live (see the module docstring); nothing is created."""
    override = os.environ.get(ENV_CACHE)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says a relative path there is to be ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "shardwise" / "models"


def entry_name(signatures: Iterable[str]) -> str:
    """``calibrated-<16 hex>.pt`` for a covered set of table signatures."""
    blob = "\n".join(sorted(set(signatures)))
    return f"{ENTRY_PREFIX}{hashlib.sha256(blob.encode()).hexdigest()[:16]}.pt"


def calibration_of(metadata: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``metadata["calibration"]`` when it holds what the cache reads (its machine
    and covered tables), None when absent; a ``ValueError`` saying what is wrong."""
    cal = metadata.get("calibration")
    if cal is None:
        return None
    if not isinstance(cal, Mapping):
        raise ValueError(f"metadata.calibration is a {type(cal).__name__}, not a mapping")
    key = cal.get("fingerprint_key")
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"metadata.calibration.fingerprint_key is {key!r}, not 16 hex digits")
    tables = cal.get("tables")
    if not isinstance(tables, list | tuple) or not all(isinstance(t, str) for t in tables):
        raise ValueError("metadata.calibration.tables is not a list of table signatures")
    return cal


def _created(cal: Mapping[str, Any], path: Path | None) -> float:
    """When a calibration was made (its ``created_at``, else the file's time): the
    newest of several covering models wins."""
    text = cal.get("created_at")
    if isinstance(text, str):
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(text).timestamp()
    if path is not None:
        with contextlib.suppress(OSError):
            return path.stat().st_mtime
    return 0.0


def _show(path: Path) -> str:
    """``path`` with the home folder as ``~`` (the cache's path is long)."""
    with contextlib.suppress(ValueError, RuntimeError):
        return "~/" + str(path.resolve().relative_to(Path.home().resolve()))
    return str(path)


def _machine(fingerprint: Any) -> str:
    """A stored fingerprint in words: ``cpu:AMD EPYC (2 cores)``."""
    if not isinstance(fingerprint, Mapping):
        return "an unrecorded machine"
    unit = "SMs" if fingerprint.get("device_type") == "cuda" else "cores"
    return f"{fingerprint.get('device', '?')} ({fingerprint.get('cores', '?')} {unit})"


#: Where a chosen model came from, as its line says it.
ORIGINS = {
    "--model": "given by --model",
    ENV_MODEL: f"from ${ENV_MODEL}",
    "cache": "",
    "bundled": "",
}


@dataclass(frozen=True)
class ModelChoice:
    """The model a command prices with and what it knows of these tables here.

    ``calibrated_here``: calibrated on this machine's fingerprint; ``covers`` of the
    ``of`` job tables are in its calibration; ``note`` is the one line the CLI prints
    ("cost model: … (calibrated on this machine on 60 of these 60 tables, …)").
    """

    model: CostModel
    path: Path | None
    calibrated_here: bool
    covers: int
    of: int
    note: str
    #: ``--model``, ``SHARDWISE_MODEL``, ``cache`` or ``bundled``.
    origin: str = "bundled"

    @property
    def holds_here(self) -> bool:
        """Calibrated on this machine on every one of the job's tables."""
        return self.calibrated_here and self.covers == self.of

    @classmethod
    def of_model(
        cls,
        model: CostModel,
        path: Path | None,
        origin: str,
        fingerprint_key: str,
        tables: Sequence[TableSpec],
        closest: bool = False,
    ) -> ModelChoice:
        """The choice of ``model`` for ``tables`` on the machine ``fingerprint_key``.
        A model whose calibration metadata is damaged counts as uncalibrated."""
        try:
            cal = calibration_of(model.metadata)
        except ValueError:
            cal = None
        covered = set(cal["tables"]) if cal is not None else set()
        covers = sum(table_signature(t) in covered for t in tables)
        here = cal is not None and cal["fingerprint_key"] == fingerprint_key
        name = "the bundled CPU model" if origin == "bundled" else _show(path or Path("?"))
        given = ORIGINS.get(origin, origin)
        if cal is not None:
            date = str(cal.get("created_at", ""))[:10]
            where = "this machine" if here else f"another machine, {_machine(model.fingerprint)},"
            what = f"calibrated on {where} on {covers} of these {len(tables)} tables"
            what += (", the closest in the model cache" if closest else "") + (
                f", {date}" if date else ""
            )
            if not here:
                what += "; not for this machine"
        else:
            trained_here = model.metadata.get("fingerprint_key") == fingerprint_key
            what = (
                "pre-trained on this machine's hardware, not calibrated on these tables"
                if trained_here
                else f"not calibrated: pre-trained on {_machine(model.fingerprint)}, "
                "not on this machine nor on these tables"
            )
        note = f"cost model: {name} ({given + '; ' if given else ''}{what})"
        return cls(model, path, here, covers, len(tables), note, origin)


@dataclass(frozen=True)
class _Entry:
    path: Path
    model: CostModel
    created: float


def _reason(err: BaseException, path: Path) -> str:
    """A load error as a clause: without the file's name (the warning names it) and
    without the advice to re-train (the warning says what to do)."""
    text = " ".join(str(err).split())
    text = text.removeprefix(str(path)).lstrip(": ").strip()
    for advice in (" Re-create it", " Re-train it"):
        text = text.split(advice)[0]
    text = text.rstrip(".") or type(err).__name__
    return "it " + text if text.startswith("is ") else text


def _misplaced(model: CostModel, cal: Mapping[str, Any] | None, key: str) -> str | None:
    """Why a model that loads is still no entry of machine ``key``'s folder, or None."""
    if cal is None:
        return "it holds no calibration (metadata.calibration)"
    if cal["fingerprint_key"] != key:
        return f"it was calibrated on machine {cal['fingerprint_key']}, but sits in {key}'s folder"
    if not isinstance(model.metadata.get("fingerprint"), Mapping):
        return "it records no fingerprint (metadata.fingerprint)"
    return None


def _temporary(folder: Path, name: str) -> tuple[Path, int]:
    """A new file of this writer's own beside the entry (never a ``.pt``, so readers
    skip it), open for writing."""
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
    raise OSError(f"no free temporary name in {folder}")  # pragma: no cover


class ModelCache:
    """Calibrated models of this user, by machine (see the module docstring)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_root()

    def directory(self, fingerprint_key: str) -> Path:
        if not _KEY.match(fingerprint_key):
            raise UserError(
                f"{fingerprint_key!r} is not a hardware fingerprint key (16 hex digits, "
                "as Fingerprint.key() gives); the model cache is kept by those."
            )
        return self.root / fingerprint_key

    def store(self, model: CostModel, fingerprint_key: str) -> Path:
        """Write a calibrated model as its entry, whole or not at all; the path.

        The covered set is ``model.metadata["calibration"]["tables"]``. Each call writes
        its own temporary file (unique name, fsync), renames it over the entry and
        syncs the folder: concurrent writers of one entry leave one of them, whole.
        """
        folder = self.directory(fingerprint_key)
        try:
            cal = calibration_of(model.metadata)
        except ValueError as err:
            raise UserError(f"{model.source} cannot be cached: {err}.") from None
        if cal is None:
            raise UserError(
                f"{model.source} has no metadata.calibration; only calibrated models are "
                "cached (`shardwise calibrate` writes them)."
            )
        if cal["fingerprint_key"] != fingerprint_key:
            raise UserError(
                f"{model.source} was calibrated on machine {cal['fingerprint_key']}, not "
                f"{fingerprint_key}; it is cached under the machine it was measured on."
            )
        path = folder / entry_name(cal["tables"])
        payload = model.to_payload()
        tmp: Path | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp, fd = _temporary(folder, path.name)
            with open(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            fsync_dir(folder)
        except OSError as err:
            raise UserError(
                f"{path}: cannot write the cached cost model ({err}). Point "
                f"${ENV_CACHE} at a writable folder."
            ) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        return path

    def entries(self, fingerprint_key: str, warn: Warn) -> list[_Entry]:
        """Every usable entry for the machine; each unusable file is one warning."""
        folder = self.directory(fingerprint_key)
        try:
            paths = sorted(folder.glob("*.pt")) if folder.is_dir() else []
        except OSError as err:
            warn(f"cannot read the model cache {folder} ({err}); it is not used.")
            return []
        found: list[_Entry] = []
        for path in paths:
            try:
                model = CostModel.load(path)
                cal = calibration_of(model.metadata)
            except Exception as err:  # a foreign file must never stop a command
                warn(
                    f"skipped the cached cost model {path}: {_reason(err, path)}. "
                    "Delete it; `shardwise calibrate` writes a new one."
                )
                continue
            problem = _misplaced(model, cal, fingerprint_key)
            if problem is not None or cal is None:
                warn(
                    f"skipped the cached cost model {path}: {problem}. Delete it; "
                    "`shardwise calibrate` writes a new one."
                )
                continue
            found.append(_Entry(path, model, _created(cal, path)))
        return found

    def best(
        self, fingerprint_key: str, tables: Sequence[TableSpec], warn: Warn
    ) -> ModelChoice | None:
        """The entry for this machine covering every table (the newest of several),
        else the one covering most of them (the newest on a tie); None when the
        machine has no usable entry."""
        ranked: list[tuple[int, float, _Entry, ModelChoice]] = []
        for entry in self.entries(fingerprint_key, warn):
            choice = ModelChoice.of_model(entry.model, entry.path, "cache", fingerprint_key, tables)
            ranked.append((choice.covers, entry.created, entry, choice))
        if not ranked:
            return None
        covers, _, entry, choice = max(ranked, key=lambda r: (r[0], r[1], str(r[2].path)))
        if covers < len(tables):  # say it is the closest, not a full match
            choice = ModelChoice.of_model(
                entry.model, entry.path, "cache", fingerprint_key, tables, closest=True
            )
        return choice

    def select(self, fingerprint_key: str, tables: Sequence[TableSpec], warn: Warn) -> ModelChoice:
        """:meth:`best`, else the bundled model (a :class:`UserError` if not installed)."""
        choice = self.best(fingerprint_key, tables, warn)
        if choice is not None:
            return choice
        return ModelChoice.of_model(load_bundled(), None, "bundled", fingerprint_key, tables)

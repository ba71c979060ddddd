"""A benchmark's results folder: one JSON line per finished task, resumable.

``results.jsonl`` gets a task's line (one ``write`` and ``fsync``) the moment its
plans are measured, so Ctrl-C or a crash loses only the task in flight; a rerun
skips the finished tasks. ``bench.json`` records what the folder measures (spec,
planners, machine); a rerun with anything else is refused rather than mixing
figures that were not measured side by side. A torn last line (the process died
mid-write) is cut; a damaged line followed by good ones is refused, not dropped.

Schema 3 added each task's cost-model quality (:class:`ModelQuality`). A schema-2
folder is read and upgraded in place: :mod:`~shardwise.profiler.bench.run` recomputes
the figures from the saved plans and models, then :meth:`ResultsFolder.rewrite`
replaces the lines and the manifest. Any other schema is refused with what to do.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardwise.basics import UserError

RESULTS = "results.jsonl"
MANIFEST = "bench.json"
SCHEMA_VERSION = 3
#: Schemas read and upgraded in place (2: no per-task model quality).
UPGRADES_FROM = (2,)


@dataclass(frozen=True)
class PlannerResult:
    """One row (a planner, or a NeuroShard variant) on one task: its plan, its planning
    and refinement time, and what the evaluator measured."""

    planner: str
    #: "ok"; "plan-failed" (no plan); "invalid-plan" (the planner's plan broke a rule
    #: of the validator: a bug, ``error`` says which); "measure-failed" (the plan could
    #: not be measured); "skipped" (refinement was not possible here; ``error`` says why).
    status: str
    error: str | None = None
    plan_hash: str | None = None
    planning_s: float | None = None
    measure_s: float = 0.0  # measurements taken while planning (torchrec-measured)
    refine_s: float | None = None  # measured refinement, on top of its start's planning
    model: str | None = None  # the cost model a NeuroShard row searched with
    max_s: float | None = None  # compute + comm, max over ranks of per-rank medians
    compute_max_s: float | None = None  # fwd + bwd compute only, max over ranks
    compute_per_rank: list[float] = field(default_factory=list)
    max_per_repeat: list[float] = field(default_factory=list)
    repeat_cv: float | None = None  # of the total over the repeats
    compute_max_per_repeat: list[float] = field(default_factory=list)
    compute_repeat_cv: float | None = None
    #: [repeat][rank] fwd + bwd compute (empty in lines recorded before it).
    compute_per_repeat: list[list[float]] = field(default_factory=list)
    column_wise_tables: int = 0
    #: Tables of each sharding kind in the plan (``Plan.kinds``); empty before kinds.
    kinds: dict[str, int] = field(default_factory=dict)
    device: str | None = None  # where it was measured
    refinement: dict[str, Any] | None = None  # the plan's record of its refinement
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.max_s is not None


def kinds_text(kinds: dict[str, int]) -> str:
    """``"TW 52, TWRW 24, DP 4"``: a plan's tables per sharding kind, most first."""
    from shardwise.planner.kinds import SHORT

    ordered = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{SHORT.get(k, k)} {n}" for k, n in ordered)


@dataclass(frozen=True)
class ModelQuality:
    """How one cost model priced the ranks a task measured: its predicted per-rank
    compute (fwd + bwd) against the evaluator's, over the ranks that hold a shard in
    every distinct plan measured in the task (docs/design.md §14)."""

    model: str  # the model's identity (file name and hash)
    plans: int
    ranks: int
    spearman: float | None  # None: fewer than two ranks, or no spread to rank
    mape: float | None  # a fraction


@dataclass(frozen=True)
class MixedRank:
    """One mixed-kind rank of a measured plan: what a model priced it at, and what the
    evaluator measured (fwd + bwd compute), so runs can be pooled
    (``benchmarks/kinds_fidelity.py``)."""

    plan: str  # the plan's hash
    rows: list[str]  # the rows whose plan it is
    rank: int
    groups: list[str]  # its kernel groups other than the fused one (row_wise, ...)
    predicted_s: float
    measured_s: float  # the median over the repeats
    #: Each repeat's measurement (empty in lines recorded before it): the
    #: measurement's own agreement from repeat to repeat bounds any model's rho.
    measured_per_repeat: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TaskResult:
    """One task: its tables, memory and batch, the comm it was judged with, the balance
    bound and every row."""

    task: str
    pool: str
    fill_kind: str
    tables: int
    gpus: int
    index: int
    seed: int
    table_names: list[str]
    global_batch: int
    batch_size_per_rank: int
    gpu_memory_bytes: int
    usable_bytes: int
    memory_total: int
    fill: float
    fill_bound: float
    repeats: int
    device: str
    comm: str  # the evaluator's comm, as CommModel.describe()
    planner_comm: str  # the comm planners priced with
    bound_s: float
    bound_per_repeat: list[float]
    bound_cv: float
    heaviest_table_s: float
    evaluation_s: float
    planners: dict[str, PlannerResult]
    #: Per model kind ("bundled", "calibrated"); empty in a schema-2 line until upgraded.
    model_quality: dict[str, ModelQuality] = field(default_factory=dict)
    #: Tables no GPU of the task holds whole (a pool sized ``balanced``).
    oversized: int = 0
    #: Per model kind, every mixed-kind rank of the task's measured plans; None: a
    #: line recorded before them.
    mixed_kind: dict[str, list[MixedRank]] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["planners"] = {name: asdict(r) for name, r in self.planners.items()}
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TaskResult:
        planners = {name: PlannerResult(**r) for name, r in doc["planners"].items()}
        quality = {k: ModelQuality(**q) for k, q in (doc.get("model_quality") or {}).items()}
        got = doc.get("mixed_kind")
        mixed = (  # anything but a mapping: not recorded
            {k: [MixedRank(**r) for r in ranks] for k, ranks in got.items()}
            if isinstance(got, dict)
            else None
        )
        return cls(**{**doc, "planners": planners, "model_quality": quality, "mixed_kind": mixed})


class ResultsFolder:
    """``DIR/bench.json`` + ``DIR/results.jsonl``; see the module docstring."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.path = directory / RESULTS
        #: The schema an older folder was written with, until :meth:`rewrite` upgrades it.
        self.upgrading_from: int | None = None
        directory.mkdir(parents=True, exist_ok=True)
        self.manifest = {"schema_version": SCHEMA_VERSION, **manifest}
        self._check_manifest(self.manifest)
        self.done: dict[str, TaskResult] = self._read()

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        path = self.directory / MANIFEST
        if path.exists():
            try:
                old = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as err:
                raise UserError(
                    f"{path}: cannot read it ({err}); delete the folder or use another --out."
                ) from None
            schema = old.get("schema_version")
            if schema != SCHEMA_VERSION and schema not in UPGRADES_FROM:
                raise UserError(
                    f"{self.directory} was written by another version of shardwise "
                    f"(results schema {schema!r}; this one reads {SCHEMA_VERSION} and "
                    f"upgrades {', '.join(map(str, UPGRADES_FROM))}). Rerun into another "
                    "--out, or delete the folder."
                )
            if schema != SCHEMA_VERSION:
                self.upgrading_from = schema
            differs = [
                k
                for k in sorted(set(old) | set(manifest))
                if k not in ("created_at", "schema_version") and old.get(k) != manifest.get(k)
            ]
            if differs:
                k = differs[0]
                raise UserError(
                    f"{self.directory} holds a benchmark of another setup ({k!r} was "
                    f"{old.get(k)!r}, now {manifest.get(k)!r}); its figures would not be "
                    "side by side with these. Use another --out, or delete the folder."
                )
            return
        self._write_manifest(manifest)

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        path = self.directory / MANIFEST
        tmp = path.with_name(MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)

    def rewrite(self, results: list[TaskResult]) -> None:
        """Replace every line with ``results`` (an upgrade's filled-in lines), then mark
        the folder as this schema; each file is replaced whole, so a crash between the
        two leaves a folder that upgrades again to the same lines."""
        tmp = self.path.with_name(RESULTS + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
        self.done = {r.task: r for r in results}
        old = json.loads((self.directory / MANIFEST).read_text(encoding="utf-8"))
        self._write_manifest({**old, "schema_version": SCHEMA_VERSION})
        self.upgrading_from = None

    def _read(self) -> dict[str, TaskResult]:
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        done: dict[str, TaskResult] = {}
        good_end = 0
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                good_end += len(line) + 1
                continue
            try:
                result = TaskResult.from_json(json.loads(line))
            except (ValueError, TypeError, KeyError) as err:
                if all(not rest.strip() for rest in lines[n:]):  # torn last line: cut it
                    with self.path.open("r+b") as f:
                        f.truncate(min(good_end, len(raw)))
                    break
                raise UserError(
                    f"{self.path}, line {n}: not a task result ({err}), and good lines "
                    "follow it; the file was edited or damaged. Fix or delete that line."
                ) from None
            done[result.task] = result
            good_end += len(line) + 1
        return done

    def append(self, result: TaskResult) -> None:
        line = json.dumps(result.to_json(), separators=(",", ":")) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.done[result.task] = result

"""The cost models the benchmark's NeuroShard rows search with (docs/bench.md).

- ``bundled``: the model shipped in the package, as a new user gets it.
- ``calibrated``: the bundled model calibrated on this machine by the pipeline of
  ``shardwise calibrate`` (:func:`shardwise.profiler.calibrate.calibrate`), within
  ``calibration_minutes``: once per pool, on *the pool's tables* (every task is drawn
  from its pool) for the largest W, or, with ``calibrate_on: task``, once per task on
  its own tables, W, batch and GPU memory, as a job is calibrated. The model and the
  calibration's summary are written into the results folder (``models/<key>.pt``,
  ``.json``), so a resumed run reuses them; the samples go to
  ``calibration/<key>/`` (resumable, as calibrate's are). Nothing
  is read from or written to the user's model cache: the bench judges these two
  models only.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.planner.tables import TableSpec
from shardwise.profiler.bench.spec import BenchSpec

if TYPE_CHECKING:
    from shardwise.planner.costmodel.artifact import CostModel

MODELS_DIR = "models"
CALIBRATION_DIR = "calibration"


@dataclass(frozen=True)
class BenchModel:
    """A model a row searches with, and how the outputs name it."""

    kind: str  # "bundled" or "calibrated"
    model: CostModel
    identity: str  # file name and content hash
    calibration: dict[str, Any] | None = None  # the summary of its calibration


def file_identity(path: Path) -> str:
    """``name sha256:<16 hex>`` of a model file (what a results folder records)."""
    if not path.is_file():
        return f"{path} (missing)"
    return f"{path.name} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


def bundled_model() -> BenchModel:
    from shardwise.planner.costmodel.artifact import BUNDLED_MODEL, load_bundled

    return BenchModel("bundled", load_bundled(), file_identity(BUNDLED_MODEL))


def calibrated_model(
    spec: BenchSpec,
    pool_key: str,
    pool: Sequence[TableSpec],
    base: BenchModel,
    out_dir: Path,
    *,
    device: str | None,
    on_step: Callable[[str], None],
    gpus: int | None = None,
    gpu_memory: int | None = None,
) -> BenchModel:
    """``base`` calibrated on ``pool`` (see the module docstring) for ``gpus`` (the
    spec's largest W when not given) and ``gpu_memory``; read back from ``out_dir``
    when an earlier run calibrated it. ``pool_key`` names it (a pool's, or a task's
    when the spec calibrates per task)."""
    from shardwise.planner.costmodel.artifact import CostModel
    from shardwise.profiler.calibrate import Budget, Job, PhaseProgress, calibrate

    path = out_dir / MODELS_DIR / f"{pool_key}.pt"
    summary_path = path.with_suffix(".json")
    if path.is_file() and summary_path.is_file():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        return BenchModel("calibrated", CostModel.load(path), file_identity(path), summary)
    gpus = gpus or max(s.gpus for s in spec.shapes)
    job = Job(tuple(pool), gpus, spec.rank_batch(gpus), spec.seed, gpu_memory)
    start = time.perf_counter()

    def progress(p: PhaseProgress) -> None:
        on_step(f"calibrating on the {pool_key} pool: {p.text} ({p.elapsed_s:.0f} s)")

    result = calibrate(
        job,
        base.model,
        "bundled",
        out_dir / CALIBRATION_DIR / pool_key,
        Budget(spec.calibration_minutes * 60.0),
        device=device,
        on_progress=progress,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    result.model.save(path)
    metrics = result.calibration.get("metrics", {})
    summary = {
        "pool": pool_key,
        "tables": len(pool),
        "global_batch": job.global_batch,
        "seconds": round(time.perf_counter() - start, 1),
        "samples": result.totals,
        "phases": result.calibration.get("phases"),
        "heldout": {k: metrics.get(k) for k in ("base", "speed_only", "final")},
        "verdict": (result.calibration.get("verdict") or {}).get("text"),
        "notes": result.notes,
    }
    tmp = summary_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(summary_path)
    return BenchModel("calibrated", result.model, file_identity(path), summary)

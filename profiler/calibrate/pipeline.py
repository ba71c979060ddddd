"""``shardwise calibrate`` end to end: speed, measure, fine-tune, within one budget.

The phases share the budget (``--minutes``), in this order:

1. **speed** (at most 60 s and 20 % of the budget): a few dozen kernels of the job's
   training tables at the job's batch, and a few small all-to-alls on two ranks, to
   which the base model's factors are fitted (:mod:`.speed`), together with every
   kernel of the training tables the next phase adds. Every budget ends with a model
   carrying them.
2. **measure**: augmented job tables, validation and test tables and the reference
   set (:mod:`.tasks`), until only the fine-tune's share of the budget is left.
3. **fine-tune** (10 % of the budget, at least 8 s; it often needs less): the compute network on all
   of it, early-stopped on the validation tables (:mod:`.finetune`); then the
   held-out metrics (:mod:`.heldout`) of the base, the base with factors, and the
   result.

All samples go to resumable datasets under the work directory (``speed/``,
``compute/``, ``comm/``): Ctrl-C keeps them, and the same command resumes, measuring
more and fine-tuning on everything there is.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import shardwise
from shardwise.basics import UserError
from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.tables import tables_signatures
from shardwise.profiler.calibrate.finetune import FineTune, finetune
from shardwise.profiler.calibrate.heldout import heldout_metrics
from shardwise.profiler.calibrate.measure import (
    COMM_WORLD,
    Counts,
    comm_cases,
    load_records,
    measure_comm_missing,
    measure_compute_until,
)
from shardwise.profiler.calibrate.speed import SpeedFit, fit_speed
from shardwise.profiler.calibrate.tasks import (
    CalibrationTasks,
    Job,
    Task,
    available_memory,
    feasible_batches,
    memory_limit,
    reference_tables,
)
from shardwise.profiler.fingerprint import Fingerprint, current_fingerprint
from shardwise.profiler.pretrain.training import EpochProgress

SPEED_MAX_S = 60.0
SPEED_SHARE = 0.20
FINETUNE_SHARE = 0.10
FINETUNE_MIN_S = 8.0
#: Kernels the speed phase measures at most ("a few dozen"); a resumed run adds none
#: once they are there.
SPEED_SAMPLES = 36
#: The all-to-all samples need one launch of two workers (about 4–6 s on 2 cores):
#: measured only when the speed phase has at least this long.
COMM_MIN_SPEED_S = 10.0
COMM_RESERVE_S = 6.0
#: Below this no budget can measure a sample and fit anything.
MIN_BUDGET_S = 20.0


@dataclass(frozen=True)
class Budget:
    """The seconds each phase may take, from the whole budget."""

    total_s: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.total_s) or self.total_s < MIN_BUDGET_S:
            raise UserError(
                f"--minutes {self.total_s / 60:g} ({self.total_s:.0f} s) is too short for any "
                f"sample: the speed phase alone needs a reference kernel and a few kernels of "
                f"the job. Give --minutes {MIN_BUDGET_S / 60:g} or more (10 is the default)."
            )

    @property
    def speed_s(self) -> float:
        return min(SPEED_MAX_S, SPEED_SHARE * self.total_s)

    @property
    def finetune_s(self) -> float:
        return max(FINETUNE_MIN_S, FINETUNE_SHARE * self.total_s)


@dataclass(frozen=True)
class PhaseProgress:
    """Passed to ``on_progress`` after every sample and epoch (the CLI's bar)."""

    phase: str  # "speed", "measure", "fine-tune"
    elapsed_s: float
    budget_s: float
    text: str


@dataclass
class CalibrationResult:
    """The calibrated model and what the CLI prints about it."""

    model: CostModel
    calibration: dict[str, Any]
    work_dir: Path
    #: (phase or kind, global batch) -> samples measured by this run.
    measured: dict[tuple[str, int], int]
    #: samples in the datasets now, by kind (this run's and earlier ones').
    totals: dict[str, int]
    phase_seconds: dict[str, float]
    speed: SpeedFit
    notes: list[str] = field(default_factory=list)


def default_work_dir(root: Path, fingerprint: Fingerprint, job: Job) -> Path:
    """``<cache root>/work/<fingerprint key>/<job key>``: the resumable datasets."""
    return root / "work" / fingerprint.key() / job.key()


def calibrate(
    job: Job,
    base: CostModel,
    base_name: str,
    work_dir: Path,
    budget: Budget,
    *,
    from_scratch: bool = False,
    device: str | None = None,
    max_samples: int | None = None,
    speed_samples: int = SPEED_SAMPLES,
    tiny: bool = False,
    on_progress: Callable[[PhaseProgress], None] | None = None,
) -> CalibrationResult:
    """Calibrate ``base`` for ``job`` on this machine within ``budget`` (see the module
    docstring). ``max_samples`` caps the measuring phase's indices and ``speed_samples``
    the speed phase's (tests, and runs that want a fixed dataset); ``tiny`` trains small
    networks from scratch (tests)."""
    start = time.monotonic()
    fingerprint = current_fingerprint(device)
    limit = memory_limit(device)
    now = available_memory(device)
    if now is not None and now < limit:  # the job's batch must fit what is free now
        feasible_batches(job, now)
    batches = feasible_batches(job, limit)
    tasks = CalibrationTasks(job, batches, limit)  # the reference set: after the speed phase
    run = _Run(start, budget, on_progress)
    notes: list[str] = []
    if not tasks.split.test:
        notes.append("one table: no table is held out, so there are no held-out metrics")

    # ---------------------------------------------------------------- speed
    settings = {"job": job.key(), "purpose": "speed", "batch_size": job.global_batch}
    speed_dir = work_dir / "speed"
    with_comm = base.comm is not None and budget.speed_s >= COMM_MIN_SPEED_S
    reserve = COMM_RESERVE_S if with_comm else 0.0
    counts = measure_compute_until(
        speed_dir,
        fingerprint,
        settings,
        tasks.speed_task,
        start + budget.speed_s - reserve,
        seed=job.seed,
        max_samples=speed_samples,
        device=device,
        on_sample=run.sampled("speed"),
    )
    measured = dict(counts.by_kind)
    speed_records = load_records(speed_dir)
    if not speed_records:
        raise UserError(
            f"--minutes {budget.total_s / 60:g} was too short for any sample of the speed "
            f"phase ({budget.speed_s:.0f} s for it; the job's kernels at batch "
            f"{job.global_batch} take longer here). Give a larger --minutes."
        )
    comm_records: list[dict[str, Any]] = []
    if with_comm:
        comm_dir = work_dir / "comm"
        comm_settings = {"job": job.key(), "purpose": "speed", "world_size": COMM_WORLD}
        run.say("speed", "timing all-to-alls on 2 ranks")
        got = measure_comm_missing(
            comm_dir, fingerprint, comm_settings, comm_cases(job), job.batch_per_rank
        )
        measured.update(got.by_kind)
        comm_records = load_records(comm_dir)
    elif base.comm is not None:
        notes.append(
            f"the speed phase had under {COMM_MIN_SPEED_S:.0f} s: no all-to-all was timed, "
            "so the comm factor is the base model's"
        )
    phase_seconds = {"speed": run.elapsed()}

    # ---------------------------------------------------------------- measure
    tasks.reference = reference_tables()
    settings = {
        "job": job.key(),
        "purpose": "calibrate",
        "batch_sizes": batches,
        "memory_limit": limit,
    }
    compute_dir = work_dir / "compute"
    counts = measure_compute_until(
        compute_dir,
        fingerprint,
        settings,
        tasks.task,
        start + budget.total_s - budget.finetune_s,
        seed=job.seed,
        max_samples=max_samples,
        device=device,
        on_sample=run.sampled("measure"),
    )
    _merge(measured, counts)
    records = load_records(compute_dir)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_kind.setdefault(str(r.get("extra", {}).get("kind", "train")), []).append(r)
    phase_seconds["measure"] = run.elapsed() - phase_seconds["speed"]
    # The factors again, on every kernel of the job's training tables measured by now:
    # the speed phase's few dozen fix the offset, these fix it better.
    speed = fit_speed(base, [*speed_records, *by_kind.get("train", [])], comm_records)
    speeded = _with_factors(base, speed)

    # ---------------------------------------------------------------- fine-tune
    run.say("fine-tune", "fine-tuning")
    tuned = finetune(
        speeded,
        speed.factors,
        [*speed_records, *by_kind.get("train", []), *by_kind.get("reference", [])],
        by_kind.get("val", []),
        seed=job.seed,
        deadline=start + budget.total_s - 2.0,
        from_scratch=from_scratch or tiny,
        hidden=16 if tiny else 64,
        on_epoch=run.epoch,
    )
    notes.extend(tuned.notes)
    final = copy.copy(speeded)
    final.compute = tuned.net
    test = by_kind.get("test", [])
    metrics = {
        "final": heldout_metrics(final, test, job.gpus, job.seed),
        "base": heldout_metrics(base, test, job.gpus, job.seed),
        "speed_only": heldout_metrics(speeded, test, job.gpus, job.seed),
        "test_tables": len(tasks.split.test),
        "val_tables": len(tasks.split.val),
        "train_tables": len(tasks.split.train),
    }
    phase_seconds["finetune"] = run.elapsed() - phase_seconds["speed"] - phase_seconds["measure"]
    totals = {"speed": len(speed_records), "comm": len(comm_records)}
    totals.update({k: len(v) for k, v in sorted(by_kind.items())})
    calibration = {
        "fingerprint_key": fingerprint.key(),
        "tables": tables_signatures(job.tables),
        "batch_sizes": sorted({job.global_batch, *(int(r["batch_size"]) for r in records)}),
        "base": base_name,
        "speed_factors": speed.factors.to_dict(),
        "phases": ["speed", "finetune"] if tuned.kept else ["speed"],
        "samples": {"compute": len(speed_records) + len(records), "comm": len(comm_records)},
        "seconds": round(run.elapsed(), 1),
        "metrics": metrics,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "job": {"gpus": job.gpus, "batch_per_rank": job.batch_per_rank, "seed": job.seed},
        "speed": speed.to_json(),
        "finetune": tuned.to_json(),
        "samples_by_kind": totals,
        "notes": list(notes),
    }
    final.metadata = _metadata(base, fingerprint, calibration, tuned, records)
    final.source = "the calibrated cost model"
    return CalibrationResult(
        final,
        final.metadata["calibration"],
        work_dir,
        measured,
        totals,
        phase_seconds,
        speed,
        notes,
    )


def _merge(into: dict[tuple[str, int], int], counts: Counts) -> None:
    for key, n in counts.by_kind.items():
        into[key] = into.get(key, 0) + n


def _with_factors(base: CostModel, speed: SpeedFit) -> CostModel:
    """``base`` with ``speed``'s factors (a copy; the base is left as it was)."""
    metadata = copy.deepcopy(base.metadata)
    calibration = dict(metadata.get("calibration") or {})
    calibration["speed_factors"] = speed.factors.to_dict()
    metadata["calibration"] = calibration
    return CostModel(base.compute, base.comm, metadata, base.source)


def _metadata(
    base: CostModel,
    fingerprint: Fingerprint,
    calibration: dict[str, Any],
    tuned: FineTune,
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """The base's metadata, for this machine, with ``calibration`` (plain JSON only,
    so the file loads weights-only)."""
    metadata = copy.deepcopy(base.metadata)
    metadata["fingerprint"] = fingerprint.to_dict()
    metadata["fingerprint_key"] = fingerprint.key()
    metadata["code_version"] = shardwise.__version__
    if tuned.kept:  # the networks now learnt these batches too
        trained = {int(b) for b in metadata.get("batch_sizes", [])}
        trained |= {int(r["batch_size"]) for r in records}
        metadata["batch_sizes"] = sorted(trained)
    metadata["calibration"] = calibration
    out: dict[str, Any] = json.loads(json.dumps(metadata, default=float, allow_nan=False))
    return out


class _Run:
    """The clock and the progress callbacks of one calibration."""

    def __init__(
        self,
        start: float,
        budget: Budget,
        on_progress: Callable[[PhaseProgress], None] | None,
    ) -> None:
        self.start, self.budget, self.on_progress = start, budget, on_progress
        self.samples: dict[str, int] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, phase: str, text: str) -> None:
        if self.on_progress:
            self.on_progress(PhaseProgress(phase, self.elapsed(), self.budget.total_s, text))

    def sampled(self, phase: str) -> Callable[[Task], None]:
        def on_sample(task: Task) -> None:
            self.samples[phase] = self.samples.get(phase, 0) + 1
            self.say(
                phase,
                f"{phase}: {self.samples[phase]} kernels (last: {task.kind}, "
                f"{len(task.tables)} tables at batch {task.batch_size})",
            )

        return on_sample

    def epoch(self, p: EpochProgress) -> None:
        self.say(
            "fine-tune",
            f"fine-tune: epoch {p.epoch}, validation loss {p.val_loss:.4f} "
            f"(best {p.best_val_loss:.4f})",
        )

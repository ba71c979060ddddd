"""The calibration's measuring loops: time-boxed, resumable, nothing lost.

Each loop appends to a cost dataset (:mod:`shardwise.profiler.dataset.store`) one sample at
a time, fsync'd as it is measured, so Ctrl-C or a killed pod keeps every finished
sample; the dataset's settings name the job, so re-running the same calibration
reopens it and measures the first indices still missing (the tasks are pure
functions of the index, :mod:`.tasks`). A loop stops before a sample it expects to
end after its deadline, judged by the mean time of the samples it measured so far.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.profiler.calibrate.tasks import Job, Task
from shardwise.profiler.collect import (
    REFERENCE_EVERY,
    append_comm_result,
    measure_compute_sample,
    measure_loads_sample,
    reference_seconds,
)
from shardwise.profiler.comm import CommCase, measure_comm_many
from shardwise.profiler.dataset.store import CostDataset
from shardwise.profiler.fingerprint import Fingerprint

#: Timed calls per kernel: measured refinement's (fewer than the evaluator's 5 + 10),
#: since this host's speed drifts over seconds and more kernels beat longer ones.
WARMUPS = 3
ITERS = 7
#: All-to-all samples of the speed phase: one launch of two workers.
COMM_SAMPLES = 4
COMM_WORLD = 2
_COMM_KEY = 24


@dataclass
class Counts:
    """Samples in a dataset after a loop: measured now, found from an earlier run."""

    measured: int = 0
    resumed: int = 0
    #: (kind, global batch) -> samples measured now.
    by_kind: dict[tuple[str, int], int] = field(default_factory=dict)


def measure_compute_until(
    directory: Path,
    fingerprint: Fingerprint,
    settings: Mapping[str, Any],
    task_of: Callable[[int], Task],
    deadline: float,
    *,
    seed: int,
    max_samples: int | None = None,
    device: str | None = None,
    on_sample: Callable[[Task], None] | None = None,
) -> Counts:
    """Measure samples 0, 1, … of ``task_of`` that ``directory`` lacks, until the
    ``deadline`` (``time.monotonic()``) or ``max_samples`` indices are covered."""
    counts = Counts()
    with CostDataset.create_or_open(directory, "compute", fingerprint, settings) as ds:
        done = ds.done_indices()
        counts.resumed = len(done)
        took: list[float] = []
        reference = 0.0
        i = -1
        while True:
            i += 1
            if max_samples is not None and i >= max_samples:
                break
            if i in done:
                continue
            expected = statistics.fmean(took) if took else 0.0
            if time.monotonic() + expected >= deadline:
                break
            task = task_of(i)
            if task.empty:  # nothing of the pool fits here: never measured
                continue
            if counts.measured % REFERENCE_EVERY == 0:
                reference = reference_seconds()
            start = time.monotonic()
            extra = {"kind": task.kind, **dict(task.extra)}
            if task.loads:
                measure_loads_sample(
                    ds,
                    i,
                    task.loads,
                    task.batch_size,
                    task.local_batch,
                    seed=seed + i,
                    device=device,
                    reference_s=reference,
                    extra=extra,
                    warmups=WARMUPS,
                    iters=ITERS,
                )
            else:
                measure_compute_sample(
                    ds,
                    i,
                    task.tables,
                    task.batch_size,
                    seed=seed + i,
                    device=device,
                    reference_s=reference,
                    extra=extra,
                    warmups=WARMUPS,
                    iters=ITERS,
                )
            took.append(time.monotonic() - start)
            counts.measured += 1
            key = (task.kind, task.batch_size)
            counts.by_kind[key] = counts.by_kind.get(key, 0) + 1
            if on_sample:
                on_sample(task)
    return counts


def comm_cases(job: Job, n: int = COMM_SAMPLES) -> list[CommCase]:
    """Small all-to-alls on two ranks, each about as wide as one rank of the job
    (the job's total width / GPUs, ×0.5–1.5), without start delays; after each, a
    reduce-scatter and an all-reduce sized like the job's (×0.5–1.5): at two ranks a
    ring moves B·D·4 bytes a rank, so width ``D·(W − 1)`` matches the job's W-rank ring
    for its widest table, and ``N·2(W − 1)/W`` elements the job's all-reduce of its
    i-th smallest fp32 table (its data-parallel candidates). None for a one-GPU job."""
    from shardwise.profiler.calibrate.plans import dp_candidates

    width = sum(t.dim for t in job.tables) / job.gpus
    widest = max(t.dim for t in job.tables)
    small = [job.tables[i] for i in dp_candidates(job.tables, n)]
    cases = []
    for i in range(n):
        rng = np.random.default_rng(np.random.SeedSequence(job.seed, spawn_key=(_COMM_KEY, i)))
        dims = [max(4, 4 * round(width * float(rng.uniform(0.5, 1.5)) / 4)) for _ in range(2)]
        scatter: list[int] = []
        reduce: list[int] = []
        if job.gpus >= 2:
            u = float(rng.uniform(0.5, 1.5))
            scatter.append(max(4, 4 * round(widest * (job.gpus - 1) * u / 4)))
            if small:
                t = small[i % len(small)]
                share = 2 * (job.gpus - 1) / job.gpus
                reduce.append(min(max(1, round(t.rows * t.dim * share * u)), 2**24))
        cases.append(CommCase(dims, [0.0] * COMM_WORLD, scatter, reduce))
    return cases


def measure_comm_missing(
    directory: Path,
    fingerprint: Fingerprint,
    settings: Mapping[str, Any],
    cases: Sequence[CommCase],
    batch_per_rank: int,
) -> Counts:
    """Measure the cases ``directory`` lacks, in one launch of the workers."""
    counts = Counts()
    with CostDataset.create_or_open(directory, "comm", fingerprint, settings) as ds:
        done = ds.done_indices()
        counts.resumed = len(done & set(range(len(cases))))
        todo = [i for i in range(len(cases)) if i not in done]
        if not todo:
            return counts
        results = measure_comm_many([cases[i] for i in todo], batch_per_rank)
        for i, res in zip(todo, results, strict=True):
            append_comm_result(ds, i, res)
            counts.measured += 1
        counts.by_kind[("comm", batch_per_rank)] = counts.measured
    return counts


def load_records(directory: Path) -> list[dict[str, Any]]:
    """A dataset's records by index; none when it does not exist yet."""
    if not (directory / "dataset.json").exists():
        return []
    return CostDataset.open(directory).load()


# --------------------------------------------------------------------------- repeats

#: Key in a repeated rank task's ``extra``: the index of the task it measures again.
REPEAT_OF = "repeat_of"
#: The most figures a rank gets (its first and the rounds again) when every planned
#: rank was measured before the deadline. Two left a burst of this host's load (+20-38 %
#: for ~10 s) in their mean: an industrial bench task's calibration, done in 66 s of its
#: 5 minutes, judged its held-out ranks 28 % off where the same model priced the bench's
#: ranks, re-timed twelve times, within 7.4 %. A median of five sets a burst aside.
RANK_FIGURES = 5


def repeat_tasks(
    tasks: Sequence[Task], records: Sequence[Mapping[str, Any]], figures: int = RANK_FIGURES
) -> list[Task]:
    """Every measured rank task again, in rounds up to ``figures`` figures a rank, each
    round noisiest first (by the spread of its calls): what a calibration that measured
    every planned rank before its deadline does with the time left, since more figures
    cut the noise in both the fit and the held-out error its verdict reports. A round
    ends before the next starts, so a deadline leaves every rank within one figure of
    the others. Deterministic given the first pass's records, so a resumed run numbers
    the repeats alike."""
    first = {int(r["index"]): r for r in records if int(r["index"]) < len(tasks)}
    order = sorted(first, key=lambda i: (-float(first[i].get("total_cv", 0.0)), i))
    return [
        replace(tasks[i], extra={**tasks[i].extra, REPEAT_OF: i})
        for _ in range(figures - 1)
        for i in order
    ]


def merge_repeats(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per rank task: a task measured again (:func:`repeat_tasks`) gets the
    median of its figures (of two, their mean), so it weighs as one rank."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        key = r.get("extra", {}).get(REPEAT_OF, r["index"])
        groups.setdefault(int(key), []).append(r)
    out = []
    for key in sorted(groups):
        group = groups[key]
        base = next((r for r in group if int(r["index"]) == key), group[0])
        if len(group) > 1:
            base = {
                **base,
                **{k: statistics.median(float(r[k]) for r in group) for k in ("fwd_s", "bwd_s")},
                "total_s": statistics.median(float(r["total_s"]) for r in group),
            }
        out.append(base)
    return out


@dataclass
class Again:
    """What :func:`measure_again` did: why the ranks stopped, the records with repeats
    merged, and the samples it measured."""

    stopped: str
    records: list[dict[str, Any]]
    counts: Counts


def measure_again(
    directory: Path,
    fingerprint: Fingerprint,
    settings: Mapping[str, Any],
    tasks: Sequence[Task],
    records: list[dict[str, Any]],
    deadline: float,
    *,
    seed: int,
    device: str | None,
    on_sample: Callable[[Task], None] | None = None,
) -> Again:
    """When every planned rank task has a record, the time left before ``deadline``
    measures them again, in rounds, noisiest first (:func:`repeat_tasks`), rather than ending
    early with advice to calibrate longer that a longer run could not follow. Returns
    why the ranks stopped (``"budget"`` when planned ranks were left unmeasured)."""
    planned = sum(1 for t in tasks if not t.empty)
    if sum(1 for r in records if int(r["index"]) < len(tasks)) < planned:
        return Again("budget", merge_repeats(records), Counts())
    again = repeat_tasks(tasks, records)
    counts = measure_compute_until(
        directory,
        fingerprint,
        settings,
        lambda i: [*tasks, *again][i],
        deadline,
        seed=seed,
        max_samples=len(tasks) + len(again),
        device=device,
        on_sample=on_sample,
    )
    records = load_records(directory)
    repeated = sum(1 for r in records if int(r["index"]) >= len(tasks))
    rounds = RANK_FIGURES - 1
    stopped = f"every planned rank was measured ({planned}), " + (
        f"and every one {rounds} more times (the median of {rounds + 1} figures)"
        if repeated >= len(again)
        else f"{repeated} figures again, in rounds, noisiest first"
    )
    return Again(stopped, merge_repeats(records), counts)

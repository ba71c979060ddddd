"""What a calibration measures: the job, its by-table split, and the kernels' tasks.

A calibration adapts a cost model to *the job's tables* on *this machine* and judges
it on what a search asks (docs/calibration.md, docs/design.md §14): what does a whole
rank of a plan for these tables cost, at the job's batch? So every sample is a fused
kernel at the job's global batch:

``anchor``   one job table alone, at its width or a column half (:mod:`.anchors`);
``rank``     a rank of a candidate plan for the *training* tables (:mod:`.plans`);
``heldout``  a rank of a candidate plan for the *test* tables: never fitted on.

The job's tables are split **by table** first (seeded, stratified by how much work a
table is, so both sides hold heavy and light tables): about 20 % are test tables.
Every task is a pure function of the job and the seed, or (plan ranks) written to the
work directory once, so a resumed calibration measures exactly the samples an
uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.tables import TableSpec, dump_tables
from shardwise.profiler.compute import MEMORY_SHARE, ShardLoad, footprint_bytes
from shardwise.profiler.sampling import batches_around

Kind = Literal["anchor", "rank", "heldout"]
TEST_TABLE_SHARE = 0.20
# Independent random streams per purpose (spawn keys under the user's seed).
_SPLIT_KEY = 21


@dataclass(frozen=True)
class Job:
    """The job a calibration is for: its tables, GPUs, per-GPU batch and (when known)
    the memory of one GPU, which bounds what a plan's rank holds."""

    tables: tuple[TableSpec, ...]
    gpus: int
    batch_per_rank: int
    seed: int = 0
    gpu_memory: int | None = None

    def __post_init__(self) -> None:
        if not self.tables:
            raise UserError("--tables holds no table; give the job's tables to calibrate on.")
        if self.gpus < 1 or self.batch_per_rank < 1:
            raise UserError("--gpus and --batch-per-rank must be >= 1.")
        if self.gpu_memory is not None and self.gpu_memory < 1:
            raise UserError("--gpu-memory must be a size above 0, e.g. 16GiB.")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise UserError("--tables names a table twice; table names must be unique.")

    @property
    def global_batch(self) -> int:
        """One rank's kernel reads the whole batch: batch per rank × GPUs."""
        return self.batch_per_rank * self.gpus

    def key(self) -> str:
        """16 hex digits of what decides the samples (tables, GPUs, batch, memory, seed)."""
        blob = json.dumps(
            {
                "tables": dump_tables(self.tables, "json"),
                "gpus": self.gpus,
                "batch_per_rank": self.batch_per_rank,
                "seed": self.seed,
                "gpu_memory": self.gpu_memory,
                "samples": "plan-ranks-v2",
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def work_proxy(spec: TableSpec, batch: int) -> float:
    """A table's work without a model: values it pools per batch (and a little per
    lookup), so that heavy tables sort first and the split is stratified by work."""
    return batch * spec.pooling_factor * (spec.dim + 8)


@dataclass(frozen=True)
class TableSplit:
    """The job's table names by role; disjoint, seeded."""

    train: tuple[str, ...]
    test: tuple[str, ...]


def split_tables(tables: Sequence[TableSpec], seed: int, batch: int = 1) -> TableSplit:
    """About 20 % test tables, one drawn from each run of five by work (heaviest first),
    so the held-out tables span the job's range; the rest for training. With fewer
    than four tables, none is held out."""
    order = sorted(tables, key=lambda t: (-work_proxy(t, batch), t.name))
    n = len(order)
    if n < 4:
        return TableSplit(train=tuple(sorted(t.name for t in order)), test=())
    rng = _rng(seed, _SPLIT_KEY, 0)
    step = round(1 / TEST_TABLE_SHARE)
    test: list[str] = []
    for start in range(0, n, step):
        chunk = order[start : start + step]
        if len(chunk) == step or not test:
            test.append(chunk[int(rng.integers(len(chunk)))].name)
    chosen = set(test)
    return TableSplit(
        train=tuple(sorted(t.name for t in order if t.name not in chosen)),
        test=tuple(sorted(chosen)),
    )


@dataclass(frozen=True)
class Task:
    """What to measure: its kind, either ``tables`` (one fused kernel of whole tables,
    each at its shard's width) or ``loads`` (a rank's shards of any kind, one kernel per
    group and precision, data-parallel ones at ``local_batch``), and its global batch;
    ``extra`` goes into the record (which table, plan and rank)."""

    kind: Kind
    tables: tuple[TableSpec, ...]
    batch_size: int
    extra: Mapping[str, Any] = field(default_factory=dict)
    loads: tuple[ShardLoad, ...] = ()
    local_batch: int | None = None

    @property
    def empty(self) -> bool:
        """Nothing to time (nothing of the pool fits here)."""
        return not self.tables and not self.loads

    @property
    def shard_count(self) -> int:
        return len(self.loads) or len(self.tables)


def _rng(seed: int, purpose: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(purpose, index)))


# --------------------------------------------------------------------------- memory


def memory_limit(device: str | None = None) -> int:
    """Bytes one measurement may hold: the compute benchmark's own share of the GPU's
    memory on ``cuda``, of the RAM on the CPU. A fixed number for a machine, so the
    samples it bounds stay the same when a calibration resumes."""
    from shardwise.profiler.compute import _device, _host_memory, _memory_limit

    dev = _device(device)
    if dev.type == "cuda":
        return _memory_limit(dev)[0]
    return int(_host_memory() * MEMORY_SHARE)


def available_memory(device: str | None = None) -> int | None:
    """What the kernel can give a CPU measurement now (MemAvailable); None on a GPU or
    where unknown."""
    from shardwise.profiler.compute import _device

    if _device(device).type == "cuda":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _largest_batch(spec: TableSpec, limit: int) -> int:
    """The largest global batch at which ``spec`` alone fits ``limit`` (0: none)."""
    fixed = footprint_bytes([ShardLoad.whole(spec)], 0)
    per_sample = footprint_bytes([ShardLoad.whole(spec)], 1) - fixed
    per_sample += int(8 * spec.pooling_factor) + 8  # its indices
    return max(0, (limit - fixed) // max(per_sample, 1))


def feasible_batches(job: Job, limit: int) -> list[int]:
    """The batches around the job's at which every table fits alone; a
    :class:`UserError` naming the table and the largest feasible batch if the job's own
    batch does not fit."""
    wanted = batches_around(job.global_batch)
    worst = min(job.tables, key=lambda t: _largest_batch(t, limit))
    top = _largest_batch(worst, limit)
    if top < job.global_batch:
        gib = limit / 2**30
        if top < job.gpus:
            raise UserError(
                f"table {worst.name!r} ({worst.rows} rows × {worst.dim}, {worst.dtype}) cannot "
                f"be profiled on this machine: its weights and optimizer state alone need "
                f"about {footprint_bytes([ShardLoad.whole(worst)], 1) / 2**30:.1f} GiB, more "
                f"than the {gib:.1f} GiB a measurement may use here. Calibrate on a machine "
                "with more memory, or split the table into narrower ones."
            )
        raise UserError(
            f"table {worst.name!r} ({worst.rows} rows × {worst.dim}, {worst.dtype}) does not fit "
            f"this machine's memory for profiling at the job's global batch {job.global_batch} "
            f"(--batch-per-rank {job.batch_per_rank} × --gpus {job.gpus}): weights, optimizer "
            f"state and output buffers need more than the {gib:.1f} GiB a measurement may use "
            f"here. The largest feasible global batch is about {top}: give --batch-per-rank "
            f"{top // job.gpus} or less, or calibrate on a machine with more memory."
        )
    return [b for b in wanted if b <= top]

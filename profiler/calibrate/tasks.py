"""What a calibration measures: the job, its by-table split, and every sample's task.

A calibration adapts a cost model to *the job's tables* on *this machine*
(docs/calibration.md). Its samples are fused kernels of augmented versions of the
job's tables (each table at its own width and at every halving down to 4, as a
column-wise shard would be), in random groups of 1–15 that fit the memory a
measurement may use, at global batches around the job's (half, the job's own, double).

The job's tables are split **by table** first (seeded): test tables are never trained
on, validation tables only steer early stopping. Sample ``i`` of the measuring phase
has a kind fixed by ``i`` (:data:`KIND_CYCLE`, 20 long):

``train``      a random group of training tables (11 of 20);
``val``        a random group of validation tables (3 of 20);
``test``       a *plan-like* kernel of test tables at the job's batch: about as many
               tables as one rank of the job holds (tables / GPUs), each at its own
               width or a halving (3 of 20);
``reference``  a random group of the generator's tables (``shardwise tables
               generate``, fixed seed): the general knowledge the model keeps (3 of 20).

The speed phase's samples are random groups of whole training tables at the job's
batch, at most one rank's share (tables / GPUs) each. Every task is a pure function of
``(seed, index)``, so a resumed calibration measures exactly the samples an
uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.tables import TableSpec, dump_tables
from shardwise.profiler.compute import MEMORY_SHARE, ShardLoad, footprint_bytes
from shardwise.profiler.sampling import (
    DEFAULT_MEMORY_CAP_BYTES,
    augment_by_halvings,
    augmented_name,
    batches_around,
    halvings,
)

Kind = Literal["speed", "train", "val", "test", "reference"]
#: Kinds of the measuring phase's sample ``i``: ``KIND_CYCLE[i % 20]`` (t = test,
#: v = validation, r = reference, j = training); spread so a short run has all kinds.
KIND_CYCLE = "jjtjrjvjtjrjvjtjrjjv"
_KINDS: dict[str, Kind] = {"j": "train", "v": "val", "t": "test", "r": "reference"}
TEST_TABLE_SHARE = 0.20
VAL_TABLE_SHARE = 0.15
MAX_TABLES = 15
#: The reference set: the calibrated generator's tables, always the same ones.
REFERENCE_COUNT = 16
REFERENCE_SEED = 17
REFERENCE_PREFIX = "reference-"
# Independent random streams per purpose (spawn keys under the user's seed).
_SPLIT_KEY, _SPEED_KEY, _MEASURE_KEY = 21, 22, 23


@dataclass(frozen=True)
class Job:
    """The job a calibration is for: its tables, GPUs and per-GPU batch."""

    tables: tuple[TableSpec, ...]
    gpus: int
    batch_per_rank: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tables:
            raise UserError("--tables holds no table; give the job's tables to calibrate on.")
        if self.gpus < 1 or self.batch_per_rank < 1:
            raise UserError("--gpus and --batch-per-rank must be >= 1.")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise UserError("--tables names a table twice; table names must be unique.")

    @property
    def global_batch(self) -> int:
        """One rank's kernel reads the whole batch: batch per rank × GPUs."""
        return self.batch_per_rank * self.gpus

    def key(self) -> str:
        """16 hex digits of what decides the samples (tables, GPUs, batch, seed)."""
        blob = json.dumps(
            {
                "tables": dump_tables(self.tables, "json"),
                "gpus": self.gpus,
                "batch_per_rank": self.batch_per_rank,
                "seed": self.seed,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TableSplit:
    """The job's table names by role; disjoint, seeded."""

    train: tuple[str, ...]
    val: tuple[str, ...]
    test: tuple[str, ...]


def split_tables(names: Sequence[str], seed: int) -> TableSplit:
    """About 20 % test and 15 % validation tables (at least one each when there are
    tables enough to keep two for training), the rest for training."""
    order = [names[int(i)] for i in _rng(seed, _SPLIT_KEY, 0).permutation(len(names))]
    n = len(order)
    n_test = max(1, round(TEST_TABLE_SHARE * n)) if n >= 2 else 0
    n_val = max(1, round(VAL_TABLE_SHARE * n)) if n - n_test >= 3 else 0
    return TableSplit(
        train=tuple(sorted(order[n_test + n_val :])),
        val=tuple(sorted(order[n_test : n_test + n_val])),
        test=tuple(sorted(order[:n_test])),
    )


@dataclass(frozen=True)
class Task:
    """One kernel to measure: its kind, its (augmented) tables and its global batch."""

    kind: Kind
    tables: tuple[TableSpec, ...]
    batch_size: int


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


# --------------------------------------------------------------------------- tasks


def reference_tables() -> list[TableSpec]:
    """The reference set: the generator's tables for a fixed seed, renamed so they never
    meet a job table's name."""
    from shardwise.planner.synthetic import generate_tables

    return [
        t.model_copy(update={"name": REFERENCE_PREFIX + t.name})
        for t in generate_tables(REFERENCE_COUNT, REFERENCE_SEED)
    ]


@dataclass
class CalibrationTasks:
    """Every sample a calibration of ``job`` measures, by index (see the module docstring)."""

    job: Job
    batches: list[int]
    limit: int
    reference: list[TableSpec] = field(default_factory=list)

    @cached_property
    def split(self) -> TableSplit:
        return split_tables([t.name for t in self.job.tables], self.job.seed)

    def _tables(self, names: Sequence[str]) -> list[TableSpec]:
        wanted = set(names)
        return [t for t in self.job.tables if t.name in wanted]

    @cached_property
    def _pools(self) -> dict[str, list[TableSpec]]:
        return {
            "train": augment_by_halvings(self._tables(self.split.train)),
            "val": augment_by_halvings(self._tables(self.split.val)),
            "reference": augment_by_halvings(self.reference),
        }

    @property
    def weight_cap(self) -> int:
        """Weights one group may hold: 2 GiB, or the job's largest table, within the limit."""
        biggest = max(footprint_bytes([ShardLoad.whole(t)], 0) for t in self.job.tables)
        return min(self.limit, max(DEFAULT_MEMORY_CAP_BYTES, biggest))

    def kind(self, index: int) -> Kind:
        kind = _KINDS[KIND_CYCLE[index % len(KIND_CYCLE)]]
        if (kind == "val" and not self.split.val) or (kind == "test" and not self.split.test):
            return "train"
        if kind == "reference" and not self.reference:
            return "train"
        return kind

    @property
    def per_rank(self) -> int:
        """Tables one rank of the job holds on average (1..15)."""
        return max(1, min(MAX_TABLES, round(len(self.job.tables) / self.job.gpus)))

    def speed_task(self, index: int) -> Task:
        """Speed sample ``index``: up to one rank's share of whole training tables at the
        job's batch (small groups: more kernels fit the speed phase's minute)."""
        rng = _rng(self.job.seed, _SPEED_KEY, index)
        pool = self._tables(self.split.train) or list(self.job.tables)
        batch = self.job.global_batch
        return Task("speed", self._group(pool, rng, batch, self.per_rank), batch)

    def task(self, index: int) -> Task:
        """Measuring-phase sample ``index``."""
        kind = self.kind(index)
        rng = _rng(self.job.seed, _MEASURE_KEY, index)
        if kind == "test":
            return Task(kind, self._plan_like(rng), self.job.global_batch)
        batch = self._batch(rng)
        return Task(kind, self._group(self._pools[kind], rng, batch), batch)

    def _batch(self, rng: np.random.Generator) -> int:
        """The job's batch half the time, its neighbours the other half."""
        job = self.job.global_batch
        others = [b for b in self.batches if b != job]
        if not others or rng.random() < 0.5:
            return job
        return int(others[int(rng.integers(len(others)))])

    def _group(
        self,
        pool: Sequence[TableSpec],
        rng: np.random.Generator,
        batch: int,
        most: int = MAX_TABLES,
    ) -> tuple[TableSpec, ...]:
        """1..``most`` tables drawn without replacement that fit the weight cap and, with
        their buffers at ``batch``, the memory limit (as the profiler's tasks do)."""
        target = int(rng.integers(1, most + 1))
        chosen: list[TableSpec] = []
        for i in rng.permutation(len(pool)):
            if len(chosen) == target:
                break
            candidate = [*chosen, pool[int(i)]]
            shards = [ShardLoad.whole(t) for t in candidate]
            if (
                footprint_bytes(shards, 0) <= self.weight_cap
                and footprint_bytes(shards, batch) <= self.limit
            ):
                chosen = candidate
        return tuple(chosen)

    def _plan_like(self, rng: np.random.Generator) -> tuple[TableSpec, ...]:
        """About one rank's share of test tables (tables / GPUs, ±1), each at its own
        width half the time, else at one of its halvings: what a plan's rank holds."""
        tests = self._tables(self.split.test)
        target = max(1, min(MAX_TABLES, self.per_rank + int(rng.integers(-1, 2)), len(tests)))
        batch = self.job.global_batch
        chosen: list[TableSpec] = []
        for i in rng.permutation(len(tests)):
            if len(chosen) == target:
                break
            t = tests[int(i)]
            widths = halvings(t.dim)
            dim = t.dim if rng.random() < 0.5 else int(widths[int(rng.integers(len(widths)))])
            spec = t.model_copy(update={"name": augmented_name(t.name, dim), "dim": dim})
            shards = [ShardLoad.whole(s) for s in [*chosen, spec]]
            if (
                footprint_bytes(shards, 0) <= self.weight_cap
                and footprint_bytes(shards, batch) <= self.limit
            ):
                chosen.append(spec)
        return tuple(chosen)

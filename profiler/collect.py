"""The profiling loops behind ``shardwise profile compute|comm``: sample, measure, append.

Samples are pure functions of ``(seed, index)`` (:mod:`shardwise.profiler.sampling`),
and each one is appended to the dataset (and fsync'd) as soon as it is measured, so a
run that is interrupted, by Ctrl-C or a crash, resumes at the first missing index
and loses no finished sample. The settings that decide the samples are stored in
the dataset's manifest; reopening with other settings is refused. Because a sample
is a pure function of the settings, a lost manifest can be rebuilt from the records
and the settings (``repair``): every record is checked to be the sample they draw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.basics import UserError
from shardwise.planner.costmodel.predictor import kernel_order
from shardwise.planner.tables import TableSpec, dump_tables
from shardwise.profiler.comm import CommCase, CommResult, measure_comm_many
from shardwise.profiler.compute import (
    DEFAULT_ITERS,
    DEFAULT_WARMUPS,
    ComputeResult,
    ShardLoad,
    measure_compute,
)
from shardwise.profiler.dataset.manifest import RecordCheck
from shardwise.profiler.dataset.records import KERNELS_KEY
from shardwise.profiler.dataset.store import (
    CommRecord,
    ComputeRecord,
    CostDataset,
    Record,
    TableFeatures,
)
from shardwise.profiler.fingerprint import current_fingerprint
from shardwise.profiler.sampling import (
    DEFAULT_WORLD_SIZES,
    augment_tables,
    check_shares,
    comm_task,
    kind_task,
)

#: Comm samples of one world size measured per launch of the worker processes.
COMM_CHUNK = 8
#: Per-rank batch of the all-to-all samples: the evaluator's default, so a cost model
#: trained on them predicts what ``shardwise evaluate`` measures.
DEFAULT_COMM_BATCH = 128
#: Global batches a compute sample is drawn at (the cost model takes the batch as a
#: feature): the evaluator's 128 per rank on 2..16 ranks.
DEFAULT_COMPUTE_BATCHES = (256, 512, 1024, 2048)


#: Every this many compute samples the runner times a fixed reference kernel. A
#: shared host's speed drifts by +-25 % over minutes (measured here); recording the
#: reference next to each sample lets training divide the drift out.
REFERENCE_EVERY = 20
REFERENCE_TABLES = [
    TableSpec(name=f"reference{i}", rows=100_000, dim=64, pooling_factor=8.0) for i in range(4)
]
REFERENCE_BATCH = 1024


def reference_seconds() -> float:
    """fwd+bwd median of the fixed reference kernel: the machine's speed right now."""
    shards = [ShardLoad.whole(t) for t in REFERENCE_TABLES]
    return measure_compute(shards, REFERENCE_BATCH, seed=0).total_s


@dataclass(frozen=True)
class RunSummary:
    directory: Path
    measured: int  # samples measured by this run
    skipped: int  # samples found already done (resumed)
    total: int  # samples in the dataset now
    cvs: list[float]  # spread of every sample measured by this run
    repaired: int = 0  # records a lost manifest was rebuilt from (``repair``)


def _tables_hash(tables: Sequence[TableSpec]) -> str:
    return hashlib.sha256(dump_tables(tables, "json").encode()).hexdigest()[:16]


def _compute_check(
    pool: Sequence[TableSpec],
    seed: int,
    batches: Sequence[int],
    max_tables: int,
    memory_cap_bytes: int,
    fp16_share: float,
    row_share: float = 0.0,
    dp_share: float = 0.0,
) -> RecordCheck:
    """Whether a record is compute sample ``index`` of these settings (for repair)."""

    def check(rec: Record) -> str | None:
        if not isinstance(rec, ComputeRecord):
            return "not a compute record"
        want_batch = batches[rec.index % len(batches)]
        if rec.batch_size != want_batch:
            return f"batch {rec.batch_size}, these options give {want_batch} (--global-batch)"
        task = kind_task(
            pool, seed, rec.index, max_tables, memory_cap_bytes, fp16_share, row_share, dp_share
        )
        want = [load_features(s) for s in task.loads()]
        if rec.tables == want:
            return None
        names, wanted = [t.name for t in rec.tables], [t.name for t in want]
        what = (
            f"tables {names}, these options draw {wanted}"
            if names != wanted
            else f"tables {names} with other sizes or features than in --tables"
        )
        return (
            f"{what} (--tables, --seed, --max-tables, --memory-cap, --fp16-share, "
            "--row-wise-share, --data-parallel-share)"
        )

    return check


def _comm_check(seed: int, world_sizes: Sequence[int], batch_size: int) -> RecordCheck:
    """Whether a record is all-to-all sample ``index`` of these settings (for repair)."""

    def check(rec: Record) -> str | None:
        if not isinstance(rec, CommRecord):
            return "not an all-to-all record"
        if rec.batch_size != batch_size:
            return (
                f"batch {rec.batch_size} per rank, these options give {batch_size} "
                "(--batch-per-rank)"
            )
        task = comm_task(seed, rec.index, world_sizes)
        got = (rec.world_size, list(rec.dims), list(rec.delays_s))
        if got != (task.world_size, task.dims, task.delays):
            return (
                f"world size {rec.world_size}, widths {rec.dims}; these options draw "
                f"{task.world_size}, {task.dims} (--seed, --world-size)"
            )
        return None

    return check


def measure_compute_sample(
    ds: CostDataset,
    index: int,
    tables: Sequence[TableSpec],
    batch_size: int,
    *,
    seed: int,
    device: str | None = None,
    reference_s: float = 0.0,
    extra: Mapping[str, Any] | None = None,
    warmups: int = DEFAULT_WARMUPS,
    iters: int = DEFAULT_ITERS,
) -> ComputeResult:
    """Time the fused kernel of whole ``tables`` at ``batch_size`` and durably append it
    to ``ds`` as sample ``index`` (with ``extra`` in the record's ``extra``)."""
    res = measure_compute(
        [ShardLoad.whole(t) for t in tables],
        batch_size,
        seed=seed,
        device=device,
        warmups=warmups,
        iters=iters,
    )
    ds.append(
        index,
        ComputeRecord(
            index=index,
            fingerprint=ds.writer_key,
            batch_size=batch_size,
            tables=[TableFeatures.from_spec(t) for t in tables],
            fwd_s=res.fwd_s,
            bwd_s=res.bwd_s,
            total_s=res.total_s,
            fwd_cv=res.fwd_cv,
            bwd_cv=res.bwd_cv,
            total_cv=res.cv,
            repeats=res.iters,
            extra={
                "allocator_mitigated": res.allocator_mitigated,
                "reference_s": reference_s,
                **(extra or {}),
            },
        ),
    )
    return res


def load_features(load: ShardLoad) -> TableFeatures:
    """What a record says of one shard: its kernel's view (a row range as its
    ``row_slice``), its group and which batch it read."""
    return TableFeatures.from_load(
        load.spec, load.cols, load.row_range, group=load.group, local_batch=load.local_batch
    )


def kernel_entries(loads: Sequence[ShardLoad], res: ComputeResult) -> list[dict[str, Any]]:
    """``extra["kernels"]``: each timed kernel with the positions of its shards in
    ``loads`` (the grouping :func:`measure_compute` ran them in)."""
    order = kernel_order(loads)
    if len(order) != len(res.kernel_times):
        raise RuntimeError(f"{len(res.kernel_times)} kernels timed for {len(order)} kernel groups")
    out: list[dict[str, Any]] = []
    for (group, _, dtype, members), kt in zip(order, res.kernel_times, strict=True):
        if (kt.group, kt.dtype) != (group, dtype):
            raise RuntimeError(f"kernel {kt.group}/{kt.dtype} timed where {group}/{dtype} runs")
        out.append(
            {
                "group": group,
                "dtype": dtype,
                "batch_size": kt.batch_size,
                "tables": list(members),
                "fwd_s": kt.fwd_s,
                "bwd_s": kt.bwd_s,
            }
        )
    return out


def measure_loads_sample(
    ds: CostDataset,
    index: int,
    loads: Sequence[ShardLoad],
    batch_size: int,
    local_batch_size: int | None = None,
    *,
    seed: int,
    device: str | None = None,
    reference_s: float = 0.0,
    extra: Mapping[str, Any] | None = None,
    warmups: int = DEFAULT_WARMUPS,
    iters: int = DEFAULT_ITERS,
) -> ComputeResult:
    """Time one rank's ``loads`` of any kind (:func:`measure_compute`: one kernel per
    kernel group and precision, row ranges reading their real lookups at the global
    ``batch_size``, data-parallel shards at ``local_batch_size``) and durably append
    them to ``ds`` as sample ``index``: one table entry per load, in order, and one
    ``extra["kernels"]`` entry per kernel with its own medians (what pre-training
    learns from, one example each)."""
    if not loads:
        raise ValueError("a compute sample needs at least one shard")
    res = measure_compute(
        loads,
        batch_size,
        seed=seed,
        device=device,
        warmups=warmups,
        iters=iters,
        local_batch_size=local_batch_size,
    )
    ds.append(
        index,
        ComputeRecord(
            index=index,
            fingerprint=ds.writer_key,
            batch_size=batch_size,
            tables=[load_features(s) for s in loads],
            fwd_s=res.fwd_s,
            bwd_s=res.bwd_s,
            total_s=res.total_s,
            fwd_cv=res.fwd_cv,
            bwd_cv=res.bwd_cv,
            total_cv=res.cv,
            repeats=res.iters,
            extra={
                "allocator_mitigated": res.allocator_mitigated,
                "reference_s": reference_s,
                **(extra or {}),
                KERNELS_KEY: kernel_entries(loads, res),
            },
        ),
    )
    return res


def profile_compute(
    tables: Sequence[TableSpec],
    out_dir: Path,
    samples: int,
    *,
    seed: int = 0,
    batch_sizes: Sequence[int] = DEFAULT_COMPUTE_BATCHES,
    max_tables: int = 15,
    memory_cap_bytes: int = 2 * 2**30,
    fp16_share: float = 0.0,
    row_share: float = 0.0,
    dp_share: float = 0.0,
    device: str | None = None,
    allow_mismatch: bool = False,
    repair: bool = False,
    on_sample: Callable[[int], None] | None = None,
) -> RunSummary:
    """Measure samples ``0..samples-1`` of kernels over augmented ``tables``: fused
    kernels of whole tables, and ``row_share`` of them a rank's row ranges,
    ``dp_share`` a rank with data-parallel tables (:func:`kind_task`).

    Sample ``i`` runs at ``batch_sizes[i % len(batch_sizes)]`` (sorted), so every batch
    size is covered evenly and resuming stays deterministic. ``repair`` first rebuilds
    a lost manifest from the records, if they are what these settings draw.
    """
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError("give at least one batch size, each >= 1.")
    pool = augment_tables(tables)
    batches = sorted(batch_sizes)
    check_shares(row_share, dp_share)
    settings: dict[str, Any] = {
        "tables_sha": _tables_hash(tables),
        "seed": seed,
        "batch_sizes": batches,
        "max_tables": max_tables,
        "memory_cap_bytes": memory_cap_bytes,
        "fp16_share": fp16_share,
    }
    # Only when set, so datasets measured before these kinds existed reopen unchanged.
    if row_share:
        settings["row_wise_share"] = row_share
    if dp_share:
        settings["data_parallel_share"] = dp_share
    measured: list[float] = []
    fingerprint = current_fingerprint(device)
    repaired = 0
    if repair:
        check = _compute_check(
            pool, seed, batches, max_tables, memory_cap_bytes, fp16_share, row_share, dp_share
        )
        repaired = CostDataset.repair(out_dir, "compute", fingerprint, settings, check)
    with CostDataset.create_or_open(
        out_dir, "compute", fingerprint, settings, allow_mismatch=allow_mismatch
    ) as ds:
        done = ds.done_indices()
        todo = [i for i in range(samples) if i not in done]
        reference = 0.0
        for n, i in enumerate(todo):
            if n % REFERENCE_EVERY == 0:
                reference = reference_seconds()
            task = kind_task(
                pool, seed, i, max_tables, memory_cap_bytes, fp16_share, row_share, dp_share
            )
            batch_size = batches[i % len(batches)]
            if task.kind == "fused":
                res = measure_compute_sample(
                    ds,
                    i,
                    task.tables,
                    batch_size,
                    seed=seed + i,
                    device=device,
                    reference_s=reference,
                )
            else:
                res = measure_loads_sample(
                    ds,
                    i,
                    task.loads(),
                    batch_size,
                    task.local_batch(batch_size),
                    seed=seed + i,
                    device=device,
                    reference_s=reference,
                    extra={"task": {"kind": task.kind, "parts": task.parts, "rank": task.rank}},
                )
            measured.append(res.cv)
            if on_sample:
                on_sample(i)
        return RunSummary(out_dir, len(todo), samples - len(todo), len(ds), measured, repaired)


def collective_sizes(dims: Sequence[int], batch_size: int) -> tuple[list[int], list[int]]:
    """The reduce-scatter width and all-reduce elements a comm sample also times, from
    its all-to-all's widths (so their sizes span the same decades): the mean width
    (a multiple of 4, at least 4) and ``sum(dims) × batch_size`` fp32 values."""
    world = max(len(dims), 1)
    width = max(4, (sum(dims) // world) // 4 * 4)
    return [width], [max(1, sum(dims) * batch_size)]


def append_comm_result(ds: CostDataset, index: int, res: CommResult) -> None:
    """Durably append a measured all-to-all to ``ds`` as sample ``index``, with the
    collectives measured beside it in ``extra["collectives"]`` (what ``--comm
    fitted:DIR`` fits them on: :func:`shardwise.planner.comm.fit.fit_comm`)."""
    extra: dict[str, Any] = {"backend": res.backend}
    if res.collectives:
        extra["collectives"] = [
            {
                "name": c.name,
                "bytes": c.bytes,
                "world_size": res.world_size,
                "fwd_s": c.fwd_s if c.name != "all_reduce" else [],
                "bwd_s": c.bwd_s,
            }
            for c in res.collectives
        ]
    ds.append(
        index,
        CommRecord(
            index=index,
            fingerprint=ds.writer_key,
            batch_size=res.batch_size,
            world_size=res.world_size,
            dims=res.dims,
            delays_s=res.delays,
            fwd_s=res.fwd_s,
            bwd_s=res.bwd_s,
            fwd_cv=res.fwd_cv,
            bwd_cv=res.bwd_cv,
            repeats=res.iters,
            extra=extra,
        ),
    )


def profile_comm(
    out_dir: Path,
    samples: int,
    *,
    seed: int = 0,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    batch_size: int = DEFAULT_COMM_BATCH,
    allow_mismatch: bool = False,
    repair: bool = False,
    on_sample: Callable[[int], None] | None = None,
    collectives: bool = True,
) -> RunSummary:
    """Measure all-to-all samples ``0..samples-1``, batching launches by world size;
    ``repair`` as in :func:`profile_compute`. ``collectives``: each sample also times
    a reduce-scatter (with its all-gather) and an all-reduce
    (:func:`collective_sizes`), the other kinds' collectives."""
    settings = {"seed": seed, "world_sizes": list(world_sizes), "batch_size": batch_size}
    cvs: list[float] = []
    fingerprint = current_fingerprint()
    repaired = 0
    if repair:
        check = _comm_check(seed, world_sizes, batch_size)
        repaired = CostDataset.repair(out_dir, "comm", fingerprint, settings, check)
    with CostDataset.create_or_open(
        out_dir, "comm", fingerprint, settings, allow_mismatch=allow_mismatch
    ) as ds:
        done = ds.done_indices()
        todo = [i for i in range(samples) if i not in done]
        tasks = {i: comm_task(seed, i, world_sizes) for i in todo}
        by_world: dict[int, list[int]] = {}
        for i in todo:
            by_world.setdefault(tasks[i].world_size, []).append(i)
        for indices in by_world.values():
            for start in range(0, len(indices), COMM_CHUNK):
                chunk = indices[start : start + COMM_CHUNK]
                cases = [
                    CommCase(
                        tasks[i].dims,
                        tasks[i].delays,
                        *(collective_sizes(tasks[i].dims, batch_size) if collectives else ([], [])),
                    )
                    for i in chunk
                ]
                for i, res in zip(chunk, measure_comm_many(cases, batch_size), strict=True):
                    append_comm_result(ds, i, res)
                    cvs.extend(res.fwd_cv)
                    if on_sample:
                        on_sample(i)
        return RunSummary(out_dir, len(todo), samples - len(todo), len(ds), cvs, repaired)

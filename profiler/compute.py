"""Compute benchmark (docs/design.md §6): time one rank's fused embedding kernel for real.

A rank's compute cost is one FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` holding
exactly its shards, run forward and backward with its fused optimizer (row-wise
Adagrad, as TorchRec's fused kernels use), because a fused multi-table kernel does not
cost the sum of its tables (docs/design.md §6): only timing the fused module shows it.

The same code runs on ``cuda`` (weights on the device, CUDA events) and on the CPU
(weights in host memory, ``EmbeddingLocation.HOST``/``ComputeDevice.CPU``, wall
clock). Before timing, the glibc allocator mitigation is applied and checked
(:mod:`shardwise.profiler.allocator`), so wide outputs are not charged page faults.

Shards with fp32 and fp16 weights cannot share one TBE (it has one
``weights_precision``); like TorchRec, a mixed rank gets one fused kernel per
precision, run back to back, and its cost is their sum.

Every sharding kind (:mod:`shardwise.planner.kinds`) is timed as DMP runs it: one
kernel per kernel group and precision, back to back. Table-wise and column-wise
shards share the fused kernel at the global batch; row-wise, table-row-wise and grid
shards hold only their row range and receive the real lookups that fall in it
(:func:`row_stream`: the table's stream at the global batch, the ids in the range,
every bag kept, empty ones too: a row shard pools every sample of the global batch);
data-parallel tables run whole at the rank's own batch.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from shardwise import names
from shardwise.basics import UserError
from shardwise.planner.costmodel.predictor import kernel_order
from shardwise.planner.kinds import FUSED_GROUP
from shardwise.planner.streams import stream_from_spec
from shardwise.planner.tables import TableSpec
from shardwise.profiler import allocator

#: Batch size when none is given (the profiler and the evaluator pass their own).
#: Measured on the 2-core CPU machine, timing the 8 ranks of
#: ``generate_tables(80, 0)`` dealt round-robin (~10 tables a rank; 5 warm-ups + 10
#: calls, building the kernels and streams included): 12 s on a quiet machine, 19 s
#: beside other jobs; batch 4096 takes 26 s / 41 s.
DEFAULT_BATCH_SIZE = 2048
DEFAULT_WARMUPS = 5
DEFAULT_ITERS = 10
#: A shard set may use at most this share of the memory it lives in (host RAM on CPU).
MEMORY_SHARE = 0.5
#: CPU kernels run on one thread: on a shared 2-core machine two OpenMP threads fight
#: every other process for the cores, and the per-call spread grows (median CV of 60
#: samples: 2.7 % on one thread against 3.6 % on two, measured back to back). The
#: evaluator's all-to-all workers are single-threaded too, so all figures agree.
#: ``SHARDWISE_CPU_THREADS`` overrides it (the figures are only comparable at one setting).
CPU_THREADS = int(os.environ.get(names.ENV_CPU_THREADS, "1"))
LEARNING_RATE = 0.01

Stream = tuple[npt.NDArray[np.integer], npt.NDArray[np.integer]]


@dataclass(frozen=True)
class ShardLoad:
    """One shard on a rank: ``cols`` columns (a whole table is ``cols = spec.dim``) of
    rows ``row_offset .. row_offset + rows`` (``rows`` None: every row) of the table
    ``spec``, run in kernel ``group`` at the global batch, or at the rank's own batch
    when ``local_batch`` (data-parallel). ``spec`` is the whole table: its stream is
    the table's, cut to the row range (:func:`row_stream`)."""

    spec: TableSpec
    cols: int
    row_offset: int = 0
    rows: int | None = None
    group: str = FUSED_GROUP
    local_batch: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.cols <= self.spec.dim or self.cols % 4:
            raise UserError(
                f"table {self.spec.name!r}: a shard of {self.cols} columns is not valid "
                f"for width {self.spec.dim}; use a positive multiple of 4 up to the width."
            )
        if self.rows is not None and not (
            self.row_offset >= 0 and self.rows > 0 and self.row_offset + self.rows <= self.spec.rows
        ):
            raise UserError(
                f"table {self.spec.name!r}: rows {self.row_offset}..{self.row_offset + self.rows}"
                f" are not a non-empty range of its {self.spec.rows} rows."
            )

    @classmethod
    def whole(cls, spec: TableSpec) -> ShardLoad:
        return cls(spec, spec.dim)

    @property
    def row_count(self) -> int:
        """Rows the shard's kernel holds."""
        return self.spec.rows if self.rows is None else self.rows

    @property
    def row_range(self) -> tuple[int, int] | None:
        """``(row_offset, rows)`` of a row range, None for every row."""
        if self.rows is None or (self.row_offset == 0 and self.rows == self.spec.rows):
            return None
        return self.row_offset, self.rows

    @property
    def name(self) -> str:
        """The table, with its row range (``t[0:500]``) when the shard holds one."""
        rr = self.row_range
        return self.spec.name if rr is None else f"{self.spec.name}[{rr[0]}:{rr[0] + rr[1]}]"

    @property
    def weight_bytes(self) -> int:
        return self.row_count * self.cols * self.spec.bytes_per_element

    def batch(self, batch_size: int, local_batch_size: int) -> int:
        """The batch this shard's kernel reads (module docstring)."""
        return local_batch_size if self.local_batch else batch_size


@dataclass(frozen=True)
class KernelTime:
    """One timed kernel of a rank: its group and precision, the batch it ran at, the
    shards it held (:attr:`ShardLoad.name`), and its medians in seconds."""

    group: str
    dtype: str
    batch_size: int
    shards: tuple[str, ...]
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class ComputeResult:
    """Medians over ``iters`` timed calls, in seconds; ``cv`` is std/mean of the totals
    (``fwd_cv``/``bwd_cv`` of each pass), the spread a dataset records with a sample;
    ``robust_cv`` the same spread read from the median absolute deviation, which one
    preempted call does not inflate (what a decision on the medians should weigh)."""

    fwd_s: float
    bwd_s: float
    total_s: float
    cv: float
    iters: int
    batch_size: int
    device: str
    allocator_mitigated: bool
    kernels: int = 1  # TBEs timed (one per kernel group and weight precision present)
    fwd_cv: float = 0.0
    bwd_cv: float = 0.0
    #: Each kernel's own medians, in the order they ran (:class:`KernelTime`).
    kernel_times: tuple[KernelTime, ...] = ()
    robust_cv: float = 0.0


def _cv(samples: Sequence[float]) -> float:
    """Coefficient of variation (population std / mean); 0 for no spread or no time."""
    mean = statistics.fmean(samples)
    cv = statistics.pstdev(samples) / mean if mean > 0 else 0.0
    return cv if math.isfinite(cv) else 0.0


def _robust_cv(samples: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation / the median: the std/mean of normal
    samples, but a burst of load on one call of ten (seen here: one 10x call gave a cv
    of 1.3, which set a refinement's noise margin at 52 %) moves it little."""
    med = statistics.median(samples)
    mad = statistics.median(abs(x - med) for x in samples)
    cv = 1.4826 * mad / med if med > 0 else 0.0
    return cv if math.isfinite(cv) else 0.0


# --------------------------------------------------------------------------- memory


def _memory_limit(device: torch.device) -> tuple[int, str]:
    """(bytes a shard set may use, what that memory is)."""
    if device.type == "cuda":
        total = int(torch.cuda.get_device_properties(device).total_memory)
        return int(total * MEMORY_SHARE), f"GPU memory ({total} bytes)"
    total = _host_memory()
    return int(total * MEMORY_SHARE), f"host RAM (MemTotal {total} bytes)"


def _host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def footprint_bytes(
    shards: Sequence[ShardLoad],
    batch_size: int,
    lookups: int = 0,
    local_batch_size: int | None = None,
) -> int:
    """What timing the shards holds: weights of the rows each holds, row-wise optimizer
    state (one fp32 per row held), each kernel's output and its gradient (fp32, its
    batch × its width: the global batch, or ``local_batch_size`` for data-parallel
    shards) and the indices."""
    local = batch_size if local_batch_size is None else local_batch_size
    weights = sum(s.weight_bytes + 4 * s.row_count for s in shards)
    outputs = sum(2 * 4 * s.batch(batch_size, local) * s.cols for s in shards)
    offsets = sum(s.batch(batch_size, local) for s in shards)
    return weights + outputs + 8 * (lookups + offsets + 1)


def check_memory(
    shards: Sequence[ShardLoad],
    batch_size: int,
    device: torch.device,
    local_batch_size: int | None = None,
) -> None:
    """Refuse (UserError) a shard set that would not fit, naming its largest table."""
    need = footprint_bytes(shards, batch_size, local_batch_size=local_batch_size)
    limit, where = _memory_limit(device)
    if need > limit:
        big = max(shards, key=lambda s: s.weight_bytes)
        raise UserError(
            f"the shard set needs about {need} bytes ({need / 2**30:.1f} GiB) to time, more "
            f"than {MEMORY_SHARE:.0%} of {where}; its largest shard is table "
            f"{big.name!r} ({big.row_count} rows × {big.cols} columns, "
            f"{big.weight_bytes} bytes). Split the set over more ranks, shard that table "
            "by columns or rows, or measure on a larger machine."
        )


def row_stream(stream: Stream, row_offset: int, rows: int) -> Stream:
    """A table's stream as the shard holding rows ``row_offset .. row_offset + rows``
    receives it: the ids in that range, less ``row_offset``, in every bag of the batch
    (a bag with none of them stays, empty: the shard still pools it)."""
    lengths, indices = (np.asarray(x, dtype=np.int64) for x in stream)
    keep = (indices >= row_offset) & (indices < row_offset + rows)
    bags = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    kept = np.bincount(bags[keep], minlength=len(lengths)).astype(np.int64)
    return kept, indices[keep] - row_offset


# --------------------------------------------------------------------------- kernel


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {dev} was asked for, but torch sees no CUDA device here.")
    if dev.type not in ("cuda", "cpu"):
        raise UserError(f"device {dev} is not supported: use cpu or cuda.")
    return dev


def build_kernel(shards: Sequence[ShardLoad], device: torch.device) -> torch.nn.Module:
    """One fused TBE holding exactly ``shards`` (all of one weight precision)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    dtypes = {s.spec.dtype for s in shards}
    if len(dtypes) != 1:
        raise ValueError(f"one kernel holds one weight precision, got {sorted(dtypes)}")
    cuda = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
    precision = SparseType.FP16 if dtypes == {"fp16"} else SparseType.FP32
    module: torch.nn.Module = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(s.row_count, s.cols, location, compute) for s in shards],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LEARNING_RATE,
        weights_precision=precision,
        output_dtype=SparseType.FP32,
        device=device,
    )
    return module


def kernel_inputs(
    streams: Sequence[Stream], batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """TBE's layout: indices of all tables back to back, offsets T·B + 1 (table-major)."""
    lengths = []
    for k, (lens, _) in enumerate(streams):
        if len(lens) != batch_size:
            raise ValueError(f"stream {k} has {len(lens)} samples, expected {batch_size}")
        lengths.append(np.asarray(lens, dtype=np.int64))
    offsets = np.zeros(len(streams) * batch_size + 1, dtype=np.int64)
    if streams:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    indices = np.concatenate(
        [np.asarray(idx, dtype=np.int64) for _, idx in streams] or [np.zeros(0, np.int64)]
    )
    if indices.size != offsets[-1]:
        raise ValueError("stream lengths do not add up to their indices")
    return (
        torch.from_numpy(indices.astype(np.int64, copy=False)).to(device),
        torch.from_numpy(offsets).to(device),
    )


class _Clock:
    """Seconds between marks: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        if self.cuda:
            assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        assert isinstance(start, float) and isinstance(end, float)
        return end - start


Kernel = tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]


def _time_kernels(
    kernels: Sequence[Kernel], device: torch.device, warmups: int, iters: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Per timed call, each kernel's (fwd, bwd) seconds, run back to back."""
    clock = _Clock(device)
    fwd: list[list[float]] = []
    bwd: list[list[float]] = []
    for i in range(warmups + iters):
        f: list[float] = []
        b: list[float] = []
        for module, indices, offsets, grad in kernels:
            t0 = clock.mark()
            out = module(indices, offsets)
            t1 = clock.mark()
            out.backward(grad)
            t2 = clock.mark()
            f.append(clock.seconds(t0, t1))
            b.append(clock.seconds(t1, t2))
            del out
        if i >= warmups:
            fwd.append(f)
            bwd.append(b)
    return fwd, bwd


def measure_compute(
    shards: Sequence[ShardLoad],
    batch_size: int = DEFAULT_BATCH_SIZE,
    *,
    warmups: int = DEFAULT_WARMUPS,
    iters: int = DEFAULT_ITERS,
    seed: int = 0,
    device: str | torch.device | None = None,
    streams: Sequence[Stream] | None = None,
    mitigate_allocator: bool = True,
    local_batch_size: int | None = None,
) -> ComputeResult:
    """Time the kernels of ``shards``: medians of fwd, bwd and fwd + bwd, summed over
    the kernels of each call (module docstring), and each kernel's own.

    ``batch_size`` is the global batch; ``local_batch_size`` (default: the same) the
    rank's own, which data-parallel shards read. ``streams`` gives each shard's table
    stream (lengths [its batch], indices), e.g. from a trace; a row shard's is cut to
    its range here. Otherwise :func:`stream_from_spec` makes them from the specs with
    ``seed``. A rank without shards costs 0. ``mitigate_allocator=False`` exists only
    to measure what the mitigation is worth (``benchmarks/allocator_effect.py``).
    """
    local = batch_size if local_batch_size is None else local_batch_size
    if batch_size < 1 or local < 1 or warmups < 0 or iters < 1:
        raise ValueError("batch sizes and iters must be >= 1 and warmups >= 0")
    dev = _device(device)
    if dev.type == "cpu":
        torch.set_num_threads(CPU_THREADS)
    if mitigate_allocator:
        allocator.mitigate()
    mitigated = allocator.is_active()
    if not shards:
        return ComputeResult(0.0, 0.0, 0.0, 0.0, 0, batch_size, str(dev), mitigated, 0)
    if streams is not None and len(streams) != len(shards):
        raise ValueError(f"{len(streams)} streams for {len(shards)} shards")
    check_memory(shards, batch_size, dev, local)
    if streams is None:
        streams = [
            stream_from_spec(s.spec, s.batch(batch_size, local), seed, s.cols) for s in shards
        ]
    cut = []
    for s, stream in zip(shards, streams, strict=True):
        rr = s.row_range
        lens, idx = stream if rr is None else row_stream(stream, *rr)
        if len(idx) and (int(np.max(idx)) >= s.row_count or int(np.min(idx)) < 0):
            raise UserError(
                f"table {s.name!r}: its stream reads rows outside 0..{s.row_count - 1}."
            )
        cut.append((lens, idx))

    kernels: list[Kernel] = []
    described = []
    for group, is_local, dtype, members in kernel_order(shards):
        batch = local if is_local else batch_size
        module = build_kernel([shards[k] for k in members], dev)
        indices, offsets = kernel_inputs([cut[k] for k in members], batch, dev)
        width = sum(shards[k].cols for k in members)
        grad = torch.randn(
            batch, width, device=dev, generator=torch.Generator(dev).manual_seed(seed)
        )
        kernels.append((module, indices, offsets, grad))
        described.append((group, dtype, batch, tuple(shards[k].name for k in members)))
    fwd, bwd = _time_kernels(kernels, dev, warmups, iters)
    fwd_sums = [sum(f) for f in fwd]
    bwd_sums = [sum(b) for b in bwd]
    totals = [f + b for f, b in zip(fwd_sums, bwd_sums, strict=True)]
    times = tuple(
        KernelTime(
            group=group,
            dtype=dtype,
            batch_size=batch,
            shards=names_,
            fwd_s=statistics.median(f[k] for f in fwd),
            bwd_s=statistics.median(b[k] for b in bwd),
        )
        for k, (group, dtype, batch, names_) in enumerate(described)
    )
    return ComputeResult(
        fwd_s=statistics.median(fwd_sums),
        bwd_s=statistics.median(bwd_sums),
        total_s=statistics.median(totals),
        cv=_cv(totals),
        iters=iters,
        batch_size=batch_size,
        device=str(dev),
        allocator_mitigated=mitigated,
        kernels=len(kernels),
        fwd_cv=_cv(fwd_sums),
        bwd_cv=_cv(bwd_sums),
        kernel_times=times,
        robust_cv=_robust_cv(totals),
    )

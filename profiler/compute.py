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
    """One shard on a rank: a table (or ``cols`` of its columns; a whole table is
    ``cols = spec.dim``). A column shard reads the same rows as the table."""

    spec: TableSpec
    cols: int

    def __post_init__(self) -> None:
        if not 0 < self.cols <= self.spec.dim or self.cols % 4:
            raise UserError(
                f"table {self.spec.name!r}: a shard of {self.cols} columns is not valid "
                f"for width {self.spec.dim}; use a positive multiple of 4 up to the width."
            )

    @classmethod
    def whole(cls, spec: TableSpec) -> ShardLoad:
        return cls(spec, spec.dim)

    @property
    def weight_bytes(self) -> int:
        return self.spec.column_bytes(self.cols)


@dataclass(frozen=True)
class ComputeResult:
    """Medians over ``iters`` timed calls, in seconds; ``cv`` is std/mean of the totals
    (``fwd_cv``/``bwd_cv`` of each pass), the spread a dataset records with a sample."""

    fwd_s: float
    bwd_s: float
    total_s: float
    cv: float
    iters: int
    batch_size: int
    device: str
    allocator_mitigated: bool
    kernels: int = 1  # fused TBEs timed (one per weight precision present)
    fwd_cv: float = 0.0
    bwd_cv: float = 0.0


def _cv(samples: Sequence[float]) -> float:
    """Coefficient of variation (population std / mean); 0 for no spread or no time."""
    mean = statistics.fmean(samples)
    cv = statistics.pstdev(samples) / mean if mean > 0 else 0.0
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


def footprint_bytes(shards: Sequence[ShardLoad], batch_size: int, lookups: int = 0) -> int:
    """What timing the shards holds: weights, row-wise optimizer state (one fp32 per
    row), the output and its gradient (fp32, batch × total width) and the indices."""
    weights = sum(s.weight_bytes + 4 * s.spec.rows for s in shards)
    width = sum(s.cols for s in shards)
    return weights + 2 * 4 * batch_size * width + 8 * (lookups + len(shards) * batch_size + 1)


def check_memory(shards: Sequence[ShardLoad], batch_size: int, device: torch.device) -> None:
    """Refuse (UserError) a shard set that would not fit, naming its largest table."""
    need = footprint_bytes(shards, batch_size)
    limit, where = _memory_limit(device)
    if need > limit:
        big = max(shards, key=lambda s: s.weight_bytes)
        raise UserError(
            f"the shard set needs about {need} bytes ({need / 2**30:.1f} GiB) to time, more "
            f"than {MEMORY_SHARE:.0%} of {where}; its largest shard is table "
            f"{big.spec.name!r} ({big.spec.rows} rows × {big.cols} columns, "
            f"{big.weight_bytes} bytes). Split the set over more ranks, shard that table "
            "by columns, or measure on a larger machine."
        )


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
        embedding_specs=[(s.spec.rows, s.cols, location, compute) for s in shards],
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


def _time_kernels(
    kernels: Sequence[tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]],
    device: torch.device,
    warmups: int,
    iters: int,
) -> tuple[list[float], list[float]]:
    clock = _Clock(device)
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmups + iters):
        f = b = 0.0
        for module, indices, offsets, grad in kernels:
            t0 = clock.mark()
            out = module(indices, offsets)
            t1 = clock.mark()
            out.backward(grad)
            t2 = clock.mark()
            f += clock.seconds(t0, t1)
            b += clock.seconds(t1, t2)
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
) -> ComputeResult:
    """Time the fused kernel of ``shards``: medians of fwd, bwd and fwd + bwd.

    ``streams`` gives each shard's (lengths [batch_size], indices), e.g. from a trace;
    otherwise :func:`stream_from_spec` makes them from the specs with ``seed``. A rank
    without shards costs 0. ``mitigate_allocator=False`` exists only to measure what
    the mitigation is worth (``benchmarks/allocator_effect.py``).
    """
    if batch_size < 1 or warmups < 0 or iters < 1:
        raise ValueError("batch_size and iters must be >= 1 and warmups >= 0")
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
    check_memory(shards, batch_size, dev)
    if streams is None:
        streams = [stream_from_spec(s.spec, batch_size, seed, s.cols) for s in shards]
    for s, (_, idx) in zip(shards, streams, strict=True):
        if len(idx) and (int(np.max(idx)) >= s.spec.rows or int(np.min(idx)) < 0):
            raise UserError(
                f"table {s.spec.name!r}: its stream reads rows outside 0..{s.spec.rows - 1}."
            )

    kernels = []
    for dtype in ("fp32", "fp16"):
        group = [k for k, s in enumerate(shards) if s.spec.dtype == dtype]
        if not group:
            continue
        module = build_kernel([shards[k] for k in group], dev)
        indices, offsets = kernel_inputs([streams[k] for k in group], batch_size, dev)
        width = sum(shards[k].cols for k in group)
        grad = torch.randn(
            batch_size, width, device=dev, generator=torch.Generator(dev).manual_seed(seed)
        )
        kernels.append((module, indices, offsets, grad))
    fwd, bwd = _time_kernels(kernels, dev, warmups, iters)
    totals = [f + b for f, b in zip(fwd, bwd, strict=True)]
    return ComputeResult(
        fwd_s=statistics.median(fwd),
        bwd_s=statistics.median(bwd),
        total_s=statistics.median(totals),
        cv=_cv(totals),
        iters=iters,
        batch_size=batch_size,
        device=str(dev),
        allocator_mitigated=mitigated,
        kernels=len(kernels),
        fwd_cv=_cv(fwd),
        bwd_cv=_cv(bwd),
    )

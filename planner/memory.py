"""What a shard costs in GPU memory, counted as TorchRec's planner counts it (docs/memory.md).

One rule for every planner, the plan validator and the workers' plan check, so a plan
that one of them accepts, the others accept too. A shard of ``cols`` columns of a table
holds, on its rank:

- **weights**: ``rows × cols × bytes per element``;
- **optimizer state**: FBGEMM's fused row-wise Adagrad keeps one fp32 accumulator per
  row of every shard (each column-wise shard is its own table inside the fused kernel):
  ``rows × 4`` bytes, whatever the shard's width and dtype;
- **I/O buffers** at the job's batch: every shard looks its table up for the global
  batch ``batch_size_per_rank × world`` (the all-to-all brings every sample's ids to
  it), so it holds the ids (int64: ``pooling × global batch × 8``) and its pooled
  outputs (``min(1, pooling) × global batch × cols × 4``, fp32 as the fused kernel
  writes them).

The I/O terms are TorchRec's own (``_calculate_tw_shard_io_sizes`` /
``_calculate_cw_shard_io_sizes`` with its default pipeline, which charges input plus
output), computed in the same order so the integers agree. Where we differ, and why:
TorchRec charges a row-wise Adagrad shard ``weights / dim`` of state (``rows × 4`` only
for a whole fp32 table; less for a column-wise shard or an fp16 table, though FBGEMM
allocates ``rows × 4`` for each), or nothing when the optimizer is fused through the
sharder's parameters as our workers do it; and it sizes an fp16 table's outputs at 2
bytes, though the fused kernel writes fp32 outputs. We count what is allocated.

The other kinds (:mod:`shardwise.planner.kinds`) follow TorchRec's I/O counts too
(``_calculate_rw_shard_io_sizes``, ``_calculate_twrw_shard_io_sizes``,
``_calculate_dp_shard_io_sizes``):

- **row-wise** (and table-row-wise, grid): the rank's rows and their optimizer state;
  ids: its share of the global batch's lookups (``pooling × batch × 8`` for row-wise,
  ``× world / local world`` within a host), outputs: a partial pooled output for every
  sample of the global batch (``min(1, pooling) × global batch × cols × 4``), which is
  why a row shard costs more than its rows suggest. An empty range holds nothing;
- **data-parallel**: the whole table on every rank, its optimizer state (the dense
  Adagrad the workers use keeps one sum per element, in the weights' dtype) and its
  gradient (DDP allocates a dense one), and I/O at the rank's own batch. TorchRec
  counts no gradient; we count what is allocated.

Without the table specs (a plan file alone) the pooling factor is unknown: only
weights and optimizer state are counted then, a lower bound that no pooling can lower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.basics import format_bytes
from shardwise.planner.tables import DTYPE_BYTES, TableSpec

if TYPE_CHECKING:
    from shardwise.planner.topology import Topology

#: Row-wise Adagrad's state: one fp32 accumulator per row of each shard.
OPTIMIZER_BYTES_PER_ROW = 4
#: Ids as the fused kernel reads them (TorchRec's ``BIGINT_DTYPE``: int64).
INDEX_BYTES = 8
#: Pooled outputs: the fused kernel writes fp32 whatever the weights' dtype.
OUTPUT_BYTES = 4
#: The narrowest shard plan.json allows.
MIN_SHARD_COLS = 4


@dataclass(frozen=True)
class ShardMemory:
    """Bytes one shard (or a sum of shards) holds on its rank, by kind."""

    weights: int = 0
    optimizer: int = 0
    #: Input (ids) and output (pooled embeddings) buffers at the job's batch.
    io: int = 0
    #: Dense gradients (data-parallel tables only: fused kernels keep none).
    gradients: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.io + self.gradients

    def __add__(self, other: ShardMemory) -> ShardMemory:
        return ShardMemory(
            self.weights + other.weights,
            self.optimizer + other.optimizer,
            self.io + other.io,
            self.gradients + other.gradients,
        )

    def describe(self) -> str:
        """``"9.5 GiB (weights 8 GiB + optimizer 128 MiB + I/O buffers 1.4 GiB)"``."""
        grads = f" + gradients {format_bytes(self.gradients)}" if self.gradients else ""
        return (
            f"{format_bytes(self.total)} (weights {format_bytes(self.weights)} + optimizer "
            f"{format_bytes(self.optimizer)} + I/O buffers {format_bytes(self.io)}{grads})"
        )


def memory_sum(parts: Iterable[ShardMemory]) -> ShardMemory:
    out = ShardMemory()
    for part in parts:
        out = out + part
    return out


def io_bytes(pooling_factor: float, cols: int, batch_size_per_rank: int, world: int) -> int:
    """Input plus output buffers of one shard ``cols`` wide, as TorchRec counts them (the
    global batch's ids in int64, its pooled fp32 outputs); the same float arithmetic in
    the same order, so the integers equal TorchRec's."""
    batch_inputs = pooling_factor * 1.0 * batch_size_per_rank
    batch_outputs = min(1.0, pooling_factor) * 1.0 * batch_size_per_rank
    inputs = math.ceil(batch_inputs * world * INDEX_BYTES)
    outputs = math.ceil(batch_outputs * world * cols * OUTPUT_BYTES)
    return inputs + outputs


def memory_of(
    rows: int,
    cols: int,
    dtype: str,
    pooling_factor: float | None,
    batch_size_per_rank: int,
    world: int,
) -> ShardMemory:
    """The rule on bare numbers; ``pooling_factor=None`` (unknown) counts no I/O."""
    return ShardMemory(
        weights=rows * cols * DTYPE_BYTES[dtype],
        optimizer=rows * OPTIMIZER_BYTES_PER_ROW,
        io=0
        if pooling_factor is None
        else io_bytes(pooling_factor, cols, batch_size_per_rank, world),
    )


def kind_io_bytes(
    kind: str,
    pooling_factor: float,
    shard_rows: int,
    cols: int,
    batch_size_per_rank: int,
    world: int,
    local_world: int,
) -> int:
    """I/O buffers of one shard of ``kind`` as TorchRec counts them (module docstring),
    in TorchRec's float order so the integers agree."""
    if kind in ("table_wise", "column_wise"):
        return io_bytes(pooling_factor, cols, batch_size_per_rank, world)
    if kind == "data_parallel":
        inputs = math.ceil(pooling_factor * 1.0 * batch_size_per_rank * INDEX_BYTES)
        batch_outputs = min(1.0, pooling_factor) * 1.0 * batch_size_per_rank
        return inputs + math.ceil(batch_outputs * cols * OUTPUT_BYTES)
    if shard_rows == 0:
        return 0
    divisor = world if kind == "row_wise" else local_world
    batch_inputs = pooling_factor * 1.0 * batch_size_per_rank / divisor
    batch_outputs = min(1.0, pooling_factor) * 1.0 * batch_size_per_rank
    inputs = math.ceil(batch_inputs * world * INDEX_BYTES)
    outputs = math.ceil(batch_outputs * world * cols * OUTPUT_BYTES)
    return inputs + outputs


def kind_memory(
    kind: str,
    shard_rows: int,
    cols: int,
    dtype: str,
    pooling_factor: float | None,
    batch_size_per_rank: int,
    world: int,
    local_world: int | None = None,
) -> ShardMemory:
    """What one shard of ``kind`` (``shard_rows`` × ``cols``) holds on its rank; a
    data-parallel shard is the whole table. ``pooling_factor=None`` counts no I/O."""
    local = local_world or world
    weights = shard_rows * cols * DTYPE_BYTES[dtype]
    io = (
        0
        if pooling_factor is None
        else kind_io_bytes(
            kind, pooling_factor, shard_rows, cols, batch_size_per_rank, world, local
        )
    )
    if kind == "data_parallel":
        return ShardMemory(weights=weights, optimizer=weights, io=io, gradients=weights)
    return ShardMemory(weights=weights, optimizer=shard_rows * OPTIMIZER_BYTES_PER_ROW, io=io)


def shard_memory(spec: TableSpec, cols: int, batch_size_per_rank: int, world: int) -> ShardMemory:
    """What a shard ``cols`` wide of ``spec`` holds on its rank in a job of ``world``
    ranks at ``batch_size_per_rank`` samples per rank (``cols == spec.dim``: the whole
    table, placed table-wise)."""
    return memory_of(spec.rows, cols, spec.dtype, spec.pooling_factor, batch_size_per_rank, world)


def shard_bytes(spec: TableSpec, cols: int, batch_size_per_rank: int, world: int) -> int:
    """:func:`shard_memory`'s total: what planners weigh against ``Topology.usable_bytes``."""
    return shard_memory(spec, cols, batch_size_per_rank, world).total


def table_bytes(spec: TableSpec, topology: Topology) -> int:
    """The whole table on one rank of ``topology``, at its batch."""
    return shard_bytes(spec, spec.dim, topology.batch_size_per_rank, topology.gpus)


def gpu_memory_to_fit(need: int, topology: Topology) -> int:
    """The smallest ``gpu_memory_bytes`` whose usable share (after the topology's
    reserve) holds ``need`` bytes."""
    memory = math.ceil(need / (1.0 - topology.memory_reserve))
    while int(memory * (1.0 - topology.memory_reserve)) < need:  # float rounding
        memory += 1
    return memory


def largest_batch(total_at: Callable[[int], int], cap: int, upto: int) -> int:
    """The largest batch per rank in ``1..upto`` at which ``total_at(batch)`` (bytes, not
    decreasing in the batch) fits ``cap``; 0 when none does."""
    lo, hi = 0, upto
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total_at(mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def what_would_fit(total_at: Callable[[int], int], topology: Topology, more: str = "") -> str:
    """What every capacity error ends with: the GPU memory that would hold
    ``total_at(batch)`` bytes per rank at the job's batch and this reserve, ``more``
    (another way, e.g. ``", or 12 GPUs"``), and the largest batch per rank that fits the
    GPUs as they are."""
    need = total_at(topology.batch_size_per_rank)
    out = (
        f"GPUs of {format_bytes(gpu_memory_to_fit(need, topology))} would fit it "
        f"(--gpu-memory, at the {topology.memory_reserve:.0%} reserve){more}"
    )
    if total_at(0) == need:  # no I/O counted: the batch does not matter
        return out
    batch = largest_batch(total_at, topology.usable_bytes, topology.batch_size_per_rank)
    if batch >= topology.batch_size_per_rank:
        return out
    if batch > 0:
        return f"{out}, or a batch of at most {batch} per rank (--batch-per-rank)"
    alone = format_bytes(total_at(0))
    return f"{out}; no smaller batch fits: weights and optimizer state alone need {alone}"

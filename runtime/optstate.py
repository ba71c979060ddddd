"""Embedding optimizer state from one plan to another: row-wise blocks, data-parallel sums.

A sharded table's fused ``EXACT_ROWWISE_ADAGRAD`` keeps, for each shard, one
accumulator per row of the shard: the sum over steps of the squared gradient's mean
over *that shard's* columns. TorchRec hands it out as one 1-D ``ShardedTensor`` per
table whose shards follow the weight's shards one for one (same order, same rank),
each as long as its weight shard has rows, placed end to end. So block ``i`` of the
vector is the weight's shard ``i``, a rectangle of rows × columns (:class:`Block`):

- table-wise: one block, every row; column-wise: ``rows`` entries per column shard;
- row-wise and table-row-wise: one block per row range, its rows long;
- grid: one block per (row range, column range), in the weight's shard order (by
  column range, then rank); an empty row range is a block of 0 entries.

:func:`remap_block` gives a new shard (any rectangle) its state from the saved blocks
covering it: for each of its rows, the mean of the saved values covering that row,
each weighted by how many of the new shard's columns it covers. The rows never mix
(a row's state is its own), so any row cut maps exactly; the columns map exactly when
the new column range is one saved column range or a union of them (the mean of means
over equal-row-count pieces, weighted by width, is the mean over the union), and
approximately when a saved column range is cut narrower (the squared gradients are
assumed even across its columns).

A data-parallel table is trained by the dense optimizer (torch's Adagrad): its state is
the element-wise ``sum`` of squared gradients, shaped like the table. To a row-wise
block it maps exactly (:func:`rowwise_from_dense`: the mean over the block's columns
of each row's sums, which is what row-wise Adagrad accumulates); back it maps by
broadcasting each row's value to its columns (:func:`dense_from_rowwise`), which keeps
each row's mean but not how it spread over the columns: an approximation.

:class:`RowRead` reads only some rows of a saved tensor through DCP, so a rank loads
the saved state of the rows it will hold, not the table's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch.distributed._shard.sharded_tensor.api import ShardedTensor


class Block(BaseModel):
    """One shard's block of a row-wise state vector: entries ``offset`` … ``+ rows``
    belong to rows ``row_offset`` … ``+ rows`` and columns ``col_offset`` … ``+ cols``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int

    @property
    def row_end(self) -> int:
        return self.row_offset + self.rows

    @property
    def col_end(self) -> int:
        return self.col_offset + self.cols

    def col_overlap(self, other: Block) -> int:
        return max(0, min(self.col_end, other.col_end) - max(self.col_offset, other.col_offset))

    def row_overlap(self, other: Block) -> tuple[int, int] | None:
        """The rows both hold, ``(first, end)``, or None."""
        a, b = max(self.row_offset, other.row_offset), min(self.row_end, other.row_end)
        return (a, b) if a < b else None


def column_blocks(rows: int, columns: Sequence[tuple[int, int]]) -> list[Block]:
    """The blocks of a state saved before blocks were recorded: one per column shard,
    ``rows`` entries each, in the listed order (how TorchRec lays out a table-wise or
    column-wise table's state)."""
    return [Block(offset=i * rows, row_offset=0, rows=rows, col_offset=c, cols=w)
            for i, (c, w) in enumerate(columns)]  # fmt: skip


def rowwise_blocks(weight: Any, state: Any) -> list[Block] | None:
    """The blocks of ``state``, a row-wise state vector of the table ``weight``, or None
    when it is not one (the shapes, ranks or offsets do not follow the weight's shards
    as the module docstring says)."""
    if not isinstance(state, ShardedTensor) or not isinstance(weight, ShardedTensor):
        return None
    w_meta = weight.metadata().shards_metadata
    s_meta = state.metadata().shards_metadata
    if state.dim() != 1 or weight.dim() != 2 or len(s_meta) != len(w_meta):
        return None
    total = sum(int(w.shard_sizes[0]) for w in w_meta)
    if int(state.size(0)) != total:
        return None
    out = []
    for w, s in zip(w_meta, s_meta, strict=True):
        if w.placement is None or s.placement is None or w.placement.rank() != s.placement.rank():
            return None
        if int(s.shard_sizes[0]) != int(w.shard_sizes[0]):
            return None
        out.append(
            Block(
                offset=int(s.shard_offsets[0]),
                row_offset=int(w.shard_offsets[0]),
                rows=int(w.shard_sizes[0]),
                col_offset=int(w.shard_offsets[1]),
                cols=int(w.shard_sizes[1]),
            )
        )
    return out


def remap_block(pieces: Sequence[tuple[Block, torch.Tensor]], new: Block) -> torch.Tensor:
    """The new block's row-wise state from saved ``pieces`` (a block, or a row range of
    one, with its values): per row, the column-weighted mean of the pieces covering it
    (module docstring). Every row of ``new`` must be covered over all its columns once."""
    dtype = pieces[0][1].dtype if pieces else torch.float32
    out = torch.zeros(new.rows, dtype=dtype)
    cover = torch.zeros(new.rows, dtype=torch.int64)
    for block, values in pieces:
        width = block.col_overlap(new)
        rows = block.row_overlap(new)
        if not width or rows is None:
            continue
        a, b = rows
        out[a - new.row_offset : b - new.row_offset] += values[
            a - block.row_offset : b - block.row_offset
        ].to(dtype) * (width / new.cols)
        cover[a - new.row_offset : b - new.row_offset] += width
    bad = torch.nonzero(cover != new.cols).flatten()
    if bad.numel():
        row = new.row_offset + int(bad[0])
        raise ValueError(
            f"row {row}, columns {new.col_offset}..{new.col_end - 1}: the saved shards cover "
            f"{int(cover[bad[0]])} of its {new.cols} columns; the tables differ"
        )
    return out


def remap_rowwise(
    old_columns: Sequence[tuple[int, int]],
    old_values: torch.Tensor,
    new_columns: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """:func:`remap_block` for whole-row column shards: ``old_values`` is
    ``[len(old_columns), rows]``, the result ``[len(new_columns), rows]``."""
    if old_values.shape[0] != len(old_columns):
        raise ValueError(f"{old_values.shape[0]} rows of state for {len(old_columns)} shards")
    rows = int(old_values.shape[1])
    old = column_blocks(rows, old_columns)
    pieces = [(b, old_values[i]) for i, b in enumerate(old)]
    try:
        return torch.stack([remap_block(pieces, b) for b in column_blocks(rows, new_columns)])
    except ValueError as err:
        raise ValueError(f"columns are not covered once by the saved shards ({err})") from None


def rowwise_from_dense(sums: torch.Tensor, new: Block, first_row: int) -> torch.Tensor:
    """A row-wise block from a data-parallel table's Adagrad sums: ``sums`` holds rows
    ``first_row`` … of the table, every column; each row's value is the mean of its
    sums over the block's columns (exact: module docstring)."""
    a = new.row_offset - first_row
    return sums[a : a + new.rows, new.col_offset : new.col_end].float().mean(dim=1)


def dense_from_rowwise(
    pieces: Sequence[tuple[Block, torch.Tensor]], rows: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """A data-parallel table's Adagrad sums from saved row-wise blocks: each block's row
    value on each of its columns (an approximation: module docstring)."""
    out = torch.zeros((rows, dim), dtype=dtype)
    cover = torch.zeros((rows, dim), dtype=torch.int64)
    for block, values in pieces:
        if block.rows:
            out[block.row_offset : block.row_end, block.col_offset : block.col_end] = values[
                : block.rows, None
            ].to(dtype)
            cover[block.row_offset : block.row_end, block.col_offset : block.col_end] += 1
    if bool((cover != 1).any()):
        raise ValueError("the saved shards do not cover the table once")
    return out


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of half-open ranges, sorted, empty ones dropped."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class RowRead:
    """Rows of a saved tensor (entries of a 1-D one, rows × every column of a 2-D one)
    read through DCP into this rank only: put :attr:`request` in the state dict given
    to DCP's load under the saved name, then take :meth:`rows`.

    DCP reads, for each local shard of a requested ``ShardedTensor``, the saved pieces
    it overlaps, and nothing else; the rest of the tensor is described by shards
    placed on another rank, which this rank never reads. So the rows read are the
    union of ``ranges``, not the tensor. With one rank, the whole tensor."""

    def __init__(self, size: Sequence[int], dtype: torch.dtype, ranges: Sequence[tuple[int, int]]):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor.metadata import (
            ShardedTensorMetadata,
            TensorProperties,
        )
        from torch.distributed._shard.sharded_tensor.shard import Shard

        self.size = [int(x) for x in size]
        rest = self.size[1:]
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.ranges = merge_ranges(ranges)
        self.request: Any
        if world == 1 or self.ranges == [(0, self.size[0])]:
            self.ranges = [(0, self.size[0])]
            self.tensors = [torch.zeros(self.size, dtype=dtype)]
            self.request = self.tensors[0]
            return
        me = dist.get_rank()
        self.tensors = [torch.zeros([b - a, *rest], dtype=dtype) for a, b in self.ranges]
        mine, gaps, at = [], [], 0
        for a, b in self.ranges:
            if a > at:
                gaps.append((at, a))
            mine.append((a, b))
            at = b
        if at < self.size[0]:
            gaps.append((at, self.size[0]))

        def meta(a: int, b: int, rank: int) -> ShardMetadata:
            return ShardMetadata(
                shard_offsets=[a] + [0] * len(rest),
                shard_sizes=[b - a, *rest],
                placement=f"rank:{rank}/cpu",
            )

        local = [
            Shard(tensor=t, metadata=meta(a, b, me))
            for t, (a, b) in zip(self.tensors, mine, strict=True)
        ]
        other = (me + 1) % world
        metadata = ShardedTensorMetadata(
            shards_metadata=[meta(a, b, me) for a, b in mine]
            + [meta(a, b, other) for a, b in gaps],
            size=torch.Size(self.size),
            tensor_properties=TensorProperties(dtype=dtype),
        )
        self.request = ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Rows ``a`` … ``b`` as read (they must lie in one of the ranges asked for)."""
        for (start, end), tensor in zip(self.ranges, self.tensors, strict=True):
            if start <= a and b <= end:
                return tensor[a - start : b - start]
        if a == b:
            return self.tensors[0][:0]
        raise ValueError(f"rows {a}..{b - 1} were not read (read: {self.ranges})")

    @property
    def elements(self) -> int:
        """How many values this rank reads."""
        return sum(int(t.numel()) for t in self.tensors)

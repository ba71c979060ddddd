"""A plan rank's shards as a calibration stores, measures and prices them.

A rank of a plan runs one kernel per kernel group and precision
(:func:`~shardwise.planner.costmodel.predictor.kernel_order`): its table-wise and
column-wise shards fused at the global batch, each row range in its kind's kernel at
the global batch (reading the lookups that fall in its rows), and data-parallel copies
at the rank's own batch. So a rank task is *all its shards*, each written in
``ranks.json`` and the record's ``extra["shards"]`` as ``[table, cols, row_offset,
rows, kind]`` (an older two-entry ``[table, cols]`` reads as a fused shard), and the
same list gives the loads to time (:meth:`RankShard.load`) and the kernels to price
(:func:`rank_kernels`), so what is timed is what is priced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.planner.costmodel.predictor import kernel_order
from shardwise.planner.kinds import KINDS, V1_KINDS, kernel_group, local_batch, row_slice
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad

#: The kinds a calibration's verdict speaks of (grid is no planner's choice here).
JUDGED_KINDS: tuple[str, ...] = (
    "table_wise",
    "column_wise",
    "row_wise",
    "table_row_wise",
    "data_parallel",
)


@dataclass(frozen=True)
class RankShard:
    """One shard of a plan rank: ``cols`` columns of rows ``row_offset ..
    row_offset + rows`` (``rows`` None: every row) of table ``table`` in ``kind``."""

    table: str
    cols: int
    row_offset: int = 0
    rows: int | None = None
    kind: str = "table_wise"

    def to_json(self, spec: TableSpec) -> list[Any]:
        rows = spec.rows if self.rows is None else self.rows
        return [self.table, self.cols, self.row_offset, rows, self.kind]

    def load(self, spec: TableSpec) -> ShardLoad:
        """What :func:`~shardwise.profiler.compute.measure_compute` times."""
        return ShardLoad(
            spec,
            self.cols,
            self.row_offset,
            self.rows,
            group=kernel_group(self.kind),
            local_batch=local_batch(self.kind),
        )

    def view(self, spec: TableSpec) -> TableSpec:
        """The shard's kernel view: a row range as its :func:`row_slice` twin."""
        if self.rows is None:
            return spec
        return row_slice(spec, self.row_offset, self.rows)


def parse_shard(entry: Any, by_name: Mapping[str, TableSpec]) -> RankShard:
    """``[table, cols]`` (a fused shard) or ``[table, cols, row_offset, rows, kind]``;
    a ``KeyError``/``ValueError``/``TypeError`` for anything else."""
    if not isinstance(entry, list | tuple) or len(entry) not in (2, 5):
        raise ValueError(f"a rank's shard is [table, cols] or a 5-entry list, not {entry!r}")
    spec = by_name[str(entry[0])]
    cols = int(entry[1])
    if len(entry) == 2:
        return RankShard(spec.name, cols, kind="table_wise" if cols == spec.dim else "column_wise")
    offset, rows, kind = int(entry[2]), int(entry[3]), str(entry[4])
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    whole = offset == 0 and rows == spec.rows
    return RankShard(spec.name, cols, offset, None if whole else rows, kind)


def rank_shards(extra: Mapping[str, Any], by_name: Mapping[str, TableSpec]) -> list[RankShard]:
    """A rank record's (or task's) shards."""
    return [parse_shard(e, by_name) for e in extra.get("shards", [])]


def shard_kinds(shards: Sequence[RankShard]) -> frozenset[str]:
    """The kinds a rank holds (a column-wise shard of a fused kernel is its own kind)."""
    return frozenset(s.kind for s in shards)


def mixed(shards: Sequence[RankShard]) -> bool:
    """Whether a rank holds a shard of a kind other than table-wise/column-wise."""
    return any(s.kind not in V1_KINDS for s in shards)


@dataclass(frozen=True)
class Kernel:
    """One kernel of a rank as the predictor prices it: its shards' views and widths,
    its group, its precision and the batch it reads."""

    group: str
    dtype: str
    batch: int
    shards: tuple[tuple[TableSpec, int], ...]


def rank_kernels(
    shards: Sequence[RankShard],
    by_name: Mapping[str, TableSpec],
    batch: int,
    local: int,
) -> list[Kernel]:
    """The kernels ``shards`` run in (the grouping the profiler timed them with), the
    global ``batch`` or, for data-parallel shards, the rank's own ``local`` batch."""
    loads = [s.load(by_name[s.table]) for s in shards]
    out = []
    for group, is_local, dtype, members in kernel_order(loads):
        views = tuple((shards[k].view(by_name[shards[k].table]), shards[k].cols) for k in members)
        out.append(Kernel(group, dtype, local if is_local else batch, views))
    return out

"""Sharding kinds: how a table's shards cut it, and what each shard's kernel reads.

plan.json (version 2) names each table's kind (docs/design.md §5):

- ``table_wise``: one shard, the whole table, on one rank;
- ``column_wise``: column ranges on different ranks, every row each;
- ``row_wise``: row ranges over ranks; every rank sees the ids of the global batch
  that fall in its range and writes a partial pooled output for every sample, which
  a reduce-scatter sums;
- ``table_row_wise``: row-wise within the ranks of one host, so the reduce stays on
  the host's fast link;
- ``grid``: column ranges, each of them row-wise within one host's ranks;
- ``data_parallel``: the whole table on every rank, read at the rank's own batch; its
  gradients are all-reduced.

TorchRec runs each kind through its own sharding (a rank's table-wise and row-wise
shards are separate kernels), so a rank's compute is one kernel per
:func:`kernel_group` and precision. We keep table-wise and column-wise shards in one
fused kernel, as the cost model was trained and the evaluator has always timed them.

A row range is priced and measured by the lookups that fall in it. Specs carry no
spatial layout, and the hot ids of real tables (and of the generator) are scattered
over the rows by hashing, so a range of ``n`` of ``rows`` rows receives ``n / rows``
of the lookups with the table's reuse histogram: :func:`row_slice`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from shardwise.planner.tables import TableSpec

if TYPE_CHECKING:
    from shardwise.planner.topology import Topology

Kind = Literal["table_wise", "column_wise", "row_wise", "table_row_wise", "grid", "data_parallel"]
KINDS: tuple[Kind, ...] = get_args(Kind)
#: Kinds whose shards hold row ranges of the table (the others hold every row).
ROW_KINDS: frozenset[str] = frozenset({"row_wise", "table_row_wise", "grid"})
#: Kinds whose row ranges stay inside one host.
HOST_KINDS: frozenset[str] = frozenset({"table_row_wise", "grid"})
#: The kinds plan.json version 1 held.
V1_KINDS: frozenset[str] = frozenset({"table_wise", "column_wise"})
#: Short labels for tables and plots.
SHORT: dict[str, str] = {
    "table_wise": "TW",
    "column_wise": "CW",
    "row_wise": "RW",
    "table_row_wise": "TWRW",
    "grid": "GRID",
    "data_parallel": "DP",
}
#: TorchRec's ``ShardingType`` value of each kind.
TORCHREC_TYPE: dict[str, str] = {
    "table_wise": "table_wise",
    "column_wise": "column_wise",
    "row_wise": "row_wise",
    "table_row_wise": "table_row_wise",
    "grid": "grid_shard",
    "data_parallel": "data_parallel",
}
#: Kernel group of the table-wise and column-wise shards (one fused kernel).
FUSED_GROUP = "fused"


def kernel_group(kind: str) -> str:
    """The kernel a shard of ``kind`` runs in on its rank: table-wise and column-wise
    shards share the fused kernel, every other kind has its own (module docstring)."""
    return FUSED_GROUP if kind in V1_KINDS else kind


def local_batch(kind: str) -> bool:
    """Whether a shard of ``kind`` reads the rank's own batch (data-parallel) rather
    than the global batch that the input all-to-all brings it."""
    return kind == "data_parallel"


def even_row_split(rows: int, parts: int) -> list[tuple[int, int]]:
    """``(row_offset, rows)`` of ``parts`` row ranges as TorchRec cuts them: every
    range ``ceil(rows / parts)`` long but the last ones, which may be shorter or empty
    (10 rows over 4 ranks: 3, 3, 3, 1). TorchRec's row-wise input dist sends an id to
    rank ``id // ceil(rows / parts)``, so a plan it runs must cut exactly so."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    block = math.ceil(rows / parts)
    out = []
    for k in range(parts):
        start = min(k * block, rows)
        out.append((start, min(block, rows - start)))
    return out


def host_of(rank: int, local_world: int) -> int:
    """The host of ``rank`` when each host has ``local_world`` ranks, in rank order."""
    return rank // local_world


def host_ranks(host: int, local_world: int) -> list[int]:
    return list(range(host * local_world, (host + 1) * local_world))


def lookup_share(shard_rows: int, table_rows: int) -> float:
    """The share of a table's lookups that land in ``shard_rows`` of its rows."""
    return 0.0 if table_rows <= 0 else shard_rows / table_rows


def row_slice(spec: TableSpec, row_offset: int, rows: int) -> TableSpec:
    """The table as a row range's kernel sees it: ``rows`` rows receiving their share of
    the lookups (module docstring), the same reuse histogram. A whole range is the
    spec itself. Named ``table[a:b]`` so caches keep ranges apart."""
    if row_offset == 0 and rows == spec.rows:
        return spec
    share = lookup_share(rows, spec.rows)
    return spec.model_copy(
        update={
            "name": f"{spec.name}[{row_offset}:{row_offset + rows}]",
            "rows": max(rows, 1),
            "pooling_factor": spec.pooling_factor * share,
        }
    )


@dataclass(frozen=True)
class KernelShard:
    """One shard as its rank's kernel runs it: the rows it holds with the lookups they
    receive (``spec``), its width, the kernel it runs in and at which batch."""

    spec: TableSpec
    cols: int
    group: str
    #: True: the rank's own batch (data-parallel); False: the global batch.
    local_batch: bool = False
    #: The table this shard is part of (``spec`` is renamed for a row range).
    table: str = ""
    row_offset: int = 0


def describe_kind(kind: str, shards: int, hosts: int = 1) -> str:
    """``"row-wise over 8 ranks"``: a kind as the per-rank tables and ``describe`` say it."""
    words = kind.replace("_", "-")
    if kind == "table_wise":
        return words
    if kind == "data_parallel":
        return f"{words} on {shards} ranks"
    if kind in HOST_KINDS and hosts > 1:
        return f"{words} over {shards} ranks of {hosts} hosts"
    return f"{words} over {shards} ranks"


@dataclass(frozen=True)
class KindOption:
    """One runnable choice of a table's kind (:func:`kind_options`): ``table_wise``
    stands for the fused kinds (table-wise or column-wise, placed by a planner);
    ``host`` is the host of a ``table_row_wise`` choice (-1 for every other kind)."""

    kind: Kind
    host: int = -1

    def describe(self, topology: Topology) -> str:
        """``"row-wise over 8 ranks"``, ``"table-row-wise on host 1 (4 ranks)"``."""
        if self.kind in V1_KINDS:
            return "table-wise/column-wise"
        if self.kind == "table_row_wise":
            return f"table-row-wise on host {self.host} ({topology.local_world} ranks)"
        return describe_kind(self.kind, topology.gpus)


#: The fused choice (table-wise or column-wise shards a planner places).
FUSED = KindOption("table_wise")


def kind_options(spec: TableSpec, topology: Topology) -> list[KindOption]:
    """The kinds ``spec`` can run in on ``topology``, each fitting an empty GPU under the
    memory rule: fused (:data:`FUSED`) unless no GPU holds the table whole; ``row_wise``
    over every rank; ``table_row_wise`` on each host when there are several hosts (on
    one host it is row-wise's cut); ``data_parallel`` for fp32 tables (the runtime
    refuses fp16 ones). Grid stays out: it is no planner's choice here. One rank: fused
    only (every other kind needs two)."""
    from shardwise.planner.memory import kind_memory, table_bytes

    cap, world, local = topology.usable_bytes, topology.gpus, topology.local_world
    batch = topology.batch_size_per_rank
    out: list[KindOption] = []
    if table_bytes(spec, topology) <= cap:
        out.append(FUSED)
    if world < 2:
        return out

    def first_range(kind: str, parts: int) -> int:
        rows = min(spec.rows, math.ceil(spec.rows / parts))
        need = kind_memory(
            kind, rows, spec.dim, spec.dtype, spec.pooling_factor, batch, world, local
        )
        return need.total

    if first_range("row_wise", world) <= cap:
        out.append(KindOption("row_wise"))
    if topology.hosts > 1 and local > 1 and first_range("table_row_wise", local) <= cap:
        out += [KindOption("table_row_wise", h) for h in range(topology.hosts)]
    if spec.dtype == "fp32" and first_range("data_parallel", 1) <= cap:
        out.append(KindOption("data_parallel"))
    return out

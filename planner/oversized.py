"""Tables no GPU holds whole: placed row-wise by a fixed rule before a planner places the rest.

A table whose whole-table memory (docs/memory.md, at the job's batch) is more than a
GPU's usable memory cannot be placed table-wise. Column-wise cuts do not help much:
every column shard still holds every row and its optimizer state, and a 2e9-row table
would "fit" only as a dozen shards of a few columns that no one would run. TorchRec
places such tables row-wise, and so do we, by one rule every planner here shares:

- **table-row-wise** on one host when the host's GPUs hold it (the reduce-scatter stays
  on the host's fast link), on the host with the most free memory on its fullest GPU;
- **row-wise** over every GPU otherwise.

Rows are cut as TorchRec cuts them (:func:`~shardwise.planner.kinds.even_row_split`),
the only cut its row-wise input dist can run. Largest tables first. The planners then
place every other table around them, counting the memory these shards already hold on
each rank. NeuroShard starts from this rule and may then switch such a table between
row-wise and table-row-wise on a host by its cost model, never to table-wise or
column-wise (:mod:`shardwise.planner.neuroshard.kindmoves`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.basics import UserError, format_bytes
from shardwise.planner.kinds import Kind, KindOption, even_row_split, host_ranks
from shardwise.planner.memory import (
    ShardMemory,
    gpu_memory_to_fit,
    kind_memory,
    largest_batch,
    table_bytes,
)
from shardwise.planner.plan import Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import MAX_RANKS, Topology


@dataclass(frozen=True)
class RowPlaced:
    """One oversized table's placement: its kind and shards."""

    index: int  # in the planner's table list
    kind: Kind
    shards: list[Shard]


@dataclass(frozen=True)
class Oversized:
    """The row-wise placements of every oversized table, and what they hold per rank."""

    placed: list[RowPlaced]
    #: Bytes their shards hold on each rank (the memory rule).
    memory: list[int]

    @property
    def indices(self) -> set[int]:
        return {p.index for p in self.placed}

    def describe(self, tables: Sequence[TableSpec]) -> str:
        """``"t0 row-wise over 8 ranks; t3 table-row-wise on host 1"``."""
        parts = []
        for p in self.placed:
            name = tables[p.index].name
            if p.kind == "row_wise":
                parts.append(f"{name} row-wise over {len(p.shards)} ranks")
            else:
                parts.append(f"{name} table-row-wise over ranks {sorted(s.rank for s in p.shards)}")
        return "; ".join(parts)


def row_shard_memory(
    spec: TableSpec, kind: Kind, ranks: int, topology: Topology, batch: int | None = None
) -> ShardMemory:
    """The largest shard (the first, ``ceil(rows / ranks)`` rows) of ``spec`` cut
    row-wise over ``ranks`` ranks: what each of them must hold."""
    rows = min(spec.rows, math.ceil(spec.rows / ranks))  # even_row_split's first range
    b = topology.batch_size_per_rank if batch is None else batch
    return kind_memory(
        kind,
        rows,
        spec.dim,
        spec.dtype,
        spec.pooling_factor,
        b,
        topology.gpus,
        topology.local_world,
    )


def is_oversized(spec: TableSpec, topology: Topology) -> bool:
    return table_bytes(spec, topology) > topology.usable_bytes


def place_oversized(tables: Sequence[TableSpec], topology: Topology) -> Oversized:
    """The fixed rule of the module docstring for every table that no GPU holds whole;
    a :class:`UserError` with the figures when one fits nowhere even row-wise over every
    GPU (:func:`too_big_message`)."""
    world, local, cap = topology.gpus, topology.local_world, topology.usable_bytes
    used = [0] * world
    placed: list[RowPlaced] = []
    big = [i for i, t in enumerate(tables) if is_oversized(t, topology)]
    for i in sorted(big, key=lambda i: (-table_bytes(tables[i], topology), tables[i].name)):
        spec = tables[i]
        kind: Kind = "row_wise"
        ranks = list(range(world))
        host = _roomiest_host(used, topology)
        on_host = host_ranks(host, local)
        need = row_shard_memory(spec, "table_row_wise", local, topology).total
        if topology.hosts > 1 and max(used[r] for r in on_host) + need <= cap:
            kind, ranks = "table_row_wise", on_host
        else:
            need = row_shard_memory(spec, "row_wise", world, topology).total
            if max(used) + need > cap:
                raise UserError(too_big_message(spec, topology, already=max(used)))
        shards = [
            Shard(rank=r, cols=spec.dim, row_offset=o, rows=n)
            for r, (o, n) in zip(ranks, even_row_split(spec.rows, len(ranks)), strict=True)
        ]
        for s in shards:
            used[s.rank] += kind_memory(
                kind,
                s.row_count(spec.rows),
                spec.dim,
                spec.dtype,
                spec.pooling_factor,
                topology.batch_size_per_rank,
                world,
                local,
            ).total
        placed.append(RowPlaced(i, kind, shards))
    placed.sort(key=lambda p: p.index)
    return Oversized(placed, used)


def _roomiest_host(used: Sequence[int], topology: Topology) -> int:
    """The host whose fullest GPU holds least (the lowest host on ties)."""
    local = topology.local_world
    return min(range(topology.hosts), key=lambda h: (max(used[r] for r in host_ranks(h, local)), h))


def too_big_message(spec: TableSpec, topology: Topology, already: int = 0) -> str:
    """Why ``spec`` fits nowhere even row-wise over every GPU, with the figures and what
    would fit: GPU memory, more GPUs, or a smaller batch per rank."""
    batch, world = topology.batch_size_per_rank, topology.gpus
    need = row_shard_memory(spec, "row_wise", world, topology)
    whole = table_bytes(spec, topology)
    ways = [
        f"GPUs of {format_bytes(gpu_memory_to_fit(need.total + already, topology))} "
        f"(--gpu-memory, at the {topology.memory_reserve:.0%} reserve)"
    ]
    gpus = gpus_to_fit_row_wise(spec, topology)
    if gpus is not None:
        ways.append(f"{gpus} GPUs (--gpus)")
    fit_batch = largest_batch(
        lambda b: row_shard_memory(spec, "row_wise", world, topology, b).total + already,
        topology.usable_bytes,
        batch,
    )
    if 0 < fit_batch < batch:
        ways.append(f"a batch of at most {fit_batch} per rank (--batch-per-rank)")
    held = f" beside {format_bytes(already)} of other row-wise tables" if already else ""
    return (
        f"table {spec.name} ({spec.rows} rows x {spec.dim} {spec.dtype}) needs "
        f"{format_bytes(whole)} whole, and even row-wise over all {world} GPUs each holds "
        f"{need.describe()} at batch {batch} per rank x {world} ranks{held} (a row shard "
        f"writes a partial output for every sample of the global batch); "
        f"{topology.describe_capacity()}. What would fit: {', or '.join(ways)}."
    )


def gpus_to_fit_row_wise(spec: TableSpec, topology: Topology) -> int | None:
    """The fewest GPUs (more than today's) of this size over which ``spec`` fits
    row-wise, or None. Each GPU added takes rows off every shard but adds its samples to
    every shard's outputs, so a shard's memory falls, then rises again with the GPUs:
    past its lowest point more GPUs do not help."""
    cap = topology.usable_bytes

    def need(w: int) -> int:
        topo = topology.model_copy(update={"gpus": w, "gpus_per_host": None})
        return row_shard_memory(spec, "row_wise", w, topo).total

    lo, hi = topology.gpus + 1, MAX_RANKS
    if lo > hi:
        return None
    # The lowest point of a convex need(w): ternary search on integers.
    a, b = lo, hi
    while b - a > 2:
        m1, m2 = a + (b - a) // 3, b - (b - a) // 3
        if need(m1) <= need(m2):
            b = m2
        else:
            a = m1
    best = min(range(a, b + 1), key=need)
    if need(best) > cap:
        return None
    # need() falls from lo to best: the first w that fits.
    while lo < best:
        mid = (lo + best) // 2
        if need(mid) <= cap:
            best = mid
        else:
            lo = mid + 1
    return best


def kind_shards(option: KindOption, spec: TableSpec, topology: Topology) -> list[Shard]:
    """The shards of ``spec`` under a splitting ``option``: TorchRec's even row cut
    (:func:`even_row_split`, the only one its input dist runs) over every rank
    (``row_wise``) or over host ``option.host``'s ranks (``table_row_wise``); a whole
    copy on every rank (``data_parallel``). Fused kinds have no fixed shards: a planner
    places them, so asking for them is an error."""
    if option.kind == "data_parallel":
        return [Shard(rank=r, cols=spec.dim) for r in range(topology.gpus)]
    if option.kind == "row_wise":
        ranks = list(range(topology.gpus))
    elif option.kind == "table_row_wise":
        if not 0 <= option.host < topology.hosts:
            raise ValueError(
                f"table-row-wise on host {option.host}: the topology has hosts "
                f"0..{topology.hosts - 1}"
            )
        ranks = host_ranks(option.host, topology.local_world)
    else:
        raise ValueError(f"{option.kind} shards are placed by a planner, not fixed by the kind")
    cuts = even_row_split(spec.rows, len(ranks))
    return [
        Shard(rank=r, cols=spec.dim, row_offset=o, rows=n)
        for r, (o, n) in zip(ranks, cuts, strict=True)
    ]

"""The heuristic baselines of NeuroShard/DreamShard: random and four greedy planners.

Each greedy planner gives every table a scalar cost, sorts tables costliest first and
puts each on the rank with the lowest summed cost that still has memory for it
(longest-processing-time first). They place tables whole (table-wise), except tables
that no GPU holds whole, which go row-wise first by the rule every planner shares
(:mod:`shardwise.planner.oversized`; their cost is spread over their ranks). They never
exceed memory as planner/memory.py counts it (weights, optimizer state and I/O buffers
at the job's batch): when a table fits nowhere they fail with the numbers instead.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from collections.abc import Sequence

from shardwise.basics import UserError, format_bytes
from shardwise.planner.base import Planner, check_capacity
from shardwise.planner.kinds import Kind
from shardwise.planner.memory import shard_memory, table_bytes
from shardwise.planner.oversized import Oversized, place_oversized
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology


def _no_room(table: TableSpec, free: Sequence[int], topology: Topology) -> UserError:
    need = shard_memory(table, table.dim, topology.batch_size_per_rank, topology.gpus)
    return UserError(
        f"table {table.name} needs {need.describe()} at batch {topology.batch_size_per_rank} "
        f"per rank x {topology.gpus} ranks, but the most any GPU has left is "
        f"{format_bytes(max(free))} ({topology.describe_capacity()}); table-wise placement "
        "cannot fit these tables. Add GPUs or memory, lower the batch, or use a planner "
        "that splits tables column-wise (torchrec, neuroshard)."
    )


def _assemble(
    tables: Sequence[TableSpec],
    ranks: Sequence[int],
    fixed: Oversized,
    topology: Topology,
    planner: str,
) -> Plan:
    """The plan: the row-placed tables as placed, every other table whole on its rank."""
    rows = {p.index: p for p in fixed.placed}
    shards: list[list[Shard]] = []
    kinds: list[Kind | None] = []
    for i, t in enumerate(tables):
        if i in rows:
            shards.append(rows[i].shards)
            kinds.append(rows[i].kind)
        else:
            shards.append([Shard(rank=ranks[i], cols=t.dim)])
            kinds.append(None)
    return Plan.from_shards(tables, shards, topology, planner, kinds=kinds)


class GreedyPlanner(Planner):
    """Costliest table first onto the least-loaded rank that fits it."""

    @abstractmethod
    def cost(self, table: TableSpec) -> float:
        """The scalar this heuristic balances across ranks."""

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology)
        fixed = place_oversized(tables, topology)
        load = [0.0] * topology.gpus
        free = [topology.usable_bytes - used for used in fixed.memory]
        for p in fixed.placed:
            for s in p.shards:
                load[s.rank] += self.cost(tables[p.index]) / len(p.shards)
        ranks = [0] * len(tables)
        skip = fixed.indices
        order = sorted(
            (i for i in range(len(tables)) if i not in skip),
            key=lambda i: (-self.cost(tables[i]), tables[i].name),
        )
        for i in order:
            t = tables[i]
            need = table_bytes(t, topology)
            fitting = [r for r in range(topology.gpus) if free[r] >= need]
            if not fitting:
                raise _no_room(t, free, topology)
            r = min(fitting, key=lambda r: (load[r], r))
            ranks[i] = r
            load[r] += self.cost(t)
            free[r] -= need
        return _assemble(tables, ranks, fixed, topology, self.name)


class SizeGreedyPlanner(GreedyPlanner):
    name = "size-greedy"
    summary = "balance bytes: largest table first onto the rank with the fewest bytes"

    def cost(self, table: TableSpec) -> float:
        return float(table.size_bytes)


class DimGreedyPlanner(GreedyPlanner):
    name = "dim-greedy"
    summary = "balance embedding width: widest table first onto the narrowest rank"

    def cost(self, table: TableSpec) -> float:
        return float(table.dim)


class LookupGreedyPlanner(GreedyPlanner):
    name = "lookup-greedy"
    summary = "balance lookups: dim x pooling factor"

    def cost(self, table: TableSpec) -> float:
        return table.dim * table.pooling_factor


class SizeLookupGreedyPlanner(GreedyPlanner):
    name = "size-lookup-greedy"
    summary = "balance lookups weighted by size: dim x pooling factor x log10(rows)"

    def cost(self, table: TableSpec) -> float:
        return table.dim * table.pooling_factor * math.log10(max(table.rows, 10))


class RandomPlanner(Planner):
    """Each table on a uniformly random rank among those with room (seeded)."""

    name = "random"
    summary = "each table on a random rank that has room (seed: --seed)"

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology)
        fixed = place_oversized(tables, topology)
        rng = random.Random(self.options.seed)
        free = [topology.usable_bytes - used for used in fixed.memory]
        ranks = [0] * len(tables)
        need = [table_bytes(t, topology) for t in tables]
        # Largest first, so that random choices early on cannot strand a big table.
        skip = fixed.indices
        rest = (i for i in range(len(tables)) if i not in skip)
        for i in sorted(rest, key=lambda i: -need[i]):
            t = tables[i]
            fitting = [r for r in range(topology.gpus) if free[r] >= need[i]]
            if not fitting:
                raise _no_room(t, free, topology)
            ranks[i] = rng.choice(fitting)
            free[ranks[i]] -= need[i]
        return _assemble(tables, ranks, fixed, topology, self.name)

"""The heuristic baselines of NeuroShard/DreamShard: random and four greedy planners.

Each greedy planner gives every table a scalar cost, sorts tables costliest first and
puts each on the rank with the lowest summed cost that still has memory for it
(longest-processing-time first). They place tables whole (table-wise) and never
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
from shardwise.planner.memory import shard_memory, table_bytes
from shardwise.planner.plan import Plan, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology


def _no_room(table: TableSpec, free: Sequence[int], topology: Topology) -> UserError:
    need = shard_memory(table, table.dim, topology.batch_size_per_rank, topology.gpus)
    return UserError(
        f"table {table.name} needs {need.describe()} at batch {topology.batch_size_per_rank} "
        f"per rank x {topology.gpus} ranks, but the most any GPU has left is "
        f"{format_bytes(max(free))} ({topology.describe_capacity()}); table-wise placement "
        "cannot fit these tables. Add GPUs or memory, lower the batch, or use a planner "
        "that splits tables column-wise (torchrec)."
    )


class GreedyPlanner(Planner):
    """Costliest table first onto the least-loaded rank that fits it."""

    @abstractmethod
    def cost(self, table: TableSpec) -> float:
        """The scalar this heuristic balances across ranks."""

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology)
        load = [0.0] * topology.gpus
        free = [topology.usable_bytes] * topology.gpus
        ranks = [0] * len(tables)
        order = sorted(range(len(tables)), key=lambda i: (-self.cost(tables[i]), tables[i].name))
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
        return table_wise_plan(tables, ranks, topology, self.name)


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
        rng = random.Random(self.options.seed)
        free = [topology.usable_bytes] * topology.gpus
        ranks = [0] * len(tables)
        need = [table_bytes(t, topology) for t in tables]
        # Largest first, so that random choices early on cannot strand a big table.
        for i in sorted(range(len(tables)), key=lambda i: -need[i]):
            t = tables[i]
            fitting = [r for r in range(topology.gpus) if free[r] >= need[i]]
            if not fitting:
                raise _no_room(t, free, topology)
            ranks[i] = rng.choice(fitting)
            free[ranks[i]] -= need[i]
        return table_wise_plan(tables, ranks, topology, self.name)

"""The benchmark's tasks (docs/design.md §9): pools of held-out tables, and tasks drawn
from them with a memory limit set by the best packing we can find.

- **Pools.** One per :class:`~shardwise.profiler.bench.spec.PoolSpec`: a family's
  tables for a seed the bundled model never saw (or a tables file), without tables
  above ``max_table_bytes`` or ``max_pooling``. Written once into the results folder,
  so a resumed run draws from exactly the same tables.
- **Tasks.** Each (pool, shape, fill, index) draws T tables without replacement,
  seeded by those numbers; a task is the same in every run.
- **Memory.** Each table costs :func:`shardwise.planner.memory.shard_bytes` at the
  task's batch (weights, row-wise Adagrad state, I/O buffers: the rule every planner
  and the validator use). We pack the whole tables as tightly as we can (largest first
  onto the emptiest GPU, then moves and swaps off the fullest GPU while it shrinks) and
  size the GPUs so that this packing's fullest GPU is ``fill`` full, ``fill`` drawn
  from the task's range (``tight``: 85–95 %, as in the NeuroShard paper). The best
  packing may be a little tighter than ours: ``fill_bound`` (the lower bound
  ``max(total / W, largest table)`` over the usable memory) says by how much at most.
- **Balanced memory** (a pool's ``sizing: balanced``, the industrial pool): sized as
  above, no GPU would be smaller than the largest table. Here the GPUs are sized by
  the tables' total instead, so that a table holding a large share of it is larger
  than a GPU: starting from GPUs whose usable memory is ``total / (W × fill)``, each
  table no GPU holds whole is cut row-wise over every GPU (TorchRec's even cut, its
  row-wise memory: :func:`shardwise.planner.memory.kind_memory`), the others are packed
  whole around those row shards as above, and the GPUs grow until that packing's
  fullest GPU is ``fill`` full (a table that then fits whole is packed whole). The
  task records how many tables no GPU holds (``oversized``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.basics import UserError, format_bytes
from shardwise.planner.families import generate
from shardwise.planner.kinds import even_row_split
from shardwise.planner.memory import gpu_memory_to_fit, kind_memory, shard_bytes
from shardwise.planner.tables import TableSpec, load_tables, save_tables
from shardwise.planner.topology import Topology
from shardwise.profiler.bench.spec import POOL_HISTOGRAM_BATCH, BenchSpec, PoolSpec

POOLS_DIR = "pools"


@dataclass(frozen=True)
class Task:
    """T tables of one pool for W GPUs: one line of the benchmark."""

    id: str
    pool: str
    fill_kind: str  # "tight" or "slack"
    index: int
    seed: int
    tables: list[TableSpec]
    topology: Topology
    #: Fullest GPU of our packing / usable memory (the drawn fill), and the lower
    #: bound's share: the best packing's fill lies between the two.
    fill: float
    fill_bound: float
    memory_total: int  # every table's bytes under the memory rule
    #: Tables no GPU of the task holds whole (balanced sizing only).
    oversized: int = 0


# --------------------------------------------------------------------------- pools


def pool_tables(
    pool: PoolSpec, base: Path | None, on_table: Callable[[], None] | None = None
) -> list[TableSpec]:
    """The pool's tables after its filters; a :class:`UserError` if none are left."""
    if pool.file is not None:
        path = Path(pool.file)
        tables = load_tables(path if path.is_absolute() or base is None else base / path)
        source = f"pool file {pool.file}"
    else:
        assert pool.family is not None  # the spec's validator
        tables = generate(pool.family, pool.count, pool.seed, POOL_HISTOGRAM_BATCH, on_table)
        source = f"{pool.family} pool (seed {pool.seed}, {pool.count} tables)"
    kept = [
        t
        for t in tables
        if t.size_bytes <= pool.max_table_bytes and t.pooling_factor <= pool.max_pooling
    ]
    if not kept:
        raise UserError(
            f"the {source} has no table of at most {format_bytes(pool.max_table_bytes)} "
            f"(max_table_bytes) read at most {pool.max_pooling:g} times per sample "
            "(max_pooling); raise them or count."
        )
    return kept


def load_pools(
    spec: BenchSpec, out_dir: Path, base: Path | None, on_step: Callable[[str], None]
) -> dict[str, list[TableSpec]]:
    """Every pool, from ``out_dir/pools/<key>.yaml`` when an earlier run wrote it, else
    drawn (and written there). A pool smaller than the largest T is refused."""
    need = max(s.tables for s in spec.shapes)
    pools: dict[str, list[TableSpec]] = {}
    for pool in spec.pools:
        path = out_dir / POOLS_DIR / f"{pool.key}.yaml"
        if path.exists():
            tables = load_tables(path)
        else:
            on_step(f"drawing the {pool.key} pool")
            tables = pool_tables(pool, base)
            save_tables(tables, path)
        if len(tables) < need:
            raise UserError(
                f"pool {pool.key} keeps {len(tables)} tables after its filters "
                f"(max_table_bytes {format_bytes(pool.max_table_bytes)}, max_pooling "
                f"{pool.max_pooling:g}), but tasks of T={need} need at least that many; "
                "raise its count or filters, or lower the largest T in 'shapes'."
            )
        pools[pool.key] = tables
    return pools


# --------------------------------------------------------------------------- packing


def pack(
    sizes: Sequence[int], bins: int, start: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """A tight packing of ``sizes`` into ``bins`` already holding ``start`` (default
    nothing): (each item's bin, each bin's load).

    Largest first onto the emptiest bin, then single moves and pairwise swaps off the
    fullest bin while they lower it (each step strictly lowers the max or the number
    of bins at it, so it ends)."""
    where = [0] * len(sizes)
    load = list(start) if start is not None else [0] * bins
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = min(range(bins), key=lambda b: load[b])
        where[i] = b
        load[b] += sizes[i]
    improved = True
    while improved and bins > 1:
        improved = False
        top = max(range(bins), key=lambda b: load[b])
        for i in [i for i in range(len(sizes)) if where[i] == top]:
            for b in range(bins):
                if b == top:
                    continue
                if load[b] + sizes[i] < load[top]:  # move
                    load[top] -= sizes[i]
                    load[b] += sizes[i]
                    where[i] = b
                    improved = True
                    break
                for j in [j for j in range(len(sizes)) if where[j] == b]:
                    delta = sizes[i] - sizes[j]
                    if delta > 0 and load[b] + delta < load[top]:  # swap
                        load[top] -= delta
                        load[b] += delta
                        where[i], where[j] = b, top
                        improved = True
                        break
                if improved:
                    break
            if improved:
                break
    return where, load


def task_topology(
    tables: Sequence[TableSpec], gpus: int, batch_per_rank: int, fill: float
) -> tuple[Topology, float, float, int]:
    """GPUs sized so that our packing's fullest GPU is ``fill`` full: the topology, the
    fill reached, the lower bound's fill, and the tables' total bytes."""
    sizes = [shard_bytes(t, t.dim, batch_per_rank, gpus) for t in tables]
    _, load = pack(sizes, gpus)
    fullest = max(load)
    base = Topology(gpus=gpus, gpu_memory_bytes=1, device="cpu", batch_size_per_rank=batch_per_rank)
    memory = gpu_memory_to_fit(math.ceil(fullest / fill), base)
    topology = base.model_copy(update={"gpu_memory_bytes": memory})
    usable = topology.usable_bytes
    bound = max(math.ceil(sum(sizes) / gpus), max(sizes))
    return topology, fullest / usable, bound / usable, sum(sizes)


def row_wise_load(spec: TableSpec, gpus: int, batch_per_rank: int) -> list[int]:
    """Bytes each rank holds of ``spec`` cut row-wise over ``gpus`` ranks (TorchRec's
    even cut, the memory rule's row-wise shards)."""
    return [
        kind_memory(
            "row_wise", n, spec.dim, spec.dtype, spec.pooling_factor, batch_per_rank, gpus
        ).total
        for _, n in even_row_split(spec.rows, gpus)
    ]


def balanced_topology(
    tables: Sequence[TableSpec], gpus: int, batch_per_rank: int, fill: float
) -> tuple[Topology, float, float, int, int]:
    """GPUs sized by the tables' total (module docstring, "Balanced memory"): the
    topology, the fill reached, the lower bound's fill, the tables' total bytes (row-wise
    ones as cut) and how many tables no GPU holds whole."""
    base = Topology(gpus=gpus, gpu_memory_bytes=1, device="cpu", batch_size_per_rank=batch_per_rank)
    whole = [shard_bytes(t, t.dim, batch_per_rank, gpus) for t in tables]
    rows = [row_wise_load(t, gpus, batch_per_rank) for t in tables]
    memory = gpu_memory_to_fit(math.ceil(sum(whole) / gpus / fill), base)
    while True:
        usable = base.model_copy(update={"gpu_memory_bytes": memory}).usable_bytes
        big = [i for i, w in enumerate(whole) if w > usable]
        start = [sum(rows[i][r] for i in big) for r in range(gpus)]
        rest = [w for i, w in enumerate(whole) if i not in big]
        fullest = max(pack(rest, gpus, start)[1])
        need = gpu_memory_to_fit(math.ceil(fullest / fill), base)
        if need <= memory:
            break
        memory = need
    topology = base.model_copy(update={"gpu_memory_bytes": memory})
    total = sum(start) + sum(rest)
    bound = max(math.ceil(total / gpus), max(rest, default=0), max(start))
    return topology, fullest / usable, bound / usable, total, len(big)


def draw_tasks(spec: BenchSpec, pools: dict[str, list[TableSpec]]) -> list[Task]:
    """Every task of the grid, in order (pool, shape, fill, index); pure in ``spec``
    and the pools."""
    tasks = []
    for p, pool in enumerate(spec.pools):
        tables_of_pool = pools[pool.key]
        for shape in spec.shapes:
            for f, (kind, (lo, hi)) in enumerate(sorted(spec.fills.items())):
                for index in range(spec.tasks):
                    seq = np.random.SeedSequence([spec.seed, p, shape.tables, shape.gpus, f, index])
                    seed = int(seq.generate_state(1)[0])
                    rng = np.random.default_rng(seed)
                    picked = rng.choice(len(tables_of_pool), shape.tables, replace=False)
                    tables = [tables_of_pool[i] for i in sorted(int(i) for i in picked)]
                    fill = float(rng.uniform(lo, hi))
                    batch = spec.rank_batch(shape.gpus)
                    oversized = 0
                    if pool.sizing == "balanced":
                        topology, reached, bound, total, oversized = balanced_topology(
                            tables, shape.gpus, batch, fill
                        )
                    else:
                        topology, reached, bound, total = task_topology(
                            tables, shape.gpus, batch, fill
                        )
                    tasks.append(
                        Task(
                            id=f"{pool.key}-T{shape.tables}-W{shape.gpus}-{kind}-{index}",
                            pool=pool.key,
                            fill_kind=kind,
                            index=index,
                            seed=seed,
                            tables=tables,
                            topology=topology,
                            fill=reached,
                            fill_bound=bound,
                            memory_total=total,
                            oversized=oversized,
                        )
                    )
    return tasks

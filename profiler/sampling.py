"""NeuroShard-style table augmentation and task sampling for the cost dataset (docs/design.md §7).

The cost models must generalize to tables and shard widths they never saw, so the
profiler does not only measure the given tables: it first *augments* them (every table
at every width of ``dims``, which is also what column-wise shards look like to the
kernel) and then measures random *tasks* drawn from that pool.

Every task is a pure function of ``(seed, index)``: task ``i`` is the same whether
10 or 10 000 tasks are asked for, so a profiling run that resumes (or is extended
with a larger ``--samples``) measures exactly the tasks it would have measured in one
go, and the dataset's sample index names the task.

Distributions (documented here because the cost model's coverage depends on them):

*Compute tasks* (:func:`compute_task`)
    - the number of tables T is uniform on 1..``max_tables`` (15, as NeuroShard);
    - all tables of a task have one dtype, because one fused FBGEMM kernel has one
      weights precision: fp16 with probability ``fp16_share`` (default 0), else fp32;
    - tables are drawn uniformly without replacement from the pool entries whose
      weights fit the memory still free under ``memory_cap_bytes``; when nothing left
      fits, the task stops short of T (so under a tight cap big tables appear in
      smaller tasks — the cap is a hard bound, T is a target).
*Tasks of other kinds* (:func:`kind_task`), a share of the compute tasks each
    (``row_share``, ``dp_share``; the rest are the compute tasks above, unchanged):
    - *row-wise*: a rank of TorchRec's row-wise cut over ``m`` ranks, ``m`` uniform on
      :data:`ROW_PARTS`, holding range ``k`` (uniform on 0..m-1) of
      :func:`~shardwise.planner.kinds.even_row_split` of *every* table of the task, in
      the ``row_wise`` kernel at the global batch. Tables are drawn as above, the cap
      bounding the ranges' weights (what the rank holds), and a table whose range
      ``k`` is empty is not drawn; when range ``k`` of every table is empty, range 0
      is taken;
    - *data-parallel*: a rank of a job over ``W`` ranks (uniform on
      :data:`DP_WORLDS`) that reads ``batch // W`` samples: fp32 tables (the runtime
      refuses fp16 data-parallel) drawn as above, each data-parallel with probability
      1/2 (at least one), the others whole in the fused kernel at the global batch,
      so the rank mixes kinds as DMP runs them.
*Communication tasks* (:func:`comm_task`)
    - the world size is uniform over ``world_sizes``;
    - each rank's output dim is 0 with probability ``zero_share`` (an idle rank), else
      (discrete) log-uniform on the multiples of 4 in 4..``max_dim`` — log-uniform so
      narrow ranks (a few small tables) are as well covered as wide ones; at least one
      rank is non-zero;
    - with probability ``no_delay_share`` every start delay is 0 (the pure all-to-all);
      otherwise each rank's delay is uniform on [0, ``max_delay_s``] and the smallest
      is shifted to 0, so delays are the straggler wait relative to the first rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.kinds import FUSED_GROUP, even_row_split
from shardwise.planner.tables import TableSpec

if TYPE_CHECKING:
    from shardwise.profiler.compute import ShardLoad

#: NeuroShard's augmentation widths.
AUGMENT_DIMS: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
#: Default cap on one compute task's weights: 2 GiB keeps every task (plus its
#: optimizer state and buffers) well inside a small CPU host or one GPU.
DEFAULT_MEMORY_CAP_BYTES = 2 << 30
DEFAULT_WORLD_SIZES: tuple[int, ...] = (2, 4, 8)
DEFAULT_MAX_DIM = 2048
DEFAULT_MAX_DELAY_S = 0.05

# Augmented names: "<base>-d<dim>" (TableSpec names cannot hold "@" or ".").
_AUG_SUFFIX = re.compile(r"^(?P<base>.+)-d(?P<dim>\d+)$")
# Independent streams per purpose, spawned from the user's seed.
_COMPUTE_KEY = 11
_COMM_KEY = 12
_KIND_KEY = 13
_ROW_KEY = 14
_DP_KEY = 15
#: The row-wise cuts a row-wise task takes a range of (ranks of the cut).
ROW_PARTS: tuple[int, ...] = (2, 4, 8, 16, 32)
#: The world sizes a data-parallel task reads the local batch of.
DP_WORLDS: tuple[int, ...] = (2, 4, 8, 16)
TaskKind = Literal["fused", "row_wise", "data_parallel"]


def augmented_name(name: str, dim: int) -> str:
    return f"{name}-d{dim}"


def base_name(name: str) -> str:
    """The original table of an augmented one (for splitting train/test *by table*)."""
    m = _AUG_SUFFIX.match(name)
    return m.group("base") if m else name


def augment_tables(
    tables: Sequence[TableSpec], dims: Sequence[int] = AUGMENT_DIMS
) -> list[TableSpec]:
    """Every table at every width of ``dims``, named ``<name>-d<dim>``.

    Rows, pooling factor, access histogram and dtype are kept: the width is the only
    thing a column-wise shard changes about a table's kernel cost.
    """
    bad = [d for d in dims if d <= 0 or d % 4]
    if bad:
        raise UserError(f"augmentation dims must be positive multiples of 4, got {bad}.")
    if len(set(dims)) != len(dims):
        raise UserError(f"augmentation dims repeat: {list(dims)}.")
    return [
        t.model_copy(update={"name": augmented_name(t.name, d), "dim": d})
        for t in tables
        for d in dims
    ]


def halvings(dim: int, low: int = 4) -> list[int]:
    """``dim`` and its halvings down to ``low``, widest first, multiples of 4 only:
    the widths a column-wise shard of the table can have (NeuroShard's augmentation
    of the tables it will shard). 96 gives 96, 48, 24, 12; 12 gives 12 (6 is no width)."""
    if dim < 4 or dim % 4:
        raise UserError(f"a table width must be a positive multiple of 4, got {dim}.")
    out = [dim]
    while out[-1] % 8 == 0 and out[-1] // 2 >= low:
        out.append(out[-1] // 2)
    return out


def augment_by_halvings(tables: Sequence[TableSpec], low: int = 4) -> list[TableSpec]:
    """Every table at its own width and at each halving down to ``low`` (:func:`halvings`),
    named ``<name>-d<dim>`` like :func:`augment_tables`, so splits by table still work."""
    return [
        t.model_copy(update={"name": augmented_name(t.name, d), "dim": d})
        for t in tables
        for d in halvings(t.dim, low)
    ]


def batches_around(global_batch: int) -> list[int]:
    """The global batches a calibration measures: the job's, half and double it (the
    neighbours the planner's predictions must hold across), ascending and distinct."""
    if global_batch < 1:
        raise UserError(f"the global batch must be >= 1, got {global_batch}.")
    return sorted({max(1, global_batch // 2), global_batch, 2 * global_batch})


def _rng(seed: int, purpose: int, index: int) -> np.random.Generator:
    if seed < 0 or index < 0:
        raise ValueError("seed and index must be >= 0")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(purpose, index)))


def _check_pool(pool: Sequence[TableSpec], max_tables: int) -> None:
    """What every kind of task needs: tables to draw from, and room for one."""
    if not pool:
        raise UserError("the table pool is empty; give at least one table to profile.")
    if max_tables < 1:
        raise UserError(f"max_tables must be >= 1, got {max_tables}.")


def compute_task(
    pool: Sequence[TableSpec],
    seed: int,
    index: int,
    max_tables: int = 15,
    memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
    fp16_share: float = 0.0,
) -> list[TableSpec]:
    """Task ``index`` of the stream ``seed``: 1..``max_tables`` tables under the cap."""
    _check_pool(pool, max_tables)
    if not 0.0 <= fp16_share <= 1.0:
        raise UserError(f"fp16_share must be in [0, 1], got {fp16_share}.")
    rng = _rng(seed, _COMPUTE_KEY, index)
    target = int(rng.integers(1, max_tables + 1))
    dtype: Literal["fp32", "fp16"] = "fp16" if rng.random() < fp16_share else "fp32"
    candidates = [t if t.dtype == dtype else t.model_copy(update={"dtype": dtype}) for t in pool]
    if min(t.size_bytes for t in candidates) > memory_cap_bytes:
        smallest = min(candidates, key=lambda t: t.size_bytes)
        raise UserError(
            f"no table fits the task memory cap of {memory_cap_bytes} bytes: the smallest, "
            f"{smallest.name} ({dtype}), holds {smallest.size_bytes} bytes. Raise the cap or "
            "profile smaller tables."
        )
    free = memory_cap_bytes
    chosen: list[TableSpec] = []
    for i in rng.permutation(len(candidates)):
        if len(chosen) == target:
            break
        t = candidates[int(i)]
        if t.size_bytes <= free:
            chosen.append(t)
            free -= t.size_bytes
    return chosen


@dataclass(frozen=True)
class KindTask:
    """One compute sample of any kind: the tables (whole specs), each one's row range
    (``None``: every row) and data-parallel flag, and the cut it came from:
    ``parts`` ranks (the row cut's, or the data-parallel job's) and ``rank`` (the
    range taken). A ``fused`` task is a :func:`compute_task` as it always was."""

    kind: TaskKind
    tables: tuple[TableSpec, ...]
    ranges: tuple[tuple[int, int] | None, ...]
    local: tuple[bool, ...]
    parts: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not len(self.tables) == len(self.ranges) == len(self.local):
            raise ValueError("tables, ranges and local need one entry per table")

    def local_batch(self, batch_size: int) -> int:
        """The batch data-parallel tables read: the global batch over ``parts`` ranks."""
        return max(1, batch_size // self.parts) if self.kind == "data_parallel" else batch_size

    def loads(self) -> list[ShardLoad]:
        """The shards to time, one per table, in order (groups as DMP runs them)."""
        from shardwise.profiler.compute import ShardLoad

        out = []
        for spec, rr, local in zip(self.tables, self.ranges, self.local, strict=True):
            if rr is not None:
                out.append(ShardLoad(spec, spec.dim, rr[0], rr[1], group="row_wise"))
            elif local:
                out.append(ShardLoad(spec, spec.dim, group="data_parallel", local_batch=True))
            else:
                out.append(ShardLoad(spec, spec.dim, group=FUSED_GROUP))
        return out


def check_shares(row_share: float, dp_share: float) -> None:
    for name, v in (("row_share", row_share), ("dp_share", dp_share)):
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise UserError(f"{name} must be in [0, 1], got {v}.")
    if row_share + dp_share > 1.0 + 1e-12:
        raise UserError(
            f"row_share {row_share} and dp_share {dp_share} add up to more than 1: they "
            "are shares of the same tasks."
        )


def _draw_under_cap(
    rng: np.random.Generator,
    candidates: Sequence[TableSpec],
    sizes: Sequence[int],
    target: int,
    cap: int,
) -> list[int]:
    """Positions of up to ``target`` candidates, uniformly without replacement, whose
    ``sizes`` fit what the cap leaves (``sizes`` 0: not drawable)."""
    free = cap
    chosen: list[int] = []
    for i in rng.permutation(len(candidates)):
        if len(chosen) == target:
            break
        size = sizes[int(i)]
        if 0 < size <= free:
            chosen.append(int(i))
            free -= size
    return chosen


def row_task(
    pool: Sequence[TableSpec],
    seed: int,
    index: int,
    max_tables: int = 15,
    memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
    fp16_share: float = 0.0,
) -> KindTask:
    """Row-wise task ``index`` of the stream ``seed`` (module docstring)."""
    _check_pool(pool, max_tables)
    rng = _rng(seed, _ROW_KEY, index)
    parts = int(ROW_PARTS[int(rng.integers(len(ROW_PARTS)))])
    rank = int(rng.integers(parts))
    target = int(rng.integers(1, max_tables + 1))
    dtype: Literal["fp32", "fp16"] = "fp16" if rng.random() < fp16_share else "fp32"
    candidates = [t if t.dtype == dtype else t.model_copy(update={"dtype": dtype}) for t in pool]
    for k in (rank, 0):
        ranges = [even_row_split(t.rows, parts)[k] for t in candidates]
        sizes = [
            n * t.dim * t.bytes_per_element for t, (_, n) in zip(candidates, ranges, strict=True)
        ]
        if any(0 < b <= memory_cap_bytes for b in sizes):
            chosen = _draw_under_cap(rng, candidates, sizes, target, memory_cap_bytes)
            return KindTask(
                kind="row_wise",
                tables=tuple(candidates[i] for i in chosen),
                ranges=tuple(ranges[i] for i in chosen),
                local=(False,) * len(chosen),
                parts=parts,
                rank=k,
            )
    raise UserError(
        f"no table's row range fits the task memory cap of {memory_cap_bytes} bytes, even "
        f"over {parts} ranks. Raise the cap or profile smaller tables."
    )


def dp_task(
    pool: Sequence[TableSpec],
    seed: int,
    index: int,
    max_tables: int = 15,
    memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
) -> KindTask:
    """Data-parallel task ``index`` of the stream ``seed`` (module docstring)."""
    _check_pool(pool, max_tables)
    rng = _rng(seed, _DP_KEY, index)
    world = int(DP_WORLDS[int(rng.integers(len(DP_WORLDS)))])
    target = int(rng.integers(1, max_tables + 1))
    candidates = [t if t.dtype == "fp32" else t.model_copy(update={"dtype": "fp32"}) for t in pool]
    sizes = [t.size_bytes for t in candidates]
    chosen = _draw_under_cap(rng, candidates, sizes, target, memory_cap_bytes)
    if not chosen:
        smallest = min(candidates, key=lambda t: t.size_bytes)
        raise UserError(
            f"no table fits the task memory cap of {memory_cap_bytes} bytes: the smallest, "
            f"{smallest.name} (fp32), holds {smallest.size_bytes} bytes. Raise the cap or "
            "profile smaller tables."
        )
    local = [bool(x) for x in rng.random(len(chosen)) < 0.5]
    if not any(local):
        local[int(rng.integers(len(chosen)))] = True
    return KindTask(
        kind="data_parallel",
        tables=tuple(candidates[i] for i in chosen),
        ranges=(None,) * len(chosen),
        local=tuple(local),
        parts=world,
    )


def kind_task(
    pool: Sequence[TableSpec],
    seed: int,
    index: int,
    max_tables: int = 15,
    memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
    fp16_share: float = 0.0,
    row_share: float = 0.0,
    dp_share: float = 0.0,
) -> KindTask:
    """Task ``index`` of the stream ``seed`` with ``row_share`` of the tasks row-wise
    and ``dp_share`` data-parallel (module docstring). With both shares 0 every task
    is the :func:`compute_task` of the same index, as before these kinds existed."""
    check_shares(row_share, dp_share)
    if row_share or dp_share:
        u = float(_rng(seed, _KIND_KEY, index).random())
        if u < row_share:
            return row_task(pool, seed, index, max_tables, memory_cap_bytes, fp16_share)
        if u < row_share + dp_share:
            return dp_task(pool, seed, index, max_tables, memory_cap_bytes)
    tables = compute_task(pool, seed, index, max_tables, memory_cap_bytes, fp16_share)
    n = len(tables)
    return KindTask("fused", tuple(tables), (None,) * n, (False,) * n)


def sample_compute_tasks(
    pool: Sequence[TableSpec],
    n: int,
    seed: int,
    max_tables: int = 15,
    memory_cap_bytes: int = DEFAULT_MEMORY_CAP_BYTES,
    fp16_share: float = 0.0,
    start: int = 0,
) -> list[list[TableSpec]]:
    """Tasks ``start .. start+n-1`` (see :func:`compute_task` and the module docstring)."""
    return [
        compute_task(pool, seed, i, max_tables, memory_cap_bytes, fp16_share)
        for i in range(start, start + n)
    ]


@dataclass(frozen=True)
class CommTask:
    """One all-to-all to measure: each rank's output dim and start delay (seconds)."""

    world_size: int
    dims: list[int]
    delays: list[float]

    def __post_init__(self) -> None:
        if len(self.dims) != self.world_size or len(self.delays) != self.world_size:
            raise ValueError("dims and delays need one entry per rank")
        if any(d < 0 or d % 4 for d in self.dims):
            raise ValueError(f"dims must be multiples of 4 and >= 0, got {self.dims}")
        if any(not math.isfinite(x) or x < 0 for x in self.delays):
            raise ValueError(f"delays must be finite and >= 0, got {self.delays}")


def comm_task(
    seed: int,
    index: int,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    max_dim: int = DEFAULT_MAX_DIM,
    max_delay_s: float = DEFAULT_MAX_DELAY_S,
    zero_share: float = 0.1,
    no_delay_share: float = 0.25,
) -> CommTask:
    """Task ``index`` of the stream ``seed`` (distributions in the module docstring)."""
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise UserError(f"an all-to-all needs world sizes >= 2, got {list(world_sizes)}.")
    if max_dim < 4 or max_dim % 4:
        raise UserError(f"max_dim must be a positive multiple of 4, got {max_dim}.")
    if max_delay_s < 0 or not math.isfinite(max_delay_s):
        raise UserError(f"max_delay_s must be a finite number >= 0, got {max_delay_s}.")
    rng = _rng(seed, _COMM_KEY, index)
    w = int(world_sizes[int(rng.integers(len(world_sizes)))])
    steps = max_dim // 4
    # Discrete log-uniform on 4..max_dim: floor((steps+1)^u) is k with P ∝ log((k+1)/k).
    width = np.clip(np.floor((steps + 1) ** rng.random(w)), 1, steps).astype(np.int64) * 4
    idle = rng.random(w) < zero_share
    if idle.all():
        idle[int(rng.integers(w))] = False
    dims = [0 if z else int(d) for z, d in zip(idle, width, strict=True)]
    if rng.random() < no_delay_share or max_delay_s == 0:
        delays = [0.0] * w
    else:
        raw = rng.uniform(0.0, max_delay_s, w)
        delays = [float(x) for x in raw - raw.min()]
    return CommTask(world_size=w, dims=dims, delays=delays)


def sample_comm_tasks(
    n: int,
    seed: int,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    max_dim: int = DEFAULT_MAX_DIM,
    max_delay_s: float = DEFAULT_MAX_DELAY_S,
    zero_share: float = 0.1,
    no_delay_share: float = 0.25,
    start: int = 0,
) -> list[CommTask]:
    """Tasks ``start .. start+n-1`` (see :func:`comm_task` and the module docstring)."""
    return [
        comm_task(seed, i, world_sizes, max_dim, max_delay_s, zero_share, no_delay_share)
        for i in range(start, start + n)
    ]

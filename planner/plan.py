"""The sharding plan (``plan.json`` version 2, docs/design.md §5), its validation and its hash.

A plan places every element of every table on exactly one rank, except that a
data-parallel table is whole on every rank. Each table names its kind
(:mod:`shardwise.planner.kinds`) and lists its shards, each a rank with a column range
and, for the row kinds, a row range:

- ``table_wise``: one shard, every row and column;
- ``column_wise``: column ranges (multiples of 4, widths may differ) that cover the
  width once, every row each;
- ``row_wise``: row ranges that cover the rows once, every column each, on different
  ranks; ``table_row_wise`` the same within one host's ranks;
- ``grid``: column ranges, each cut into row ranges on one host's ranks;
- ``data_parallel``: one whole shard on every rank.

Version 1 plans (table-wise and column-wise only, no ``kind``) still load, keep their
hash and are checked by the same rules; every plan written now is version 2. The hash
covers the placement (kinds and row ranges included) and the topology only, so two
planners that find the same placement produce the same hash (and the operator the
same ConfigMap).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from shardwise.basics import UserError, format_bytes, read_text, write_atomic
from shardwise.planner.kinds import (
    HOST_KINDS,
    ROW_KINDS,
    SHORT,
    V1_KINDS,
    KernelShard,
    Kind,
    host_of,
    kernel_group,
    local_batch,
    row_slice,
)
from shardwise.planner.memory import ShardMemory, kind_memory, what_would_fit
from shardwise.planner.tables import DTYPE_BYTES, MAX_DIM, MAX_ROWS, TableSpec
from shardwise.planner.topology import MAX_RANKS, Topology

PLAN_VERSION: Literal[2] = 2
#: What a plan without its hash is told (docs/design.md §5: the hash covers the content).
NO_HASH = (
    "the plan has no hash; write plans with `shardwise plan` (or Plan.with_hash()) so "
    "every reader can tell it holds the same, unedited plan"
)

#: A cost in seconds as plan.json holds it: finite and not negative.
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class InvalidPlanError(UserError):
    """A plan that breaks plan.json's rules (:meth:`Plan.validate_plan`)."""


class NonFiniteCostError(UserError):
    """A cost model predicted NaN or infinity: the model is broken, not the plan."""


class Shard(BaseModel):
    """A rectangle of a table on one rank: columns ``col_offset`` … ``+ cols`` and rows
    ``row_offset`` … ``+ rows`` (``rows`` unset: every row of the table). Written
    without its row range when it holds every row, as version 1 wrote it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0, le=MAX_RANKS)
    col_offset: int = Field(default=0, ge=0, le=MAX_DIM)
    cols: int = Field(gt=0, le=MAX_DIM)
    row_offset: int = Field(default=0, ge=0, le=MAX_ROWS)
    #: May be 0: TorchRec's even row split leaves the last ranks empty when a table has
    #: fewer rows than ranks times the block.
    rows: int | None = Field(default=None, ge=0, le=MAX_ROWS)

    @model_serializer(mode="wrap")
    def _compact(self, handler: Any) -> Any:
        out = handler(self)
        if isinstance(out, dict) and out.get("rows") is None:
            out.pop("rows", None)
            if out.get("row_offset") == 0:
                out.pop("row_offset", None)
        return out

    def row_count(self, table_rows: int) -> int:
        """The rows this shard holds, given its table's."""
        return table_rows if self.rows is None else self.rows

    @property
    def whole_rows(self) -> bool:
        return self.rows is None


class PlanTable(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    rows: int = Field(gt=0, le=MAX_ROWS)
    dim: int = Field(gt=0, le=MAX_DIM)
    dtype: Literal["fp32", "fp16"] = "fp32"
    #: Derived from the shards when absent (version 1 plans, and table-wise or
    #: column-wise tables built in code): one shard is table-wise, several column-wise.
    kind: Kind = "table_wise"
    shards: list[Shard] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _kind_and_whole_rows(cls, data: Any) -> Any:
        """Fill a missing kind from the shards, and write a row range that is every row
        as no range (so one placement has one form and one hash)."""
        if not isinstance(data, dict):
            return data
        shards = data.get("shards")
        rows = data.get("rows")
        if isinstance(shards, list) and isinstance(rows, int):
            fixed = []
            for s in shards:
                if isinstance(s, Shard) and s.rows == rows and s.row_offset == 0:
                    s = s.model_copy(update={"rows": None})
                elif isinstance(s, dict) and s.get("rows") == rows and not s.get("row_offset"):
                    s = {k: v for k, v in s.items() if k not in ("rows", "row_offset")}
                fixed.append(s)
            data = {**data, "shards": fixed}
            shards = fixed
        if data.get("kind") is None and isinstance(shards, list):
            ranged = any(
                (s.rows is not None)
                if isinstance(s, Shard)
                else (isinstance(s, dict) and s.get("rows") is not None)
                for s in shards
            )
            if ranged:
                raise ValueError(
                    "shards with row ranges need the table's kind: row_wise, table_row_wise or grid"
                )
            data = {**data, "kind": "table_wise" if len(shards) == 1 else "column_wise"}
        return data

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_table_wise(self) -> bool:
        return self.kind == "table_wise"

    @property
    def short_kind(self) -> str:
        return SHORT[self.kind]

    def shard_memory(
        self,
        shard: Shard,
        pooling_factor: float | None,
        batch_size_per_rank: int,
        world: int,
        local_world: int | None = None,
    ) -> ShardMemory:
        """What ``shard`` of this table holds on its rank (docs/memory.md)."""
        return kind_memory(
            self.kind,
            shard.row_count(self.rows),
            shard.cols,
            self.dtype,
            pooling_factor,
            batch_size_per_rank,
            world,
            local_world,
        )


class Predicted(BaseModel):
    """A cost model's view of the plan, in seconds per iteration."""

    model_config = ConfigDict(extra="forbid")

    per_rank_seconds: list[Seconds]
    max_seconds: Seconds
    imbalance: float = Field(
        allow_inf_nan=False, description="1 - mean/max over ranks: 0 is perfectly even"
    )

    @classmethod
    def from_costs(cls, per_rank: Sequence[float]) -> Predicted:
        """The prediction of per-rank costs; a NaN or infinite cost is a
        :class:`NonFiniteCostError` (a broken model must not yield a plan)."""
        if not all(math.isfinite(x) for x in per_rank):
            raise NonFiniteCostError(
                f"the cost model predicted {list(per_rank)[:8]} seconds per rank, not finite "
                "costs: its weights are broken. Re-train it with `shardwise pretrain`."
            )
        return cls(
            per_rank_seconds=list(per_rank),
            max_seconds=max(per_rank),
            imbalance=imbalance(per_rank),
        )


@dataclass(frozen=True)
class RankCost:
    """One rank's embedding cost per iteration, in seconds: what the evaluator measures
    and the cost model predicts, in the same shape."""

    rank: int
    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float
    bwd_comm_s: float

    @property
    def total_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s + self.fwd_comm_s + self.bwd_comm_s


@dataclass(frozen=True)
class PlanCost:
    """A plan's per-rank cost: the base of the measured evaluation and the prediction."""

    plan_hash: str
    planner: str
    world_size: int
    batch_size_per_rank: int
    device: str
    ranks: list[RankCost]

    @property
    def max_s(self) -> float:
        return max(r.total_s for r in self.ranks)

    @property
    def max_over_mean(self) -> float:
        """Imbalance as the evaluator prints it: max/mean (1 is perfectly even)."""
        mean = sum(r.total_s for r in self.ranks) / len(self.ranks)
        return self.max_s / mean if mean > 0 else 1.0

    def cost_json(self) -> dict[str, object]:
        """The keys both shapes share (``shardwise evaluate --json``)."""
        return {
            "plan_hash": self.plan_hash,
            "planner": self.planner,
            "world_size": self.world_size,
            "batch_size_per_rank": self.batch_size_per_rank,
            "device": self.device,
            "ranks": [
                {
                    "rank": r.rank,
                    "fwd_compute_s": r.fwd_compute_s,
                    "bwd_compute_s": r.bwd_compute_s,
                    "fwd_comm_s": r.fwd_comm_s,
                    "bwd_comm_s": r.bwd_comm_s,
                    "total_s": r.total_s,
                }
                for r in self.ranks
            ],
            "max_s": self.max_s,
            "imbalance_max_over_mean": self.max_over_mean,
        }


def imbalance(per_rank: Sequence[float]) -> float:
    """``1 - mean/max``: the share of the slowest rank's time the others spend waiting."""
    top = max(per_rank)
    return 0.0 if top <= 0 else 1.0 - (sum(per_rank) / len(per_rank)) / top


class Refinement(BaseModel):
    """What measured refinement (docs/design.md §8) measured to choose this plan: the
    plan says how it was chosen, and its final figures come from a fresh re-measurement
    (a winner picked on noisy timings looks better than it is)."""

    model_config = ConfigDict(extra="forbid")

    device: str
    batch_size_per_rank: int = Field(gt=0)
    #: The plan the refinement started from (the cost model's choice).
    start_hash: str
    moves: int = Field(ge=0)
    kernels_measured: int = Field(ge=0)
    seconds: Seconds
    #: The declared comm added to the measured compute, as ``CommModel.describe()``.
    comm: str
    #: Max-rank fwd+bwd compute of the start plan and of the final plan, both from the
    #: fresh re-measurement that closes the refinement, and what the loop believed.
    start_max_compute_seconds: Seconds
    final_max_compute_seconds: Seconds
    believed_max_compute_seconds: Seconds
    final_per_rank_compute_seconds: list[Seconds]
    #: Where the search started when not from the given plan: the alternative (e.g.
    #: ``torchrec``) one measured round found fastest.
    started_from: str | None = None
    #: The objective (max over ranks of measured compute + the declared comm) of the
    #: given plan and of the final one, from the fresh re-measurement.
    start_objective_seconds: Seconds | None = None
    final_objective_seconds: Seconds | None = None
    #: Tables whose kind a measured kind move changed, as the refinement said each
    #: (``"t3: table-wise -> row-wise over 4 ranks"``); empty when none did.
    kind_changes: list[str] = []


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1, 2] = PLAN_VERSION
    world_size: int = Field(ge=1, le=MAX_RANKS)
    planner: str
    hash: str = ""
    topology: Topology
    tables: list[PlanTable]
    predicted: Predicted | None = None
    #: Set when measured refinement chose the plan (not part of the hash).
    refinement: Refinement | None = None

    @classmethod
    def from_shards(
        cls,
        tables: Sequence[TableSpec],
        shards: Sequence[Sequence[Shard]],
        topology: Topology,
        planner: str,
        predicted: Sequence[float] | None = None,
        kinds: Sequence[Kind | None] | None = None,
    ) -> Plan:
        """The hashed plan that places table ``tables[i]`` as ``shards[i]`` on
        ``topology``'s ranks, with ``predicted`` per-rank seconds if a planner priced it.
        ``kinds[i]`` names table ``i``'s kind (``None``: table-wise for one shard, else
        column-wise). Every planner and converter builds its plan here."""
        plan = cls(
            world_size=topology.gpus,
            planner=planner,
            topology=topology,
            tables=[
                PlanTable(
                    name=t.name,
                    rows=t.rows,
                    dim=t.dim,
                    dtype=t.dtype,
                    kind=kind,
                    shards=list(s),
                )
                for t, s, kind in zip(tables, shards, kinds or [None] * len(tables), strict=True)
            ],
            predicted=Predicted.from_costs(predicted) if predicted is not None else None,
        )
        return plan.with_hash()

    # ------------------------------------------------------------------ derived views
    def content_hash(self) -> str:
        """sha256 over the canonical JSON of world size, topology and placement. A
        version 1 plan hashes as version 1 did (no kinds, no row ranges)."""
        v1 = self.version == 1
        body = {
            "version": self.version,
            "world_size": self.world_size,
            "topology": self.topology.model_dump(mode="json"),
            "tables": [
                {
                    **t.model_dump(mode="json", exclude={"shards", "kind"} if v1 else {"shards"}),
                    "shards": [
                        s.model_dump(mode="json")
                        for s in sorted(
                            t.shards, key=lambda s: (s.col_offset, s.row_offset, s.rank)
                        )
                    ],
                }
                for t in sorted(self.tables, key=lambda t: t.name)
            ],
        }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def with_hash(self) -> Plan:
        return self.model_copy(update={"hash": self.content_hash()})

    def memory_per_rank(
        self,
        tables: Sequence[TableSpec] | None = None,
        *,
        batch_size_per_rank: int | None = None,
    ) -> list[int]:
        """Bytes each rank holds under the memory rule (docs/memory.md) at the plan's
        batch (or ``batch_size_per_rank``); without ``tables`` the pooling is unknown and
        only weights and optimizer state count (a lower bound)."""
        return [m.total for m in self.rank_memory(tables, batch_size_per_rank=batch_size_per_rank)]

    def rank_memory(
        self,
        tables: Sequence[TableSpec] | Mapping[str, TableSpec] | None = None,
        *,
        batch_size_per_rank: int | None = None,
    ) -> list[ShardMemory]:
        """Each rank's memory under the rule (:mod:`shardwise.planner.memory`) by part:
        weights, optimizer state, I/O buffers, at ``batch_size_per_rank`` (default: the
        plan's). A table missing from ``tables`` (or all, when ``None``) has an unknown
        pooling factor: its I/O buffers are not counted."""
        specs = tables if isinstance(tables, Mapping) else {t.name: t for t in tables or ()}
        batch = batch_size_per_rank
        if batch is None:
            batch = self.topology.batch_size_per_rank
        out = [ShardMemory()] * self.world_size
        local = self.topology.local_world
        for t in self.tables:
            spec = specs.get(t.name)
            pooling = spec.pooling_factor if spec is not None else None
            for s in t.shards:
                if s.rank < self.world_size:
                    out[s.rank] = out[s.rank] + t.shard_memory(
                        s, pooling, batch, self.world_size, local
                    )
        return out

    def shards_per_rank(self) -> list[list[tuple[PlanTable, Shard]]]:
        out: list[list[tuple[PlanTable, Shard]]] = [[] for _ in range(self.world_size)]
        for t in self.tables:
            for s in t.shards:
                if s.rank < self.world_size:
                    out[s.rank].append((t, s))
        return out

    def kernel_shards(
        self, tables: Sequence[TableSpec] | Mapping[str, TableSpec]
    ) -> list[list[KernelShard]]:
        """Each rank's shards as its kernels run them (:class:`KernelShard`): a row range
        with the lookups it receives, a data-parallel table at the rank's own batch.
        Empty row ranges hold nothing and are left out. What the cost model prices and
        the evaluator times, so both see the same kernels."""
        specs = tables if isinstance(tables, Mapping) else {t.name: t for t in tables}
        out: list[list[KernelShard]] = [[] for _ in range(self.world_size)]
        for t in self.tables:
            spec = specs[t.name]
            for s in t.shards:
                rows = s.row_count(t.rows)
                if rows == 0 or s.rank >= self.world_size:
                    continue
                out[s.rank].append(
                    KernelShard(
                        spec=row_slice(spec, s.row_offset, rows),
                        cols=s.cols,
                        group=kernel_group(t.kind),
                        local_batch=local_batch(t.kind),
                        table=t.name,
                        row_offset=s.row_offset,
                    )
                )
        return out

    def kinds(self) -> dict[str, int]:
        """How many tables of each kind, in plan order of first appearance."""
        return dict(Counter(t.kind for t in self.tables))

    # ------------------------------------------------------------------ validation
    def problems(
        self,
        tables: Sequence[TableSpec] | None = None,
        *,
        require_hash: bool = False,
        batch_size_per_rank: int | None = None,
    ) -> list[str]:
        """Every rule of docs/design.md §5 the plan breaks, as sentences (empty: valid).

        ``require_hash`` is for plans read from a file (``shardwise evaluate``, the
        workers): there the hash is what shows the file is the plan that was written.
        A plan being built in memory may still lack it. Memory is checked at the plan's
        batch, or at ``batch_size_per_rank`` (a worker that trains at another batch).
        """
        out: list[str] = []
        if self.world_size != self.topology.gpus:
            out.append(f"world_size is {self.world_size} but topology.gpus is {self.topology.gpus}")
        names = [t.name for t in self.tables]
        for dup in sorted(n for n, k in Counter(names).items() if k > 1):
            out.append(f"table {dup!r} appears more than once")
        for t in self.tables:
            out.extend(_table_problems(t, self.world_size, self.topology.local_world))
            if self.version == 1 and t.kind not in V1_KINDS:
                out.append(
                    f"table {t.name!r} is {t.kind} but plan.json version 1 holds only "
                    "table-wise and column-wise tables; write version 2"
                )
        if self.predicted is not None and len(self.predicted.per_rank_seconds) != self.world_size:
            out.append(
                f"predicted.per_rank_seconds has {len(self.predicted.per_rank_seconds)} "
                f"entries for {self.world_size} ranks"
            )
        out.extend(self.memory_problems(tables, batch_size_per_rank=batch_size_per_rank))
        if not self.hash:
            if require_hash:
                out.append(NO_HASH)
        elif self.hash != self.content_hash():
            out.append("hash does not match the plan's content (was the file edited?)")
        if tables is not None:
            out.extend(shape_mismatches(plan_shapes(self), spec_shapes(tables), "plan", "tables"))
        return out

    def memory_problems(
        self,
        tables: Sequence[TableSpec] | None = None,
        *,
        batch_size_per_rank: int | None = None,
    ) -> list[str]:
        """Each rank over ``topology.usable_bytes`` under the memory rule, with its parts
        and what would fit (docs/memory.md)."""
        topo = self.topology
        batch = topo.batch_size_per_rank if batch_size_per_rank is None else batch_size_per_rank
        if batch != topo.batch_size_per_rank:
            topo = topo.model_copy(update={"batch_size_per_rank": batch})
        parts = self.rank_memory(tables, batch_size_per_rank=batch)
        over = {rank for rank, used in enumerate(parts) if used.total > topo.usable_bytes}
        if not over:
            return []
        pooling = {t.name: t.pooling_factor for t in tables or ()}
        held: dict[int, list[tuple[PlanTable, Shard]]] = {r: [] for r in over}
        for t in self.tables:
            for s in t.shards:
                if s.rank in held:
                    held[s.rank].append((t, s))
        out: list[str] = []
        local = self.topology.local_world
        for rank in sorted(over):
            used = parts[rank]

            def at(b: int, shards: list[tuple[PlanTable, Shard]] = held[rank]) -> int:
                return sum(
                    t.shard_memory(s, pooling.get(t.name), b, self.world_size, local).total
                    for t, s in shards
                )

            if tables is not None:
                need = f"{used.describe()} at batch {batch} per rank x {self.world_size} ranks"
            else:
                need = (
                    f"at least {format_bytes(used.total)} (weights {format_bytes(used.weights)}"
                    f" + optimizer {format_bytes(used.optimizer)}; I/O buffers not counted: "
                    "the tables' pooling factors were not given)"
                )
            out.append(
                f"rank {rank} needs {need}; {topo.describe_capacity()}; {what_would_fit(at, topo)}"
            )
        return out

    def validate_plan(
        self,
        tables: Sequence[TableSpec] | None = None,
        source: str = "plan",
        *,
        require_hash: bool = False,
    ) -> Plan:
        """Raise an :class:`InvalidPlanError` listing every problem; return self when valid."""
        problems = self.problems(tables, require_hash=require_hash)
        if problems:
            raise InvalidPlanError(f"{source} is not a valid plan:\n- " + "\n- ".join(problems))
        return self


def _table_problems(t: PlanTable, world_size: int, local_world: int | None = None) -> list[str]:
    """Every rule of the table's kind it breaks (module docstring), as sentences that
    name the table, the ranks, the columns and the rows."""
    out: list[str] = []
    local = local_world or world_size
    for s in t.shards:
        if s.rank >= world_size:
            out.append(f"table {t.name!r}: shard on rank {s.rank}, but world_size is {world_size}")
        if s.cols % 4:
            out.append(
                f"table {t.name!r}: shard at column {s.col_offset} is {s.cols} wide, "
                "not a multiple of 4"
            )
        if s.rows is not None and s.row_offset + s.rows > t.rows:
            out.append(
                f"table {t.name!r}: shard on rank {s.rank} holds rows {s.row_offset}.."
                f"{s.row_offset + s.rows - 1}, past the table's {t.rows} rows"
            )
    kind = t.kind
    if kind == "data_parallel":
        return out + _data_parallel_problems(t, world_size)
    if kind not in ROW_KINDS:
        ranged = [s.rank for s in t.shards if s.rows is not None]
        if ranged:
            out.append(
                f"table {t.name!r} is {kind} but its shards on ranks {ranged} hold row ranges; "
                "name a row kind (row_wise, table_row_wise, grid) or give every row"
            )
        if kind == "table_wise" and len(t.shards) != 1:
            out.append(f"table {t.name!r} is table_wise but has {len(t.shards)} shards")
        out.extend(_column_cover(t.name, t.shards, t.dim))
        return out
    # Row kinds: each column range is cut into row ranges that cover the rows once.
    blocks: dict[tuple[int, int], list[Shard]] = {}
    for s in t.shards:
        blocks.setdefault((s.col_offset, s.cols), []).append(s)
    columns = [Shard(rank=0, col_offset=c, cols=w) for c, w in blocks]
    out.extend(_column_cover(t.name, columns, t.dim))
    if kind != "grid" and len(blocks) > 1:
        out.append(
            f"table {t.name!r} is {kind} but its shards cut the columns into {len(blocks)} "
            "ranges; only grid cuts both"
        )
    for (c, w), shards in sorted(blocks.items()):
        where = f"table {t.name!r}" + (f" columns {c}..{c + w - 1}" if kind == "grid" else "")
        out.extend(_row_cover(where, shards, t.rows))
        ranks = [s.rank for s in shards]
        for dup in sorted(r for r, n in Counter(ranks).items() if n > 1):
            out.append(f"{where}: rank {dup} holds two of its row ranges")
        if kind in HOST_KINDS:
            hosts = sorted({host_of(r, local) for r in ranks})
            if len(hosts) > 1:
                out.append(
                    f"{where} is {kind}, so its row ranges must stay on one host, but ranks "
                    f"{sorted(ranks)} are on hosts {hosts} ({local} GPUs per host)"
                )
    return out


def _column_cover(name: str, shards: Sequence[Shard], dim: int) -> list[str]:
    out: list[str] = []
    covered = 0
    for s in sorted(shards, key=lambda s: s.col_offset):
        if s.col_offset > covered:
            out.append(f"table {name!r}: columns {covered}..{s.col_offset - 1} are not placed")
        elif s.col_offset < covered:
            out.append(f"table {name!r}: columns {s.col_offset}..{covered - 1} are placed twice")
        covered = max(covered, s.col_offset + s.cols)
    if covered != dim:
        out.append(f"table {name!r}: shards cover {covered} columns of dim {dim}")
    return out


def _row_cover(where: str, shards: Sequence[Shard], rows: int) -> list[str]:
    out: list[str] = []
    covered = 0
    for s in sorted(shards, key=lambda s: (s.row_offset, s.row_count(rows))):
        n = s.row_count(rows)
        if n == 0:
            continue
        if s.row_offset > covered:
            out.append(f"{where}: rows {covered}..{s.row_offset - 1} are not placed")
        elif s.row_offset < covered:
            top = min(covered, s.row_offset + n) - 1
            out.append(f"{where}: rows {s.row_offset}..{top} are placed twice (rank {s.rank})")
        covered = max(covered, s.row_offset + n)
    if covered < rows:
        out.append(f"{where}: rows {covered}..{rows - 1} are not placed")
    return out


def _data_parallel_problems(t: PlanTable, world_size: int) -> list[str]:
    out: list[str] = []
    partial = [s.rank for s in t.shards if s.rows is not None or s.col_offset or s.cols != t.dim]
    if partial:
        out.append(
            f"table {t.name!r} is data_parallel, so every shard is the whole table, but "
            f"the shards on ranks {partial} are not"
        )
    have = Counter(s.rank for s in t.shards)
    missing = [r for r in range(world_size) if r not in have]
    twice = sorted(r for r, n in have.items() if n > 1)
    if missing:
        out.append(f"table {t.name!r} is data_parallel but has no copy on ranks {missing}")
    if twice:
        out.append(f"table {t.name!r} is data_parallel but has two copies on ranks {twice}")
    return out


#: A table as two views of one model must agree on it: (rows, dim, dtype).
TableShape = tuple[int, int, str]


def shape_mismatches(
    have: Mapping[str, TableShape],
    want: Mapping[str, TableShape],
    have_label: str,
    want_label: str,
) -> list[str]:
    """Every table missing from, extra in, or shaped differently in ``have`` than in
    ``want``, as sentences (a plan against its tables, a model, a checkpoint)."""
    out: list[str] = []
    for name, shape in want.items():
        got = have.get(name)
        if got is None:
            out.append(f"table {name!r} is not in the {have_label}")
        elif got != shape:
            out.append(
                f"table {name!r} is {got[0]}x{got[1]} {got[2]} in the {have_label} "
                f"but {shape[0]}x{shape[1]} {shape[2]} in the {want_label}"
            )
    out.extend(
        f"table {name!r} is in the {have_label} but not in the {want_label}"
        for name in sorted(set(have) - set(want))
    )
    return out


def plan_shapes(plan: Plan) -> dict[str, TableShape]:
    return {t.name: (t.rows, t.dim, t.dtype) for t in plan.tables}


def spec_shapes(tables: Sequence[TableSpec]) -> dict[str, TableShape]:
    return {t.name: (t.rows, t.dim, t.dtype) for t in tables}


def table_wise_plan(
    tables: Sequence[TableSpec],
    ranks: Sequence[int],
    topology: Topology,
    planner: str,
    predicted: Sequence[float] | None = None,
) -> Plan:
    """A plan that puts table ``i`` whole on ``ranks[i]``, hashed."""
    shards = [[Shard(rank=r, col_offset=0, cols=t.dim)] for t, r in zip(tables, ranks, strict=True)]
    return Plan.from_shards(tables, shards, topology, planner, predicted)


# --------------------------------------------------------------------------- files


def load_plan(path: str | Path) -> Plan:
    """Parse plan.json; a file that is not one is a :class:`UserError` naming the file
    and each field. Parsing checks types and bounds only: :meth:`Plan.validate_plan`
    checks the rules."""
    p = Path(path)
    text = read_text(p, "plan")
    try:
        return Plan.model_validate_json(text)
    except ValidationError as err:
        lines = [
            f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']}"
            for e in err.errors()[:20]
        ]
        raise UserError(
            f"{p} is not a plan.json (version {PLAN_VERSION}):\n- "
            + "\n- ".join(lines)
            + "\nWrite plans with `shardwise plan` rather than by hand."
        ) from None


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` atomically: a reader (a worker, the operator) sees the old file
    or the whole new one, never a half. Failing is a :class:`UserError` naming it."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, plan.model_dump_json(indent=1) + "\n")
    except OSError as err:
        raise UserError(f"{p}: cannot write the plan there ({err.strerror or err}).") from None

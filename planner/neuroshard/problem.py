"""What every candidate of NeuroShard's search shares: the tables, the topology, the
cost model's encodings and head, and the full predicted cost of a placement.

A *state* says how each table is cut: a tuple of column widths per table (one width:
whole; several: column-wise shards, widths multiples of 4, possibly uneven, never
more shards than ranks). A *placement* gives each of the state's shards a rank. Shards
of one table always sit on different ranks: two on one rank would be one wider shard
paying two kernels' lookups, and TorchRec requires equal widths there anyway.

Tables no GPU holds whole are not part of the search: they are placed row-wise first
(:mod:`shardwise.planner.oversized`), and what they hold on each rank is a fixed
*base*: memory, the compute of their own kernels (a row-wise kernel per rank, apart
from the fused one), and their collectives. Every candidate's cost includes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shardwise.planner.comm.collectives import plan_kind_parts
from shardwise.planner.comm.hosts import comm_local_world
from shardwise.planner.costmodel import CostPredictor
from shardwise.planner.incremental import ComputeHead, KernelHead
from shardwise.planner.kinds import Kind
from shardwise.planner.memory import shard_bytes
from shardwise.planner.oversized import Oversized
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: How each table is cut: column widths per table, widest first.
State = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Placement:
    """One placement of a state's shards, with its predicted cost per rank."""

    ranks: I64  # per shard
    per_rank: F64  # [W] predicted total (compute + comm)
    compute: F64  # [W, 2] fwd, bwd compute
    comm: F64  # [W, 2] fwd (with wait), bwd all-to-all
    scale: float = 0.0
    #: The grid's feasible scales, best first: a child state searches only the first few.
    scales: tuple[float, ...] = ()

    @property
    def score(self) -> float:
        return float(self.per_rank.max())


@dataclass(frozen=True)
class Shards:
    """A state's shards as arrays: what the greedy and the local search index."""

    table: I64
    cols: I64
    nbytes: I64
    fp16: I64
    enc: F32
    #: Per shard: its table's index among the state's split tables, -1 if whole.
    split: I64
    n_split: int


class Problem:
    """Everything about the tables and topology that every candidate state shares."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        topology: Topology,
        predictor: CostPredictor,
        fixed: Oversized | None = None,
    ) -> None:
        """``tables``: every table of the job; those ``fixed`` places (by index) are the
        base, the others (:attr:`tables`) are searched."""
        self.all_tables = list(tables)
        self.fixed = fixed or Oversized([], [0] * topology.gpus)
        skip = self.fixed.indices
        self.tables = [t for i, t in enumerate(tables) if i not in skip]
        self.topology = topology
        self.world = topology.gpus
        self.cap = topology.usable_bytes
        self.predictor = predictor
        self.batch_per_rank = topology.batch_size_per_rank
        self.global_batch = self.batch_per_rank * self.world
        # A calibrated model's rank head prices the summed channels its encodings are;
        # otherwise the network's head prices summed network encodings.
        self.head: KernelHead = predictor.anchored_head or ComputeHead(
            predictor.model.compute, self.global_batch, (predictor.speed.fwd, predictor.speed.bwd)
        )
        self._enc: dict[tuple[int, int], F32] = {}
        self._bytes: dict[tuple[int, int], int] = {}
        #: Ranks per host as the declared comm prices the all-to-all (the plan's hosts).
        self.comm_local_world = comm_local_world(predictor.comm_model, topology)
        self.base_mem: I64 = np.asarray(self.fixed.memory, dtype=np.int64)
        self.base_compute, self.base_comm = self._base_costs()
        #: What a rank's fused kernel must share its memory with: the emptiest rank's room.
        self.max_free = int(self.cap - self.base_mem.min())

    def _base_costs(self) -> tuple[F64, F64]:
        """Per-rank predicted compute ``[W, 2]`` and collectives ``[W, 2]`` of the fixed
        row-wise tables (zeros when there are none)."""
        w = self.world
        if not self.fixed.placed:
            return np.zeros((w, 2)), np.zeros((w, 2))
        part = self.fixed_plan()
        specs = [self.all_tables[p.index] for p in self.fixed.placed]
        compute = self.predictor.plan_compute(part, specs, self.batch_per_rank)
        parts = plan_kind_parts(part, self.predictor.comm_model, self.batch_per_rank)
        fwd = np.sum([c.fwd for c in parts], axis=0) if parts else np.zeros(w)
        bwd = np.sum([c.bwd for c in parts], axis=0) if parts else np.zeros(w)
        return compute, np.stack([fwd, bwd], axis=1)

    def fixed_plan(self) -> Plan:
        """The fixed tables alone as a plan (what prices them)."""
        specs = [self.all_tables[p.index] for p in self.fixed.placed]
        kinds: list[Kind | None] = [p.kind for p in self.fixed.placed]
        return Plan.from_shards(
            specs, [p.shards for p in self.fixed.placed], self.topology, "fixed", kinds=kinds
        )

    # ------------------------------------------------------------------ states
    def whole(self) -> State:
        return tuple((t.dim,) for t in self.tables)

    def can_halve(self, state: State, t: int, width: int) -> bool:
        """A shard of ``width`` columns of table ``t`` may be cut in two equal halves."""
        return width % 8 == 0 and len(state[t]) < self.world

    def halve(self, state: State, t: int, width: int) -> State:
        widths = list(state[t])
        widths.remove(width)
        widths += [width // 2, width // 2]
        return (*state[:t], tuple(sorted(widths, reverse=True)), *state[t + 1 :])

    def shard_bytes(self, t: int, cols: int) -> int:
        """GPU memory of a shard as TorchRec counts it (docs/memory.md), memoized."""
        key = (t, cols)
        got = self._bytes.get(key)
        if got is None:
            got = self._bytes[key] = shard_bytes(
                self.tables[t], cols, self.batch_per_rank, self.world
            )
        return got

    def shard_list(self, state: State) -> list[tuple[int, int]]:
        """``(table index, cols)`` of every shard of a state, table by table."""
        return [(t, c) for t, widths in enumerate(state) for c in widths]

    def shards(self, state: State) -> Shards:
        pairs = self.shard_list(state)
        split_of = {t: k for k, t in enumerate(t for t, w in enumerate(state) if len(w) > 1)}
        return Shards(
            table=np.array([t for t, _ in pairs], dtype=np.int64),
            cols=np.array([c for _, c in pairs], dtype=np.int64),
            nbytes=np.array([self.shard_bytes(t, c) for t, c in pairs], dtype=np.int64),
            fp16=np.array([self.tables[t].dtype == "fp16" for t, _ in pairs], dtype=np.int64),
            enc=self.encodings(pairs),
            split=np.array([split_of.get(t, -1) for t, _ in pairs], dtype=np.int64),
            n_split=len(split_of),
        )

    def encodings(self, shards: Sequence[tuple[int, int]]) -> F32:
        missing = sorted({s for s in shards if s not in self._enc})
        if missing:
            got = self.predictor.encodings(
                [(self.tables[t], c) for t, c in missing], self.global_batch
            )
            for key, row in zip(missing, got, strict=True):
                self._enc[key] = row
        return np.stack([self._enc[s] for s in shards])

    def solo(self, sh: Shards) -> F64:
        """Each shard's predicted fwd + bwd cost alone."""
        got: F64 = (
            self.head.seconds(sh.enc, np.ones(len(sh.cols), dtype=np.int64))
            .sum(axis=1)
            .astype(np.float64)
        )
        return got

    # ------------------------------------------------------------------ costs
    def comm(self, dims: F64, fwd: F64) -> tuple[F64, F64]:
        """``[M, W]`` per-rank widths and forward compute → (fwd incl. wait, bwd)
        all-to-all seconds, by the predictor's declared comm model (W = 1 costs nothing),
        plus the fixed tables' collectives."""
        fwd_c, bwd_c = self.predictor.comm_model.all_to_all(
            dims, fwd, self.batch_per_rank, self.comm_local_world
        )
        return fwd_c + self.base_comm[:, 0], bwd_c + self.base_comm[:, 1]

    def costs(self, sh: Shards, r: I64) -> tuple[F64, F64]:
        """Predicted compute ``[W, 2]`` and all-to-all ``[W, 2]`` of one placement."""
        w = self.world
        compute = np.zeros((w, 2), dtype=np.float64)
        for d in (0, 1):
            on = sh.fp16 == d
            if not on.any():
                continue
            sums = np.zeros((w, sh.enc.shape[1]), dtype=np.float32)
            np.add.at(sums, r[on], sh.enc[on])
            compute += self.head.seconds(sums, np.bincount(r[on], minlength=w).astype(np.int64))
        compute += self.base_compute
        dims = np.bincount(r, weights=sh.cols, minlength=w)
        fwd_c, bwd_c = self.predictor.comm_model.one(
            dims.tolist(), compute[:, 0].tolist(), self.batch_per_rank, self.comm_local_world
        )
        return compute, np.stack([fwd_c, bwd_c], axis=1) + self.base_comm

    def sigma(self, sh: Shards, r: I64) -> F64:
        """Each rank's log error spread ``[W]`` under this model: the rank head's from
        the summed channels (more for shards priced without an anchor), else the
        predictor's one figure (:mod:`shardwise.planner.neuroshard.risk` weighs them)."""
        head = self.predictor.anchored_head
        if head is None:
            return np.full(self.world, self.predictor.rank_sigma)
        sums = np.zeros((self.world, sh.enc.shape[1]), dtype=np.float64)
        np.add.at(sums, r, sh.enc)
        return head.sigma(sums)

    def place(
        self, sh: Shards, r: I64, scale: float = 0.0, scales: tuple[float, ...] = ()
    ) -> Placement:
        compute, comm = self.costs(sh, r)
        return Placement(r, compute.sum(axis=1) + comm.sum(axis=1), compute, comm, scale, scales)

    # ------------------------------------------------------------------ plans
    def to_plan(self, state: State, best: Placement, name: str) -> Plan:
        by_table: dict[int, list[Shard]] = {}
        offset: dict[int, int] = {}
        for (t, c), r in zip(self.shard_list(state), best.ranks, strict=True):
            o = offset.get(t, 0)
            by_table.setdefault(t, []).append(Shard(rank=int(r), col_offset=o, cols=c))
            offset[t] = o + c
        searched = iter(by_table[t] for t in range(len(self.tables)))
        fixed = {p.index: p for p in self.fixed.placed}
        shards: list[list[Shard]] = []
        kinds: list[Kind | None] = []
        for i in range(len(self.all_tables)):
            if i in fixed:
                shards.append(fixed[i].shards)
                kinds.append(fixed[i].kind)
            else:
                shards.append(next(searched))
                kinds.append(None)
        return Plan.from_shards(
            self.all_tables,
            shards,
            self.topology,
            name,
            [float(x) for x in best.per_rank],
            kinds=kinds,
        )

    def from_plan(self, plan: Plan) -> tuple[State, I64] | None:
        """A plan of another planner as a state and its ranks (None when it puts two
        shards of one table on one rank, or a searched table in another kind than
        table-wise or column-wise, which states do not hold). Its fixed tables must be
        placed as ours are (every planner here shares that rule)."""
        placed = {t.name: t for t in plan.tables}
        widths: list[tuple[int, ...]] = []
        ranks: list[int] = []
        for spec in self.tables:
            if placed[spec.name].kind not in ("table_wise", "column_wise"):
                return None
            shards = sorted(placed[spec.name].shards, key=lambda s: (-s.cols, s.col_offset))
            if len({s.rank for s in shards}) != len(shards):
                return None
            widths.append(tuple(s.cols for s in shards))
            ranks.extend(s.rank for s in shards)
        return tuple(widths), np.array(ranks, dtype=np.int64)

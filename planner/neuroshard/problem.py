"""What every candidate of NeuroShard's search shares: the tables, the topology, the
cost model's encodings and head, and the full predicted cost of a placement.

A *state* says how each table is cut: a tuple of column widths per table (one width:
whole; several: column-wise shards, widths multiples of 4, possibly uneven, never
more shards than ranks), or one negative code for a table of a splitting kind
(row-wise, table-row-wise on a host, data-parallel: :mod:`.base`). A *placement*
gives each of the state's column shards a rank. Shards of one table always sit on
different ranks: two on one rank would be one wider shard paying two kernels'
lookups, and TorchRec requires equal widths there anyway.

The coded tables hold a fixed *base* on every rank (memory, their own kernels, their
collectives, :class:`~.base.Base`), memoized by the state's kind choices; every
placement's cost includes it. Tables no GPU holds whole start coded as the row-wise
rule places them (:mod:`shardwise.planner.oversized`) and never become fused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shardwise.planner.comm.hosts import comm_local_world
from shardwise.planner.costmodel import CostPredictor
from shardwise.planner.incremental import ComputeHead, KernelHead
from shardwise.planner.kinds import (
    KINDS,
    ROW_KINDS,
    V1_KINDS,
    Kind,
    KindOption,
    kind_options,
)
from shardwise.planner.memory import shard_bytes
from shardwise.planner.neuroshard.base import (
    Base,
    Kinds,
    kind_code,
    kinds_of,
    option_of,
    price_base,
)
from shardwise.planner.oversized import Oversized, kind_shards, place_oversized
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: How each table is cut: column widths per table, widest first, or a kind's code.
State = tuple[tuple[int, ...], ...]
#: The kinds a search may choose (grid stays out: no planner here chooses it).
SEARCH_KINDS: frozenset[str] = frozenset(KINDS) - {"grid"}


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
    #: What the state's coded tables hold on each rank.
    base: Base


class Problem:
    """Everything about the tables and topology that every candidate state shares."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        topology: Topology,
        predictor: CostPredictor,
        fixed: Oversized | None = None,
        kinds: frozenset[str] = SEARCH_KINDS,
    ) -> None:
        """``tables``: every table of the job; those ``fixed`` places (by index; default
        :func:`place_oversized`) start coded as it places them. ``kinds``: what the
        search may choose (:data:`~shardwise.planner.kinds.V1_KINDS`: table-wise and
        column-wise only, the oversized tables kept as the rule placed them)."""
        self.all_tables = self.tables = list(tables)
        self.fixed = fixed if fixed is not None else place_oversized(tables, topology)
        #: The oversized tables' starting kinds (never fused).
        self.rule: dict[int, KindOption] = {}
        for p in self.fixed.placed:
            host = p.shards[0].rank // topology.local_world if p.kind == "table_row_wise" else -1
            self.rule[p.index] = KindOption(p.kind, host)
        self.kinds = frozenset(kinds) | V1_KINDS
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
        self._bases: dict[Kinds, Base] = {}
        self._options: dict[int, list[KindOption]] = {}
        self._table_solo: F64 | None = None
        #: Per table: data-parallel's bytes gain and copy size (``kindmoves.dp_gain``).
        self.dp_arrays: tuple[F64, F64] | None = None
        #: Ranks per host as the declared comm prices the all-to-all (the plan's hosts).
        self.comm_local_world = comm_local_world(predictor.comm_model, topology)
        start = self.base(kinds_of(self.whole()))
        #: What a rank's fused kernel must share its memory with: the emptiest rank's room.
        self.max_free = int(self.cap - start.mem.min())

    @property
    def searches_kinds(self) -> bool:
        """Whether the search may choose kinds beyond table-wise and column-wise."""
        return bool(self.kinds - V1_KINDS)

    def base(self, kinds: Kinds) -> Base:
        """What the coded tables hold on each rank (:mod:`.base`), memoized."""
        got = self._bases.get(kinds)
        if got is None:
            got = price_base(self.tables, kinds, self.topology, self.predictor)
            if len(self._bases) > 4096:
                self._bases.clear()
            self._bases[kinds] = got
        return got

    def base_of(self, state: State) -> Base:
        return self.base(kinds_of(state))

    def options(self, t: int) -> list[KindOption]:
        """Table ``t``'s splitting choices this search allows (memoized)."""
        got = self._options.get(t)
        if got is None:
            got = self._options[t] = [
                o
                for o in kind_options(self.tables[t], self.topology)
                if o.kind not in V1_KINDS and o.kind in self.kinds
            ]
        return got

    def fixed_plan(self) -> Plan:
        """The oversized tables alone, as the rule placed them."""
        specs = [self.all_tables[p.index] for p in self.fixed.placed]
        kinds: list[Kind | None] = [p.kind for p in self.fixed.placed]
        return Plan.from_shards(
            specs, [p.shards for p in self.fixed.placed], self.topology, "fixed", kinds=kinds
        )

    # ------------------------------------------------------------------ states
    def whole(self) -> State:
        """Every table whole, the oversized ones as the rule places them."""
        return tuple(
            kind_code(self.rule[t]) if t in self.rule else (spec.dim,)
            for t, spec in enumerate(self.tables)
        )

    def can_halve(self, state: State, t: int, width: int) -> bool:
        """A shard of ``width`` columns of table ``t`` may be cut in two equal halves."""
        return width > 0 and width % 8 == 0 and len(state[t]) < self.world

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
        return [(t, c) for t, widths in enumerate(state) for c in widths if c > 0]

    def shards(self, state: State) -> Shards:
        pairs = self.shard_list(state)
        base = self.base(kinds_of(state))
        split_of = {t: k for k, t in enumerate(t for t, w in enumerate(state) if len(w) > 1)}
        return Shards(
            table=np.array([t for t, _ in pairs], dtype=np.int64),
            cols=np.array([c for _, c in pairs], dtype=np.int64),
            nbytes=np.array([self.shard_bytes(t, c) for t, c in pairs], dtype=np.int64),
            fp16=np.array([self.tables[t].dtype == "fp16" for t, _ in pairs], dtype=np.int64),
            enc=self.encodings(pairs),
            split=np.array([split_of.get(t, -1) for t, _ in pairs], dtype=np.int64),
            n_split=len(split_of),
            base=base,
        )

    def encodings(self, shards: Sequence[tuple[int, int]]) -> F32:
        if not shards:  # every table coded: no fused shard (an encoding's width, no rows)
            return self.encodings([(0, self.tables[0].dim)])[:0]
        missing = sorted({s for s in shards if s not in self._enc})
        if missing:
            got = self.predictor.encodings(
                [(self.tables[t], c) for t, c in missing], self.global_batch
            )
            for key, row in zip(missing, got, strict=True):
                self._enc[key] = row
        return np.stack([self._enc[s] for s in shards])

    def table_solo(self) -> F64:
        """Each table's predicted fwd + bwd cost whole and alone (memoized): what ranks
        the tables a kind step tries first."""
        if self._table_solo is None:
            enc = self.encodings([(t, spec.dim) for t, spec in enumerate(self.tables)])
            ones = np.ones(len(self.tables), dtype=np.int64)
            self._table_solo = self.head.seconds(enc, ones).sum(axis=1).astype(np.float64)
        return self._table_solo

    def solo(self, sh: Shards) -> F64:
        """Each shard's predicted fwd + bwd cost alone."""
        got: F64 = (
            self.head.seconds(sh.enc, np.ones(len(sh.cols), dtype=np.int64))
            .sum(axis=1)
            .astype(np.float64)
        )
        return got

    # ------------------------------------------------------------------ costs
    def comm(self, dims: F64, fwd: F64, base: Base) -> tuple[F64, F64]:
        """``[M, W]`` per-rank widths and forward compute → (fwd incl. wait, bwd)
        all-to-all seconds, by the predictor's declared comm model (W = 1 costs nothing),
        plus the coded tables' collectives."""
        fwd_c, bwd_c = self.predictor.comm_model.all_to_all(
            dims, fwd, self.batch_per_rank, self.comm_local_world
        )
        return fwd_c + base.comm[:, 0], bwd_c + base.comm[:, 1]

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
        compute += sh.base.compute
        dims = np.bincount(r, weights=sh.cols, minlength=w)
        fwd_c, bwd_c = self.predictor.comm_model.one(
            dims.tolist(), compute[:, 0].tolist(), self.batch_per_rank, self.comm_local_world
        )
        return compute, np.stack([fwd_c, bwd_c], axis=1) + sh.base.comm

    def sigma(self, sh: Shards, r: I64) -> F64:
        """Each rank's log error spread ``[W]`` under this model: the rank head's from
        the summed channels (more for shards priced without an anchor), else the
        predictor's one figure (:mod:`shardwise.planner.neuroshard.risk` weighs them). The
        coded tables' kernels weigh in by their seconds."""
        head = self.predictor.anchored_head
        if head is None:
            return np.full(self.world, self.predictor.rank_sigma)
        sums = np.zeros((self.world, sh.enc.shape[1]), dtype=np.float64)
        np.add.at(sums, r, sh.enc)
        fused = head.sigma(sums)
        if not sh.base.kinds:
            return fused
        secs = np.zeros(self.world)
        for d in (0, 1):
            on = sh.fp16 == d
            if on.any():
                part = np.zeros((self.world, sh.enc.shape[1]), dtype=np.float32)
                np.add.at(part, r[on], sh.enc[on])
                counts = np.bincount(r[on], minlength=self.world).astype(np.int64)
                secs += head.seconds(part, counts).sum(axis=1)
        total = secs + sh.base.seconds
        mixed: F64 = np.where(
            total > 0, (fused * secs + sh.base.spread) / np.maximum(total, 1e-300), fused
        )
        return mixed

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
        shards: list[list[Shard]] = []
        kinds: list[Kind | None] = []
        for t, widths in enumerate(state):
            opt = option_of(widths)
            if opt is None:
                shards.append(by_table[t])
                kinds.append(None)
            else:
                shards.append(kind_shards(opt, self.tables[t], self.topology))
                kinds.append(opt.kind)
        return Plan.from_shards(
            self.tables,
            shards,
            self.topology,
            name,
            [float(x) for x in best.per_rank],
            kinds=kinds,
        )

    def from_plan(self, plan: Plan) -> tuple[State, I64] | None:
        """A plan of another planner as a state and its ranks, or None where a state
        cannot hold it: two shards of one table on one rank, a kind this search does not
        choose (grid; any non-fused kind when it chooses table-wise and column-wise
        only), or a cut other than :func:`~shardwise.planner.oversized.kind_shards`'.
        Searching table-wise and column-wise only, the oversized tables are taken as our
        rule places them (every planner here shares it)."""
        placed = {t.name: t for t in plan.tables}
        widths: list[tuple[int, ...]] = []
        ranks: list[int] = []
        for t, spec in enumerate(self.tables):
            table = placed[spec.name]
            if t in self.rule and not self.searches_kinds:
                widths.append(kind_code(self.rule[t]))
                continue
            if table.kind in V1_KINDS and t not in self.rule:
                shards = sorted(table.shards, key=lambda s: (-s.cols, s.col_offset))
                if len({s.rank for s in shards}) != len(shards):
                    return None
                widths.append(tuple(s.cols for s in shards))
                ranks.extend(s.rank for s in shards)
                continue
            opt = self._option_of_table(t, table.kind, [s.rank for s in table.shards])
            if opt is None:
                return None
            want = kind_shards(opt, spec, self.topology)
            if _cut(table.shards, spec.rows) != _cut(want, spec.rows):
                return None
            widths.append(kind_code(opt))
        return tuple(widths), np.array(ranks, dtype=np.int64)

    def plan_kinds(self, plan: Plan) -> Kinds:
        """The tables a whole plan gives a kind other than table-wise or column-wise, with
        their options (the oversized ones included), as :func:`kinds_of` gives a state's."""
        placed = {t.name: t for t in plan.tables}
        choices: list[tuple[int, KindOption]] = []
        for t, spec in enumerate(self.tables):
            table = placed[spec.name]
            if table.kind not in V1_KINDS:
                host = self._host(table.kind, [s.rank for s in table.shards])
                choices.append((t, KindOption(table.kind, host)))
        return tuple(choices)

    def rows_cut(self, choices: Kinds) -> tuple[str, ...]:
        """The tables ``choices`` (:func:`kinds_of`, :meth:`plan_kinds`) cut by rows where
        the row-wise rule does not: row-wise or table-row-wise tables a GPU holds whole,
        and oversized ones cut otherwise than the rule cuts them."""
        return tuple(
            self.tables[t].name
            for t, opt in choices
            if opt.kind in ROW_KINDS and self.rule.get(t) != opt
        )

    def _host(self, kind: str, ranks: list[int]) -> int:
        """The host of a table-row-wise table on ``ranks`` (-1 for every other kind)."""
        return min(ranks) // self.topology.local_world if kind == "table_row_wise" else -1

    def _option_of_table(self, t: int, kind: str, ranks: list[int]) -> KindOption | None:
        """The allowed option a plan's table of ``kind`` on ``ranks`` would be."""
        host = self._host(kind, ranks)
        for opt in self.options(t):
            if opt.kind == kind and opt.host == host:
                return opt
        return None


def _cut(shards: Sequence[Shard], rows: int) -> list[tuple[int, int, int, int, int]]:
    return sorted((s.rank, s.col_offset, s.cols, s.row_offset, s.row_count(rows)) for s in shards)

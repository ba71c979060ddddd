"""NeuroShard's search (docs/design.md §8): column-wise beam search over a table-wise greedy.

Inner loop, for one set of shards (every table whole, or cut into equal column
shards): place shards costliest first (by the compute model's single-shard cost),
each onto the rank whose predicted fused-kernel cost *after* adding it is lowest,
among the ranks with memory for it and whose summed width stays under a cap. The cap
is ``scale × (total width / W)`` for every scale of a grid (1.0 … 1.5): a narrow cap
balances the all-to-all, a loose one the kernels. Each grid point's placement is
scored by the full predicted cost — compute plus the all-to-all with the straggler
wait, max over ranks — and the best one wins. All grid points advance together
(one NumPy evaluation of ``[grid, W]`` candidates per shard), through the head copy of
:mod:`shardwise.planner.incremental`, so a placement of 80 shards on 8 ranks takes
milliseconds.

Outer loop: a beam search (width ``beam_width``, ``beam_steps`` steps). A state says
into how many equal column shards each table is cut (a power of two, widths staying
multiples of 4, never more shards than ranks). From each state, the candidates halve
one of the ``branch`` widest shards' tables or one of the ``branch`` costliest; every
candidate gets the inner search, and the best ``beam_width`` states go on. Memory is
a hard constraint everywhere: a table too big for one GPU starts cut until its shards
fit, and a placement that cannot fit is dropped, never returned.

What we changed from the paper's code, and why:

- the rank choice minimizes the cost *after* adding the shard (the paper's code takes
  the rank with the lowest cost so far); with a non-additive fused kernel the
  marginal cost differs by rank, and this is what the model can tell us;
- one communication model for every world size (docs/design.md §7), so the score's comm part
  works for any W;
- a grid point where the width cap leaves no rank for a shard falls back to memory
  alone for that shard (the paper's code fails the grid point), so a tight cap still
  yields a plan to score.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shardwise.basics import UserError, format_bytes
from shardwise.planner.base import Planner, PlannerOptions, check_capacity
from shardwise.planner.costmodel import CostPredictor, load_bundled
from shardwise.planner.incremental import ComputeHead
from shardwise.planner.plan import Plan, Shard, Topology
from shardwise.planner.tables import TableSpec

#: Width-cap scales of the inner grid search (docs/design.md §8: 1.0 … 1.5).
DEFAULT_GRID: tuple[float, ...] = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))

#: Moves per local-search round that the comm model prices (after a compute screen).
SCREEN = 32
#: A round's swaps pair the straggler's shards with those on this many least-loaded
#: ranks (all shards would be ~46,000 pairs a round for 856 tables on 32 GPUs).
SWAP_RANKS = 4
#: A round moves at most this many of the straggler's shards (its costliest alone),
#: and swaps them with at most this many shards of the light ranks (spread over their
#: costs, cheapest to costliest). Without the bounds a round prices sources x partners
#: pairs, quadratic in the tables: 2,000 tables on 8 GPUs took 85 s and 1.5 GB here,
#: 10,000 more than 20 GB. Below the bounds (a few hundred tables) nothing changes.
MAX_SOURCES = 64
MAX_PARTNERS = 256

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SearchConfig:
    """The search's knobs; the defaults meet docs/design.md §8's speed targets on 2 cores."""

    beam_width: int = 3
    beam_steps: int = 5
    branch: int = 2
    grid: tuple[float, ...] = DEFAULT_GRID
    #: A split must lower the predicted max by this share of its parent's to be kept.
    #: On CPU a column split nearly doubles the table's kernel work (two kernels each
    #: reading every index; measured 1.87-1.95x for halves here) while the model, ~15 %
    #: off per kernel, can predict a gain that is not there; below this margin a split
    #: is noise under the model, and it costs for sure.
    split_gain: float = 0.03
    #: A child state (one more split) searches only its parent's best few scales.
    child_grid: int = 3
    #: Most single-shard moves of the final local search (0: none, the paper's search).
    refine_moves: int = 100


@dataclass
class SearchStats:
    """What the last search did: shown by the CLI and recorded by the benchmark."""

    candidates: int = 0
    steps: int = 0
    best_scale: float = 0.0
    split_tables: int = 0
    seconds: float = 0.0
    history: list[float] = field(default_factory=list)  # best predicted max per step
    refine_gain: float = 0.0  # share of the predicted max the local search removed


@dataclass(frozen=True)
class _Placement:
    ranks: I64  # per shard
    per_rank: npt.NDArray[np.float64]  # [W] predicted total (compute + comm)
    compute: npt.NDArray[np.float64]  # [W, 2] fwd, bwd compute
    comm: npt.NDArray[np.float64]  # [W, 2] fwd (with wait), bwd all-to-all
    scale: float
    #: The grid's feasible scales, best first: a child state searches only the first few.
    scales: tuple[float, ...] = ()

    @property
    def score(self) -> float:
        return float(self.per_rank.max())


class _Problem:
    """Everything about the tables and topology that every candidate state shares."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        topology: Topology,
        predictor: CostPredictor,
        batch_per_rank: int,
    ) -> None:
        self.tables = list(tables)
        self.topology = topology
        self.world = topology.gpus
        self.cap = topology.usable_bytes
        self.predictor = predictor
        self.batch_per_rank = batch_per_rank
        self.global_batch = batch_per_rank * self.world
        self.head = ComputeHead(
            predictor.model.compute, self.global_batch, (predictor.speed.fwd, predictor.speed.bwd)
        )
        self._enc: dict[tuple[int, int], F32] = {}

    def max_pieces(self, t: int) -> int:
        """Most equal column shards table ``t`` may be cut into (a power of two)."""
        dim, p = self.tables[t].dim, 1
        while p * 2 <= self.world and (dim // p) % 8 == 0:
            p *= 2
        return p

    def shards(self, pieces: Sequence[int]) -> list[tuple[int, int]]:
        """``(table index, cols)`` of every shard of a state."""
        return [(t, self.tables[t].dim // p) for t, p in enumerate(pieces) for _ in range(p)]

    def encodings(self, shards: Sequence[tuple[int, int]]) -> F32:
        missing = sorted({s for s in shards if s not in self._enc})
        if missing:
            got = self.predictor.encodings(
                [(self.tables[t], c) for t, c in missing], self.global_batch
            )
            for key, row in zip(missing, got, strict=True):
                self._enc[key] = row
        return np.stack([self._enc[s] for s in shards])


def _greedy(problem: _Problem, pieces: Sequence[int], grid: Sequence[float]) -> _Placement | None:
    """The inner search for one state: every grid point at once, best one scored."""
    shards = problem.shards(pieces)
    enc = problem.encodings(shards)
    s_count, w = len(shards), problem.world
    fp16 = np.array([problem.tables[t].dtype == "fp16" for t, _ in shards], dtype=np.int64)
    cols = np.array([c for _, c in shards], dtype=np.int64)
    nbytes = np.array([problem.tables[t].column_bytes(c) for t, c in shards], dtype=np.int64)
    single = problem.head.seconds(enc, np.ones(s_count, dtype=np.int64)).sum(axis=1)
    caps = np.ceil(np.asarray(grid) * cols.sum() / w).astype(np.int64)  # [G]
    for order in (
        np.lexsort((np.arange(s_count), -single)),  # costliest first (the paper)
        np.lexsort((np.arange(s_count), -nbytes)),  # biggest first: when memory is tight
    ):
        placed = _place(problem, order, enc, fp16, cols, nbytes, caps)
        if placed is not None:
            return _score(problem, placed, enc, fp16, cols, grid)
    return None


def _place(
    problem: _Problem,
    order: I64,
    enc: F32,
    fp16: I64,
    cols: I64,
    nbytes: I64,
    caps: I64,
) -> tuple[I64, npt.NDArray[np.bool_]] | None:
    """Greedy for every grid point: ranks ``[G, S]`` and which grid points fit."""
    g, w, h = len(caps), problem.world, enc.shape[1]
    sums = np.zeros((g, 2, w, h), dtype=np.float32)  # per dtype kernel
    counts = np.zeros((g, 2, w), dtype=np.int64)
    kernel = np.zeros((g, 2, w), dtype=np.float32)  # fwd+bwd of each dtype's kernel
    mem = np.zeros((g, w), dtype=np.int64)
    width = np.zeros((g, w), dtype=np.int64)
    ranks = np.zeros((g, len(cols)), dtype=np.int64)
    ok = np.ones(g, dtype=bool)
    gi = np.arange(g)
    for s in order:
        d = int(fp16[s])
        fits = mem + nbytes[s] <= problem.cap  # [G, W]
        under = fits & (width + cols[s] <= caps[:, None])
        allowed = np.where(under.any(axis=1, keepdims=True), under, fits)
        ok &= allowed.any(axis=1)
        if not ok.any():
            return None
        new = problem.head.seconds(sums[:, d] + enc[s], counts[:, d] + 1).sum(axis=-1)
        total = new + kernel[:, 1 - d]  # [G, W]
        total = np.where(allowed, total, np.inf)
        r = np.argmin(total, axis=1)  # lowest rank wins ties
        ranks[:, s] = r
        sums[gi, d, r] += enc[s]
        counts[gi, d, r] += 1
        kernel[gi, d, r] = new[gi, r]
        mem[gi, r] += nbytes[s]
        width[gi, r] += cols[s]
    return (ranks, ok) if ok.any() else None


def _costs(
    problem: _Problem, r: I64, enc: F32, fp16: I64, cols: I64
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Predicted compute ``[W, 2]`` and all-to-all ``[W, 2]`` of one placement."""
    w = problem.world
    compute = np.zeros((w, 2), dtype=np.float64)
    for d in (0, 1):
        on = fp16 == d
        sums = np.zeros((w, enc.shape[1]), dtype=np.float32)
        np.add.at(sums, r[on], enc[on])
        compute += problem.head.seconds(sums, np.bincount(r[on], minlength=w).astype(np.int64))
    dims = np.bincount(r, weights=cols, minlength=w).astype(np.int64)
    if w > 1:
        fwd_c, bwd_c = problem.predictor.comm(
            dims.tolist(), compute[:, 0].tolist(), problem.batch_per_rank
        )
    else:
        fwd_c, bwd_c = np.zeros(1), np.zeros(1)
    return compute, np.stack([fwd_c, bwd_c], axis=1)


def _score(
    problem: _Problem,
    placed: tuple[I64, npt.NDArray[np.bool_]],
    enc: F32,
    fp16: I64,
    cols: I64,
    grid: Sequence[float],
) -> _Placement | None:
    """Full predicted cost (compute + all-to-all, max over ranks) of each grid point."""
    ranks, ok = placed
    scored: list[_Placement] = []
    seen: set[bytes] = set()
    for gi in np.flatnonzero(ok):
        r = ranks[gi]
        if r.tobytes() in seen:
            continue
        seen.add(r.tobytes())
        compute, comm = _costs(problem, r, enc, fp16, cols)
        scored.append(
            _Placement(r, compute.sum(axis=1) + comm.sum(axis=1), compute, comm, grid[int(gi)])
        )
    if not scored:
        return None
    scored.sort(key=lambda p: p.score)
    return dataclasses.replace(scored[0], scales=tuple(p.scale for p in scored))


def _refine(
    problem: _Problem, pieces: Sequence[int], start: _Placement, max_moves: int
) -> _Placement:
    """Local search on the full predicted cost: move one shard off the predicted
    straggler (or the rank with the slowest forward, which every rank waits for) to
    another rank, or swap it with a shard on one of the least-loaded ranks, whichever
    lowers the max most;
    repeat while it falls. A round prices every move's two changed kernels in one
    NumPy batch, keeps the :data:`SCREEN` best by compute with today's all-to-all,
    and prices those with one batched comm-model call."""
    shards = problem.shards(pieces)
    enc = problem.encodings(shards)
    fp16 = np.array([problem.tables[t].dtype == "fp16" for t, _ in shards], dtype=np.int64)
    cols = np.array([c for _, c in shards], dtype=np.int64)
    nbytes = np.array([problem.tables[t].column_bytes(c) for t, c in shards], dtype=np.int64)
    table = np.array([t for t, _ in shards], dtype=np.int64)
    dtypes = [d for d in (0, 1) if (fp16 == d).any()]
    w, head, cap = problem.world, problem.head, problem.cap
    best = start
    r = start.ranks.copy()
    # Each shard's cost alone (fwd + bwd): which to move first, which partners to try.
    solo = head.seconds(enc, np.ones(len(shards), dtype=np.int64)).sum(axis=1)
    for _ in range(max_moves):
        compute, comm = best.compute, best.comm
        mem = np.bincount(r, weights=nbytes, minlength=w)
        dims = np.bincount(r, weights=cols, minlength=w)
        sources = np.array(sorted({int(np.argmax(best.per_rank)), int(np.argmax(compute[:, 0]))}))
        on_src = _costliest(np.flatnonzero(np.isin(r, sources)), solo, MAX_SOURCES)
        # Moves: shard s to rank b. Swaps: s with shard o on another rank.
        ms, mb = np.nonzero(
            (np.arange(w)[None, :] != r[on_src, None])
            & (mem[None, :] + nbytes[on_src, None] <= cap)
        )
        # Swap partners only on the least-loaded ranks: where a heavy shard can go.
        partners = _spread(
            np.flatnonzero(np.isin(r, np.argsort(best.per_rank, kind="stable")[:SWAP_RANKS])),
            solo,
            MAX_PARTNERS,
        )
        ss, so = np.nonzero(
            (r[partners][None, :] != r[on_src, None])
            & ~(
                (table[partners][None, :] == table[on_src, None])
                & (cols[partners][None, :] == cols[on_src, None])
            )
            & (mem[r[partners]][None, :] + nbytes[on_src, None] - nbytes[partners][None, :] <= cap)
            & (mem[r[on_src], None] + nbytes[partners][None, :] - nbytes[on_src, None] <= cap)
        )
        out = np.concatenate([on_src[ms], on_src[ss]])
        back = np.concatenate([np.full(len(ms), -1), partners[so]])
        if not len(out):
            break
        src = r[out]
        dst = np.concatenate([mb, r[partners[so]]])
        swap = back >= 0
        m = len(out)
        enc_back = np.where(swap[:, None], enc[np.maximum(back, 0)], 0.0).astype(np.float32)
        new_src = np.zeros((m, 2))
        new_dst = np.zeros((m, 2))
        for d in dtypes:
            on = fp16 == d
            sums = np.zeros((w, enc.shape[1]), dtype=np.float32)
            np.add.at(sums, r[on], enc[on])
            counts = np.bincount(r[on], minlength=w).astype(np.int64)
            go = fp16[out] == d
            come = swap & (fp16[np.maximum(back, 0)] == d)
            moved = go[:, None] * enc[out] - come[:, None] * enc_back
            shift = go.astype(np.int64) - come.astype(np.int64)
            new_src += head.seconds(np.maximum(sums[src] - moved, 0.0), counts[src] - shift)
            new_dst += head.seconds(np.maximum(sums[dst] + moved, 0.0), counts[dst] + shift)
        rows = np.arange(m)
        fwd = np.repeat(compute[None, :, 0], m, axis=0)
        bwd = np.repeat(compute[None, :, 1], m, axis=0)
        fwd[rows, src], bwd[rows, src] = new_src[:, 0], new_src[:, 1]
        fwd[rows, dst], bwd[rows, dst] = new_dst[:, 0], new_dst[:, 1]
        # Screen with today's all-to-all; only the most promising get the comm model.
        rough = (fwd.max(axis=1, keepdims=True) + bwd + comm[None, :, 1]).max(axis=1)
        keep = np.argsort(rough, kind="stable")[:SCREEN]
        width = cols[out] - np.where(swap, cols[np.maximum(back, 0)], 0)
        new_dims = np.repeat(dims[None, :], len(keep), axis=0).astype(np.float64)
        new_dims[np.arange(len(keep)), src[keep]] -= width[keep]
        new_dims[np.arange(len(keep)), dst[keep]] += width[keep]
        fwd_c, bwd_c = problem.predictor.comm_many(new_dims, fwd[keep], problem.batch_per_rank)
        score = (fwd[keep] + bwd[keep] + fwd_c + bwd_c).max(axis=1)
        k = int(np.argmin(score))
        if not score[k] < best.score * (1 - 1e-6):
            break
        k = int(keep[k])
        r = r.copy()
        if back[k] >= 0:
            r[back[k]] = src[k]
        r[out[k]] = dst[k]
        compute, comm = _costs(problem, r, enc, fp16, cols)
        best = _Placement(
            r, compute.sum(axis=1) + comm.sum(axis=1), compute, comm, best.scale, best.scales
        )
    return best


def _costliest(idx: I64, solo: npt.NDArray[np.float64], k: int) -> I64:
    """The ``k`` shards of ``idx`` that cost most alone, in index order (all if fewer)."""
    if len(idx) <= k:
        return idx
    return np.sort(idx[np.argsort(-solo[idx], kind="stable")[:k]])


def _spread(idx: I64, solo: npt.NDArray[np.float64], k: int) -> I64:
    """``k`` shards of ``idx`` evenly spread over their costs alone (all if fewer), so
    that swaps can trade a heavy shard for a light one or a near-equal one."""
    if len(idx) <= k:
        return idx
    ordered = idx[np.argsort(solo[idx], kind="stable")]
    return np.sort(ordered[np.linspace(0, len(ordered) - 1, k).round().astype(np.int64)])


def _initial_pieces(problem: _Problem) -> list[int]:
    """Whole tables, except those too big for one GPU: cut until a shard fits."""
    pieces = []
    for spec in problem.tables:
        p = 1
        while spec.column_bytes(spec.dim // p) > problem.cap:
            if p * 2 > problem.world or (spec.dim // p) % 8:
                head = (
                    f"table {spec.name} needs {format_bytes(spec.size_bytes)}; "
                    f"{problem.topology.describe_capacity()}. "
                )
                if p == 1:
                    why = (
                        f"Its {spec.dim} columns cannot be halved into multiples of 4"
                        if (spec.dim // p) % 8
                        else "One GPU cannot split it"
                    )
                else:
                    why = (
                        f"Cut into {p} equal column shards ({spec.dim // p} columns, "
                        f"{format_bytes(spec.column_bytes(spec.dim // p))} each) it still does "
                        "not fit, and it cannot be cut further (one shard per GPU, widths "
                        "multiples of 4)"
                    )
                raise UserError(head + why + ". Add GPUs or memory.")
            p *= 2
        pieces.append(p)
    return pieces


def _moves(problem: _Problem, pieces: Sequence[int], best: _Placement, branch: int) -> list[int]:
    """Tables to halve next: the widest shards' and the costliest ranks' costliest."""
    splittable = [t for t, p in enumerate(pieces) if p < problem.max_pieces(t)]
    if not splittable:
        return []
    widest = sorted(splittable, key=lambda t: (-problem.tables[t].dim // pieces[t], t))
    shards = problem.shards(pieces)
    single = problem.head.seconds(
        problem.encodings(shards), np.ones(len(shards), dtype=np.int64)
    ).sum(axis=1)
    # Shards on the predicted straggler first: halving elsewhere cannot lower the max.
    straggler = int(np.argmax(best.per_rank))
    cost: dict[int, float] = {}
    for (t, _), r, c in zip(shards, best.ranks, single, strict=True):
        cost[t] = max(cost.get(t, 0.0), float(c) + (1e3 if r == straggler else 0.0))
    costliest = sorted(splittable, key=lambda t: (-cost[t], t))
    out: list[int] = []
    for t in widest[:branch] + costliest[:branch]:
        if t not in out:
            out.append(t)
    return out


class NeuroShardPlanner(Planner):
    """Beam search over column splits, greedy grid search over placements."""

    name = "neuroshard"
    summary = (
        "NeuroShard: cost-model-guided beam search over column splits and greedy "
        "placement (the bundled CPU model unless --model)"
    )

    def __init__(
        self, options: PlannerOptions | None = None, config: SearchConfig | None = None
    ) -> None:
        super().__init__(options)
        self.config = config or SearchConfig()
        self.last_stats = SearchStats()

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology, splittable=True)
        started = time.perf_counter()
        predictor = self.options.predictor or CostPredictor(load_bundled())
        problem = _Problem(tables, topology, predictor, self.options.batch_size_per_rank)
        cfg = self.config
        stats = SearchStats()
        start = _initial_pieces(problem)
        first = _greedy(problem, start, cfg.grid)
        stats.candidates = 1
        beam: list[tuple[tuple[int, ...], _Placement]] = []
        if first is not None:
            beam.append((tuple(start), first))
        seen = {tuple(start)}
        # A start that fits nowhere (memory too tight for whole tables) still gets cut.
        frontier: list[tuple[tuple[int, ...], _Placement | None]] = [(tuple(start), first)]
        for _ in range(cfg.beam_steps):
            cands: list[tuple[tuple[int, ...], _Placement]] = []
            unfit: list[tuple[tuple[int, ...], _Placement | None]] = []
            for pieces, placed in frontier:
                for t in self._next(problem, pieces, placed):
                    nxt = list(pieces)
                    nxt[t] *= 2
                    key = tuple(nxt)
                    if key in seen:
                        continue
                    seen.add(key)
                    grid = placed.scales[: cfg.child_grid] if placed else cfg.grid
                    got = _greedy(problem, key, grid)
                    stats.candidates += 1
                    if got is None:
                        unfit.append((key, None))
                    elif placed is None or got.score < placed.score * (1 - cfg.split_gain):
                        cands.append((key, got))
            if not cands:
                if beam or not unfit:
                    break
                frontier = unfit[: cfg.beam_width]  # nothing fits yet: keep cutting
                continue
            stats.steps += 1
            merged = sorted(beam + cands, key=lambda x: x[1].score)[: cfg.beam_width]
            entered = any(m is c for m in merged for c in cands)
            beam = merged
            frontier = list(beam)
            stats.history.append(beam[0][1].score)
            if not entered:
                break
        if not beam:
            raise UserError(
                f"no placement of the {len(tables)} tables fits {topology.gpus} GPUs "
                f"({topology.describe_capacity()}), even with column splits. "
                "Add GPUs or memory."
            )
        if cfg.refine_moves > 0:
            top = beam[0][1].score
            beam = [(beam[0][0], _refine(problem, beam[0][0], beam[0][1], cfg.refine_moves))]
            stats.refine_gain = 1.0 - beam[0][1].score / top
        pieces, best = beam[0]
        stats.best_scale = best.scale
        stats.split_tables = sum(1 for p in pieces if p > 1)
        stats.seconds = time.perf_counter() - started
        self.last_stats = stats
        return _to_plan(problem, pieces, best, self.name)

    def _next(
        self, problem: _Problem, pieces: tuple[int, ...], placed: _Placement | None
    ) -> list[int]:
        if placed is None:  # nothing fitted: cut the biggest tables
            order = sorted(
                (t for t, p in enumerate(pieces) if p < problem.max_pieces(t)),
                key=lambda t: -problem.tables[t].column_bytes(problem.tables[t].dim // pieces[t]),
            )
            return order[: self.config.branch]
        return _moves(problem, pieces, placed, self.config.branch)


def _to_plan(problem: _Problem, pieces: Sequence[int], best: _Placement, name: str) -> Plan:
    shards = problem.shards(pieces)
    by_table: dict[int, list[Shard]] = {}
    offset: dict[int, int] = {}
    for (t, c), r in zip(shards, best.ranks, strict=True):
        o = offset.get(t, 0)
        by_table.setdefault(t, []).append(Shard(rank=int(r), col_offset=o, cols=c))
        offset[t] = o + c
    return Plan.from_shards(
        problem.tables,
        [by_table[t] for t in range(len(problem.tables))],
        problem.topology,
        name,
        [float(x) for x in best.per_rank],
    )


__all__ = ["DEFAULT_GRID", "NeuroShardPlanner", "SearchConfig", "SearchStats"]

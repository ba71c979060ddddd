"""What measured refinement works on: a placement (shards per rank), the moves that
change it, and its kernels timed for real (:class:`KernelBench`, with the noise of a
timing), priced as the objective the search lowers (:func:`objective`).

Apart from the search (:mod:`shardwise.profiler.refine.search`), so the closing
re-measurement (:mod:`shardwise.profiler.refine.measured`) times and prices with the
same pieces.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardwise.planner.comm.model import CommModel
from shardwise.planner.plan import Shard
from shardwise.planner.streams import stream_from_spec
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad, Stream, measure_compute

#: Per kernel timing: fewer calls than the evaluator's 5 + 10, so a budget tries more
#: moves; the closing fresh re-measurement repeats it (``refine.FRESH_REPEATS``).
WARMUPS = 3
ITERS = 7


@dataclass(frozen=True)
class Timing:
    """One measured kernel: medians of fwd and bwd, their spread (the robust cv of its
    calls: :attr:`ComputeResult.robust_cv`), and the wall time the measurement took
    (building the kernel included)."""

    fwd: float
    bwd: float
    cv: float = 0.0
    wall: float = 0.0

    @property
    def total(self) -> float:
        return self.fwd + self.bwd

    def plus(self, other: Timing) -> Timing:
        """This kernel and ``other`` run back to back on one rank (the spread and wall
        stay this one's: ``other`` is a fixed part measured apart)."""
        return Timing(self.fwd + other.fwd, self.bwd + other.bwd, self.cv, self.wall)


def noise(t: Timing) -> float:
    """Relative standard error of a median of ``ITERS`` calls with spread ``t.cv``."""
    return 1.25 * t.cv / math.sqrt(ITERS)


Key = tuple[int, int]  # (index of the table in the plan, shard columns)
Slot = tuple[int, int]  # (index of the table in the plan, index of the shard in it)
# Where every shard is: per table (in the plan's order), its shards.
Placement = list[list[Shard]]


@dataclass(frozen=True)
class Move:
    """Shard ``slot`` goes from rank ``src`` to ``dst``, swapped with ``partner`` there
    if given; ``split`` moves only its right part (the halves' widths multiples of 4)."""

    slot: Slot
    src: int
    dst: int
    partner: Slot | None = None
    split: bool = False


def split_widths(cols: int) -> tuple[int, int] | None:
    """(kept, moved) columns of a split shard, both multiples of 4, or None."""
    kept = 4 * (cols // 8)
    return (kept, cols - kept) if kept >= 4 else None


class KernelBench:
    """Times shard sets at one global batch, each table's stream made once."""

    def __init__(self, specs: Sequence[TableSpec], batch: int, seed: int, device: str) -> None:
        self.specs, self.batch, self.seed, self.device = specs, batch, seed, device
        self.streams: dict[int, Stream] = {}
        self.kernels = 0
        self.used_device = device
        #: The shard set timed last (sorted), so a caller can tell a figure is fresh.
        self.last: list[Key] = []

    def time(self, keys: Sequence[Key]) -> Timing:
        if not keys:
            return Timing(0.0, 0.0)
        t0 = time.perf_counter()
        for i, _ in keys:
            if i not in self.streams:
                self.streams[i] = stream_from_spec(self.specs[i], self.batch, self.seed)
        m = measure_compute(
            [ShardLoad(self.specs[i], c) for i, c in keys],
            self.batch,
            warmups=WARMUPS,
            iters=ITERS,
            seed=self.seed,
            device=self.device,
            streams=[self.streams[i] for i, _ in keys],
        )
        self.kernels += 1
        self.used_device = m.device
        self.last = sorted(keys)
        return Timing(m.fwd_s, m.bwd_s, m.robust_cv, time.perf_counter() - t0)


def rank_sets(place: Placement, world: int) -> list[list[Key]]:
    out: list[list[Key]] = [[] for _ in range(world)]
    for i, shards in enumerate(place):
        for s in shards:
            out[s.rank].append((i, s.cols))
    return out


def widths(sets: Sequence[Sequence[Key]]) -> list[int]:
    return [sum(c for _, c in keys) for keys in sets]


def objective(
    timings: Sequence[Timing],
    dims: Sequence[int],
    comm: CommModel | None,
    batch: int,
    *,
    local_world: int | None = None,
    extra: Sequence[float] | None = None,
) -> float:
    """The evaluator's cost: max over ranks of compute plus the declared comm (each
    rank's forward compute is its start delay, so the forward includes the wait), on
    ``local_world`` ranks a host; ``extra`` adds each rank's other collectives (of
    tables the refinement keeps fixed)."""
    total = np.array([t.total for t in timings], dtype=np.float64)
    if comm is not None and len(timings) > 1:
        fwd, bwd = comm.one(list(dims), [t.fwd for t in timings], batch, local_world)
        total = total + fwd + bwd
    if extra is not None:
        total = total + np.asarray(extra, dtype=np.float64)
    return float(total.max())


def apply_move(place: Placement, move: Move) -> Placement:
    ti, si = move.slot
    out = list(place)
    shards = list(out[ti])
    a = shards[si]
    halves = split_widths(a.cols) if move.split else None
    if halves is not None:
        shards[si] = a.model_copy(update={"cols": halves[0]})
        shards.append(Shard(rank=move.dst, col_offset=a.col_offset + halves[0], cols=halves[1]))
    else:
        shards[si] = a.model_copy(update={"rank": move.dst})
    out[ti] = shards
    if move.partner is not None:
        tj, sj = move.partner
        out[tj] = [
            s.model_copy(update={"rank": move.src}) if k == sj else s for k, s in enumerate(out[tj])
        ]
    return out


def equal_widths(place: Placement, tables: Sequence[int], ranks: Sequence[int]) -> bool:
    """TorchRec's rule on the changed tables and ranks: one width per table per rank."""
    return all(len({s.cols for s in place[ti] if s.rank == r}) <= 1 for ti in tables for r in ranks)

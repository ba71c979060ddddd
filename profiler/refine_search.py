"""The loop of measured refinement (docs/refinement.md): the measured straggler's shards
are moved to, or swapped with shards on, the fastest ranks; a proxy ranks the
candidates, the best few are re-measured on the two ranks they change, and the best
is kept when it beats the current measured objective by more than the noise.

:mod:`shardwise.profiler.refine` runs it and closes with the fresh re-measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shardwise.planner.comm import CommModel
from shardwise.planner.plan import Shard
from shardwise.planner.streams import stream_from_spec
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad, Stream, measure_compute

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

#: Per kernel timing: fewer calls than the evaluator's 5 + 10, so a budget tries more
#: moves; the closing fresh re-measurement repeats it (``refine.FRESH_REPEATS``).
WARMUPS = 3
ITERS = 7
#: The straggler's shards may go to (or swap with) this many of the fastest ranks.
TARGETS = 3
#: Candidates re-measured per round, best proxy first.
TRIES_PER_ROUND = 3
#: A move must beat the current objective by this share at least, and by more than
#: the standard error of the medians it compares (:func:`noise`).
MIN_GAIN = 0.01
#: Shards of a rank considered as sources or swap partners (most lookups × columns
#: first), and single-shard costs measured per round without a predictor.
MAX_SHARDS_PER_RANK = 32
MAX_SINGLES_PER_ROUND = 16


@dataclass(frozen=True)
class Timing:
    """One measured kernel: medians of fwd and bwd, their spread, and the wall time the
    measurement took (building the kernel included)."""

    fwd: float
    bwd: float
    cv: float = 0.0
    wall: float = 0.0

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def noise(t: Timing) -> float:
    """Relative standard error of a median of ``ITERS`` calls with spread ``t.cv``."""
    return 1.25 * t.cv / math.sqrt(ITERS)


Key = tuple[int, int]  # (index of the table in the plan, shard columns)
Slot = tuple[int, int]  # (index of the table in the plan, index of the shard in it)
# Where every shard is: per table (in the plan's order), its shards.
Placement = list[list[Shard]]
# A change: shard ``slot`` moves from rank s to d, optionally swapped with ``partner`` on d.
Move = tuple[Slot, int, int, Slot | None]


class KernelBench:
    """Times shard sets at one global batch, each table's stream made once."""

    def __init__(self, specs: Sequence[TableSpec], batch: int, seed: int, device: str) -> None:
        self.specs, self.batch, self.seed, self.device = specs, batch, seed, device
        self.streams: dict[int, Stream] = {}
        self.kernels = 0
        self.used_device = device

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
        return Timing(m.fwd_s, m.bwd_s, m.cv, time.perf_counter() - t0)


def rank_sets(place: Placement, world: int) -> list[list[Key]]:
    out: list[list[Key]] = [[] for _ in range(world)]
    for i, shards in enumerate(place):
        for s in shards:
            out[s.rank].append((i, s.cols))
    return out


def widths(sets: Sequence[Sequence[Key]]) -> list[int]:
    return [sum(c for _, c in keys) for keys in sets]


def objective(
    timings: Sequence[Timing], dims: Sequence[int], comm: CommModel | None, batch: int
) -> float:
    """The evaluator's cost: max over ranks of compute plus the declared comm (each
    rank's forward compute is its start delay, so the forward includes the wait)."""
    total = np.array([t.total for t in timings], dtype=np.float64)
    if comm is not None and len(timings) > 1:
        fwd, bwd = comm.one(list(dims), [t.fwd for t in timings], batch)
        total = total + fwd + bwd
    return float(total.max())


def apply_move(place: Placement, move: Move) -> Placement:
    (ti, si), src, dst, partner = move
    out = list(place)
    out[ti] = [s.model_copy(update={"rank": dst}) if k == si else s for k, s in enumerate(out[ti])]
    if partner is not None:
        tj, sj = partner
        out[tj] = [
            s.model_copy(update={"rank": src}) if k == sj else s for k, s in enumerate(out[tj])
        ]
    return out


def equal_widths(place: Placement, tables: Sequence[int], ranks: Sequence[int]) -> bool:
    """TorchRec's rule on the changed tables and ranks: one width per table per rank."""
    return all(len({s.cols for s in place[ti] if s.rank == r}) <= 1 for ti in tables for r in ranks)


@dataclass(frozen=True)
class Candidate:
    move: Move
    src_keys: list[Key]  # the straggler's shard set after the move
    dst_keys: list[Key]
    estimate: float = 0.0  # the proxy's objective

    @property
    def src(self) -> int:
        return self.move[1]

    @property
    def dst(self) -> int:
        return self.move[2]

    def key(self) -> tuple[int, int, tuple[Key, ...], tuple[Key, ...]]:
        return self.src, self.dst, tuple(sorted(self.src_keys)), tuple(sorted(self.dst_keys))


@dataclass
class Search:
    """The loop over a placement and its measured per-rank timings (see the module
    docstring). ``mem(table, cols)`` is a shard's memory under the plan's rule;
    ``objective(timings, dims)`` the cost; ``reserve_per_wall`` how many times each
    rank's wall time the closing re-measurement needs (it is kept free)."""

    place: Placement
    timings: list[Timing]
    specs: Sequence[TableSpec]
    bench: KernelBench
    predictor: CostPredictor | None
    mem: Callable[[int, int], int]
    cap: int
    cost: Callable[[Sequence[Timing], Sequence[int]], float]
    deadline: float
    say: Callable[[str], None]
    reserve_per_wall: int

    def __post_init__(self) -> None:
        self.world = len(self.timings)
        self.value = self.cost(self.timings, widths(rank_sets(self.place, self.world)))
        self.start_sets = [sorted(keys) for keys in rank_sets(self.place, self.world)]
        self.tried: set[tuple[int, int, tuple[Key, ...], tuple[Key, ...]]] = set()
        self.singles: dict[Key, Timing] = {}
        self.moves = 0

    # ------------------------------------------------------------------ views
    def slots(self) -> list[list[Slot]]:
        out: list[list[Slot]] = [[] for _ in range(self.world)]
        for i, shards in enumerate(self.place):
            for k, s in enumerate(shards):
                out[s.rank].append((i, k))
        return out

    def key(self, slot: Slot) -> Key:
        return slot[0], self.place[slot[0]][slot[1]].cols

    def work(self, key: Key) -> float:
        """A-priori weight of a shard (lookups × columns), to bound the candidates."""
        return max(self.specs[key[0]].pooling_factor, 0.05) * key[1]

    def heaviest(self, slots: Sequence[Slot]) -> list[Slot]:
        return sorted(slots, key=lambda sl: -self.work(self.key(sl)))[:MAX_SHARDS_PER_RANK]

    def changed(self, also: Sequence[int] = ()) -> set[int]:
        now = rank_sets(self.place, self.world)
        moved = {r for r in range(self.world) if sorted(now[r]) != self.start_sets[r]}
        return moved | set(also)

    def late(self, cost: float, changed: set[int]) -> bool:
        """Whether ``cost`` more seconds would eat into the closing re-measurement's
        time (every rank once, the ranks that differ from the start twice)."""
        walls = [t.wall for t in self.timings]
        reserve = self.reserve_per_wall * (sum(walls) + sum(walls[r] for r in changed))
        return time.perf_counter() + cost + reserve > self.deadline

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        """Refine until the budget is spent or no candidate is left; the number of moves."""
        fresh = set(range(self.world))  # ranks measured since the last kept move
        while True:
            slots = self.slots()
            totals = [t.total for t in self.timings]
            s = int(np.argmax(totals))
            if s not in fresh:  # the straggler's figure may be stale: time it again
                if self.late(self.timings[s].wall, self.changed() if self.moves else set()):
                    self.say("refine: time budget reached")
                    break
                self.timings[s] = self.bench.time([self.key(sl) for sl in slots[s]])
                self.value = self.cost(self.timings, widths(rank_sets(self.place, self.world)))
                fresh.add(s)
                continue
            targets = sorted((r for r in range(self.world) if r != s), key=totals.__getitem__)
            cands = self.ranked(s, targets[:TARGETS], slots)
            if not cands:
                self.say("refine: no untried move is expected to help; stopping")
                break
            kept, late = self.try_best(s, cands[:TRIES_PER_ROUND])
            if kept is not None:
                fresh = {kept.src, kept.dst}
            if late:
                self.say("refine: time budget reached")
                break
        return self.moves

    def try_best(self, s: int, cands: Sequence[Candidate]) -> tuple[Candidate | None, bool]:
        """Re-measure the changed ranks of each candidate; keep the best if it beats the
        current objective by more than the noise. (kept candidate, out of time)."""
        best: tuple[float, Candidate, Timing, Timing] | None = None
        late = False
        for cand in cands:
            d = cand.dst
            if self.late(self.timings[s].wall + self.timings[d].wall, self.changed([s, d])):
                late = True
                break
            ts, td = self.bench.time(cand.src_keys), self.bench.time(cand.dst_keys)
            self.tried.add(cand.key())
            trial = list(self.timings)
            trial[s], trial[d] = ts, td
            value = self.cost(trial, self.dims_after(cand))
            if best is None or value < best[0]:
                best = (value, cand, ts, td)
        if best is None:
            return None, late
        value, cand, ts, td = best
        margin = max(MIN_GAIN, noise(self.timings[s]), noise(ts), noise(td))
        if value >= self.value * (1 - margin):
            return None, late
        what = self.describe(cand)
        before = self.value
        self.place = apply_move(self.place, cand.move)
        self.timings[s], self.timings[cand.dst] = ts, td
        self.value = value
        self.moves += 1
        self.say(
            f"refine: move {self.moves}: {what}: {_ms(before)} → {_ms(value)} measured "
            f"({self.bench.kernels} kernels)"
        )
        return cand, late

    def dims_after(self, cand: Candidate) -> list[int]:
        dims = widths(rank_sets(self.place, self.world))
        dims[cand.src] = sum(c for _, c in cand.src_keys)
        dims[cand.dst] = sum(c for _, c in cand.dst_keys)
        return dims

    def describe(self, cand: Candidate) -> str:
        a, s, d, b = cand.move
        what = f"{self.specs[a[0]].name} ({self.key(a)[1]} cols) rank {s} → {d}"
        if b is not None:
            what += f", swapped with {self.specs[b[0]].name} ({self.key(b)[1]} cols)"
        return what

    # ------------------------------------------------------------------ candidates
    def ranked(
        self, s: int, targets: Sequence[int], slots: Sequence[Sequence[Slot]]
    ) -> list[Candidate]:
        """Untried moves and swaps off ``s`` that keep memory and TorchRec's rule, best
        proxy estimate first, only those the proxy expects to help."""
        used = [sum(self.mem(*self.key(sl)) for sl in row) for row in slots]
        out: list[Candidate] = []
        for a in self.heaviest(slots[s]):
            ka = self.key(a)
            for d in targets:
                partners: list[Slot | None] = [None, *self.heaviest(slots[d])]
                for b in partners:
                    kb = self.key(b) if b is not None else None
                    if kb == ka:
                        continue  # a shard for an equal one of the same table: no change
                    delta = self.mem(*ka) - (self.mem(*kb) if kb is not None else 0)
                    if not (
                        self.fits(used[s] - delta, used[s]) and self.fits(used[d] + delta, used[d])
                    ):
                        continue
                    move: Move = (a, s, d, b)
                    if not equal_widths(
                        apply_move(self.place, move), [a[0]] + ([b[0]] if b else []), [s, d]
                    ):
                        continue
                    src = [self.key(sl) for sl in slots[s] if sl != a] + ([kb] if kb else [])
                    dst = [self.key(sl) for sl in slots[d] if sl != b] + [ka]
                    cand = Candidate(move, src, dst)
                    if cand.key() not in self.tried:
                        out.append(cand)
        scored = self.estimate(out)
        return sorted((c for c in scored if c.estimate < self.value), key=lambda c: c.estimate)

    def fits(self, new: int, old: int) -> bool:
        """Within the memory cap, or at least no fuller than before (a start plan
        counted by another rule may already be over)."""
        return new <= self.cap or new <= old

    def estimate(self, cands: Sequence[Candidate]) -> list[Candidate]:
        if not cands:
            return []
        pairs = self.predicted(cands) if self.predictor is not None else self.from_singles(cands)
        out = []
        for cand, pair in zip(cands, pairs, strict=True):
            if pair is None:
                continue
            trial = list(self.timings)
            trial[cand.src], trial[cand.dst] = pair
            value = self.cost(trial, self.dims_after(cand))
            out.append(Candidate(cand.move, cand.src_keys, cand.dst_keys, value))
        return out

    def predicted(self, cands: Sequence[Candidate]) -> list[tuple[Timing, Timing] | None]:
        """The model's relative change applied to measured figures: a new shard set is
        priced by the model and scaled by its rank's measured/predicted ratio."""
        assert self.predictor is not None
        sets = [[self.key(sl) for sl in row] for row in self.slots()]
        sets += [k for c in cands for k in (c.src_keys, c.dst_keys)]
        priced = self.predictor.compute(
            [[(self.specs[i], c) for i, c in keys] for keys in sets], self.bench.batch
        )
        now, new = priced[: self.world], priced[self.world :]
        meas = np.array([[t.fwd, t.bwd] for t in self.timings])
        busy = now.sum(axis=1) > 0
        overall = meas[busy].sum(axis=0) / np.maximum(now[busy].sum(axis=0), 1e-12)
        scale = np.where(now > 0, meas / np.maximum(now, 1e-12), overall)
        out: list[tuple[Timing, Timing] | None] = []
        for k, cand in enumerate(cands):
            fs, bs = new[2 * k] * scale[cand.src]
            fd, bd = new[2 * k + 1] * scale[cand.dst]
            out.append((Timing(float(fs), float(bs)), Timing(float(fd), float(bd))))
        return out

    def from_singles(self, cands: Sequence[Candidate]) -> list[tuple[Timing, Timing] | None]:
        """Measured single-shard costs moved from one rank's figure to the other's;
        singles are measured on first need, the most lookups × columns first."""
        wanted: set[Key] = set()
        for c in cands:
            wanted.add(self.key(c.move[0]))
            if c.move[3] is not None:
                wanted.add(self.key(c.move[3]))
        todo = sorted(wanted - set(self.singles), key=lambda k: -self.work(k))
        changed = self.changed()
        for key in todo[:MAX_SINGLES_PER_ROUND]:
            if self.late(max(t.wall for t in self.timings) / 2, changed):
                break
            self.singles[key] = self.bench.time([key])
        out: list[tuple[Timing, Timing] | None] = []
        zero = Timing(0.0, 0.0)
        for c in cands:
            a = self.singles.get(self.key(c.move[0]))
            b = self.singles.get(self.key(c.move[3])) if c.move[3] is not None else zero
            if a is None or b is None:
                out.append(None)
                continue
            ts, td = self.timings[c.src], self.timings[c.dst]
            out.append(
                (
                    Timing(max(0.0, ts.fwd - a.fwd + b.fwd), max(0.0, ts.bwd - a.bwd + b.bwd)),
                    Timing(max(0.0, td.fwd + a.fwd - b.fwd), max(0.0, td.bwd + a.bwd - b.bwd)),
                )
            )
        return out


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"

"""The loop of measured refinement (docs/refinement.md): the measured straggler's shards
are moved to, or swapped with shards on, the fastest ranks; a proxy ranks the
candidates, the best few are re-measured on the two ranks they change, and the best
is kept when it beats the current measured objective by more than the noise.

:mod:`shardwise.profiler.refine.measured` runs it and closes with the fresh re-measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from shardwise.planner.tables import TableSpec
from shardwise.profiler.refine.placement import (
    KernelBench,
    Key,
    Move,
    Placement,
    Slot,
    Timing,
    apply_move,
    equal_widths,
    noise,
    rank_sets,
    split_widths,
    widths,
)

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

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
class Candidate:
    """A move with the shard sets it leaves on its two ranks and what it changes there
    (``leaves``/``enters`` the source; the destination gets the reverse, except a split:
    ``arrives`` is what the destination gets)."""

    move: Move
    src_keys: list[Key]  # the straggler's shard set after the move
    dst_keys: list[Key]
    leaves: Key
    enters: Key | None
    arrives: Key
    estimate: float = 0.0  # the proxy's objective

    @property
    def src(self) -> int:
        return self.move.src

    @property
    def dst(self) -> int:
        return self.move.dst

    def key(self) -> tuple[int, int, tuple[Key, ...], tuple[Key, ...]]:
        return self.src, self.dst, tuple(sorted(self.src_keys)), tuple(sorted(self.dst_keys))


@dataclass
class Search:
    """The loop over a placement and its measured per-rank timings (see the module
    docstring). ``mem(table, cols)`` is a shard's memory under the plan's rule;
    ``cost(timings, dims)`` the objective. The time the closing re-measurement will
    need is kept free before ``deadline``: ``fresh_repeats`` times the walls of the
    ranks that changed (twice: both plans) and of the others measured at ``near_max``
    of the straggler or more (once: shared)."""

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
    fresh_repeats: int
    near_max: float
    #: Memory each rank holds in tables the search does not move (row-wise,
    #: data-parallel: kept where the plan put them), counted against ``cap``.
    fixed_mem: Sequence[int] = ()

    def __post_init__(self) -> None:
        self.world = len(self.timings)
        self.value = self.cost(self.timings, widths(rank_sets(self.place, self.world)))
        self.start_sets = [sorted(keys) for keys in rank_sets(self.place, self.world)]
        self.start_max = max(t.total for t in self.timings)
        self.tried: set[tuple[int, int, tuple[Key, ...], tuple[Key, ...]]] = set()
        self.singles: dict[Key, Timing] = {}
        self.moves = 0
        self.tries = 0
        #: (table, rank) a kept move took a shard of the table off: never moved back
        #: there, so noise cannot undo a kept move and redo it (seen here: ping-pong).
        self.left: set[tuple[int, int]] = set()

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
        """Whether ``cost`` more seconds would eat into the time of the closing
        re-measurement, needed once ``changed`` ranks differ from the start."""
        if changed:
            top = self.near_max * min(self.start_max, max(t.total for t in self.timings))
            walls = [
                t.wall * (2 if r in changed else 1 if t.total >= top else 0)
                for r, t in enumerate(self.timings)
            ]
            cost += self.fresh_repeats * sum(walls)
        return time.perf_counter() + cost > self.deadline

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        """Refine until the budget is spent or no candidate is left; the number of moves.

        Each round first re-times the straggler unless it was timed in the round before
        (this host's speed drifts, and a candidate is judged against it), then tries
        the best few candidates off it.
        """
        timed = [0] * self.world  # the round each rank's figure is from
        rnd = 0
        while True:
            slots = self.slots()
            totals = [t.total for t in self.timings]
            s = int(np.argmax(totals))
            if timed[s] < rnd:
                if self.late(self.timings[s].wall, self.changed()):
                    break
                self.timings[s] = self.bench.time([self.key(sl) for sl in slots[s]])
                self.value = self.cost(self.timings, widths(rank_sets(self.place, self.world)))
                timed[s] = rnd
                continue
            targets = sorted((r for r in range(self.world) if r != s), key=totals.__getitem__)
            cands = self.ranked(s, targets[:TARGETS], slots)
            if not cands:
                self.say(f"refine: no untried move is expected to help ({self.tries} tried)")
                return self.moves
            kept, late = self.try_best(s, cands[:TRIES_PER_ROUND])
            rnd += 1
            if kept is not None:
                timed[kept.src] = timed[kept.dst] = rnd
            if late:
                break
        self.say(f"refine: time budget reached ({self.tries} candidates tried)")
        return self.moves

    def try_best(self, s: int, cands: Sequence[Candidate]) -> tuple[Candidate | None, bool]:
        """Re-measure the two ranks each candidate changes, right after timing the
        straggler as it is (unless it was the last kernel timed), so each candidate is
        judged against a figure from the same minute: this host's speed drifts. Keep
        the best if it beats that figure by more than the noise. (kept, out of time)."""
        best: tuple[float, float, Candidate, Timing, Timing, Timing] | None = None
        late = False
        current = sorted(self.key(sl) for sl in self.slots()[s])
        dims = widths(rank_sets(self.place, self.world))
        for cand in cands:
            d = cand.dst
            again = self.bench.last != current
            cost = self.timings[s].wall * (2 if again else 1) + self.timings[d].wall
            if self.late(cost, self.changed([s, d])):
                late = True
                break
            if again:
                self.timings[s] = self.bench.time(current)
                self.value = self.cost(self.timings, dims)
            ts, td = self.bench.time(cand.src_keys), self.bench.time(cand.dst_keys)
            self.tried.add(cand.key())
            self.tries += 1
            trial = list(self.timings)
            trial[s], trial[d] = ts, td
            value = self.cost(trial, self.dims_after(cand))
            self.say(
                f"refine: tried {self.describe(cand)}: {_ms(self.value)} → {_ms(value)} "
                f"(expected {_ms(cand.estimate)})"
            )
            if best is None or value / self.value < best[0] / best[1]:
                best = (value, self.value, cand, ts, td, self.timings[s])
        if best is None:
            return None, late
        value, before, cand, ts, td, ref = best
        margin = max(MIN_GAIN, noise(ref), noise(ts), noise(td))
        if value >= before * (1 - margin):
            self.say(
                f"refine: not kept: {self.describe(cand)}: {_ms(before)} → {_ms(value)} is "
                f"within the noise margin of {100 * margin:.1f} %"
            )
            return None, late
        what = self.describe(cand)
        self.left.add((cand.leaves[0], s))
        if cand.enters is not None and not cand.move.split:
            self.left.add((cand.enters[0], cand.dst))
        self.place = apply_move(self.place, cand.move)
        self.timings[s], self.timings[cand.dst] = ts, td
        self.value = self.cost(self.timings, widths(rank_sets(self.place, self.world)))
        self.moves += 1
        self.say(
            f"refine: move {self.moves}: {what}: {_ms(before)} → {_ms(value)} measured "
            f"({self.bench.kernels} kernels)"
        )
        return cand, late

    def dims_after(self, cand: Candidate, base: Sequence[int] | None = None) -> list[int]:
        """Each rank's output width after ``cand`` (``base``: the widths now, if known)."""
        dims = list(base) if base is not None else widths(rank_sets(self.place, self.world))
        dims[cand.src] = sum(c for _, c in cand.src_keys)
        dims[cand.dst] = sum(c for _, c in cand.dst_keys)
        return dims

    def describe(self, cand: Candidate) -> str:
        m = cand.move
        name = self.specs[m.slot[0]].name
        if m.split:
            return (
                f"{name} split {cand.leaves[1]} → {cand.enters[1] if cand.enters else 0} + "
                f"{cand.arrives[1]} cols, rank {m.src} → {m.dst}"
            )
        what = f"{name} ({cand.leaves[1]} cols) rank {m.src} → {m.dst}"
        if m.partner is not None and cand.enters is not None:
            what += f", swapped with {self.specs[m.partner[0]].name} ({cand.enters[1]} cols)"
        return what

    # ------------------------------------------------------------------ candidates
    def ranked(
        self, s: int, targets: Sequence[int], slots: Sequence[Sequence[Slot]]
    ) -> list[Candidate]:
        """Untried moves, swaps and splits off ``s`` that keep memory and TorchRec's
        rule, best proxy estimate first, only those the proxy expects to help."""
        used = [
            sum(self.mem(*self.key(sl)) for sl in row)
            + (self.fixed_mem[r] if r < len(self.fixed_mem) else 0)
            for r, row in enumerate(slots)
        ]
        out: list[Candidate] = []
        for a in self.heaviest(slots[s]):
            ka = self.key(a)
            halves = split_widths(ka[1])
            for d in targets:
                moves = [Move(a, s, d)] + [Move(a, s, d, b) for b in self.heaviest(slots[d])]
                moves += [Move(a, s, d, split=True)] if halves is not None else []
                for move in moves:
                    b = move.partner
                    kb = self.key(b) if b is not None else None
                    if kb == ka:
                        continue  # a shard for an equal one of the same table: no change
                    if move.split and halves is not None:
                        enters: Key | None = (ka[0], halves[0])
                        arrives = (ka[0], halves[1])
                    else:
                        enters, arrives = kb, ka
                    gain = self.mem(*arrives) - (self.mem(*kb) if kb is not None else 0)
                    loss = self.mem(*ka) - (self.mem(*enters) if enters is not None else 0)
                    if not (
                        self.fits(used[s] - loss, used[s]) and self.fits(used[d] + gain, used[d])
                    ):
                        continue
                    if (ka[0], d) in self.left or (kb is not None and (kb[0], s) in self.left):
                        continue
                    tables = [ka[0]] + ([kb[0]] if kb is not None else [])
                    if not equal_widths(apply_move(self.place, move), tables, [s, d]):
                        continue
                    src = [self.key(sl) for sl in slots[s] if sl != a]
                    dst = [self.key(sl) for sl in slots[d] if sl != b]
                    src += [enters] if enters is not None else []
                    cand = Candidate(move, src, [*dst, arrives], ka, enters, arrives)
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
        base = widths(rank_sets(self.place, self.world))
        out = []
        for cand, pair in zip(cands, pairs, strict=True):
            if pair is None:
                continue
            trial = list(self.timings)
            trial[cand.src], trial[cand.dst] = pair
            value = self.cost(trial, self.dims_after(cand, base))
            out.append(replace(cand, estimate=value))
        return out

    def predicted(self, cands: Sequence[Candidate]) -> list[tuple[Timing, Timing] | None]:
        """The model's relative changes in measured units. The source keeps its
        measured figure times the model's ratio new/old; what arrives at the destination
        costs its marginal share of the *source's* measured figure (the model's error on
        a table shows in the figure of the rank that holds it), and what a swap takes
        away costs its marginal share of the destination's."""
        assert self.predictor is not None
        rows = [[self.key(sl) for sl in row] for row in self.slots()]
        wanted: dict[tuple[Key, ...], int] = {}

        def ref(keys: Sequence[Key]) -> int:
            return wanted.setdefault(tuple(sorted(keys)), len(wanted))

        def without(keys: Sequence[Key], key: Key) -> list[Key]:
            out = list(keys)
            out.remove(key)
            return out

        plan: list[tuple[int, int, int, int, int, int | None]] = []
        for c in cands:
            src, dst = rows[c.src], rows[c.dst]
            rest = without(src, c.leaves)
            gone = ref(without(dst, c.enters)) if c.enters and not c.move.split else None
            plan.append(
                (ref(src), ref(c.src_keys), ref(rest), ref([*rest, c.arrives]), ref(dst), gone)
            )
        sets = list(wanted)
        price = self.predictor.compute(
            [[(self.specs[i], cols) for i, cols in keys] for keys in sets], self.bench.batch
        )
        out: list[tuple[Timing, Timing] | None] = []
        for c, (now_s, new_s, left, left_arr, now_d, gone) in zip(cands, plan, strict=True):
            ms = np.array([self.timings[c.src].fwd, self.timings[c.src].bwd])
            md = np.array([self.timings[c.dst].fwd, self.timings[c.dst].bwd])
            per_s = ms / np.maximum(price[now_s], 1e-12)
            est_s = price[new_s] * per_s
            est_d = md + (price[left_arr] - price[left]) * per_s
            if gone is not None:
                est_d -= (price[now_d] - price[gone]) * md / np.maximum(price[now_d], 1e-12)
            est_s, est_d = np.maximum(est_s, 0.0), np.maximum(est_d, 0.0)
            out.append(
                (Timing(float(est_s[0]), float(est_s[1])), Timing(float(est_d[0]), float(est_d[1])))
            )
        return out

    def from_singles(self, cands: Sequence[Candidate]) -> list[tuple[Timing, Timing] | None]:
        """Measured single-shard costs moved from one rank's figure to the other's;
        singles are measured on first need, the most lookups × columns first."""
        wanted: set[Key] = set()
        for c in cands:
            wanted.update(k for k in (c.leaves, c.enters, c.arrives) if k is not None)
        todo = sorted(wanted - set(self.singles), key=lambda k: -self.work(k))
        changed = self.changed()
        for key in todo[:MAX_SINGLES_PER_ROUND]:
            if self.late(max(t.wall for t in self.timings) / 2, changed):
                break
            self.singles[key] = self.bench.time([key])
        zero = Timing(0.0, 0.0)
        out: list[tuple[Timing, Timing] | None] = []
        for c in cands:
            a = self.singles.get(c.leaves)
            b = self.singles.get(c.enters) if c.enters is not None else zero
            got = self.singles.get(c.arrives)
            if a is None or b is None or got is None:
                out.append(None)
                continue
            lost = zero if c.move.split else b  # what the destination gives back
            ts, td = self.timings[c.src], self.timings[c.dst]
            out.append(
                (
                    Timing(max(0.0, ts.fwd - a.fwd + b.fwd), max(0.0, ts.bwd - a.bwd + b.bwd)),
                    Timing(
                        max(0.0, td.fwd + got.fwd - lost.fwd),
                        max(0.0, td.bwd + got.bwd - lost.bwd),
                    ),
                )
            )
        return out


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"

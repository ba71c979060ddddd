"""Measured refinement's own comparisons of whole plans: which start the moves begin
from (the plan given or an alternative, by per-rank medians of interleaved rounds) and
the closing fresh re-measurement of the start and final plans (a winner picked on
noisy timings looks better than it is). :mod:`.measured` runs both.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler.refine.placement import (
    KernelBench,
    Key,
    Placement,
    Timing,
    rank_sets,
    widths,
)

#: Repeats of the closing re-measurement of the start and final plans.
FRESH_REPEATS = 3
#: Repeats the closing re-measurement always makes, its deadline passed or not: both
#: orders of the two plans once.
FRESH_MIN_REPEATS = 2
#: The closing re-measurement re-times a rank both plans share only when the loop
#: measured it at this share of the straggler or more (else its loop figure stands
#: for both plans: it cannot set the max, and it is the same kernel in both).
FRESH_NEAR_MAX = 0.7
#: Rounds each start candidate is timed (per-rank medians decide the start): one round
#: per plan once picked a start whose lone round a burst of load had doubled.
START_ROUNDS = 3


def _best_start(
    plan: Plan,
    alternatives: Mapping[str, Plan],
    specs: Sequence[TableSpec],
    world: int,
    place: Placement,
    timings: list[Timing],
    bench: KernelBench,
    cost: Callable[[Sequence[Timing], Sequence[int]], float],
    say: Callable[[str], None],
    *,
    until: float = float("inf"),
    round_s: float = 0.0,
    tables: Sequence[TableSpec] = (),
) -> tuple[str | None, Placement, list[Timing]]:
    """The fastest of ``plan`` (its first round already timed) and each alternative:
    its name (None: ``plan`` itself), placement and per-rank median timings.

    One round per plan misled under load (an even plan once measured 24 ms against a
    lopsided start's 13 ms), so every candidate is timed :data:`START_ROUNDS` times,
    the later rounds interleaved rank by rank in a rotating order, and compared on
    per-rank medians. An alternative is timed only while its rounds and everyone's
    later rounds fit before ``until`` at ``round_s`` a round (said so when not); when
    not even one alternative fits that way, fewer rounds are used."""
    rounds = _start_rounds(until - time.perf_counter(), round_s)
    names: list[str | None] = [None]
    places: list[Placement] = [place]
    firsts: list[list[Timing]] = [timings]
    start_value = cost(timings, widths(rank_sets(place, world)))
    seen = {plan.hash}
    for name, alt in alternatives.items():
        if alt.hash in seen or alt.world_size != world or alt.problems(tables or specs):
            continue
        later = (rounds - 1) * (len(names) + 1) * round_s
        if rounds == 0 or time.perf_counter() + round_s + later > until:
            say(f"refine: {name}'s plan not timed: the budget is needed for the moves")
            continue
        seen.add(alt.hash)
        by_name = {t.name: t for t in alt.tables}
        alt_place = [list(by_name[t.name].shards) for t in specs]
        sets = rank_sets(alt_place, world)
        first = [bench.time(keys) for keys in sets]
        say(
            f"refine: {name}'s plan measured {_ms(cost(first, widths(sets)))} against "
            f"{_ms(start_value)} (round 1 of {rounds})"
        )
        names.append(name)
        places.append(alt_place)
        firsts.append(first)
    if len(names) == 1:
        return None, place, timings
    sets_of = [rank_sets(p, world) for p in places]
    medians, done = _interleaved(bench, sets_of, firsts, rounds, until, round_s)
    values = [cost(m, widths(s)) for m, s in zip(medians, sets_of, strict=True)]
    best = min(range(len(names)), key=values.__getitem__)
    listed = ", ".join(
        f"{n or 'the plan given'} {_ms(v)}" for n, v in zip(names, values, strict=True)
    )
    say(
        f"refine: per-rank medians of {done} round{'s' * (done > 1)}: {listed}; the "
        f"search starts from {names[best] or 'the plan given'}"
    )
    return names[best], places[best], medians[best]


def _start_rounds(left_s: float, round_s: float) -> int:
    """Rounds per start candidate: :data:`START_ROUNDS`, or fewer when even the plan
    given and one alternative cannot be timed that often in ``left_s`` (the plan's
    first round is done: ``2r - 1`` rounds remain); 0 when not even one round fits."""
    for rounds in range(START_ROUNDS, 0, -1):
        if (2 * rounds - 1) * round_s <= left_s:
            return rounds
    return 0


def _interleaved(
    bench: KernelBench,
    sets_of: Sequence[Sequence[Sequence[Key]]],
    firsts: Sequence[Sequence[Timing]],
    rounds: int,
    until: float,
    round_s: float,
) -> tuple[list[list[Timing]], int]:
    """Per-rank (fwd, bwd) medians of each candidate over its first round and up to
    ``rounds - 1`` more, each round rank by rank with the candidates' order rotated,
    so a burst of load falls on one candidate's rank once, not on a whole plan. A rank
    two candidates share is timed once a round for both. A round that would end past
    ``until`` (at the pace of the rounds so far; before any, ``round_s`` a candidate)
    is not started. Also returns how
    many rounds the medians are of."""
    got = [[[t] for t in first] for first in firsts]
    n = len(sets_of)
    began, done = time.perf_counter(), 1
    for rep in range(1, rounds):
        now = time.perf_counter()
        pace = (now - began) / (done - 1) if done > 1 else n * round_s
        if now + pace > until:
            break
        done += 1
        order = [(rep + k) % n for k in range(n)]
        for r in range(len(sets_of[0])):
            shared: dict[tuple[Key, ...], Timing] = {}
            for c in order:
                key = tuple(sorted(sets_of[c][r]))
                if key not in shared:
                    shared[key] = bench.time(sets_of[c][r])
                got[c][r].append(shared[key])
    return [[_median(ts) for ts in ranks] for ranks in got], done


def _median(timings: Sequence[Timing]) -> Timing:
    med = statistics.median
    return Timing(med([t.fwd for t in timings]), med([t.bwd for t in timings]))


def _fresh(
    bench: KernelBench,
    start: Sequence[Sequence[Key]],
    final: Sequence[Sequence[Key]],
    start_loop: Sequence[Timing],
    final_loop: Sequence[Timing],
    deadline: float = math.inf,
) -> tuple[list[Timing], list[Timing], int]:
    """Per-rank (fwd, bwd) medians of both plans over :data:`FRESH_REPEATS` repeats,
    interleaved rank by rank in alternating order, and how many repeats they are of.
    A rank the two plans share is timed once per repeat for both, or not at all when
    the loop measured it well below the straggler (:data:`FRESH_NEAR_MAX`): its loop
    figure stands for both. The search keeps this re-measurement's time free, but a
    host that slows down mid-run takes longer: after :data:`FRESH_MIN_REPEATS` (each
    order once), a repeat that would end past ``deadline`` at the pace so far is not
    started (beside two busy loops a 19.6-s refinement once ran 25.7 s)."""
    top = min(max(t.total for t in start_loop), max(t.total for t in final_loop))
    got: list[list[list[Timing]]] = [[[] for _ in start] for _ in range(2)]
    began, done = time.perf_counter(), 0
    for rep in range(FRESH_REPEATS):
        now = time.perf_counter()
        if done >= FRESH_MIN_REPEATS and now + (now - began) / done > deadline:
            break
        done += 1
        for r, pair in enumerate(zip(start, final, strict=True)):
            if sorted(pair[0]) == sorted(pair[1]):
                far = final_loop[r].total < FRESH_NEAR_MAX * top
                t = final_loop[r] if far else bench.time(pair[0])
                got[0][r].append(t)
                got[1][r].append(t)
                continue
            for which in (0, 1) if rep % 2 == 0 else (1, 0):
                got[which][r].append(bench.time(pair[which]))
    return [_median(ts) for ts in got[0]], [_median(ts) for ts in got[1]], done


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"

"""Measured refinement (docs/design.md §8, docs/refinement.md): improve a plan on the
machine that will run it by timing its kernels instead of trusting a model.

Every rank's fused kernel is timed for real (:func:`measure_compute`, at the job's
global batch, the allocator mitigation on). Then, within a time budget, the measured
straggler's shards are moved to, or swapped with shards on, the fastest ranks, and
only the two changed ranks are re-measured (:mod:`shardwise.profiler.refine.search`).
The objective is the evaluator's: max over ranks of measured fwd + bwd compute plus
the declared comm (``CommModel.one``).

A loop that keeps the best of many noisy timings believes its result better than it
is (selection bias), so it closes by re-measuring the start and the final plan fresh,
interleaved rank by rank, and returns the final plan only when it is better there.
``Plan.refinement`` records what was measured. Moves keep every rank within
``topology.usable_bytes`` (``planner.memory.shard_bytes``) and TorchRec's rule that the
shards of one table on one rank are equally wide.

Tables of the other kinds (row-wise, table-row-wise, grid, data-parallel) stay where
the plan put them: moving tables between kinds is not refinement's job. They are
still measured as the evaluator measures them: each rank's kernels of those kinds
(their row ranges, the local batch for data-parallel tables) are timed once and added
to that rank's fused kernel, their memory counts against the rank's cap, and their
collectives (``plan_kind_parts``) add to the declared comm.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from shardwise.basics import UserError, format_bytes
from shardwise.planner.comm.collectives import plan_kind_parts
from shardwise.planner.comm.hosts import comm_local_world
from shardwise.planner.comm.model import CommModel
from shardwise.planner.kinds import FUSED_GROUP, V1_KINDS
from shardwise.planner.memory import shard_bytes
from shardwise.planner.plan import Plan, Refinement
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import (
    ShardLoad,
    _device,
    _memory_limit,
    footprint_bytes,
    measure_compute,
)
from shardwise.profiler.refine.placement import (
    ITERS,
    WARMUPS,
    KernelBench,
    Key,
    Placement,
    Timing,
    objective,
    rank_sets,
    widths,
)
from shardwise.profiler.refine.search import Search

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

DEFAULT_BUDGET_S = 60.0
#: Repeats of the closing re-measurement of the start and final plans.
FRESH_REPEATS = 3
#: The closing re-measurement re-times a rank both plans share only when the loop
#: measured it at this share of the straggler or more (else its loop figure stands
#: for both plans: it cannot set the max, and it is the same kernel in both).
FRESH_NEAR_MAX = 0.7
#: :func:`measurable`'s probe kernel leaves out tables above this size (building a
#: kernel's weights dominates its timing on a CPU host; the build is scaled by bytes).
PROBE_MAX_BYTES = 512 * 2**20
COMPUTE_ONLY = "none: compute only"
#: Runners-up are timed only while this share of the budget is not spent: the moves
#: and the closing re-measurement need the rest.
ALTERNATIVES_SHARE = 0.5
#: Rounds each start candidate is timed (per-rank medians decide the start): one round
#: per plan once picked a start whose lone round a burst of load had doubled.
START_ROUNDS = 3


class RefinementSkipped(UserError):
    """This host cannot refine the plan by measurement; the message says why."""


def _memory_reason(
    loads: Sequence[Sequence[ShardLoad]], batch: int, local_batch: int, device: str
) -> str | None:
    limit, where = _memory_limit(_device(device))
    for r, rank_loads in enumerate(loads):
        need = footprint_bytes(rank_loads, batch, local_batch_size=local_batch)
        if need > limit:
            return (
                f"timing rank {r}'s kernel at global batch {batch} needs about "
                f"{format_bytes(need)}, more than half of {where}; refine on the machine "
                "that runs the job, or at a smaller batch"
            )
    return None


def measurable(
    tables: Sequence[TableSpec],
    batch_size_per_rank: int,
    world: int,
    device: str | None = None,
    *,
    plan: Plan | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
) -> str | None:
    """Why this host cannot refine by measurement at that batch, or None when it can.

    Memory: a rank's kernel at the global batch must fit in half of this host's memory
    (as the profiler requires): checked on ``plan``'s ranks when given, else on the
    average rank (some rank holds at least that much). Time: one measured round of
    all W ranks must fit in the budget, estimated from a probe kernel of every W-th
    table at the global batch (building scaled by bytes, calls by lookups × columns).
    """
    if not tables or world < 1 or batch_size_per_rank < 1:
        return "there are no tables, ranks or samples to measure"
    dev = str(_device(device))
    batch = batch_size_per_rank * world
    specs = list(tables)
    if plan is not None:
        from shardwise.profiler.evaluate import rank_shards

        why = _memory_reason(rank_shards(plan, specs), batch, batch_size_per_rank, dev)
        if why is not None:
            return why
    else:
        average = footprint_bytes([ShardLoad.whole(t) for t in specs], batch) // world
        limit, where = _memory_limit(_device(dev))
        if average > limit:
            return (
                f"timing one rank's kernel at global batch {batch} needs about "
                f"{format_bytes(average)} on average, more than half of {where}; refine on "
                "the machine that runs the job, or at a smaller batch"
            )
    round_s = _round_seconds(specs, world, batch, dev)
    if round_s > budget_s:
        return (
            f"one measured round of {world} kernels at global batch {batch} takes about "
            f"{round_s:.0f} s here, more than the {budget_s:g} s budget; give a larger "
            "budget or refine on the machine that runs the job"
        )
    return None


_ROUNDS: dict[tuple[object, ...], float] = {}


def _round_seconds(specs: Sequence[TableSpec], world: int, batch: int, device: str) -> float:
    """Estimated wall seconds to time all W ranks once, from one probe kernel (cached
    per process: the plan command checks, then refines)."""
    tables = tuple((t.name, t.rows, t.dim, t.dtype, t.pooling_factor) for t in specs)
    key = (tables, world, batch, device)
    if key in _ROUNDS:
        return _ROUNDS[key]
    probe = [t for t in specs[::world] if t.size_bytes <= PROBE_MAX_BYTES]
    probe = probe or [min(specs, key=lambda t: t.size_bytes)]
    shards = [ShardLoad.whole(t) for t in probe]
    # Twice: a process's first kernel pays for growing the heap; scaled by bytes, that
    # alone once estimated a round at 116 s where the whole refinement then took 57 s.
    measure_compute(shards, batch, warmups=0, iters=1, device=device)
    t0 = time.perf_counter()
    m = measure_compute(shards, batch, warmups=1, iters=1, device=device)
    build = max(0.0, time.perf_counter() - t0 - 2 * m.total_s)

    def work(ts: Sequence[TableSpec]) -> float:
        return sum(max(t.pooling_factor, 0.05) * t.dim for t in ts)

    byte_share = sum(t.size_bytes for t in specs) / max(1, sum(t.size_bytes for t in probe))
    call = m.total_s * work(specs) / max(work(probe), 1e-9)
    _ROUNDS[key] = build * byte_share + (WARMUPS + ITERS) * call
    return _ROUNDS[key]


def refine_measured(
    plan: Plan,
    tables: Sequence[TableSpec],
    *,
    comm: CommModel | None,
    predictor: CostPredictor | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    seed: int = 0,
    device: str | None = None,
    on_step: Callable[[str], None] | None = None,
    alternatives: Mapping[str, Plan] | None = None,
) -> Plan:
    """``plan`` refined by measurement on this host at its job's batch, with
    ``refinement`` filled (see the module docstring); the start plan, with the record,
    when the fresh re-measurement does not confirm the refined one. ``comm`` None
    prices compute only. ``budget_s`` bounds the whole run, the closing
    re-measurement included.

    ``alternatives`` (e.g. :attr:`NeuroShardPlanner.last_alternatives`: TorchRec's plan
    and the candidates within the model's error of ``plan``) are timed beside
    ``plan`` while half the budget is left, and the search starts from the fastest:
    the cost model ranks plans within its error, and measurement settles which start
    is best (per-rank medians of :data:`START_ROUNDS` interleaved rounds, so one burst
    of load does not decide it). The closing fresh re-measurement still compares the
    result with ``plan`` itself.

    Raises :class:`RefinementSkipped` when this host cannot measure the plan's kernels
    at the job's batch within the budget (:func:`measurable`), or when ``comm`` is a
    measured one (refinement needs a declared model of the all-to-all).
    """
    started = time.perf_counter()
    say = on_step or (lambda _line: None)
    if comm is not None and comm.kind == "measured":
        raise RefinementSkipped(
            "refinement skipped: it adds a declared comm model to the measured compute, "
            "and measured all-to-alls run only in the evaluator; give a preset, model or "
            "fitted:DIR comm."
        )
    plan.validate_plan(tables, source=f"plan {plan.hash[:8] or '(unhashed)'}")
    world, topo = plan.world_size, plan.topology
    per_rank = topo.batch_size_per_rank
    dev = str(_device(device))
    why = measurable(tables, per_rank, world, dev, plan=plan, budget_s=budget_s)
    if why is not None:
        raise RefinementSkipped(f"refinement skipped: {why}.")

    by_name = {t.name: t for t in tables}
    # Only table-wise and column-wise tables move; the others are a fixed part.
    movable = [t for t in plan.tables if t.kind in V1_KINDS]
    specs = [by_name[t.name] for t in movable]
    bench = KernelBench(specs, per_rank * world, seed, dev)
    fixed, fixed_mem, extra = _fixed_part(plan, tables, comm, seed, dev)
    local_world = comm_local_world(comm, topo) if comm is not None else None

    def full(timings: Sequence[Timing]) -> list[Timing]:
        return [t.plus(f) for t, f in zip(timings, fixed, strict=True)]

    def cost(timings: Sequence[Timing], dims: Sequence[int]) -> float:
        return objective(full(timings), dims, comm, per_rank, local_world=local_world, extra=extra)

    start_place = [list(t.shards) for t in movable]
    start_sets = rank_sets(start_place, world)
    # The first kernel of a process pays for growing the heap (the allocator then keeps
    # it): time the widest rank once and drop it, so the start is not charged for that.
    bench.time(max(start_sets, key=lambda keys: sum(c for _, c in keys)))
    round_started = time.perf_counter()
    start_timings = [bench.time(keys) for keys in start_sets]
    round_s = time.perf_counter() - round_started
    origin, place, timings = _best_start(
        plan,
        _same_fixed(plan, alternatives or {}, say),
        specs,
        world,
        start_place,
        start_timings,
        bench,
        cost,
        say,
        until=started + ALTERNATIVES_SHARE * budget_s,
        round_s=round_s,
        tables=tables,
    )
    search = Search(
        place=place,
        timings=list(timings),
        specs=specs,
        bench=bench,
        predictor=predictor,
        mem=lambda i, cols: shard_bytes(specs[i], cols, per_rank, world),
        cap=topo.usable_bytes,
        cost=cost,
        deadline=started + budget_s,
        say=say,
        fresh_repeats=FRESH_REPEATS,
        near_max=FRESH_NEAR_MAX,
        fixed_mem=fixed_mem,
    )
    kept = len(plan.tables) - len(movable)
    say(
        f"refine: start plan measured at global batch {bench.batch}: max compute "
        f"{_ms(max(t.total for t in full(start_timings)))}, objective {_ms(search.value)} "
        f"({bench.kernels} kernels, budget {budget_s:g} s"
        + (f"; {kept} row-wise or data-parallel tables kept where they are)" if kept else ")")
    )
    moves = search.run() if world > 1 and specs else 0

    believed = max(t.total for t in full(search.timings))
    start_fresh = start_timings
    final_fresh = start_timings
    final_sets = rank_sets(search.place, world)
    keep = False
    before = after = cost(start_timings, widths(start_sets))
    if moves or origin is not None:
        start_fresh, final_fresh = _fresh(
            bench, start_sets, final_sets, start_timings, search.timings
        )
        before = cost(start_fresh, widths(start_sets))
        after = cost(final_fresh, widths(final_sets))
        keep = after < before
        say(
            f"refine: fresh re-measurement ({FRESH_REPEATS} repeats, interleaved): start "
            f"{_ms(before)}, refined {_ms(after)} (the loop believed {_ms(search.value)}): "
            f"keeping the {'refined' if keep else 'start'} plan"
        )
    if keep:
        moved = dict(zip((t.name for t in movable), search.place, strict=True))
        out = Plan.from_shards(
            [by_name[t.name] for t in plan.tables],
            [moved.get(t.name, t.shards) for t in plan.tables],
            topo,
            plan.planner,
            kinds=[None if t.kind in V1_KINDS else t.kind for t in plan.tables],
        )
        if predictor is not None:
            priced = predictor.predict_plan(out, tables, per_rank)
            out = out.model_copy(update={"predicted": priced.predicted()})
        out.validate_plan(tables, source="the refined plan")
    else:
        out, final_fresh, moves, origin, after = plan, start_fresh, 0, None, before
    record = Refinement(
        device=bench.used_device,
        batch_size_per_rank=per_rank,
        start_hash=plan.hash,
        moves=moves,
        kernels_measured=bench.kernels,
        seconds=time.perf_counter() - started,
        comm=comm.describe() if comm is not None else COMPUTE_ONLY,
        start_max_compute_seconds=max(t.total for t in full(start_fresh)),
        final_max_compute_seconds=max(t.total for t in full(final_fresh)),
        believed_max_compute_seconds=believed,
        final_per_rank_compute_seconds=[t.total for t in full(final_fresh)],
        started_from=origin,
        start_objective_seconds=before,
        final_objective_seconds=after,
    )
    return out.model_copy(update={"refinement": record})


def _fixed_part(
    plan: Plan,
    tables: Sequence[TableSpec],
    comm: CommModel | None,
    seed: int,
    device: str,
) -> tuple[list[Timing], list[int], list[float]]:
    """The part of each rank refinement does not move: its kernels of the other kinds
    timed once as the evaluator times them, their memory under the plan's rule, and
    their collectives' fwd + bwd seconds under ``comm`` (none without one)."""
    from shardwise.profiler.evaluate import rank_shards

    world, per_rank = plan.world_size, plan.topology.batch_size_per_rank
    timings = []
    for loads in rank_shards(plan, tables):
        mine = [s for s in loads if s.group != FUSED_GROUP]
        if not mine:
            timings.append(Timing(0.0, 0.0))
            continue
        m = measure_compute(
            mine,
            per_rank * world,
            local_batch_size=per_rank,
            warmups=WARMUPS,
            iters=ITERS,
            seed=seed,
            device=device,
        )
        timings.append(Timing(m.fwd_s, m.bwd_s, m.cv))
    specs = {t.name: t for t in tables}
    mem = [0] * world
    for t in plan.tables:
        if t.kind in V1_KINDS:
            continue
        for s in t.shards:
            part = t.shard_memory(
                s, specs[t.name].pooling_factor, per_rank, world, plan.topology.local_world
            )
            mem[s.rank] += part.total
    extra = np.zeros(world)
    if comm is not None:
        for p in plan_kind_parts(plan, comm, per_rank):
            extra += p.fwd + p.bwd
    return timings, mem, extra.tolist()


def _same_fixed(
    plan: Plan, alternatives: Mapping[str, Plan], say: Callable[[str], None]
) -> dict[str, Plan]:
    """The alternatives that keep the plan's row-wise and data-parallel tables as they
    are (refinement times those once, for the plan given), and move only the others."""
    fixed = {t.name: t for t in plan.tables if t.kind not in V1_KINDS}
    out = {}
    for name, alt in alternatives.items():
        theirs = {t.name: t for t in alt.tables if t.kind not in V1_KINDS}
        if theirs.keys() == fixed.keys() and all(
            theirs[n].kind == fixed[n].kind and theirs[n].shards == fixed[n].shards for n in fixed
        ):
            out[name] = alt
        else:
            say(f"refine: {name}'s plan not timed: it places the row-wise or DP tables apart")
    return out


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
) -> tuple[list[Timing], list[Timing]]:
    """Per-rank (fwd, bwd) medians of both plans over :data:`FRESH_REPEATS` repeats,
    interleaved rank by rank in alternating order. A rank the two plans share is timed
    once per repeat for both, or not at all when the loop measured it well below the
    straggler (:data:`FRESH_NEAR_MAX`): its loop figure stands for both."""
    top = min(max(t.total for t in start_loop), max(t.total for t in final_loop))
    got: list[list[list[Timing]]] = [[[] for _ in start] for _ in range(2)]
    for rep in range(FRESH_REPEATS):
        for r, pair in enumerate(zip(start, final, strict=True)):
            if sorted(pair[0]) == sorted(pair[1]):
                far = final_loop[r].total < FRESH_NEAR_MAX * top
                t = final_loop[r] if far else bench.time(pair[0])
                got[0][r].append(t)
                got[1][r].append(t)
                continue
            for which in (0, 1) if rep % 2 == 0 else (1, 0):
                got[which][r].append(bench.time(pair[which]))
    return [_median(ts) for ts in got[0]], [_median(ts) for ts in got[1]]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"

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
the plan put them during the moves. They are still measured as the evaluator measures
them: each rank's kernels of those kinds (their row ranges, the local batch for
data-parallel tables) are timed once and added to that rank's fused kernel, their
memory counts against the rank's cap, and their collectives (``plan_kind_parts``) add
to the declared comm.

With ``kinds=True``, measured kind moves (:mod:`shardwise.profiler.refine.kindmove`)
come first, within :data:`KIND_SHARE` of the budget: runners-up that place the
row-wise and data-parallel tables apart, each as a whole plan, then the straggler's hot
table cut row-wise, a row-wise table made whole, each judged on all W ranks beside the
plan as it is, kept beyond the noise and recorded in ``Refinement.kind_changes``; the
moves then start from the plan they leave.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
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
    Timing,
    objective,
    rank_sets,
    widths,
)
from shardwise.profiler.refine.search import Search
from shardwise.profiler.refine.starts import (
    FRESH_NEAR_MAX,
    FRESH_REPEATS,
    _best_start,
    _fresh,
)

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

DEFAULT_BUDGET_S = 60.0
#: :func:`measurable`'s probe kernel leaves out tables above this size (building a
#: kernel's weights dominates its timing on a CPU host; the build is scaled by bytes).
PROBE_MAX_BYTES = 512 * 2**20
COMPUTE_ONLY = "none: compute only"
#: Runners-up are timed only while this share of the budget is not spent: the moves
#: and the closing re-measurement need the rest.
ALTERNATIVES_SHARE = 0.5
#: Share of the budget the kind moves may spend (the shard moves need the rest).
KIND_SHARE = 0.4


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
    kinds: bool = False,
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

    ``kinds``: first try measured kind moves (the module docstring says how); the
    record's start figures are then the given plan's, timed beside the first of them.

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

    given = plan
    phase = None
    judged: set[str] = set()
    if kinds and world > 1:
        from shardwise.profiler.refine.kindmove import kind_phase

        lw = comm_local_world(comm, topo) if comm is not None else None
        apart = cheapest_first(
            {n: a for n, a in (alternatives or {}).items() if not _fixed_alike(plan, a)}
        )
        judged = set(apart)
        phase = kind_phase(
            plan, tables, comm=comm, local_world=lw, seed=seed, device=dev,
            until=started + KIND_SHARE * budget_s, say=say, runners_up=apart,
        )  # fmt: skip
        plan = phase.plan
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
        _same_fixed(plan, alternatives or {}, say, judged),
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
        start_fresh, final_fresh, repeats = _fresh(
            bench, start_sets, final_sets, start_timings, search.timings, started + budget_s
        )
        before = cost(start_fresh, widths(start_sets))
        after = cost(final_fresh, widths(final_sets))
        keep = after < before
        say(
            f"refine: fresh re-measurement ({_repeats(repeats)}, interleaved): start "
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
        start_hash=given.hash,
        moves=moves,
        kernels_measured=bench.kernels + (phase.kernels if phase is not None else 0),
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
    if phase is not None and phase.changes:  # the given plan's figures, not the moves' start
        if out.predicted is None and predictor is not None:
            out = out.model_copy(
                update={"predicted": predictor.predict_plan(out, tables, per_rank).predicted()}
            )
        record = record.model_copy(
            update={
                "kind_changes": phase.changes,
                "start_max_compute_seconds": max(t.total for t in phase.start_timings),
                "start_objective_seconds": phase.start_value,
            }
        )
    return out.model_copy(update={"refinement": record})


def _repeats(done: int) -> str:
    """How many repeats the closing re-measurement made, and why fewer than planned."""
    if done >= FRESH_REPEATS:
        return f"{done} repeats"
    return f"{done} of {FRESH_REPEATS} repeats: the budget was spent"


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
        timings.append(Timing(m.fwd_s, m.bwd_s, m.robust_cv))
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


def cheapest_first(alternatives: Mapping[str, Plan]) -> dict[str, Plan]:
    """The alternatives by their predicted maximum, unpriced ones last: the kind phase
    times each runner-up whole while its budget lasts, so the toss-ups come before a
    plan the model prices far worse (TorchRec's, handed on in case the model is wrong)."""

    def key(item: tuple[str, Plan]) -> float:
        p = item[1].predicted
        return p.max_seconds if p is not None else float("inf")

    return dict(sorted(alternatives.items(), key=key))


def _fixed_alike(plan: Plan, alt: Plan) -> bool:
    """Whether ``alt`` keeps ``plan``'s row-wise and data-parallel tables as they are."""
    fixed = {t.name: t for t in plan.tables if t.kind not in V1_KINDS}
    theirs = {t.name: t for t in alt.tables if t.kind not in V1_KINDS}
    return theirs.keys() == fixed.keys() and all(
        theirs[n].kind == fixed[n].kind and theirs[n].shards == fixed[n].shards for n in fixed
    )


def _same_fixed(
    plan: Plan,
    alternatives: Mapping[str, Plan],
    say: Callable[[str], None],
    judged: AbstractSet[str] = frozenset(),
) -> dict[str, Plan]:
    """The alternatives that keep the plan's row-wise and data-parallel tables as they
    are (refinement times those once, for the plan given), and move only the others.
    ``judged``: runners-up the kind phase already timed whole (not said again)."""
    out = {}
    for name, alt in alternatives.items():
        if _fixed_alike(plan, alt):
            out[name] = alt
        elif name not in judged:
            say(
                f"refine: {name}'s plan not timed: it places the row-wise or DP tables apart "
                "(refinement with kinds times such plans whole)"
            )
    return out


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"

"""Re-planning a running job from its live measurements: the planner's side of the loop.

The workers' live summary (:mod:`shardwise.planner.live.summary`) says what each rank's
fused kernels cost per iteration (forward + backward compute) and, from the bounded
probe, what each of its shards costs. :func:`replan` prices every shard from those
figures, keeps the plan's column splits, and moves whole shards between ranks to lower
the predicted max-rank compute, under the same memory rule as every planner.

**Pricing** is :mod:`shardwise.planner.live.prices`'s: every shard in the live
summary's milliseconds, the rank's fixed part fitted apart.

**Kinds.** Only table-wise and column-wise shards move. A row-wise, table-row-wise,
grid or data-parallel table stays where it is (moving a row range changes the cut
TorchRec runs), but its shards are priced like any other, so the ranks that hold them
carry their cost and their memory, and the movable shards balance around them. Given
the model's slice/whole ratios (a calibrated rank head's anchors or a cost model),
:mod:`.kinds` also tries turning the straggler's hot table-wise tables row-wise and
row-wise tables table-wise, chosen only when that beats every placement without a
kind change at the worst plausible price.

**Search.** Candidates, all moving whole shards (a column shard stays as cut): the plan
as it runs; best-improvement moves and swaps off the predicted max rank from it; a fresh
longest-processing-time greedy (costliest shard first onto the least loaded rank with
room), its ranks relabelled to keep the most bytes where they are, then the same moves
and swaps; and the shortest prefix of the first search's steps within 1 % of the best
candidate. A move never puts two shards of one table on one rank (TorchRec requires
equal widths there, and it would pay two kernels' lookups for one table). The lowest
predicted max wins; among those within 1 % of it, the fewest moved shards, since each
moved shard costs resharding bytes. The job's compute is judged, not its comm: a rank's
measured comm includes its wait for the straggler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from shardwise.planner.costmodel.rankhead import RankHead
from shardwise.planner.kinds import V1_KINDS
from shardwise.planner.live.headprior import head_prior
from shardwise.planner.live.inputs import check_inputs
from shardwise.planner.live.kinds import (
    KindChange,
    RatioFn,
    declined,
    kind_changes,
    kind_plan,
    model_ratios,
)
from shardwise.planner.live.prices import price_shards
from shardwise.planner.live.result import LIVE_SUFFIX, NEAR_TIE, LiveReplan, Move
from shardwise.planner.live.search import Search, State, out_var, residual_shares
from shardwise.planner.live.summary import LiveSummary, RankPoint
from shardwise.planner.plan import Plan, Predicted, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

if TYPE_CHECKING:
    from shardwise.planner.costmodel.predictor import CostPredictor

__all__ = ["LIVE_SUFFIX", "NEAR_TIE", "LiveReplan", "Move", "replan"]


def replan(
    plan: Plan,
    tables: Sequence[TableSpec],
    topology: Topology,
    live: LiveSummary,
    *,
    max_moves: int | None = None,
    history: Sequence[RankPoint] = (),
    head: RankHead | None = None,
    predictor: CostPredictor | None = None,
    ratios: RatioFn | None = None,
) -> LiveReplan:
    """Re-place ``plan``'s shards on ``topology`` by the live costs in ``live`` (the
    module's docstring says how), moving at most ``max_moves`` shards. ``history``:
    measured ranks of other plans this job ran (a reshard that did not deliver);
    ``head``: a calibrated model's rank head, for what it knows of a rank's fixed part
    and of what a table's row ranges cost against it whole; ``predictor``: a cost
    model pricing those ranges where the head did not measure them; ``ratios``: the
    ranges' ratios given directly (:class:`~.kinds.SliceRatio`), instead of either.
    Without any of the three, no table changes its kind.

    Memory is the planner's rule (:mod:`shardwise.planner.memory`) at the larger of the
    plan's batch and the batch the job trains at (``live.batch_size_per_rank``), so both
    the plan's validation and the workers' check pass; a rank the running plan already
    fills beyond ``topology`` is never filled further. Pure and fast (well under a
    second for 1,000 tables on 8 ranks). Inputs that do not belong together (a summary
    of another plan or world size, tables not the plan's, ranks not yet measured) are a
    :class:`LiveInputError`.
    """
    t0 = time.perf_counter()
    check_inputs(plan, tables, topology, live)
    priors = []
    if head is not None:
        prior, _ = head_prior(head, plan, tables, live)
        if prior is not None:
            priors.append(prior)
    prices = price_shards(plan, tables, live, history=history, priors=priors)
    specs = {t.name: t for t in tables}
    world = plan.world_size
    batch = max(topology.batch_size_per_rank, live.batch_size_per_rank)
    local = topology.local_world
    slots = [(ti, s) for ti, t in enumerate(plan.tables) for s in t.shards]
    keys = [(plan.tables[ti].name, s.rank, s.row_offset, s.col_offset) for ti, s in slots]
    mems = [
        t.shard_memory(s, specs[t.name].pooling_factor, batch, world, local)
        for t, s in ((plan.tables[ti], s) for ti, s in slots)
    ]
    fit = prices.fit
    current = [0.0] * world
    for r in live.measured():
        current[r.rank] = r.compute_ms
    scenarios = np.array(
        [(p.overhead, p.share, p.factor) for p in fit.scenarios()], dtype=np.float64
    )
    search = Search(
        marg=np.array([prices.marginal[k] for k in keys], dtype=np.float64),
        var=np.array([prices.spread[k] ** 2 for k in keys], dtype=np.float64),
        var_out=np.array([out_var(prices, k) for k in keys], dtype=np.float64),
        mem=np.array([m.total for m in mems], dtype=np.int64),
        table=np.array([ti for ti, _ in slots], dtype=np.int64),
        start=np.array([s.rank for _, s in slots], dtype=np.int64),
        cap=topology.usable_bytes,
        world=world,
        n_tables=len(plan.tables),
        max_moves=max_moves,
        movable=np.array([plan.tables[ti].kind in V1_KINDS for ti, _ in slots], dtype=bool),
        params=scenarios,
        unit=np.array(
            [int(s.row_count(plan.tables[ti].rows) > 0) for ti, s in slots], dtype=np.int64
        ),
        delta=np.zeros((len(scenarios), len(slots)), dtype=np.float64),
    )
    search.delta = residual_shares(search, scenarios, np.array(current, dtype=np.float64))
    now = search.state(search.start)
    chosen = _placement(search, now, fit.checked, max_moves)

    def ranks_ms(s: Search, st: State) -> list[float]:
        """A placement's priced compute per rank by the best fit, anchored on the
        measured ranks (their residuals under the best fit, moved with their shards)."""
        priced = fit.best.rank_ms(st.cnt > 0, st.cnt, st.probe) + st.extra[0]
        return [float(x) for x in priced]

    current_max = max(current)
    predicted_max = max(ranks_ms(search, chosen))
    gain = current_max / predicted_max - 1 if predicted_max > 0 else 0.0
    if search.moved(chosen) == 0 or gain <= 0:
        chosen, gain = now, 0.0
    # Kind changes, each judged against the best placement without one.
    ratio_fn = ratios or model_ratios(topology, batch * world, head=head, predictor=predictor)
    change: KindChange | None = None
    notes: list[str] = []
    if ratio_fn is not None and world > 1:
        without = float(search.loads(chosen).max())
        tried, notes = kind_changes(
            search, slots, plan, tables, topology, batch, ratio_fn, chosen.rank,
            without * (1 - NEAR_TIE),
        )  # fmt: skip
        tried.sort(key=lambda c: (c.risk_max, c.moved()))
        for c in tried:
            c_max = max(ranks_ms(c.search, c.state))
            c_gain = current_max / c_max - 1 if c_max > 0 else 0.0
            if change is None and c.risk_max < without * (1 - NEAR_TIE) and c_gain > 0:
                change = c
            else:
                notes.append(declined(c, without, ranks_ms(c.search, c.state)))
    run, st = (search, chosen) if change is None else (change.search, change.state)
    predicted = ranks_ms(run, st)
    gain = current_max / max(predicted) - 1 if change is not None else gain
    risk = [float(x) for x in run.loads(st)]
    risk_max = max(risk)
    risk_gain = current_max / risk_max - 1 if risk_max > 0 and st is not now else 0.0
    live_slots = slots if change is None else change.slots
    moves = [
        Move(plan.tables[ti].name, s.col_offset, s.rank, int(r))
        for k, ((ti, s), r) in enumerate(zip(live_slots, st.rank, strict=True))
        if k < len(slots) and int(r) != s.rank
    ]
    moved_bytes = sum(
        m.weights + m.optimizer
        for m, r, r0 in zip(mems, st.rank[: len(slots)], search.start, strict=True)
        if r != r0
    )
    per_rank_s = [ms / 1e3 for ms in predicted]
    specs_in_order = [specs[t.name] for t in plan.tables]
    name = plan.planner if plan.planner.endswith(LIVE_SUFFIX) else plan.planner + LIVE_SUFFIX
    if change is not None:
        moved_bytes += change.table_bytes
        kinds = [t.kind for t in plan.tables]
        kinds[change.table] = change.option.kind
        new = Plan.from_shards(
            specs_in_order, kind_plan(change, plan), topology, name, per_rank_s, kinds=kinds
        )
    elif not moves:  # the plan that runs, as it is (same topology, same hash)
        new = plan.model_copy(update={"predicted": Predicted.from_costs(per_rank_s)})
    else:
        placed: list[list[Shard]] = [[] for _ in plan.tables]
        for (ti, s), r in zip(slots, st.rank, strict=True):
            placed[ti].append(s.model_copy(update={"rank": int(r)}))
        kinds = [t.kind for t in plan.tables]
        new = Plan.from_shards(specs_in_order, placed, topology, name, per_rank_s, kinds=kinds)
    return LiveReplan(
        plan=new,
        current_rank_ms=current,
        priced_rank_ms=[float(x) for x in fit.best.rank_ms(now.cnt > 0, now.cnt, now.probe)],
        predicted_rank_ms=predicted,
        current_max_ms=current_max,
        predicted_max_ms=float(max(predicted)),
        gain=gain,
        moves=moves,
        moved_bytes=moved_bytes,
        estimated_shards=prices.estimated,
        seconds=time.perf_counter() - t0,
        fit=fit,
        risk_rank_ms=risk,
        risk_max_ms=risk_max,
        risk_gain=risk_gain,
        kind_changes=[] if change is None else [change.says],
        kind_notes=notes,
    )


def _placement(search: Search, now: State, checked: bool, max_moves: int | None) -> State:
    """The best placement without a kind change (the module docstring's candidates):
    the lowest worst-plausible max, the fewest moved shards among those within the tie."""
    improved, maxima = search.improve(now.copy())
    candidates = [now, improved]
    if not checked:  # swaps alone keep every rank's shard count: no doubt on the share
        candidates.append(search.improve(now.copy(), swaps_only=True)[0])
    fresh = search.greedy()
    if fresh is not None:
        candidates += [fresh, search.improve(fresh.copy())[0]]
    if max_moves is not None:
        candidates = [c for c in candidates if search.moved(c) <= max_moves]
    low = min(float(search.loads(c).max()) for c in candidates)
    # The first steps from the running plan that come within the tie of the best: the
    # same gain, give or take 1 %, for fewer moved shards.
    enough = next((k for k, m in enumerate(maxima) if m <= low * (1 + NEAR_TIE)), None)
    if enough is not None and enough + 1 < len(maxima):
        candidates.append(search.improve(now.copy(), steps=enough + 1)[0])
    return min(
        (c for c in candidates if float(search.loads(c).max()) <= low * (1 + NEAR_TIE)),
        key=lambda c: (search.moved(c), float(search.loads(c).max())),
    )

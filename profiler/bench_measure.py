"""The evaluator's measurement of several plans at once, side by side (design §6, §9).

This host's speed drifts by ±25 % over minutes, so plans measured one after the other
are not comparable. Here every repeat measures every plan once, in a rotating order
(and the balance bound's single tables with them), so drift hits all plans alike.
Each plan's cost is exactly what :func:`shardwise.profiler.evaluate.evaluate_plan`
measures (the same functions: each rank's fused kernel at the global batch, then the
all-to-all with each rank's forward as its delay; per-rank medians; the max over
ranks) and comes back as the evaluator's :class:`Evaluation`; a test pins the two
equal. What differs is only the scheduling: the all-to-alls of every plan and repeat
run in one launch of the W worker processes (starting 8 workers costs ~10 s here,
more than the collectives), in the same rotating order.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shardwise.planner.errors import UserError
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler.comm import CommCase, measure_comm_many, rank_dims
from shardwise.profiler.compute import ShardLoad, measure_compute
from shardwise.profiler.evaluate import Evaluation, aggregate, rank_shards

Step = Callable[[str], None]


@dataclass
class SingleShardCosts:
    """Measured (fwd, bwd) seconds of one shard alone, memoized: the measurements
    ``torchrec-measured`` plans with (the planner's ``measure`` callable)."""

    seed: int = 0
    device: str | None = None
    seconds: float = 0.0  # spent measuring
    calls: int = 0  # measurements actually taken (memo misses)
    _memo: dict[tuple[TableSpec, int, int], tuple[float, float]] = field(default_factory=dict)

    def __call__(self, spec: TableSpec, cols: int, global_batch: int) -> tuple[float, float]:
        key = (spec, cols, global_batch)
        if key not in self._memo:
            start = time.perf_counter()
            r = measure_compute(
                [ShardLoad(spec, cols)], global_batch, seed=self.seed, device=self.device
            )
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self._memo[key] = (r.fwd_s, r.bwd_s)
        return self._memo[key]


@dataclass(frozen=True)
class SideBySide:
    """One evaluation per plan (``None`` where it could not be measured, with why),
    and the balance bound: sum of single-table compute ÷ W, per repeat."""

    evaluations: list[Evaluation | None]
    errors: list[str | None]
    bound_per_repeat: list[float]
    #: The costliest single table alone, per repeat: no table-wise plan can beat it.
    heaviest_per_repeat: list[float] = field(default_factory=list)

    @property
    def heaviest_s(self) -> float:
        xs = self.heaviest_per_repeat
        return statistics.median(xs) if xs else 0.0

    @property
    def bound_s(self) -> float:
        return statistics.median(self.bound_per_repeat) if self.bound_per_repeat else 0.0

    @property
    def bound_cv(self) -> float:
        xs = self.bound_per_repeat
        if len(xs) < 2 or statistics.fmean(xs) == 0:
            return 0.0
        return statistics.stdev(xs) / statistics.fmean(xs)


_BOUND = -1  # the balance bound's entry in the rotation


def evaluate_side_by_side(
    plans: Sequence[Plan],
    tables: Sequence[TableSpec],
    *,
    batch_size_per_rank: int,
    repeats: int,
    seed: int = 0,
    device: str | None = None,
    bound: bool = True,
    on_step: Step | None = None,
) -> SideBySide:
    """Measure every plan ``repeats`` times, interleaved; see the module docstring.

    The balance bound measures each table whole and alone at the global batch
    (compute only, fwd + bwd medians) and divides the sum by W.
    """
    if not plans:
        raise UserError("nothing to evaluate: no plan was given.")
    worlds = {p.world_size for p in plans}
    if len(worlds) != 1 or batch_size_per_rank < 1 or repeats < 1:
        raise UserError(
            f"side-by-side plans need one world size (got {sorted(worlds)}), a batch and "
            "repeats of at least 1."
        )
    world = worlds.pop()
    global_batch = batch_size_per_rank * world
    shards = [rank_shards(p, tables) for p in plans]
    errors: list[str | None] = [None] * len(plans)
    computes: list[list[list[tuple[float, float]]]] = [[] for _ in plans]  # [plan][rep][rank]
    bounds: list[float] = []
    heaviest: list[float] = []
    mitigated = [True] * len(plans)
    used_device = [device or "cpu"] * len(plans)
    entries = list(range(len(plans))) + ([_BOUND] if bound else [])
    for rep in range(repeats):
        k = rep % len(entries)
        for entry in entries[k:] + entries[:k]:
            if entry == _BOUND:
                if on_step:
                    on_step(f"repeat {rep + 1}/{repeats}: balance bound, {len(tables)} tables")
                singles = _single_tables(tables, global_batch, seed, device)
                bounds.append(sum(singles) / world)
                heaviest.append(max(singles))
                continue
            if errors[entry] is not None:
                continue
            if on_step:
                on_step(f"repeat {rep + 1}/{repeats}: {plans[entry].planner}")
            row = []
            try:
                for rank_loads in shards[entry]:
                    m = measure_compute(rank_loads, global_batch, seed=seed, device=device)
                    mitigated[entry] = mitigated[entry] and (
                        m.allocator_mitigated or not rank_loads
                    )
                    used_device[entry] = m.device
                    row.append((m.fwd_s, m.bwd_s))
            except UserError as err:  # e.g. a rank too big for this host's memory
                errors[entry] = str(err)
                continue
            computes[entry].append(row)
    comms = _all_to_alls(plans, computes, errors, repeats, batch_size_per_rank, world, on_step)
    evaluations: list[Evaluation | None] = []
    for i, plan in enumerate(plans):
        if errors[i] is not None:
            evaluations.append(None)
            continue
        evaluations.append(
            aggregate(
                plan,
                computes[i],
                comms[i],
                batch_size_per_rank=batch_size_per_rank,
                device=used_device[i],
                mitigated=mitigated[i],
            )
        )
    return SideBySide(evaluations, errors, bounds, heaviest)


def _single_tables(
    tables: Sequence[TableSpec], global_batch: int, seed: int, device: str | None
) -> list[float]:
    """Each table's compute (fwd + bwd medians) whole and alone at the global batch."""
    out = []
    for t in tables:
        m = measure_compute([ShardLoad.whole(t)], global_batch, seed=seed, device=device)
        out.append(m.fwd_s + m.bwd_s)
    return out


def _all_to_alls(
    plans: Sequence[Plan],
    computes: Sequence[Sequence[Sequence[tuple[float, float]]]],
    errors: Sequence[str | None],
    repeats: int,
    batch_size_per_rank: int,
    world: int,
    on_step: Step | None,
) -> list[list[list[tuple[float, float]]]]:
    """[plan][rep][rank] -> (fwd, bwd) all-to-all seconds, one launch for all cases."""
    out: list[list[list[tuple[float, float]]]] = [
        [[(0.0, 0.0)] * world for _ in range(repeats)] for _ in plans
    ]
    live = [i for i in range(len(plans)) if errors[i] is None]
    if world < 2 or not live:
        return out
    order: list[tuple[int, int]] = []  # (plan, rep), rotating like the compute
    for rep in range(repeats):
        k = rep % len(live)
        order.extend((i, rep) for i in live[k:] + live[:k])
    cases = [
        CommCase(dims=rank_dims(plans[i]), delays=[f for f, _ in computes[i][rep]])
        for i, rep in order
    ]
    if on_step:
        on_step(f"all-to-all across {world} processes: {len(cases)} cases")
    for (i, rep), result in zip(order, measure_comm_many(cases, batch_size_per_rank), strict=True):
        out[i][rep] = list(zip(result.fwd_s, result.bwd_s, strict=True))
    return out

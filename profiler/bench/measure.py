"""What the benchmark measures besides planning: single shards for
``torchrec-measured`` (memoized), and every plan of a task side by side through the
evaluator (:func:`shardwise.profiler.evaluate.evaluate_side_by_side`), with the
task's comm."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler.bench.results import PlannerResult
from shardwise.profiler.bench.stats import balance, cv
from shardwise.profiler.compute import ShardLoad, measure_compute
from shardwise.profiler.evaluate import SideBySide, evaluate_side_by_side

if TYPE_CHECKING:
    from shardwise.planner.comm.model import CommModel


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


def measure_plans(
    plans: dict[str, Plan],
    outcomes: dict[str, PlannerResult],
    tables: list[TableSpec],
    *,
    batch_size_per_rank: int,
    repeats: int,
    comm: CommModel,
    seed: int,
    device: str | None,
    on_step: Callable[[str], None],
) -> SideBySide | None:
    """Measure the plans side by side and fill in ``outcomes``; rows that found the
    same placement share one measurement. None when no row produced a plan."""
    unique = list({p.hash: p for p in plans.values()}.values())
    if not unique:
        return None
    measured = evaluate_side_by_side(
        unique,
        tables,
        batch_size_per_rank=batch_size_per_rank,
        repeats=repeats,
        seed=seed,
        device=device,
        comm=comm,
        on_step=on_step,
    )
    by_hash = {p.hash: i for i, p in enumerate(unique)}
    for name, plan in plans.items():
        i = by_hash[plan.hash]
        ev, why = measured.evaluations[i], measured.errors[i]
        if ev is None:
            outcomes[name] = replace(outcomes[name], status="measure-failed", error=why)
            continue
        compute = [r.fwd_compute_s + r.bwd_compute_s for r in ev.ranks]
        outcomes[name] = replace(
            outcomes[name],
            max_s=ev.max_s,
            compute_max_s=max(compute),
            compute_per_rank=compute,
            max_per_repeat=list(ev.max_per_repeat),
            repeat_cv=ev.repeat_cv,
            compute_max_per_repeat=list(ev.max_compute_per_repeat),
            compute_repeat_cv=cv(ev.max_compute_per_repeat),
            compute_per_repeat=[list(rep) for rep in ev.compute_per_repeat],
            device=ev.device,
            ranks=[{**asdict(r), "total_s": r.total_s} for r in ev.ranks],
        )
    return measured


def balance_of(result: PlannerResult) -> float | None:
    """Mean over max of the row's measured per-rank compute."""
    return balance(result.compute_per_rank) if result.ok else None

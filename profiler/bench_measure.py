"""Single-shard measurements for ``torchrec-measured`` (docs/design.md §9), memoized.

The side-by-side measurement of every plan of a task is the evaluator's own
(:func:`shardwise.profiler.evaluate.evaluate_side_by_side`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad, measure_compute


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

"""TorchRec's planner fed our measured costs (docs/design.md §9's "TorchRec with measured costs").

The same ``EmbeddingShardingPlanner`` as :class:`TorchRecPlanner` (same constraints,
memory, proposer and partitioner), but each shard's compute is priced by a custom
TorchRec ``ShardEstimator`` from *measured* single-shard costs instead of TorchRec's
analytic GPU model. It answers "is a better search worth more than better costs?":
the gap between ``torchrec`` and ``torchrec-measured`` is what measured costs buy
TorchRec's search; the gap to NeuroShard is what the search and a learnt,
non-additive model buy on top.

- **Compute.** ``fwd_compute``/``bwd_compute`` of every shard = the measured forward
  and backward of that shard alone (``cols`` of its table) at the global batch
  (``batch_size_per_rank × world_size``: every rank looks its tables up for every
  sample, as the evaluator measures it). TorchRec adds shard costs per rank, so this
  is the additive model the issue asks for (a fused kernel is not additive, docs/design.md §6).
- **Communication.** TorchRec's own estimate is kept (its estimator runs first, then
  the compute fields are replaced): we have no per-shard all-to-all measurement, and
  the all-to-all depends on the whole rank, not one shard. It is priced for GPU links,
  so next to CPU-measured compute it is tiny and the search effectively balances
  measured compute.
- **Measurements** come from a callable ``measure(spec, cols, global_batch) ->
  (fwd_s, bwd_s)`` the caller injects (the benchmark passes one backed by
  ``shardwise.profiler.compute.measure_compute``, memoized), because the planner must
  not import the profiler (the dependency runs profiler → planner). Without one the
  planner refuses to plan.

It needs the ``TorchRecPlanner._estimators`` hook (TorchRec's enumerator with our
estimators); a planner module without it is refused loudly, never silently planned
as TorchRec as shipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardwise.basics import UserError
from shardwise.planner.base import PlannerOptions
from shardwise.planner.baselines.torchrec import GREEDY_THRESHOLD, TorchRecPlanner
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

#: ``measure(spec, cols, global_batch) -> (fwd_seconds, bwd_seconds)`` of one shard
#: of ``cols`` columns of ``spec``, alone in a fused kernel, at ``global_batch``.
MeasureFn = Callable[[TableSpec, int, int], tuple[float, float]]


class TorchRecMeasuredPlanner(TorchRecPlanner):
    """TorchRec's search with measured per-shard compute costs."""

    name = "torchrec-measured"
    summary = (
        "TorchRec's planner with a custom ShardEstimator: measured single-shard "
        "fwd/bwd compute (TorchRec's comm estimate kept); needs measurements"
    )

    def __init__(
        self,
        options: PlannerOptions | None = None,
        *,
        measure: MeasureFn | None = None,
        threshold: int | None = GREEDY_THRESHOLD,
        min_partition: int | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(options, threshold=threshold, min_partition=min_partition, verbose=verbose)
        #: Set by the caller (the benchmark sets it after the registry builds the planner).
        self.measure = measure
        #: (table, cols, global batch) of every measurement asked for in the last plan.
        self.measured: list[tuple[str, int, int]] = []

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        if self.measure is None:
            raise UserError(
                "the torchrec-measured planner prices shards with measured costs and was "
                "given no measurements. Run it through `shardwise bench` (which measures "
                "each table with the compute benchmark), or construct "
                "TorchRecMeasuredPlanner(measure=...) with a callable "
                "(spec, cols, global_batch) -> (fwd_s, bwd_s)."
            )
        self.measured = []
        return super().plan(tables, topology)

    def _estimators(
        self,
        specs: dict[str, TableSpec],
        topology: Topology,
        torchrec_topology: Any,
        constraints: dict[str, Any],
    ) -> list[Any] | None:
        assert self.measure is not None  # checked in plan()
        measure = self.measure
        log = self.measured

        def recorded(spec: TableSpec, cols: int, batch: int) -> tuple[float, float]:
            log.append((spec.name, cols, batch))
            return measure(spec, cols, batch)

        return measured_estimators(
            specs,
            recorded,
            topology.batch_size_per_rank * topology.gpus,
            torchrec_topology,
            constraints,
        )


def measured_estimators(
    specs: Mapping[str, TableSpec],
    measure: MeasureFn,
    global_batch: int,
    torchrec_topology: Any,
    constraints: Mapping[str, Any],
) -> list[Any]:
    """TorchRec's estimator list with the perf estimator replaced by the measured one
    (its storage estimator is kept; the memory rule sets each shard's storage after it,
    as for TorchRec as shipped: docs/memory.md)."""
    from torchrec.distributed.planner.shard_estimators import (
        EmbeddingPerfEstimator,
        EmbeddingStorageEstimator,
    )
    from torchrec.distributed.planner.types import Perf, ShardEstimator

    class MeasuredPerfEstimator(ShardEstimator):  # type: ignore[misc]
        """TorchRec's perf estimate with measured fwd/bwd compute per shard."""

        def __init__(self, topology: Any, constraints: Any = None) -> None:
            self._shipped = EmbeddingPerfEstimator(topology=topology, constraints=constraints)

        def estimate(self, sharding_options: list[Any], sharder_data_map: Any = None) -> None:
            self._shipped.estimate(sharding_options, sharder_data_map=sharder_data_map)
            for option in sharding_options:
                spec = specs[option.name]
                for shard in option.shards:
                    fwd, bwd = measure(spec, int(shard.size[1]), global_batch)
                    shipped = shard.perf
                    shard.perf = Perf(
                        fwd_compute=fwd,
                        fwd_comms=shipped.fwd_comms,
                        bwd_compute=bwd,
                        bwd_comms=shipped.bwd_comms,
                        input_dist_comms=shipped.input_dist_comms,
                        prefetch_compute=0.0,
                    )

    return [
        MeasuredPerfEstimator(torchrec_topology, dict(constraints)),
        EmbeddingStorageEstimator(topology=torchrec_topology, constraints=dict(constraints)),
    ]

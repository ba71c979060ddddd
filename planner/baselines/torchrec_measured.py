"""TorchRec's planner fed our measured costs (docs/design.md §9's "TorchRec with measured costs").

The same ``EmbeddingShardingPlanner`` as :class:`TorchRecPlanner` (same sharding types,
kernels, memory, proposer and partitioner), but each shard's compute is priced by a
custom TorchRec ``ShardEstimator`` from *measured* single-shard costs instead of
TorchRec's analytic GPU model. It answers "is a better search worth more than better
costs?": the gap between ``torchrec`` and ``torchrec-measured`` is what measured costs
buy TorchRec's search; the gap to NeuroShard is what the search and a learnt,
non-additive model buy on top. Two rows, as for TorchRec as shipped:
``torchrec-measured`` (every sharding type) and ``torchrec-measured-tw-cw``
(table-wise and column-wise only).

- **Compute.** ``fwd_compute``/``bwd_compute`` of every shard = the measured forward
  and backward of that shard alone, as its kernel runs it:

  - table-wise, column-wise (and table-column-wise): the shard's ``cols`` of its table
    at the global batch (``batch_size_per_rank × world_size``: the input all-to-all
    brings every sample's ids to it, as the evaluator measures it);
  - row-wise, table-row-wise and grid: the shard's row range as its kernel sees it
    (:func:`~shardwise.planner.kinds.row_slice`: that many rows, receiving their share
    of the lookups with the table's reuse histogram), its ``cols``, at the global
    batch; an empty range (TorchRec's even cut can leave the last ranks none) costs 0;
  - data-parallel: the whole table at the rank's own batch (``batch_size_per_rank``):
    each rank looks up only its samples.

  TorchRec adds shard costs per rank, so this is the additive model the issue asks for
  (a fused kernel is not additive, docs/design.md §6).
- **Communication.** TorchRec's own estimate is kept (its estimator runs first, then
  the compute fields are replaced): we have no per-shard all-to-all measurement, and
  the all-to-all depends on the whole rank, not one shard. The same holds for the
  row kinds' reduce-scatter and data-parallel's gradient all-reduce, which TorchRec
  prices by kind. It is priced for GPU links, so next to CPU-measured compute it is
  tiny and the search effectively balances measured compute.
- **Measurements** come from a callable ``measure(spec, cols, batch) -> (fwd_s,
  bwd_s)`` the caller injects (the benchmark passes one backed by
  ``shardwise.profiler.compute.measure_compute``, memoized), because the planner must
  not import the profiler (the dependency runs profiler → planner). ``batch`` is the
  batch the shard's kernel reads (global, or local for data-parallel) and ``spec`` is
  the row range's for the row kinds. Without a callable the planner refuses to plan.

It needs the ``TorchRecPlanner._estimators`` hook (TorchRec's enumerator with our
estimators); a planner module without it is refused loudly, never silently planned
as TorchRec as shipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardwise.basics import UserError
from shardwise.planner.base import PlannerOptions
from shardwise.planner.baselines.torchrec import (
    GREEDY_THRESHOLD,
    TW_CW_SHARDING_TYPES,
    TorchRecPlanner,
    option_kind,
)
from shardwise.planner.kinds import ROW_KINDS, local_batch, row_slice
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

#: ``measure(spec, cols, batch) -> (fwd_seconds, bwd_seconds)`` of one shard of
#: ``cols`` columns of ``spec`` (a row range's own spec for the row kinds), alone in a
#: fused kernel, at the ``batch`` its kernel reads.
MeasureFn = Callable[[TableSpec, int, int], tuple[float, float]]


class TorchRecMeasuredPlanner(TorchRecPlanner):
    """TorchRec's search over every sharding type with measured per-shard compute."""

    name = "torchrec-measured"
    summary = (
        "TorchRec's planner (every sharding type) with a custom ShardEstimator: measured "
        "single-shard fwd/bwd compute (TorchRec's comm estimate kept); needs measurements"
    )

    def __init__(
        self,
        options: PlannerOptions | None = None,
        *,
        measure: MeasureFn | None = None,
        threshold: int | None = GREEDY_THRESHOLD,
        min_partition: int | None = None,
        verbose: bool = False,
        sharding_types: Sequence[str] | None = None,
    ) -> None:
        super().__init__(
            options,
            threshold=threshold,
            min_partition=min_partition,
            verbose=verbose,
            sharding_types=sharding_types,
        )
        #: Set by the caller (the benchmark sets it after the registry builds the planner).
        self.measure = measure
        #: (spec name, cols, batch) of every measurement asked for in the last plan.
        self.measured: list[tuple[str, int, int]] = []

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        if self.measure is None:
            raise UserError(
                f"the {self.name} planner prices shards with measured costs and was "
                "given no measurements. Run it through `shardwise bench` (which measures "
                "each shard with the compute benchmark), or construct it with "
                "measure=... , a callable (spec, cols, batch) -> (fwd_s, bwd_s)."
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
            topology.batch_size_per_rank,
            topology.gpus,
            torchrec_topology,
            constraints,
        )


class TorchRecMeasuredTwCwPlanner(TorchRecMeasuredPlanner):
    """``torchrec-measured`` restricted to table-wise and column-wise sharding."""

    name = "torchrec-measured-tw-cw"
    summary = (
        "TorchRec's planner restricted to table_wise/column_wise with measured "
        "single-shard compute; for comparison with torchrec-measured"
    )
    offered = TW_CW_SHARDING_TYPES


def shard_cost(
    spec: TableSpec,
    kind: str,
    row_offset: int,
    rows: int,
    cols: int,
    batch_size_per_rank: int,
    world: int,
    measure: MeasureFn,
) -> tuple[float, float]:
    """Measured (fwd, bwd) of one shard of ``kind`` as its kernel runs it (module
    docstring): a row range's own lookups, data-parallel at the rank's own batch."""
    batch = batch_size_per_rank if local_batch(kind) else batch_size_per_rank * world
    if kind in ROW_KINDS:
        if rows == 0:
            return 0.0, 0.0
        return measure(row_slice(spec, row_offset, rows), cols, batch)
    return measure(spec, cols, batch)


def measured_estimators(
    specs: Mapping[str, TableSpec],
    measure: MeasureFn,
    batch_size_per_rank: int,
    world: int,
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
                kind = option_kind(str(option.sharding_type))
                for shard in option.shards:
                    fwd, bwd = shard_cost(
                        spec,
                        kind,
                        int(shard.offset[0]),
                        int(shard.size[0]),
                        int(shard.size[1]),
                        batch_size_per_rank,
                        world,
                        measure,
                    )
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

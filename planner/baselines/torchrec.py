"""The TorchRec baseline (docs/design.md §9): TorchRec's ``EmbeddingShardingPlanner`` as shipped.

TorchRec plans an ``EmbeddingBagCollection`` built on the meta device (no memory is
allocated) for a ``cuda`` topology of ``topology.gpus`` ranks at
``topology.batch_size_per_rank``; no GPU is needed. It plans for GPUs even when
``topology.device`` is ``cpu``: that setting only changes the placements the workers
get (see :mod:`shardwise.planner.torchrec_plan`). What we set, and why:

- **Sharding types.** ``ParameterConstraints(sharding_types=["table_wise",
  "column_wise"])`` per table: TorchRec as shipped picks row-wise for high-pooling
  tables, and plan.json v1 has no row-wise. Compute kernel ``fused`` only (what the
  workers run). ``pooling_factors=[spec.pooling_factor]``, else TorchRec assumes 1.0.
- **Memory.** ``hbm_cap = gpu_memory_bytes`` with a ``FixedPercentageStorageReservation``
  of our own ``memory_reserve``: TorchRec's usable memory per rank is then
  ``int((1 - reserve) * gpu_memory_bytes)``, exactly :attr:`Topology.usable_bytes`.
  Each shard's storage is our memory rule (planner/memory.py, docs/memory.md): a
  ShardEstimator run after TorchRec's own sets it to :func:`~shardwise.planner.memory.shard_bytes`.
  That rule is TorchRec's own count (weights + optimizer state + input and output
  buffers at the job's batch) with its undercounts fixed: TorchRec sizes a column-wise
  shard's row-wise Adagrad state by ``cols / dim`` and sees no optimizer at all when it
  is fused through the sharder as our workers do it. So TorchRec packs shards by the
  same bytes our validator checks, and its plans pass it. (TorchRec's default
  ``HeuristicalStorageReservation`` also reserves KJT buffers sized by the batch: at
  the design's batch of 65536 that alone is over 20 GB per rank for 20 tables, so it
  could plan nothing on 16 GiB GPUs; the rule counts each shard's buffers instead.)
- **Column-wise width.** As shipped, TorchRec cuts column-wise shards at least
  ``MIN_CW_DIM`` = 128 wide, so tables of dim <= 128 (all of the synthetic ones)
  never split: its "column_wise" option is then one whole-table shard, which comes
  back as a table-wise placement, and a table too big for one GPU fails. Pass
  ``min_partition`` (e.g. 32) to let it cut narrower blocks (its blocks are equal,
  so shards sharing a rank are always equally wide, as DMP needs).
- **Proposer.** ``GreedyProposer(threshold=10)``: TorchRec's greedy proposer with its
  own early stop after 10 proposals that do not improve the best plan. TorchRec's
  default list (grid search, two greedy variants, uniform) skips the grid search
  beyond 10^4 proposals (about 13 tables) and then walks about one proposal per
  table, each re-partitioning all tables. Measured here (2 CPU cores, 8 GPUs, median
  of 3, ``benchmarks/torchrec_planning_time.py``, synthetic tables): 0.26 s for 80
  tables and 5.0 s for 400 with the default list, 0.14 s and 0.70 s with the
  early-stopping greedy, which found plans of the same TorchRec perf rating in every
  case compared (20 to 400 tables, batch 4096 and 65536, tight to loose memory).
  ``TorchRecPlanner(threshold=None)`` runs TorchRec's default proposer list.
- **Quiet.** TorchRec logs a large stats table and per-proposer records; they are
  dropped (``NoopEmbeddingStats``, its loggers raised to ERROR while planning) unless
  ``verbose=True``.
- **Names.** Tables enter TorchRec under aliases (``shardwise_t{i}``), because an
  ``EmbeddingBagCollection`` keeps tables in an ``nn.ModuleDict`` where names with a
  ``.`` (legal in a :class:`TableSpec`) or names like ``keys`` are not allowed. The
  result and TorchRec's messages are mapped back to the real names.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

from shardwise.basics import UserError, format_bytes
from shardwise.planner.base import Planner, PlannerOptions, check_capacity
from shardwise.planner.memory import memory_sum, shard_bytes, shard_memory, what_would_fit
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import (
    FUSED_KERNEL,
    embedding_bag_configs,
    from_sharding_plan,
)

#: Stop after this many consecutive proposals that do not beat the best plan.
GREEDY_THRESHOLD = 10
#: The sharding types plan.json v1 can hold (TorchRec's names).
SHARDING_TYPES = ("table_wise", "column_wise")
_ALIAS = "shardwise_t{}"
_ALIAS_RE = re.compile(r"shardwise_t(\d+)")
_MODULE_PATH = ""  # the planned module is the EBC itself


class TorchRecPlanner(Planner):
    """TorchRec's planner restricted to table-wise and column-wise sharding."""

    name = "torchrec"
    summary = (
        "TorchRec's EmbeddingShardingPlanner as shipped (its cost model), restricted to "
        "table_wise/column_wise, with the tables' pooling factors"
    )

    def __init__(
        self,
        options: PlannerOptions | None = None,
        *,
        threshold: int | None = GREEDY_THRESHOLD,
        min_partition: int | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(options)
        self.threshold = threshold
        self.min_partition = min_partition
        self.verbose = verbose

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology, splittable=True)
        aliases = [_ALIAS.format(i) for i in range(len(tables))]
        with _quiet(not self.verbose):
            sharding_plan = self._torchrec_plan(tables, aliases, topology)
        return from_sharding_plan(
            _rename(sharding_plan, dict(zip(aliases, (t.name for t in tables), strict=True))),
            tables,
            topology,
            self.name,
            module_path=_MODULE_PATH,
        )

    def _torchrec_plan(
        self, tables: Sequence[TableSpec], aliases: Sequence[str], topology: Topology
    ) -> Any:
        import torch
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR
        from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
        from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory
        from torchrec.distributed.planner.proposers import GreedyProposer
        from torchrec.distributed.planner.stats import EmbeddingStats, NoopEmbeddingStats
        from torchrec.distributed.planner.storage_reservations import (
            FixedPercentageStorageReservation,
        )
        from torchrec.distributed.planner.types import (
            KernelConfig,
            ParameterConstraints,
            PlannerError,
            TopologyFactory,
            TrainerConfig,
        )

        ebc = EmbeddingBagCollection(
            tables=embedding_bag_configs(tables, names=aliases), device=torch.device("meta")
        )
        constraints = {
            alias: ParameterConstraints(
                sharding_types=list(SHARDING_TYPES),
                compute_kernels=[FUSED_KERNEL],
                pooling_factors=[t.pooling_factor],
                min_partition=self.min_partition,
            )
            for t, alias in zip(tables, aliases, strict=True)
        }
        torchrec_topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=topology.gpus, hbm_cap_bytes=topology.gpu_memory_bytes),
            kernel_config=KernelConfig(compute_device="cuda"),
        )
        specs = dict(zip(aliases, tables, strict=True))
        estimators = self._estimators(specs, topology, torchrec_topology, constraints)
        if estimators is None:  # TorchRec's own perf estimator, as its enumerator makes it
            estimators = [
                EmbeddingPerfEstimatorFactory.create(
                    DEFAULT_PERF_ESTIMATOR, topology=torchrec_topology, constraints=constraints
                )
            ]
        planner = EmbeddingShardingPlanner(
            topology=torchrec_topology,
            batch_size=topology.batch_size_per_rank,
            enumerator=EmbeddingEnumerator(
                topology=torchrec_topology,
                batch_size=topology.batch_size_per_rank,
                constraints=constraints,
                estimator=[*estimators, memory_rule_estimator(specs, topology)],
            ),
            storage_reservation=FixedPercentageStorageReservation(topology.memory_reserve),
            proposer=GreedyProposer(threshold=self.threshold) if self.threshold else None,
            constraints=constraints,
            stats=EmbeddingStats() if self.verbose else NoopEmbeddingStats(),
            debug=self.verbose,
        )
        try:
            return planner.plan(ebc, [EmbeddingBagCollectionSharder()])
        except PlannerError as err:
            raise UserError(_no_plan_message(tables, topology, str(err))) from None

    def _estimators(
        self,
        specs: dict[str, TableSpec],
        topology: Topology,
        torchrec_topology: Any,
        constraints: dict[str, Any],
    ) -> list[Any] | None:
        """TorchRec ``ShardEstimator``s pricing each shard (``specs`` keyed by alias);
        ``None`` keeps TorchRec's own perf estimator, as shipped. ``torchrec-measured``
        overrides it. Storage is always set after these, by the memory rule."""
        return None


def memory_rule_estimator(specs: dict[str, TableSpec], topology: Topology) -> Any:
    """A TorchRec ``ShardEstimator`` that sets each shard's storage to the memory rule
    (:func:`~shardwise.planner.memory.shard_bytes` at the job's batch, all in HBM), so
    TorchRec packs ranks by the bytes our validator checks. ``specs`` is keyed by alias."""
    from torchrec.distributed.planner.types import ShardEstimator, Storage

    class MemoryRuleEstimator(ShardEstimator):  # type: ignore[misc]
        def __init__(self) -> None:
            pass

        def estimate(self, sharding_options: list[Any], sharder_data_map: Any = None) -> None:
            for option in sharding_options:
                spec = specs[option.name]
                for shard in option.shards:
                    need = shard_bytes(
                        spec, int(shard.size[1]), topology.batch_size_per_rank, topology.gpus
                    )
                    shard.storage = Storage(hbm=need, ddr=0)

    return MemoryRuleEstimator()


def _no_plan_message(tables: Sequence[TableSpec], topology: Topology, detail: str) -> str:
    names = [t.name for t in tables]
    detail = _ALIAS_RE.sub(lambda m: repr(names[int(m.group(1))]), detail).strip()
    batch, world = topology.batch_size_per_rank, topology.gpus
    total = memory_sum(shard_memory(t, t.dim, batch, world) for t in tables)

    def per_rank(b: int) -> int:
        return -(-sum(shard_bytes(t, t.dim, b, world) for t in tables) // world)

    if per_rank(batch) <= topology.usable_bytes:
        advice = (
            "They would fit if spread evenly, but TorchRec could not pack its shards: give "
            "more memory or GPUs, lower the batch, or let it cut narrower column blocks "
            "(min_partition)."
        )
    else:
        advice = f"Even spread evenly they do not fit: {what_would_fit(per_rank, topology)}."
    return (
        f"TorchRec's planner found no table-wise/column-wise plan for {len(tables)} tables "
        f"on {world} GPUs: whole, they need {total.describe()} at batch {batch} per rank x "
        f"{world} ranks (docs/memory.md; splitting a table adds optimizer state and ids); "
        f"{topology.describe_capacity()}, {format_bytes(topology.usable_bytes * world)} "
        f"in all. {advice}\nTorchRec said:\n{detail}"
    )


def _rename(sharding_plan: Any, names: dict[str, str]) -> Any:
    """The same ShardingPlan with the EBC's tables under their real names."""
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan

    renamed: dict[str, Any] = {}
    for path, module_plan in sharding_plan.plan.items():
        out = EmbeddingModuleShardingPlan()
        for alias, param in module_plan.items():
            out[names.get(alias, alias)] = param
        renamed[path] = out
    return ShardingPlan(renamed)


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Raise TorchRec's loggers to ERROR for the duration (its planner logs at INFO/WARNING)."""
    if not enabled:
        yield
        return
    logger = logging.getLogger("torchrec")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)

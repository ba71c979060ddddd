"""The TorchRec baselines (docs/design.md §9): TorchRec's ``EmbeddingShardingPlanner``.

Two rows, one class each:

- ``torchrec`` (:class:`TorchRecPlanner`): TorchRec's planner at full strength, offered
  every sharding type its sharder allows for GPUs: ``data_parallel``, ``table_wise``,
  ``column_wise``, ``table_column_wise``, ``row_wise``, ``table_row_wise`` and
  ``grid_shard``. It is the anchor the benchmark's ratios are against, and it places a
  table no GPU holds whole row-wise (or table-row-wise, grid), as TorchRec does.
- ``torchrec-tw-cw`` (:class:`TorchRecTwCwPlanner`): the same planner restricted to
  ``table_wise``/``column_wise`` (what plan.json version 1 held), kept so the benchmark
  shows what the other kinds buy TorchRec.

TorchRec plans an ``EmbeddingBagCollection`` built on the meta device (no memory is
allocated) for a ``cuda`` topology of ``topology.gpus`` ranks, ``topology.local_world``
per host, at ``topology.batch_size_per_rank``; no GPU is needed. It plans for GPUs even
when ``topology.device`` is ``cpu`` (TorchRec's stock sharder offers row-wise,
table-row-wise and grid only for ``cuda``): the device only changes the placements the
workers get (:mod:`shardwise.planner.torchrec_plan`). What we set, and why:

- **Sharding types and kernels.** ``ParameterConstraints(sharding_types=...)`` per table
  with the row's types (less ``data_parallel`` for an fp16 table: the workers refuse it,
  as its dense Adagrad turns it NaN), and ``compute_kernels`` ``fused`` (FBGEMM's TBE with the
  optimizer fused into backward, what the workers run for every sharded type) plus
  ``dense`` where ``data_parallel`` is offered (TorchRec's only kernel for it). The
  UVM, caching, key-value and SSD kernels TorchRec also offers on ``cuda`` are left
  out: our workers run none of them. ``table_column_wise`` comes back as column-wise
  shards (plan.json has no separate kind for column blocks kept on one host).
  ``pooling_factors=[spec.pooling_factor]``, else TorchRec assumes 1.0.
- **Memory.** ``hbm_cap = gpu_memory_bytes`` with a ``FixedPercentageStorageReservation``
  of our own ``memory_reserve``: TorchRec's usable memory per rank is then
  ``int((1 - reserve) * gpu_memory_bytes)``, exactly :attr:`Topology.usable_bytes`.
  Each shard's storage is our memory rule for its sharding type
  (:func:`~shardwise.planner.memory.kind_memory` with the shard's rows and columns,
  docs/memory.md): a ShardEstimator run after TorchRec's own sets it
  (:func:`memory_rule_estimator`). The rule is TorchRec's own count (weights,
  optimizer state, input and output buffers of each kind at the job's batch) with its
  undercounts fixed: a column-wise shard's row-wise Adagrad state (TorchRec scales it
  by ``cols / dim``), the optimizer it does not see when fused through the sharder, and
  a data-parallel table's dense optimizer sum and gradient on every rank (TorchRec
  counts the replicated weights and the local batch's I/O per rank, nothing for the
  dense optimizer or DDP's gradient). So TorchRec packs shards by the same bytes our
  validator checks, and its plans pass it. (TorchRec's default
  ``HeuristicalStorageReservation`` also reserves KJT buffers sized by the batch: at
  the design's batch of 65536 that alone is over 20 GB per rank for 20 tables, so it
  could plan nothing on 16 GiB GPUs; the rule counts each shard's buffers instead.)
- **Capacity.** :func:`~shardwise.planner.base.check_capacity` first: a table that
  fits nowhere even row-wise over every GPU, or tables that fit the GPUs in no way,
  fail with the figures and what would fit before TorchRec is asked.
- **Column-wise width.** As shipped, TorchRec cuts column-wise (and grid) shards at
  least ``MIN_CW_DIM`` = 128 wide, so tables of dim <= 128 never split column-wise:
  such an option is one whole-table shard, which comes back table-wise. Pass
  ``min_partition`` (e.g. 32) to let it cut narrower blocks (its blocks are equal,
  so shards sharing a rank are always equally wide, as DMP needs).
- **Row ranges.** TorchRec cuts rows ``ceil(rows / n)`` per rank in rank order, the
  only cut its row-wise input dist runs (:func:`~shardwise.planner.kinds.even_row_split`);
  a plan it makes passes :func:`~shardwise.planner.torchrec_plan.torchrec_problems`.
- **Proposers.** TorchRec's default list is a grid search, a greedy proposer by each
  option's deepest shard, one by its shards' sum, and a uniform proposer (one sharding
  type for every table). The grid search stops beyond 10^4 proposals (about 13 tables
  of 2 options, fewer with 7 types), and each greedy one walks about one proposal per
  option of every table, each re-partitioning all tables. We run the same list without
  the grid search, each greedy proposer with TorchRec's own early stop after
  ``threshold`` (10) proposals that do not improve its best plan
  (:func:`proposers`). With every sharding type one greedy proposer alone is not
  enough: it walks each table through its options in perf order and can end with no
  plan that fits (20 tables on 4 GPUs of 1 GiB at batch 65536 per rank) where the
  uniform proposer's all-table-wise plan does. The list found the default list's plan
  (the same hash) on the five cases compared (20-80 synthetic tables, 4-8 GPUs on one
  or two hosts, batch 1024-65536 per rank), in 8.3 s against 13.7 s at 80 tables on 8
  GPUs (2 shared CPU cores). ``threshold=None`` runs TorchRec's default list as shipped.
  Planning times: ``benchmarks/torchrec_planning_time.py`` (docs/bench.md).
- **Repeatable.** TorchRec's enumerator intersects the offered and the allowed sharding
  types (and kernels) as Python sets, so the order of a table's options follows the
  process's string hash seed; its proposers sort options by price and keep that order
  among equal prices. Row-wise and table-row-wise on one host are priced alike, so the
  same tables got a row-wise plan in one process and a table-row-wise one in the next.
  :func:`ordered_enumerator` keeps the sharder's own order instead (the intersection
  is unchanged): the same inputs give the same plan in every process.
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
from typing import Any, ClassVar

from shardwise.basics import UserError, format_bytes
from shardwise.planner.base import Planner, PlannerOptions, check_capacity
from shardwise.planner.memory import (
    kind_memory,
    memory_sum,
    shard_bytes,
    shard_memory,
    what_would_fit,
)
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import (
    DENSE_KERNEL,
    FUSED_KERNEL,
    KIND_OF_TYPE,
    embedding_bag_configs,
    from_sharding_plan,
)

#: Stop after this many consecutive proposals that do not beat the best plan.
GREEDY_THRESHOLD = 10
#: Every sharding type TorchRec's ``EmbeddingBagCollectionSharder`` offers on ``cuda``
#: (TorchRec's names), in its order.
ALL_SHARDING_TYPES: tuple[str, ...] = (
    "data_parallel",
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "grid_shard",
)
#: The sharding types plan.json version 1 held: ``torchrec-tw-cw``'s.
TW_CW_SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise")
#: The sharding types that cut a table's rows: without one, a table must fit a GPU as
#: its narrowest column block at least.
ROW_CUTTING_TYPES: frozenset[str] = frozenset({"row_wise", "table_row_wise", "grid_shard"})
#: TorchRec's narrowest column-wise block without ``min_partition`` (``MIN_CW_DIM``).
TORCHREC_MIN_CW_DIM = 128
_DATA_PARALLEL = "data_parallel"
_ALIAS = "shardwise_t{}"
_ALIAS_RE = re.compile(r"shardwise_t(\d+)")
_MODULE_PATH = ""  # the planned module is the EBC itself


def table_sharding_types(spec: TableSpec, offered: Sequence[str]) -> list[str]:
    """The sharding types ``spec`` is offered: all of ``offered`` but data-parallel for
    an fp16 table, which the workers refuse (the dense Adagrad's eps underflows in fp16
    and the table turns NaN: ``shardwise.runtime.plancheck``). A :class:`UserError`
    when nothing is left."""
    types = [t for t in offered if not (t == _DATA_PARALLEL and spec.dtype == "fp16")]
    if not types:
        raise UserError(
            f"table {spec.name!r} is fp16, and the workers train no fp16 table "
            "data-parallel (its dense optimizer turns it NaN); offer another sharding "
            "type, or make the table fp32."
        )
    return types


def compute_kernels(sharding_types: Sequence[str]) -> list[str]:
    """The kernels our workers run for these sharding types: ``fused`` for every
    sharded type, ``dense`` for ``data_parallel`` (TorchRec's only one for it)."""
    out = []
    if any(t != _DATA_PARALLEL for t in sharding_types):
        out.append(FUSED_KERNEL)
    if _DATA_PARALLEL in sharding_types:
        out.append(DENSE_KERNEL)
    return out


class TorchRecPlanner(Planner):
    """TorchRec's planner offered every sharding type its sharder allows on GPUs."""

    name = "torchrec"
    summary = (
        "TorchRec's EmbeddingShardingPlanner at full strength (its cost model): every "
        "sharding type (data/table/column/table-column/row/table-row-wise, grid), "
        "fused kernels (dense for data-parallel), the tables' pooling factors"
    )
    #: The sharding types offered to TorchRec (its names) unless the caller names some.
    offered: ClassVar[tuple[str, ...]] = ALL_SHARDING_TYPES

    def __init__(
        self,
        options: PlannerOptions | None = None,
        *,
        threshold: int | None = GREEDY_THRESHOLD,
        min_partition: int | None = None,
        verbose: bool = False,
        sharding_types: Sequence[str] | None = None,
    ) -> None:
        super().__init__(options)
        self.threshold = threshold
        self.min_partition = min_partition
        self.verbose = verbose
        self.sharding_types: tuple[str, ...] = self.offered
        if sharding_types is not None:
            unknown = sorted(set(sharding_types) - set(ALL_SHARDING_TYPES))
            if unknown or not sharding_types:
                raise UserError(
                    f"sharding types {unknown or '[]'}: offer some of "
                    f"{', '.join(ALL_SHARDING_TYPES)}."
                )
            self.sharding_types = tuple(sharding_types)

    def plan(self, tables: Sequence[TableSpec], topology: Topology) -> Plan:
        check_capacity(tables, topology, splittable=True)
        if not ROW_CUTTING_TYPES & set(self.sharding_types):
            self._check_column_blocks(tables, topology)
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

    def _check_column_blocks(self, tables: Sequence[TableSpec], topology: Topology) -> None:
        """Offered no kind that cuts rows, TorchRec can place a table only whole or in
        column blocks at least ``min_partition`` (else 128) wide: a table whose
        narrowest block fits no GPU fails here, at once, not after TorchRec partitioned
        its proposals (1,718 of them, about 20 s, for 858 tables on 128 GPUs)."""
        narrowest = self.min_partition or TORCHREC_MIN_CW_DIM
        batch, world = topology.batch_size_per_rank, topology.gpus
        for t in tables:
            cols = min(t.dim, narrowest)
            need = shard_memory(t, cols, batch, world)
            if need.total > topology.usable_bytes:
                kinds = "/".join(k.replace("_", "-") for k in self.sharding_types)
                raise UserError(
                    f"TorchRec's planner found no plan ({kinds}) for {len(tables)} tables "
                    f"on {world} GPUs: table {t.name!r} fits no GPU even as its narrowest "
                    f"column block ({cols} of {t.dim} columns need {need.describe()}; "
                    f"{topology.describe_capacity()}), and no sharding type offered cuts "
                    "its rows. Offer one that does (the full `torchrec` planner), or give "
                    "the GPUs more memory."
                )

    def _torchrec_plan(
        self, tables: Sequence[TableSpec], aliases: Sequence[str], topology: Topology
    ) -> Any:
        import torch
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR
        from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory
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
        constraints = {}
        for t, alias in zip(tables, aliases, strict=True):
            types = table_sharding_types(t, self.sharding_types)
            constraints[alias] = ParameterConstraints(
                sharding_types=types,
                compute_kernels=compute_kernels(types),
                pooling_factors=[t.pooling_factor],
                min_partition=self.min_partition,
            )
        torchrec_topology = TopologyFactory.create_topology(
            TrainerConfig(
                world_size=topology.gpus,
                local_world_size=topology.local_world,
                hbm_cap_bytes=topology.gpu_memory_bytes,
            ),
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
            enumerator=ordered_enumerator(
                topology=torchrec_topology,
                batch_size=topology.batch_size_per_rank,
                constraints=constraints,
                estimator=[*estimators, memory_rule_estimator(specs, topology)],
            ),
            storage_reservation=FixedPercentageStorageReservation(topology.memory_reserve),
            proposer=proposers(self.threshold),
            constraints=constraints,
            stats=EmbeddingStats() if self.verbose else NoopEmbeddingStats(),
            debug=self.verbose,
        )
        try:
            return planner.plan(ebc, [EmbeddingBagCollectionSharder()])
        except PlannerError as err:
            raise UserError(
                _no_plan_message(tables, topology, str(err), self.sharding_types)
            ) from None

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


class TorchRecTwCwPlanner(TorchRecPlanner):
    """TorchRec's planner restricted to table-wise and column-wise sharding."""

    name = "torchrec-tw-cw"
    summary = (
        "TorchRec's EmbeddingShardingPlanner (its cost model) restricted to "
        "table_wise/column_wise, as plan.json v1 held; for comparison with torchrec"
    )
    offered = TW_CW_SHARDING_TYPES


def proposers(threshold: int | None) -> list[Any] | None:
    """TorchRec's default proposer list without its grid search, each greedy proposer
    stopping after ``threshold`` proposals that do not beat its best (module
    docstring); ``None``: TorchRec's default list as shipped."""
    if not threshold:
        return None
    from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer

    return [
        GreedyProposer(threshold=threshold),
        GreedyProposer(use_depth=False, threshold=threshold),
        UniformProposer(),
    ]


def ordered_enumerator(**kwargs: Any) -> Any:
    """TorchRec's ``EmbeddingEnumerator`` (``kwargs`` as it takes them) listing each
    table's sharding types and kernels in the sharder's order, not in the hash order
    of the sets it intersects (module docstring: **Repeatable**)."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    class OrderedEnumerator(EmbeddingEnumerator):  # type: ignore[misc]
        def _filter_sharding_types(
            self, name: str, allowed_sharding_types: list[str], sharder_key: str = ""
        ) -> list[str]:
            got = super()._filter_sharding_types(name, allowed_sharding_types, sharder_key)
            return in_order(got, allowed_sharding_types)

        def _filter_compute_kernels(
            self, name: str, allowed_compute_kernels: list[str], sharding_type: str
        ) -> list[str]:
            got = super()._filter_compute_kernels(name, allowed_compute_kernels, sharding_type)
            return in_order(got, allowed_compute_kernels)

    return OrderedEnumerator(**kwargs)


def in_order(got: Sequence[str], order: Sequence[str]) -> list[str]:
    """``got`` sorted by where each item stands in ``order`` (items not in it last, by
    name): a set's members in a list's order."""
    rank = {item: i for i, item in enumerate(order)}
    return sorted(got, key=lambda x: (rank.get(x, len(rank)), x))


def option_kind(sharding_type: str) -> str:
    """The plan's kind of a TorchRec sharding type (``table_column_wise`` is
    column-wise shards, as :func:`~shardwise.planner.torchrec_plan.from_sharding_plan`
    reads it back)."""
    try:
        return KIND_OF_TYPE[sharding_type]
    except KeyError:
        raise UserError(
            f"TorchRec offered sharding type {sharding_type!r}, which plan.json cannot hold."
        ) from None


def memory_rule_estimator(specs: dict[str, TableSpec], topology: Topology) -> Any:
    """A TorchRec ``ShardEstimator`` that sets each shard's storage to the memory rule
    for its option's sharding type (:func:`~shardwise.planner.memory.kind_memory` of
    the shard's rows and columns at the job's batch, all in HBM), so TorchRec packs
    ranks by the bytes our validator checks. ``specs`` is keyed by alias."""
    from torchrec.distributed.planner.types import ShardEstimator, Storage

    batch, world, local = topology.batch_size_per_rank, topology.gpus, topology.local_world

    class MemoryRuleEstimator(ShardEstimator):  # type: ignore[misc]
        def __init__(self) -> None:
            pass

        def estimate(self, sharding_options: list[Any], sharder_data_map: Any = None) -> None:
            for option in sharding_options:
                spec = specs[option.name]
                kind = option_kind(str(option.sharding_type))
                for shard in option.shards:
                    rows, cols = int(shard.size[0]), int(shard.size[1])
                    need = kind_memory(
                        kind, rows, cols, spec.dtype, spec.pooling_factor, batch, world, local
                    )
                    shard.storage = Storage(hbm=need.total, ddr=0)

    return MemoryRuleEstimator()


def _no_plan_message(
    tables: Sequence[TableSpec],
    topology: Topology,
    detail: str,
    sharding_types: Sequence[str] = ALL_SHARDING_TYPES,
) -> str:
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
    kinds = "/".join(t.replace("_", "-") for t in sharding_types)
    return (
        f"TorchRec's planner found no plan ({kinds}) for {len(tables)} tables "
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

"""Conversion between ``plan.json`` (:class:`Plan`) and TorchRec's ``ShardingPlan``.

The worker runtime hands TorchRec's ``DistributedModelParallel`` (DMP) the plan our
planners made, and the TorchRec baseline planner turns TorchRec's answer back into a
``plan.json``; both go through this module, so the two formats agree on one mapping:

- each table's kind is TorchRec's sharding type of the same name (``grid`` is
  ``grid_shard``; TorchRec's ``table_column_wise`` comes back as column-wise): uneven
  column widths are fine (``ShardMetadata`` carries each shard's own offset and size,
  and TorchRec's column-wise sharding reads them; only its own planner makes even
  ones);
- every sharded table uses the ``fused`` compute kernel (FBGEMM's TBE with the
  optimizer fused into backward), which is also the kernel that runs on CPU; a
  data-parallel table uses ``dense`` (TorchRec's only kernel for it: a replicated
  table under DDP, trained by the dense optimizer);
- each shard is one ``ShardMetadata`` with offsets ``[row_offset, col_offset]``, sizes
  ``[rows, cols]`` and placement ``rank:{r}/cuda:{r % local_world_size}`` on GPUs,
  ``rank:{r}/cpu`` on CPU. ``ParameterSharding.ranks`` lists the same ranks in shard
  order. A data-parallel table has no sharding spec, only its ranks (every rank).

Some rules are TorchRec's, not plan.json's, and :func:`torchrec_problems` names the
tables that break them (:func:`to_sharding_plan` refuses them):

- shards of one column-wise table that share a rank must have the same width (16+8 on
  one rank fails inside DMP, where TorchRec views the rank's slice of the fused
  weights as ``count × rows × width`` of the first shard; 8+8 on one rank with 12 on
  another works);
- row ranges must be TorchRec's even cut (:func:`~shardwise.planner.kinds.even_row_split`)
  in rank order: its row-wise input dist sends id ``i`` to the ``i // ceil(rows / n)``-th
  rank, whatever the metadata says, so an uneven plan would train on the wrong rows. A
  row-wise table spans every rank; a table-row-wise one, and each column range of a
  grid table, every rank of one host.

What DMP needs to run such a plan on CPU (tested with a 2-process gloo run in
``tests/test_planner_torchrec_plan.py``): the placements must say ``cpu`` (pass
``device="cpu"``, whatever device the plan was made for: the "device rewrite"), DMP
gets ``device=torch.device("cpu")`` and a gloo process group, and the kernel stays
``fused`` (TorchRec picks FBGEMM's CPU TBE for it). Nothing else changes: the model
can be built on the meta device, and weights copied into the local shards of
``dmp.state_dict()`` land in the fused kernel. Left as ``cuda:{i}`` the placements
fail on CPU ("Local shard tensor device does not match with local Shard's
placement"). Table names become ``nn.ModuleDict`` keys in the worker's
``EmbeddingBagCollection``, so a name with a ``.`` (or one like ``keys``) cannot be
used there as is.

The plan is keyed by the FQN of the ``EmbeddingBagCollection`` inside the model that
DMP wraps. The default, :data:`DEFAULT_MODULE_PATH`, is where TorchRec's own
``torchrec.models.dlrm.DLRM`` keeps it; pass ``module_path`` for other models
(``""`` when DMP wraps the collection itself).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchrec import EmbeddingBagConfig
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import placement
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import DataType

from shardwise.basics import UserError
from shardwise.planner.kinds import (
    HOST_KINDS,
    TORCHREC_TYPE,
    Kind,
    even_row_split,
    host_of,
    host_ranks,
)
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

#: FQN of the ``EmbeddingBagCollection`` in ``torchrec.models.dlrm.DLRM``.
DEFAULT_MODULE_PATH = "sparse_arch.embedding_bag_collection"
#: TorchRec's sharding type → the plan's kind (``table_column_wise`` is column-wise
#: shards that TorchRec keeps on one host: plan.json holds them as column-wise).
KIND_OF_TYPE: dict[str, Kind] = {
    **{v: k for k, v in TORCHREC_TYPE.items()},  # type: ignore[misc]
    ShardingType.TABLE_COLUMN_WISE.value: "column_wise",
}
#: Every sharding type a plan can hold.
SUPPORTED_SHARDING_TYPES = frozenset(KIND_OF_TYPE)
FUSED_KERNEL: str = EmbeddingComputeKernel.FUSED.value
DENSE_KERNEL: str = EmbeddingComputeKernel.DENSE.value


_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def embedding_bag_configs(
    tables: Sequence[TableSpec | PlanTable],
    names: Sequence[str] | None = None,
    features: Sequence[str] | None = None,
) -> list[EmbeddingBagConfig]:
    """TorchRec's ``EmbeddingBagConfig`` for each table: its rows, width and dtype, one
    feature each. A config is named like its table (so a plan's names are the
    collection's, which :func:`to_sharding_plan` keys on) unless ``names`` gives aliases,
    and its feature like the config unless ``features`` names them."""
    names = [t.name for t in tables] if names is None else list(names)
    features = names if features is None else list(features)
    return [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[feature],
            data_type=_DATA_TYPES[t.dtype],
        )
        for t, name, feature in zip(tables, names, features, strict=True)
    ]


def to_sharding_plan(
    plan: Plan,
    *,
    device: str | None = None,
    module_path: str = DEFAULT_MODULE_PATH,
    local_world_size: int | None = None,
) -> ShardingPlan:
    """TorchRec's ``ShardingPlan`` for ``plan``, for an EBC at ``module_path``.

    ``device`` ("cuda" or "cpu") overrides ``plan.topology.device``: a plan made for
    GPUs runs on CPU workers unchanged except for its placements. ``local_world_size``
    (GPUs per host, default: all ranks on one host) sets the ``cuda:{index}`` of each
    rank. The plan is validated first so TorchRec never sees overlapping shards.
    """
    plan.validate_plan(source="the plan given to to_sharding_plan")
    problems = torchrec_problems(plan)
    if problems:
        raise UserError("TorchRec cannot run this plan:\n- " + "\n- ".join(problems))
    dev = device or plan.topology.device
    if dev not in ("cuda", "cpu"):
        raise UserError(f"device {dev!r} is not supported; use 'cuda' or 'cpu'.")
    local = local_world_size or plan.world_size
    if local < 1:
        raise UserError(f"local_world_size must be at least 1, got {local}.")

    module_plan = EmbeddingModuleShardingPlan()
    for table in plan.tables:
        if table.kind == "data_parallel":
            module_plan[table.name] = ParameterSharding(
                sharding_type=ShardingType.DATA_PARALLEL.value,
                compute_kernel=DENSE_KERNEL,
                ranks=sorted(s.rank for s in table.shards),
                sharding_spec=None,
            )
            continue
        shards = _torchrec_order(table)
        module_plan[table.name] = ParameterSharding(
            sharding_type=TORCHREC_TYPE[table.kind],
            compute_kernel=FUSED_KERNEL,
            ranks=[s.rank for s in shards],
            sharding_spec=EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=[s.row_offset, s.col_offset],
                        shard_sizes=[s.row_count(table.rows), s.cols],
                        placement=placement(dev, s.rank, local),
                    )
                    for s in shards
                ]
            ),
        )
    return ShardingPlan({module_path: module_plan})


def _torchrec_order(table: PlanTable) -> list[Shard]:
    """The shards in the order TorchRec's sharding reads them: by rank for the row kinds
    (it indexes the list by rank within the world or the host), by column range and
    then rank for grid; as listed otherwise."""
    if table.kind in ("row_wise", "table_row_wise"):
        return sorted(table.shards, key=lambda s: s.rank)
    if table.kind == "grid":
        return sorted(table.shards, key=lambda s: (s.col_offset, s.rank))
    return list(table.shards)


def torchrec_problems(plan: Plan) -> list[str]:
    """Placements plan.json allows but TorchRec's DMP cannot build, as sentences
    (module docstring): unequal column widths on one rank, and row ranges other than
    TorchRec's even cut over the world's or one host's ranks."""
    out: list[str] = []
    world, local = plan.world_size, plan.topology.local_world
    for table in plan.tables:
        if table.kind == "column_wise":
            widths: dict[int, set[int]] = {}
            for s in table.shards:
                widths.setdefault(s.rank, set()).add(s.cols)
            for rank, seen in sorted(widths.items()):
                if len(seen) > 1:
                    out.append(
                        f"table {table.name!r} has shards of widths "
                        f"{', '.join(map(str, sorted(seen)))} on rank {rank}; TorchRec needs "
                        "the shards of a table on one rank to be equally wide (merge or split "
                        "them)"
                    )
        elif table.kind == "row_wise":
            out.extend(_row_cut_problems(table, table.shards, list(range(world)), "every rank"))
        elif table.kind in HOST_KINDS:
            blocks: dict[int, list[Shard]] = {}
            for s in table.shards:
                blocks.setdefault(s.col_offset, []).append(s)
            for shards in blocks.values():
                host = host_of(min(s.rank for s in shards), local)
                out.extend(
                    _row_cut_problems(
                        table, shards, host_ranks(host, local), f"every rank of host {host}"
                    )
                )
    return out


def _row_cut_problems(
    table: PlanTable, shards: list[Shard], ranks: list[int], what: str
) -> list[str]:
    want = [
        (r, o, n) for r, (o, n) in zip(ranks, even_row_split(table.rows, len(ranks)), strict=True)
    ]
    have = sorted((s.rank, s.row_offset, s.row_count(table.rows)) for s in shards)
    if have == want:
        return []
    cut = ", ".join(
        f"rank {r}: rows {o}..{o + n - 1}" if n else f"rank {r}: none" for r, o, n in want
    )
    return [
        f"table {table.name!r} is {table.kind} with rows cut {_ranges(have)}; TorchRec's "
        f"{table.kind} input dist sends id i to rank i // ceil(rows / ranks) over {what}, so "
        f"it runs only the even cut ({cut}). Re-plan it with `shardwise plan`."
    ]


def _ranges(shards: list[tuple[int, int, int]]) -> str:
    return ", ".join(
        f"rank {r}: rows {o}..{o + n - 1}" if n else f"rank {r}: none" for r, o, n in shards
    )


def from_sharding_plan(
    sharding_plan: ShardingPlan,
    tables: Sequence[TableSpec],
    topology: Topology,
    planner: str,
    module_path: str | None = None,
) -> Plan:
    """Our hashed, validated :class:`Plan` from TorchRec's ``ShardingPlan``.

    ``module_path`` picks the EBC's entry; ``None`` accepts a plan with exactly one
    module. Row-wise, data-parallel and other sharding types raise a
    :class:`UserError`: plan.json v1 holds only table-wise and column-wise shards.
    """
    module_plan = _module_plan(sharding_plan, module_path)
    problems: list[str] = []
    placed: list[list[Shard]] = []
    kinds: list[Kind | None] = []
    for spec in tables:
        param = module_plan.get(spec.name)
        if param is None:
            problems.append(f"table {spec.name!r} is not in TorchRec's plan")
            continue
        if not isinstance(param, ParameterSharding):
            problems.append(
                f"table {spec.name!r}: {type(param).__name__} is not a ParameterSharding"
            )
            continue
        kind = KIND_OF_TYPE.get(str(param.sharding_type))
        if kind is None:
            raise UserError(
                f"table {spec.name!r} is sharded {param.sharding_type} in TorchRec's plan; "
                "plan.json holds "
                f"{', '.join(sorted(SUPPORTED_SHARDING_TYPES))}."
            )
        if kind == "data_parallel":
            shards, table_problems = _copies(spec, param, topology.gpus)
        else:
            shards, table_problems = _shards(spec, param, kind)
            if kind == "column_wise" and len(shards) == 1:
                kind = "table_wise"  # one column block: TorchRec's own planner does this
            if kind == "grid" and len({(x.col_offset, x.cols) for x in shards}) == 1:
                kind = "table_row_wise"  # one column range: the same cut, one form
        problems.extend(table_problems)
        placed.append(shards)
        kinds.append(kind)
    known = {t.name for t in tables}
    problems.extend(
        f"TorchRec's plan places {name!r}, which is not among the tables"
        for name in sorted(set(module_plan) - known)
    )
    if problems:
        raise UserError(
            "TorchRec's sharding plan cannot become a plan.json:\n- " + "\n- ".join(problems)
        )
    plan = Plan.from_shards(tables, placed, topology, planner, kinds=kinds)
    return plan.validate_plan(tables, source="TorchRec's sharding plan")


def _copies(spec: TableSpec, param: ParameterSharding, world: int) -> tuple[list[Shard], list[str]]:
    """A data-parallel table: a whole copy on each of its ranks (all when unnamed)."""
    ranks = list(param.ranks) if param.ranks else list(range(world))
    return [Shard(rank=int(r), cols=spec.dim) for r in ranks], []


def _module_plan(sharding_plan: ShardingPlan, module_path: str | None) -> ModuleShardingPlan:
    paths = list(sharding_plan.plan)
    if module_path is None:
        if len(paths) != 1:
            raise UserError(
                f"TorchRec's plan has {len(paths)} modules ({', '.join(map(repr, paths))}); "
                "say which one holds the tables with module_path."
            )
        module_path = paths[0]
    module_plan = sharding_plan.plan.get(module_path)
    if module_plan is None:
        raise UserError(
            f"TorchRec's plan has no module {module_path!r}; it has "
            f"{', '.join(map(repr, paths)) or 'none'}."
        )
    return module_plan


def _shards(spec: TableSpec, param: ParameterSharding, kind: Kind) -> tuple[list[Shard], list[str]]:
    """The shards of one table, or the reasons it has none we can express."""
    where = f"table {spec.name!r}"
    sharding_spec = param.sharding_spec
    if not isinstance(sharding_spec, EnumerableShardingSpec) or not sharding_spec.shards:
        return [], [
            f"{where} has no ShardMetadata (sharding_spec is {type(sharding_spec).__name__})"
        ]
    shards: list[Shard] = []
    problems: list[str] = []
    for i, meta in enumerate(sharding_spec.shards):
        row_offset, col_offset = (int(x) for x in meta.shard_offsets)
        rows, cols = (int(x) for x in meta.shard_sizes)
        if kind in ("table_wise", "column_wise") and (row_offset != 0 or rows != spec.rows):
            problems.append(
                f"{where}: shard {i} holds rows {row_offset}..{row_offset + rows - 1} of "
                f"{spec.rows}, but a {kind.replace('_', '-')} shard holds every row (was "
                "TorchRec's plan made for a table of another size?)"
            )
            continue
        if meta.placement is None:
            problems.append(f"{where}: shard {i} has no placement")
            continue
        rank = int(meta.placement.rank())
        if param.ranks is not None and i < len(param.ranks) and param.ranks[i] != rank:
            problems.append(
                f"{where}: shard {i} is placed on rank {rank} but ranks[{i}] is {param.ranks[i]}"
            )
            continue
        shards.append(
            Shard(rank=rank, col_offset=col_offset, cols=cols, row_offset=row_offset, rows=rows)
        )
    if param.ranks is not None and len(param.ranks) != len(sharding_spec.shards):
        problems.append(f"{where}: {len(param.ranks)} ranks for {len(sharding_spec.shards)} shards")
    return (shards if not problems else []), problems

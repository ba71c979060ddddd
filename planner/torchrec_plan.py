"""Conversion between ``plan.json`` (:class:`Plan`) and TorchRec's ``ShardingPlan``.

The worker runtime hands TorchRec's ``DistributedModelParallel`` (DMP) the plan our
planners made, and the TorchRec baseline planner turns TorchRec's answer back into a
``plan.json``; both go through this module, so the two formats agree on one mapping:

- a table with one shard is ``table_wise``, with several ``column_wise`` (uneven
  widths are fine: ``ShardMetadata`` carries each shard's own offset and size, and
  TorchRec's column-wise sharding reads them; only its own planner makes even ones);
- every table uses the ``fused`` compute kernel (FBGEMM's TBE with the optimizer
  fused into backward), which is also the kernel that runs on CPU;
- each shard is one ``ShardMetadata`` with offsets ``[0, col_offset]``, sizes
  ``[rows, cols]`` and placement ``rank:{r}/cuda:{r % local_world_size}`` on GPUs,
  ``rank:{r}/cpu`` on CPU. ``ParameterSharding.ranks`` lists the same ranks in shard
  order.

One rule is TorchRec's, not plan.json's: shards of one table that share a rank must
have the same width (16+8 on one rank fails inside DMP, where TorchRec views the
rank's slice of the fused weights as ``count × rows × width`` of the first shard;
8+8 on one rank with 12 on another works). :func:`torchrec_problems` names the
tables that break it and :func:`to_sharding_plan` refuses them.

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
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

#: FQN of the ``EmbeddingBagCollection`` in ``torchrec.models.dlrm.DLRM``.
DEFAULT_MODULE_PATH = "sparse_arch.embedding_bag_collection"
#: Sharding types whose shards are whole-row column slices, i.e. what plan.json v1 holds.
SUPPORTED_SHARDING_TYPES = frozenset(
    {
        ShardingType.TABLE_WISE.value,
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_COLUMN_WISE.value,
    }
)
FUSED_KERNEL: str = EmbeddingComputeKernel.FUSED.value


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
        sharding_type = ShardingType.TABLE_WISE if table.is_table_wise else ShardingType.COLUMN_WISE
        module_plan[table.name] = ParameterSharding(
            sharding_type=sharding_type.value,
            compute_kernel=FUSED_KERNEL,
            ranks=[s.rank for s in table.shards],
            sharding_spec=EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=[0, s.col_offset],
                        shard_sizes=[table.rows, s.cols],
                        placement=placement(dev, s.rank, local),
                    )
                    for s in table.shards
                ]
            ),
        )
    return ShardingPlan({module_path: module_plan})


def torchrec_problems(plan: Plan) -> list[str]:
    """Placements plan.json allows but TorchRec's DMP cannot build, as sentences.

    TorchRec (1.8) stacks the shards of a table that land on one rank into a single
    fused-kernel slice sized by the first shard's width, so their widths must agree.
    """
    out: list[str] = []
    for table in plan.tables:
        widths: dict[int, set[int]] = {}
        for s in table.shards:
            widths.setdefault(s.rank, set()).add(s.cols)
        for rank, seen in sorted(widths.items()):
            if len(seen) > 1:
                out.append(
                    f"table {table.name!r} has shards of widths "
                    f"{', '.join(map(str, sorted(seen)))} on rank {rank}; TorchRec needs the "
                    "shards of a table on one rank to be equally wide (merge or split them)"
                )
    return out


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
        if param.sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise UserError(
                f"table {spec.name!r} is sharded {param.sharding_type} in TorchRec's plan; "
                "plan.json v1 supports only table-wise and column-wise placement "
                f"({', '.join(sorted(SUPPORTED_SHARDING_TYPES))}). Restrict TorchRec's "
                "sharding types with ParameterConstraints(sharding_types=...)."
            )
        shards, table_problems = _shards(spec, param)
        problems.extend(table_problems)
        placed.append(shards)
    known = {t.name for t in tables}
    problems.extend(
        f"TorchRec's plan places {name!r}, which is not among the tables"
        for name in sorted(set(module_plan) - known)
    )
    if problems:
        raise UserError(
            "TorchRec's sharding plan cannot become a plan.json:\n- " + "\n- ".join(problems)
        )
    plan = Plan.from_shards(tables, placed, topology, planner)
    return plan.validate_plan(tables, source="TorchRec's sharding plan")


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


def _shards(spec: TableSpec, param: ParameterSharding) -> tuple[list[Shard], list[str]]:
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
        if row_offset != 0 or rows != spec.rows:
            problems.append(
                f"{where}: shard {i} holds rows {row_offset}..{row_offset + rows - 1} "
                f"of {spec.rows}; plan.json v1 has no row-wise shards"
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
        shards.append(Shard(rank=rank, col_offset=col_offset, cols=cols))
    if param.ranks is not None and len(param.ranks) != len(sharding_spec.shards):
        problems.append(f"{where}: {len(param.ranks)} ranks for {len(sharding_spec.shards)} shards")
    return (shards if not problems else []), problems

"""Shard a model with the injected plan: TorchRec's ``ShardingPlan`` → ``DistributedModelParallel``.

The plan is converted by :func:`shardwise.planner.torchrec_plan.to_sharding_plan`, with
the placements rewritten for the device this worker runs on (a plan made for ``cuda``
runs unchanged on CPU workers: gloo, FBGEMM's CPU kernels). Every sharded table uses
the ``fused`` kernel: FBGEMM's table-batched embedding with the optimizer fused into
backward, which is what the profiler and the cost model time, so the
measured cost a worker exports and the plan's prediction price the same kernel.
The default fused optimizer is ``EXACT_ROWWISE_ADAGRAD`` as in the profiler; ``sgd``
(``EXACT_SGD``: no optimizer state) is the other choice.

Every sharding kind runs on both devices: TorchRec's stock ``EmbeddingBagCollectionSharder``
offers row-wise, table-row-wise and grid only for ``cuda``, but its CPU kernel (FBGEMM's
CPU TBE) and gloo run them too, so :func:`all_kinds_sharder` offers every type the plan
may hold on either device. Measured on 2 and 4 CPU ranks (2 hosts of 2): after several
steps every kind's weights equal an unsharded model's trained with the same optimizer
(``tests/test_runtime_kinds.py``). A data-parallel table uses TorchRec's ``dense``
kernel under DDP and is trained by :func:`dense_optimizer`; on CPU its backward warns
that FBGEMM's dense lookup has no autograd kernel, yet its gradients are right (the
same test pins it).

The model's ``EmbeddingBagCollection`` at ``module_path`` is checked against the plan
(names, rows, dims, dtype) before DMP is built, so a mismatch is a :class:`UserError`
naming the table on every rank, not a shape error inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from shardwise.basics import UserError
from shardwise.planner.plan import Plan, plan_shapes, shape_mismatches, spec_shapes
from shardwise.planner.tables import TableSpec
from shardwise.planner.torchrec_plan import DEFAULT_MODULE_PATH, to_sharding_plan
from shardwise.runtime.env import WorkerEnv
from shardwise.runtime.plancheck import run_problems

EmbeddingOptimizerName = Literal["rowwise_adagrad", "sgd"]


@dataclass(frozen=True)
class EmbeddingOptimizer:
    """The optimizer fused into the embedding kernels' backward."""

    name: EmbeddingOptimizerName = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8

    def fused_params(self) -> dict[str, Any]:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        kind = {
            "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "sgd": EmbOptimType.EXACT_SGD,
        }[self.name]
        params: dict[str, Any] = {"optimizer": kind, "learning_rate": self.lr}
        if self.name == "rowwise_adagrad":
            params["eps"] = self.eps
        return params


def all_kinds_sharder(fused_params: dict[str, Any]) -> Any:
    """TorchRec's ``EmbeddingBagCollectionSharder`` offering every sharding type on
    every device (the stock one keeps row-wise, table-row-wise and grid for ``cuda``;
    module docstring). Kernels are TorchRec's own choice per type and device: ``fused``
    for the sharded kinds, ``dense`` for data-parallel."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class AllKindsSharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            offered: list[str] = list(super().sharding_types(compute_device_type))
            return offered + [t.value for t in ShardingType if t.value not in offered]

    return AllKindsSharder(fused_params=fused_params)


def worker_device(env: WorkerEnv) -> torch.device:
    """``cuda:LOCAL_RANK`` when this host has GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def embedding_collection(model: nn.Module, module_path: str = DEFAULT_MODULE_PATH) -> Any:
    """The ``EmbeddingBagCollection`` at ``module_path`` (``""``: the model itself)."""
    from torchrec import EmbeddingBagCollection

    try:
        module = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        module = None
    if not isinstance(module, EmbeddingBagCollection):
        found = [
            n or "(the model)"
            for n, m in model.named_modules()
            if isinstance(m, EmbeddingBagCollection)
        ]
        raise UserError(
            f"the model has no EmbeddingBagCollection at {module_path!r} (the plan is keyed by "
            f"that path); it has one at: {', '.join(found) or 'nowhere'}. Pass module_path."
        )
    return module


def model_tables(ebc: Any) -> list[TableSpec]:
    """The collection's tables as specs (shape only), to check a plan against the model."""
    from torchrec.modules.embedding_configs import DataType

    dtypes = {DataType.FP32: "fp32", DataType.FP16: "fp16"}
    out = []
    for cfg in ebc.embedding_bag_configs():
        if cfg.data_type not in dtypes:
            raise UserError(
                f"table {cfg.name!r} has data type {cfg.data_type}; plans hold fp32 or fp16."
            )
        if len(cfg.feature_names) != 1:
            raise UserError(
                f"table {cfg.name!r} is read by {len(cfg.feature_names)} features; the cost "
                "model and the plan assume one feature per table."
            )
        out.append(
            TableSpec(
                name=cfg.name,
                rows=cfg.num_embeddings,
                dim=cfg.embedding_dim,
                pooling_factor=0.0,
                dtype=dtypes[cfg.data_type],
            )
        )
    return out


def check_model(plan: Plan, model: nn.Module, module_path: str = DEFAULT_MODULE_PATH) -> None:
    """Raise a :class:`UserError` naming every table where the model and the plan differ."""
    specs = model_tables(embedding_collection(model, module_path))
    problems = shape_mismatches(plan_shapes(plan), spec_shapes(specs), "plan", "model")
    if problems:
        raise UserError("the plan does not match the model:\n- " + "\n- ".join(problems))


def shard_model(
    model: nn.Module,
    plan: Plan,
    device: torch.device,
    *,
    optimizer: EmbeddingOptimizer | None = None,
    module_path: str = DEFAULT_MODULE_PATH,
    local_world_size: int | None = None,
    group: Any = None,
) -> Any:
    """Wrap ``model`` in ``DistributedModelParallel`` with exactly ``plan``'s placement.

    Build the model on the ``meta`` device: DMP allocates only this rank's shards and
    materialises the dense layers on ``device`` (DDP then copies rank 0's dense weights
    to every rank). Call it on every rank with the same plan, after
    ``init_process_group``. ``group``: the process group of every rank that the
    training collectives (all-to-alls, DDP) use, e.g. one with a shorter timeout than
    the default group's; default: the default group. ``local_world_size``: ranks per
    host (torchrun's ``LOCAL_WORLD_SIZE``, which TorchRec's table-row-wise and grid
    shardings read to find a rank's host); a plan with such tables must have been made
    for as many GPUs per host (:func:`~.plancheck.run_problems` says so before any
    collective). Returns the DMP module.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    check_model(plan, model, module_path)
    local = local_world_size or _env_local_world(plan.world_size)
    problems = run_problems(plan, local)
    if problems:
        raise UserError("DMP cannot train this plan here:\n- " + "\n- ".join(problems))
    sharding_plan = to_sharding_plan(
        plan, device=device.type, module_path=module_path, local_world_size=local
    )
    sharder = all_kinds_sharder((optimizer or EmbeddingOptimizer()).fused_params())
    return DistributedModelParallel(
        model,
        env=None if group is None else ShardingEnv.from_process_group(group),
        device=device,
        plan=sharding_plan,
        sharders=[sharder],
    )


def _env_local_world(world: int) -> int:
    """``LOCAL_WORLD_SIZE`` as TorchRec reads it (the world when unset)."""
    import os

    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return world


def dense_optimizer(dmp: Any, lr: float) -> Any:
    """Adagrad over the dense (replicated, DDP) parameters, keyed by name so its state
    checkpoints the same way at any world size. The sharded tables' optimizer is fused;
    a data-parallel table is a dense parameter (TorchRec's ``dense`` kernel), so this
    trains it, its state the element-wise ``sum`` keyed by the table's weight key."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adagrad(ps, lr=lr))


def sharded_collection(dmp: Any, module_path: str = DEFAULT_MODULE_PATH) -> Any:
    """The ``ShardedEmbeddingBagCollection`` DMP put at ``module_path``."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    module = dmp.module
    for part in filter(None, module_path.split(".")):
        module = getattr(module, part)
    if not isinstance(module, ShardedEmbeddingBagCollection):
        raise RuntimeError(f"{module_path!r} is a {type(module).__name__}, not a sharded EBC")
    return module

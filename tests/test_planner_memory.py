"""The memory rule (planner/memory.py, docs/memory.md): TorchRec's counting, and where it
deliberately differs."""

from __future__ import annotations

import math

import pytest

from shardwise.planner.memory import (
    INDEX_BYTES,
    OPTIMIZER_BYTES_PER_ROW,
    OUTPUT_BYTES,
    ShardMemory,
    gpu_memory_to_fit,
    largest_batch,
    memory_sum,
    shard_bytes,
    shard_memory,
    what_would_fit,
)
from shardwise.planner.plan import Shard, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

A = TableSpec(name="a", rows=1000, dim=64, pooling_factor=3.5)
B = TableSpec(name="b", rows=777, dim=256, pooling_factor=0.4)
C = TableSpec(name="c", rows=500, dim=128, pooling_factor=2.0, dtype="fp16")


def test_parts_by_hand() -> None:
    """Weights, rows x 4 of row-wise Adagrad state per shard, and the global batch's
    int64 ids plus fp32 pooled outputs."""
    m = shard_memory(A, 32, batch_size_per_rank=512, world=4)
    assert m.weights == 1000 * 32 * 4
    assert m.optimizer == 1000 * OPTIMIZER_BYTES_PER_ROW
    assert m.io == math.ceil(3.5 * 512 * 4 * INDEX_BYTES) + 512 * 4 * 32 * OUTPUT_BYTES
    assert m.total == m.weights + m.optimizer + m.io == shard_bytes(A, 32, 512, 4)
    # fp16 halves the weights, not the optimizer state nor the fp32 outputs.
    half = shard_memory(C, 128, 512, 4)
    assert half.weights == 500 * 128 * 2 and half.optimizer == 500 * 4
    # Pooling below 1 scales the outputs by it (TorchRec's min(1, pooling)).
    low = shard_memory(B, 256, 512, 4)
    assert low.io == math.ceil(0.4 * 512 * 4 * 8) + math.ceil(0.4 * 512 * 4 * 256 * 4)


def test_io_grows_with_batch_and_world_and_splitting_costs_memory() -> None:
    small, big = shard_memory(A, 64, 128, 8), shard_memory(A, 64, 65536, 8)
    assert small.weights == big.weights and big.io == pytest.approx(512 * small.io, rel=1e-3)
    assert shard_memory(A, 64, 128, 16).io == pytest.approx(2 * small.io, rel=1e-3)
    # Two half shards hold the same weights but twice the optimizer state and the ids.
    halves = memory_sum([shard_memory(A, 32, 128, 8)] * 2)
    assert halves.weights == small.weights and halves.total > small.total
    assert halves.optimizer == 2 * small.optimizer


def test_matches_torchrecs_storage_estimator() -> None:
    """TorchRec's own EmbeddingStorageEstimator (the fused kernel on cuda, its default
    pipeline, weights tagged with row-wise Adagrad) on the shards its enumerator
    proposes: equal for whole fp32 tables; for column-wise shards we add the optimizer
    state TorchRec scales down by cols/dim; for fp16 tables the full rows x 4 of
    state and fp32 outputs (docs/memory.md)."""
    import torch
    import torchrec.optim as trec_optim
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import (
        KernelConfig,
        ParameterConstraints,
        TopologyFactory,
        TrainerConfig,
    )

    from shardwise.planner.torchrec_plan import FUSED_KERNEL, embedding_bag_configs

    specs = {t.name: t for t in (A, B, C)}
    world, batch = 4, 512
    ebc = EmbeddingBagCollection(
        tables=embedding_bag_configs(list(specs.values())), device=torch.device("meta")
    )
    for p in ebc.parameters():
        p._optimizer_classes = [trec_optim.RowWiseAdagrad]  # type: ignore[attr-defined]
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["table_wise", "column_wise"],
            compute_kernels=[FUSED_KERNEL],
            pooling_factors=[t.pooling_factor],
            min_partition=32,
        )
        for t in specs.values()
    }
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world, hbm_cap_bytes=2**34),
        kernel_config=KernelConfig(compute_device="cuda"),
    )
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch, constraints=constraints)
    options = enumerator.enumerate(ebc, [EmbeddingBagCollectionSharder()])
    kinds = set()
    for option in options:
        spec = specs[option.name]
        for shard in option.shards:
            rows, cols = shard.size
            ours = shard_memory(spec, cols, batch, world)
            theirs = shard.storage.hbm
            kinds.add((spec.name, option.sharding_type))
            state = math.ceil(rows * cols * spec.bytes_per_element / spec.dim)
            extra = ours.optimizer - state
            if spec.dtype == "fp16":  # TorchRec sizes fp16 tables' outputs at 2 bytes
                extra += math.ceil(min(1.0, spec.pooling_factor) * batch * world * cols * 2)
            assert ours.total == theirs + extra, (option.name, option.sharding_type, cols)
            if spec.dtype == "fp32" and cols == spec.dim:
                assert ours.total == theirs
    assert {k for _, k in kinds} == {"table_wise", "column_wise"} and len(kinds) == 6


def test_rank_memory_without_specs_counts_no_io() -> None:
    topo = Topology(gpus=2, gpu_memory_bytes=2**30, batch_size_per_rank=256)
    plan = table_wise_plan([A, B, C], [0, 1, 1], topo, "test")
    known = plan.rank_memory([A, B, C])
    unknown = plan.rank_memory()
    assert known[0] == shard_memory(A, 64, 256, 2)
    assert known[1] == shard_memory(B, 256, 256, 2) + shard_memory(C, 128, 256, 2)
    assert [m.io for m in unknown] == [0, 0]
    assert [m.weights + m.optimizer for m in unknown] == [m.weights + m.optimizer for m in known]
    # Another batch: the I/O scales, the rest does not.
    at_512 = plan.rank_memory([A, B, C], batch_size_per_rank=512)
    assert at_512[0].io > known[0].io and at_512[0].weights == known[0].weights
    # Two shards of one table on one rank count twice the state and ids.
    split = plan.model_copy(
        update={
            "tables": [
                plan.tables[0].model_copy(
                    update={
                        "shards": [
                            Shard(rank=0, col_offset=0, cols=32),
                            Shard(rank=0, col_offset=32, cols=32),
                        ]
                    }
                ),
                *plan.tables[1:],
            ]
        }
    )
    assert split.rank_memory([A, B, C])[0].optimizer == 2 * known[0].optimizer


def test_what_would_fit_names_memory_and_batch() -> None:
    topo = Topology(gpus=4, gpu_memory_bytes=10 * 2**20, batch_size_per_rank=65536)

    def need(batch: int) -> int:
        return shard_bytes(A, 64, batch, topo.gpus)

    memory = gpu_memory_to_fit(need(65536), topo)
    assert topo.model_copy(update={"gpu_memory_bytes": memory}).usable_bytes >= need(65536)
    assert topo.model_copy(update={"gpu_memory_bytes": memory - 1}).usable_bytes < need(65536)
    batch = largest_batch(need, topo.usable_bytes, 65536)
    assert 0 < batch < 65536 and need(batch) <= topo.usable_bytes < need(batch + 1)
    text = what_would_fit(need, topo)
    assert f"a batch of at most {batch} per rank" in text and "would fit" in text
    tiny = topo.model_copy(update={"gpu_memory_bytes": 1000})
    assert "no smaller batch fits" in what_would_fit(need, tiny)


def test_describe_names_every_part() -> None:
    text = ShardMemory(weights=2**30, optimizer=2**20, io=3 * 2**20).describe()
    assert "weights" in text and "optimizer" in text and "I/O buffers" in text


def test_plan_problems_count_io_with_the_specs_at_the_jobs_batch() -> None:
    """Weights that fit, I/O that does not: the validator says so with the specs (and
    the batch that would fit), not without them; the workers' check at their batch."""
    from shardwise.runtime.plancheck import plan_problems

    tables = [A, B]
    weights_and_state = sum(shard_memory(t, t.dim, 0, 2).total for t in tables)
    memory = int((weights_and_state + 2**20) / 0.85) + 1  # 1 MiB to spare at the reserve
    topo = Topology(gpus=2, gpu_memory_bytes=memory, batch_size_per_rank=65536)
    plan = table_wise_plan(tables, [0, 0], topo, "test")
    problems = plan.problems(tables)
    assert len(problems) == 1 and problems[0].startswith("rank 0 needs"), problems
    assert "I/O buffers" in problems[0] and "at batch 65536 per rank x 2 ranks" in problems[0]
    batch = int(problems[0].split("a batch of at most ")[1].split()[0])
    assert plan.problems(tables, batch_size_per_rank=batch) == []
    assert plan.problems(tables, batch_size_per_rank=batch + 1) != []
    assert plan.problems() == []  # without the pooling factors: weights + state fit
    # The workers' check is the same rule, at the batch they train at.
    hashed = plan.with_hash()
    assert plan_problems(hashed, tables, 2, batch_size_per_rank=batch) == []
    assert any("I/O buffers" in p for p in plan_problems(hashed, tables, 2))

"""The TorchRec baselines: valid plans within memory, the restricted one TW/CW only, clear
errors. Every sharding kind of the unrestricted one: tests/test_planner_torchrec_full.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from conftest import make_tables
from hypothesis import event, given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.base import check_capacity
from shardwise.planner.baselines.torchrec import TorchRecPlanner, TorchRecTwCwPlanner
from shardwise.planner.memory import table_bytes
from shardwise.planner.registry import get_planner
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import to_sharding_plan, torchrec_problems

GiB = 2**30


def test_registry_finds_both() -> None:
    planner = get_planner("torchrec")
    assert type(planner) is TorchRecPlanner
    assert planner.name == "torchrec" and "every sharding type" in planner.summary
    assert "row_wise" in planner.sharding_types and "data_parallel" in planner.sharding_types
    restricted = get_planner("torchrec-tw-cw")
    assert isinstance(restricted, TorchRecTwCwPlanner) and restricted.name == "torchrec-tw-cw"
    assert "restricted" in restricted.summary
    assert restricted.sharding_types == ("table_wise", "column_wise")


@pytest.mark.parametrize("cls", [TorchRecPlanner, TorchRecTwCwPlanner])
@pytest.mark.parametrize("batch", [4096, 65536])
def test_valid_plan_for_20_tables_on_4_gpus(cls: type[TorchRecPlanner], batch: int) -> None:
    """At batch 65536 the I/O buffers are most of the memory: one greedy proposer alone
    walked every table into options that fit nowhere (the proposer list's other
    proposers find a plan)."""
    tables = make_tables(20)
    topo = Topology(gpus=4, gpu_memory_bytes=GiB, batch_size_per_rank=batch)
    plan = cls().plan(tables, topo)
    assert plan.problems(tables) == []
    assert plan.planner == cls.name and plan.hash == plan.content_hash()
    assert [t.name for t in plan.tables] == [t.name for t in tables]
    assert all(used <= topo.usable_bytes for used in plan.memory_per_rank(tables))
    assert len({s.rank for t in plan.tables for s in t.shards}) > 1
    assert torchrec_problems(plan) == []
    to_sharding_plan(plan)  # and the workers can take it back to TorchRec


def test_restricted_only_table_wise_and_column_wise_even_for_high_pooling() -> None:
    """Unconstrained, TorchRec picks row-wise for tables like these; torchrec-tw-cw must
    not (and torchrec does)."""
    tables = [
        TableSpec(name=f"hot{i}", rows=2_000_000, dim=64, pooling_factor=200.0) for i in range(4)
    ] + make_tables(8)
    topo = Topology(gpus=4, gpu_memory_bytes=4 * GiB, batch_size_per_rank=8192)
    aliases = [f"shardwise_t{i}" for i in range(len(tables))]
    planner = TorchRecTwCwPlanner()
    raw = planner._torchrec_plan(tables, aliases, topo)
    kinds = {p.sharding_type for module in raw.plan.values() for p in module.values()}
    assert kinds <= {"table_wise", "column_wise"}
    plan = planner.plan(tables, topo)
    assert plan.problems(tables) == []
    full = TorchRecPlanner()._torchrec_plan(tables, aliases, topo)
    kinds = {p.sharding_type for module in full.plan.values() for p in module.values()}
    assert kinds - {"table_wise", "column_wise"}, kinds


def test_column_wise_split_when_a_table_fits_no_gpu() -> None:
    """With narrower column blocks allowed, a table bigger than one GPU is split."""
    big = TableSpec(name="big-one", rows=1_000_000, dim=128, pooling_factor=30)  # 512 MB
    tables = [
        *make_tables(6),
        big,
        TableSpec(name="keys", rows=1000, dim=12, pooling_factor=3, dtype="fp16"),
    ]
    topo = Topology(gpus=4, gpu_memory_bytes=400 * 2**20, batch_size_per_rank=4096)
    plan = TorchRecTwCwPlanner(min_partition=32).plan(tables, topo)
    assert plan.problems(tables) == []
    placed = {t.name: t for t in plan.tables}
    assert len(placed["big-one"].shards) > 1 and placed["big-one"].kind == "column_wise"
    assert all(used <= topo.usable_bytes for used in plan.memory_per_rank(tables))
    assert torchrec_problems(plan) == []


def test_as_shipped_never_splits_narrow_tables() -> None:
    """TorchRec's column blocks are >= 128 wide unless min_partition says otherwise, so
    restricted to TW/CW it cannot place a 128-wide table bigger than a GPU."""
    big = TableSpec(name="big", rows=1_000_000, dim=128, pooling_factor=30)
    topo = Topology(gpus=4, gpu_memory_bytes=400 * 2**20, batch_size_per_rank=4096)
    with pytest.raises(UserError, match="TorchRec's planner found no plan") as err:
        TorchRecTwCwPlanner().plan([big, *make_tables(3)], topo)
    assert "(table-wise/column-wise)" in str(err.value)
    assert "'big'" in str(err.value)  # TorchRec's alias is mapped back to the name
    # refused before TorchRec is asked: its narrowest block is the whole table
    assert "I/O buffers" in str(err.value) and "128 of 128 columns" in str(err.value)


def test_user_error_when_tables_cannot_fit() -> None:
    tables = make_tables(20)
    # Our own capacity check, first (t0 fits no 2 GPUs of 64 MiB even row-wise).
    with pytest.raises(UserError, match=r"each GPU has 54\.4 MiB after a 15% reserve"):
        TorchRecPlanner().plan(tables, Topology(gpus=2, gpu_memory_bytes=64 * 2**20))
    # Weights fit in total, but not with the optimizer state and the I/O buffers at this
    # batch (the rule TorchRec counts too): the numbers, and the batch that would fit.
    with pytest.raises(UserError) as err:
        TorchRecPlanner().plan(tables, Topology(gpus=4, gpu_memory_bytes=256 * 2**20))
    text = str(err.value)
    assert "(weights 663.9 MiB + optimizer 14.0 MiB + I/O buffers " in text, text
    assert "4 GPUs hold 870.4 MiB" in text and "a batch of at most" in text
    # The batch it names passes the total check (packing may need less).
    batch = int(text.split("a batch of at most ")[1].split()[0])
    at = Topology(gpus=4, gpu_memory_bytes=256 * 2**20, batch_size_per_rank=batch)
    check_capacity(tables, at, splittable=True)
    plan = TorchRecPlanner().plan(tables, at.model_copy(update={"batch_size_per_rank": batch // 2}))
    assert plan.problems(tables) == []


def test_quiet_unless_verbose(caplog: pytest.LogCaptureFixture) -> None:
    tables = make_tables(5)
    topo = Topology(gpus=2, gpu_memory_bytes=GiB)
    with caplog.at_level(logging.INFO):
        TorchRecPlanner().plan(tables, topo)
    assert not [r for r in caplog.records if r.name.startswith("torchrec")]
    assert logging.getLogger("torchrec").level == logging.NOTSET


def test_default_proposer_list_also_works() -> None:
    tables = make_tables(12, seed=3)
    topo = Topology(gpus=4, gpu_memory_bytes=GiB, batch_size_per_rank=8192)
    fast = TorchRecPlanner().plan(tables, topo)
    full = TorchRecPlanner(threshold=None).plan(tables, topo)
    assert fast.problems(tables) == [] and full.problems(tables) == []


@settings(max_examples=15, deadline=None)
@given(
    full=st.booleans(),
    count=st.integers(1, 30),
    seed=st.integers(0, 10**6),
    gpus=st.integers(1, 8),
    slack=st.floats(0.8, 4.0),
    batch=st.sampled_from([1024, 65536]),
)
def test_never_over_memory(
    full: bool, count: int, seed: int, gpus: int, slack: float, batch: int
) -> None:
    """Either a valid plan within our validator's limit, or a UserError."""
    tables = make_tables(count, seed)
    sizing = Topology(gpus=gpus, gpu_memory_bytes=1, batch_size_per_rank=batch)
    sizes = [table_bytes(t, sizing) for t in tables]  # the memory rule, at this batch
    need = max(max(sizes), sum(sizes) / gpus)
    topo = Topology(
        gpus=gpus, gpu_memory_bytes=int(need * slack / 0.85) + 1, batch_size_per_rank=batch
    )
    try:
        plan = (TorchRecPlanner() if full else TorchRecTwCwPlanner()).plan(tables, topo)
    except UserError:
        event("UserError")
        return
    event("plan")
    assert plan.problems(tables) == [] and torchrec_problems(plan) == []
    assert all(used <= topo.usable_bytes for used in plan.memory_per_rank(tables))


def test_torchrec_packs_by_the_memory_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 tables on tight GPUs: packed by TorchRec's own storage estimate (half the
    row-wise state and fp16 outputs, docs/memory.md) a rank is over our validator's
    limit; packed by the memory rule (what the planner does) the plan is valid."""
    import random

    import shardwise.planner.baselines.torchrec as module

    rng = random.Random(1)
    tables = [
        TableSpec(
            name=f"t{i}",
            rows=rng.randint(10**5, 10**6),
            dim=rng.choice([64, 128, 256]),
            pooling_factor=rng.uniform(1, 5),
            dtype="fp16",
        )
        for i in range(8)
    ]
    sizing = Topology(gpus=4, gpu_memory_bytes=1, batch_size_per_rank=1024)
    sizes = [table_bytes(t, sizing) for t in tables]
    need = max(max(sizes), sum(sizes) / 4)
    topo = sizing.model_copy(update={"gpu_memory_bytes": int(need * 1.1 / 0.85)})
    plan = TorchRecTwCwPlanner(min_partition=32).plan(tables, topo)
    assert plan.problems(tables) == []

    class Shipped(TorchRecTwCwPlanner):
        def _estimators(self, specs: Any, topology: Any, tt: Any, constraints: Any) -> Any:
            from torchrec.distributed.planner.shard_estimators import (
                EmbeddingPerfEstimator,
                EmbeddingStorageEstimator,
            )

            return [
                EmbeddingPerfEstimator(topology=tt, constraints=constraints),
                EmbeddingStorageEstimator(topology=tt, constraints=constraints),
            ]

    class KeepsTorchRecs:
        def estimate(self, *args: Any, **kwargs: Any) -> None:
            pass

    monkeypatch.setattr(module, "memory_rule_estimator", lambda specs, topo: KeepsTorchRecs())
    with pytest.raises(UserError, match=r"not a valid plan:\n- rank \d needs"):
        Shipped(min_partition=32).plan(tables, topo)

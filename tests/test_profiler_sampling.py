"""Augmentation and task sampling: shapes, determinism, and the memory cap."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import make_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.tables import TableSpec
from shardwise.profiler.sampling import (
    AUGMENT_DIMS,
    CommTask,
    augment_tables,
    base_name,
    comm_task,
    compute_task,
    sample_comm_tasks,
    sample_compute_tasks,
)


def test_augment_every_table_at_every_dim() -> None:
    tables = make_tables(5)
    pool = augment_tables(tables)
    assert len(pool) == 5 * len(AUGMENT_DIMS)
    assert len({t.name for t in pool}) == len(pool)
    for t in pool:
        src = next(s for s in tables if s.name == base_name(t.name))
        assert t.name == f"{src.name}-d{t.dim}"
        assert (t.rows, t.pooling_factor, t.access_hist, t.dtype) == (
            src.rows,
            src.pooling_factor,
            src.access_hist,
            src.dtype,
        )
    assert {t.dim for t in pool} == set(AUGMENT_DIMS)
    assert base_name("x-d4-d16") == "x-d4" and base_name("plain") == "plain"


def test_augment_refuses_bad_dims() -> None:
    with pytest.raises(UserError, match="multiples of 4"):
        augment_tables(make_tables(1), dims=(4, 6))
    with pytest.raises(UserError, match="repeat"):
        augment_tables(make_tables(1), dims=(4, 4))


def test_compute_tasks_are_deterministic_and_prefix_stable() -> None:
    pool = augment_tables(make_tables(10))
    a = sample_compute_tasks(pool, 30, seed=7)
    assert a == sample_compute_tasks(pool, 30, seed=7)
    assert a[:10] == sample_compute_tasks(pool, 10, seed=7)
    assert a[20:] == sample_compute_tasks(pool, 10, seed=7, start=20)
    assert a != sample_compute_tasks(pool, 30, seed=8)
    sizes = Counter(len(task) for task in a)
    assert min(sizes) >= 1 and max(sizes) <= 15 and len(sizes) > 5
    for task in a:
        assert len({t.name for t in task}) == len(task)  # without replacement


def test_fp16_share_makes_whole_tasks_fp16() -> None:
    pool = augment_tables(make_tables(10))
    tasks = sample_compute_tasks(pool, 60, seed=1, fp16_share=0.5)
    dtypes = [{t.dtype for t in task} for task in tasks]
    assert all(len(d) == 1 for d in dtypes)  # one fused kernel has one precision
    share = sum(d == {"fp16"} for d in dtypes) / len(dtypes)
    assert 0.25 < share < 0.75
    assert all(t.dtype == "fp32" for task in sample_compute_tasks(pool, 20, seed=1) for t in task)


def test_compute_task_refuses_when_nothing_fits() -> None:
    big = [TableSpec(name="big", rows=10**6, dim=128, pooling_factor=1.0)]
    with pytest.raises(UserError, match="no table fits"):
        compute_task(big, seed=0, index=0, memory_cap_bytes=1000)
    with pytest.raises(UserError, match="empty"):
        compute_task([], seed=0, index=0)


tables_st = st.lists(
    st.builds(
        TableSpec,
        name=st.uuids().map(lambda u: f"t{u.hex[:12]}"),
        rows=st.integers(1, 2_000_000),
        dim=st.sampled_from([4, 8, 16, 32, 64, 128]),
        pooling_factor=st.floats(0, 100),
        dtype=st.sampled_from(["fp32", "fp16"]),
    ),
    min_size=1,
    max_size=40,
    unique_by=lambda t: t.name,
)


@settings(max_examples=60, deadline=None)
@given(
    pool=tables_st,
    cap=st.integers(1, 1 << 31),
    seed=st.integers(0, 2**32),
    index=st.integers(0, 10**6),
    max_tables=st.integers(1, 15),
    fp16=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_compute_task_never_exceeds_the_cap(
    pool: list[TableSpec], cap: int, seed: int, index: int, max_tables: int, fp16: float
) -> None:
    try:
        task = compute_task(pool, seed, index, max_tables, cap, fp16)
    except UserError:  # only when no table fits even alone
        elements = min(t.rows * t.dim for t in pool)
        assert elements * (2 if fp16 == 1.0 else 4) > cap
        return
    assert 1 <= len(task) <= max_tables
    assert sum(t.size_bytes for t in task) <= cap
    names = {t.name for t in pool}
    assert all(t.name in names for t in task)


def test_comm_tasks_shape_and_distribution() -> None:
    tasks = sample_comm_tasks(400, 3, (2, 4, 8), 1024, 0.02)
    assert tasks == sample_comm_tasks(400, 3, (2, 4, 8), 1024, 0.02)
    assert {t.world_size for t in tasks} == {2, 4, 8}
    dims = [d for t in tasks for d in t.dims]
    assert all(d % 4 == 0 and 0 <= d <= 1024 for d in dims)
    assert 0 in dims and 4 in dims and max(dims) > 512
    assert all(any(t.dims) for t in tasks)  # never an all-idle all-to-all
    no_delay = [t for t in tasks if not any(t.delays)]
    assert 0.15 < len(no_delay) / len(tasks) < 0.4
    delayed = [t for t in tasks if any(t.delays)]
    assert all(min(t.delays) == 0.0 and max(t.delays) <= 0.02 for t in delayed)
    assert comm_task(3, 17, (2, 4, 8), 1024, 0.02) == tasks[17]


def test_comm_task_validation() -> None:
    with pytest.raises(UserError, match=">= 2"):
        comm_task(0, 0, world_sizes=(1,))
    with pytest.raises(UserError, match="multiple of 4"):
        comm_task(0, 0, max_dim=10)
    with pytest.raises(ValueError, match="one entry per rank"):
        CommTask(world_size=2, dims=[4], delays=[0.0, 0.0])
    assert all(not any(t.delays) for t in sample_comm_tasks(20, 0, max_delay_s=0.0))

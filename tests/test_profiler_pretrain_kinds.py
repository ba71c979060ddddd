"""Pre-training samples of the other kinds: a rank's row ranges (at the global batch)
and data-parallel tables (at the local batch), recorded kernel by kernel, and trained
on one example per kernel."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import refused, shardwise
from conftest import make_tables
from pydantic import ValidationError

from shardwise.basics import UserError
from shardwise.planner.costmodel.features import TABLE_FEATURES
from shardwise.planner.kinds import even_row_split, row_slice
from shardwise.planner.tables import TableSpec, dump_tables
from shardwise.profiler.collect import load_features, measure_loads_sample, profile_compute
from shardwise.profiler.compute import ShardLoad
from shardwise.profiler.dataset.records import ComputeRecord, RecordScan, TableFeatures
from shardwise.profiler.dataset.store import CostDataset
from shardwise.profiler.fingerprint import current_fingerprint
from shardwise.profiler.pretrain.data import compute_data, kernel_records, split_compute
from shardwise.profiler.sampling import (
    DP_WORLDS,
    ROW_PARTS,
    augment_tables,
    compute_task,
    kind_task,
)

POOL = augment_tables(make_tables(12, seed=3))
LOG_BATCH = TABLE_FEATURES.index("log_batch")
LOG_ROWS = TABLE_FEATURES.index("log_rows")


# --------------------------------------------------------------------------- sampling


def test_row_tasks_are_pure_in_seed_and_index_and_cut_evenly() -> None:
    tasks = [kind_task(POOL, 5, i, row_share=1.0) for i in range(60)]
    assert tasks == [kind_task(POOL, 5, i, row_share=1.0) for i in range(60)]
    assert tasks[7] == kind_task(POOL, 5, 7, row_share=1.0)  # not the run's length
    assert tasks != [kind_task(POOL, 6, i, row_share=1.0) for i in range(60)]
    assert {t.parts for t in tasks} == set(ROW_PARTS)  # every cut is drawn
    assert len({t.rank for t in tasks}) > 5
    for task in tasks:
        assert task.kind == "row_wise" and task.tables
        assert 0 <= task.rank < task.parts and task.local_batch(1024) == 1024
        held = 0
        for spec, rr, load in zip(task.tables, task.ranges, task.loads(), strict=True):
            # range `rank` of TorchRec's even cut, never empty
            assert rr == even_row_split(spec.rows, task.parts)[task.rank]
            assert rr is not None and rr[1] > 0
            assert (load.row_offset, load.rows, load.group) == (rr[0], rr[1], "row_wise")
            assert not load.local_batch
            held += rr[1] * spec.dim * spec.bytes_per_element
        assert held <= 2 << 30  # the cap bounds the ranges the rank holds


def test_a_rank_whose_range_is_empty_everywhere_takes_range_zero() -> None:
    tiny = [TableSpec(name="tiny", rows=3, dim=8, pooling_factor=2.0)]
    for i in range(40):
        task = kind_task(tiny, 1, i, row_share=1.0)
        rr = task.ranges[0]
        assert rr is not None and rr[1] > 0
        assert rr == even_row_split(3, task.parts)[task.rank]
        if task.parts > 3:  # ranges 3.. of 3 rows are empty
            assert task.rank < 3


def test_data_parallel_tasks_mix_kinds_at_the_local_batch() -> None:
    tasks = [kind_task(POOL, 2, i, dp_share=1.0) for i in range(40)]
    assert tasks == [kind_task(POOL, 2, i, dp_share=1.0) for i in range(40)]
    assert {t.parts for t in tasks} == set(DP_WORLDS)
    assert any(not all(t.local) for t in tasks)  # ranks holding fused tables beside
    for task in tasks:
        assert task.kind == "data_parallel" and any(task.local)
        assert all(t.dtype == "fp32" for t in task.tables)  # DP runs fp32 only
        assert task.local_batch(4096) == 4096 // task.parts
        for load, local in zip(task.loads(), task.local, strict=True):
            assert load.local_batch is local and load.row_range is None
            assert load.group == ("data_parallel" if local else "fused")


def test_shares_split_the_tasks_and_leave_the_rest_as_before() -> None:
    tasks = [kind_task(POOL, 9, i, row_share=0.3, dp_share=0.2) for i in range(300)]
    kinds = [t.kind for t in tasks]
    assert 0.2 < kinds.count("row_wise") / 300 < 0.4
    assert 0.1 < kinds.count("data_parallel") / 300 < 0.3
    for i, task in enumerate(tasks):
        if task.kind == "fused":
            assert list(task.tables) == compute_task(POOL, 9, i)
    # no shares: every task is the compute task it always was
    assert all(list(kind_task(POOL, 9, i).tables) == compute_task(POOL, 9, i) for i in range(50))
    with pytest.raises(UserError, match="add up to more than 1"):
        kind_task(POOL, 9, 0, row_share=0.7, dp_share=0.4)
    with pytest.raises(UserError, match=r"row_share must be in \[0, 1\]"):
        kind_task(POOL, 9, 0, row_share=-0.1)


# --------------------------------------------------------------------------- records

# A compute record exactly as the profiler wrote it before row ranges existed.
OLD_LINE = (
    '{"index":0,"fingerprint":"fa5253a731b5f726","batch_size":256,"tables":[{"name":"t0-d8",'
    '"base":"t0","rows":1000,"dim":8,"cols":8,"pooling_factor":4.0,"access_hist":[1.0,0.0,'
    '0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0],"dtype":"fp32"}],'
    '"fwd_s":0.001,"bwd_s":0.002,"total_s":0.003,"fwd_cv":0.01,"bwd_cv":0.01,'
    '"total_cv":0.01,"repeats":10,"extra":{"allocator_mitigated":true,"reference_s":0.02}}'
)


def test_old_records_load_and_keep_their_text(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(OLD_LINE + "\n")
    (rec,) = list(RecordScan(path, "compute"))
    assert isinstance(rec, ComputeRecord)
    t = rec.tables[0]
    assert (t.table_rows, t.row_offset, t.group, t.local_batch) == (None, 0, "fused", False)
    assert t.row_range is None and rec.kernels() == []
    # written back byte for byte, so the dataset hash over old records is unchanged
    assert rec.model_dump_json() == OLD_LINE


def test_a_row_range_is_recorded_as_its_kernel_sees_it() -> None:
    spec = TableSpec(name="big-d16", rows=1000, dim=16, pooling_factor=8.0)
    f = load_features(ShardLoad(spec, 16, 750, 250, group="row_wise"))
    twin = row_slice(spec, 750, 250)
    assert (f.rows, f.pooling_factor, f.name) == (250, twin.pooling_factor, twin.name)
    assert (f.table_rows, f.row_offset, f.row_range, f.group) == (1000, 750, (750, 250), "row_wise")
    assert f.base == "big"  # a table's ranges share its train/test split
    assert TableFeatures.model_validate_json(f.model_dump_json()) == f
    dp = load_features(ShardLoad(spec, 16, group="data_parallel", local_batch=True))
    assert (dp.rows, dp.table_rows, dp.local_batch) == (1000, None, True)
    with pytest.raises(ValidationError, match="not inside the table's 1000 rows"):
        TableFeatures.model_validate({**f.model_dump(), "row_offset": 800})


def _record(index: int, tables: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "index": index,
        "fingerprint": "f",
        "batch_size": 1024,
        "tables": tables,
        "fwd_s": 0.010,
        "bwd_s": 0.020,
        "total_s": 0.030,
        "fwd_cv": 0.0,
        "bwd_cv": 0.0,
        "total_cv": 0.0,
        "repeats": 3,
        "extra": {"reference_s": 0.05, **extra},
    }


def _features(load: ShardLoad) -> dict[str, Any]:
    return load_features(load).model_dump(mode="json")


def test_a_malformed_kernel_list_is_refused_naming_the_line(tmp_path: Path) -> None:
    spec = TableSpec(name="a", rows=100, dim=8, pooling_factor=2.0)
    bad = _record(
        0,
        [_features(ShardLoad.whole(spec))],
        kernels=[{"group": "fused", "dtype": "fp32", "batch_size": 8, "tables": [3], "fwd_s": 0.1}],
    )
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(UserError, match=r"line 1: .*extra\.kernels\[0\]"):
        list(RecordScan(path, "compute"))


# --------------------------------------------------------------------------- pretrain data


def test_a_record_with_kernels_gives_one_example_per_kernel() -> None:
    a = TableSpec(name="a-d8", rows=4000, dim=8, pooling_factor=4.0)
    b = TableSpec(name="b-d16", rows=500, dim=16, pooling_factor=2.0)
    c = TableSpec(name="c-d32", rows=800, dim=32, pooling_factor=1.0)
    old = _record(0, [_features(ShardLoad.whole(c))])
    loads = [
        ShardLoad(a, 8, 0, 1000, group="row_wise"),
        ShardLoad.whole(b),
        ShardLoad(c, 32, group="data_parallel", local_batch=True),
    ]
    kernels = [
        {"group": "fused", "dtype": "fp32", "batch_size": 1024, "tables": [1], "fwd_s": 0.001,
         "bwd_s": 0.002},
        {"group": "data_parallel", "dtype": "fp32", "batch_size": 128, "tables": [2],
         "fwd_s": 0.003, "bwd_s": 0.004},
        {"group": "row_wise", "dtype": "fp32", "batch_size": 1024, "tables": [0],
         "fwd_s": 0.005, "bwd_s": 0.006},
    ]  # fmt: skip
    new = _record(1, [_features(s) for s in loads], kernels=kernels)
    new["extra"]["reference_s"] = 0.10  # measured while the host ran at half speed
    ComputeRecord.model_validate(new)  # what the profiler writes is a valid record

    data = compute_data([old, new])
    assert data.record_of == [0, 1, 1, 1]
    assert data.batch_sizes == [1024, 1024, 128, 1024]
    assert [sorted(b) for b in data.bases] == [["c"], ["b"], ["c"], ["a"]]
    assert data.mask.sum(1).tolist() == [1, 1, 1, 1]
    # each kernel at its own batch; the row range with the range's rows
    assert data.tables[2, 0, LOG_BATCH].item() == pytest.approx(math.log(128))
    assert data.tables[3, 0, LOG_ROWS].item() == pytest.approx(math.log(1000))
    # each kernel's own medians, drift-normalized by its record's reference
    k_old, k = 0.075 / 0.05, 0.075 / 0.10  # median reference / the record's
    assert data.y[0].exp().tolist() == pytest.approx([0.010 * k_old, 0.020 * k_old], rel=1e-5)
    assert data.y[2].exp().tolist() == pytest.approx([0.003 * k, 0.004 * k], rel=1e-5)
    assert data.y[3].exp().tolist() == pytest.approx([0.005 * k, 0.006 * k], rel=1e-5)
    # with the correction off (a calibration whose anchors it did not help): as measured
    raw = compute_data([old, new], drift=False)
    assert raw.y[2].exp().tolist() == pytest.approx([0.003, 0.004], rel=1e-5)
    # a table's ranges and copies stay on its side of the by-table split
    split = split_compute(data.bases, seed=0)
    assert len(split.train) + len(split.val) + len(split.test) == 4
    # the same kernels as records, for code that prices a record as one kernel
    flat = kernel_records([old, new])
    assert flat[0] is old and len(flat) == 4
    assert [(r["batch_size"], r["fwd_s"], len(r["tables"])) for r in flat[1:]] == [
        (1024, 0.001, 1),
        (128, 0.003, 1),
        (1024, 0.005, 1),
    ]
    assert flat[2]["tables"][0]["group"] == "data_parallel"
    assert "kernels" not in flat[3]["extra"] and flat[3]["extra"]["reference_s"] == 0.10


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def tables_file(tmp_path: Path) -> Path:
    path = tmp_path / "tables.yaml"
    path.write_text(dump_tables(make_tables(2, seed=1), "yaml"))
    return path


@pytest.mark.parametrize(
    ("value", "says"),
    [("1.5", "less than or equal to 1"), ("-0.2", "greater than or equal to 0")],
)
def test_the_row_wise_share_must_be_a_share(
    tables_file: Path, tmp_path: Path, value: str, says: str
) -> None:
    ran = shardwise(
        "profile", "compute", "--tables", tables_file, "--out", tmp_path / "c",
        "--row-wise-share", value,
    )  # fmt: skip
    refused(ran, "Invalid value for '--row-wise-share'", says)
    assert not (tmp_path / "c").exists()


def test_shares_adding_up_to_more_than_one_are_refused(tables_file: Path, tmp_path: Path) -> None:
    ran = shardwise(
        "profile", "compute", "--tables", tables_file, "--out", tmp_path / "c",
        "--row-wise-share", "0.8", "--data-parallel-share", "0.4",
    )  # fmt: skip
    refused(ran, "--row-wise-share 0.8 and --data-parallel-share 0.4 add up to more than 1")
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------- real kernels

SMALL = [t.model_copy(update={"rows": min(t.rows, 5_000)}) for t in make_tables(4, seed=8)]


@pytest.mark.slow
def test_profile_compute_measures_and_records_every_kind(tmp_path: Path) -> None:
    out = tmp_path / "c"
    # seed 7 draws one task of each kind first (the shares are tested above)
    summary = profile_compute(
        SMALL, out, 3, seed=7, batch_sizes=[64], max_tables=3, row_share=0.5, dp_share=0.3
    )
    assert summary.total == 3
    ds = CostDataset.open(out)
    assert ds.manifest.settings["row_wise_share"] == 0.5
    pool = augment_tables(SMALL)
    kinds = set()
    for rec in ds.models():
        assert isinstance(rec, ComputeRecord)
        task = kind_task(pool, 7, rec.index, 3, 2 << 30, 0.0, 0.5, 0.3)
        kinds.add(task.kind)
        assert rec.tables == [load_features(s) for s in task.loads()]
        kernels = rec.kernels()
        if task.kind == "fused":
            assert kernels == []  # written as it always was
            continue
        assert rec.extra["task"] == {"kind": task.kind, "parts": task.parts, "rank": task.rank}
        held = sorted(i for k in kernels for i in k.tables)
        assert held == list(range(len(rec.tables)))  # every shard in one kernel
        for k in kernels:
            assert k.fwd_s > 0 and k.bwd_s > 0
            assert {rec.tables[i].group for i in k.tables} == {k.group}
            assert k.batch_size == (64 // task.parts if k.group == "data_parallel" else 64)
    assert kinds == {"fused", "row_wise", "data_parallel"}
    # the same settings reopen it (and resume), another share is refused
    again = profile_compute(
        SMALL, out, 3, seed=7, batch_sizes=[64], max_tables=3, row_share=0.5, dp_share=0.3
    )
    assert (again.skipped, again.measured) == (3, 0)
    with pytest.raises(UserError, match="row_wise_share"):
        profile_compute(SMALL, out, 4, seed=7, batch_sizes=[64], max_tables=3, row_share=0.4)


@pytest.mark.slow
def test_measure_loads_sample_records_each_kernel(tmp_path: Path) -> None:
    a, b = SMALL[0], SMALL[1].model_copy(update={"dtype": "fp32"})
    loads = [
        ShardLoad(a, a.dim, *even_row_split(a.rows, 4)[1], group="row_wise"),
        ShardLoad(b, b.dim, group="data_parallel", local_batch=True),
    ]
    with CostDataset.create_or_open(tmp_path, "compute", current_fingerprint(None), {}) as ds:
        res = measure_loads_sample(ds, 3, loads, 128, 32, seed=0, warmups=1, iters=2)
    (rec,) = list(CostDataset.open(tmp_path).models())
    assert isinstance(rec, ComputeRecord) and rec.index == 3
    got = {k.group: (k.batch_size, k.tables, k.fwd_s) for k in rec.kernels()}
    want = {t.group: (t.batch_size, t.fwd_s) for t in res.kernel_times}
    assert got == {
        "row_wise": (128, [0], want["row_wise"][1]),
        "data_parallel": (32, [1], want["data_parallel"][1]),
    }
    assert rec.tables[0].row_range == even_row_split(a.rows, 4)[1]

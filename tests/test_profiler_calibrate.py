"""Calibration: what it measures, the speed factors, and a real short calibration that
is interrupted and resumed (tiny tables, tiny networks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shardwise.basics import UserError
from shardwise.planner.costmodel.artifact import CostModel, SpeedFactors, load_bundled
from shardwise.planner.costmodel.cache import ModelCache
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.plan import Topology, table_wise_plan
from shardwise.planner.tables import TableSpec, tables_signatures
from shardwise.profiler.calibrate import Budget, Job, PhaseProgress, calibrate
from shardwise.profiler.calibrate.heldout import group_indices
from shardwise.profiler.calibrate.speed import fit_speed, predict_compute
from shardwise.profiler.calibrate.tasks import (
    CalibrationTasks,
    feasible_batches,
    split_tables,
)
from shardwise.profiler.compute import ShardLoad, footprint_bytes
from shardwise.profiler.dataset import RECORDS_FILE, CostDataset
from shardwise.profiler.fingerprint import current_fingerprint
from shardwise.profiler.sampling import augment_by_halvings, base_name, batches_around, halvings

TINY = tuple(
    TableSpec(name=f"t{i}", rows=rows, dim=dim, pooling_factor=pool)
    for i, (rows, dim, pool) in enumerate(
        [(2000, 16, 3.0), (5000, 32, 5.0), (800, 8, 1.5), (3000, 16, 8.0)]
    )
)
GIB = 2**30


def with_factors(model: CostModel, **factors: float) -> CostModel:
    metadata = json.loads(json.dumps(model.metadata))
    metadata["calibration"] = {"speed_factors": {**SpeedFactors().to_dict(), **factors}}
    return CostModel(model.compute, model.comm, metadata)


# --------------------------------------------------------------------------- sampling


def test_halvings_and_batches() -> None:
    assert halvings(96) == [96, 48, 24, 12]
    assert halvings(128) == [128, 64, 32, 16, 8, 4]
    assert halvings(12) == [12]
    assert batches_around(1024) == [512, 1024, 2048]
    assert batches_around(1) == [1, 2]
    pool = augment_by_halvings(TINY[:2])
    assert [(base_name(t.name), t.dim) for t in pool] == [
        ("t0", 16), ("t0", 8), ("t0", 4), ("t1", 32), ("t1", 16), ("t1", 8), ("t1", 4),
    ]  # fmt: skip


def test_tasks_are_pure_and_split_by_table() -> None:
    job = Job(TINY, gpus=2, batch_per_rank=16, seed=3)
    a = CalibrationTasks(job, [16, 32, 64], 4 * GIB)
    b = CalibrationTasks(job, [16, 32, 64], 4 * GIB)
    split = a.split
    assert split == split_tables([t.name for t in TINY], 3)
    assert len(split.test) == 1 and len(split.val) == 1 and len(split.train) == 2
    assert not set(split.test) & set(split.val) | set(split.test) & set(split.train)
    kinds = {a.kind(i) for i in range(40)}
    assert kinds == {"train", "val", "test"}  # no reference set given
    for i in range(60):
        task = a.task(i)
        assert task == b.task(i)  # a resumed run draws the same sample
        assert task == a.task(i)
        bases = {base_name(t.name) for t in task.tables}
        role = {"train": split.train, "val": split.val, "test": split.test}[task.kind]
        assert bases <= set(role), (i, task.kind, bases)
        assert 1 <= len(task.tables) <= 15
        if task.kind == "test":
            assert task.batch_size == 32  # plan-like kernels at the job's batch
        assert task.batch_size in (16, 32, 64)
        for t in task.tables:
            own = next(s for s in TINY if s.name == base_name(t.name))
            assert t.dim in halvings(own.dim) and t.rows == own.rows
    speed = [a.speed_task(i) for i in range(10)]
    assert all(t.batch_size == 32 for t in speed)
    assert all({x.name for x in t.tables} <= set(split.train) for t in speed)


def test_groups_fit_the_memory_limit() -> None:
    big = tuple(
        TableSpec(name=f"b{i}", rows=1_000_000, dim=64, pooling_factor=2.0) for i in range(6)
    )
    job = Job(big, gpus=2, batch_per_rank=64)
    limit = 700 * 2**20  # two of these tables at full width (260 MB each with state)
    tasks = CalibrationTasks(job, feasible_batches(job, limit), limit)
    for i in range(40):
        task = tasks.task(i)
        shards = [ShardLoad.whole(t) for t in task.tables]
        assert len(shards) >= 1 and footprint_bytes(shards, task.batch_size) <= limit
        assert sum(t.dim == 64 for t in task.tables) <= 2


def test_an_infeasible_batch_names_the_table_and_the_largest_batch() -> None:
    job = Job(
        (TINY[0], TableSpec(name="wide", rows=1_000_000, dim=128, pooling_factor=4.0)),
        gpus=8,
        batch_per_rank=1_000_000,
    )
    with pytest.raises(UserError, match=r"'wide'.*largest feasible global batch is about (\d+)"):
        feasible_batches(job, 4 * GIB)
    try:
        feasible_batches(job, 4 * GIB)
    except UserError as e:
        suggested = int(str(e).split("--batch-per-rank ")[-1].split()[0])
    # the suggestion fits, one more per rank at that size does not overrun by much
    fits = Job(job.tables, 8, suggested)
    assert feasible_batches(fits, 4 * GIB)[-1] >= fits.global_batch
    huge = TableSpec(name="huge", rows=300_000_000, dim=128, pooling_factor=1.0)
    with pytest.raises(UserError, match="'huge'.*cannot be profiled on this machine"):
        feasible_batches(Job((huge,), 8, 128), 4 * GIB)
    # the double batch is left out when only it does not fit
    snug = Job((TableSpec(name="s", rows=1000, dim=128, pooling_factor=1.0),), 1, 2_500_000)
    assert feasible_batches(snug, 4 * GIB) == [1_250_000, 2_500_000]


def test_a_budget_too_short_for_any_sample() -> None:
    with pytest.raises(UserError, match="too short for any sample"):
        Budget(5.0)
    assert Budget(600).speed_s == 60 and Budget(60).speed_s == 12
    assert Budget(600).finetune_s == 60 and Budget(60).finetune_s == 8


# --------------------------------------------------------------------------- speed factors


def test_speed_factors_are_applied_by_the_predictor(tmp_path: Path) -> None:
    base = load_bundled()
    doubled = with_factors(base, fwd=2.0, bwd=3.0, comm=4.0)
    sets = [[(TINY[0], 16), (TINY[1], 8)], [(TINY[2], 8)]]
    one = CostPredictor(base).compute(sets, 1024)
    two = CostPredictor(doubled).compute(sets, 1024)
    np.testing.assert_allclose(two[:, 0], 2 * one[:, 0], rtol=1e-9)
    np.testing.assert_allclose(two[:, 1], 3 * one[:, 1], rtol=1e-9)
    # comm: the transfer is scaled, the straggler wait (other ranks' compute) is not
    f1, b1 = CostPredictor(base).comm([16, 32], [0.0, 0.01], 128)
    f4, b4 = CostPredictor(doubled).comm([16, 32], [0.0, 0.01], 128)
    np.testing.assert_allclose(b4, 4 * b1, rtol=1e-9)
    np.testing.assert_allclose(f4 - [0.01, 0.0], 4 * (f1 - [0.01, 0.0]), rtol=1e-6)
    # the factors survive the file, and a whole plan's prediction carries them
    doubled.save(tmp_path / "m.pt")
    loaded = CostModel.load(tmp_path / "m.pt")
    assert loaded.speed_factors == SpeedFactors(2.0, 3.0, 4.0)
    topology = Topology(gpus=2, gpu_memory_bytes=GIB)
    plan = table_wise_plan(list(TINY), [0, 1, 0, 1], topology, "round-robin")
    p1 = CostPredictor(base).predict_plan(plan, list(TINY), 64)
    p2 = CostPredictor(loaded).predict_plan(plan, list(TINY), 64)
    for r1, r2 in zip(p1.ranks, p2.ranks, strict=True):
        assert r2.fwd_compute_s == pytest.approx(2 * r1.fwd_compute_s)
        assert r2.bwd_compute_s == pytest.approx(3 * r1.bwd_compute_s)
    assert p2.model["speed_factors"] == {"fwd": 2.0, "bwd": 3.0, "comm": 4.0}
    assert "speed_factors" not in p1.model


@pytest.mark.parametrize(
    ("key", "value"),
    [("fwd", math.nan), ("bwd", -1.0), ("comm", 0.0), ("fwd", math.inf), ("bwd", "2")],
)
def test_a_bad_speed_factor_is_refused_naming_the_field(
    tmp_path: Path, key: str, value: object
) -> None:
    import torch

    payload = load_bundled().to_payload()
    payload["metadata"]["calibration"] = {
        "speed_factors": {"fwd": 1.0, "bwd": 1.0, "comm": 1.0, key: value}
    }
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(UserError, match=rf"metadata\.calibration\.speed_factors\.{key} is"):
        CostModel.load(tmp_path / "bad.pt")


def test_the_speed_fit_is_the_median_ratio_and_ignores_outliers() -> None:
    base = load_bundled()
    rng = np.random.default_rng(0)
    pool = augment_by_halvings(TINY)
    records = []
    for _ in range(25):
        tables = [pool[int(j)] for j in rng.choice(len(pool), 3, replace=False)]
        records.append(
            {
                "batch_size": 1024,
                "tables": [
                    {**t.model_dump(), "cols": t.dim, "access_hist": list(t.access_hist)}
                    for t in tables
                ],
            }
        )
    pred = predict_compute(base, records)
    noise = np.exp(rng.normal(0, 0.05, (25, 2)))
    for r, (f, b), (nf, nb) in zip(records, pred, noise, strict=True):
        r["fwd_s"], r["bwd_s"] = 3.0 * f * nf, 5.0 * b * nb
    records[0]["fwd_s"] *= 40  # a kernel caught by a noisy neighbour
    records[1]["bwd_s"] /= 40
    fit = fit_speed(base, records)
    assert fit.factors.fwd == pytest.approx(3.0, rel=0.05)
    assert fit.factors.bwd == pytest.approx(5.0, rel=0.05)
    assert fit.factors.comm == 1.0 and fit.comm_samples == 0
    # a calibrated model's own factors are corrected, not replaced
    again = fit_speed(with_factors(base, fwd=1.5, bwd=10.0), records)
    assert again.factors.fwd == pytest.approx(3.0, rel=0.05)
    assert again.factors.bwd == pytest.approx(5.0, rel=0.05)


def test_group_indices() -> None:
    assert group_indices(4, 2, 0) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    many = group_indices(30, 8, 0, limit=50)
    assert len(many) == len(set(many)) == 50 and all(len(g) == 8 for g in many)
    assert group_indices(3, 8, 0) == [(0, 1, 2)]


# --------------------------------------------------------------------------- end to end


def test_calibrate_end_to_end_interrupted_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real, short calibration: Ctrl-C in the measuring phase keeps every sample, the
    same call resumes without measuring any twice, and the model carries its factors."""
    monkeypatch.setenv("SHARDWISE_MODEL_CACHE", str(tmp_path / "cache"))
    job = Job(TINY, gpus=2, batch_per_rank=16, seed=1)
    work = tmp_path / "work"
    base = load_bundled()
    seen: list[str] = []

    def stop_after_seven(p: PhaseProgress) -> None:
        if p.phase == "measure":
            seen.append(p.text)
            if len(seen) == 7:
                raise KeyboardInterrupt

    kwargs = {"max_samples": 30, "speed_samples": 8, "tiny": True}
    with pytest.raises(KeyboardInterrupt):
        calibrate(job, base, "bundled", work, Budget(45), on_progress=stop_after_seven, **kwargs)
    first = CostDataset.open(work / "compute").load()
    assert [r["index"] for r in first] == list(range(7))
    assert len(CostDataset.open(work / "speed").load()) == 8

    result = calibrate(job, base, "bundled", work, Budget(45), **kwargs)
    lines = (work / "compute" / RECORDS_FILE).read_text().splitlines()
    indices = [json.loads(line)["index"] for line in lines]
    assert sorted(indices) == list(range(30))  # none lost, none measured twice
    records = CostDataset.open(work / "compute").by_index()
    assert all(records[r["index"]] == r for r in first)  # the first run's samples kept
    assert len(CostDataset.open(work / "speed").load()) == 8  # nothing re-measured
    assert sum(n for (kind, _), n in result.measured.items() if kind != "speed") == 23
    kinds = {r["extra"]["kind"] for r in records.values()}
    assert kinds == {"train", "val", "test", "reference"}
    assert {r["batch_size"] for r in records.values()} == {16, 32, 64}

    cal = result.model.metadata["calibration"]
    fp = current_fingerprint()
    assert cal["fingerprint_key"] == fp.key()
    assert result.model.metadata["fingerprint"] == fp.to_dict()
    assert cal["tables"] == tables_signatures(TINY)
    assert cal["base"] == "bundled" and cal["samples"] == {"compute": 38, "comm": 0}
    assert set(cal["speed_factors"]) == {"fwd", "bwd", "comm"}
    assert all(v > 0 and math.isfinite(v) for v in cal["speed_factors"].values())
    assert cal["speed_factors"]["comm"] == 1.0  # 9 s of speed phase: no all-to-all
    assert cal["phases"] in (["speed"], ["speed", "finetune"])
    held = cal["metrics"]
    assert held["test_tables"] == 1 and held["final"]["kernels"] == len(
        [r for r in records.values() if r["extra"]["kind"] == "test"]
    )
    assert held["final"]["kernel_mape"] is not None
    assert result.model.speed_factors == SpeedFactors(**cal["speed_factors"])
    # the speed factors alone move the bundled model's median error towards 1
    before, after = held["base"]["median_ratio"], held["speed_only"]["median_ratio"]
    assert abs(math.log(after)) <= abs(math.log(before)) + 0.1

    stored = ModelCache().store(result.model, fp.key())
    choice = ModelCache().select(fp.key(), list(TINY), lambda line: None)
    assert choice.path == stored and choice.holds_here
    assert choice.model.speed_factors == result.model.speed_factors

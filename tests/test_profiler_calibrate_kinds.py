"""Calibration on mixed-kind ranks: plan ranks with row-wise slices and data-parallel
copies are sampled reproducibly and saved, slices and copies are anchored, the rank head
is fitted on every kernel a rank runs, and the verdict (and a plan's warning) speaks of
each kind."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import flat, shardwise

from shardwise.planner.costmodel.artifact import CostModel, load_bundled
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.costmodel.rankhead import (
    CHANNELS,
    COUNT,
    SOLO_BWD,
    SOLO_FWD,
    RankHead,
    kind_warnings,
    rank_head_from_json,
    reliability_warning,
)
from shardwise.planner.kinds import even_row_split, row_slice
from shardwise.planner.plan import Plan, Shard
from shardwise.planner.tables import TableSpec, dump_tables, table_signature
from shardwise.planner.topology import Topology
from shardwise.profiler.calibrate import plans
from shardwise.profiler.calibrate.anchors import anchor_tasks, anchors_of, plain_anchor
from shardwise.profiler.calibrate.heldout import MIN_RANKS, kind_metrics, verdict
from shardwise.profiler.calibrate.plans import (
    dp_candidates,
    load_rank_tasks,
    plan_rank_tasks,
    rowwise_plan,
    save_rank_tasks,
    side_world,
)
from shardwise.profiler.calibrate.rankfit import fit_fusion, predict_samples, samples_of
from shardwise.profiler.calibrate.shards import RankShard, parse_shard, rank_kernels
from shardwise.profiler.calibrate.tasks import Job, split_tables

GIB = 2**30
MANY = tuple(
    TableSpec(
        name=f"m{i:02d}",
        rows=500 + 300 * i,
        dim=(16, 32, 64, 24)[i % 4],
        pooling_factor=1.0 + (i * 7) % 9,
        dtype="fp16" if i % 5 == 4 else "fp32",
    )
    for i in range(20)
)
BY_NAME = {t.name: t for t in MANY}
#: Generators that need neither TorchRec nor a cost model (fast and deterministic).
QUICK = ("rowwise", "random", "halves", "rowwise", "size-greedy")


def quick_tasks(job: Job, rounds: int, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    monkeypatch.setattr(plans, "GENERATORS", QUICK)
    return plan_rank_tasks(job, split_tables(job.tables, job.seed, job.global_batch), rounds, None)


# --------------------------------------------------------------------------- tasks


def test_mixed_kind_rank_tasks_are_reproducible_and_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = Job(MANY, gpus=4, batch_per_rank=128, seed=1)
    split = split_tables(job.tables, job.seed, job.global_batch)
    tasks = quick_tasks(job, 10, monkeypatch)
    assert tasks == quick_tasks(job, 10, monkeypatch)  # pure in the job and the seed
    kinds = Counter((t.kind, e[4]) for t in tasks for e in {tuple(e) for e in t.extra["shards"]})
    assert kinds[("rank", "row_wise")] and kinds[("heldout", "row_wise")]
    assert kinds[("rank", "data_parallel")]
    worlds = {
        "rank": side_world(job, len(split.train)),
        "heldout": side_world(job, len(split.test)),
    }
    for t in tasks:
        names = set(split.train if t.kind == "rank" else split.test)
        assert len(t.loads) == len(t.extra["shards"]) and not t.tables
        assert t.batch_size == job.global_batch and t.local_batch == job.batch_per_rank
        for entry, load in zip(t.extra["shards"], t.loads, strict=True):
            name, cols, offset, rows, kind = entry
            assert name in names and load.spec == BY_NAME[name] and load.cols == cols
            if kind == "row_wise":  # a range of TorchRec's even cut over the side's GPUs
                assert (offset, rows) in even_row_split(BY_NAME[name].rows, worlds[t.kind])
                assert (load.row_offset, load.rows, load.group) == (offset, rows, "row_wise")
            elif kind == "data_parallel":
                assert load.local_batch and load.group == "data_parallel"
                assert BY_NAME[name].dtype == "fp32"
            else:
                assert load.rows is None and load.group == "fused" and not load.local_batch
    path = tmp_path / "ranks.json"
    save_rank_tasks(path, job, tasks)
    assert load_rank_tasks(path, job) == tasks
    # an entry written as [table, cols] (before kinds) still reads as a fused shard
    doc = json.loads(path.read_text())
    fused = next(e for e in doc["tasks"] if all(s[4] == "table_wise" for s in e["shards"]))
    fused["shards"] = [s[:2] for s in fused["shards"]]
    path.write_text(json.dumps(doc))
    again = load_rank_tasks(path, job)
    assert again is not None and [t.loads for t in again] == [t.loads for t in tasks]


def test_rowwise_plans_cut_heavy_tables_and_copy_small_fp32_ones() -> None:
    topology = Topology(gpus=4, gpu_memory_bytes=GIB, batch_size_per_rank=256)
    rng = np.random.default_rng(3)
    seen: Counter[str] = Counter()
    heavy = sorted(MANY, key=lambda t: -t.pooling_factor * (t.dim + 8))[:8]
    small = {MANY[i].name for i in dp_candidates(MANY, len(MANY))[:4]}
    for _ in range(20):
        plan = rowwise_plan(MANY, topology, rng)
        assert plan is not None and not plan.problems(MANY)
        rw = [t for t in plan.tables if t.kind == "row_wise"]
        dp = [t for t in plan.tables if t.kind == "data_parallel"]
        assert 1 <= len(rw) <= 2 and {t.name for t in rw} <= {t.name for t in heavy}
        assert len(dp) <= 2 and all(BY_NAME[t.name].dtype == "fp32" for t in dp)
        assert {t.name for t in dp} <= small
        seen.update(t.kind for t in plan.tables)
    assert seen["data_parallel"] and seen["row_wise"]
    assert rowwise_plan(MANY, Topology(gpus=1, gpu_memory_bytes=GIB), rng) is None


# --------------------------------------------------------------------------- anchors


def anchor_record(task: Any, fwd: float, bwd: float) -> dict[str, Any]:
    return {"fwd_s": fwd, "bwd_s": bwd, "extra": {"kind": "anchor", **task.extra}}


def test_slices_and_dp_copies_are_anchored() -> None:
    job = Job(MANY, gpus=4, batch_per_rank=128, seed=1)
    tasks = anchor_tasks(job, 4 * GIB, worlds=[3, 2])
    slices = [t for t in tasks if "rows" in t.extra]
    copies = [t for t in tasks if "local_batch" in t.extra]
    heaviest = tasks[2].extra["table"]  # the first whole table is the heaviest
    cuts = {(t.extra["table"], t.extra["rows"]) for t in slices}
    for w in (2, 3, 4):  # range 0 of the job's cut and of each side's
        assert (heaviest, even_row_split(BY_NAME[heaviest].rows, w)[0][1]) in cuts
    assert all(t.loads[0].group == "row_wise" and t.batch_size == job.global_batch for t in slices)
    assert {t.extra["table"] for t in copies} == {
        MANY[i].name for i in dp_candidates(MANY, 2)
    }  # the smallest fp32 tables
    assert all(t.local_batch == job.batch_per_rank and t.loads[0].local_batch for t in copies)
    records = [anchor_record(t, 1e-3 * (i + 1), 2e-3 * (i + 1)) for i, t in enumerate(tasks[2:])]
    assert not any(plain_anchor(r) for r in records if "rows" in r["extra"])
    anchors = anchors_of(records, MANY)
    local = anchors_of(records, MANY, local=True)
    first = slices[0]
    spec = BY_NAME[first.extra["table"]]
    twin = row_slice(spec, first.extra["row_offset"], first.extra["rows"])
    assert table_signature(twin) in anchors and table_signature(spec) in anchors
    dp = BY_NAME[copies[0].extra["table"]]
    assert set(local) == {table_signature(BY_NAME[t.extra["table"]]) for t in copies}
    # the head prices a plan's slice and its copy from them, measured (spread 0)
    head = RankHead(
        batch=job.global_batch,
        anchors=anchors,
        local_batch=job.batch_per_rank,
        local_anchors=local,
        sigma=0.05,
    )
    model = with_head(head)
    predictor = CostPredictor(model)
    got, spread = predictor.solo([(twin, spec.dim), (dp, dp.dim)], job.global_batch)
    assert got[0].tolist() == pytest.approx(list(anchors[table_signature(twin)][spec.dim]))
    assert spread[0] == 0.0
    # at the global batch the table is its whole anchor, at the batch per rank its copy's
    assert got[1].tolist() == pytest.approx(list(anchors[table_signature(dp)][dp.dim]))
    got, spread = predictor.solo([(dp, dp.dim)], job.batch_per_rank)
    assert got[0].tolist() == pytest.approx(list(local[table_signature(dp)][dp.dim]))
    assert spread[0] == 0.0
    # without its local anchor, a copy is scaled from the global one (and less certain)
    bare = CostPredictor(with_head(RankHead(batch=job.global_batch, anchors=anchors)))
    assert bare.solo([(dp, dp.dim)], job.batch_per_rank)[1][0] == head.sigma_scaled
    # the head survives the file; a head stored before local anchors still loads
    back = rank_head_from_json(json.loads(json.dumps(head.to_json())))
    assert back.local_batch == job.batch_per_rank and back.local_anchors == local
    old = head.to_json()
    del old["local_batch"], old["local_anchors"]
    assert rank_head_from_json(old).local_anchors == {}


def with_head(head: RankHead) -> CostModel:
    model = load_bundled()
    metadata = copy.deepcopy(model.metadata)
    metadata.setdefault("calibration", {})["rank_head"] = head.to_json()
    return CostModel(model.compute, model.comm, metadata, "a test model")


# --------------------------------------------------------------------------- the fit


def solo(spec: TableSpec, cols: int, batch: int) -> tuple[float, float]:
    """A made-up machine: a kernel's parts cost their lookups and width."""
    work = batch * spec.pooling_factor * (cols + 8) * 1e-9
    return work, 2 * work


def fake_channels(shards: Any, batch: int) -> Any:
    out = np.zeros((len(shards), len(CHANNELS)))
    for i, (spec, cols) in enumerate(shards):
        out[i, SOLO_FWD], out[i, SOLO_BWD] = solo(spec, cols, batch)
        out[i, COUNT] = 1.0
    return out


def test_rankfit_on_mixed_kind_ranks_recovers_a_known_factor() -> None:
    """Every kernel a rank runs (fused, row-wise at the global batch, data-parallel at
    the batch per rank) costs 1.3x its parts here: the fit finds 1.3 from whole-rank
    totals, which it can only if each kernel is priced at its own batch."""
    job = Job(MANY, gpus=4, batch_per_rank=128, seed=1)
    rng = np.random.default_rng(0)
    records = []
    for i in range(40):
        names = [str(n) for n in rng.choice([t.name for t in MANY], size=6, replace=False)]
        shards = [RankShard(n, BY_NAME[n].dim) for n in names[:3]]
        rows = BY_NAME[names[3]].rows
        offset, n = even_row_split(rows, 4)[int(rng.integers(4))]
        shards.append(RankShard(names[3], BY_NAME[names[3]].dim, offset, n, "row_wise"))
        fp32 = [x for x in names[4:] if BY_NAME[x].dtype == "fp32"]
        shards += [RankShard(x, BY_NAME[x].dim, kind="data_parallel") for x in fp32[:1]]
        kernels = rank_kernels(shards, BY_NAME, job.global_batch, job.batch_per_rank)
        parts = [solo(s, c, k.batch) for k in kernels for s, c in k.shards]
        fwd, bwd = (1.3 * sum(p[j] for p in parts) for j in (0, 1))
        extra = {"plan": f"p{i % 6}", "shards": [s.to_json(BY_NAME[s.table]) for s in shards]}
        records.append({"fwd_s": fwd, "bwd_s": bwd, "extra": extra})
    samples = samples_of(records, job, fake_channels)
    assert all(s.kernels.shape[0] >= 2 for s in samples)  # fused + row-wise (+ DP) kernels
    assert any("data_parallel" in s.kinds for s in samples)
    fit = fit_fusion(samples, select=False)
    assert math.exp(fit.fwd.bias) == pytest.approx(1.3, rel=1e-3)
    assert math.exp(fit.bwd.bias) == pytest.approx(1.3, rel=1e-3)
    pred = predict_samples(fit, samples).sum(axis=1)
    assert pred == pytest.approx([sum(s.measured) for s in samples], rel=1e-3)
    # copies priced at the global batch (512, not 128) would not fit one factor
    wrong = samples_of(records, Job(MANY, gpus=1, batch_per_rank=512, seed=1), fake_channels)
    off = predict_samples(fit_fusion(wrong, select=False), wrong).sum(axis=1)
    assert max(abs(np.log(off / [sum(s.measured) for s in wrong]))) > 0.01
    # an old two-entry shard reads as fused
    assert parse_shard(["m03", 12], BY_NAME) == RankShard("m03", 12, kind="column_wise")


# --------------------------------------------------------------------------- verdict


def test_the_verdict_has_a_level_per_kind() -> None:
    rng = np.random.default_rng(1)
    n = 30
    kinds = [frozenset({"table_wise"})] * 18 + [frozenset({"table_wise", "row_wise"})] * 10
    kinds += [frozenset({"data_parallel", "table_wise"})] * 2
    meas = rng.uniform(1e-3, 5e-3, n)
    pred = meas * np.exp(rng.normal(0, 0.03, n))
    for i, k in enumerate(kinds):
        if "row_wise" in k:
            pred[i] = meas[i] * 1.4  # row-wise ranks priced 40 % high
    plans_ = [f"p{i % 5}" for i in range(n)]
    fitted = [frozenset({"table_wise", "row_wise"})] * 4
    metrics = kind_metrics(pred, meas, plans_, kinds, fitted)
    assert metrics["row_wise"]["ranks"] == 10 and metrics["row_wise"]["fitted"] == 4
    assert metrics["row_wise"]["sigma"] == pytest.approx(math.log(1.4), rel=1e-6)
    assert metrics["data_parallel"]["ranks"] == 2 and metrics["table_row_wise"]["ranks"] == 0
    final = {"ranks": n, "plans": 5, "sigma": 0.05, "rank_spearman": 0.95}
    got = verdict(final, kinds=metrics)
    assert got["level"] == "reliable"  # overall: the many fused ranks hide the row-wise error
    levels = {k: v["level"] for k, v in got["kinds"].items()}
    assert levels["row_wise"] == "unreliable"  # 40 % off on its own ranks
    assert levels["table_wise"] == "reliable"  # over its 18 ranks of fused shards alone
    assert metrics["table_wise"]["ranks"] == 18
    assert levels["data_parallel"] == "unjudged" and levels["table_row_wise"] == "unjudged"
    assert f"needs {MIN_RANKS}" in got["kinds"]["data_parallel"]["text"]
    # what a plan that uses those kinds says
    meta = {"calibration": {"verdict": got}}
    lines = kind_warnings(meta, ["table_wise", "row_wise", "data_parallel"])
    assert len(lines) == 2 and "row-wise ranks only within ±34%" in lines[0]
    assert "data-parallel prices are unjudged" in lines[1] and "measured 2 held-out" in lines[1]
    assert kind_warnings(meta, ["table_wise", "column_wise"]) == []
    assert reliability_warning(meta) is None  # the overall verdict alone is no warning
    assert "unjudged" in (reliability_warning(meta, ["data_parallel"]) or "")
    # a calibration that predates judging kinds: its split kinds are unjudged
    old = {"calibration": {"verdict": {"level": "reliable", "sigma": 0.05}}}
    assert "predates" in kind_warnings(old, ["row_wise"])[0]
    assert kind_warnings({}, ["row_wise"]) == []  # uncalibrated: the calibrate note says it


# --------------------------------------------------------------------------- the CLI


def no_row_wise_model(tmp_path: Path) -> Path:
    """The bundled model with a calibration whose verdict measured no row-wise rank."""
    model = load_bundled()
    metadata = copy.deepcopy(model.metadata)
    kinds = {
        "table_wise": {"level": "reliable", "ranks": 20, "fitted": 60, "sigma": 0.05},
        "row_wise": {"level": "unjudged", "ranks": 0, "fitted": 0, "sigma": None},
        "table_row_wise": {"level": "unjudged", "ranks": 0, "fitted": 0, "sigma": None},
    }
    metadata["calibration"] = {
        "verdict": {"level": "reliable", "sigma": 0.05, "text": "", "kinds": kinds}
    }
    path = tmp_path / "model.pt"
    CostModel(model.compute, model.comm, metadata).save(path)
    return path


def oversized_job(tmp_path: Path) -> Path:
    """Two light tables and one that no 1 MiB GPU holds whole: a plan goes row-wise."""
    tables = [
        TableSpec(name="big", rows=12_000, dim=32, pooling_factor=4.0),
        TableSpec(name="a", rows=200, dim=16, pooling_factor=2.0),
        TableSpec(name="b", rows=300, dim=16, pooling_factor=3.0),
    ]
    path = tmp_path / "tables.yaml"
    path.write_text(dump_tables(tables, "yaml"))
    return path


def test_a_plan_that_goes_row_wise_says_its_row_wise_prices_are_unjudged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `shardwise plan` prints after planning (:func:`warn_plan_kinds`): the model's
    calibration measured 0 row-wise ranks, and the plan made for the job cuts a table
    by rows."""
    from shardwise.cli._common import warn_plan_kinds
    from shardwise.planner.base import PlannerOptions
    from shardwise.planner.registry import get_planner
    from shardwise.planner.tables import load_tables

    model = CostModel.load(no_row_wise_model(tmp_path))
    tables = load_tables(oversized_job(tmp_path))
    topology = Topology(gpus=2, gpu_memory_bytes=2**20, batch_size_per_rank=64)
    plan = get_planner("size-greedy", PlannerOptions()).plan(tables, topology)
    split = {t.kind for t in plan.tables} - {"table_wise", "column_wise"}
    assert split & {"row_wise", "table_row_wise"}, plan.kinds()
    line = warn_plan_kinds(CostPredictor(model), plan)
    assert line is not None and "row-wise prices are unjudged" in line
    assert "measured 0 held-out" in line and f"needs {MIN_RANKS}" in line
    assert "unjudged" in capsys.readouterr().err
    # the same model on a plan of whole tables says nothing
    whole = Plan.from_shards(
        tables[1:], [[Shard(rank=0, cols=16)], [Shard(rank=1, cols=16)]], topology, "test"
    )
    assert warn_plan_kinds(CostPredictor(model), whole) is None


def test_shardwise_plan_prints_the_unjudged_line(tmp_path: Path) -> None:
    model = no_row_wise_model(tmp_path)
    tables = oversized_job(tmp_path)
    ran = shardwise(
        "plan", tables, "--gpus", "2", "--gpu-memory", "1MiB", "--batch-per-rank", "64",
        "--planner", "size-greedy", "--model", model, "--refine", "none",
        "--out", tmp_path / "plan.json",
    )  # fmt: skip
    assert ran.code == 0, ran.stderr
    text = flat(ran.stderr)
    assert "row-wise prices are unjudged" in text and "measured 0 held-out" in text


# --------------------------------------------------------------------------- comm


def test_the_comm_phase_times_collectives_sized_like_the_job() -> None:
    from shardwise.profiler.calibrate.measure import comm_cases

    job = Job(MANY, gpus=4, batch_per_rank=128, seed=1)
    cases = comm_cases(job)
    widest = max(t.dim for t in MANY)
    small = [MANY[i] for i in dp_candidates(MANY, len(cases))]
    for i, case in enumerate(cases):
        (d,) = case.reduce_scatter
        assert d % 4 == 0 and 0.5 * widest * 3 - 4 <= d <= 1.5 * widest * 3 + 4
        (n,) = case.all_reduce
        whole = small[i].rows * small[i].dim * 2 * 3 / 4
        assert 0.5 * whole - 1 <= n <= 1.5 * whole + 1
    assert comm_cases(job) == cases  # pure in the job and its seed
    one = comm_cases(Job(MANY, gpus=1, batch_per_rank=128))
    assert all(not c.reduce_scatter and not c.all_reduce for c in one)


def collective_records(slow: float) -> list[dict[str, Any]]:
    """Comm records of two ranks whose collectives take (20 µs + ring bytes / 1 GB/s) ×
    ``slow``."""
    from shardwise.planner.comm.fit import ring_bytes

    out = []
    for i, size in enumerate((2**16, 2**18, 2**20, 2**22)):
        got = []
        for name in ("reduce_scatter", "all_reduce"):
            t = slow * (20e-6 + ring_bytes(name, size, 2) / 1e9)
            fwd = [t, t] if name == "reduce_scatter" else []
            got.append(
                {"name": name, "bytes": size, "world_size": 2, "fwd_s": fwd, "bwd_s": [t, t]}
            )
        out.append({"index": i, "extra": {"backend": "gloo", "collectives": got}})
    return out


def test_the_comm_phase_fits_or_rescales_the_collectives() -> None:
    from shardwise.planner.comm.learned import COLLECTIVES_KEY, learned_collectives
    from shardwise.profiler.calibrate.speed import fit_collectives

    model = load_bundled()
    metadata = copy.deepcopy(model.metadata)
    metadata.pop(COLLECTIVES_KEY, None)
    bare = CostModel(model.compute, model.comm, metadata, "a model without fits")
    got = fit_collectives(bare, collective_records(1.0), cores=2)
    assert set(got.fitted) == {"reduce_scatter", "all_reduce"} and not got.factors
    fitted = CostModel(model.compute, model.comm, {**metadata, COLLECTIVES_KEY: got.fitted})
    fits = learned_collectives(fitted.metadata)
    link = fits["reduce_scatter"].link(2)
    assert link.alpha_s == pytest.approx(20e-6, rel=0.05)
    assert link.bytes_per_s == pytest.approx(1e9, rel=0.05)
    # the same machine twice as slow: the fitted lines get a factor of 2
    again = fit_collectives(fitted, collective_records(2.0), cores=2)
    assert not again.fitted
    assert again.factors["all_reduce"]["factor"] == pytest.approx(2.0, rel=0.02)
    assert again.factors["reduce_scatter"]["factor"] == pytest.approx(2.0, rel=0.02)
    assert not fit_collectives(bare, [{"index": 0, "extra": {}}], cores=2).fitted


def test_a_row_range_record_is_priced_as_its_kernel_saw_it() -> None:
    """A rank of several kinds, split into its kernels, is priced per kernel: a row
    range's record name (``base[lo:hi]``) is no table name, yet the range is priced by
    its own rows and lookups, as the held-out check and the speed fit need."""
    from shardwise.profiler.calibrate.speed import predict_compute
    from shardwise.profiler.pretrain.data import kernel_records

    hist = [0.5, 0.3, 0.2] + [0.0] * 14
    entry = {"rows": 400, "cols": 32, "pooling_factor": 0.7, "access_hist": hist}
    rng = {**entry, "name": "m01[100:500]", "base": "m01", "group": "row_wise"}
    whole = {**entry, "name": "m02", "base": "m02", "rows": 4000, "pooling_factor": 3.0}
    record = {
        "batch_size": 1024,
        "tables": [{**rng, "dtype": "fp32"}, {**whole, "dtype": "fp32"}],
        "fwd_s": 3e-3,
        "bwd_s": 6e-3,
        "extra": {
            "kernels": [
                {
                    "group": "row_wise",
                    "batch_size": 1024,
                    "tables": [0],
                    "fwd_s": 1e-3,
                    "bwd_s": 2e-3,
                },
                {"group": "fused", "batch_size": 256, "tables": [1], "fwd_s": 2e-3, "bwd_s": 4e-3},
            ]
        },
    }
    kernels = kernel_records([record])
    assert [k["batch_size"] for k in kernels] == [1024, 256]
    model = load_bundled()
    got = predict_compute(model, kernels)
    spec = TableSpec(name="r", rows=400, dim=32, pooling_factor=0.7, access_hist=tuple(hist))
    alone = CostPredictor(model).network_compute([[(spec, 32)]], 1024)
    assert got[0] == pytest.approx(alone[0])
    assert np.all(got > 0)

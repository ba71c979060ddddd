"""Calibration: what it measures, the speed factors, and a real short calibration that
is interrupted and resumed (tiny tables, tiny networks)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from shardwise.basics import UserError
from shardwise.planner.costmodel.artifact import CostModel, SpeedFactors, load_bundled
from shardwise.planner.costmodel.cache import ModelCache
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.costmodel.rankhead import in_range, rank_features
from shardwise.planner.plan import table_wise_plan
from shardwise.planner.tables import TableSpec, table_signature, tables_signatures
from shardwise.planner.topology import Topology
from shardwise.profiler.calibrate import Budget, Job, PhaseProgress, calibrate
from shardwise.profiler.calibrate.anchors import (
    anchor_tasks,
    halved_count,
    overhead_of,
    plain_anchor,
)
from shardwise.profiler.calibrate.plans import (
    load_rank_tasks,
    plan_rank_tasks,
    save_rank_tasks,
    side_world,
)
from shardwise.profiler.calibrate.speed import (
    MIN_REFERENCE_PAIRS,
    fit_speed,
    predict_compute,
    reference_check,
)
from shardwise.profiler.calibrate.tasks import (
    feasible_batches,
    split_tables,
    work_proxy,
)
from shardwise.profiler.compute import ShardLoad, footprint_bytes
from shardwise.profiler.dataset.store import RECORDS_FILE, CostDataset
from shardwise.profiler.fingerprint import current_fingerprint
from shardwise.profiler.sampling import augment_by_halvings, base_name, batches_around, halvings

TINY = tuple(
    TableSpec(name=f"t{i}", rows=rows, dim=dim, pooling_factor=pool)
    for i, (rows, dim, pool) in enumerate(
        [(2000, 16, 3.0), (5000, 32, 5.0), (800, 8, 1.5), (3000, 16, 8.0)]
    )
)
GIB = 2**30
#: Calibration's note on the head the model ships: all, training and held-out ranks.
REFIT = (
    r"rank head fitted again on all (\d+) measured ranks after the held-out verdict "
    r"\((\d+) training, (\d+) held-out\)"
)
#: 20 tables, light enough to time in milliseconds, varied in work and width.
MANY = tuple(
    TableSpec(
        name=f"m{i:02d}",
        rows=500 + 300 * i,
        dim=(16, 32, 64, 24)[i % 4],
        pooling_factor=1.0 + (i * 7) % 9,
    )
    for i in range(20)
)


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


def test_the_split_is_by_table_seeded_and_spans_the_work() -> None:
    tables = MANY
    split = split_tables(tables, 3, 512)
    assert split == split_tables(tables, 3, 512)  # a resumed run splits alike
    assert len(split.test) == len(tables) // 5 and not set(split.test) & set(split.train)
    assert sorted([*split.test, *split.train]) == sorted(t.name for t in tables)
    # one test table from each run of five by work: the heaviest five hold one
    order = sorted(tables, key=lambda t: -work_proxy(t, 512))
    assert len({t.name for t in order[:5]} & set(split.test)) == 1
    assert split_tables(tables, 4, 512) != split  # the seed decides which
    assert split_tables(TINY[:3], 0).test == ()  # too few tables to hold one out


def test_anchors_are_every_table_heaviest_first_then_halves() -> None:
    job = Job(MANY, gpus=4, batch_per_rank=128)
    tasks = anchor_tasks(job, 4 * GIB)
    # first the kernel's own overhead: one tiny table, four tiny tables
    assert [t.extra["overhead"] for t in tasks[:2]] == [1, 4]
    assert [len(t.tables) for t in tasks[:2]] == [1, 4]
    # whole tables and column halves first (then row ranges and data-parallel copies:
    # tests/test_profiler_calibrate_kinds.py)
    fused = sum(1 for t in tasks if t.tables)
    assert all(not t.tables for t in tasks[fused:])
    tasks = tasks[2:fused]
    whole = [t for t in tasks if t.tables[0].dim == next(
        s for s in MANY if s.name == t.extra["table"]).dim]  # fmt: skip
    by_work = [s.name for s in sorted(MANY, key=lambda s: (-work_proxy(s, 512), s.name))]
    names = [t.extra["table"] for t in whole]
    assert sorted(names) == sorted(by_work)  # every table once
    assert names[:8] == by_work[:8]  # the heaviest two per GPU first
    # then the rest spread from heavy to light: any prefix holds both ends
    rest = [by_work.index(n) for n in names[8:12]]
    assert min(rest) < 12 and max(rest) >= 14
    halves = tasks[len(whole) :]
    assert 0 < len(halves) <= halved_count(job)
    for t in halves:
        own = next(s for s in MANY if s.name == t.extra["table"])
        assert t.tables[0].dim == own.dim // 2 == t.extra["cols"]
    assert all(t.kind == "anchor" and t.batch_size == job.global_batch for t in tasks)
    # a kernel that would not fit the limit is left out
    tight = anchor_tasks(job, footprint_bytes([ShardLoad.whole(MANY[0])], 512) - 1)[2:]
    assert MANY[0].name not in {t.extra["table"] for t in tight if t.extra["cols"] == 64}
    # the overhead: the one-table kernel less the per-table cost the four-table one shows
    records = [
        {"fwd_s": 3e-4, "bwd_s": 1e-4, "extra": {"overhead": 1}},
        {"fwd_s": 5.4e-4, "bwd_s": 1.6e-4, "extra": {"overhead": 4}},
        {"fwd_s": 9.9, "bwd_s": 9.9, "extra": {"table": "m00", "cols": 16}},
    ]
    assert overhead_of(records) == pytest.approx((2.2e-4, 0.8e-4))
    assert overhead_of(records[2:]) == (0.0, 0.0)


def test_calibration_samples_plan_like_ranks(tmp_path: Path) -> None:
    """The ranks of candidate plans for the job's tables: several shards each, both
    sides, column halves among them, no test table in a fitted rank, persisted."""
    job = Job(MANY, gpus=4, batch_per_rank=128, seed=1)
    split = split_tables(job.tables, job.seed, job.global_batch)
    predictor = CostPredictor(load_bundled())
    tasks = plan_rank_tasks(job, split, 12, predictor)
    train = [t for t in tasks if t.kind == "rank"]
    held = [t for t in tasks if t.kind == "heldout"]
    assert train and held
    assert all({s.spec.name for s in t.loads} <= set(split.train) for t in train)
    assert all({s.spec.name for s in t.loads} <= set(split.test) for t in held)
    # whole ranks: about as many tables as a rank of the job holds
    per_rank = len(MANY) / job.gpus
    assert np.median([len(t.loads) for t in train]) >= per_rank / 2
    assert max(len(t.loads) for t in train) >= per_rank
    planners = {str(t.extra["plan"]).split(":")[1] for t in train}
    assert {"size-greedy", "torchrec-tw-cw", "random", "neuroshard", "halves"} <= planners
    cut = [t for t in train if any(s.cols < s.spec.dim for s in t.loads)]
    assert cut, "no column shard in any measured rank"
    assert all(t.batch_size == job.global_batch for t in tasks)
    assert side_world(job, len(split.train)) == 3 and side_world(job, len(split.test)) == 2
    # no rank twice on a side; the list survives the work directory
    keys = [(t.kind, frozenset(map(tuple, t.extra["shards"]))) for t in tasks]
    assert len(set(keys)) == len(keys)
    save_rank_tasks(tmp_path / "ranks.json", job, tasks)
    assert load_rank_tasks(tmp_path / "ranks.json", job) == tasks
    other = Job(MANY, gpus=4, batch_per_rank=64, seed=1)
    assert load_rank_tasks(tmp_path / "ranks.json", other) is None


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
    assert Budget(600).anchors_s == 240 and Budget(60).anchors_s == 24
    assert Budget(600).fit_s == 30 and Budget(60).fit_s == 8


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
    # A reference kernel that swings on its own: dividing it out spreads the ratios;
    # with ``drift`` off the fit is the timings' as measured.
    for r, own in zip(records, np.exp(rng.normal(0, 0.3, 25)), strict=True):
        r["extra"] = {"reference_s": 1e-3 * float(own)}
    corrected, measured = fit_speed(base, records), fit_speed(base, records, drift=False)
    assert measured.factors == fit.factors and measured.spread == fit.spread
    assert corrected.spread["fwd"] > measured.spread["fwd"]


def _timed_twice(rng: np.random.Generator, tracks: float, n: int = 20) -> list[dict[str, object]]:
    """``n`` anchors timed in two passes under a host speed that swings +-30 %; the
    reference kernel beside each follows that swing with weight ``tracks`` (0: its own
    noise only)."""
    out: list[dict[str, object]] = []
    for pass_ in (1, 2):
        for i in range(n):
            swing = math.exp(rng.normal(0, 0.3))
            own = math.exp(rng.normal(0, 0.3))
            extra = {
                "kind": "anchor",
                "table": f"t{i}",
                "reference_s": 1e-3 * swing**tracks * own ** (1 - tracks),
            }
            if pass_ == 2:
                extra["pass"] = 2
            tables = [{"name": f"t{i}", "rows": 1000 + i, "cols": 16}]
            out.append(
                {
                    "batch_size": 64,
                    "tables": tables,
                    "total_s": 1e-3 * (i + 1) * swing,
                    "extra": extra,
                }
            )
    return out


def test_the_reference_correction_is_kept_only_where_the_anchors_timed_twice_agree_better() -> None:
    rng = np.random.default_rng(3)
    follows = reference_check(_timed_twice(rng, tracks=1.0))
    assert follows is not None and follows.pairs == 20 and follows.helps
    assert follows.corrected == pytest.approx(0.0, abs=1e-9) and follows.raw > 0.1
    assert "narrowed the spread of the 20 anchors timed twice" in follows.note()
    own = reference_check(_timed_twice(rng, tracks=0.0))  # the reference's own swings
    assert own is not None and not own.helps and own.corrected > own.raw
    assert own.note().endswith("timings left as measured")
    assert reference_check(_timed_twice(rng, 1.0, n=MIN_REFERENCE_PAIRS - 1)) is None


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_calibrate_end_to_end_interrupted_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real, short calibration: Ctrl-C while timing plan ranks keeps every sample, the
    same call resumes without measuring any twice, and the model prices ranks from the
    anchors with a held-out verdict."""
    monkeypatch.setenv("SHARDWISE_MODEL_CACHE", str(tmp_path / "cache"))
    job = Job(MANY, gpus=2, batch_per_rank=16, seed=1)
    work = tmp_path / "work"
    base = load_bundled()
    seen: list[str] = []

    def stop_after_seven(p: PhaseProgress) -> None:
        if p.phase == "ranks" and "kernels" in p.text:
            seen.append(p.text)
            if len(seen) == 7:
                raise KeyboardInterrupt

    kwargs = {"max_samples": 20, "tiny": True, "rounds": 12}
    with pytest.raises(KeyboardInterrupt):
        calibrate(job, base, "bundled", work, Budget(45), on_progress=stop_after_seven, **kwargs)
    first = CostDataset.open(work / "ranks").load()
    assert [r["index"] for r in first] == list(range(7))
    anchors = CostDataset.open(work / "anchors").load()
    assert len(anchors) == len(anchor_tasks(job, 4 * GIB))  # overhead, tables, halves

    result = calibrate(job, base, "bundled", work, Budget(45), **kwargs)
    lines = (work / "ranks" / RECORDS_FILE).read_text().splitlines()
    indices = [json.loads(line)["index"] for line in lines]
    assert sorted(indices) == list(range(20))  # none lost, none measured twice
    records = CostDataset.open(work / "ranks").by_index()
    assert all(records[r["index"]] == r for r in first)  # the first run's samples kept
    # the first pass is not timed twice; the second pass times every anchor once more
    again = CostDataset.open(work / "anchors").load()
    assert again[: len(anchors)] == anchors and len(again) == 2 * len(anchors)
    assert result.measured.get("anchor", 0) == 0
    assert result.measured["anchor (again)"] == len(anchors)
    assert result.measured["rank"] + result.measured["heldout"] == 13
    assert result.totals["anchor"] == result.totals["anchor (again)"] == len(anchors)
    kinds = {r["extra"]["kind"] for r in records.values()}
    assert kinds == {"rank", "heldout"}
    assert {r["batch_size"] for r in records.values()} == {32}  # the job's batch only

    cal = result.model.metadata["calibration"]
    fp = current_fingerprint()
    assert cal["fingerprint_key"] == fp.key()
    assert result.model.metadata["fingerprint"] == fp.to_dict()
    assert cal["tables"] == tables_signatures(MANY)
    assert cal["base"] == "bundled" and cal["samples"]["compute"] == 2 * len(anchors) + 20
    assert cal["phases"][:2] == ["anchors", "ranks"] and cal["phases"][-1] == "rank_head"
    assert set(cal["speed_factors"]) == {"fwd", "bwd", "comm"}
    assert all(v > 0 and math.isfinite(v) for v in cal["speed_factors"].values())
    assert cal["speed_factors"]["comm"] == 1.0  # a 45-s budget times no all-to-all
    held = cal["metrics"]
    n_held = sum(r["extra"]["kind"] == "heldout" for r in records.values())
    assert held["test_tables"] == 4 and held["final"]["ranks"] == n_held > 0
    assert held["final"]["rank_mape"] is not None
    assert cal["verdict"]["level"] in ("reliable", "refine", "unreliable", "unjudged")
    # mixed-kind ranks were timed kernel by kernel, and judged per kind
    kinds_timed = {e[4] for r in records.values() for e in r["extra"]["shards"]}
    assert "row_wise" in kinds_timed
    assert all(len(r["extra"]["kernels"]) >= 1 for r in records.values())
    assert set(cal["verdict"]["kinds"]) == set(held["final"]["kinds"]) >= {"row_wise"}
    assert cal["rank_head"]["local_batch"] == job.batch_per_rank
    assert {row["inputs"] for row in cal["ablation"]} >= {"sum of anchors", "chosen"}
    assert result.model.speed_factors == SpeedFactors(**cal["speed_factors"])
    # the anchors timed twice judged the reference kernel's correction, and it says so
    check = cal["reference_check"]
    assert MIN_REFERENCE_PAIRS <= check["pairs"] <= len(anchors)
    used = check["corrected"] < check["raw"]
    assert any(("narrowed" if used else "widened") in n for n in cal["notes"])
    # the verdict judged the training ranks' head; the model ships one fitted on all
    refit = [m for n in cal["notes"] if (m := re.match(REFIT, n))]
    assert len(refit) == 1 and refit[0].group(3) == str(n_held), cal["notes"]
    assert int(refit[0].group(1)) == int(refit[0].group(2)) + n_held
    # every table is anchored, and a table alone is priced as it was measured
    predictor = CostPredictor(result.model)
    assert predictor.rank_head is not None
    assert set(tables_signatures(MANY)) <= set(predictor.rank_head.anchors)
    one = next(r for r in anchors if r["extra"].get("cols") == 64)
    spec = next(t for t in MANY if t.name == one["extra"]["table"])
    both = [
        r["fwd_s"]
        for r in again
        if r["extra"].get("table") == spec.name and r["extra"]["cols"] == 64 and plain_anchor(r)
    ]
    anchor = cal["rank_head"]["anchors"][table_signature(spec)]["64"][0]
    assert len(both) == 2 and anchor == pytest.approx(sum(both) / 2)  # the two passes
    got = predictor.compute([[(spec, 64)]], 32)[0]
    # alone: its anchor times the fusion's factor, its features clipped into the
    # calibrated range (a row-wise or data-parallel kernel of one shard is in it now)
    head = predictor.rank_head
    raw = rank_features(predictor.encodings([(spec, 64)], 32).astype(np.float64))
    assert head.lo is not None and head.hi is not None
    phi = in_range(raw, head.lo, head.hi)
    factor = np.exp(head.fwd.log_factor(phi, np.asarray(head.mean), np.asarray(head.std)))[0]
    assert got[0] == pytest.approx(anchor * factor, rel=1e-5)

    stored = ModelCache().store(result.model, fp.key())
    choice = ModelCache().select(fp.key(), list(MANY), lambda line: None)
    assert choice.path == stored and choice.holds_here
    assert CostPredictor(choice.model).rank_head == predictor.rank_head


@pytest.mark.slow
def test_two_calibrations_with_one_seed_plan_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeatable: the samples are a function of the job and the seed, the fit has no
    randomness of its own, and the plan's choice uses fixed draws; so on a machine that
    times every kernel alike, two calibrations give the same model and the same plan
    (on a real one they differ by the timings' noise: docs/calibration.md).

    Within a budget that no phase reaches: the fine-tune stops at its deadline or when
    it stops improving, whichever comes first, so on a busy machine a binding deadline
    cut each run at another epoch (seen with 3 busy processes on 2 cores: sigmas 0.184
    against 0.187). Comm calibration stays off, as it is below ``COMM_MIN_BUDGET_S``."""
    from shardwise.planner.base import PlannerOptions, run_planner
    from shardwise.planner.costmodel.predictor import kernel_order
    from shardwise.planner.registry import get_planner
    from shardwise.profiler import collect
    from shardwise.profiler.calibrate import pipeline
    from shardwise.profiler.compute import ComputeResult, KernelTime

    def steady(
        shards: list[ShardLoad],
        batch_size: int,
        local_batch_size: int | None = None,
        **_: object,
    ) -> ComputeResult:
        """Each kernel (as the real one groups them) costs its shards' work, 1 % more a
        shard: row ranges their share of the lookups, copies at the local batch."""
        times = []
        for group, local, dtype, members in kernel_order(shards):
            b = (local_batch_size or batch_size) if local else batch_size
            work = [
                b * s.spec.pooling_factor * s.row_count / s.spec.rows * (s.cols + 8) * 1e-10
                for s in (shards[k] for k in members)
            ]
            fused = 1.0 + 0.01 * len(members)
            names = tuple(shards[k].name for k in members)
            f, w = 0.4 * sum(work) * fused, 0.9 * sum(work) * fused
            times.append(KernelTime(group, dtype, b, names, f, w))
        fwd, bwd = sum(t.fwd_s for t in times), sum(t.bwd_s for t in times)
        return ComputeResult(
            fwd, bwd, fwd + bwd, 0.0, 7, batch_size, "cpu", True, len(times),
            kernel_times=tuple(times),
        )  # fmt: skip

    monkeypatch.setattr(collect, "measure_compute", steady)
    monkeypatch.setattr(pipeline, "COMM_MIN_BUDGET_S", math.inf)
    monkeypatch.setenv("SHARDWISE_MODEL_CACHE", str(tmp_path / "cache"))
    job = Job(MANY, gpus=2, batch_per_rank=16, seed=5)
    kwargs = {"max_samples": 12, "tiny": True, "rounds": 4}
    models = [
        calibrate(job, load_bundled(), "bundled", tmp_path / f"w{i}", Budget(3600), **kwargs).model
        for i in range(2)
    ]
    heads = [m.metadata["calibration"]["rank_head"] for m in models]
    assert heads[0] == heads[1]
    topo = Topology(gpus=2, gpu_memory_bytes=GIB, batch_size_per_rank=16)
    plans = [
        run_planner(
            get_planner("neuroshard", PlannerOptions(predictor=CostPredictor(m))), MANY, topo
        ).plan
        for m in models
    ]
    assert plans[0].hash == plans[1].hash
    # the fused kernels of this machine cost 1 % more per table: the fit finds it
    assert math.exp(heads[0]["fusion"]["bwd"]["bias"]) > 1.0


def test_rank_tasks_of_plans_with_row_wise_and_dp_tables_are_all_their_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate plan holding row-wise and data-parallel tables gives each rank's
    kernels as its task, as the rank runs them: the table-wise shards whole, the row
    range of the row-wise table at the global batch, the data-parallel copy at the job's
    batch per rank."""
    import shardwise.profiler.calibrate.plans as plans
    from shardwise.planner.kinds import even_row_split
    from shardwise.planner.plan import Plan, PlanTable, Shard

    job = Job(MANY, gpus=4, batch_per_rank=128, seed=1)
    split = split_tables(job.tables, job.seed, job.global_batch)

    def kinds_plan(
        name: str, draw: int, tables: list[TableSpec], topology: Topology, *_: object
    ) -> Plan:
        w = topology.gpus
        rw, dp, *rest = tables
        return Plan(
            world_size=w,
            planner=name,
            topology=topology,
            tables=[
                PlanTable(
                    name=rw.name,
                    rows=rw.rows,
                    dim=rw.dim,
                    kind="row_wise",
                    shards=[
                        Shard(rank=r, cols=rw.dim, row_offset=o, rows=n)
                        for r, (o, n) in enumerate(even_row_split(rw.rows, w))
                    ],
                ),
                PlanTable(
                    name=dp.name,
                    rows=dp.rows,
                    dim=dp.dim,
                    kind="data_parallel",
                    shards=[Shard(rank=r, cols=dp.dim) for r in range(w)],
                ),
                *(
                    PlanTable(
                        name=t.name, rows=t.rows, dim=t.dim, shards=[Shard(rank=i % w, cols=t.dim)]
                    )
                    for i, t in enumerate(rest)
                ),
            ],
        ).with_hash()

    monkeypatch.setattr(plans, "candidate_plan", kinds_plan)
    tasks = plan_rank_tasks(job, split, 1, None)
    assert tasks and all(t.batch_size == job.global_batch for t in tasks)
    by_name = {t.name: t for t in MANY}
    for side, names in (("rank", split.train), ("heldout", split.test)):
        rw, dp = names[0], names[1]
        mine = [t for t in tasks if t.kind == side]
        assert mine, side
        world = side_world(job, len(names))
        for r, t in enumerate(mine):
            loads = {s.spec.name: s for s in t.loads}
            assert (loads[rw].row_offset, loads[rw].rows) == even_row_split(
                by_name[rw].rows, world
            )[r] and loads[rw].group == "row_wise"
            assert loads[dp].local_batch and loads[dp].group == "data_parallel"
            assert t.local_batch == job.batch_per_rank
            rest = [s for n, s in loads.items() if n not in (rw, dp)]
            assert all(s.rows is None and s.cols == s.spec.dim for s in rest)
            assert all(s.spec == by_name[s.spec.name] for s in t.loads)  # whole specs

"""Which cost model `plan` and `evaluate --predict` use, and the lines they
print about it (docs/model-cache.md): --model > $SHARDWISE_MODEL > this machine's
cached model covering the tables > the closest cached one > the bundled model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import Ran, shardwise
from conftest import make_tables
from model_cache_helpers import calibrated

from shardwise.planner.costmodel import (
    BUNDLED_MODEL,
    ENV_CACHE,
    CostPredictor,
    ModelCache,
    load_bundled,
)
from shardwise.planner.plan import load_plan
from shardwise.planner.tables import save_tables
from shardwise.profiler.fingerprint import current_fingerprint

TABLES = make_tables(6)
HERE = current_fingerprint().key()


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelCache:
    """Never the user's ~/.cache, never their $SHARDWISE_MODEL."""
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv("SHARDWISE_MODEL", raising=False)
    return ModelCache()


@pytest.fixture
def tables(tmp_path: Path) -> Path:
    save_tables(TABLES, tmp_path / "t.yaml")
    return tmp_path / "t.yaml"


def plan(tables: Path, *more: str | Path) -> Ran:
    out = tables.parent / "p.json"
    ran = shardwise("plan", tables, "--gpus", "2", "--planner", "size-greedy", "--out", out, *more)
    return ran


def one_model_line(ran: Ran) -> str:
    assert ran.code == 0, ran.stderr
    (line,) = ran.lines("cost model: ")
    assert "differs in" not in ran.stderr  # never only a fingerprint diff
    return line


def calibrate_lines(ran: Ran) -> list[str]:
    return ran.lines("note: for predictions that hold on these tables and this machine")


def test_without_a_cache_the_bundled_model_and_how_to_calibrate(tables: Path) -> None:
    ran = plan(tables)
    line = one_model_line(ran)
    assert line.startswith("cost model: the bundled CPU model (") and "not calibrated" in line
    (how,) = calibrate_lines(ran)
    assert how == (
        "note: for predictions that hold on these tables and this machine, calibrate (about "
        "10 minutes), which later commands then pick by themselves: shardwise calibrate "
        f"--tables {tables} --gpus 2 --batch-per-rank 65536"
    )
    # Not priced, not searched: no model, no line.
    quiet = plan(tables, "--no-predict")
    assert quiet.code == 0 and not quiet.lines("cost model") and not calibrate_lines(quiet)


def test_this_machines_calibrated_model_prices_the_plan(tables: Path, cache: ModelCache) -> None:
    model = calibrated(TABLES, key=HERE)
    path = cache.store(model, HERE)
    cache.store(calibrated(TABLES[:3], key=HERE, created="2026-12-01"), HERE)  # newer, partial
    ran = plan(tables)
    assert one_model_line(ran) == (
        f"cost model: {path} (calibrated on this machine on 6 of these 6 tables, 2026-11-24)"
    )
    assert calibrate_lines(ran) == []
    written = load_plan(tables.parent / "p.json")
    want = CostPredictor(model).predict_plan(written, TABLES, batch_size_per_rank=128)
    assert written.predicted is not None
    assert written.predicted.max_seconds == pytest.approx(want.predicted().max_seconds)


def test_the_closest_cached_model_when_none_covers_every_table(
    tables: Path, cache: ModelCache
) -> None:
    path = cache.store(calibrated(TABLES[:4], key=HERE), HERE)
    cache.store(calibrated(TABLES, key="fedcba9876543210"), "fedcba9876543210")  # not here
    ran = plan(tables)
    line = one_model_line(ran)
    assert line.startswith(f"cost model: {path} (calibrated on this machine on 4 of these 6")
    assert "the closest in the model cache" in line
    assert len(calibrate_lines(ran)) == 1


def test_model_option_beats_the_environment_which_beats_the_cache(
    tables: Path, cache: ModelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache.store(calibrated(TABLES, key=HERE), HERE)
    env_model = tmp_path / "env.pt"
    env_model.write_bytes(BUNDLED_MODEL.read_bytes())
    monkeypatch.setenv("SHARDWISE_MODEL", str(env_model))
    line = one_model_line(plan(tables))
    # Whatever machine the bundled model was pre-trained on, it is calibrated on none.
    assert line.startswith(f"cost model: {env_model} (from $SHARDWISE_MODEL; ")
    assert "not calibrated" in line
    given = tmp_path / "given.pt"
    calibrated(TABLES[:2], key=HERE).save(given)
    ran = plan(tables, "--model", given)
    assert one_model_line(ran) == (
        f"cost model: {given} (given by --model; calibrated on this machine on 2 of these 6 "
        "tables, 2026-11-24)"
    )
    (how,) = calibrate_lines(ran)
    assert "(about 10 minutes), then leave out --model: shardwise calibrate --tables" in how
    monkeypatch.setenv("SHARDWISE_MODEL", str(tmp_path / "missing.pt"))
    bad = plan(tables)
    assert bad.code == 2 and f"$SHARDWISE_MODEL={tmp_path / 'missing.pt'}:" in bad.stderr
    assert "no such cost model file" in bad.stderr and "unset SHARDWISE_MODEL" in bad.stderr
    # --model's own errors are unchanged.
    missing = plan(tables, "--model", tmp_path / "nope.pt")
    assert missing.code == 2 and missing.stderr.startswith(
        f"error: {tmp_path / 'nope.pt'}: no such"
    )


def test_a_damaged_cache_entry_is_one_warning_and_never_used(
    tables: Path, cache: ModelCache
) -> None:
    folder = cache.directory(HERE)
    folder.mkdir(parents=True)
    (folder / "calibrated-0000000000000000.pt").write_bytes(b"\x00garbage")
    ran = plan(tables)
    (warning,) = ran.lines("warning: skipped the cached cost model ")
    assert str(folder / "calibrated-0000000000000000.pt") in warning
    assert one_model_line(ran).startswith("cost model: the bundled CPU model")
    good = cache.store(calibrated(TABLES, key=HERE), HERE)
    ran = plan(tables)
    assert len(ran.lines("warning: skipped")) == 1
    assert one_model_line(ran).startswith(f"cost model: {good} (calibrated on this machine")


def test_plan_says_when_the_jobs_batch_is_outside_the_models_range(
    tables: Path, cache: ModelCache
) -> None:
    cache.store(calibrated(TABLES, key=HERE), HERE)  # trained on 256..1024 global
    ran = plan(tables, "--batch-per-rank", "65536")
    (note,) = ran.lines("note: the model was trained on")
    assert note == (
        "note: the model was trained on global batches 256–1,024; 131,072 is outside: "
        "predictions extrapolate. Calibrate at this batch: `shardwise calibrate --tables "
        f"{tables} --gpus 2 --batch-per-rank 65536`."
    )
    assert plan(tables, "--batch-per-rank", "256").lines("note: the model was") == []


def test_evaluate_predict_announces_its_model_and_an_extrapolated_batch(
    tables: Path, cache: ModelCache
) -> None:
    path = cache.store(calibrated(TABLES, key=HERE), HERE)
    assert plan(tables, "--batch-per-rank", "128").code == 0
    plan_file = tables.parent / "p.json"
    ran = shardwise("evaluate", plan_file, "--tables", tables, "--predict", "--json")
    assert one_model_line(ran).startswith(f"cost model: {path} (calibrated on this machine")
    assert json.loads(ran.stdout)["source"] == "predicted"  # the lines stay off stdout
    # At the plan's job batch: 128 x 2 = 256, inside 256..1024.
    assert json.loads(ran.stdout)["batch_size_per_rank"] == 128
    assert ran.lines("note: the model was") == []
    far = shardwise(
        "evaluate", plan_file, "--tables", tables, "--predict", "--batch-per-rank", "4096"
    )
    (note,) = far.lines("note: the model was trained on")
    assert note == (
        "note: the model was trained on global batches 256–1,024; 8,192 is outside: "
        "predictions extrapolate. Calibrate at this batch: `shardwise calibrate --tables "
        f"{tables} --gpus 2 --batch-per-rank 4096`."
    )
    # Per rank the bundled model's largest trained batch: twice it on 2 GPUs is outside.
    top = max(load_bundled().metadata["batch_sizes"])
    bundled = shardwise(
        "evaluate",
        plan_file,
        "--tables",
        tables,
        "--predict",
        "--batch-per-rank",
        str(top),
        "--model",
        BUNDLED_MODEL,
    )
    (note,) = bundled.lines("note: the model was trained on")
    assert note.endswith(f"{2 * top:,} is outside: predictions extrapolate.")
    assert bundled.stderr.count("shardwise calibrate") == 1  # said once, in its own line
    assert calibrate_lines(bundled)[0].endswith(f"--gpus 2 --batch-per-rank {top}")


def test_plan_warns_on_an_unreliable_model_and_says_how_it_chose(
    tables: Path, tmp_path: Path
) -> None:
    """A model whose calibration judged held-out plan ranks only within ±22 % is still
    used, and every plan that prices with it says so with the figure; neuroshard says
    by which rule it chose among its candidates."""
    from shardwise.planner.costmodel.rankhead import RankHead
    from shardwise.planner.tables import table_signature

    model = load_bundled()
    anchors = {table_signature(t): {t.dim: (1e-3, 2e-3)} for t in TABLES}
    cal = model.metadata.setdefault("calibration", {})
    cal["rank_head"] = RankHead(batch=1024, anchors=anchors, sigma=0.22).to_json()
    cal["verdict"] = {"level": "unreliable", "sigma": 0.22, "text": "±22%"}
    model.save(tmp_path / "poor.pt")
    ran = shardwise(
        "plan", tables, "--gpus", "2", "--batch-per-rank", "512", "--model", tmp_path / "poor.pt",
        "--out", tmp_path / "p.json",
    )  # fmt: skip
    assert ran.code == 0, ran.stderr
    (warning,) = ran.lines("warning: this cost model priced held-out plan ranks")
    assert "±22%" in warning and "--refine measured" in warning
    assert "neuroshard chose" in ran.stdout and "risk-adjusted max" in ran.stdout
    # The slowest rank's spread: the head's ±22 % for shards it anchors, more where the
    # network alone prices a shard (a row range this head has no anchor for).
    (spread,) = re.findall(r"±(\d+)% on its slowest rank", ran.stdout.replace("\n", " "))
    assert int(spread) >= 22
    # a model judged reliable says nothing of the kind
    cal["verdict"] = {"level": "reliable", "sigma": 0.05, "text": "±5%"}
    model.save(tmp_path / "good.pt")
    ran = shardwise("plan", tables, "--gpus", "2", "--model", tmp_path / "good.pt",
                    "--out", tmp_path / "q.json")  # fmt: skip
    assert ran.code == 0 and not ran.lines("warning: this cost model priced")

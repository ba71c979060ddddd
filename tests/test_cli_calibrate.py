"""`shardwise calibrate` as a user runs it: a real short calibration into the model
cache, and its bad inputs as one-paragraph errors (exit 2).

In-process (tests/cli_helpers.py, with ``main()``'s exit-2 rule): the process itself
shows nothing here that tests/test_cli.py's real processes do not; the calibration's
all-to-alls still run in their own worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import flat, refused, shardwise

from shardwise.planner.costmodel.artifact import CostModel, load_bundled
from shardwise.planner.costmodel.cache import ModelCache
from shardwise.planner.tables import TableSpec, save_tables, tables_signatures
from shardwise.profiler.fingerprint import current_fingerprint

TINY = [
    TableSpec(name=f"t{i}", rows=rows, dim=dim, pooling_factor=pool)
    for i, (rows, dim, pool) in enumerate(
        [(2000, 16, 3.0), (5000, 32, 5.0), (800, 8, 1.5), (3000, 16, 8.0)]
    )
]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Relative paths in ``tmp_path``, and the model cache there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDWISE_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_calibrate_stores_a_model_the_cache_picks(here: Path) -> None:
    save_tables(TINY, here / "t.yaml")
    args = ["--tables", "t.yaml", "--gpus", "2", "--batch-per-rank", "16", "--minutes", "1"]
    done = shardwise(
        "calibrate",
        *args,
        "--max-samples",
        "12",
        "--tiny",
        "--gpu-memory",
        "64MiB",
        "--out",
        "m.pt",
        "--base-name",
        "the published model base-1",
    )
    assert done.code == 0, done.stderr
    text = done.stdout
    for what in ("speed factors", "held-out", "base + speed factors", "rank head", "phases kept",
                 "anchors", "verdict:", "why a rank costs other than its parts",
                 "budget: used", "the sample cap (12)", "by kind:", "row ranges"):  # fmt: skip
        assert what in text, (what, text)
    assert "the bundled CPU model" in flat(done.stderr)  # which base it calibrated
    entries = list((here / "cache").glob("*/calibrated-*.pt"))
    assert len(entries) == 1 and str(entries[0]) in text.replace("\n", "")
    model = CostModel.load(here / "m.pt")
    cal = model.metadata["calibration"]
    assert cal["base"] == "the published model base-1"  # named, not a path in a pod
    assert cal["tables"] == tables_signatures(TINY)
    assert cal["samples"]["comm"] == 4  # a minute times all-to-alls on 2 ranks
    assert cal["speed_factors"]["comm"] != 1.0
    assert model.speed_factors.fwd == cal["speed_factors"]["fwd"]
    assert cal["job"]["gpu_memory"] == 64 * 2**20
    # every table anchored whole, and the heaviest's first row range of each cut
    assert set(tables_signatures(TINY)) < set(cal["rank_head"]["anchors"])
    # the work directory is in the cache, per machine and job, and resumable
    assert len(list((here / "cache" / "work").glob("*/*/anchors/records.jsonl"))) == 1
    assert len(list((here / "cache" / "work").glob("*/*/ranks/records.jsonl"))) == 1

    # what `shardwise plan` on this machine picks for these tables (the cache the
    # command wrote, through $SHARDWISE_MODEL_CACHE)
    choice = ModelCache(here / "cache").select(current_fingerprint().key(), TINY, lambda line: None)
    assert choice.path == entries[0] and choice.holds_here


def test_bad_inputs_are_one_paragraph_errors(here: Path) -> None:
    save_tables(TINY, here / "t.yaml")
    refused(
        shardwise("calibrate", "--tables", "t.yaml", "--minutes", "0.1"),
        "too short for any sample",
    )

    wide = [TableSpec(name="wide", rows=2_000_000, dim=128, pooling_factor=4.0)]
    save_tables(wide, here / "wide.yaml")
    refused(
        shardwise("calibrate", "--tables", "wide.yaml", "--batch-per-rank", "200000000"),
        "'wide'",
        "largest feasible global batch",
        "--batch-per-rank",
    )

    payload = load_bundled().to_payload()
    payload["metadata"]["calibration"] = {"speed_factors": {"fwd": -2.0}}
    torch.save(payload, here / "bad.pt")
    refused(
        shardwise("calibrate", "--tables", "t.yaml", "--base-model", "bad.pt"),
        "speed_factors.fwd",
    )
    assert not (here / "cache").exists()  # nothing measured, nothing stored

"""Calibrate's budget and its advice agree: a run that measured every planned rank
before its deadline spends the rest measuring the noisiest again, says why it stopped,
and never advises a longer run that would measure nothing new."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from shardwise.planner.costmodel.artifact import load_bundled
from shardwise.planner.tables import TableSpec
from shardwise.profiler.calibrate import Budget, Job, calibrate
from shardwise.profiler.calibrate.heldout import verdict
from shardwise.profiler.calibrate.measure import (
    RANK_FIGURES,
    REPEAT_OF,
    merge_repeats,
    repeat_tasks,
)
from shardwise.profiler.calibrate.tasks import Task
from shardwise.profiler.dataset.store import CostDataset

SPEC = TableSpec(name="t", rows=1000, dim=16, pooling_factor=2.0)
TASKS = [Task("rank", (SPEC,), 64, {"plan": f"{i}:x", "rank": 0}) for i in range(3)]


def _record(index: int, fwd: float, cv: float, **extra: object) -> dict[str, object]:
    return {
        "index": index,
        "fwd_s": fwd,
        "bwd_s": 2 * fwd,
        "total_s": 3 * fwd,
        "total_cv": cv,
        "extra": {"kind": "rank", **extra},
    }


def test_repeats_go_noisiest_first_and_merge_to_one_record_per_rank() -> None:
    first = [_record(0, 1.0, 0.01), _record(1, 2.0, 0.20), _record(2, 3.0, 0.05)]
    again = repeat_tasks(TASKS, first, figures=3)
    # Round by round, each noisiest first: a deadline leaves no rank two figures behind.
    assert [t.extra[REPEAT_OF] for t in again] == [1, 2, 0, 1, 2, 0]
    assert len(repeat_tasks(TASKS, first)) == (RANK_FIGURES - 1) * len(TASKS)
    repeated = [_record(3, 4.0, 0.0, **{REPEAT_OF: 1}), _record(4, 5.0, 0.0, **{REPEAT_OF: 2})]
    merged = merge_repeats([*first, *repeated])
    assert [r["index"] for r in merged] == [0, 1, 2]
    assert [r["fwd_s"] for r in merged] == [1.0, 3.0, 4.0]  # the median of two: their mean
    assert merged[1]["bwd_s"] == 6.0 and merged[1]["total_s"] == 9.0
    # A burst in one figure of three is set aside, where a mean of two would keep half.
    burst = [_record(5, 9.0, 0.0, **{REPEAT_OF: 1}), _record(6, 2.1, 0.0, **{REPEAT_OF: 1})]
    assert merge_repeats([*first, *burst])[1]["fwd_s"] == 2.1


def test_the_advice_says_calibrate_longer_only_when_a_longer_run_would_measure_more() -> None:
    final = {"ranks": 20, "plans": 5, "sigma": 0.3, "rank_spearman": 0.5}
    cut = verdict(final)["text"]
    assert "calibrate longer" in cut and "the budget ended" in cut
    done = verdict(final, every_rank_measured=True)["text"]
    assert "calibrate longer" not in done
    assert "a longer calibration would not narrow this" in done
    assert "--refine measured" in done


@pytest.mark.slow
def test_a_run_that_measures_every_rank_early_measures_them_again(tmp_path: Path) -> None:
    tables = tuple(
        TableSpec(name=f"t{i}", rows=2000 + 100 * i, dim=16, pooling_factor=2.0) for i in range(8)
    )
    job = Job(tables, gpus=2, batch_per_rank=16, seed=3)
    result = calibrate(job, load_bundled(), "bundled", tmp_path, Budget(24), tiny=True, rounds=2)
    cal = result.model.metadata["calibration"]
    assert cal["stopped"].startswith("every planned rank was measured")
    assert cal["budget_s"] == 24.0 and cal["seconds"] <= 24.0 + 10
    records = CostDataset.open(tmp_path / "ranks").load()
    repeats = [r for r in records if REPEAT_OF in r["extra"]]
    firsts = [r for r in records if REPEAT_OF not in r["extra"]]
    assert repeats and {r["extra"][REPEAT_OF] for r in repeats} <= {r["index"] for r in firsts}
    # Round by round: wherever the deadline fell, no rank is two figures behind another.
    times = Counter(r["extra"][REPEAT_OF] for r in repeats)
    figures = [1 + times[r["index"]] for r in firsts]
    assert max(figures) - min(figures) <= 1 and max(figures) <= RANK_FIGURES
    # Each rank counts once in the fit and the verdict, however often it was timed.
    assert result.totals["rank"] + result.totals["heldout"] == len(firsts)
    assert "calibrate longer" not in cal["verdict"]["text"]

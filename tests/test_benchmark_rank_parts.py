"""benchmarks/rank_parts.py: a bench task's mixed-kind ranks re-timed, fused and shard
by shard, on real kernels, beside the run's own figures."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from conftest import load_script

from shardwise.planner.kinds import KindOption
from shardwise.planner.plan import save_plan, table_wise_plan
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.planner.topology import Topology
from shardwise.profiler.bench.results import MixedRank, PlannerResult, TaskResult
from shardwise.profiler.refine.kindmove import KindMove, apply_kind

TABLES = [
    TableSpec(name="hot", rows=6_000, dim=32, pooling_factor=8.0),
    *(TableSpec(name=f"t{i}", rows=2_000, dim=16, pooling_factor=2.0) for i in range(3)),
]
TASK = "tiny-1-T4-W3-tight-0"


def _folder(root: Path, mixed: bool) -> Path:
    """A results folder as `shardwise bench` writes it: the pool, the row's plan (the
    hot table row-wise over 3 ranks) and the task's line with its mixed-kind ranks."""
    topo = Topology(gpus=3, gpu_memory_bytes=2**34, batch_size_per_rank=64)
    plan = table_wise_plan(TABLES, [0, 0, 1, 2], topo, "test")
    plan = apply_kind(plan, TABLES, KindMove("hot", KindOption("row_wise")))
    save_tables(TABLES, root / "pools" / "tiny-1.yaml")
    save_plan(plan, root / "plans" / TASK / "neuroshard.json")
    ranks = [  # each priced as measured
        asdict(MixedRank(plan.hash, ["neuroshard"], r, ["row_wise"], ms, ms))
        for r, ms in enumerate([1e-3, 2e-3, 3e-3])
    ]
    doc: dict[str, Any] = {
        **dict.fromkeys(TaskResult.__dataclass_fields__, 0),
        "task": TASK,
        "pool": "tiny-1",
        "fill_kind": "tight",
        "gpus": 3,
        "seed": 7,
        "table_names": [t.name for t in TABLES],
        "global_batch": 192,
        "batch_size_per_rank": 64,
        "bound_per_repeat": [],
        "device": "cpu",
        "comm": "modelled: nvlink",
        "planners": {
            "neuroshard": asdict(PlannerResult("neuroshard", "ok", max_s=1e-3, plan_hash=plan.hash))
        },
        "model_quality": {},
        "mixed_kind": {"calibrated": ranks} if mixed else None,
    }
    (root / "results.jsonl").write_text(json.dumps(doc) + "\n", encoding="utf-8")
    return root


def test_each_mixed_kind_rank_is_re_timed_beside_its_shards_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path / "bench", mixed=True)
    assert load_script("benchmarks/rank_parts.py").main([str(folder), "--repeats", "1"]) == 0
    out = capsys.readouterr()
    line = out.out.strip()
    assert line.startswith(f"{TASK}: 3 ranks | rho re-timed vs bench "), line
    assert "model vs bench 1.00" in line  # the run's prices, in the bench's order here
    ratio = float(line.split("fused / sum of solos: median ")[1].split(",")[0])
    assert 0.2 < ratio < 5.0  # real kernels: a rank costs about its parts
    assert "rank 3/3 (" in out.err  # progress on stderr


def test_a_task_it_cannot_re_time_is_skipped_and_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path / "bench", mixed=False)
    script = load_script("benchmarks/rank_parts.py")
    assert script.main([str(folder)]) == 0
    assert "no mixed-kind rank priced by a calibrated model: skipped" in capsys.readouterr().out
    assert script.main([str(tmp_path)]) == 2
    assert "no results.jsonl" in capsys.readouterr().err
    assert script.main([str(folder), "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
    gone = _folder(tmp_path / "gone", mixed=True)
    (gone / "plans" / TASK / "neuroshard.json").unlink()
    assert script.main([str(gone)]) == 0
    assert "the plans of its mixed-kind ranks are not in plans/: skipped" in capsys.readouterr().out

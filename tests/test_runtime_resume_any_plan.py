"""Checkpoints resume into any valid plan, including plans that leave ranks empty.

One run goes 1 → 4 → 1 ranks (the 4 under real ``torchrun``, the 1 as the trainer's
one process without it): the plan for 4 gives rank 0 and rank 3 no table at all (rank
0 also writes the checkpoint's description), and cuts one table column-wise across
ranks 1 and 2. Each resume must start at the checkpointed step with exactly the saved
weights and optimizer state, and go on training. Helpers and the trainer are those of
``test_runtime_torchrun.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_torchrun import TORCHRUN, _env, losses, plan_cli, run, small_tables, trainer

from shardwise.planner.plan import Plan, Shard, save_plan
from shardwise.planner.tables import save_tables
from shardwise.runtime.checkpoint import read_meta, remap_rowwise, weight_key

pytestmark = pytest.mark.slow


@dataclass
class Leg:
    dir: Path
    world_size: int
    plan: Plan
    proc: subprocess.CompletedProcess[str]
    summary: dict[str, Any]
    start: dict[str, Any]  # the exported state before the first step (after the resume)
    end: dict[str, Any]  # ... and after the last step


def _leg(d: Path, name: str, plan: Plan, steps: int) -> Leg:
    """Train to ``steps`` with ``plan`` from ``d/ckpt``'s latest checkpoint: under
    ``torchrun``, or for a plan of 1 rank as the one process the trainer runs alone
    (what a process more would add, torchrun's agent, is not what is tested here)."""
    save_plan(plan, d / f"{name}.json")
    launch = [*TORCHRUN, f"--nproc_per_node={plan.world_size}"] if plan.world_size > 1 else []
    cmd = [
        *(launch or [sys.executable]),
        *trainer(
            "--tables", "tables.yaml", "--steps", str(steps), "--checkpoint-dir", "ckpt",
            "--measure-every", "0", "--export-start", f"{name}_start.pt",
            "--export-end", f"{name}_end.pt", "--summary", f"{name}.json",
        ),
    ]  # fmt: skip
    proc = run(cmd, _env(SHARDWISE_PLAN=str(d / f"{name}.json")), d)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return Leg(
        d,
        plan.world_size,
        plan,
        proc,
        json.loads((d / f"{name}.json").read_text()),
        torch.load(d / f"{name}_start.pt"),
        torch.load(d / f"{name}_end.pt"),
    )


def _four_with_empty_ranks(d: Path) -> Plan:
    """A plan for 4 ranks where ranks 0 and 3 hold nothing: table_0000 on rank 1,
    table_0001 cut in two column shards on ranks 1 and 2."""
    plan = plan_cli(d / "tables.yaml", 4, d / "cli4.json")
    shards = {
        "table_0000": [Shard(rank=1, col_offset=0, cols=16)],
        "table_0001": [Shard(rank=1, col_offset=0, cols=8), Shard(rank=2, col_offset=8, cols=8)],
    }
    for t in plan.tables:
        t.shards = shards[t.name]
        t.kind = "column_wise" if len(t.shards) > 1 else "table_wise"
    plan = plan.with_hash()
    assert plan.problems() == []
    assert {s.rank for t in plan.tables for s in t.shards} == {1, 2}
    return plan


@pytest.fixture(scope="module")
def legs(tmp_path_factory: pytest.TempPathFactory) -> list[Leg]:
    """6 steps on 1 rank, then to step 10 on 4 ranks (two empty), then to 12 on 1."""
    d = tmp_path_factory.mktemp("resume_any_plan")
    save_tables(small_tables((16, 16)), d / "tables.yaml")
    one = plan_cli(d / "tables.yaml", 1, d / "cli1.json")
    four = _four_with_empty_ranks(d)
    return [_leg(d, "a", one, 6), _leg(d, "b", four, 10), _leg(d, "c", one, 12)]


def _columns(plan: Plan, name: str) -> list[tuple[int, int]]:
    table = next(t for t in plan.tables if t.name == name)
    return sorted((s.col_offset, s.cols) for s in table.shards)


def _assert_resumed_exactly(before: Leg, after: Leg) -> None:
    """``after`` starts from ``before``'s last checkpoint with its exact state: tables,
    dense layers, dense optimizer; row-wise embedding optimizer state mapped to the new
    column split (exact for these splits: a cut copies, a merge averages)."""
    s = after.summary
    assert (s["resumed_world_size"], s["start_step"]) == (
        before.world_size,
        before.summary["end_step"],
    )
    assert after.start["step"] == before.end["step"]
    assert before.end["model"].keys() == after.start["model"].keys()
    for key, value in before.end["model"].items():
        assert torch.equal(value, after.start["model"][key]), key
    for key, state in before.end["dense_optimizer"].items():
        for name, value in state.items():
            assert torch.equal(value, after.start["dense_optimizer"][key][name]), (key, name)
    for t in after.plan.tables:
        key, state_key = weight_key(t.name), f"{t.name}.momentum1"
        old = before.end["embedding_optimizer"][key][state_key].view(-1, t.rows)
        assert float(old.sum()) > 0  # trained state, not zeros on both sides
        expected = remap_rowwise(
            _columns(before.plan, t.name), old, _columns(after.plan, t.name)
        ).reshape(-1)
        assert torch.equal(after.start["embedding_optimizer"][key][state_key], expected), t.name
    seen = losses(s)
    assert len(seen) == s["end_step"] - s["start_step"] and all(math.isfinite(v) for v in seen)
    changed = [
        k for k, v in after.end["model"].items() if not torch.equal(v, after.start["model"][k])
    ]
    assert any("embedding_bags" in k for k in changed)  # it trained on from there


def test_scale_up_into_empty_ranks_resumes_at_the_checkpointed_step(legs: list[Leg]) -> None:
    one, four, _ = legs
    assert "rank holds no embedding kernel" in four.proc.stdout  # ranks 0 and 3 are empty
    _assert_resumed_exactly(one, four)
    meta = read_meta(four.dir / four.summary["checkpoints"][-1])
    assert (meta.step, meta.world_size, meta.plan_hash) == (10, 4, four.plan.hash)
    assert {t.name: t.columns for t in meta.tables}["table_0001"] == [(0, 8), (8, 8)]


def test_scale_down_from_empty_ranks_resumes_at_the_checkpointed_step(legs: list[Leg]) -> None:
    _, four, back = legs
    _assert_resumed_exactly(four, back)


def test_one_to_four_to_one_ends_where_it_started(legs: list[Leg]) -> None:
    one, four, back = legs
    assert [leg.summary["end_step"] for leg in legs] == [6, 10, 12]
    assert back.plan.hash == one.plan.hash and back.summary["world_size"] == 1
    meta = read_meta(back.dir / back.summary["checkpoints"][-1])
    assert (meta.step, meta.world_size) == (12, 1)
    assert four.summary["world_size"] == 4

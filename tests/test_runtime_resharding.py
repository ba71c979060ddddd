"""Resharding in real processes: what a reshard does to the workers.

A training on 2 ranks, started as the worker image starts it (the launcher), is stopped
by SIGTERM (what the kubelet sends when the operator deletes the worker Job), and
resumes on 3 ranks with a plan made for 3, from the checkpoint it wrote, with exactly
the weights it stopped with. tests/test_runtime_torchrun.py resumes 2 → 3 only from a
run that ended normally, and stops by SIGTERM without resuming; this joins the two,
reusing its helpers.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from test_runtime_torchrun import (
    LAUNCH,
    _env,
    _wait_for_metrics,
    finish,
    free_port_pair,
    losses,
    plan_cli,
    run,
    small_tables,
    start,
    trainer,
)

from shardwise.planner.tables import save_tables
from shardwise.runtime.checkpoint import latest_checkpoint, read_meta

pytestmark = pytest.mark.slow


def test_sigterm_at_two_ranks_resumes_at_three_with_the_new_plan(tmp_path: Path) -> None:
    d = tmp_path
    save_tables(small_tables((16,) * 5), d / "tables.yaml")
    plan2 = plan_cli(d / "tables.yaml", 2, d / "plan2.json")
    plan3 = plan_cli(d / "tables.yaml", 3, d / "plan3.json")
    assert plan3.world_size == 3 and plan3.hash != plan2.hash
    port = free_port_pair()
    cmd = [
        *LAUNCH,
        "--nproc_per_node=2",
        *trainer(
            "--tables", "tables.yaml", "--steps", "1000000", "--checkpoint-dir", "ckpt",
            "--measure-every", "2", "--export-end", "a_end.pt", "--summary", "a.json",
        ),
    ]  # fmt: skip
    env = _env(SHARDWISE_PLAN=str(d / "plan2.json"), SHARDWISE_METRICS_PORT=str(port))
    proc = start(cmd, env, d)
    try:
        _wait_for_metrics([port, port + 1], proc, timeout=120)
        os.kill(proc.pid, signal.SIGTERM)  # the kubelet, when the worker Job is deleted
        out = finish(proc, 90, "no exit after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    stopped = latest_checkpoint(d / "ckpt")
    assert stopped is not None
    meta = read_meta(stopped)
    assert (meta.reason, meta.world_size, meta.plan_hash) == ("stop", 2, plan2.hash)
    step = meta.step

    # the new worker Job: 3 ranks, the plan for 3, the same checkpoint directory
    resume = [
        *LAUNCH,
        "--nproc_per_node=3",
        *trainer(
            "--tables", "tables.yaml", "--steps", str(step + 2), "--checkpoint-dir", "ckpt",
            "--measure-every", "0", "--export-start", "b_start.pt", "--summary", "b.json",
        ),
    ]  # fmt: skip
    proc3 = run(resume, _env(SHARDWISE_PLAN=str(d / "plan3.json")), d)
    assert proc3.returncode == 0, proc3.stdout[-4000:]
    s = json.loads((d / "b.json").read_text())
    assert (s["resumed_world_size"], s["start_step"], s["end_step"]) == (2, step, step + 2)
    assert len(losses(s)) == 2
    before, after = torch.load(d / "a_end.pt"), torch.load(d / "b_start.pt")
    assert (before["step"], after["step"]) == (step, step)
    assert after["plan_hash"] == plan3.hash
    assert before["model"].keys() == after["model"].keys()
    for key, value in before["model"].items():
        assert torch.equal(value, after["model"][key]), key  # equal weights, resharded
    last = latest_checkpoint(d / "ckpt")
    assert last is not None and read_meta(last).world_size == 3

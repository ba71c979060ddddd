"""``make gpu-check`` (scripts/gpu_check.py) where there is no GPU, and its commands
against the real CLI: every step it would run on a GPU parses as given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from conftest import load_script

from shardwise.cli import app


def test_without_a_gpu_it_says_what_it_would_run_and_skips(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    gpu_check = load_script("scripts/gpu_check.py")
    assert gpu_check.main(["--out", str(tmp_path)], found=lambda: []) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("no GPU: skipped")
    for step in ("profile compute (cuda)", "evaluate (cuda", "calibrate (cuda", "NCCL"):
        assert step in out
    assert not (tmp_path / "tables.yaml").exists()  # nothing ran


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_step_parses_with_the_cli(tmp_path: Path, gpus: int) -> None:
    """The flags of each ``shardwise`` step are the CLI's own (click parses them here
    without running anything), so a lent GPU is not spent on a typo."""
    gpu_check = load_script("scripts/gpu_check.py")
    for name in ("tables.yaml", "plan.json", "train-plan.json"):
        (tmp_path / name).write_text("")
    cli = typer.main.get_command(app)
    checked = 0
    for step in gpu_check.steps(sys.executable, tmp_path, gpus):
        if step.argv[1:3] != ["-m", "shardwise"]:
            continue
        args, command = list(step.argv[3:]), cli
        while hasattr(command, "commands"):  # a group: descend to the command
            ctx = command.make_context("shardwise", [], resilient_parsing=True)
            sub = command.get_command(ctx, args[0])  # type: ignore[attr-defined]
            assert sub is not None, f"{step.name}: no command {args[0]!r}"
            command, args = sub, args[1:]
        command.make_context(step.name, args)  # raises on an unknown flag or a bad value
        checked += 1
    assert checked >= 7

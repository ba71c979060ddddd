"""The trainer API (``shardwise.runtime.trainer``) with a model of the caller's own.

What runs is ``examples/train_dlrm.py``: a small model whose collection sits at
``embeddings`` (not DLRM's path), its own data, every other part the runtime's. The
default entry's run through the same trainer is ``test_runtime_torchrun.py``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_runtime_torchrun import ROOT, TORCHRUN, _env, plan_cli, run, small_tables

from shardwise.basics import UserError
from shardwise.planner.tables import save_tables
from shardwise.runtime.checkpoint import latest_checkpoint, read_meta, read_tables
from shardwise.runtime.stop import GracefulStop
from shardwise.runtime.trainer import TrainOptions, train

EXAMPLE = ROOT / "examples" / "train_dlrm.py"


def test_options_refuse_what_the_flags_refuse() -> None:
    assert TrainOptions().checkpoint_every == 500 and TrainOptions().resume
    for bad in ({"steps": -1}, {"keep": 0}, {"checkpoint_every": -1}, {"batch_size": 0}):
        with pytest.raises(UserError, match="must be at least"):
            TrainOptions(**bad)  # type: ignore[arg-type]


def _never(*_: object) -> object:
    raise AssertionError("called before the plan was checked")


def test_errors_before_any_collective_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A bad environment, unreadable tables or no plan: status 2 and one message, no
    process group, the model and data never built."""
    stop = GracefulStop(bound=0)  # not installed: this is the test process
    for name in ("SHARDWISE_PLAN", "SHARDWISE_PLAN_HASH", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "0")
    assert train([], _never, _never, stop=stop) == 2
    assert capsys.readouterr().err.startswith("error: environment variable WORLD_SIZE=0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert train(tmp_path / "missing.yaml", _never, _never, stop=stop) == 2
    assert capsys.readouterr().err.startswith("[rank 0/1] error: ")

    def refuse() -> list[object]:
        raise UserError("these tables are not there")

    assert train(refuse, _never, _never, stop=stop) == 2  # type: ignore[arg-type]
    assert "[rank 0/1] error: these tables are not there" in capsys.readouterr().err
    save_tables(small_tables((16,)), tmp_path / "tables.yaml")
    assert train(tmp_path / "tables.yaml", _never, _never, stop=stop) == 2
    assert "SHARDWISE_PLAN" in capsys.readouterr().err


@pytest.mark.slow
def test_example_trains_its_own_model_and_resumes_on_another_world_size(tmp_path: Path) -> None:
    """2 ranks under torchrun with a plan that cuts a table column-wise, then 1 rank
    without torchrun from the same checkpoint with a plan for 1."""
    save_tables(small_tables((16, 32, 16)), tmp_path / "tables.yaml")
    plan_cli(tmp_path / "tables.yaml", 2, tmp_path / "plan2.json")
    plan_cli(tmp_path / "tables.yaml", 1, tmp_path / "plan1.json")
    args = ["--tables", "tables.yaml", "--checkpoint-dir", "ckpt", "--summary", "s.json"]
    proc = run(
        [*TORCHRUN, "--nproc_per_node=2", EXAMPLE, *args, "--steps", "6"],
        _env(SHARDWISE_PLAN=str(tmp_path / "plan2.json")),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["world_size"], summary["start_step"], summary["end_step"]) == (2, 0, 6)
    assert summary["batch_size"] == 256  # the plan's
    meta = read_meta(tmp_path / "ckpt" / "step-000000006")
    assert (meta.module_path, meta.reason, meta.world_size) == ("embeddings", "final", 2)
    saved = read_tables(tmp_path / "ckpt" / "step-000000006")

    proc = run(
        [sys.executable, EXAMPLE, *args, "--steps", "9"],
        _env(SHARDWISE_PLAN=str(tmp_path / "plan1.json")),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[rank 0/1] resumed step 6" in proc.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["world_size"], summary["start_step"], summary["end_step"]) == (1, 6, 9)
    assert summary["resumed_world_size"] == 2
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and read_meta(latest).step == 9
    assert read_tables(latest).keys() == saved.keys()

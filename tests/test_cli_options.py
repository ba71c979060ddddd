"""One name, one meaning per option across the ``shardwise`` commands, and the old
spellings (``--batch-size``, ``--device``) still accepted for a release with a note.

In-process (typer's runner); the measuring functions are replaced by stand-ins that
record what the command passed them, so these tests take seconds.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer.main
from cli_helpers import flat
from typer.testing import CliRunner

from shardwise.basics import UserError
from shardwise.cli import app
from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    MEASURE_ON_HELP,
    MODEL_HELP,
    TABLES_HELP,
)
from shardwise.planner.plan import load_plan
from shardwise.planner.tables import TableSpec, save_tables

RENAMED = {  # command: {old spelling: new name}
    "plan": {"--batch-size": "--batch-per-rank", "--device": "--target-device"},
    "evaluate": {"--batch-size": "--batch-per-rank", "--device": "--measure-on"},
    "bench": {"--device": "--measure-on"},
    "profile compute": {"--batch-size": "--global-batch", "--device": "--measure-on"},
    "profile comm": {"--batch-size": "--batch-per-rank"},
    "tables generate": {"--batch-size": "--histogram-batch"},
}


class Captured(Exception):
    """Raised by the stand-ins once they have what the command passed them."""


def invoke(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def note(old: str, new: str) -> str:
    return f"note: {old} is deprecated and will be removed in the next release; use {new}."


def commands() -> dict[str, Any]:
    """Every command by its full name (typer's click objects: typer vendors click)."""
    root: Any = typer.main.get_command(app)
    found: dict[str, Any] = {}
    for name, cmd in root.commands.items():
        if hasattr(cmd, "commands"):
            found.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
        else:
            found[name] = cmd
    return found


def options(cmd: Any) -> dict[str, Any]:
    return {o: p for p in cmd.params if p.param_type_name == "option" for o in p.opts}


@pytest.fixture
def tables_file(tmp_path: Path) -> Path:
    specs = [
        TableSpec(name=f"t{i}", rows=1000 * (i + 1), dim=8 * (1 + i % 3), pooling_factor=1 + i)
        for i in range(6)
    ]
    save_tables(specs, tmp_path / "t.yaml")
    return tmp_path / "t.yaml"


# --------------------------------------------------------------------------- help


def test_old_spellings_are_hidden_and_name_one_thing() -> None:
    """--batch-size and --device are hidden everywhere; each new name has one help text."""
    every = commands()
    for name, renamed in RENAMED.items():
        opts = options(every[name])
        for old, new in renamed.items():
            assert opts[old].hidden and not opts[new].hidden, f"{name} {old} -> {new}"
    for name, cmd in every.items():
        opts = options(cmd)
        assert "--batch-size" not in opts or opts["--batch-size"].hidden, name
        assert "--device" not in opts or opts["--device"].hidden, name
        starts = {
            "--batch-per-rank": BATCH_PER_RANK_HELP,
            "--measure-on": MEASURE_ON_HELP,
            "--model": MODEL_HELP,
            "--tables": TABLES_HELP,
        }
        for opt, start in starts.items():
            if opt in opts:
                assert (opts[opt].help or "").startswith(start), f"{name} {opt}"


def test_every_command_says_what_it_writes_and_where() -> None:
    for name, cmd in commands().items():
        text = flat(cmd.help or "")
        assert "Writes" in text or "writes" in text, name
        if "--out" in options(cmd):
            assert "--out" in text, name


def test_help_hides_the_old_spellings() -> None:
    shown = invoke("plan", "--help")
    assert shown.exit_code == 0
    assert "--batch-per-rank" in shown.stdout and "--target-device" in shown.stdout
    assert "--batch-size" not in shown.stdout and "--device " not in shown.stdout


# --------------------------------------------------------------------------- old spellings


def test_plan_old_spellings_give_the_same_plan(tables_file: Path) -> None:
    out = tables_file.parent
    common = ["plan", tables_file, "--gpus", "2", "--planner", "size-greedy", "--no-predict"]
    new = invoke(*common, "--target-device", "cpu", "--batch-per-rank", "512", "--out", out / "n")
    assert new.exit_code == 0, new.stderr
    assert "deprecated" not in new.stderr
    old = invoke(*common, "--device", "cpu", "--batch-size", "512", "--out", out / "o")
    assert old.exit_code == 0, old.stderr
    assert note("--batch-size", "--batch-per-rank") in flat(old.stderr)
    assert note("--device", "--target-device") in flat(old.stderr)
    plan = load_plan(out / "o")
    assert plan == load_plan(out / "n")
    assert (plan.topology.device, plan.topology.batch_size_per_rank) == ("cpu", 512)
    both = invoke(*common, "--batch-size", "512", "--batch-per-rank", "256", "--out", out / "b")
    assert isinstance(both.exception, UserError)
    assert "--batch-per-rank was given twice" in str(both.exception)
    bad = invoke(*common, "--target-device", "tpu", "--out", out / "t")
    assert "--target-device must be cuda or cpu" in str(bad.exception)


def test_tables_generate_old_spelling(tmp_path: Path) -> None:
    new = invoke(
        "tables",
        "generate",
        "--count",
        "3",
        "--histogram-batch",
        "256",
        "--out",
        tmp_path / "n.yaml",
    )
    old = invoke(
        "tables", "generate", "--count", "3", "--batch-size", "256", "--out", tmp_path / "o.yaml"
    )
    assert new.exit_code == 0 and old.exit_code == 0, old.stderr
    assert (tmp_path / "n.yaml").read_text() == (tmp_path / "o.yaml").read_text()
    assert note("--batch-size", "--histogram-batch") in flat(old.stderr)
    assert "deprecated" not in new.stderr


def test_evaluate_old_spellings(tables_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.profiler.evaluate as evaluate
    from shardwise.planner.plan import load_plan

    plan_file = tables_file.parent / "p.json"
    made = invoke(
        "plan",
        tables_file,
        "--gpus",
        "2",
        "--planner",
        "size-greedy",
        "--no-predict",
        "--out",
        plan_file,
    )
    assert made.exit_code == 0, made.stderr
    seen: list[dict[str, Any]] = []

    def stand_in(plan: Any, tables: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        raise Captured

    monkeypatch.setattr(evaluate, "evaluate_plan", stand_in)
    invoke(
        "evaluate",
        plan_file,
        "--tables",
        tables_file,
        "--batch-per-rank",
        "64",
        "--measure-on",
        "cpu",
    )
    old = invoke(
        "evaluate", plan_file, "--tables", tables_file, "--batch-size", "64", "--device", "cpu"
    )
    assert isinstance(old.exception, Captured)
    assert note("--batch-size", "--batch-per-rank") in flat(old.stderr)
    assert note("--device", "--measure-on") in flat(old.stderr)
    assert [(k["batch_size_per_rank"], k["device"]) for k in seen] == [(64, "cpu"), (64, "cpu")]
    default = invoke("evaluate", plan_file, "--tables", tables_file)
    assert isinstance(default.exception, Captured)
    # Without --batch-per-rank: the plan's job batch (docs/design.md §6).
    job_batch = load_plan(plan_file).topology.batch_size_per_rank
    assert (seen[-1]["batch_size_per_rank"], seen[-1]["device"]) == (job_batch, None)


def test_profile_old_spellings(tables_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.profiler.collect as runner

    seen: list[tuple[str, dict[str, Any]]] = []

    def compute(tables: Any, out_dir: Any, samples: int, **kwargs: Any) -> Any:
        seen.append(("compute", kwargs))
        return SimpleNamespace(total=samples, measured=samples, skipped=0, cvs=[])

    def comm(out_dir: Any, samples: int, **kwargs: Any) -> Any:
        seen.append(("comm", kwargs))
        return SimpleNamespace(total=samples, measured=samples, skipped=0, cvs=[])

    monkeypatch.setattr(runner, "profile_compute", compute)
    monkeypatch.setattr(runner, "profile_comm", comm)
    out = tables_file.parent / "costs"
    base = ["profile", "compute", "--tables", tables_file, "--out", out, "--samples", "1"]
    new = invoke(*base, "--global-batch", "64", "--global-batch", "128", "--measure-on", "cpu")
    old = invoke(*base, "--batch-size", "64", "--batch-size", "128", "--device", "cpu")
    assert new.exit_code == 0 and old.exit_code == 0, old.stderr
    assert "deprecated" not in new.stderr
    assert note("--batch-size", "--global-batch") in flat(old.stderr)
    assert note("--device", "--measure-on") in flat(old.stderr)
    default = invoke(*base)
    assert default.exit_code == 0 and "deprecated" not in default.stderr
    got = [(k["batch_sizes"], k["device"]) for _, k in seen]
    assert got == [([64, 128], "cpu"), ([64, 128], "cpu"), ((256, 512, 1024, 2048), None)]

    seen.clear()
    base = ["profile", "comm", "--out", out, "--samples", "1"]
    new = invoke(*base, "--batch-per-rank", "32")
    old = invoke(*base, "--batch-size", "32")
    default = invoke(*base)
    assert new.exit_code == old.exit_code == default.exit_code == 0, old.stderr
    assert note("--batch-size", "--batch-per-rank") in flat(old.stderr)
    assert [k["batch_size"] for _, k in seen] == [32, 32, 128]


def test_bench_old_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.profiler.bench.run as bench

    seen: list[str | None] = []

    def stand_in(*args: Any, device: str | None = None, **kwargs: Any) -> Any:
        seen.append(device)
        raise Captured

    monkeypatch.setattr(bench, "run_bench", stand_in)
    new = invoke("bench", "--quick", "--measure-on", "cpu", "--out", tmp_path)
    old = invoke("bench", "--quick", "--device", "cpu", "--out", tmp_path)
    assert isinstance(new.exception, Captured) and isinstance(old.exception, Captured)
    assert "deprecated" not in new.stderr
    assert note("--device", "--measure-on") in flat(old.stderr)
    assert seen == ["cpu", "cpu"]

"""The ``shardwise`` command as a user runs it: real processes, exit codes, messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardwise.planner.plan import load_plan
from shardwise.planner.tables import TableSpec, load_tables, save_tables

SHARDWISE = [sys.executable, "-m", "shardwise"]


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [*SHARDWISE, *map(str, args)], cwd=cwd, env=env, text=True, capture_output=True, timeout=600
    )


def assert_user_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for f in fragments:
        assert f in proc.stderr, proc.stderr


def test_help_teaches(tmp_path: Path) -> None:
    top = run("--help", cwd=tmp_path)
    assert top.returncode == 0 and "tables" in top.stdout and "plan" in top.stdout
    plan_help = run("plan", "--help", cwd=tmp_path)
    assert "Example: shardwise plan" in plan_help.stdout
    assert "size-lookup-greedy" in plan_help.stdout


def test_generate_then_plan_then_torchrec(tmp_path: Path) -> None:
    """The issue's acceptance path, end to end."""
    gen = run("tables", "generate", "--count", "80", "--seed", "1", "--out", "t.yaml", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    plan = run(
        "plan",
        "t.yaml",
        "--gpus",
        "8",
        "--gpu-memory",
        "4GiB",
        "--planner",
        "size-lookup-greedy",
        "--out",
        "p.json",
        "--plot",
        "p.png",
        cwd=tmp_path,
    )
    assert plan.returncode == 0, plan.stderr
    assert "size-lookup-greedy: 80 tables on 8 GPUs" in plan.stdout
    tables = load_tables(tmp_path / "t.yaml")
    p = load_plan(tmp_path / "p.json")
    assert p.validate_plan(tables) is p
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"

    from shardwise.planner.torchrec_plan import to_sharding_plan

    sharding = to_sharding_plan(p)
    (module_plan,) = sharding.plan.values()
    assert set(module_plan) == {t.name for t in tables}  # type: ignore[arg-type]


def test_compare_lists_every_planner(tmp_path: Path) -> None:
    save_tables(
        [
            TableSpec(name=f"t{i}", rows=1000 * (i + 1), dim=16 * (1 + i % 4), pooling_factor=1 + i)
            for i in range(24)
        ],
        tmp_path / "t.csv",
    )
    proc = run("plan", "t.csv", "--gpus", "4", "--compare", "--out", "p.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in (
        "random",
        "size-greedy",
        "dim-greedy",
        "lookup-greedy",
        "size-lookup-greedy",
        "torchrec",
        "neuroshard",
    ):
        assert name in proc.stdout
    assert load_plan(tmp_path / "p.json").planner == "neuroshard"  # the default


def test_compare_measure_sets_measured_beside_predicted(tmp_path: Path) -> None:
    save_tables(
        [
            TableSpec(name=f"t{i}", rows=2000 * (i + 1), dim=8 * (1 + i % 3), pooling_factor=1 + i)
            for i in range(6)
        ],
        tmp_path / "t.yaml",
    )
    proc = run(
        "plan", "t.yaml", "--gpus", "2", "--compare", "--measure", "--repeats", "1",
        "--planner", "size-greedy", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "measured" in proc.stdout and "bound" in proc.stdout
    lines = [line.split() for line in proc.stdout.splitlines()]
    rows = {cells[0]: cells for cells in lines if cells and cells[0] in ("neuroshard", "random")}
    for name in ("neuroshard", "random"):
        measured_ms = float(rows[name][1])  # the first figure is the measured max
        assert measured_ms > 0
    assert "torchrec-measured" not in proc.stdout  # it needs `shardwise bench`


def test_bad_input_is_a_paragraph_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(
        "tables:\n  - {name: a, rows: 10, dim: 6, pooling_factor: 1}\n"
    )
    assert_user_error(
        run("plan", "bad.yaml", cwd=tmp_path),
        "bad.yaml, line 2: table 'a', field 'dim'",
        "multiple of 4",
    )
    assert_user_error(run("plan", "missing.yaml", cwd=tmp_path), "no such tables file")
    big = TableSpec(name="t17", rows=25 * 10**6, dim=100, pooling_factor=1)  # 9.3 GiB
    save_tables([big], tmp_path / "big.yaml")
    assert_user_error(
        run("plan", "big.yaml", "--gpu-memory", "8GiB", cwd=tmp_path),
        "table t17 needs 9.3 GiB; each GPU has 6.8 GiB after a 15% reserve",
    )
    assert_user_error(
        run("plan", "big.yaml", "--planner", "magic", cwd=tmp_path), "unknown planner 'magic'"
    )
    assert_user_error(
        run("plan", "big.yaml", "--gpu-memory", "lots", cwd=tmp_path),
        "--gpu-memory: cannot read 'lots'",
    )
    assert_user_error(
        run("tables", "from-trace", "nope.pt.gz", "--out", "x.yaml", cwd=tmp_path), "nope.pt.gz"
    )


def test_stdlib_operator_is_not_shadowed() -> None:
    """Python started in the repository root still gets the stdlib's operator module."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", "import operator, shardwise.operator; print(operator.__file__)"],
        cwd=repo,
        text=True,
        capture_output=True,
        check=True,
    )
    assert str(repo) not in proc.stdout


def test_profile_and_evaluate_commands(tmp_path: Path) -> None:
    import json

    small = [
        TableSpec(name=f"t{i}", rows=5000, dim=16 * (1 + i % 3), pooling_factor=2 + i)
        for i in range(6)
    ]
    save_tables(small, tmp_path / "t.yaml")
    prof = run(
        "profile",
        "compute",
        "--tables",
        "t.yaml",
        "--samples",
        "3",
        "--global-batch",
        "64",
        "--out",
        "costs",
        cwd=tmp_path,
    )
    assert prof.returncode == 0, prof.stderr
    assert "3 compute samples in costs (3 measured now, 0 resumed)" in prof.stdout
    again = run(
        "profile",
        "compute",
        "--tables",
        "t.yaml",
        "--samples",
        "4",
        "--batch-size",  # the old spelling of --global-batch: the same dataset resumes
        "64",
        "--out",
        "costs",
        cwd=tmp_path,
    )
    assert "4 compute samples in costs (1 measured now, 3 resumed)" in again.stdout
    assert "--batch-size is deprecated" in again.stderr
    assert_user_error(
        run(
            "profile",
            "compute",
            "--tables",
            "t.yaml",
            "--samples",
            "1",
            "--publish",
            "no-slash",
            "--out",
            "costs",
            cwd=tmp_path,
        ),
        "--publish wants NAMESPACE/NAME",
    )

    assert run("plan", "t.yaml", "--gpus", "2", "--out", "p.json", cwd=tmp_path).returncode == 0
    ev = run("evaluate", "p.json", "--tables", "t.yaml", "--repeats", "1", "--json", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    doc = json.loads(ev.stdout)
    assert len(doc["ranks"]) == 2 and doc["max_s"] > 0
    other = [t.model_copy(update={"rows": 6000}) for t in small]
    save_tables(other, tmp_path / "other.yaml")
    assert_user_error(
        run("evaluate", "p.json", "--tables", "other.yaml", cwd=tmp_path),
        "is 5000x16 fp32 in the plan but 6000x16 fp32 in the tables",
    )

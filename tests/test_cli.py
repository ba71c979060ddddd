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
    names = ("neuroshard", "random", "torchrec-measured")
    rows = {cells[0]: cells for cells in lines if cells and cells[0] in names}
    for name in names:  # torchrec-measured too: --measure measures its single tables
        measured_ms = float(rows[name][1])  # the first figure is the measured max
        assert measured_ms > 0
    assert "single-shard kernels for torchrec-measured" in proc.stderr


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
    big = TableSpec(name="t17", rows=25 * 10**7, dim=100, pooling_factor=1)  # 93 GiB
    save_tables([big], tmp_path / "big.yaml")
    assert_user_error(
        run("plan", "big.yaml", "--gpu-memory", "8GiB", cwd=tmp_path),
        "table t17 (250000000 rows x 100 fp32) needs 94.3 GiB whole, and even row-wise",
        "each GPU has 6.8 GiB after a 15% reserve",
        "What would fit: GPUs of 14.1 GiB",
        "or 15 GPUs (--gpus)",
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
    # main(): the checks before planning and of the model end as exit 2, no traceback
    (tmp_path / "folder").mkdir()
    assert_user_error(
        run("plan", "bad.yaml", "--out", "folder", cwd=tmp_path),
        "--out folder: this is a directory",
    )
    (tmp_path / "empty.pt").write_bytes(b"")
    assert_user_error(
        run("plan", "big.yaml", "--model", "empty.pt", cwd=tmp_path),
        "empty.pt: the file is empty or truncated",
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
    ev = run(
        "evaluate",
        "p.json",
        "--tables",
        "t.yaml",
        "--repeats",
        "1",
        "--batch-per-rank",  # the plan's own 65,536 would take longer
        "128",
        "--comm",
        "pcie",
        "--json",
        cwd=tmp_path,
    )
    assert ev.returncode == 0, ev.stderr
    doc = json.loads(ev.stdout)
    assert len(doc["ranks"]) == 2 and doc["max_s"] > 0
    assert doc["comm"].startswith("modelled: pcie preset") and "comm: modelled: pcie" in ev.stderr
    assert 0 < doc["max_compute_s"] < doc["max_s"] and doc["batch_size_per_rank"] == 128
    bad = run("evaluate", "p.json", "--tables", "t.yaml", "--comm", "nvlinc", cwd=tmp_path)
    assert_user_error(bad, "--comm 'nvlinc' is not a comm model")
    assert all(
        name in " ".join(bad.stderr.split()) for name in ("nvlink", "infiniband", "fitted:DIR")
    )
    other = [t.model_copy(update={"rows": 6000}) for t in small]
    save_tables(other, tmp_path / "other.yaml")
    assert_user_error(
        run("evaluate", "p.json", "--tables", "other.yaml", cwd=tmp_path),
        "is 5000x16 fp32 in the plan but 6000x16 fp32 in the tables",
    )


def _small_tables(tmp_path: Path) -> None:
    small = [
        TableSpec(name=f"t{i}", rows=5000, dim=16 * (1 + i % 3), pooling_factor=2 + i)
        for i in range(6)
    ]
    save_tables(small, tmp_path / "t.yaml")


def test_profile_dataset_problems_exit_2_and_say_how_to_fix(tmp_path: Path) -> None:
    import json

    _small_tables(tmp_path)
    cmd = ("profile", "compute", "--tables", "t.yaml", "--global-batch", "64", "--out", "costs")
    first = run(*cmd, "--samples", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    manifest = tmp_path / "costs" / "dataset.json"
    good = manifest.read_text()

    # A malformed fingerprint: the file, the line and the field, no traceback.
    doc = json.loads(good)
    manifest.write_text(json.dumps({**doc, "fingerprint": {**doc["fingerprint"], "cores": "abc"}}))
    assert_user_error(
        run(*cmd, "--samples", "3", cwd=tmp_path),
        "costs/dataset.json: not a valid dataset manifest",
        "line 1, fingerprint.cores: must be a whole number >= 1, got 'abc'",
    )

    # A lost manifest: say how to rebuild it; --repair checks the records and does.
    manifest.unlink()
    assert_user_error(
        run(*cmd, "--samples", "3", cwd=tmp_path), "dataset.json is missing", "--repair"
    )
    assert_user_error(
        run(*cmd, "--samples", "3", "--seed", "7", "--repair", cwd=tmp_path),
        "cannot rebuild dataset.json, 2 of 2 records disagree",
        "line 1 (sample 0): tables",
    )
    repaired = run(*cmd, "--samples", "3", "--repair", cwd=tmp_path)
    assert repaired.returncode == 0, repaired.stderr
    assert "rebuilt costs/dataset.json from 2 records" in repaired.stdout
    assert "3 compute samples in costs (1 measured now, 2 resumed)" in repaired.stdout
    assert json.loads(manifest.read_text())["settings"] == json.loads(good)["settings"]
    assert "--repair" in run("profile", "compute", "--help", cwd=tmp_path).stdout

    # A complete record that does not parse: refused with its line, nothing cut.
    records = tmp_path / "costs" / "records.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    lines[1] = json.dumps({**json.loads(lines[1]), "note": 1}) + "\n"
    records.write_text("".join(lines))
    assert_user_error(
        run(*cmd, "--samples", "4", cwd=tmp_path),
        "records.jsonl, line 2: not a valid compute record (note: Extra inputs",
        "Nothing was deleted",
    )
    assert records.read_text() == "".join(lines)


def test_profile_ctrl_c_says_what_was_kept_and_how_to_resume(tmp_path: Path) -> None:
    import re
    import signal
    import time

    _small_tables(tmp_path)
    # Far more samples than any run finishes (500 took 18 s here): under load the test
    # could wake only after a short run had finished, and then send no signal at all
    # (Popen.send_signal does nothing once the process has exited) and read exit 0.
    args = ["profile", "compute", "--tables", "t.yaml", "--samples", "100000", "--global-batch"]
    args += ["64", "--out", "costs"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    # Ctrl-C's default in the child: a shell's background job (`make test &`) starts with
    # SIGINT ignored, an ignored signal survives exec, and Python then raises nothing.
    proc = subprocess.Popen(
        [*SHARDWISE, *args], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    records = tmp_path / "costs" / "records.jsonl"
    deadline = time.monotonic() + 300
    while not (records.exists() and records.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr + stdout
    found = re.search(r"interrupted: (\d+) compute samples? (?:is|are) on disk in costs", stderr)
    assert found, stderr
    kept = int(found.group(1))
    assert kept == records.read_bytes().count(b"\n") >= 1
    assert "every finished sample is kept" in stderr
    assert f"run the same command again:\n  shardwise {' '.join(args)}" in stderr

    resumed = run(*args[:5], str(kept + 1), *args[6:], cwd=tmp_path)
    assert f"{kept + 1} compute samples in costs (1 measured now, {kept} resumed)" in resumed.stdout

"""The ``shardwise`` command as a user runs it: exit codes, messages, files.

Most tests call the command in-process (tests/cli_helpers.py ``shardwise``, with
``main()``'s rule: a UserError is exit 2 with its message, anything else escapes with
its traceback), so they pay for the torch/TorchRec import once. Real processes are
kept for what only a real process shows:

- ``test_help_teaches``: ``python -m shardwise --help`` starts and teaches;
- ``test_bad_input_is_a_paragraph_and_exit_2``: one bad input through ``main()`` ends
  as exit 2 with its message and no traceback;
- ``test_stdlib_operator_is_not_shadowed``: Python started in the repository root;
- ``test_profile_ctrl_c_says_what_was_kept_and_how_to_resume``: a real SIGINT.

``plan --compare --measure`` still starts its comm workers: they are the product.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import flat, refused, shardwise

from shardwise.planner.plan import load_plan
from shardwise.planner.tables import TableSpec, load_tables, save_tables

SHARDWISE = [sys.executable, "-m", "shardwise"]


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A real ``python -m shardwise`` process."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [*SHARDWISE, *map(str, args)], cwd=cwd, env=env, text=True, capture_output=True, timeout=600
    )


def assert_user_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for f in fragments:
        assert f in proc.stderr, proc.stderr


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The in-process command runs in ``tmp_path``, so relative paths land there; help
    is as wide as the real processes' (typer makes its console per call)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path


def test_help_teaches(here: Path) -> None:
    top = run("--help", cwd=here)
    assert top.returncode == 0 and "tables" in top.stdout and "plan" in top.stdout
    plan_help = shardwise("plan", "--help")
    assert plan_help.code == 0
    assert "Example: shardwise plan" in flat(plan_help.stdout)
    assert "size-lookup-greedy" in plan_help.stdout


def test_generate_then_plan_then_torchrec(here: Path) -> None:
    """The issue's acceptance path, end to end."""
    gen = shardwise("tables", "generate", "--count", "80", "--seed", "1", "--out", "t.yaml")
    assert gen.code == 0, gen.stderr
    plan = shardwise(
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
    )
    assert plan.code == 0, plan.stderr
    assert "size-lookup-greedy: 80 tables on 8 GPUs" in plan.stdout
    tables = load_tables(here / "t.yaml")
    p = load_plan(here / "p.json")
    assert p.validate_plan(tables) is p
    assert (here / "p.png").read_bytes()[:4] == b"\x89PNG"

    from shardwise.planner.torchrec_plan import to_sharding_plan

    sharding = to_sharding_plan(p)
    (module_plan,) = sharding.plan.values()
    assert set(module_plan) == {t.name for t in tables}


def test_compare_lists_every_planner(here: Path) -> None:
    save_tables(
        [
            TableSpec(name=f"t{i}", rows=1000 * (i + 1), dim=16 * (1 + i % 4), pooling_factor=1 + i)
            for i in range(24)
        ],
        here / "t.csv",
    )
    ran = shardwise("plan", "t.csv", "--gpus", "4", "--compare", "--out", "p.json")
    assert ran.code == 0, ran.stderr
    for name in (
        "random",
        "size-greedy",
        "dim-greedy",
        "lookup-greedy",
        "size-lookup-greedy",
        "torchrec",
        "neuroshard",
    ):
        assert name in ran.stdout
    assert load_plan(here / "p.json").planner == "neuroshard"  # the default


def test_compare_measure_sets_measured_beside_predicted(here: Path) -> None:
    save_tables(
        [
            TableSpec(name=f"t{i}", rows=2000 * (i + 1), dim=8 * (1 + i % 3), pooling_factor=1 + i)
            for i in range(6)
        ],
        here / "t.yaml",
    )
    ran = shardwise(
        "plan", "t.yaml", "--gpus", "2", "--compare", "--measure", "--repeats", "1",
        "--planner", "size-greedy",
        "--batch-per-rank", "512",  # the default 65,536 a rank: 20 s of kernels here
    )  # fmt: skip
    assert ran.code == 0, ran.stderr
    assert "measured" in ran.stdout and "bound" in ran.stdout
    lines = [line.split() for line in ran.stdout.splitlines()]
    names = ("neuroshard", "random", "torchrec-measured")
    rows = {cells[0]: cells for cells in lines if cells and cells[0] in names}
    for name in names:  # torchrec-measured too: --measure measures its single tables
        measured_ms = float(rows[name][1])  # the first figure is the measured max
        assert measured_ms > 0
    assert "single-shard kernels for torchrec-measured" in flat(ran.stderr)


def test_bad_input_is_a_paragraph_and_exit_2(here: Path) -> None:
    (here / "bad.yaml").write_text("tables:\n  - {name: a, rows: 10, dim: 6, pooling_factor: 1}\n")
    # One real process: main() turns the UserError into its message and exit 2.
    assert_user_error(
        run("plan", "bad.yaml", cwd=here),
        "bad.yaml, line 2: table 'a', field 'dim'",
        "multiple of 4",
    )
    refused(shardwise("plan", "missing.yaml"), "no such tables file")
    big = TableSpec(name="t17", rows=25 * 10**7, dim=100, pooling_factor=1)  # 93 GiB
    save_tables([big], here / "big.yaml")
    refused(
        shardwise("plan", "big.yaml", "--gpu-memory", "8GiB"),
        "table t17 (250000000 rows x 100 fp32) needs 94.3 GiB whole, and even row-wise",
        "each GPU has 6.8 GiB after a 15% reserve",
        "What would fit: GPUs of 14.1 GiB",
        "or 15 GPUs (--gpus)",
    )
    refused(shardwise("plan", "big.yaml", "--planner", "magic"), "unknown planner 'magic'")
    refused(
        shardwise("plan", "big.yaml", "--gpu-memory", "lots"), "--gpu-memory: cannot read 'lots'"
    )
    refused(shardwise("tables", "from-trace", "nope.pt.gz", "--out", "x.yaml"), "nope.pt.gz")
    # the checks before planning and of the model end as exit 2, no traceback
    (here / "folder").mkdir()
    refused(shardwise("plan", "bad.yaml", "--out", "folder"), "--out folder: this is a directory")
    (here / "empty.pt").write_bytes(b"")
    refused(
        shardwise("plan", "big.yaml", "--model", "empty.pt"),
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


def _small_tables(tmp_path: Path) -> list[TableSpec]:
    small = [
        TableSpec(name=f"t{i}", rows=5000, dim=16 * (1 + i % 3), pooling_factor=2 + i)
        for i in range(6)
    ]
    save_tables(small, tmp_path / "t.yaml")
    return small


def test_profile_and_evaluate_commands(here: Path) -> None:
    small = _small_tables(here)
    prof = shardwise(
        "profile", "compute", "--tables", "t.yaml", "--samples", "3", "--global-batch", "64",
        "--out", "costs",
    )  # fmt: skip
    assert prof.code == 0, prof.stderr
    assert "3 compute samples in costs (3 measured now, 0 resumed)" in prof.stdout
    again = shardwise(
        "profile", "compute", "--tables", "t.yaml", "--samples", "4",
        "--batch-size",  # the old spelling of --global-batch: the same dataset resumes
        "64", "--out", "costs",
    )  # fmt: skip
    assert "4 compute samples in costs (1 measured now, 3 resumed)" in again.stdout
    assert "--batch-size is deprecated" in flat(again.stderr)
    refused(
        shardwise(
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
        ),
        "--publish wants NAMESPACE/NAME",
    )

    assert shardwise("plan", "t.yaml", "--gpus", "2", "--out", "p.json").code == 0
    ev = shardwise(
        "evaluate", "p.json", "--tables", "t.yaml", "--repeats", "1",
        "--batch-per-rank",  # the plan's own 65,536 would take longer
        "128", "--comm", "pcie", "--json",
    )  # fmt: skip
    assert ev.code == 0, ev.stderr
    doc = json.loads(ev.stdout)
    assert len(doc["ranks"]) == 2 and doc["max_s"] > 0
    assert doc["comm"].startswith("modelled: pcie preset")
    assert "comm: modelled: pcie" in flat(ev.stderr)
    assert 0 < doc["max_compute_s"] < doc["max_s"] and doc["batch_size_per_rank"] == 128
    bad = shardwise("evaluate", "p.json", "--tables", "t.yaml", "--comm", "nvlinc")
    refused(bad, "--comm 'nvlinc' is not a comm model")
    assert all(name in flat(bad.stderr) for name in ("nvlink", "infiniband", "fitted:DIR"))
    other = [t.model_copy(update={"rows": 6000}) for t in small]
    save_tables(other, here / "other.yaml")
    refused(
        shardwise("evaluate", "p.json", "--tables", "other.yaml"),
        "is 5000x16 fp32 in the plan but 6000x16 fp32 in the tables",
    )


def test_profile_dataset_problems_exit_2_and_say_how_to_fix(here: Path) -> None:
    _small_tables(here)
    cmd = ("profile", "compute", "--tables", "t.yaml", "--global-batch", "64", "--out", "costs")
    first = shardwise(*cmd, "--samples", "2")
    assert first.code == 0, first.stderr
    manifest = here / "costs" / "dataset.json"
    good = manifest.read_text()

    # A malformed fingerprint: the file, the line and the field, no traceback.
    doc = json.loads(good)
    manifest.write_text(json.dumps({**doc, "fingerprint": {**doc["fingerprint"], "cores": "abc"}}))
    refused(
        shardwise(*cmd, "--samples", "3"),
        "costs/dataset.json: not a valid dataset manifest",
        "line 1, fingerprint.cores: must be a whole number >= 1, got 'abc'",
    )

    # A lost manifest: say how to rebuild it; --repair checks the records and does.
    manifest.unlink()
    refused(shardwise(*cmd, "--samples", "3"), "dataset.json is missing", "--repair")
    refused(
        shardwise(*cmd, "--samples", "3", "--seed", "7", "--repair"),
        "cannot rebuild dataset.json, 2 of 2 records disagree",
        "line 1 (sample 0): tables",
    )
    repaired = shardwise(*cmd, "--samples", "3", "--repair")
    assert repaired.code == 0, repaired.stderr
    assert "rebuilt costs/dataset.json from 2 records" in repaired.stdout
    assert "3 compute samples in costs (1 measured now, 2 resumed)" in repaired.stdout
    assert json.loads(manifest.read_text())["settings"] == json.loads(good)["settings"]
    assert "--repair" in shardwise("profile", "compute", "--help").stdout

    # A complete record that does not parse: refused with its line, nothing cut.
    records = here / "costs" / "records.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    lines[1] = json.dumps({**json.loads(lines[1]), "note": 1}) + "\n"
    records.write_text("".join(lines))
    refused(
        shardwise(*cmd, "--samples", "4"),
        "records.jsonl, line 2: not a valid compute record (note: Extra inputs",
        "Nothing was deleted",
    )
    assert records.read_text() == "".join(lines)


def test_profile_ctrl_c_says_what_was_kept_and_how_to_resume(here: Path) -> None:
    import re
    import signal
    import time

    tmp_path = here
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

    # the resume itself needs no process of its own
    resumed = shardwise(*args[:5], str(kept + 1), *args[6:])
    assert f"{kept + 1} compute samples in costs (1 measured now, {kept} resumed)" in resumed.stdout

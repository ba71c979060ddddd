"""`plan`, `tables`, `evaluate` and `pretrain` keep the CLI's promise: every mistake is
a message naming the file or option, what is wrong and what to do, exit code 2 — and
it comes before the work, never after minutes of planning, measuring or training.

In-process (typer's runner), with ``main()``'s rule applied: a UserError is exit 2,
anything else escapes and fails the test with its traceback.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import flat, refused, shardwise

from shardwise.planner.costmodel import BUNDLED_MODEL
from shardwise.planner.plan import load_plan
from shardwise.planner.tables import TableSpec, save_tables


def never(what: str) -> Any:
    def called(*_: object, **__: object) -> None:
        pytest.fail(f"{what} ran before the mistake was reported")

    return called


@pytest.fixture
def tables(tmp_path: Path) -> Path:
    save_tables(
        [
            TableSpec(name=f"t{i}", rows=2000 * (i + 1), dim=8 * (1 + i % 3), pooling_factor=1 + i)
            for i in range(6)
        ],
        tmp_path / "t.yaml",
    )
    return tmp_path / "t.yaml"


def _bundled() -> dict[str, Any]:
    payload: dict[str, Any] = torch.load(BUNDLED_MODEL, weights_only=True)
    return payload


# --------------------------------------------------------------------------- cost models
def _nan_weights(p: dict[str, Any]) -> None:
    p["compute"]["state_dict"]["encoder.0.weight"][0, 0] = float("nan")


def _short_normalizer(p: dict[str, Any]) -> None:
    norm = p["compute"]["norm"]["table"]
    norm["mean"], norm["std"] = norm["mean"][:-1], norm["std"][:-1]


def _no_fingerprint(p: dict[str, Any]) -> None:
    del p["metadata"]["fingerprint"]


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_nan_weights, "compute.state_dict['encoder.0.weight'] holds NaN or infinite weights"),
        (_short_normalizer, "compute.norm.table.mean has 26 values; the model has 27 features"),
        (_no_fingerprint, "metadata has no 'fingerprint'"),
    ],
)
def test_a_broken_model_is_refused_before_it_plans(
    tables: Path, tmp_path: Path, damage: Any, says: str
) -> None:
    """A NaN model used to plan (every table on rank 0, 'nan' printed, exit 0) and write
    a plan.json nobody could read back; a short normalizer predicted 75x the cost."""
    payload = _bundled()
    damage(payload)
    torch.save(payload, tmp_path / "broken.pt")
    out = tmp_path / "p.json"
    ran = shardwise("plan", tables, "--gpus", "2", "--model", tmp_path / "broken.pt", "--out", out)
    refused(ran, f"{tmp_path / 'broken.pt'}", says, "shardwise pretrain")
    assert not out.exists()


def test_model_paths_say_what_the_file_is_and_how_to_fix_it(tables: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "model.pt").write_bytes(BUNDLED_MODEL.read_bytes())
    refused(
        shardwise("plan", tables, "--model", models),
        "is a directory, not a cost model file: give the model file inside it, e.g. --model "
        f"{models / 'model.pt'}",
    )
    (tmp_path / "empty.pt").write_bytes(b"")
    refused(
        shardwise("plan", tables, "--model", tmp_path / "empty.pt"),
        "empty.pt: the file is empty or truncated. Re-create it with `shardwise pretrain`",
    )
    torch.save({"x": Fraction(1, 3)}, tmp_path / "objects.pt")  # a Python object
    ran = shardwise("evaluate", tmp_path / "p.json", "--tables", tables, "--predict")
    refused(ran, "no such plan file")
    ran = shardwise("pretrain", "--report", "--model", tmp_path / "objects.pt")
    refused(ran, "not a Shardwise cost model", "weights-only load refuses")
    assert "weights_only" not in ran.stderr


# --------------------------------------------------------------------------- output paths
@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("folder", "this is a directory; give the file to write inside it, e.g."),
        ("a-file/p.json", "a-file is a file, so nothing can be created under it"),
        ("/proc/x", "cannot create files in /proc"),
        ("/dev/null", "is not a regular file"),
    ],
)
def test_plan_checks_out_before_planning_and_measuring(
    tables: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, says: str
) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("shardwise.cli.plan.run_planner", never("planning"))
    ran = shardwise("plan", tables, "--gpus", "2", "--measure", "--out", out)
    refused(ran, f"--out {out}", says)


def test_plot_paths_are_checked_first_and_a_late_failure_keeps_the_plan(
    tables: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "p.json"
    with monkeypatch.context() as m:
        m.setattr("shardwise.cli.plan.run_planner", never("planning"))
        refused(
            shardwise("plan", tables, "--out", out, "--plot", tmp_path / "x.txt"),
            "--plot",
            "cannot draw a .txt; name it .png",
        )
    (tmp_path / "a-file").write_text("")
    refused(
        shardwise("plan", tables, "--out", out, "--plot", tmp_path / "a-file" / "p.png"),
        "a-file is a file",
    )

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("shardwise.cli.plan.plot_plan", disk_full)
    ran = shardwise(
        "plan", tables, "--gpus", "2", "--planner", "size-greedy", "--out", out,
        "--plot", tmp_path / "p.png",
    )  # fmt: skip
    refused(ran, f"wrote {out}, but --plot", "No space left on device", "is complete")
    assert load_plan(out).planner == "size-greedy"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--out", "/proc/x.yaml"), "--out /proc/x.yaml: cannot create files in /proc"),
        (("--out", "folder"), "--out folder: this is a directory"),
        (("--out", "t.txt"), "cannot tell the format from the extension '.txt'"),
        (("--out", "t.yaml", "--trace", "/proc/t.pt.gz"), "--trace /proc/t.pt.gz: cannot create"),
    ],
)
def test_tables_generate_checks_out_before_generating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], says: str
) -> None:
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("shardwise.planner.synthetic.generate_tables", never("generating"))
    refused(shardwise("tables", "generate", "--count", "2", *args), says)


def test_tables_from_trace_checks_out_first(tmp_path: Path) -> None:
    refused(
        shardwise("tables", "from-trace", tmp_path / "missing.pt.gz", "--out", "/proc/x.yaml"),
        "--out /proc/x.yaml: cannot create files in /proc",
    )


def test_pretrain_checks_its_paths_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shardwise.profiler.pretrain.pretrain", never("training"))
    refused(
        shardwise("pretrain", tmp_path, "--out", "/proc/m.pt"),
        "--out /proc/m.pt: cannot create files in /proc",
    )
    refused(
        shardwise("pretrain", tmp_path, "--out", tmp_path, "--plot", "s.png"),
        f"--out {tmp_path}: this is a directory",
        f"e.g. {tmp_path / 'model.pt'}",
    )
    refused(
        shardwise("pretrain", tmp_path, "--out", tmp_path / "m.pt", "--plot", "s.txt"),
        "--plot s.txt: cannot draw a .txt",
    )


# --------------------------------------------------------------------------- values
def test_a_400_digit_gpu_memory_is_a_clear_error(tables: Path) -> None:
    refused(
        shardwise("plan", tables, "--gpu-memory", "1" + "0" * 400),
        "--gpu-memory",
        "is more than 8 EiB",
    )


@pytest.mark.slow
def test_evaluate_measures_only_on_a_device(
    tables: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shardwise.profiler.evaluate.evaluate_plan", never("measuring"))
    assert shardwise("plan", tables, "--gpus", "2", "--out", tmp_path / "p.json").code == 0
    refused(
        shardwise("evaluate", tmp_path / "p.json", "--tables", tables, "--measure-on", "tpu"),
        "Invalid value for '--measure-on': 'tpu' is not a device the measurements run on",
    )
    refused(
        shardwise("evaluate", tmp_path / "p.json", "--tables", tables, "--device", "tpu"),
        "'tpu' is not a device the measurements run on: give --measure-on cpu",
    )


@pytest.mark.slow
def test_evaluate_refuses_a_plan_without_its_hash(tables: Path, tmp_path: Path) -> None:
    """The runtime refuses it; so does evaluate, by the same rule (Plan.problems)."""
    assert shardwise("plan", tables, "--gpus", "2", "--out", tmp_path / "p.json").code == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["hash"] = ""
    (tmp_path / "p.json").write_text(json.dumps(doc))
    refused(
        shardwise("evaluate", tmp_path / "p.json", "--tables", tables, "--predict"),
        f"{tmp_path / 'p.json'} is not a valid plan",
        "the plan has no hash; write plans with `shardwise plan`",
    )


# --------------------------------------------------------------------------- torchrec-measured
@pytest.mark.slow
def test_torchrec_measured_plans_from_the_plan_command(tables: Path, tmp_path: Path) -> None:
    """It measures each table's shards alone here first, at the job's batch."""
    assert "torchrec-measured first measures each table" in flat(shardwise("plan", "--help").stdout)
    ran = shardwise(
        "plan",
        tables,
        "--gpus",
        "2",
        "--planner",
        "torchrec-measured",
        "--out",
        tmp_path / "p.json",
    )
    assert ran.code == 0, ran.stderr
    # Every shard option TorchRec weighs, each measured once at the batch its kernel
    # reads: 6 whole tables and their 2 row ranges at the global batch, and each (fp32)
    # table at the rank's own batch, as a data-parallel copy reads it.
    assert "measured 24 single-shard kernels for torchrec-measured" in flat(ran.stderr)
    plan = load_plan(tmp_path / "p.json")
    assert plan.planner == "torchrec-measured" and plan.problems(require_hash=True) == []
    compare = shardwise("plan", tables, "--gpus", "2", "--compare", "--out", tmp_path / "c.json")
    assert compare.code == 0, compare.stderr
    assert "torchrec-measured" not in compare.stdout
    left = flat(compare.stderr)
    assert "torchrec-measured, torchrec-measured-tw-cw left out: they plan" in left
    assert "--measure" in left

"""The worker runtime in real processes: ``torchrun`` with gloo on CPU, as in a pod.

What runs is ``python -m shardwise.runtime.train``, the worker image's default entry
(TorchRec's DLRM through :mod:`shardwise.runtime.trainer`), with plans from
``shardwise plan``. Every subprocess has a timeout and runs in its own session, killed
whole on expiry, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from shardwise.planner.plan import Plan, Shard, load_plan, save_plan
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import TableSpec, save_tables
from shardwise.runtime.checkpoint import (
    latest_checkpoint,
    read_meta,
    read_tables,
    remap_rowwise,
    weight_key,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: The worker image's default entry, as torchrun (and the operator) start it.
ENTRY = ["-m", "shardwise.runtime.train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LAUNCH = [sys.executable, "-m", "shardwise.runtime.launch", "--standalone"]
SHARDWISE = [sys.executable, "-m", "shardwise"]
TIMEOUT_S = 180
BATCH = "256"


# --------------------------------------------------------------------------- helpers


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "SHARDWISE_METRICS_PORT": "0", "OMP_NUM_THREADS": "1"}
    # Nothing of this process's own rendezvous, if a test left one: each run makes its own.
    inherited = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    for name in ("SHARDWISE_PLAN", *inherited):
        env.pop(name, None)
    env.update(extra)
    return env


def start(cmd: Sequence[str | Path], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """Start in a new process group (so a hang can be killed whole), output captured."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float, what: str) -> str:
    """Its output once it exits, or kill the whole process group and fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} after {timeout} s:\n{out[-4000:]}")
    return out


def run(
    cmd: Sequence[str | Path], env: dict[str, str], cwd: Path, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run to completion, or kill the whole process group at the timeout and fail."""
    proc = start(cmd, env, cwd)
    out = finish(proc, timeout, "timed out (a hang)")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def plan_cli(tables: Path, gpus: int, out: Path) -> Plan:
    proc = run(
        [
            *SHARDWISE,
            "plan",
            tables,
            "--gpus",
            str(gpus),
            "--gpu-memory",
            "1GiB",
            "--target-device",
            "cpu",
            "--batch-per-rank",
            BATCH,
            "--planner",
            "size-greedy",
            "--no-predict",
            "--out",
            out,
        ],
        _env(),
        out.parent,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    return load_plan(out)


def small_tables(dims: Sequence[int]) -> list[TableSpec]:
    """Generated specs (pooling, histograms) cut to small tables: fast on 2 cores."""
    specs = generate_tables(len(dims), 0, batch_size=4096)
    return [
        s.model_copy(update={"rows": min(s.rows, 1000 * (i + 2)), "dim": d})
        for i, (s, d) in enumerate(zip(specs, dims, strict=True))
    ]


def trainer(*args: str | Path) -> list[str | Path]:
    return [*ENTRY, "--batch-size", BATCH, "--log-every", "0", *args]


def losses(summary: dict[str, object]) -> list[float]:
    return [float(v) for _, v in summary["losses"]]  # type: ignore[attr-defined]


def free_port_pair() -> int:
    """A port p with p and p + 1 free (local ranks 0 and 1 serve on them)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 65000:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


# --------------------------------------------------------------------------- training at W=2


@dataclass
class FirstRun:
    dir: Path
    tables: Path
    plan: Plan
    proc: subprocess.CompletedProcess[str]
    summary: dict[str, object]


# Tables with mixed widths: the trainer then uses DLRM with per-table projections.
MIXED_DIMS = (16, 32, 16, 32, 16, 32)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    """Train 30 steps on 2 ranks with a ``shardwise plan`` plan whose three 32-wide
    tables are then cut column-wise (even, uneven, and two shards on each rank)."""
    d = tmp_path_factory.mktemp("runtime")
    save_tables(small_tables(MIXED_DIMS), d / "tables.yaml")
    plan = plan_cli(d / "tables.yaml", 2, d / "cli2.json")
    cuts = {
        "table_0001": [(0, 0, 16), (1, 16, 16)],
        "table_0003": [(1, 0, 8), (0, 8, 24)],
        "table_0005": [(0, 0, 8), (1, 8, 8), (0, 16, 8), (1, 24, 8)],
    }
    for t in plan.tables:
        if t.name in cuts:
            t.shards = [Shard(rank=r, col_offset=o, cols=c) for r, o, c in cuts[t.name]]
            t.kind = "column_wise"
    plan = plan.with_hash()
    assert plan.problems() == []
    save_plan(plan, d / "plan_a.json")
    proc = run(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            *trainer(
                "--tables",
                "tables.yaml",
                "--steps",
                "30",
                "--checkpoint-dir",
                "ckpt",
                "--check-unsharded",
                "--measure-every",
                "5",
                "--export-end",
                "a_end.pt",
                "--summary",
                "a.json",
            ),
        ],
        _env(SHARDWISE_PLAN=str(d / "plan_a.json")),
        d,
    )
    summary = json.loads((d / "a.json").read_text()) if (d / "a.json").exists() else {}
    return FirstRun(d, d / "tables.yaml", plan, proc, summary)


def test_two_ranks_train_with_table_and_column_wise_shards(first_run: FirstRun) -> None:
    assert first_run.proc.returncode == 0, first_run.proc.stdout[-4000:]
    s = first_run.summary
    # Same weights in, same output out: the sharded forward is the unsharded model's.
    assert 0 <= float(s["unsharded_max_abs_err"]) <= 1e-6  # type: ignore[arg-type]
    seen = losses(s)
    assert len(seen) == 30 and all(math.isfinite(v) for v in seen)
    first, last = sum(seen[:5]) / 5, sum(seen[-5:]) / 5
    assert last < 0.85 * first, seen
    # The live measurement saw every phase of the embedding stage.
    medians = s["cost_medians"]
    assert isinstance(medians, dict)
    for phase in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm", "input_dist"):
        assert medians[phase] > 0, medians
    assert medians["total"] == pytest.approx(
        sum(medians[p] for p in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm")), rel=0.5
    )


def test_checkpoint_holds_the_trained_tables(first_run: FirstRun) -> None:
    """The checkpoint, read back in this process without torch.distributed, equals the
    weights the two ranks had (gathered to rank 0 after the last step)."""
    path = latest_checkpoint(first_run.dir / "ckpt")
    assert path is not None and path.name == "step-000000030"
    meta = read_meta(path)
    assert (meta.step, meta.world_size, meta.reason) == (30, 2, "final")
    assert meta.plan_hash == first_run.plan.hash
    layout = {t.name: t for t in meta.tables}
    assert layout["table_0005"].columns == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert layout["table_0003"].columns == [(0, 8), (8, 24)]
    momentum = {s.key: s for s in layout["table_0003"].optimizer}["table_0003.momentum1"]
    assert momentum.kind == "rowwise"
    assert [(b.col_offset, b.cols, b.rows) for b in momentum.blocks] == [
        (0, 8, 5000),
        (8, 24, 5000),
    ]
    exported = torch.load(first_run.dir / "a_end.pt")
    assert exported["step"] == 30
    tables = read_tables(path)
    assert set(tables) == {t.name for t in first_run.plan.tables}
    for name, weights in tables.items():
        assert torch.equal(weights, exported["model"][weight_key(name)]), name


def test_resume_on_three_ranks_with_another_plan(first_run: FirstRun) -> None:
    """World size 2 → 3 with a table-wise plan for 3: every weight (tables and dense
    layers) and the dense optimizer state come back exactly; row-wise embedding
    optimizer state is mapped to the new column split; training goes on."""
    assert first_run.proc.returncode == 0, first_run.proc.stdout[-4000:]
    d = first_run.dir
    plan_b = plan_cli(first_run.tables, 3, d / "plan_b.json")
    moved = [
        t.name
        for t in plan_b.tables
        if {s.rank for s in t.shards}
        != {s.rank for s in next(a for a in first_run.plan.tables if a.name == t.name).shards}
    ]
    assert moved  # another placement, not just another world size
    saved = read_meta(d / "ckpt" / "step-000000030")
    proc = run(
        [
            *TORCHRUN,
            "--nproc_per_node=3",
            *trainer(
                "--tables",
                "tables.yaml",
                "--steps",
                "34",
                "--checkpoint-dir",
                "ckpt",
                "--export-start",
                "b_start.pt",
                "--export-end",
                "b_end.pt",
                "--summary",
                "b.json",
                "--measure-every",
                "0",
            ),
        ],
        _env(SHARDWISE_PLAN=str(d / "plan_b.json")),
        d,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    s = json.loads((d / "b.json").read_text())
    assert (s["resumed_world_size"], s["start_step"], s["end_step"]) == (2, 30, 34)
    assert len(losses(s)) == 4 and all(math.isfinite(v) for v in losses(s))

    before = torch.load(d / "a_end.pt")
    after = torch.load(d / "b_start.pt")
    assert after["step"] == 30 and after["plan_hash"] == plan_b.hash
    assert before["model"].keys() == after["model"].keys()
    for key, value in before["model"].items():
        assert torch.equal(value, after["model"][key]), key
    for key, state in before["dense_optimizer"].items():
        for name, value in state.items():
            assert torch.equal(value, after["dense_optimizer"][key][name]), (key, name)

    old_columns = {t.name: t.columns for t in saved.tables}
    for t in plan_b.tables:
        key, state_key = weight_key(t.name), f"{t.name}.momentum1"
        old = before["embedding_optimizer"][key][state_key].view(-1, t.rows)
        new_columns = sorted((sh.col_offset, sh.cols) for sh in t.shards)
        expected = remap_rowwise(old_columns[t.name], old, new_columns).reshape(-1)
        assert torch.equal(after["embedding_optimizer"][key][state_key], expected), t.name
        assert float(old.sum()) > 0  # trained state, not zeros on both sides

    end = torch.load(d / "b_end.pt")
    changed = [k for k, v in end["model"].items() if not torch.equal(v, after["model"][k])]
    assert any("embedding_bags" in k for k in changed) and any("dense_arch" in k for k in changed)
    assert read_meta(d / "ckpt" / "step-000000034").world_size == 3


# --------------------------------------------------------------------------- SIGTERM


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _wait_for_metrics(
    ports: Sequence[int], proc: subprocess.Popen[str], timeout: float
) -> dict[int, dict[str, list[tuple[dict[str, str], float]]]]:
    """Scrape every rank until each has done 6 steps and sampled its cost twice."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended early ({proc.returncode})")
        try:
            seen = {p: _scrape(p) for p in ports}
        except OSError:
            time.sleep(0.5)
            continue
        if all(
            m.get("shardwise_worker_steps_total", [({}, 0.0)])[0][1] >= 6
            and m.get("shardwise_embedding_cost_samples_total", [({}, 0.0)])[0][1] >= 2
            for m in seen.values()
        ):
            return seen
        time.sleep(0.5)
    pytest.fail("the ranks' metrics never showed 6 steps")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Path, int, subprocess.Popen[str]]]:
    """A long run on 2 ranks (uniform widths: TorchRec's DLRM as it is), started like
    the worker image: through the launcher, with metrics on."""
    save_tables(small_tables((16,) * 5), tmp_path / "tables.yaml")
    plan_cli(tmp_path / "tables.yaml", 2, tmp_path / "plan.json")
    port = free_port_pair()
    env = _env(
        SHARDWISE_PLAN=str(tmp_path / "plan.json"),
        SHARDWISE_METRICS_PORT=str(port),
        SHARDWISE_NAMESPACE="ns1",
        SHARDWISE_JOB="job1",
    )
    cmd = [
        *LAUNCH,
        "--nproc_per_node=2",
        *trainer(
            "--tables",
            "tables.yaml",
            "--steps",
            "1000000",
            "--checkpoint-dir",
            "ckpt",
            "--measure-every",
            "2",
            "--summary",
            "s.json",
        ),
    ]
    proc = start(cmd, env, tmp_path)
    yield tmp_path, port, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_metrics_then_sigterm_checkpoints_and_exits_zero(
    job: tuple[Path, int, subprocess.Popen[str]],
) -> None:
    d, port, proc = job
    seen = _wait_for_metrics([port, port + 1], proc, timeout=120)
    for rank, p in enumerate((port, port + 1)):
        cost = {
            labels["phase"]: value
            for labels, value in seen[p]["shardwise_embedding_cost_seconds"]
            if (labels["namespace"], labels["job"], labels["rank"]) == ("ns1", "job1", str(rank))
        }
        assert set(cost) == {
            "fwd_compute",
            "bwd_compute",
            "fwd_comm",
            "bwd_comm",
            "input_dist",
            "total",
        }
        assert all(v > 0 for v in cost.values()), cost
        assert seen[p]["shardwise_worker_step_seconds"][0][1] > 0
        (info,) = seen[p]["shardwise_worker_info"]
        assert info[0]["plan_hash"] == load_plan(d / "plan.json").hash
        assert info[0]["world_size"] == "2"

    os.kill(proc.pid, signal.SIGTERM)  # what Kubernetes does to the pod's first process
    out = finish(proc, 90, "no exit after SIGTERM")
    assert proc.returncode == 0, out[-4000:]
    assert "every rank stopped at step" in out
    path = latest_checkpoint(d / "ckpt")
    assert path is not None
    meta = read_meta(path)
    assert meta.reason == "stop" and 6 <= meta.step < 1_000_000
    summary = json.loads((d / "s.json").read_text())
    assert summary["stopped"] == "SIGTERM" and summary["end_step"] == meta.step
    assert len(read_tables(path)) == 5


# --------------------------------------------------------------------------- bad plans


def test_trainer_help_teaches(tmp_path: Path) -> None:
    proc = run([sys.executable, *ENTRY, "--help"], _env(), tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stdout
    for fragment in ("SHARDWISE_PLAN", "--checkpoint-dir", "SIGTERM", "torchrun --nproc_per_node"):
        assert fragment in proc.stdout, fragment
    # what a lost node costs, and what bounds it
    text = " ".join(proc.stdout.split())
    for fragment in ("bound on lost work", "default 500", "SHARDWISE_STOP_TIMEOUT", "exits 124"):
        assert fragment in text, fragment


@pytest.mark.parametrize("case", ["wrong_table", "wrong_world_size"])
def test_bad_plan_fails_every_rank_clearly(case: str, tmp_path: Path) -> None:
    tables = small_tables((16, 16, 16))
    save_tables(tables, tmp_path / "tables.yaml")
    if case == "wrong_table":  # the plan was made for a table of another size
        other = [
            t.model_copy(update={"rows": t.rows + 1}) if t.name == "table_0002" else t
            for t in tables
        ]
        save_tables(other, tmp_path / "other.yaml")
        plan_cli(tmp_path / "other.yaml", 2, tmp_path / "plan.json")
        fragment = "table 'table_0002' is 4001x16 fp32 in the plan but 4000x16 fp32 in the tables"
    else:
        plan_cli(tmp_path / "tables.yaml", 3, tmp_path / "plan.json")
        fragment = "the plan is for 3 ranks but this job runs 2"
    started = time.monotonic()
    proc = run(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "--log-dir",
            "logs",
            "--redirects",
            "3",
            *trainer("--tables", "tables.yaml", "--steps", "5"),
        ],
        _env(SHARDWISE_PLAN=str(tmp_path / "plan.json")),
        tmp_path,
        timeout=120,
    )
    assert proc.returncode != 0
    assert time.monotonic() - started < 120
    assert "exitcode  : 2" in proc.stdout  # torchrun's report of the first failure
    logs = sorted(tmp_path.glob("logs/**/stderr.log"))
    assert len(logs) == 2
    for rank, log in enumerate(sorted(logs, key=lambda p: int(p.parent.name))):
        text = log.read_text()
        assert f"[rank {rank}/2] error: " in text, text
        assert fragment in text, text
        assert "Traceback" not in text, text

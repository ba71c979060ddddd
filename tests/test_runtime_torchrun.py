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
from cli_helpers import shardwise
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
from shardwise.runtime.stop import GracefulStop
from shardwise.runtime.trainer import train

ROOT = Path(__file__).resolve().parents[1]
#: The worker image's default entry, as torchrun (and the operator) start it.
ENTRY = ["-m", "shardwise.runtime.train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LAUNCH = [sys.executable, "-m", "shardwise.runtime.launch", "--standalone"]
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
    """A plan from ``shardwise plan``, run in this process (the CLI's own process is
    pinned by its tests; a process here would cost seconds of imports)."""
    ran = shardwise(
        "plan", tables, "--gpus", str(gpus), "--gpu-memory", "1GiB", "--target-device", "cpu",
        "--batch-per-rank", BATCH, "--planner", "size-greedy", "--no-predict", "--out", out,
    )  # fmt: skip
    assert ran.code == 0, ran.stdout + ran.stderr
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


# --------------------------------------------------------------------------- one run: 2 → 3


# Tables with mixed widths: the trainer then uses DLRM with per-table projections.
MIXED_DIMS = (16, 32, 16, 32, 16, 32)
#: The first run trains at least this many steps before its SIGTERM.
FIRST_STEPS = 30
#: The resumed run's steps past the checkpoint it resumed from.
MORE_STEPS = 4

Scrape = dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class Stopped:
    """The first run: 2 ranks, stopped by SIGTERM once every rank trained FIRST_STEPS."""

    dir: Path
    tables: Path
    plan: Plan
    port: int
    seen: dict[int, Scrape]  # each rank's metrics just before the SIGTERM, by port
    returncode: int
    out: str
    summary: dict[str, object]

    @property
    def step(self) -> int:
        return int(self.summary["end_step"])  # type: ignore[call-overload]


@dataclass
class Resumed:
    """The second run: 3 ranks, a plan for 3, from the first run's stop checkpoint."""

    plan: Plan
    proc: subprocess.CompletedProcess[str]
    summary: dict[str, object]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    """Train on 2 ranks, started as the worker image starts them (the launcher, metrics
    on), with a ``shardwise plan`` plan whose three 32-wide tables are then cut
    column-wise (even, uneven, and two shards on each rank); scrape both ranks once each
    has trained FIRST_STEPS steps, then SIGTERM the launcher (what Kubernetes does to
    the pod's first process)."""
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
    port = free_port_pair()
    env = _env(
        SHARDWISE_PLAN=str(d / "plan_a.json"),
        SHARDWISE_METRICS_PORT=str(port),
        SHARDWISE_NAMESPACE="ns1",
        SHARDWISE_JOB="job1",
    )
    cmd = [
        *LAUNCH,
        "--nproc_per_node=2",
        *trainer(
            "--tables", "tables.yaml", "--steps", "1000000", "--checkpoint-dir", "ckpt",
            "--check-unsharded", "--measure-every", "5", "--export-end", "a_end.pt",
            "--summary", "a.json",
        ),
    ]  # fmt: skip
    proc = start(cmd, env, d)
    try:
        seen = _wait_for_metrics([port, port + 1], proc, timeout=TIMEOUT_S, steps=FIRST_STEPS)
        os.kill(proc.pid, signal.SIGTERM)
        out = finish(proc, 90, "no exit after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    summary = json.loads((d / "a.json").read_text()) if (d / "a.json").exists() else {}
    yield Stopped(d, d / "tables.yaml", plan, port, seen, proc.returncode, out, summary)


@pytest.fixture(scope="module")
def resumed(stopped: Stopped) -> Resumed:
    """The new worker Job of a reshard: 3 ranks through the launcher, a plan made for 3
    by ``shardwise plan``, the same checkpoint directory; MORE_STEPS steps on."""
    assert stopped.returncode == 0, stopped.out[-4000:]
    d = stopped.dir
    plan = plan_cli(stopped.tables, 3, d / "plan_b.json")
    cmd = [
        *LAUNCH,
        "--nproc_per_node=3",
        *trainer(
            "--tables", "tables.yaml", "--steps", str(stopped.step + MORE_STEPS),
            "--checkpoint-dir", "ckpt", "--export-start", "b_start.pt",
            "--export-end", "b_end.pt", "--summary", "b.json", "--measure-every", "0",
        ),
    ]  # fmt: skip
    proc = run(cmd, _env(SHARDWISE_PLAN=str(d / "plan_b.json")), d)
    summary = json.loads((d / "b.json").read_text()) if (d / "b.json").exists() else {}
    return Resumed(plan, proc, summary)


@pytest.mark.slow
def test_two_ranks_train_with_table_and_column_wise_shards(stopped: Stopped) -> None:
    assert stopped.returncode == 0, stopped.out[-4000:]
    s = stopped.summary
    # Same weights in, same output out: the sharded forward is the unsharded model's.
    assert 0 <= float(s["unsharded_max_abs_err"]) <= 1e-6  # type: ignore[arg-type]
    seen = losses(s)
    assert len(seen) == stopped.step >= FIRST_STEPS and all(math.isfinite(v) for v in seen)
    first = sum(seen[:5]) / 5
    for last in (sum(seen[25:30]) / 5, sum(seen[-5:]) / 5):  # at step 30 and at the stop
        assert last < 0.85 * first, seen
    # The live measurement saw every phase of the embedding stage.
    medians = s["cost_medians"]
    assert isinstance(medians, dict)
    for phase in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm", "input_dist"):
        assert medians[phase] > 0, medians
    assert medians["total"] == pytest.approx(
        sum(medians[p] for p in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm")), rel=0.5
    )


@pytest.mark.slow
def test_checkpoint_holds_the_trained_tables(stopped: Stopped) -> None:
    """The checkpoint, read back in this process without torch.distributed, equals the
    weights the two ranks had (gathered to rank 0 after the last step)."""
    assert stopped.returncode == 0, stopped.out[-4000:]
    path = latest_checkpoint(stopped.dir / "ckpt")
    assert path is not None and path.name == f"step-{stopped.step:09d}"
    meta = read_meta(path)
    assert (meta.step, meta.world_size, meta.reason) == (stopped.step, 2, "stop")
    assert meta.plan_hash == stopped.plan.hash
    layout = {t.name: t for t in meta.tables}
    assert layout["table_0005"].columns == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert layout["table_0003"].columns == [(0, 8), (8, 24)]
    momentum = {s.key: s for s in layout["table_0003"].optimizer}["table_0003.momentum1"]
    assert momentum.kind == "rowwise"
    assert [(b.col_offset, b.cols, b.rows) for b in momentum.blocks] == [
        (0, 8, 5000),
        (8, 24, 5000),
    ]
    exported = torch.load(stopped.dir / "a_end.pt")
    assert exported["step"] == stopped.step
    tables = read_tables(path)
    assert set(tables) == {t.name for t in stopped.plan.tables}
    for name, weights in tables.items():
        assert torch.equal(weights, exported["model"][weight_key(name)]), name


@pytest.mark.slow
def test_metrics_then_sigterm_checkpoints_and_exits_zero(stopped: Stopped) -> None:
    for rank, p in enumerate((stopped.port, stopped.port + 1)):
        cost = {
            labels["phase"]: value
            for labels, value in stopped.seen[p]["shardwise_embedding_cost_seconds"]
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
        assert stopped.seen[p]["shardwise_worker_step_seconds"][0][1] > 0
        (info,) = stopped.seen[p]["shardwise_worker_info"]
        assert info[0]["plan_hash"] == stopped.plan.hash
        assert info[0]["world_size"] == "2"

    assert stopped.returncode == 0, stopped.out[-4000:]
    assert "every rank stopped at step" in stopped.out
    path = latest_checkpoint(stopped.dir / "ckpt")
    assert path is not None
    meta = read_meta(path)
    assert meta.reason == "stop" and FIRST_STEPS <= meta.step < 1_000_000
    assert stopped.summary["stopped"] == "SIGTERM" and stopped.summary["end_step"] == meta.step
    assert len(read_tables(path)) == len(MIXED_DIMS)


@pytest.mark.slow
def test_resume_on_three_ranks_with_another_plan(stopped: Stopped, resumed: Resumed) -> None:
    """World size 2 → 3 with a table-wise plan for 3: every weight (tables and dense
    layers) and the dense optimizer state come back exactly; row-wise embedding
    optimizer state is mapped to the new column split; training goes on."""
    d, step, plan_b = stopped.dir, stopped.step, resumed.plan
    moved = [
        t.name
        for t in plan_b.tables
        if {s.rank for s in t.shards}
        != {s.rank for s in next(a for a in stopped.plan.tables if a.name == t.name).shards}
    ]
    assert moved  # another placement, not just another world size
    assert resumed.proc.returncode == 0, resumed.proc.stdout[-4000:]
    s = resumed.summary
    assert (s["resumed_world_size"], s["start_step"], s["end_step"]) == (
        2,
        step,
        step + MORE_STEPS,
    )
    assert len(losses(s)) == MORE_STEPS and all(math.isfinite(v) for v in losses(s))

    saved = read_meta(d / "ckpt" / f"step-{step:09d}")
    before = torch.load(d / "a_end.pt")
    after = torch.load(d / "b_start.pt")
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


@pytest.mark.slow
def test_sigterm_at_two_ranks_resumes_at_three_with_the_new_plan(
    stopped: Stopped, resumed: Resumed
) -> None:
    """What a reshard does to the workers: the run stopped by SIGTERM resumes on 3 ranks
    with a plan made for 3, from the checkpoint it wrote, with exactly the weights it
    stopped with."""
    d, step = stopped.dir, stopped.step
    assert resumed.plan.world_size == 3 and resumed.plan.hash != stopped.plan.hash
    meta = read_meta(d / "ckpt" / f"step-{step:09d}")
    assert (meta.reason, meta.world_size, meta.plan_hash) == ("stop", 2, stopped.plan.hash)
    assert resumed.proc.returncode == 0, resumed.proc.stdout[-4000:]
    assert resumed.summary["losses"][0][0] == step + 1  # type: ignore[index]  # 0 steps lost
    before, after = torch.load(d / "a_end.pt"), torch.load(d / "b_start.pt")
    assert (before["step"], after["step"]) == (step, step)
    assert after["plan_hash"] == resumed.plan.hash
    assert before["model"].keys() == after["model"].keys()
    for key, value in before["model"].items():
        assert torch.equal(value, after["model"][key]), key  # equal weights, resharded
    last = latest_checkpoint(d / "ckpt")
    assert last is not None
    assert (read_meta(last).step, read_meta(last).world_size, read_meta(last).reason) == (
        step + MORE_STEPS,
        3,
        "final",
    )


# --------------------------------------------------------------------------- metrics


def _scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _wait_for_metrics(
    ports: Sequence[int], proc: subprocess.Popen[str], timeout: float, steps: int = 6
) -> dict[int, Scrape]:
    """Scrape every rank until each has done ``steps`` steps and sampled its cost twice."""
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
            m.get("shardwise_worker_steps_total", [({}, 0.0)])[0][1] >= steps
            and m.get("shardwise_embedding_cost_samples_total", [({}, 0.0)])[0][1] >= 2
            for m in seen.values()
        ):
            return seen
        time.sleep(0.5)
    pytest.fail(f"the ranks' metrics never showed {steps} steps")


# --------------------------------------------------------------------------- help, bad plans


def test_trainer_help_teaches(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry's ``--help``, in this process: its parser is the one a process runs
    (every torchrun test here starts that process)."""
    monkeypatch.setenv("COLUMNS", "80")  # a pipe's width, as in a pod's log
    from shardwise.runtime import train as entry

    entry.STOP.uninstall()  # the entry installs its stop handler on import: not here
    with pytest.raises(SystemExit) as exited:
        entry.parse_args(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for fragment in ("SHARDWISE_PLAN", "--checkpoint-dir", "SIGTERM", "torchrun --nproc_per_node"):
        assert fragment in out, fragment
    # what a lost node costs, and what bounds it
    text = " ".join(out.split())
    for fragment in ("bound on lost work", "default 500", "SHARDWISE_STOP_TIMEOUT", "exits 124"):
        assert fragment in text, fragment


#: What each bad plan's refusal says, on every rank.
BAD_PLAN = {
    "wrong_table": "table 'table_0002' is 4001x16 fp32 in the plan but 4000x16 fp32 in the tables",
    "wrong_world_size": "the plan is for 3 ranks but this job runs 2",
}


def _bad_plans(d: Path) -> dict[str, Path]:
    """Plans that do not fit 2 ranks of ``d/tables.yaml``: made for a table of another
    size, for 3 ranks, and both at once."""
    tables = small_tables((16, 16, 16))
    save_tables(tables, d / "tables.yaml")
    other = [
        t.model_copy(update={"rows": t.rows + 1}) if t.name == "table_0002" else t for t in tables
    ]
    save_tables(other, d / "other.yaml")
    made = {
        "wrong_table": (d / "other.yaml", 2),
        "wrong_world_size": (d / "tables.yaml", 3),
        "both": (d / "other.yaml", 3),
    }
    for name, (specs, gpus) in made.items():
        plan_cli(specs, gpus, d / f"{name}.json")
    return {name: d / f"{name}.json" for name in made}


@pytest.mark.parametrize("case", sorted(BAD_PLAN))
def test_each_bad_plan_is_refused_on_every_rank_before_any_collective(
    case: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank of 2, in this process: status 2, its own tagged message naming the
    table (or both sizes), no traceback, the model and data never built."""
    plan = _bad_plans(tmp_path)[case]

    def never(*_: object) -> object:
        raise AssertionError("called before the plan was checked")

    for name in ("SHARDWISE_PLAN_HASH", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for rank in (0, 1):
        for name, value in {
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "SHARDWISE_PLAN": str(plan),
        }.items():
            monkeypatch.setenv(name, value)
        code = train(tmp_path / "tables.yaml", never, never, stop=GracefulStop(bound=0))  # type: ignore[arg-type]
        err = capsys.readouterr().err
        assert code == 2
        assert f"[rank {rank}/2] error: " in err, err
        assert BAD_PLAN[case] in err, err
        assert "Traceback" not in err, err


@pytest.mark.slow
def test_bad_plan_fails_every_rank_clearly(tmp_path: Path) -> None:
    """2 torchrun ranks given a plan for 3 ranks and a table of another size: each rank
    exits 2 naming both, in its own log, without a traceback; torchrun reports it."""
    plan = _bad_plans(tmp_path)["both"]
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
        _env(SHARDWISE_PLAN=str(plan)),
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
        for fragment in BAD_PLAN.values():
            assert fragment in text, text
        assert "Traceback" not in text, text

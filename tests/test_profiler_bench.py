"""`shardwise bench`: a tiny real run, its figures recomputed, resuming, bad input."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import typer
from conftest import make_tables
from typer.testing import CliRunner

from shardwise.basics import UserError
from shardwise.cli.bench import bench_cmd
from shardwise.planner.plan import Topology, table_wise_plan
from shardwise.planner.tables import TableSpec
from shardwise.profiler import evaluate
from shardwise.profiler.bench import draw_tasks, held_out_pool, resolve_planners, run_bench
from shardwise.profiler.bench_report import GREEDY, summarize
from shardwise.profiler.bench_results import PlannerResult, ResultsFolder, TaskResult
from shardwise.profiler.bench_spec import QUICK, BenchSpec, PoolSpec, load_spec, parse_spec
from shardwise.profiler.comm import CommCase, CommResult
from shardwise.profiler.compute import ComputeResult, ShardLoad
from shardwise.profiler.evaluate import evaluate_side_by_side

PLANNERS = ["size-greedy", "lookup-greedy", "torchrec"]
TINY = BenchSpec(
    tables=[6],
    gpus=[2],
    tasks=2,
    repeats=2,
    batch_size_per_rank=32,
    pool=PoolSpec(count=12, max_table_bytes=64 * 2**20),
)


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the tiny bench, stopped after its first task, a torn line appended, resumed."""
    out = tmp_path_factory.mktemp("bench")
    seen: list[tuple[str, bool]] = []

    def stop_after_first(result: TaskResult, fresh: bool) -> None:
        seen.append((result.task, fresh))
        raise Interrupt

    with pytest.raises(Interrupt):
        run_bench(TINY, PLANNERS, out, on_task=stop_after_first)
    first = (out / "results.jsonl").read_text()
    with (out / "results.jsonl").open("a") as f:
        f.write('{"task": "T6-W2-1", "tables": 6, "gpu')  # killed mid-write
    resumed: list[tuple[str, bool]] = []
    run = run_bench(TINY, PLANNERS, out, on_task=lambda r, fresh: resumed.append((r.task, fresh)))
    return {"out": out, "first": first, "seen": seen, "resumed": resumed, "run": run}


def read_results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_resume_keeps_finished_tasks_and_cuts_a_torn_line(bench_dir: dict[str, Any]) -> None:
    assert bench_dir["seen"] == [("T6-W2-0", True)]
    assert bench_dir["resumed"] == [("T6-W2-0", False), ("T6-W2-1", True)]
    text = (bench_dir["out"] / "results.jsonl").read_text()
    assert text.startswith(bench_dir["first"])  # the finished task was not measured again
    assert [r["task"] for r in read_results(bench_dir["out"])] == ["T6-W2-0", "T6-W2-1"]
    again = run_bench(TINY, PLANNERS, bench_dir["out"])
    assert again.ran == 0 and again.skipped == 2
    with pytest.raises(UserError, match="'planners' was"):
        run_bench(TINY, ["size-greedy"], bench_dir["out"])


def test_every_plan_measured_and_the_figures_follow(bench_dir: dict[str, Any]) -> None:
    """Ratios and geomeans recomputed here from results.jsonl, the evaluator's numbers."""
    out: Path = bench_dir["out"]
    results = read_results(out)
    for task in results:
        assert task["tables"] == 6 and task["gpus"] == 2 and len(set(task["table_names"])) == 6
        assert task["bound_s"] == statistics.median(task["bound_per_repeat"]) > 0
        assert task["usable_bytes"] >= 1.3 * task["total_bytes"] / 2
        for name in PLANNERS:
            r = task["planners"][name]
            assert r["status"] == "ok" and (out / "plans" / task["task"] / f"{name}.json").exists()
            assert len(r["max_per_repeat"]) == 2 and r["planning_s"] >= 0
            assert r["max_s"] == pytest.approx(max(rank["total_s"] for rank in r["ranks"]))
    summary = json.loads((out / "summary.json").read_text())
    per = {p["planner"]: p for p in summary["per_planner"]}
    for name in PLANNERS:
        to_tr, to_heur, to_bound = [], [], []
        for task in results:
            cost = {n: task["planners"][n]["max_s"] for n in PLANNERS}
            to_tr.append(cost[name] / cost["torchrec"])
            to_heur.append(cost[name] / min(cost[n] for n in PLANNERS if n in GREEDY))
            to_bound.append(cost[name] / task["bound_s"])
        geo = per[name]["geomeans"]
        assert geo["torchrec"] == pytest.approx(math.prod(to_tr) ** 0.5)
        assert geo["best-heuristic"] == pytest.approx(math.prod(to_heur) ** 0.5)
        assert geo["bound"] == pytest.approx(math.prod(to_bound) ** 0.5)
        assert geo["torchrec-measured"] is None and per[name]["counts"]["bound"] == 2
    assert per["torchrec"]["geomeans"]["torchrec"] == pytest.approx(1.0)
    assert min(per[n]["geomeans"]["best-heuristic"] for n in GREEDY if n in per) >= 1.0 - 1e-12
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(PLANNERS)
    row = next(r for r in rows if r["planner"] == "size-greedy" and r["task"] == "T6-W2-1")
    task = results[1]
    expect = task["planners"]["size-greedy"]["max_s"] / task["planners"]["torchrec"]["max_s"]
    assert float(row["ratio_torchrec"]) == pytest.approx(expect, rel=1e-5)
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["evaluator_cv"]["median"] is not None
    assert any("CPU figures" in n for n in summary["notes"])


def test_summary_math_on_known_numbers() -> None:
    """Failures are counted, never ratios; the best heuristic is per task."""

    def task(name: str, costs: dict[str, float | None], bound: float) -> TaskResult:
        planners = {
            p: PlannerResult(p, "ok", max_s=c, planning_s=0.1, repeat_cv=0.02)
            if c is not None
            else PlannerResult(p, "plan-failed", error="no room")
            for p, c in costs.items()
        }
        return TaskResult(
            name, 4, 2, 0, 0, [], 0, 0, 0, 128, 3, "cpu", bound, [bound], 0.0, 0.0, planners
        )

    results = [
        task("a", {"torchrec": 2.0, "size-greedy": 4.0, "dim-greedy": 1.0, "x": 1.0}, 0.5),
        task("b", {"torchrec": 8.0, "size-greedy": 2.0, "dim-greedy": None, "x": 4.0}, 2.0),
    ]
    s = summarize(results, ["torchrec", "size-greedy", "dim-greedy", "x"])
    x = next(p for p in s.per_planner if p.planner == "x")
    assert x.geomeans["torchrec"] == pytest.approx(math.sqrt(0.5 * 0.5))
    assert x.geomeans["best-heuristic"] == pytest.approx(math.sqrt(1.0 * 2.0))
    assert x.geomeans["bound"] == pytest.approx(math.sqrt(2.0 * 2.0))
    dim = next(p for p in s.per_planner if p.planner == "dim-greedy")
    assert (dim.tasks_ok, dim.failures, dim.counts["torchrec"]) == (1, 1, 1)
    assert x.wins == 1 and dim.wins == 1  # task a: a tie at 1.0


def fake_compute(shards: list[ShardLoad], batch: int, **_: Any) -> ComputeResult:
    work = sum(s.cols * s.spec.pooling_factor for s in shards) * batch * 1e-9
    return ComputeResult(work, 2 * work, 3 * work, 0.0, 10, batch, "cpu", True)


def fake_comm(cases: list[CommCase], batch: int, **_: Any) -> list[CommResult]:
    return [
        CommResult(
            len(c.dims),
            batch,
            c.dims,
            c.delays,
            fwd_s=[max(c.delays) - d + 1e-6 * w for d, w in zip(c.delays, c.dims, strict=True)],
            bwd_s=[2e-6 * w for w in c.dims],
            fwd_cv=[0.0] * len(c.dims),
            bwd_cv=[0.0] * len(c.dims),
            backend="gloo",
        )
        for c in cases
    ]


def test_side_by_side_gives_each_plan_its_own_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaving plans (and sharing one all-to-all launch) never mixes their figures:
    each plan gets what measuring it alone gives."""
    monkeypatch.setattr(evaluate, "measure_compute", fake_compute)
    monkeypatch.setattr(evaluate, "measure_comm_many", fake_comm)
    tables = make_tables(7, seed=4)
    topo = Topology(gpus=3, gpu_memory_bytes=2**36)
    plans = [
        table_wise_plan(tables, [i % 3 for i in range(7)], topo, "even"),
        table_wise_plan(tables, [0] * 6 + [1], topo, "lopsided"),
    ]
    side = evaluate_side_by_side(plans, tables, batch_size_per_rank=64, repeats=3)
    for plan, got in zip(plans, side.evaluations, strict=True):
        assert got == evaluate.evaluate_plan(plan, tables, batch_size_per_rank=64, repeats=3)
    singles = [fake_compute([ShardLoad.whole(t)], 192).total_s for t in tables]
    assert side.bound_per_repeat == pytest.approx([sum(singles) / 3] * 3)
    assert side.heaviest_s == pytest.approx(max(singles))


# --------------------------------------------------------------------------- input


def test_tasks_are_drawn_from_the_held_out_pool() -> None:
    pool = [t for t in make_tables(30, seed=1) if t.size_bytes < 2**30]
    spec = BenchSpec(tables=[5, 10], gpus=[2, 4], tasks=2, memory_factor=1.25)
    tasks = draw_tasks(spec, pool)
    assert [t.id for t in tasks][:3] == ["T5-W2-0", "T5-W2-1", "T5-W4-0"] and len(tasks) == 8
    assert draw_tasks(spec, pool) == tasks  # deterministic
    assert tasks[0].tables != tasks[1].tables
    for t in tasks:
        sizes = [x.size_bytes for x in t.tables]
        assert len({x.name for x in t.tables}) == len(t.tables)
        limit = 1.25 * max(sum(sizes) / t.topology.gpus, max(sizes))
        assert limit <= t.topology.usable_bytes < limit + 2
    with pytest.raises(UserError, match="pool.max_table_bytes"):
        held_out_pool(BenchSpec(tables=[20], gpus=[2], pool=PoolSpec(count=10)), None)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("tables: [10]\ngpus: [2]\ntask: 3\n", ["spec.yaml, line 3", "'task'", "Extra inputs"]),
        ("tables: [10, 0]\ngpus: [2]\n", ["line 1", "'tables'", "at least 1"]),
        ("tables: [10]\ngpus: []\n", ["line 2", "'gpus'"]),
        ("tables: [10]\n", ["'gpus'", "Field required"]),
        ("tables: [10]\ngpus: [2]\npool:\n  seed: 7\n", ["line 4", "'pool.seed'", "training"]),
        ("tables: [10]\ngpus: [2]\nmemory_factor: 0.5\n", ["line 3", "'memory_factor'"]),
        ("tables: [10\ngpus: [2]\n", ["spec.yaml, line", "not valid YAML"]),
        ("- 10\n- 20\n", ["a bench spec is a mapping"]),
    ],
)
def test_bad_specs_name_file_line_and_field(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_spec(str(path))
    for f in fragments:
        assert f in str(err.value), str(err.value)


def test_spec_files_and_builtins(tmp_path: Path) -> None:
    assert load_spec("quick") == (QUICK, None)
    assert parse_spec('{"tables": [20, 10], "gpus": [4], "pool": {"max_table_bytes": "1GiB"}}') == (
        BenchSpec(tables=[10, 20], gpus=[4], pool=PoolSpec(max_table_bytes=2**30))
    )
    with pytest.raises(UserError, match="no such bench spec file"):
        load_spec(str(tmp_path / "missing.yaml"))
    with pytest.raises(UserError, match="built-in spec"):
        load_spec("fast")


def test_planner_names() -> None:
    assert "torchrec" in resolve_planners("all") and "random" in resolve_planners("all")
    assert resolve_planners("random, torchrec") == ["random", "torchrec"]
    with pytest.raises(UserError, match="unknown planner 'greedy'.*size-greedy"):
        resolve_planners("random,greedy")
    with pytest.raises(UserError, match="twice"):
        resolve_planners("random,random")


def test_results_folder_refuses_a_damaged_middle_line(tmp_path: Path) -> None:
    ResultsFolder(tmp_path, {"spec": 1})
    (tmp_path / "results.jsonl").write_text('{"task": "x"\n{"also": 1}\n')
    with pytest.raises(UserError, match="line 1"):
        ResultsFolder(tmp_path, {"spec": 1})


def test_cli_help_teaches_and_bad_input_is_a_user_error(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(bench_cmd)
    runner = CliRunner()
    helped = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0 and "Example: shardwise bench --quick" in helped.output
    bad = runner.invoke(app, ["--planners", "random,nope", "--out", str(tmp_path)])
    assert isinstance(bad.exception, UserError) and "'nope'" in str(bad.exception)
    (tmp_path / "s.json").write_text('{"tables": [4], "gpus": [2], "repeats": 0}')
    bad = runner.invoke(app, ["--tasks", str(tmp_path / "s.json"), "--out", str(tmp_path)])
    assert isinstance(bad.exception, UserError) and "'repeats'" in str(bad.exception)


def test_table_spec_pool_file(tmp_path: Path) -> None:
    from shardwise.planner.tables import save_tables

    tables = [
        TableSpec(name=f"p{i}", rows=100 * (i + 1), dim=16, pooling_factor=1.0) for i in range(5)
    ]
    save_tables(tables, tmp_path / "pool.csv")
    spec = parse_spec("tables: [3]\ngpus: [2]\npool: {file: pool.csv, max_table_bytes: 20000}\n")
    assert [t.name for t in held_out_pool(spec, tmp_path)] == ["p0", "p1", "p2"]

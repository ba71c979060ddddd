"""The bench's statistics: bootstrap intervals, ties by noise, the best heuristic by
median, balance, and the summary built from them on known numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shardwise.profiler.bench.report import summarize, write_outputs
from shardwise.profiler.bench.results import PlannerResult, TaskResult
from shardwise.profiler.bench.stats import (
    balance,
    best_heuristic,
    bootstrap_geomean,
    compare,
    geomean,
    paired,
    task_noise,
)


def test_bootstrap_interval_covers_the_geomean_and_narrows_with_tasks() -> None:
    rng = np.random.default_rng(3)
    few = list(np.exp(rng.normal(np.log(0.9), 0.1, 8)))
    many = list(np.exp(rng.normal(np.log(0.9), 0.1, 200)))
    lo, hi = bootstrap_geomean(few, seed=1) or (0, 0)
    g = geomean(few)
    assert g is not None and lo < g < hi
    lo2, hi2 = bootstrap_geomean(many, seed=1) or (0, 0)
    assert hi2 - lo2 < (hi - lo) / 2  # about 1/sqrt(25) as wide
    assert lo2 < 0.9 < hi2  # the true geomean
    assert bootstrap_geomean(few, seed=1) == bootstrap_geomean(few, seed=1)  # seeded
    assert bootstrap_geomean([]) is None
    assert bootstrap_geomean([0.8]) == pytest.approx((0.8, 0.8))


def test_the_interval_is_of_the_geomean_not_the_mean() -> None:
    ratios = [0.5, 2.0] * 200  # geomean 1.0, arithmetic mean 1.25
    lo, hi = bootstrap_geomean(ratios, seed=0) or (0, 0)
    assert lo < 1.0 < hi and hi < 1.25


def test_ties_are_set_by_the_noise() -> None:
    assert compare(0.97, 1.0, noise=0.05).verdict == "tie"
    assert compare(0.97, 1.0, noise=0.01).verdict == "win"
    assert compare(1.06, 1.0, noise=0.05).verdict == "loss"
    assert compare(1.0, 2.0, 0.0).ratio == pytest.approx(0.5)
    assert compare(None, 1.0, 0.05).verdict == "loss"  # failing where the reference plans
    assert compare(1.0, None, 0.05).verdict == "win"
    assert compare(None, None, 0.05).verdict == "tie"
    assert task_noise([0.02, 0.10, 0.04]) == 0.04 and task_noise([]) == 0.0
    p = paired([compare(0.9, 1.0, 0.05), compare(0.99, 1.0, 0.05), compare(None, 1.0, 0.05)])
    assert (p.wins, p.ties, p.losses, p.n) == (1, 1, 1, 2)
    assert p.geomean == pytest.approx(math.sqrt(0.9 * 0.99))


def test_best_heuristic_is_the_best_median_not_the_luckiest_draw() -> None:
    """size-greedy is usually best; dim-greedy is far cheaper on one task (a lucky draw)
    and worse elsewhere: the per-task minimum would credit dim-greedy's luck, the median
    picks size-greedy."""
    tasks = [
        {"size-greedy": 1.0, "dim-greedy": 1.2, "lookup-greedy": 1.3},
        {"size-greedy": 1.0, "dim-greedy": 1.1, "lookup-greedy": 1.2},
        {"size-greedy": 1.0, "dim-greedy": 0.3, "lookup-greedy": 1.4},
    ]
    assert best_heuristic(tasks) == "size-greedy"
    failing = [{**t, "size-greedy": None} for t in tasks[:2]] + [tasks[2]]
    assert best_heuristic(failing) == "dim-greedy"  # failures count as infinitely costly
    assert best_heuristic([{"random": 1.0}]) is None


def test_balance_is_mean_over_max() -> None:
    assert balance([1.0, 1.0]) == 1.0
    assert balance([2.0, 1.0, 0.0]) == pytest.approx(0.5)
    assert balance([]) is None


def _task(name: str, costs: dict[str, float | None], cv: float = 0.02) -> TaskResult:
    planners = {
        p: PlannerResult(
            p,
            "ok",
            max_s=c * 1.1,
            compute_max_s=c,
            compute_per_rank=[c, c / 2],
            repeat_cv=cv,
            compute_repeat_cv=cv,
            plan_hash=f"{name}-{p}",
            planning_s=0.1,
        )
        if c is not None
        else PlannerResult(p, "plan-failed", error="no room")
        for p, c in costs.items()
    }
    return TaskResult(
        task=name,
        pool="heldout-5",
        fill_kind="tight",
        tables=4,
        gpus=2,
        index=0,
        seed=0,
        table_names=[],
        global_batch=256,
        batch_size_per_rank=128,
        gpu_memory_bytes=1,
        usable_bytes=1,
        memory_total=1,
        fill=0.9,
        fill_bound=0.88,
        repeats=3,
        device="cpu",
        comm="modelled: nvlink",
        planner_comm="modelled: nvlink",
        bound_s=0.5,
        bound_per_repeat=[0.5],
        bound_cv=0.0,
        heaviest_table_s=0.3,
        evaluation_s=1.0,
        planners=planners,
    )


def test_summary_on_known_numbers() -> None:
    """Paired ratios against TorchRec and the best-median heuristic, W/T/L within the
    noise, failures never a ratio, the worst task against its best baseline."""
    ns = "neuroshard[calibrated+refined]"
    results = [
        _task("a", {"torchrec": 2.0, "size-greedy": 2.2, "dim-greedy": 3.0, ns: 1.0}),
        _task("b", {"torchrec": 4.0, "size-greedy": 4.0, "dim-greedy": 1.0, ns: 4.04}),
        _task("c", {"torchrec": 1.0, "size-greedy": 1.0, "dim-greedy": None, ns: 2.0}),
    ]
    s = summarize(results, ["torchrec", "size-greedy", "dim-greedy", ns], seed=0)
    assert s.best_heuristic["compute"] == "size-greedy"  # dim: 0.47, 0.5 lucky, 1 failure
    f = s.figures_of(ns, "compute")
    assert f is not None
    tr = f.vs["torchrec"]
    assert tr.geomean == pytest.approx((0.5 * 1.01 * 2.0) ** (1 / 3))
    assert (tr.wins, tr.ties, tr.losses) == (1, 1, 1)  # 1.01 is within 2 % noise
    assert tr.interval is not None and tr.interval[0] <= tr.geomean <= tr.interval[1]
    heur = f.vs["best-heuristic"]
    assert heur.geomean == pytest.approx((1 / 2.2 * 1.01 * 2.0) ** (1 / 3))
    # Best baseline per task: a 2.0, b 1.0 (dim-greedy), c 1.0 -> worst b at 4.04x.
    assert f.best_baseline_worst == pytest.approx(4.04)
    assert f.best_baseline_worst_task == "b" and f.beyond_noise == 2
    assert f.balance_median == pytest.approx(0.75)
    dim = s.figures_of("dim-greedy", "compute")
    assert dim is not None and (dim.ok, dim.failed) == (2, 1)
    assert dim.vs["torchrec"].n == 2 and dim.vs["torchrec"].losses >= 1
    total = s.figures_of(ns, "total")
    assert total is not None and total.vs["torchrec"].geomean == pytest.approx(tr.geomean)
    targets = {t.what.split(":")[1].strip(): t for t in s.targets if t.row == ns}
    assert not any(t.met for t in targets.values() if "TorchRec" in t.what)


def test_a_row_failing_where_a_baseline_plans_is_its_worst_task(tmp_path: Path) -> None:
    """A failure is an infinitely bad ratio to the best baseline (counted beyond noise),
    and summary.json stays strict JSON."""
    ns = "neuroshard[bundled]"
    results = [
        _task("a", {"torchrec": 2.0, "size-greedy": 2.2, ns: 1.9}),
        _task("b", {"torchrec": 2.0, "size-greedy": 2.2, ns: None}),
    ]
    s = summarize(results, ["torchrec", "size-greedy", ns])
    f = s.figures_of(ns, "compute")
    assert f is not None and f.best_baseline_worst == math.inf
    assert f.best_baseline_worst_task == "b" and f.beyond_noise == 1 and (f.ok, f.failed) == (1, 1)
    assert f.vs["torchrec"].losses == 1 and f.vs["torchrec"].n == 1
    write_outputs(s, results, tmp_path)

    def strict(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")

    doc = json.loads((tmp_path / "summary.json").read_text(), parse_constant=strict)
    assert doc["tasks"] == 2 and (tmp_path / "summary.csv").read_text().count("\n") == 7

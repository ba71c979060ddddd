"""How well a bench task's measured mixed-kind ranks follow the sum of their parts.

A calibrated model prices a rank from its shards' anchors (each timed alone) and one
fitted factor per rank. This re-times, on this machine and now, each mixed-kind rank of
the plans a ``shardwise bench`` run measured, fused as the evaluator times it (its
function, the task's seed), and every shard of it alone, interleaved, ``--repeats``
times, and prints per task Spearman's rho of:

- the re-timed ranks against the bench's medians: how far the measurement reproduces
  itself minutes or hours later;
- the calibrated model's price against the bench (what ``kinds_fidelity.py`` pools);
- Σ solo (each shard alone, medians) against the re-timed ranks, and the spread of
  fused / Σ solo: what any price that sums per-shard anchors must explain with its
  rank-level factor.

Nothing is planned or fitted; the plans, tables and model prices are the run's own.

    .venv/bin/python benchmarks/rank_parts.py bench-ind-kinds --repeats 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.tables import load_tables
from shardwise.profiler.bench.fidelity import read_results
from shardwise.profiler.bench.quality import saved_plans
from shardwise.profiler.bench.results import TaskResult
from shardwise.profiler.bench.run import PLANS_DIR
from shardwise.profiler.bench.tasks import POOLS_DIR
from shardwise.profiler.compute import ShardLoad, measure_compute
from shardwise.profiler.evaluate import rank_shards
from shardwise.profiler.pretrain.report import metrics


def _timed(loads: list[ShardLoad], task: TaskResult) -> float:
    got = measure_compute(
        loads, task.global_batch, seed=task.seed, local_batch_size=task.batch_size_per_rank
    )
    return got.fwd_s + got.bwd_s


def _key(s: ShardLoad) -> tuple[object, ...]:
    return (s.name, s.cols, s.row_range, s.local_batch)


def task_lines(folder: Path, task: TaskResult, repeats: int, say: Callable[[str], None]) -> str:
    """Re-time ``task``'s mixed-kind ranks and their shards; its line of figures."""
    mixed = (task.mixed_kind or {}).get("calibrated") or []
    if not mixed:
        return f"{task.task}: no mixed-kind rank priced by a calibrated model: skipped"
    tables = {t.name: t for t in load_tables(folder / POOLS_DIR / f"{task.pool}.yaml")}
    specs = [tables[n] for n in task.table_names]
    plans = {p.hash: p for p in saved_plans(task, folder / PLANS_DIR).values()}
    ranks = [(plans[r.plan], r) for r in mixed if r.plan in plans]
    if len(ranks) < len(mixed):
        return f"{task.task}: the plans of its mixed-kind ranks are not in {PLANS_DIR}/: skipped"
    bench, model, fused, solo = [], [], [], []
    alone: dict[tuple[object, ...], list[float]] = {}
    for i, (plan, rec) in enumerate(ranks, start=1):
        loads = rank_shards(plan, specs)[rec.rank]
        say(f"{task.task}: rank {i}/{len(ranks)} ({len(loads)} shards), {repeats} repeats")
        times = []
        for _ in range(repeats):  # the rank, then each shard alone: drift hits both
            times.append(_timed(loads, task))
            for s in loads:
                alone.setdefault(_key(s), []).append(_timed([s], task))
        bench.append(rec.measured_s)
        model.append(rec.predicted_s)
        fused.append(statistics.median(times))
        solo.append(sum(statistics.median(alone[_key(s)]) for s in loads))
    ratio = np.log(np.asarray(fused) / np.asarray(solo))

    def rho(a: list[float], b: list[float]) -> str:
        got = metrics(a, b)["spearman"] if len(a) >= 3 else float("nan")
        return "-" if math.isnan(got) else f"{got:.2f}"

    return (
        f"{task.task}: {len(ranks)} ranks | rho re-timed vs bench {rho(fused, bench)}, "
        f"model vs bench {rho(model, bench)}, sum of solos vs re-timed {rho(solo, fused)}, "
        f"sum of solos vs bench {rho(solo, bench)} | fused / sum of solos: median "
        f"{float(np.exp(np.median(ratio))):.2f}, spread {float(ratio.std()):.3f} (sd of log)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("dir", type=Path, help="a results folder of shardwise bench")
    ap.add_argument("--repeats", type=int, default=5, help="timings of each rank and shard")
    ap.add_argument("--task", action="append", help="only this task id (repeatable)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    try:
        tasks = read_results(args.dir)
        for task in tasks:
            if args.task and task.task not in args.task:
                continue
            print(task_lines(args.dir, task, args.repeats, lambda t: print(t, file=sys.stderr)))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

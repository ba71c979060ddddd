"""NeuroShard's planning time, peak memory and predicted quality at the design's sizes.

    python benchmarks/neuroshard_scale.py [--repeats 3] [--only small|big|huge]
        [--batch-per-rank 512]

- 80 tables on 8 GPUs,
- 856 tables (the size of Meta's open dataset, from the calibrated generator) on 128
  GPUs, memory-constrained: each GPU holds 1.2 x its balanced share (the largest
  table at least), so placements are tight (target: <= 30 s), and
- 10,000 tables on 8 GPUs (target: <= 60 s and <= 2 GB peak RSS),

planned end to end: search, plan.json validation, and TorchRec's ``ShardingPlan``
for the placement (what the workers receive). Prints the planning time (median of
``--repeats``), the search's statistics, and the *predicted* max-rank cost beside the
greedy heuristics' and TorchRec's plans priced by the same model (predictions, not
measurements: ``shardwise bench`` measures). One torch thread, as the planner runs in
the operator. CPU figures.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from shardwise.basics import UserError
from shardwise.planner.base import PlannerOptions
from shardwise.planner.comm.choice import resolve_comm
from shardwise.planner.costmodel import CostPredictor, load_bundled
from shardwise.planner.neuroshard import NeuroShardPlanner
from shardwise.planner.registry import get_planner
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import to_sharding_plan

BASELINES = ("size-greedy", "lookup-greedy", "size-lookup-greedy", "dim-greedy", "torchrec")


def run(count: int, gpus: int, slack: float, repeats: int, seed: int, batch: int) -> None:
    tables = generate_tables(count, seed=seed)
    total = sum(t.size_bytes for t in tables)
    largest = max(t.size_bytes for t in tables)
    reserve = 0.15
    memory = int(max(slack * total / gpus, 1.05 * largest) / (1 - reserve))
    topo = Topology(
        gpus=gpus, gpu_memory_bytes=memory, memory_reserve=reserve, batch_size_per_rank=batch
    )
    print(
        f"\n{count} tables ({total / 2**30:.1f} GiB, largest {largest / 2**30:.2f} GiB) on "
        f"{gpus} GPUs of {memory / 2**30:.2f} GiB ({slack:g} x the balanced share), "
        f"{batch} samples per GPU"
    )
    model = load_bundled()
    times = []
    for _ in range(repeats):
        predictor = CostPredictor(model)
        predictor.comm_model = resolve_comm(
            "auto", world=gpus, device=topo.device, predictor=predictor, measuring=False
        )
        planner = NeuroShardPlanner(PlannerOptions(predictor=predictor))
        start = time.perf_counter()
        plan = planner.plan(tables, topo)
        plan.validate_plan(tables)
        to_sharding_plan(plan)
        times.append(time.perf_counter() - start)
    stats = planner.last_stats
    assert plan.predicted is not None
    ours = plan.predicted.max_seconds
    print(
        f"  neuroshard: {statistics.median(times):.2f} s (runs: "
        f"{', '.join(f'{t:.2f}' for t in times)}), {stats.candidates} split states, "
        f"{stats.split_tables} tables split, local search -{stats.refine_gain:.1%}, "
        f"{stats.steps} beam steps{' (' + stats.stopped + ')' if stats.stopped else ''}, "
        f"plan from {stats.source}; predicted max {ours * 1e3:.1f} ms, imbalance "
        f"{plan.predicted.imbalance:.3f}; peak RSS so far {_peak_rss_mb():.0f} MB"
    )
    pred = predictor
    for name in BASELINES:
        start = time.perf_counter()
        try:
            theirs = get_planner(name).plan(tables, topo)
        except UserError as e:
            print(f"  {name:<19} failed: {str(e).splitlines()[0][:90]}")
            continue
        spent = time.perf_counter() - start
        cost = pred.predict_plan(theirs, tables).max_s
        print(
            f"  {name:<19} {spent:6.2f} s  predicted max {cost * 1e3:7.1f} ms  "
            f"(neuroshard {ours / cost:.2f}x)"
        )


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


SIZES = {"small": (80, 8, 1.3), "big": (856, 128, 1.2), "huge": (10_000, 8, 1.3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=sorted(SIZES), default=None)
    ap.add_argument("--batch-per-rank", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, (count, gpus, slack) in SIZES.items():
        if args.only in (None, name):
            run(count, gpus, slack, args.repeats, args.seed, args.batch_per_rank)


if __name__ == "__main__":
    main()

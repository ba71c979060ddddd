"""NeuroShard's planning time, peak memory and predicted quality at the design's sizes.

    python benchmarks/neuroshard_scale.py [--repeats 3] [--only small|big|huge|terabyte]
        [--batch-per-rank 512] [--oversized N] [--kinds all|tw-cw]

- 80 tables on 8 GPUs,
- 856 tables (the size of Meta's open dataset, from the calibrated generator) on 128
  GPUs, memory-constrained: each GPU holds 1.2 x its balanced share (the largest
  table at least), so placements are tight (target: <= 30 s), and
- 10,000 tables on 8 GPUs (target: <= 60 s and <= 2 GB peak RSS),
- ``terabyte``: one 1 TB table (4e9 rows x 64, fp32) and 100 generated tables on 64
  GPUs of 80 GiB (target: <= 60 s; planning only, nothing is measured at that size),

``--oversized N`` adds N tables of 3x one GPU's memory to the first three sizes (they
go row-wise, the search places the rest around them),

``--kinds tw-cw`` plans with ``neuroshard-tw-cw`` (table-wise and column-wise only, the
search before kinds were searched) instead of ``neuroshard`` (every kind); with every
kind the kind search's states, moves and seconds and its choices are printed too,

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
from shardwise.planner.neuroshard import NeuroShardPlanner, NeuroShardTwCwPlanner
from shardwise.planner.neuroshard.planner import TORCHREC_LIMITS
from shardwise.planner.registry import get_planner
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.planner.torchrec_plan import to_sharding_plan

BASELINES = (
    "size-greedy",
    "lookup-greedy",
    "size-lookup-greedy",
    "dim-greedy",
    "torchrec",
    "torchrec-tw-cw",
)


def run(
    count: int,
    gpus: int,
    slack: float,
    repeats: int,
    seed: int,
    batch: int,
    oversized: int,
    kinds: str,
) -> None:
    tables = generate_tables(count, seed=seed)
    total = sum(t.size_bytes for t in tables)
    largest = max(t.size_bytes for t in tables)
    reserve = 0.15
    # Each oversized table holds 3 GPUs' usable memory, and the GPUs hold slack x all of
    # it: usable = slack x (total + 3 k usable) / gpus, solved for usable.
    room = 1.0 - 3.0 * slack * oversized / gpus
    if room <= 0:
        raise SystemExit(f"--oversized {oversized}: {gpus} GPUs cannot hold that many")
    usable = max(slack * total / gpus / room, 1.05 * largest)
    memory = int(usable / (1 - reserve))
    topo = Topology(
        gpus=gpus, gpu_memory_bytes=memory, memory_reserve=reserve, batch_size_per_rank=batch
    )
    rows = int(3 * usable / (64 * 4))  # 3x a GPU's usable memory, dim 64
    tables += [
        TableSpec(name=f"oversized{i}", rows=rows, dim=64, pooling_factor=8.0)
        for i in range(oversized)
    ]
    plan_and_report(tables, topo, repeats, kinds)


def run_terabyte(repeats: int, batch: int, kinds: str) -> None:
    """The 1 TB table among 100 generated ones on 64 GPUs of 80 GiB."""
    huge = TableSpec(name="huge", rows=4_000_000_000, dim=64, pooling_factor=20.0)
    tables = [huge, *generate_tables(100, seed=3)]
    topo = Topology(gpus=64, gpu_memory_bytes=80 * 2**30, batch_size_per_rank=batch)
    plan_and_report(tables, topo, repeats, kinds)


def plan_and_report(tables: list[TableSpec], topo: Topology, repeats: int, kinds: str) -> None:
    total = sum(t.size_bytes for t in tables)
    largest = max(t.size_bytes for t in tables)
    gpus, memory, batch = topo.gpus, topo.gpu_memory_bytes, topo.batch_size_per_rank
    print(
        f"\n{len(tables)} tables ({total / 2**30:.1f} GiB, largest {largest / 2**30:.2f} GiB) "
        f"on {gpus} GPUs of {memory / 2**30:.2f} GiB, {batch} samples per GPU"
    )
    model = load_bundled()
    times = []
    for _ in range(repeats):
        predictor = CostPredictor(model)
        predictor.comm_model = resolve_comm(
            "auto", world=gpus, device=topo.device, predictor=predictor, measuring=False
        )
        cls = NeuroShardTwCwPlanner if kinds == "tw-cw" else NeuroShardPlanner
        planner = cls(PlannerOptions(predictor=predictor))
        start = time.perf_counter()
        plan = planner.plan(tables, topo)
        plan.validate_plan(tables)
        to_sharding_plan(plan)
        times.append(time.perf_counter() - start)
    stats = planner.last_stats
    assert plan.predicted is not None
    ours = plan.predicted.max_seconds
    print(
        f"  {planner.name}: {statistics.median(times):.2f} s (runs: "
        f"{', '.join(f'{t:.2f}' for t in times)}), {stats.candidates} split states, "
        f"{stats.split_tables} tables split, local search -{stats.refine_gain:.1%}, "
        f"{stats.steps} beam steps{' (' + stats.stopped + ')' if stats.stopped else ''}, "
        f"plan from {stats.source}; predicted max {ours * 1e3:.1f} ms, imbalance "
        f"{plan.predicted.imbalance:.3f}; peak RSS so far {_peak_rss_mb():.0f} MB"
    )
    held = {k: n for k, n in plan.kinds().items() if k != "table_wise"}
    if held:
        print(f"  kinds besides table-wise: {held}")
    if stats.kind_candidates or stats.kind_moves:
        print(
            f"  kind search: {stats.kind_candidates} kind states, {stats.kind_moves} kind "
            f"moves priced, {stats.kind_seconds:.2f} s; restricted search's best "
            f"{stats.priced.get('search-tw-cw', float('nan')) * 1e3:.1f} ms predicted"
        )
    for line in stats.kinds[:8]:
        print(f"    {line}")
    if len(stats.kinds) > 8:
        print(f"    ... and {len(stats.kinds) - 8} more")
    if stats.baseline_errors:
        print(f"  baselines left out: {stats.baseline_errors}")
    pred = predictor
    for name in BASELINES:
        most, pairs = TORCHREC_LIMITS.get(name, (len(tables), len(tables) * gpus))
        if len(tables) > most or len(tables) * gpus > pairs:
            print(f"  {name:<19} left out: minutes at this size (as in neuroshard's candidates)")
            continue
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
CHOICES = [*SIZES, "terabyte"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=CHOICES, default=None)
    ap.add_argument("--batch-per-rank", type=int, default=512)
    ap.add_argument("--oversized", type=int, default=0, help="tables of 3x a GPU's memory")
    ap.add_argument(
        "--kinds",
        choices=["all", "tw-cw"],
        default="all",
        help="every kind (neuroshard) or table-wise/column-wise only (neuroshard-tw-cw)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, (count, gpus, slack) in SIZES.items():
        if args.only in (None, name):
            run(
                count,
                gpus,
                slack,
                args.repeats,
                args.seed,
                args.batch_per_rank,
                args.oversized,
                args.kinds,
            )
    if args.only in (None, "terabyte"):
        run_terabyte(args.repeats, args.batch_per_rank, args.kinds)


if __name__ == "__main__":
    main()

"""How long the TorchRec baselines take to plan: median wall time per table count.

    python benchmarks/torchrec_planning_time.py [--counts 80 400] [--gpus 8]
        [--gpus-per-host 8] [--gpu-memory 32GiB | --slack 1.2] [--batch-size 65536]
        [--repeats 3]
        [--planner torchrec|torchrec-tw-cw] [--default-proposers]

``--planner torchrec`` (the default) is TorchRec's planner offered every sharding kind
(data-parallel, table-, column-, table-column-, row-, table-row-wise, grid);
``torchrec-tw-cw`` its table-wise/column-wise restriction. Tables come from the
synthetic generator (``shardwise.planner.synthetic``, seed 0, histograms measured at
batch 4096 to keep this quick). Time covers building the meta-device EBC, TorchRec's
enumeration, its proposers and partitioner, and the conversion and validation of the
plan; TorchRec's import is paid once, in a warm-up run, and not counted. A count
TorchRec cannot place is reported with its reason. The default 32 GiB per GPU leaves
room for the input/output buffers the memory rule charges at batch 65536 (400
synthetic tables hold 44.5 GiB of weights but need about 116 GB with buffers). Run
a large count under ``timeout`` to bound it: each count prints when it finishes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from shardwise.basics import UserError, format_bytes, parse_bytes
from shardwise.planner.baselines.torchrec import (
    GREEDY_THRESHOLD,
    TorchRecPlanner,
    TorchRecTwCwPlanner,
)
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.profiler.bench.results import kinds_text

#: The generator measures pooling from a generated batch: a small one keeps this quick.
GENERATOR_BATCH = 4096
PLANNERS = {"torchrec": TorchRecPlanner, "torchrec-tw-cw": TorchRecTwCwPlanner}
RESERVE = 0.15


def time_plan(
    planner: TorchRecPlanner, tables: Sequence[TableSpec], topology: Topology
) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        plan = planner.plan(tables, topology)
    except UserError as err:
        return time.perf_counter() - start, "no plan: " + str(err).splitlines()[0][:120]
    seconds = time.perf_counter() - start
    peak = max(plan.memory_per_rank())
    return seconds, f"{kinds_text(plan.kinds())}; fullest rank {format_bytes(peak)}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--counts", type=int, nargs="+", default=[80, 400])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-host", type=int, default=None, help="default: one host")
    parser.add_argument("--gpu-memory", default="32GiB", help="per GPU")
    parser.add_argument(
        "--slack",
        type=float,
        default=None,
        help="instead of --gpu-memory: GPUs holding SLACK x the weights' balanced share "
        "(the largest table at least), as benchmarks/neuroshard_scale.py sizes them",
    )
    parser.add_argument("--batch-size", type=int, default=65536, help="per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--planner", choices=sorted(PLANNERS), default="torchrec")
    parser.add_argument(
        "--default-proposers",
        action="store_true",
        help="TorchRec's default proposer list (grid search included) instead of ours",
    )
    args = parser.parse_args(argv)

    threshold = None if args.default_proposers else GREEDY_THRESHOLD
    planner = PLANNERS[args.planner](threshold=threshold)
    proposer = (
        "TorchRec's default proposer list"
        if args.default_proposers
        else f"greedy x2 (threshold {GREEDY_THRESHOLD}) + uniform"
    )
    memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    print(
        f"{args.planner} ({', '.join(planner.sharding_types)}), {proposer}: {args.gpus} "
        f"GPUs, {args.gpus_per_host or args.gpus} per host, batch {args.batch_size} per "
        f"rank, median of {args.repeats}",
        flush=True,
    )
    warm = generate_tables(4, args.seed, batch_size=GENERATOR_BATCH)
    time_plan(planner, warm, _topology(args, warm, memory))
    for count in args.counts:
        tables = generate_tables(count, args.seed, batch_size=GENERATOR_BATCH)
        topology = _topology(args, tables, memory)
        runs = [time_plan(planner, tables, topology) for _ in range(args.repeats)]
        median = statistics.median(seconds for seconds, _ in runs)
        weights = format_bytes(sum(t.size_bytes for t in tables))
        print(
            f"{count:5d} tables ({weights}) on {format_bytes(topology.gpu_memory_bytes)} "
            f"GPUs: {median:8.2f} s   {runs[-1][1]}",
            flush=True,
        )


def _topology(args: argparse.Namespace, tables: Sequence[TableSpec], memory: int) -> Topology:
    """The GPUs: ``--gpu-memory`` each, or sized by ``--slack`` for these tables."""
    if args.slack is not None:
        total = sum(t.size_bytes for t in tables)
        largest = max(t.size_bytes for t in tables)
        memory = int(max(args.slack * total / args.gpus, 1.05 * largest) / (1 - RESERVE))
    return Topology(
        gpus=args.gpus,
        gpus_per_host=args.gpus_per_host,
        gpu_memory_bytes=memory,
        batch_size_per_rank=args.batch_size,
        memory_reserve=RESERVE,
    )


if __name__ == "__main__":
    main()

"""What the memory rule (docs/memory.md) adds to the weights, by batch per rank.

    python benchmarks/memory_rule.py [--tables tables.yaml | --count 80 --seed 0]
        [--gpus 8] [--gpu-memory 4GiB] [--batches 128 65536]

For each batch: the tables' weights, row-wise Adagrad state and I/O buffers placed
whole (table-wise), the largest single table, and the busiest rank of the size-greedy
plan under the rule next to its weights (or why no plan fits). The default tables are
the demo's (``shardwise tables generate --count 80 --seed 0``), on its 8 GPUs of 4 GiB.
"""

from __future__ import annotations

import argparse

from shardwise.basics import UserError, format_bytes, parse_bytes
from shardwise.planner.memory import memory_sum, shard_memory
from shardwise.planner.registry import get_planner
from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import load_tables
from shardwise.planner.topology import Topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", help="a tables file (default: generated)")
    parser.add_argument("--count", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-memory", default="4GiB")
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 65536])
    args = parser.parse_args()
    tables = (
        load_tables(args.tables) if args.tables else generate_tables(args.count, seed=args.seed)
    )
    memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    print(
        f"{len(tables)} tables on {args.gpus} GPUs of {format_bytes(memory)}; "
        "whole tables, weights + row-wise Adagrad state + I/O buffers:"
    )
    for batch in args.batches:
        parts = [shard_memory(t, t.dim, batch, args.gpus) for t in tables]
        total = memory_sum(parts)
        biggest = max(parts, key=lambda m: m.total)
        print(
            f"  batch {batch:>6}/rank: {total.describe()}: +{total.total / total.weights - 1:.1%}"
            f" over the weights; largest table {biggest.describe()}"
        )
        topo = Topology(gpus=args.gpus, gpu_memory_bytes=memory, batch_size_per_rank=batch)
        try:
            plan = get_planner("size-greedy").plan(tables, topo)
        except UserError as err:
            print(f"    size-greedy: no plan: {str(err).splitlines()[0]}")
            continue
        ranks = plan.rank_memory(tables)
        top = max(ranks, key=lambda m: m.total)
        print(
            f"    size-greedy's busiest rank: {top.describe()} of "
            f"{format_bytes(topo.usable_bytes)} usable (weights alone: "
            f"{format_bytes(max(m.weights for m in ranks))})"
        )


if __name__ == "__main__":
    main()

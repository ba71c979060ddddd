"""What the glibc allocator mitigation is worth (docs/design.md §6).

Times a wide shard set (16 generated tables at width 128: total width 2048) as one
fused kernel and as its two halves timed apart, and prints time(all) / (time(half A)
+ time(half B)) WITH and WITHOUT the mitigation. Each setting runs in a fresh
subprocess (the mitigation with the environment glibc reads at start-up, the baseline
with those variables removed and ``mitigate_allocator=False``), so neither leaks into
the other. Without the mitigation the wide kernel pays page faults for its large
outputs that its halves pay less of, which inflates the ratio.

    .venv/bin/python benchmarks/allocator_effect.py [--batch-size B] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from shardwise.planner.synthetic import generate_tables
from shardwise.planner.tables import TableSpec
from shardwise.profiler import allocator
from shardwise.profiler.compute import DEFAULT_BATCH_SIZE, ShardLoad, measure_compute

WIDTH = 128
TABLES = 16  # 16 × 128 = 2048 columns
MAX_ROWS = 500_000  # keeps the set near 1 GiB of weights


def wide_set(count: int = TABLES) -> list[TableSpec]:
    """``count`` generated tables (seed 0, rows <= MAX_ROWS), each widened to WIDTH."""
    specs = [s for s in generate_tables(4 * count, 0, batch_size=4096) if s.rows <= MAX_ROWS]
    if len(specs) < count:
        raise SystemExit(f"only {len(specs)} small-enough tables; raise the pool")
    return [s.model_copy(update={"dim": WIDTH}) for s in specs[:count]]


def child(mitigate: bool, batch_size: int, repeats: int, iters: int) -> dict[str, Any]:
    """Runs inside the fresh subprocess: full set vs halves, ``repeats`` times."""
    specs = wide_set()
    full = [ShardLoad.whole(s) for s in specs]
    half_a, half_b = full[0::2], full[1::2]
    ratios: list[float] = []
    fwd_ratios: list[float] = []
    totals: list[list[float]] = []
    fwds: list[float] = []
    cvs: list[float] = []
    mitigated = False
    for _ in range(repeats):
        runs = [
            measure_compute(part, batch_size, iters=iters, mitigate_allocator=mitigate)
            for part in (full, half_a, half_b)
        ]
        mitigated = runs[0].allocator_mitigated
        ratios.append(runs[0].total_s / (runs[1].total_s + runs[2].total_s))
        fwd_ratios.append(runs[0].fwd_s / (runs[1].fwd_s + runs[2].fwd_s))
        fwds.append(runs[0].fwd_s)
        totals.append([r.total_s for r in runs])
        cvs.extend(r.cv for r in runs)
    return {
        "mitigated": mitigated,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "fwd_ratio": statistics.median(fwd_ratios),
        "full_fwd_s": statistics.median(fwds),
        "full_s": statistics.median(t[0] for t in totals),
        "halves_s": statistics.median(t[1] + t[2] for t in totals),
        "median_cv": statistics.median(cvs),
        "width": sum(s.cols for s in full),
        "batch_size": batch_size,
    }


def run_child(mitigate: bool, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    for key in allocator.ENV:
        env.pop(key, None)
    if mitigate:
        env = allocator.allocator_env(env)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "on" if mitigate else "off",
        "--batch-size",
        str(args.batch_size),
        "--repeats",
        str(args.repeats),
        "--iters",
        str(args.iters),
    ]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "on", args.batch_size, args.repeats, args.iters)))
        return
    print(
        f"wide set: {TABLES} tables × {WIDTH} columns, batch {args.batch_size}, "
        f"{args.repeats} repeats × (5 warm-ups + {args.iters} calls), CPU={os.cpu_count()}"
    )
    for mitigate in (False, True):
        r = run_child(mitigate, args)
        label = "with mitigation   " if mitigate else "without mitigation"
        print(
            f"{label}: all {r['full_s'] * 1e3:7.1f} ms, halves {r['halves_s'] * 1e3:7.1f} ms, "
            f"ratio {r['ratio']:.3f} (repeats {', '.join(f'{x:.3f}' for x in r['ratios'])}); "
            f"forward alone: all {r['full_fwd_s'] * 1e3:6.1f} ms, ratio {r['fwd_ratio']:.3f}; "
            f"median CV {r['median_cv']:.1%}, allocator check: "
            f"{'active' if r['mitigated'] else 'inactive'}"
        )


if __name__ == "__main__":
    main()

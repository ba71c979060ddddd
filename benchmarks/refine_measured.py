"""Measured refinement on generated tables, judged by a fresh evaluation (docs/refinement.md).

Plans the tables with each planner at the job's batch, refines each plan by
measurement within a budget, and prints the refinement's own fresh figures (start vs
refined, and what its loop believed). Then, unless ``--evaluate-repeats 0``, the
evaluator measures every start and refined plan side by side, interleaved, with the
same declared comm: an independent judge of the refinement.

    python benchmarks/refine_measured.py --count 50 --max-rows 1000000

``--max-rows`` caps each table's rows: on a CPU host FBGEMM initialises every kernel's
weights in host memory, and a 20M-row table costs ~20 s to build each time it is timed.
"""

from __future__ import annotations

import argparse
import time

from shardwise.cli._common import choose_model
from shardwise.planner.base import PlannerOptions, run_planner
from shardwise.planner.comm.choice import resolve_comm
from shardwise.planner.costmodel import CostPredictor
from shardwise.planner.families import generate
from shardwise.planner.plan import Plan
from shardwise.planner.registry import get_planner
from shardwise.planner.topology import Topology
from shardwise.profiler.evaluate import evaluate_side_by_side
from shardwise.profiler.refine.measured import RefinementSkipped, measurable, refine_measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="heldout")
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--seed", type=int, default=2027)
    ap.add_argument("--max-rows", type=int, default=0, help="cap rows (0: as generated)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-memory", type=int, default=80 * 2**30)
    ap.add_argument("--batch-per-rank", type=int, default=1024)
    ap.add_argument("--planners", default="torchrec,neuroshard")
    ap.add_argument("--comm", default="auto")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--evaluate-repeats", type=int, default=5)
    args = ap.parse_args()

    tables = generate(args.family, args.count, args.seed)
    if args.max_rows:
        tables = [t.model_copy(update={"rows": min(t.rows, args.max_rows)}) for t in tables]
    gib = sum(t.size_bytes for t in tables) / 2**30
    print(f"{len(tables)} {args.family} tables (seed {args.seed}), {gib:.1f} GiB of weights")
    topo = Topology(
        gpus=args.gpus,
        gpu_memory_bytes=args.gpu_memory,
        device="cuda",
        batch_size_per_rank=args.batch_per_rank,
    )
    choice = choose_model(None, tables, calibrate="shardwise calibrate ...")
    predictor = CostPredictor(choice.model) if choice is not None else None
    comm = resolve_comm(
        args.comm, world=args.gpus, device="cpu", predictor=predictor, measuring=False
    )
    print(f"comm: {comm.describe()}")
    t0 = time.perf_counter()
    why = measurable(tables, args.batch_per_rank, args.gpus, budget_s=args.budget)
    print(f"measurable: {why or 'yes'} ({time.perf_counter() - t0:.1f} s to check)")

    starts: list[Plan] = []
    refined: list[Plan] = []
    for name in args.planners.split(","):
        planner = get_planner(name, PlannerOptions(predictor=predictor))
        run = run_planner(planner, tables, topo, predictor)
        print(f"\n{name}: planned in {run.seconds:.1f} s")
        try:
            out = refine_measured(
                run.plan,
                tables,
                comm=comm,
                predictor=predictor,
                budget_s=args.budget,
                on_step=lambda line: print(f"  {line}", flush=True),
            )
        except RefinementSkipped as err:
            print(f"  {err}")
            continue
        rec = out.refinement
        assert rec is not None
        print(
            f"  {name}: {rec.moves} moves, {rec.kernels_measured} kernels, {rec.seconds:.1f} s;"
            f" fresh max compute {1e3 * rec.start_max_compute_seconds:.2f} -> "
            f"{1e3 * rec.final_max_compute_seconds:.2f} ms "
            f"({rec.final_max_compute_seconds / rec.start_max_compute_seconds:.3f}x), "
            f"loop believed {1e3 * rec.believed_max_compute_seconds:.2f} ms"
        )
        starts.append(run.plan)
        refined.append(out)

    if args.evaluate_repeats and starts:
        plans = [p for pair in zip(starts, refined, strict=True) for p in pair]
        labels = [f"{p.planner}{' +refined' if k % 2 else ''}" for k, p in enumerate(plans)]
        print(f"\nevaluator, side by side, {args.evaluate_repeats} repeats:")
        side = evaluate_side_by_side(
            plans,
            tables,
            batch_size_per_rank=args.batch_per_rank,
            repeats=args.evaluate_repeats,
            bound=False,
            comm=comm,
        )
        first = None
        for label, plan, ev, err in zip(labels, plans, side.evaluations, side.errors, strict=True):
            if ev is None:
                print(f"  {label}: not measured ({err})")
                continue
            compute = max(r.fwd_compute_s + r.bwd_compute_s for r in ev.ranks)
            first = first or ev.max_s
            print(
                f"  {label:24s} {plan.hash[:8]} cost {1e3 * ev.max_s:7.2f} ms "
                f"(max compute {1e3 * compute:7.2f} ms, max/mean {ev.max_over_mean:.2f}, "
                f"repeat CV {ev.repeat_cv:.1%}) = {ev.max_s / first:.3f}x the first"
            )


if __name__ == "__main__":
    main()

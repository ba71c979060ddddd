"""Does a cost model rank and price the plans it will choose between, here, at the job's batch?

    python benchmarks/calibration_quality.py --tables T.yaml --gpus 8 --batch-per-rank 1024 \
        --gpu-memory 4GiB --model calibrated.pt --model bundled [--unseen U.yaml] [--repeats 3]

For each tables file it makes the plans every planner would give the job (the greedy
heuristics, TorchRec's planner, NeuroShard with each model, and ``--random-plans``
random placements), then measures every rank's fused fwd+bwd kernel on this machine
at the job's global batch (``batch-per-rank × gpus``), interleaved over ``--repeats``
so that the machine's drift hits every plan alike (medians per rank). Each model then
predicts the same kernels, and the script prints, side by side:

- per rank: Spearman's rho and MAPE of predicted against measured compute;
- per plan: Spearman's rho of the predicted against the measured max-rank compute;
- the measurement against itself (repeat 1 against repeat 2, same figures): the
  agreement this machine's noise allows any model;
- the measured max-rank compute of each planner's plan, and its spread over the repeats
  (CV of the per-repeat max).

The measurement is the profiler's kernel timing (docs/design.md §6), not any model; the
batch is the job's, never the 128 per rank a planner might assume. ``--unseen`` gives
tables of the same family the calibration never saw. These are CPU figures on a CPU
machine. Models: a file, or ``bundled``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.basics import UserError, parse_bytes
from shardwise.planner.base import PlannerOptions, run_planner
from shardwise.planner.costmodel import CostModel, CostPredictor, load_bundled
from shardwise.planner.plan import Plan
from shardwise.planner.registry import get_planner
from shardwise.planner.tables import TableSpec, load_tables
from shardwise.planner.topology import Topology
from shardwise.profiler.compute import measure_compute
from shardwise.profiler.evaluate import rank_shards
from shardwise.profiler.pretrain.report import metrics

HEURISTICS = ("size-greedy", "dim-greedy", "lookup-greedy", "size-lookup-greedy", "torchrec")


@dataclass
class Measured:
    """One plan: who made it, each rank's measured fwd+bwd compute (median, s), and its
    max over ranks in each repeat (the spread a plan's figure has here)."""

    label: str
    plan: Plan
    ranks: list[float]
    per_repeat: list[list[float]]  # [rank][repeat], seconds

    @property
    def max_per_repeat(self) -> list[float]:
        return [max(t[rep] for t in self.per_repeat) for rep in range(len(self.per_repeat[0]))]

    @property
    def cv(self) -> float:
        m = self.max_per_repeat
        return statistics.pstdev(m) / statistics.fmean(m) if len(m) > 1 else 0.0


def load_model(text: str) -> tuple[str, CostModel]:
    if text == "bundled":
        return "bundled", load_bundled()
    return Path(text).name, CostModel.load(text)


def make_plans(
    tables: Sequence[TableSpec],
    topology: Topology,
    models: Sequence[tuple[str, CostModel]],
    random_plans: int,
) -> list[tuple[str, Plan]]:
    """Every planner's plan for the job, each distinct plan once (first label kept)."""
    runs: list[tuple[str, str, PlannerOptions]] = []
    for name in HEURISTICS:
        runs.append((name, name, PlannerOptions()))
    for label, model in models:
        options = PlannerOptions(predictor=CostPredictor(model))
        runs.append((f"neuroshard[{label}]", "neuroshard", options))
    for seed in range(random_plans):
        runs.append((f"random#{seed}", "random", PlannerOptions(seed=seed)))
    plans: dict[str, tuple[str, Plan]] = {}
    for label, name, options in runs:
        try:
            plan = run_planner(get_planner(name, options), tables, topology).plan
        except UserError as err:
            print(f"  {label}: no plan ({err})")
            continue
        if plan.hash in plans:
            print(f"  {label}: the same plan as {plans[plan.hash][0]}")
        plans.setdefault(plan.hash, (label, plan))
    return list(plans.values())


def measure(
    plans: Sequence[tuple[str, Plan]], tables: Sequence[TableSpec], global_batch: int, repeats: int
) -> list[Measured]:
    """Per-rank medians over ``repeats``, plans in a rotating order per repeat."""
    loads = [rank_shards(p, tables) for _, p in plans]
    times: list[list[list[float]]] = [[[] for _ in ls] for ls in loads]
    for rep in range(repeats):
        order = list(range(len(plans)))
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for i in order:
            for r, shards in enumerate(loads[i]):
                local = global_batch // plans[i][1].world_size
                m = measure_compute(shards, global_batch, seed=rep, local_batch_size=local)
                times[i][r].append(m.fwd_s + m.bwd_s)
        print(f"  repeat {rep + 1}/{repeats} measured {len(plans)} plans", flush=True)
    return [
        Measured(
            label,
            plan,
            [statistics.median(t) for t in ranks],
            ranks,
        )
        for (label, plan), ranks in zip(plans, times, strict=True)
    ]


def predict(
    model: CostModel, measured: Sequence[Measured], tables: Sequence[TableSpec], global_batch: int
) -> list[list[float]]:
    predictor = CostPredictor(model)
    specs = {t.name: t for t in tables}
    out = []
    for m in measured:
        sets = [[(specs[t.name], s.cols) for t, s in shards] for shards in m.plan.shards_per_rank()]
        fb = predictor.compute(sets, global_batch)
        out.append([float(f + b) for f, b in fb])
    return out


def report(
    title: str,
    measured: Sequence[Measured],
    models: Sequence[tuple[str, CostModel]],
    tables: Sequence[TableSpec],
    global_batch: int,
) -> None:
    n_ranks = sum(len(m.ranks) for m in measured)
    print(f"\n== {title}: {len(measured)} plans, {n_ranks} ranks, global batch {global_batch:,}")
    print("   (per-rank fused fwd+bwd compute on this machine: CPU figures)")
    true_ranks = [x for m in measured for x in m.ranks]
    true_max = [max(m.ranks) for m in measured]
    print(
        f"{'model':<28} {'rank rho':>9} {'rank MAPE':>10} {'plan-max rho':>13} "
        f"{'plan-max MAPE':>14}"
    )
    for label, model in models:
        pred = predict(model, measured, tables, global_batch)
        per_rank = metrics([x for p in pred for x in p], true_ranks)
        per_plan = metrics([max(p) for p in pred], true_max)
        print(
            f"{label:<28} {per_rank['spearman']:>9.3f} {per_rank['mape']:>10.1%} "
            f"{per_plan['spearman']:>13.3f} {per_plan['mape']:>14.1%}"
        )
    if all(len(m.max_per_repeat) > 1 for m in measured):
        first = [t[0] for m in measured for t in m.per_repeat]
        second = [t[1] for m in measured for t in m.per_repeat]
        per_rank = metrics(first, second)
        per_plan = metrics(
            [m.max_per_repeat[0] for m in measured], [m.max_per_repeat[1] for m in measured]
        )
        print(
            f"{'(noise) repeat 1 vs 2':<28} {per_rank['spearman']:>9.3f} {per_rank['mape']:>10.1%} "
            f"{per_plan['spearman']:>13.3f} {per_plan['mape']:>14.1%}"
        )
    ref = next((max(m.ranks) for m in measured if m.label == "torchrec"), None)
    print(f"\n{'plan':<28} {'max-rank ms':>12} {'x TorchRec':>11} {'mean/max':>9} {'CV':>6}")
    for m in sorted(measured, key=lambda m: max(m.ranks)):
        top = max(m.ranks)
        rel = f"{top / ref:.3f}" if ref else "-"
        print(
            f"{m.label:<28} {top * 1e3:>12.2f} {rel:>11} "
            f"{float(np.mean(m.ranks)) / top:>9.2f} {m.cv:>6.1%}"
        )


def run(
    path: Path,
    topology: Topology,
    models: Sequence[tuple[str, CostModel]],
    random_plans: int,
    repeats: int,
) -> None:
    tables = load_tables(path)
    global_batch = topology.batch_size_per_rank * topology.gpus
    print(f"{path}: {len(tables)} tables; planning with every planner")
    plans = make_plans(tables, topology, models, random_plans)
    measured = measure(plans, tables, global_batch, repeats)
    report(str(path), measured, models, tables, global_batch)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tables",
        type=Path,
        required=True,
        help="the job's tables (what the model was calibrated on)",
    )
    ap.add_argument(
        "--unseen",
        type=Path,
        action="append",
        default=[],
        help="tables of the same family it never saw (repeatable)",
    )
    ap.add_argument(
        "--model",
        action="append",
        required=True,
        help="a cost model file, or 'bundled' (repeatable)",
    )
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--batch-per-rank", type=int, default=1024)
    ap.add_argument("--gpu-memory", default="4GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random-plans", type=int, default=4)
    args = ap.parse_args(argv)
    try:
        models = [load_model(m) for m in args.model]
        topology = Topology(
            gpus=args.gpus,
            gpu_memory_bytes=parse_bytes(args.gpu_memory),
            batch_size_per_rank=args.batch_per_rank,
        )
        for path in [args.tables, *args.unseen]:
            run(path, topology, models, args.random_plans, args.repeats)
    except UserError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()

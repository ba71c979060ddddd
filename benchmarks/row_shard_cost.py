"""What a row shard costs, measured: a table row-wise over W ranks against the same table
table-wise on one rank of the same job (compute only, docs/comm.md).

An analytic model (TorchRec's shard estimator, our ``row_slice`` pricing) gives a row
shard of ``n`` of ``N`` rows ``n / N`` of the table's lookups, so about ``1 / W`` of the
table's cost. The evaluator measures it instead: each row shard runs its own kernel
at the global batch, receiving the lookups that fall in its rows and pooling every bag
of the global batch (most of them empty or short). This prints, per W, the
table-wise rank's compute, each row-wise rank's, the slowest row-wise rank over the
table-wise one, and the ``1 / W`` an analytic share would say.

Both plans are measured side by side (every repeat measures both, in a rotating order,
so the host's drift hits them alike); the comm is a declared preset and left out.

    .venv/bin/python benchmarks/row_shard_cost.py [--ranks 2 4] [--batch-per-rank 1024]
        [--rows 1000000] [--dim 64] [--pooling 20] [--repeats 5] [--device cuda]
"""

from __future__ import annotations

import argparse

from shardwise.planner.comm.model import PRESETS
from shardwise.planner.kinds import even_row_split
from shardwise.planner.plan import Plan, PlanTable, Shard
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology
from shardwise.profiler.evaluate import Evaluation, evaluate_side_by_side


def plans(spec: TableSpec, world: int, batch_per_rank: int) -> tuple[Plan, Plan]:
    """The table row-wise over ``world`` ranks (TorchRec's even cut), and table-wise on
    rank 0 of a ``world``-rank job (the other ranks idle)."""
    topo = Topology(
        gpus=world, gpu_memory_bytes=2**36, device="cpu", batch_size_per_rank=batch_per_rank
    )
    cut = even_row_split(spec.rows, world)
    rw = PlanTable(
        name=spec.name,
        rows=spec.rows,
        dim=spec.dim,
        kind="row_wise",
        shards=[Shard(rank=r, cols=spec.dim, row_offset=o, rows=n) for r, (o, n) in enumerate(cut)],
    )
    tw = PlanTable(
        name=spec.name, rows=spec.rows, dim=spec.dim, shards=[Shard(rank=0, cols=spec.dim)]
    )
    make = [
        Plan(world_size=world, planner=p, topology=topo, tables=[t])
        for p, t in (("row-wise", rw), ("table-wise", tw))
    ]
    return make[0].with_hash(), make[1].with_hash()


def _ms(x: float) -> str:
    return f"{1e3 * x:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--batch-per-rank", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--pooling", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if any)")
    args = ap.parse_args()
    spec = TableSpec(name="t", rows=args.rows, dim=args.dim, pooling_factor=args.pooling)
    print(
        f"table {spec.rows:,} rows x {spec.dim}, pooling {spec.pooling_factor:g}, "
        f"batch {args.batch_per_rank:,}/rank, median of {args.repeats} repeats, compute only"
    )
    device = None
    head = (
        f"{'W':>3} {'global':>7} {'TW rank ms':>10} {'RW ranks ms (fwd+bwd)':>30} "
        f"{'RW max ms':>9} {'RW max / TW':>11} {'analytic 1/W':>12}"
    )
    print(head)
    for world in args.ranks:
        rw_plan, tw_plan = plans(spec, world, args.batch_per_rank)
        side = evaluate_side_by_side(
            [rw_plan, tw_plan],
            [spec],
            batch_size_per_rank=args.batch_per_rank,
            repeats=args.repeats,
            bound=False,
            comm=PRESETS["nvlink"],
            device=args.device,
        )
        rw, tw = side.evaluations
        if not isinstance(rw, Evaluation) or not isinstance(tw, Evaluation):
            raise SystemExit(f"W={world}: {side.errors}")
        per_rank = [r.fwd_compute_s + r.bwd_compute_s for r in rw.ranks]
        if device is None:
            device = rw.device
            print(f"measured on {device}")
        tw_cost = tw.max_compute_s
        print(
            f"{world:>3} {world * args.batch_per_rank:>7,} {_ms(tw_cost):>10} "
            f"{' '.join(_ms(x).strip() for x in per_rank):>30} {_ms(rw.max_compute_s):>9} "
            f"{rw.max_compute_s / tw_cost:>11.2f} {1 / world:>12.2f}"
        )


if __name__ == "__main__":
    main()

"""Is a row range's kernel priced right as its ``row_slice`` twin?

The planner and the cost model see a row range of ``n`` of a table's ``N`` rows as a
table of ``n`` rows receiving ``n / N`` of its lookups with the same reuse histogram
(``planner.kinds.row_slice``). The range's real kernel differs: it reads the ids of the
table's real stream that fall in its rows, and pools *every* bag of the global batch,
most of them short or empty. This prints, for range 0 of TorchRec's even cut over W
ranks of a few heavy-family tables, three fwd+bwd figures side by side:

- ``real``: ``measure_compute`` of the real cut (``ShardLoad`` with the row range,
  kernel ``row_wise``);
- ``twin``: ``measure_compute`` of the twin (``ShardLoad.whole(row_slice(...))``, its
  stream made from the twin's spec);
- ``net``: the bundled model's network on the twin (what an uncalibrated planner
  prices the range at);

and the twin's and the network's ratio to the real cut. For scale, each table's whole
kernel is measured too, and ``net/whole`` is the network's ratio on it: where
``net/real`` and ``net/whole`` agree, the network errs on the table, not on the cut.
Real and twin are timed in the same calls, as two kernels run back to back (the twin
first in even repeats, last in odd ones), so the host's drift on a shared machine hits
both alike; ``twin/real`` is the median over ``--repeats`` of each call set's ratio.
The tables are the heaviest (weights × pooling) of a heavy pool: the ones a planner
cuts by rows.

    .venv/bin/python benchmarks/row_slice_twin.py [--tables 3] [--batch 8192]
        [--ranks 2 4 8] [--seed 4093] [--repeats 3] [--warmups 2] [--iters 10]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics

from shardwise.planner.costmodel.artifact import load_bundled
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.families import heavy_tables
from shardwise.planner.kinds import even_row_split, row_slice
from shardwise.planner.tables import TableSpec
from shardwise.profiler.compute import ShardLoad, measure_compute


def pick(count: int, seed: int, pool: int = 40) -> list[TableSpec]:
    """The ``count`` heaviest tables (weights × pooling) of a heavy pool of ``pool``."""
    tables = heavy_tables(pool, seed)
    return sorted(tables, key=lambda t: -t.size_bytes * t.pooling_factor)[:count]


def timed(load: ShardLoad, args: argparse.Namespace, seed: int) -> float:
    res = measure_compute(
        [load], args.batch, seed=seed, device=args.device, warmups=args.warmups, iters=args.iters
    )
    return res.total_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seed", type=int, default=4093)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    predictor = CostPredictor(load_bundled())

    def net_ms(spec: TableSpec) -> float:
        return 1e3 * float(predictor.network_compute([[(spec, spec.dim)]], args.batch)[0].sum())

    print(f"batch {args.batch}, range 0 of the even cut, medians of {args.repeats} repeats")
    print(
        f"{'table':<12}{'rows':>10}{'dim':>5}{'dtype':>6}{'pool':>6}{'whole ms':>10}"
        f"{'net/whole':>10}{'W':>4}{'real ms':>9}{'twin ms':>9}{'net ms':>9}"
        f"{'twin/real':>10}{'net/real':>9}"
    )
    twin_ratios, net_ratios = [], []
    for spec in pick(args.tables, args.seed):
        whole = 1e3 * statistics.median(
            timed(ShardLoad.whole(spec), args, r) for r in range(args.repeats)
        )
        for w in args.ranks:
            offset, rows = even_row_split(spec.rows, w)[0]
            twin = row_slice(spec, offset, rows)
            real_load = ShardLoad(spec, spec.dim, offset, rows, group="row_wise")
            times: list[list[float]] = [[], []]
            for r in range(args.repeats):
                # The twin's kernel runs before the row-wise one ("fused" sorts first) or
                # after it (a group named after "row_wise"): kernel_order's rule.
                twin_load = ShardLoad(twin, twin.dim, group="fused" if r % 2 == 0 else "twin")
                res = measure_compute(
                    [real_load, twin_load],
                    args.batch,
                    seed=r,
                    device=args.device,
                    warmups=args.warmups,
                    iters=args.iters,
                )
                by_group = {k.group: 1e3 * (k.fwd_s + k.bwd_s) for k in res.kernel_times}
                times[0].append(by_group["row_wise"])
                times[1].append(by_group[twin_load.group])
            real, tw = (statistics.median(t) for t in times)
            paired = statistics.median(b / a for a, b in zip(*times, strict=True))
            net = net_ms(twin)
            twin_ratios.append(paired)
            net_ratios.append(net / real)
            print(
                f"{spec.name:<12}{spec.rows:>10}{spec.dim:>5}{spec.dtype:>6}"
                f"{spec.pooling_factor:>6.1f}{whole:>10.2f}{net_ms(spec) / whole:>10.2f}"
                f"{w:>4}{real:>9.2f}{tw:>9.2f}{net:>9.2f}{paired:>10.2f}{net / real:>9.2f}",
                flush=True,
            )
    print(
        f"median twin/real {statistics.median(twin_ratios):.2f} "
        f"(range {min(twin_ratios):.2f}-{max(twin_ratios):.2f}); "
        f"median net/real {statistics.median(net_ratios):.2f} "
        f"(range {min(net_ratios):.2f}-{max(net_ratios):.2f})"
    )


if __name__ == "__main__":
    main()

"""Is a mixed-kind fidelity figure the model's or the measurement's? Cross-price runs.

Two runs of the same bench spec measure the same tasks (same pools, seeds and tables)
but different plans, under whatever noise the host had, each with its own calibrated
models (``models/<task>.pt``). This prices every run's measured mixed-kind ranks (the
ranks ``benchmarks/kinds_fidelity.py`` pools: a kernel other than the fused
table-wise/column-wise one, each distinct measured plan once) with every run's
calibrated models, and prints Spearman's rho and the MAPE, overall and per pool. A
figure that moves with the measured run and not with the models is the measurement's
(its noise, or plans whose ranks lie within it); one that moves with the models is
the model's. Nothing is measured again; the prices are recomputed on this machine.

    .venv/bin/python benchmarks/kinds_cross_price.py \\
        --run old=bench-heavy-kinds,bench-ind-kinds --run new=bench-heavy-2,bench-ind-2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.basics import UserError
from shardwise.planner.costmodel.artifact import CostModel
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.tables import load_tables
from shardwise.profiler.bench.fidelity import read_results
from shardwise.profiler.bench.quality import mixed_ranks_of, saved_plans
from shardwise.profiler.pretrain.report import metrics

#: (pool, predicted s, measured s) of one mixed-kind rank.
Priced = tuple[str, float, float]


def parse_run(text: str) -> tuple[str, list[Path]]:
    """``LABEL=DIR[,DIR...]``: a run's label and its results folders."""
    label, sep, dirs = text.partition("=")
    if not sep or not label or not dirs:
        raise UserError(f"--run {text!r}: give LABEL=DIR[,DIR...], e.g. new=bench-heavy-kinds")
    return label, [Path(d) for d in dirs.split(",")]


def price(measured: list[Path], models: list[Path]) -> list[Priced]:
    """The mixed-kind ranks of ``measured``'s tasks priced by the calibrated model of the
    same task in ``models`` (folders paired in order: heavy with heavy)."""
    if len(measured) != len(models):
        raise UserError("every run needs as many folders as the others, in the same order")
    out: list[Priced] = []
    for folder, model_folder in zip(measured, models, strict=True):
        pools = sorted((folder / "pools").glob("*.yaml"))
        every = {t.name: t for p in pools for t in load_tables(p)}
        for result in read_results(folder):
            path = model_folder / "models" / f"{result.task}.pt"
            if not path.is_file():
                raise UserError(f"{path}: no calibrated model of {result.task} in {model_folder}")
            tables = [every[n] for n in result.table_names]
            plans = saved_plans(result, folder / "plans")
            predictor = CostPredictor(CostModel.load(path))
            for rank in mixed_ranks_of(plans, result.planners, tables, predictor):
                out.append((result.pool, rank.predicted_s, rank.measured_s))
    return out


def line(ranks: list[Priced]) -> str:
    m = metrics([p for _, p, _ in ranks], [t for _, _, t in ranks])
    return f"{len(ranks):>4} ranks  rho {m['spearman']:5.2f}  MAPE {m['mape']:6.1%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="LABEL=DIR[,DIR...]")
    args = ap.parse_args(argv)
    try:
        runs = dict(parse_run(r) for r in args.run)
        for measured, dirs in runs.items():
            for priced_by, model_dirs in runs.items():
                ranks = price(dirs, model_dirs)
                print(f"measured {measured}, priced by {priced_by}'s calibrated: {line(ranks)}")
                for pool in sorted({p for p, _, _ in ranks}):
                    print(f"  {pool:<20} {line([r for r in ranks if r[0] == pool])}")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

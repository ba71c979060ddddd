"""How well each cost model prices mixed-kind ranks, pooled over bench runs.

A mixed-kind rank holds a kernel other than the fused table-wise/column-wise one: a
row range of a row-wise or table-row-wise table, or a data-parallel copy. Every task
of ``shardwise bench`` keeps each such rank of its measured plans, with each model's
predicted per-rank compute (fwd + bwd) and the evaluator's measurement. This pools
them over the tasks of the folders given and prints, per model, Spearman's rho and
the MAPE over every planner's plans (each distinct plan's rank once), then per row
whose plan held the rank, per pool and per kernel group, and the calibrated model's
verdict against MAPE <= 10 % and Spearman >= 0.9 over every planner's plans. Nothing
is measured or priced again: the figures are the runs' own.

    .venv/bin/python benchmarks/kinds_fidelity.py bench-heavy-kinds bench-ind-kinds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.basics import UserError
from shardwise.profiler.bench.fidelity import fidelity_text, kinds_fidelity


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="results folders of shardwise bench")
    args = ap.parse_args(argv)
    try:
        fid = kinds_fidelity(args.dirs)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(fidelity_text(fid)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The targets a bench run is judged on (docs/bench.md), each a line of the figures.

- **Pools with a bar of their own** (:data:`POOL_BARS`, by the pool's family): the
  heavy and industrial pools, where NeuroShard is judged against TorchRec's planner at
  full strength (``torchrec``, every sharding kind): model-only (the calibrated row,
  else the bundled one) within the pool's bar with the 95 % interval's upper end below
  1 and no task worse beyond noise; refined within its bar where the pool has one;
  the median balance (with the geomean ratio to the balance bound beside it) and the
  worst task against its best baseline, as for every pool.
- **Other pools** (the full protocol's held-out and broad pools, files): the full
  protocol's targets, over their tasks together.
- **Every kind against table-wise/column-wise only**, on every pool: where a run has
  both ``neuroshard[M]`` and ``neuroshard[M-tw-cw]``, no task on which every kind
  measured worse than the restricted search beyond the task's noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.profiler.bench.figures import (
    RowFigures,
    cost,
    row_figures,
    task_noise_of,
)
from shardwise.profiler.bench.results import TaskResult
from shardwise.profiler.bench.spec import TW_CW
from shardwise.profiler.bench.stats import Paired, compare, paired

#: The NeuroShard rows the targets judge, the first present of each.
REFINED_ROWS = ("neuroshard[calibrated+refined]", "neuroshard[bundled+refined]")
MODEL_ROWS = ("neuroshard[calibrated]", "neuroshard[bundled]")
#: The model kinds whose every-kind row is judged against its ``-tw-cw`` twin.
TWIN_MODELS = ("calibrated", "bundled")
#: Median balance (mean/max measured compute) a judged row should reach.
BALANCE = 0.95


@dataclass(frozen=True)
class Target:
    row: str
    what: str
    value: float | None
    limit: float
    met: bool | None
    detail: str
    #: The pool whose tasks it is judged on; None: every task of pools without a bar.
    pool: str | None = None


@dataclass(frozen=True)
class PoolBar:
    """Compute geomean x ``torchrec`` a pool family's NeuroShard rows must reach."""

    model: float  # model only
    refined: float | None = None  # refined (None: no bar of its own)


#: The heavy pool and the industrial pool (tables larger than a GPU), against TorchRec
#: at full strength.
POOL_BARS: dict[str, PoolBar] = {
    "heavy": PoolBar(model=0.85, refined=0.80),
    "industrial": PoolBar(model=0.90),
}


def pool_family(key: str) -> str | None:
    """The family of a pool key such as ``heavy-4093`` (None: a tables file's stem)."""
    family, sep, seed = key.rpartition("-")
    return family if sep and seed.isdigit() and family else None


def targets(
    rows: Sequence[str],
    results: Sequence[TaskResult],
    heuristic: str | None,
    seed: int = 0,
    figures: Sequence[RowFigures] = (),
) -> list[Target]:
    """Every target of the run: per pool with a bar, then the other pools' tasks
    together (``figures``: their compute figures, when they are every task's already)."""
    groups: dict[str | None, list[TaskResult]] = {}
    for t in results:
        family = pool_family(t.pool)
        groups.setdefault(t.pool if family in POOL_BARS else None, []).append(t)
    out: list[Target] = []
    for key, tasks in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        if key is None and len(tasks) == len(results) and figures:
            figs = [f for f in figures if f.metric == "compute"]
        else:
            figs = [row_figures(r, "compute", tasks, heuristic, seed) for r in rows]
        if key is None:
            out += general_targets(rows, figs)
        else:
            family = pool_family(key)
            assert family is not None
            out += pool_targets(key, POOL_BARS[family], rows, figs)
        out += restriction_targets(key, rows, tasks, seed)
    return out


def pool_targets(
    pool: str, bar: PoolBar, rows: Sequence[str], figures: Sequence[RowFigures]
) -> list[Target]:
    """The bar's targets on one pool's tasks (module docstring)."""
    out: list[Target] = []
    for candidates, limit, label in (
        (MODEL_ROWS, bar.model, "model only"),
        (REFINED_ROWS, bar.refined, "refined"),
    ):
        row = next((r for r in candidates if r in rows), None)
        f = next((f for f in figures if f.row == row), None)
        if limit is None or row is None or f is None:
            continue
        tr = f.vs.get("torchrec")
        geo = tr.geomean if tr else None
        hi = tr.interval[1] if tr and tr.interval else None
        out.append(
            Target(
                row,
                f"{label}: compute geomean x torchrec (every kind) <= {limit}, "
                "interval's upper end < 1.0",
                geo,
                limit,
                None if geo is None else geo <= limit and hi is not None and hi < 1.0,
                paired_text(tr),
                pool,
            )
        )
        out.append(
            Target(
                row,
                f"{label}: tasks worse than torchrec (every kind) beyond noise = 0",
                None if tr is None else float(tr.losses),
                0.0,
                None if tr is None else tr.losses == 0,
                paired_text(tr),
                pool,
            )
        )
        bound = "-" if f.vs_bound is None else f"{f.vs_bound:.3f}"
        out.append(
            Target(
                row,
                f"{label}: median balance (mean/max measured compute) >= {BALANCE}",
                f.balance_median,
                BALANCE,
                None if f.balance_median is None else f.balance_median >= BALANCE,
                f"{f.ok} tasks; compute x balance bound {bound} (geomean)",
                pool,
            )
        )
        out.append(_no_task_worse(row, label, f, pool))
    return out


def restriction(model: str, tasks: Sequence[TaskResult], seed: int = 0) -> Paired | None:
    """``neuroshard[model]`` against ``neuroshard[model-tw-cw]`` over the tasks that ran
    both, in compute, ties within each task's noise (None: no such task)."""
    full, tw = f"neuroshard[{model}]", f"neuroshard[{model}{TW_CW}]"
    outcomes = [
        compare(
            cost(t.planners[full], "compute"),
            cost(t.planners[tw], "compute"),
            task_noise_of(t, "compute"),
        )
        for t in tasks
        if full in t.planners and tw in t.planners and t.planners[full].status != "skipped"
    ]
    return paired(outcomes, seed) if outcomes else None


def restriction_targets(
    pool: str | None, rows: Sequence[str], tasks: Sequence[TaskResult], seed: int = 0
) -> list[Target]:
    """Every kind never worse than table-wise/column-wise only, per model (module
    docstring)."""
    out: list[Target] = []
    for model in TWIN_MODELS:
        full, tw = f"neuroshard[{model}]", f"neuroshard[{model}{TW_CW}]"
        if full not in rows or tw not in rows:
            continue
        p = restriction(model, tasks, seed)
        out.append(
            Target(
                full,
                f"every kind: tasks worse than {tw} (table-wise/column-wise only) beyond noise = 0",
                None if p is None else float(p.losses),
                0.0,
                None if p is None else p.losses == 0,
                paired_text(p),
                pool,
            )
        )
    return out


def general_targets(summary_rows: Sequence[str], figures: Sequence[RowFigures]) -> list[Target]:
    """The full protocol's targets (docs/bench.md), over the tasks of pools without a
    bar of their own."""

    def fig(row: str) -> RowFigures | None:
        return next((f for f in figures if f.row == row and f.metric == "compute"), None)

    out = []
    for rows, limit_tr, label in (
        (REFINED_ROWS, 0.88, "refined"),
        (MODEL_ROWS, 0.92, "model only"),
    ):
        row = next((r for r in rows if r in summary_rows), None)
        f = fig(row) if row else None
        if row is None or f is None:
            continue
        tr = f.vs.get("torchrec")
        hi = tr.interval[1] if tr and tr.interval else None
        out.append(
            Target(
                row,
                f"{label}: compute geomean x TorchRec <= {limit_tr}"
                + (", interval's upper end < 1.0" if label == "refined" else ""),
                tr.geomean if tr else None,
                limit_tr,
                None
                if tr is None or tr.geomean is None
                else tr.geomean <= limit_tr
                and (label != "refined" or (hi is not None and hi < 1.0)),
                paired_text(tr),
            )
        )
        out.append(
            Target(
                row,
                f"{label}: tasks worse than TorchRec beyond noise = 0",
                None if tr is None else float(tr.losses),
                0.0,
                None if tr is None or tr.geomean is None else tr.losses == 0,
                paired_text(tr),
            )
        )
        if label == "refined":  # the heavy pool's (docs/design.md §14)
            out.append(
                Target(
                    row,
                    "refined: compute geomean x TorchRec <= 0.85 and median balance >= 0.92",
                    tr.geomean if tr else None,
                    0.85,
                    None
                    if tr is None or tr.geomean is None or f.balance_median is None
                    else tr.geomean <= 0.85 and f.balance_median >= 0.92,
                    f"{paired_text(tr)}; balance "
                    + ("-" if f.balance_median is None else f"{f.balance_median:.3f}"),
                )
            )
        bh = f.vs.get("best-heuristic")
        out.append(
            Target(
                row,
                f"{label}: compute geomean x best heuristic <= 0.92",
                bh.geomean if bh else None,
                0.92,
                None if bh is None or bh.geomean is None else bh.geomean <= 0.92,
                paired_text(bh),
            )
        )
        out.append(
            Target(
                row,
                f"{label}: median balance (mean/max measured compute) >= 0.95",
                f.balance_median,
                0.95,
                None if f.balance_median is None else f.balance_median >= 0.95,
                f"{f.ok} tasks",
            )
        )
        out.append(_no_task_worse(row, label, f))
    return out


def paired_text(p: Paired | None) -> str:
    if p is None:
        return "no paired task"
    if p.geomean is None:  # every pair had a failure: the verdicts still count
        return f"no paired ratio, W/T/L {p.wins}/{p.ties}/{p.losses}"
    ci = f" [{p.interval[0]:.3f}, {p.interval[1]:.3f}]" if p.interval else ""
    return f"{p.geomean:.3f}{ci}, n={p.n}, W/T/L {p.wins}/{p.ties}/{p.losses}"


def _no_task_worse(row: str, label: str, f: RowFigures, pool: str | None = None) -> Target:
    """No task worse than its best baseline beyond noise, with the worst task named."""
    worst = (
        f"worst {f.best_baseline_worst_task}: x{f.best_baseline_worst:.3f}"
        if f.best_baseline_worst is not None
        else "no task"
    )
    return Target(
        row,
        f"{label}: tasks worse than the task's best baseline beyond noise = 0",
        float(f.beyond_noise),
        0.0,
        f.beyond_noise == 0,
        worst,
        pool,
    )

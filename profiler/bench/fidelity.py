"""The cost models' fidelity on mixed-kind ranks, pooled over bench runs.

A mixed-kind rank holds a kernel other than the fused table-wise/column-wise one (a
row range of a row-wise or table-row-wise table, a data-parallel copy). Each task of
``shardwise bench`` keeps every such rank of its measured plans with each model's
price and the evaluator's measurement (``TaskResult.mixed_kind``); this pools them
over the tasks of one or more results folders and gives Spearman's rho and the MAPE
per model: over every planner's plans (each distinct plan's rank once), per row
whose plan held the rank, per pool and per kernel group. Beside them it gives the
measurement against itself (:class:`Retest`): one repeat's measured ranks against
another's. A model is judged against the medians over the repeats, so a rho the
repeats themselves do not reach says the noise, not the model, sets the figure. The target is the
calibrated model's over every planner's plans (:data:`MAPE_TARGET`,
:data:`SPEARMAN_TARGET`). ``benchmarks/kinds_fidelity.py`` prints it.

Pooling compares ranks of different tasks, each priced by its own calibration, run
minutes before that task's evaluation. A shared CPU host's speed moves by tens of
percent between the two (one run here: a task's held-out ranks measured 1.11x its
model at calibration, its bench ranks 0.76x), which shifts a whole task's prices and
scrambles the pooled order while no plan of that task is ordered differently. So
beside the target, :class:`Levels` splits the figure: each task's own Spearman, each
task's level (measured / predicted), and the pooled figures with every task's prices
brought to its measured level, a diagnostic that uses the measurement, never a verdict.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardwise.basics import UserError
from shardwise.profiler.bench.quality import KINDS, pooled
from shardwise.profiler.bench.results import RESULTS, MixedRank, TaskResult

#: The calibrated model's bar on mixed-kind ranks over every planner's plans.
MAPE_TARGET = 0.10
SPEARMAN_TARGET = 0.9
ALL = "every planner"


@dataclass(frozen=True)
class Line:
    """One pooled figure: a model's mixed-kind ranks of one slice (``by`` ``planner``,
    ``pool`` or ``group``, or ``all``)."""

    model: str
    by: str
    name: str
    ranks: int
    tasks: int
    spearman: float | None
    mape: float | None


@dataclass(frozen=True)
class Retest:
    """The measurement against itself over the mixed-kind ranks recorded with their
    repeats: Spearman's rho and the mean relative difference of one repeat's ranks
    against another's, averaged over every pair of the first ``repeats`` repeats."""

    ranks: int
    repeats: int
    spearman: float | None
    difference: float | None  # mean |a - b| / b, a fraction
    #: Spearman's rho of the medians of one half of the repeats against the other's
    #: (four repeats or more), averaged over :data:`SPLITS` splits.
    halves: float | None = None
    #: About the highest rho a model exact on every rank reaches against the medians
    #: of all the repeats: the halves' rho stepped up to all of them (Spearman-Brown),
    #: its square root. A target above it is one the measurement cannot show met.
    ceiling: float | None = None


#: Splits of the repeats into halves that :class:`Retest` averages over (every split
#: where there are fewer; a fixed seed picks them, so a folder always prints alike).
SPLITS = 64


def _mean(xs: Sequence[float]) -> float | None:
    finite = [x for x in xs if x == x]
    return sum(finite) / len(finite) if finite else None


def _halves(kept: Sequence[Sequence[float]], k: int) -> float | None:
    """Spearman's rho of two disjoint halves' medians over the repeats, averaged."""
    from shardwise.profiler.pretrain.report import metrics

    if k < 4:
        return None
    h = k // 2
    splits = list(itertools.combinations(range(k), h))
    if len(splits) > SPLITS:
        splits = random.Random(0).sample(splits, SPLITS)
    rhos = []
    for first in splits:
        rest = [i for i in range(k) if i not in first][:h]
        a = [statistics.median(x[i] for i in first) for x in kept]
        b = [statistics.median(x[i] for i in rest) for x in kept]
        rhos.append(metrics(a, b)["spearman"])
    return _mean(rhos)


def retest(ranks: Sequence[MixedRank]) -> Retest | None:
    """:class:`Retest` over ``ranks`` (those with at least two repeats); None when
    fewer than two ranks have them (lines recorded before the repeats were kept)."""
    from shardwise.profiler.pretrain.report import metrics

    kept = [r.measured_per_repeat for r in ranks if len(r.measured_per_repeat) >= 2]
    if len(kept) < 2:
        return None
    k = min(len(x) for x in kept)
    rhos, diffs = [], []
    for i in range(k):
        for j in range(i + 1, k):
            m = metrics([x[i] for x in kept], [x[j] for x in kept])
            rhos.append(m["spearman"])
            diffs.append(m["mape"])
    halves = _halves(kept, k)
    ceiling = None
    if halves is not None:
        step = k / (k // 2)  # all the repeats against a half of them
        ceiling = (step * halves / (1 + (step - 1) * halves)) ** 0.5 if halves > 0 else 0.0
    return Retest(
        ranks=len(kept),
        repeats=k,
        spearman=_mean(rhos),
        difference=sum(diffs) / len(diffs),
        halves=halves,
        ceiling=ceiling,
    )


@dataclass(frozen=True)
class Settled:
    """The pairs of ranks of one task (one calibration, one evaluation window) that
    every repeat orders alike, and the share of them a model orders alike too: a
    model's figure where the measurement leaves no doubt."""

    pairs: int  # pairs of ranks of one task, both with their repeats
    settled: int  # of those, the pairs every repeat orders alike
    agrees: float | None  # the share of the settled pairs the model orders alike


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def settled(items: Sequence[tuple[str, MixedRank]]) -> Settled | None:
    """:class:`Settled` over ``items`` ((task key, rank)); None when no task has two
    ranks recorded with their repeats."""
    by_task: dict[str, list[MixedRank]] = {}
    for task, r in items:
        if len(r.measured_per_repeat) >= 2:
            by_task.setdefault(task, []).append(r)
    pairs = done = agreed = 0
    for ranks in by_task.values():
        for i, a in enumerate(ranks):
            for b in ranks[i + 1 :]:
                k = min(len(a.measured_per_repeat), len(b.measured_per_repeat))
                signs = {
                    _sign(x - y)
                    for x, y in zip(
                        a.measured_per_repeat[:k], b.measured_per_repeat[:k], strict=True
                    )
                }
                pairs += 1
                if len(signs) == 1 and 0 not in signs:
                    done += 1
                    agreed += _sign(a.predicted_s - b.predicted_s) in signs
    if not pairs:
        return None
    return Settled(pairs, done, agreed / done if done else None)


@dataclass(frozen=True)
class Levels:
    """The judged model's figure split into the order within tasks and each task's
    level (module docstring): ``within`` is the tasks' own Spearman averaged (weighted
    by ranks, tasks of 3 ranks or more), ``low``/``high`` the lowest and highest task
    level (median measured / predicted), and ``matched_*`` the pooled figures with each
    task's prices multiplied by its own level."""

    tasks: int
    within: float | None
    low: float
    high: float
    matched_spearman: float | None
    matched_mape: float | None


def levels(items: Sequence[tuple[str, MixedRank]]) -> Levels | None:
    """:class:`Levels` over ``items`` ((task key, rank)); None without a priced rank."""
    by_task: dict[str, list[MixedRank]] = {}
    for task, r in items:
        if r.predicted_s > 0 and r.measured_s > 0:
            by_task.setdefault(task, []).append(r)
    if not by_task:
        return None
    scaled: list[MixedRank] = []
    ratios: list[float] = []
    rhos: list[tuple[float, int]] = []
    for ranks in by_task.values():
        ratio = statistics.median(r.measured_s / r.predicted_s for r in ranks)
        ratios.append(ratio)
        scaled += [replace(r, predicted_s=ratio * r.predicted_s) for r in ranks]
        rho = pooled(ranks)["spearman"] if len(ranks) >= 3 else None
        if rho is not None:
            rhos.append((rho, len(ranks)))
    matched = pooled(scaled)
    weight = sum(n for _, n in rhos)
    return Levels(
        tasks=len(by_task),
        within=sum(x * n for x, n in rhos) / weight if weight else None,
        low=min(ratios),
        high=max(ratios),
        matched_spearman=matched["spearman"],
        matched_mape=matched["mape"],
    )


@dataclass
class Fidelity:
    lines: list[Line] = field(default_factory=list)
    #: The measurement against itself, over the calibrated model's ranks (else the
    #: first model's): the same measured ranks every model is judged on.
    retest: Retest | None = None
    #: Per model, its figure on the pairs the measurement settles (over every planner).
    settled: dict[str, Settled] = field(default_factory=dict)
    #: Per model, its figure within tasks and its tasks' levels (over every planner).
    levels: dict[str, Levels] = field(default_factory=dict)
    tasks: int = 0  # tasks read
    unrecorded: int = 0  # tasks recorded before the mixed-kind figures
    folders: list[str] = field(default_factory=list)

    def line(self, model: str, by: str, name: str) -> Line | None:
        return next((x for x in self.lines if (x.model, x.by, x.name) == (model, by, name)), None)

    def target(self) -> tuple[bool | None, str]:
        """The calibrated model's verdict over every planner's plans, and why."""
        got = self.line("calibrated", "all", ALL)
        if got is None or not got.ranks:
            return None, "no calibrated model's mixed-kind ranks in these folders"
        if got.mape is None or got.spearman is None:
            return False, f"{got.ranks} ranks: too few, or no spread to rank"
        met = got.mape <= MAPE_TARGET and got.spearman >= SPEARMAN_TARGET
        return met, (
            f"{got.ranks} ranks: MAPE {100 * got.mape:.1f}% (<= {100 * MAPE_TARGET:.0f}%), "
            f"Spearman {got.spearman:.2f} (>= {SPEARMAN_TARGET})"
        )


def read_results(directory: Path) -> list[TaskResult]:
    """The task lines of a results folder (a torn last line is skipped, as a resumed
    bench cuts it)."""
    path = directory / RESULTS
    if not path.is_file():
        raise UserError(f"{directory}: no {RESULTS}; give a folder `shardwise bench --out` wrote.")
    lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    out = []
    for n, text in enumerate(lines, start=1):
        try:
            out.append(TaskResult.from_json(json.loads(text)))
        except (ValueError, TypeError, KeyError) as err:
            if n == len(lines):
                break  # torn by a stopped run
            raise UserError(f"{path}, line {n}: not a task result ({err}).") from None
    return out


def _pool(model: str, by: str, name: str, items: Sequence[tuple[str, MixedRank]]) -> Line:
    got: dict[str, Any] = pooled([r for _, r in items])
    tasks = len({task for task, _ in items})
    return Line(model, by, name, got["ranks"], tasks, got["spearman"], got["mape"])


def kinds_fidelity(folders: Sequence[Path]) -> Fidelity:
    """Every model's mixed-kind ranks of ``folders`` pooled (module docstring)."""
    out = Fidelity(folders=[str(f) for f in folders])
    # model -> slice -> name -> [(task key, rank)]
    slices: dict[str, dict[str, dict[str, list[tuple[str, MixedRank]]]]] = {}
    for folder in folders:
        for t in read_results(folder):
            out.tasks += 1
            if t.mixed_kind is None:
                out.unrecorded += 1
                continue
            key = f"{folder}/{t.task}"
            for model, ranks in t.mixed_kind.items():
                cut = slices.setdefault(
                    model, {"all": {ALL: []}, "planner": {}, "pool": {}, "group": {}}
                )
                for r in ranks:
                    cut["all"][ALL].append((key, r))
                    cut["pool"].setdefault(t.pool, []).append((key, r))
                    for row in r.rows:
                        cut["planner"].setdefault(row, []).append((key, r))
                    for group in r.groups:
                        cut["group"].setdefault(group, []).append((key, r))
    order = [k for k in KINDS if k in slices] + sorted(set(slices) - set(KINDS))
    if order:
        judged = "calibrated" if "calibrated" in slices else order[0]
        out.retest = retest([r for _, r in slices[judged]["all"][ALL]])
    for model in order:
        got = settled(slices[model]["all"][ALL])
        if got is not None:
            out.settled[model] = got
        split = levels(slices[model]["all"][ALL])
        if split is not None:
            out.levels[model] = split
    for model in order:
        for by in ("all", "planner", "pool", "group"):
            for name, items in sorted(slices[model][by].items()):
                out.lines.append(_pool(model, by, name, items))
    return out


def fidelity_text(fid: Fidelity) -> list[str]:
    """The figures as lines of text (what the script prints)."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"mixed-kind ranks (a kernel other than table-wise/column-wise) of {fid.tasks} "
        f"tasks in {', '.join(fid.folders)}; predicted against measured per-rank compute"
    ]
    if fid.unrecorded:
        lines.append(
            f"{fid.unrecorded} tasks were recorded before these figures (no mixed-kind "
            "ranks kept): rerun those benches into new folders to include them"
        )
    head = f"{'model':<11} {'by':<8} {'name':<36} {'ranks':>6} {'tasks':>6} {'rho':>6} {'MAPE':>7}"
    lines.append(head)
    for x in fid.lines:
        mape = "-" if x.mape is None else f"{100 * x.mape:.1f}%"
        lines.append(
            f"{x.model:<11} {x.by:<8} {x.name:<36} {x.ranks:>6} {x.tasks:>6} "
            f"{num(x.spearman, '.2f'):>6} {mape:>7}"
        )
    if fid.retest is not None:
        rt = fid.retest
        lines.append(
            f"the measurement against itself: one repeat's ranks against another's "
            f"({rt.ranks} ranks, every pair of {rt.repeats} repeats): rho "
            f"{num(rt.spearman, '.2f')}, mean difference {num(rt.difference, '.1%')}; "
            "a model is judged against the medians over the repeats, which order the "
            "ranks better than one repeat does"
        )
        if rt.halves is not None and rt.ceiling is not None:
            lines.append(
                f"  the medians of half the repeats against the other half's: rho "
                f"{rt.halves:.2f}; so a model exact on every rank would reach a rho of "
                f"about {rt.ceiling:.2f} against the medians of all {rt.repeats} "
                "(split-half, stepped up by Spearman-Brown): the most these repeats "
                "can show"
            )
        for model, st in fid.settled.items():
            lines.append(
                f"  {model}: of {st.pairs} pairs of ranks of one task, every repeat orders "
                f"{st.settled} alike; the model orders {num(st.agrees, '.0%')} of those "
                "alike too"
            )
    else:
        lines.append(
            "the measurement against itself: not recorded (lines written before each "
            "repeat's ranks were kept)"
        )
    for model, lv in fid.levels.items():
        lines.append(
            f"  {model}: within each of {lv.tasks} tasks rho {num(lv.within, '.2f')} "
            f"(averaged by ranks); task levels (measured / predicted) {lv.low:.2f}-"
            f"{lv.high:.2f}; pooled with each task's prices at its measured level: rho "
            f"{num(lv.matched_spearman, '.2f')}, MAPE {num(lv.matched_mape, '.1%')} "
            "(a diagnostic that takes out each task's level, such as the host's speed "
            "between calibration and evaluation; not the target's figure)"
        )
    met, why = fid.target()
    verdict = {True: "met", False: "not met", None: "n/a"}[met]
    lines.append(f"target: calibrated model over every planner's plans: {why}: {verdict}")
    return lines

"""NeuroShard's outer loop: a beam search over column splits (docs/design.md §8).

As the paper does it: width 3, 10 steps. From each state of the beam, the candidates
halve a shard of one of the ``branch`` tables with the biggest shards or of the
``branch`` costliest (the predicted straggler's first: halving elsewhere cannot lower
the max), so the candidates are the top tables by size ∪ by predicted cost. Any shard
may be halved again, so splits can be uneven (64 + 32 + 32). Every child gets the
inner greedy (:mod:`shardwise.planner.neuroshard.greedy`) on its parent's best few
width caps, and the ``width`` best children form the next beam whether or not they
beat their parents: there is no per-step margin, so the search can pass through a
split that only pays with the next one. The best state ever seen wins.

Memory is a hard constraint everywhere: a table too big for one GPU starts cut until
its shards fit, and a placement that cannot fit is dropped, never returned. A search
past its time budget stops after the step under way and says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.basics import UserError
from shardwise.planner.memory import shard_memory, what_would_fit
from shardwise.planner.neuroshard.greedy import DEFAULT_GRID, greedy
from shardwise.planner.neuroshard.kindmoves import kind_children
from shardwise.planner.neuroshard.problem import SEARCH_KINDS, Placement, Problem, State


@dataclass(frozen=True)
class SearchConfig:
    """The search's knobs; the defaults are the paper's beam (width 3, 10 steps)."""

    beam_width: int = 3
    beam_steps: int = 10
    #: Tables per criterion (by shard size, by predicted cost) a state may halve.
    branch: int = 2
    grid: tuple[float, ...] = DEFAULT_GRID
    #: A child state searches only its parent's best few width caps.
    child_grid: int = 3
    #: Most single-shard moves of the final local search (0: none, the paper's search).
    refine_moves: int = 100
    #: The beam starts no step past this many seconds (856 tables on 128 GPUs, 10,000
    #: on 8: docs/design.md §8's planning-time targets leave room for the rest).
    time_budget_s: float = 15.0
    #: Price TorchRec's and the greedy heuristics' plans too; the cheapest wins.
    baselines: bool = True
    #: The kinds the search may choose (``V1_KINDS``: table-wise and column-wise only).
    kinds: frozenset[str] = SEARCH_KINDS
    #: Steps of the kind beam that follows the split beam (:func:`kind_search`).
    kind_steps: int = 4
    #: The kind beam starts no child past this many seconds (856 tables on 128 GPUs
    #: place one child in about a second there: a handful of kind states).
    kind_budget_s: float = 4.0
    #: Most kind rounds of the final local search (each prices a bounded set of moves).
    kind_rounds: int = 3


@dataclass
class SearchStats:
    """What the last search did: shown by the CLI and recorded by the benchmark."""

    candidates: int = 0
    steps: int = 0
    best_scale: float = 0.0
    split_tables: int = 0
    seconds: float = 0.0
    history: list[float] = field(default_factory=list)  # best predicted max per step
    refine_gain: float = 0.0  # share of the predicted max the local search removed
    stopped: str = ""  # why the beam stopped early ("" when it ran its steps)
    #: Where the returned plan came from: "search", or the baseline that won.
    source: str = "search"
    #: Predicted max (after the local search) of the search's best and every baseline.
    priced: dict[str, float] = field(default_factory=dict)
    baseline_errors: dict[str, str] = field(default_factory=dict)
    #: How the plan was chosen among the candidates (:mod:`.risk`): the rule, the
    #: model's spread on the chosen plan's straggler, its predicted and expected max,
    #: and which candidate the predicted max alone would have picked.
    choice: dict[str, Any] = field(default_factory=dict)
    #: The candidates within the model's error of the chosen one (a toss-up for it).
    ambiguous: list[str] = field(default_factory=list)
    #: Why each table not fused has its kind, and the hot tables refused row-wise, with
    #: both predicted maxima (:mod:`.explain`).
    kinds: list[str] = field(default_factory=list)
    #: States the kind beam placed, moves the kind rounds priced, and their seconds.
    kind_candidates: int = 0
    kind_moves: int = 0
    kind_seconds: float = 0.0


def initial_state(problem: Problem) -> State:
    """Whole tables, except those too big for one GPU: halved until a shard fits."""
    state = problem.whole()
    for t in range(len(problem.tables)):
        while state[t][0] > 0 and problem.shard_bytes(t, state[t][0]) > problem.max_free:
            width = state[t][0]
            if width % 8 or 2 * len(state[t]) > problem.world:
                raise UserError(_too_big(problem, t, width, len(state[t])))
            for _ in range(len(state[t])):
                state = problem.halve(state, t, state[t][0])
    return state


def _too_big(problem: Problem, t: int, width: int, pieces: int) -> str:
    """Why table ``t`` fits nowhere even cut as far as the rules allow, with the
    numbers (weights, optimizer state, I/O buffers) and what would fit."""
    spec, topo = problem.tables[t], problem.topology
    batch, world = topo.batch_size_per_rank, topo.gpus
    need = shard_memory(spec, width, batch, world)
    if pieces == 1:
        cut = (
            f"its {spec.dim} columns cannot be halved into multiples of 4"
            if width % 8
            else "one GPU cannot split it"
        )
    else:
        cut = (
            f"cut into {pieces} column shards of {width} columns it still does not fit, and "
            "it cannot be cut further (one shard per GPU, widths multiples of 4)"
        )
    fits = what_would_fit(lambda b: shard_memory(spec, width, b, world).total, topo)
    return (
        f"table {spec.name}: a {width}-column shard needs {need.describe()} at batch {batch} "
        f"per rank x {world} ranks; {topo.describe_capacity()}, and {cut}. {fits}."
    )


def candidates(
    problem: Problem, state: State, placed: Placement | None, branch: int
) -> list[tuple[int, int]]:
    """``(table, width)`` of the shards to halve next: the biggest shards' tables and the
    costliest (the predicted straggler's first); the biggest only when nothing fits."""
    pairs = problem.shard_list(state)
    nbytes = {(t, c): problem.shard_bytes(t, c) for t, c in pairs}
    splittable = [(t, c) for t, c in dict.fromkeys(pairs) if problem.can_halve(state, t, c)]
    if not splittable:
        return []
    by_size = sorted(splittable, key=lambda p: (-nbytes[p], p))
    if placed is None:
        return by_size[:branch]
    sh = problem.shards(state)
    single = problem.solo(sh)
    straggler = int(np.argmax(placed.per_rank))
    cost: dict[tuple[int, int], float] = {}
    for (t, c), r, s in zip(pairs, placed.ranks, single, strict=True):
        cost[(t, c)] = max(cost.get((t, c), 0.0), float(s) + (1e3 if r == straggler else 0.0))
    by_cost = sorted(splittable, key=lambda p: (-cost[p], p))
    out: list[tuple[int, int]] = []
    for p in _distinct_tables(by_size, branch) + _distinct_tables(by_cost, branch):
        if p not in out:
            out.append(p)
    return out


def _distinct_tables(pairs: list[tuple[int, int]], k: int) -> list[tuple[int, int]]:
    """The first ``k`` pairs of distinct tables (each table's first, its biggest shard)."""
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    for t, c in pairs:
        if t not in seen:
            seen.add(t)
            out.append((t, c))
            if len(out) == k:
                break
    return out


def beam_search(
    problem: Problem, cfg: SearchConfig, stats: SearchStats
) -> list[tuple[State, Placement]]:
    """The best ``beam_width`` states ever seen with their placements, best first
    (empty: nothing fits even cut as far as the rules allow)."""
    started = time.perf_counter()
    start = initial_state(problem)
    first = greedy(problem, start, cfg.grid)
    stats.candidates = 1
    best: list[tuple[State, Placement]] = [(start, first)] if first is not None else []
    frontier: list[tuple[State, Placement | None]] = [(start, first)]
    seen = {start}
    for _ in range(cfg.beam_steps):
        if time.perf_counter() - started > cfg.time_budget_s:
            stats.stopped = f"time budget ({cfg.time_budget_s:g} s) after {stats.steps} steps"
            break
        fitted: list[tuple[State, Placement]] = []
        unfit: list[tuple[State, Placement | None]] = []
        for state, placed in frontier:
            for t, width in candidates(problem, state, placed, cfg.branch):
                # A step of large children can outlast the budget: stop within it once
                # something is placed (a step's states are placed one by one).
                if best and time.perf_counter() - started > cfg.time_budget_s:
                    stats.stopped = (
                        f"time budget ({cfg.time_budget_s:g} s) within step {stats.steps + 1}"
                    )
                    break
                child = problem.halve(state, t, width)
                if child in seen:
                    continue
                seen.add(child)
                grid = placed.scales[: cfg.child_grid] if placed else cfg.grid
                got = greedy(problem, child, grid)
                stats.candidates += 1
                if got is None:
                    unfit.append((child, None))
                else:
                    fitted.append((child, got))
        if fitted:
            fitted.sort(key=lambda x: x[1].score)
            frontier = list(fitted[: cfg.beam_width])
            best = sorted(best + fitted[: cfg.beam_width], key=lambda x: x[1].score)
            best = best[: cfg.beam_width]
        elif unfit and not best:
            frontier = unfit[: cfg.beam_width]  # nothing fits yet: keep cutting
        else:
            break
        stats.steps += 1
        if best:
            stats.history.append(best[0][1].score)
    return best


def kind_search(
    problem: Problem,
    cfg: SearchConfig,
    stats: SearchStats,
    lineages: list[list[tuple[State, Placement]]],
) -> list[tuple[State, Placement]]:
    """A beam over kinds from each lineage of starting states (the unsplit start, where
    a hot table goes row-wise before anything is cut around it; the split beam's best):
    each step tries every state's kind moves (:func:`~.kindmoves.kind_children`) and
    halvings, placed by the greedy on the parent's best width caps. Each lineage has its
    share of ``kind_budget_s``. The ``beam_width`` best states ever seen, the starting
    ones included, best first: the split beam ran first and unchanged, so with every
    kind the search is never worse, by the model, than with table-wise and column-wise."""
    best: list[tuple[State, Placement]] = []
    seen: set[State] = set()
    budget = cfg.kind_budget_s / max(len(lineages), 1)
    for start in lineages:
        best = sorted(
            best + _kind_beam(problem, cfg, stats, start, seen, budget), key=lambda x: x[1].score
        )[: cfg.beam_width]
    return best


def _kind_beam(
    problem: Problem,
    cfg: SearchConfig,
    stats: SearchStats,
    start: list[tuple[State, Placement]],
    seen: set[State],
    budget_s: float,
) -> list[tuple[State, Placement]]:
    started = time.perf_counter()
    best = list(start)
    frontier = list(start)
    seen.update(s for s, _ in start)
    for _ in range(cfg.kind_steps):
        if time.perf_counter() - started > budget_s:
            break
        fitted: list[tuple[State, Placement]] = []
        for state, placed in frontier:
            children = kind_children(problem, state, placed, cfg.branch)
            halvings = candidates(problem, state, placed, cfg.branch)
            children += [problem.halve(state, t, w) for t, w in halvings]
            for child in children:
                if child in seen or time.perf_counter() - started > budget_s:
                    continue
                seen.add(child)
                got = greedy(problem, child, placed.scales[: cfg.child_grid] or cfg.grid)
                stats.kind_candidates += 1
                if got is not None:
                    fitted.append((child, got))
        if not fitted:
            break
        fitted.sort(key=lambda x: x[1].score)
        frontier = fitted[: cfg.beam_width]
        best = sorted(best + frontier, key=lambda x: x[1].score)[: cfg.beam_width]
    stats.kind_seconds += time.perf_counter() - started
    return best

"""NeuroShard's inner search: a table-wise greedy over a grid of width caps.

For one state, place shards costliest first (by the compute model's single-shard
cost), each onto the rank whose predicted fused-kernel cost *after* adding it is
lowest, among the ranks with memory for it, without another shard of its table, and
whose summed width stays under a cap. The cap is ``scale × (total width / W)`` for
every scale of a grid (1.0 … 1.5): a narrow cap balances the all-to-all, a loose one
the kernels. Each grid point's placement is scored by the full predicted cost —
compute plus the all-to-all with the straggler wait, max over ranks — and the best
wins. All grid points advance together (one NumPy evaluation of ``[grid, W]``
candidates per shard), through the head copy of :mod:`shardwise.planner.incremental`,
so a placement of 80 shards on 8 ranks takes milliseconds.

Two changes from the paper's code, and why: the rank choice minimizes the cost
*after* adding the shard (the paper takes the rank with the lowest cost so far; with
a non-additive fused kernel the marginal cost differs by rank); and a grid point
where the cap leaves no rank for a shard falls back to memory alone for that shard
(the paper's code fails the grid point), so a tight cap still yields a plan to score.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shardwise.planner.neuroshard.problem import I64, Placement, Problem, Shards, State

#: Width-cap scales of the inner grid search (docs/design.md §8: 1.0 … 1.5).
DEFAULT_GRID: tuple[float, ...] = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))


def greedy(problem: Problem, state: State, grid: Sequence[float]) -> Placement | None:
    """The inner search for one state: every grid point at once, best one scored."""
    sh = problem.shards(state)
    s_count, w = len(sh.cols), problem.world
    single = problem.solo(sh)
    caps = np.ceil(np.asarray(grid) * sh.cols.sum() / w).astype(np.int64)  # [G]
    for order in (
        np.lexsort((np.arange(s_count), -single)),  # costliest first (the paper)
        np.lexsort((np.arange(s_count), -sh.nbytes)),  # biggest first: when memory is tight
    ):
        placed = _place(problem, sh, order, caps)
        if placed is not None:
            return _score(problem, sh, placed, grid)
    return None


def _place(
    problem: Problem, sh: Shards, order: I64, caps: I64
) -> tuple[I64, npt.NDArray[np.bool_]] | None:
    """Greedy for every grid point: ranks ``[G, S]`` and which grid points fit."""
    g, w, h = len(caps), problem.world, sh.enc.shape[1]
    sums = np.zeros((g, 2, w, h), dtype=np.float32)  # per dtype kernel
    counts = np.zeros((g, 2, w), dtype=np.int64)
    kernel = np.zeros((g, 2, w), dtype=np.float32)  # fwd+bwd of each dtype's kernel
    base = sh.base.compute.sum(axis=1).astype(np.float32)  # [W] coded tables' kernels
    mem = np.tile(sh.base.mem, (g, 1))  # the coded tables' bytes
    width = np.zeros((g, w), dtype=np.int64)
    holds = np.zeros((g, w, max(sh.n_split, 1)), dtype=bool)  # split table k on rank
    ranks = np.zeros((g, len(sh.cols)), dtype=np.int64)
    ok = np.ones(g, dtype=bool)
    gi = np.arange(g)
    for s in order:
        d, k = int(sh.fp16[s]), int(sh.split[s])
        fits = mem + sh.nbytes[s] <= problem.cap  # [G, W]
        if k >= 0:
            fits &= ~holds[:, :, k]
        under = fits & (width + sh.cols[s] <= caps[:, None])
        allowed = np.where(under.any(axis=1, keepdims=True), under, fits)
        ok &= allowed.any(axis=1)
        if not ok.any():
            return None
        new = problem.head.seconds(sums[:, d] + sh.enc[s], counts[:, d] + 1).sum(axis=-1)
        total = np.where(allowed, new + kernel[:, 1 - d] + base, np.inf)  # [G, W]
        r = np.argmin(total, axis=1)  # lowest rank wins ties
        ranks[:, s] = r
        sums[gi, d, r] += sh.enc[s]
        counts[gi, d, r] += 1
        kernel[gi, d, r] = new[gi, r]
        mem[gi, r] += sh.nbytes[s]
        width[gi, r] += sh.cols[s]
        if k >= 0:
            holds[gi, r, k] = True
    return (ranks, ok) if ok.any() else None


def _score(
    problem: Problem,
    sh: Shards,
    placed: tuple[I64, npt.NDArray[np.bool_]],
    grid: Sequence[float],
) -> Placement | None:
    """Full predicted cost (compute + all-to-all, max over ranks) of each grid point."""
    ranks, ok = placed
    scored: list[Placement] = []
    seen: set[bytes] = set()
    for gi in np.flatnonzero(ok):
        r = ranks[gi]
        if r.tobytes() in seen:
            continue
        seen.add(r.tobytes())
        scored.append(problem.place(sh, r, grid[int(gi)]))
    if not scored:
        return None
    scored.sort(key=lambda p: p.score)
    return dataclasses.replace(scored[0], scales=tuple(p.scale for p in scored))

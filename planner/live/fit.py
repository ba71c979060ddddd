"""The live price of a rank, fitted with its uncertainty (docs/resharding.md, "Pricing").

A rank's fused kernels cost a fixed part whatever they hold, and each shard adds its
marginal (what the probe replays: its lookups alone through the kernel) *and* its share
of the kernel's per-table work (the output, the backward's sort and the optimizer's
pass per table, cache misses a replay on warm rows does not pay). So a rank that holds
``n`` shards whose probe costs sum to ``M`` is priced

    compute ≈ c0 + a·n + f·M          (c0, a ≥ 0, f > 0)

and a shard's live price is ``a + f·m``. A replayed marginal alone (``a = 0``) prices
light tables as nearly free, and a re-plan then piles them together.

**Evidence.** The ranks of the running plan, each a point ``(n, M, compute)``; the
ranks of plans the job ran before (a reshard that did not deliver is evidence too),
weighed at :data:`HISTORY_WEIGHT`; and for the fixed part, the probe's empty calls
(every bag empty: the kernels' own work) and, when a calibrated model is given, its
rank head's overhead (a rank costs its anchors, less one overhead), scaled to the
measured units. Each point is taken as measured within :data:`NOISE`.

**The fit is not forced through the running plan.** ``c0`` and ``f`` are fitted by
weighted least squares for each ``a`` on a grid, the misfit profiled over ``a``; the
estimate is the best ``a`` (the middle of the best ones where the evidence does not
choose), and every ``a`` whose misfit is within one unit of the best is *plausible*.
On two ranks that hold as many shards each, the ranks' totals cannot tell the fixed
part from the per-shard share: only the priors can, and the plausible range stays wide.
A re-plan prices every candidate under the plausible extremes too
(:meth:`LiveFit.scenarios`), so a move whose gain depends on what was not measured
carries that as its uncertainty. The fit is *checked* when more points than parameters
pin all three; its error on the running plan (and, then, each point left out in turn)
is reported, not hidden.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

#: One rank's measured compute (a median of sampled steps) is taken as true within this
#: share: what consecutive summaries of one plan differ by on 2 shared cores.
NOISE = 0.05
#: A point of a plan the job ran before counts this much (other time, other kernels).
HISTORY_WEIGHT = 0.5
#: A prior on the fixed part is trusted within this share of its value.
PRIOR_SPREAD = 0.5
#: A rank's probe sum tells the factor only from this share of its compute up.
INFORMATIVE_PROBE = 0.02
#: Grid points of the per-shard share ``a`` the misfit is profiled on.
GRID = 241
#: Misfits within this of the best are equally good (the evidence does not choose).
FLAT = 1e-6
#: Rounds of down-weighting points far off the fit, and how far (in noise units) a point
#: may be before it weighs less.
ROBUST_ROUNDS = 3
HUBER = 2.0


@dataclass(frozen=True)
class Point:
    """One measured rank: ``shards`` held, probe costs summed, measured compute (ms)."""

    shards: int
    probe_ms: float
    compute_ms: float
    weight: float = 1.0
    #: How far ``probe_ms`` may be off (its shards' spreads, in quadrature).
    probe_spread: float = 0.0


@dataclass(frozen=True)
class Prior:
    """What is known of the fixed part ``c0`` apart from the ranks' totals (ms)."""

    value: float
    spread: float
    source: str


@dataclass(frozen=True)
class Params:
    """``(c0, a, f)``: a rank's fixed part, each shard's share, the probe's factor."""

    overhead: float
    share: float
    factor: float

    def rank_ms(self, held: npt.ArrayLike, shards: npt.ArrayLike, probe: npt.ArrayLike) -> F64:
        """The priced compute of ranks holding ``shards`` shards (``held``: 1 where a
        rank holds any) whose probe costs sum to ``probe``."""
        out: F64 = np.asarray(
            self.overhead * np.asarray(held) + self.share * np.asarray(shards)
            + self.factor * np.asarray(probe),
            dtype=np.float64,
        )  # fmt: skip
        return out


@dataclass(frozen=True)
class LiveFit:
    """The fitted prices, the plausible alternatives and what could be checked."""

    best: Params
    #: The plausible extremes (fewest and most per-shard share; the factor one σ up and
    #: down): every candidate is priced under each, its risk is the worst.
    alternatives: tuple[Params, ...]
    #: Data points (the running plan's ranks, and earlier plans').
    points: int
    history: int
    #: More points than parameters, and the points pin all three.
    checked: bool
    #: The plausible range of the per-shard share (ms).
    share_range: tuple[float, float]
    #: Relative error of each running-plan rank priced by the fit, (priced - measured) /
    #: measured, and of each point predicted with it left out (empty unless checked).
    errors: tuple[float, ...]
    loo_errors: tuple[float, ...] = ()
    priors: tuple[Prior, ...] = ()
    #: What the fit could not check, in words (empty when checked).
    note: str = ""
    sigma_factor: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def scenarios(self) -> tuple[Params, ...]:
        return (self.best, *self.alternatives)

    def describe(self) -> str:
        """One line: the prices, the evidence and how well the fit holds."""
        b = self.best
        lo, hi = self.share_range
        err = max((abs(e) for e in self.errors), default=0.0)
        text = (
            f"a rank costs {b.overhead:.2f} ms + {b.share:.2f} ms per shard "
            f"(plausible {lo:.2f}-{hi:.2f}) + {b.factor:.2f} x its shards' probe ms, fitted "
            f"on {self.points} measured rank{'s' if self.points != 1 else ''}"
            + (f" and {self.history} of earlier plans" if self.history else "")
            + f"; the running plan priced within {100 * err:.1f} %"
        )
        if self.loo_errors:
            loo = max(abs(e) for e in self.loo_errors)
            text += f", each rank left out predicted within {100 * loo:.1f} %"
        if self.note:
            text += f"; {self.note}"
        return text


def _solve(x: F64, y: F64, w: F64, priors: Sequence[Prior]) -> tuple[float, float, float]:
    """``(c0, f, misfit)``: weighted least squares of ``y ≈ c0 + f·x`` with ``c0, f ≥ 0``
    and the priors on ``c0``; the misfit is the weighted squared error, in units of
    each point's noise. Two unknowns: the normal equations, solved in closed form (the
    fit solves thousands of these)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    # sums of the weighted rows, priors (rows (1/σ, 0) = value/σ) included
    pw = sum(1.0 / p.spread**2 for p in priors)
    py = sum(p.value / p.spread**2 for p in priors)
    s00 = float(np.sum(w)) + pw
    s01 = float(np.sum(w * x))
    s11 = float(np.sum(w * x * x))
    b0 = float(np.sum(w * y)) + py
    b1 = float(np.sum(w * x * y))
    bb = float(np.sum(w * y * y)) + sum(p.value**2 / p.spread**2 for p in priors)

    def misfit(c: float, f: float) -> float:
        # ||Aθ - B||² from the sums: θᵀSθ - 2θᵀb + BᵀB
        return max(c * c * s00 + 2 * c * f * s01 + f * f * s11 - 2 * (c * b0 + f * b1) + bb, 0.0)

    det = s00 * s11 - s01 * s01
    if det > 1e-12 * max(s00 * s11, 1e-300):
        c, f = (b0 * s11 - b1 * s01) / det, (s00 * b1 - s01 * b0) / det
        if c >= -1e-12 and f >= -1e-12:
            c, f = max(c, 0.0), max(f, 0.0)
            return c, f, misfit(c, f)
    options = [(0.0, 0.0)]
    if s11 > 0:
        options.append((0.0, max(b1 / s11, 0.0)))
    if s00 > 0:
        options.append((max(b0 / s00, 0.0), 0.0))
    c, f = min(options, key=lambda t: misfit(*t))
    return c, f, misfit(c, f)


def fit_live(
    points: Sequence[Point],
    history: Sequence[Point] = (),
    priors: Sequence[Prior] = (),
    *,
    smallest: float = 0.0,
    leave_out: bool = True,
) -> LiveFit:
    """Fit ``(c0, a, f)`` on the running plan's ranks (``points``), earlier plans' ranks
    (``history``) and the priors on ``c0`` (the module docstring says how). The share
    may be negative down to ``-f × smallest`` (``smallest``: the least probed marginal;
    0: ``a ≥ 0``), so no shard is priced below nothing. Without a point: the probe's
    figures as they are (``f = 1``, nothing else)."""
    data = [
        *points,
        *(
            Point(p.shards, p.probe_ms, p.compute_ms, HISTORY_WEIGHT, p.probe_spread)
            for p in history
        ),
    ]
    if not data:
        none = Params(0.0, 0.0, 1.0)
        return LiveFit(none, (), 0, 0, False, (0.0, 0.0), (), note="no rank fully probed")
    n = np.array([p.shards for p in data], dtype=np.float64)
    m = np.array([p.probe_ms for p in data], dtype=np.float64)
    y = np.array([p.compute_ms for p in data], dtype=np.float64)
    # A point is as uncertain as its measured compute and, through the factor (about the
    # ranks' median compute over probe ms), its probe costs.
    sm = np.array([p.probe_spread for p in data], dtype=np.float64)
    f0 = _typical_factor(m, y)
    weights = np.array([p.weight for p in data], dtype=np.float64)
    w0 = weights / _variance(y, sm, min(f0, 10.0))
    top = float(np.min(y / n))
    grid = np.linspace(-top if smallest > 0 else 0.0, top, GRID)
    w = w0
    for _ in range(ROBUST_ROUNDS):
        fits = [_solve(m, y - a * n, w, priors) for a in grid]
        misfit = np.array([f[2] for f in fits])
        # a negative share no shard's marginal can pay is no price
        misfit[grid + np.array([f[1] for f in fits]) * smallest < 0] = np.inf
        low = float(misfit.min())
        near = np.flatnonzero(misfit <= low + FLAT * (1.0 + low))
        # where the evidence does not choose: the share nearest nothing (the probe's
        # marginals as they are) if that is among the best, else the middle of them
        k = (
            int(near[np.argmin(np.abs(grid[near]))])
            if grid[near].min() < 0
            else int(near[len(near) // 2])
        )
        best = Params(fits[k][0], float(grid[k]), fits[k][1])
        # One rank's spike (its probe or its compute disturbed) must not bend the
        # prices: points far off the fit, in units of their noise, weigh less (Huber).
        r = np.abs(y - best.rank_ms(1.0, n, m)) * np.sqrt(w0)
        w = w0 * np.minimum(1.0, HUBER / np.maximum(r, 1e-12))
    resid = y - best.rank_ms(1.0, n, m)
    dof = len(data) - 3
    # Evidence noisier than NOISE widens what is plausible, as it widens the factor's σ.
    scale = max(1.0, float(np.sum(w * resid**2)) / dof) if dof > 0 else 1.0
    plausible = np.flatnonzero(misfit <= low + scale)
    lo_k, hi_k = int(plausible.min()), int(plausible.max())

    def params(i: int) -> Params:
        return Params(fits[i][0], float(grid[i]), fits[i][1])

    alts = [params(lo_k), params(hi_k)]
    robust = w / w0 * weights
    f_lo = f_hi = best.factor
    if leave_out:  # a fit for one point left out is read for its best prices only
        f_lo, f_hi = _factor_range(n, m, y, sm, robust, priors, best.factor, scale, smallest)
        for f in (f_lo, f_hi):
            alts.append(_at_factor(n, m, y, sm, robust, priors, f, smallest)[0])
    sigma_f = (f_hi - f_lo) / 2
    design = np.stack([np.ones_like(n), n, m], axis=1)
    distinct = len({(p.shards, round(p.probe_ms, 9)) for p in data})
    checked = distinct > 3 and int(np.linalg.matrix_rank(design)) == 3
    current = np.arange(len(points))
    errors = tuple(float(e) for e in (best.rank_ms(1.0, n, m) - y)[current] / y[current])
    loo: tuple[float, ...] = ()
    if checked and leave_out and len(data) <= 64:
        out = []
        for i, p in enumerate(data):
            rest_now = [q for j, q in enumerate(points) if j != i]
            rest_before = [q for j, q in enumerate(history) if j + len(points) != i]
            f_i = fit_live(rest_now, rest_before, priors, smallest=smallest, leave_out=False)
            if f_i.points + f_i.history >= 3:
                pred = float(f_i.best.rank_ms(1.0, p.shards, p.probe_ms))
                out.append((pred - p.compute_ms) / p.compute_ms)
        loo = tuple(out)
    note = "" if checked else _unchecked(data, len(points), priors)
    return LiveFit(
        best=best,
        alternatives=tuple(alts),
        points=len(points),
        history=len(history),
        checked=checked,
        share_range=(float(grid[lo_k]), float(grid[hi_k])),
        errors=errors,
        loo_errors=loo,
        priors=tuple(priors),
        note=note,
        sigma_factor=sigma_f,
    )


def _variance(y: F64, probe_spread: F64, factor: float) -> F64:
    """How far each point's compute may be off from its price: its measurement noise,
    and its probe sum's spread through the factor (the effective variance)."""
    out: F64 = (NOISE * y) ** 2 + (factor * probe_spread) ** 2
    return np.maximum(out, 1e-12)


def _at_factor(
    n: F64,
    m: F64,
    y: F64,
    sm: F64,
    weights: F64,
    priors: Sequence[Prior],
    f: float,
    smallest: float,
) -> tuple[Params, float]:
    """The fixed part and the share fitted for the factor ``f`` (the share ≥ ``-f ×
    smallest``), and the points' negative log-likelihood there (their variance grows
    with ``f`` through the probe's spread)."""
    var = _variance(y, sm, f)
    floor = f * smallest  # solve for a + floor ≥ 0
    c0, lifted, misfit = _solve(n, y - f * m + floor * n, weights / var, priors)
    return Params(c0, lifted - floor, f), misfit + float(np.sum(weights * np.log(var)))


def _typical_factor(m: F64, y: F64) -> float:
    """The ranks' median compute over probe ms, of the ranks whose probed shards are at
    least :data:`INFORMATIVE_PROBE` of their compute; 1 when none is. A rank whose
    shards all probe at about nothing says nothing of the factor: counted as compute /
    1e-9 ms, one such rank of two once stretched the factor's plausible range to 1e9
    (a re-plan then priced ranks at hours, and declined every move)."""
    told = m >= INFORMATIVE_PROBE * y
    return float(np.median(y[told] / m[told])) if told.any() else 1.0


def _factor_range(
    n: F64,
    m: F64,
    y: F64,
    sm: F64,
    weights: F64,
    priors: Sequence[Prior],
    best: float,
    scale: float,
    smallest: float,
) -> tuple[float, float]:
    """The plausible range of the probe's factor: profiled (the fixed part and the share
    fitted for each factor on a grid) by the points' likelihood, whose variance grows
    with the factor through the probe's spread, so a factor only the probe's noise
    could excuse is not plausible; within ``scale`` of the best."""
    top = max(3.0 * best, 2.0 * _typical_factor(m, y), 1e-6)
    grid = np.linspace(0.0, top, GRID)
    nll = np.array([_at_factor(n, m, y, sm, weights, priors, float(f), smallest)[1] for f in grid])
    ok = np.flatnonzero(nll <= float(nll.min()) + scale)
    lo, hi = float(grid[ok.min()]), float(grid[ok.max()])
    return min(lo, best), max(hi, best)


def _unchecked(data: Sequence[Point], current: int, priors: Sequence[Prior]) -> str:
    """Why the fit cannot be checked, and what the split of fixed part and share rests on."""
    counts = sorted({p.shards for p in data})
    if len(counts) == 1:
        why = (
            f"every measured rank holds {counts[0]} shard{'s' if counts[0] != 1 else ''}, so "
            "the ranks' totals cannot tell a rank's fixed part from its shards' share"
        )
    else:
        why = f"{len(data)} measured ranks for 3 parameters leave nothing to check the fit on"
    rests = (
        "it rests on " + " and ".join(f"{p.source} ({p.value:.2f} ms)" for p in priors)
        if priors
        else "nothing else measured it"
    )
    return f"unchecked: {why}; {rests}, and the prediction carries that uncertainty"


def empty_prior(empty_ms: Sequence[float]) -> Prior | None:
    """The fixed part as the probe's empty calls measure it (their median over ranks)."""
    got = [e for e in empty_ms if e > 0]
    if not got:
        return None
    value = statistics.median(got)
    return Prior(value, max(PRIOR_SPREAD * value, 1e-6), "the probe's empty calls")

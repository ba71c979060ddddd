"""Fitting a rank head's fusion factors on measured plan ranks, and judging a model on
held-out ones (docs/calibration.md, docs/design.md §14).

A rank's kernel is priced as its shards' anchors summed (the kernel's own overhead
counted once), times ``exp(bias + θ · z)`` per part
(:mod:`shardwise.planner.costmodel.rankhead`), where ``z`` are the rank's
normalized features. A rank mixing fp32 and fp16 is two kernels, so its price is a
sum of two such terms: the fit is a small nonlinear least squares on log-seconds
(Gauss-Newton, a ridge on ``θ``), exact for mixed ranks. Features are chosen forward,
one at a time, while leaving each training plan out in turn lowers the error by more
than :data:`MIN_GAIN`. With two figures a rank, on this project's CPU hosts, that
usually kept none (within the host's noise a fused kernel cost its parts times a
constant); with up to five, the industrial bench tasks' calibrations kept three (the
table count, the solo time, and the width or the working set: fewer, heavier parts
fuse cheaper). The ablation printed by the calibration says what each is worth on
held-out ranks.

Judged per rank and per plan: Spearman's rho and MAPE of each rank's fwd + bwd, the
spread ``σ`` (root mean square of log(predicted / measured), which counts a bias too),
and Spearman of each plan's maximum, since a plan costs its slowest rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from shardwise.planner.costmodel.rankhead import (
    COUNT,
    RANK_FEATURES,
    SOLO_BWD,
    SOLO_FWD,
    Fusion,
    fused_parts,
    in_range,
    rank_features,
)
from shardwise.planner.tables import TableSpec
from shardwise.profiler.calibrate.shards import rank_kernels, rank_shards, shard_kinds
from shardwise.profiler.calibrate.tasks import Job
from shardwise.profiler.pretrain.report import metrics

F64 = npt.NDArray[np.float64]
#: A feature is kept when leaving each plan out, in turn, lowers the RMS log error by
#: at least this much (absolute, log scale: 0.003 is 0.3 %).
MIN_GAIN = 0.003
MAX_FEATURES = 3
RIDGE = 1.0
_ITERATIONS = 25


@dataclass(frozen=True)
class RankSample:
    """One measured rank: its shards (each kernel's view: a row range as its
    ``row_slice`` twin; shard widths), its kernels' summed channels (one row per kernel
    group, batch and weight precision, each at its kernel's batch), what was measured,
    its plan, and the kinds it holds."""

    shards: tuple[tuple[TableSpec, int], ...]
    kernels: F64  # [K, C]
    measured: tuple[float, float]
    plan: str
    kinds: frozenset[str] = frozenset({"table_wise"})


@dataclass(frozen=True)
class FusionFit:
    """The fitted factors, the normalization of their inputs, and how they were chosen."""

    fwd: Fusion
    bwd: Fusion
    mean: tuple[float, ...]
    std: tuple[float, ...]
    #: Leave-one-plan-out RMS log error of each part with the features kept (absent
    #: with a single plan, which cannot be left out).
    cv_sigma: dict[str, float]
    #: The features' range over the fitted kernels (prices clip into it).
    lo: tuple[float, ...] | None = None
    hi: tuple[float, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"fwd": self.fwd.used, "bwd": self.bwd.used, "cv_sigma": dict(self.cv_sigma)}


def samples_of(
    records: Sequence[Mapping[str, Any]],
    job: Job,
    channels: Callable[[Sequence[tuple[TableSpec, int]], int], Any],
) -> list[RankSample]:
    """Rank records as samples: one kernel row per (group, batch, precision) as the
    rank ran them (:func:`~.shards.rank_kernels`), ``channels(shards, batch)`` giving
    the shards' rank-head channels at that kernel's batch (summed here)."""
    by_name = {t.name: t for t in job.tables}
    out = []
    for r in records:
        extra = r.get("extra", {})
        shards = rank_shards(extra, by_name)
        if not shards:
            continue
        kernels = rank_kernels(shards, by_name, job.global_batch, job.batch_per_rank)
        rows = [
            np.asarray(channels(list(k.shards), k.batch), dtype=np.float64).sum(axis=0)
            for k in kernels
        ]
        out.append(
            RankSample(
                tuple(s for k in kernels for s in k.shards),
                np.stack(rows),
                (float(r["fwd_s"]), float(r["bwd_s"])),
                str(extra.get("plan", "")),
                shard_kinds(shards),
            )
        )
    return out


# --------------------------------------------------------------------------- the fit


def _design(
    samples: Sequence[RankSample], part: int, overhead: tuple[float, float] = (0.0, 0.0)
) -> tuple[list[F64], list[F64], F64]:
    """Per sample: kernels' summed anchors of ``part`` with the kernel's overhead
    counted once, their features, and log measured."""
    channel = SOLO_FWD if part == 0 else SOLO_BWD
    solos = [
        np.maximum(fused_parts(s.kernels[:, channel], s.kernels[:, COUNT], overhead[part]), 1e-12)
        for s in samples
    ]
    phis = [rank_features(s.kernels) for s in samples]
    y = np.log(np.maximum([s.measured[part] for s in samples], 1e-12))
    return solos, phis, y


def _fit_part(
    solos: Sequence[F64],
    zs: Sequence[F64],
    y: F64,
    cols: Sequence[int],
) -> tuple[float, F64]:
    """(bias, θ over ``cols``) minimizing Σ (log Σ_k solo·e^(b + θ·z_k) - y)² + ridge."""
    n_f = len(cols)
    params = np.zeros(1 + n_f)
    # Start from the bias alone: the median log ratio of measured to summed solo.
    params[0] = float(np.median(y - np.log([s.sum() for s in solos])))
    for _ in range(_ITERATIONS):
        jac = np.zeros((len(y), 1 + n_f))
        resid = np.zeros(len(y))
        for i, (solo, z) in enumerate(zip(solos, zs, strict=True)):
            zc = z[:, cols] if n_f else np.zeros((len(solo), 0))
            terms = solo * np.exp(params[0] + zc @ params[1:])
            pred = terms.sum()
            resid[i] = math.log(pred) - y[i]
            w = terms / pred
            jac[i, 0] = 1.0
            jac[i, 1:] = w @ zc
        reg = np.diag([0.0] + [RIDGE] * n_f)
        lhs = jac.T @ jac + reg + 1e-9 * np.eye(1 + n_f)
        rhs = jac.T @ resid + reg @ params
        step = np.linalg.solve(lhs, rhs)
        params -= step
        if float(np.abs(step).max()) < 1e-7:
            break
    return float(params[0]), params[1:]


def _predict_part(solos: Sequence[F64], zs: Sequence[F64], bias: float, coef: F64) -> F64:
    return np.array(
        [float((s * np.exp(bias + z @ coef)).sum()) for s, z in zip(solos, zs, strict=True)]
    )


def _cv_sigma(
    solos: list[F64], zs: list[F64], y: F64, plans: Sequence[str], cols: list[int]
) -> float:
    """RMS log error of ``cols`` with each plan left out of the fit in turn."""
    labels = np.asarray(plans)
    err = np.zeros(len(y))
    for p in dict.fromkeys(plans):
        out = labels == p
        if out.all():
            return math.inf
        idx, rest = np.flatnonzero(out), np.flatnonzero(~out)
        b, th = _fit_part([solos[i] for i in rest], [zs[i] for i in rest], y[rest], cols)
        full = np.zeros(len(RANK_FEATURES))
        full[cols] = th
        pred = _predict_part([solos[i] for i in idx], [zs[i] for i in idx], b, full)
        err[idx] = np.log(pred) - y[idx]
    return float(np.sqrt(np.mean(err**2)))


def fit_fusion(
    samples: Sequence[RankSample],
    *,
    select: bool = True,
    overhead: tuple[float, float] = (0.0, 0.0),
) -> FusionFit:
    """The fusion factors of both parts on ``samples`` (module docstring), the kernel's
    ``overhead`` counted once per kernel."""
    all_phi = np.concatenate([rank_features(s.kernels) for s in samples])
    mean = all_phi.mean(axis=0)
    std = np.where(all_phi.std(axis=0) < 1e-6, 1.0, all_phi.std(axis=0))
    plans = [s.plan for s in samples]
    parts: list[Fusion] = []
    cv: dict[str, float] = {}
    for part, name in enumerate(("fwd", "bwd")):
        solos, phis, y = _design(samples, part, overhead)
        zs = [(p - mean) / std for p in phis]
        cols: list[int] = []
        best = _cv_sigma(solos, zs, y, plans, cols) if select else math.nan
        while select and len(cols) < MAX_FEATURES and len(set(plans)) >= 3:
            trials = {
                j: _cv_sigma(solos, zs, y, plans, [*cols, j])
                for j in range(len(RANK_FEATURES))
                if j not in cols
            }
            j, got = min(trials.items(), key=lambda kv: kv[1])
            if not got < best - MIN_GAIN:
                break
            cols.append(j)
            best = got
        bias, theta = _fit_part(solos, zs, y, cols)
        coef = np.zeros(len(RANK_FEATURES))
        coef[cols] = theta
        parts.append(Fusion(bias, tuple(float(c) for c in coef)))
        if math.isfinite(best):  # one plan cannot be left out: no CV figure
            cv[name] = best
    return FusionFit(
        parts[0], parts[1], tuple(float(m) for m in mean), tuple(float(s) for s in std), cv,
        *_range(all_phi),
    )  # fmt: skip


def shipped_fusion(
    train: Sequence[RankSample],
    heldout: Sequence[RankSample],
    overhead: tuple[float, float] = (0.0, 0.0),
) -> FusionFit:
    """The fusion a calibrated model ships, once the held-out ranks have judged the one
    fitted on ``train``: fitted again on both, since the held-out tables are the job's
    own and its plans mix them with the rest (a fusion fitted on one half of the tables
    has underpriced the other half's ranks by a fifth). A held-out rank keeps a plan
    group of its own: both sides name their plans alike (``0:size-greedy``)."""
    held = [replace(s, plan=f"heldout:{s.plan}") for s in heldout]
    return fit_fusion([*train, *held], overhead=overhead)


def _range(all_phi: F64) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return tuple(all_phi.min(axis=0).tolist()), tuple(all_phi.max(axis=0).tolist())


def fixed_fusion(
    samples: Sequence[RankSample],
    features: Sequence[str],
    overhead: tuple[float, float] = (0.0, 0.0),
) -> FusionFit:
    """Factors fitted with exactly ``features`` (the ablation's rows): no selection."""
    all_phi = np.concatenate([rank_features(s.kernels) for s in samples])
    mean = all_phi.mean(axis=0)
    std = np.where(all_phi.std(axis=0) < 1e-6, 1.0, all_phi.std(axis=0))
    cols = [RANK_FEATURES.index(f) for f in features]
    parts = []
    for part in (0, 1):
        solos, phis, y = _design(samples, part, overhead)
        bias, theta = _fit_part(solos, [(p - mean) / std for p in phis], y, cols)
        coef = np.zeros(len(RANK_FEATURES))
        coef[cols] = theta
        parts.append(Fusion(bias, tuple(float(c) for c in coef)))
    return FusionFit(
        parts[0], parts[1], tuple(mean.tolist()), tuple(std.tolist()), {}, *_range(all_phi)
    )


def predict_samples(
    fit: FusionFit | None,
    samples: Sequence[RankSample],
    overhead: tuple[float, float] = (0.0, 0.0),
) -> F64:
    """(fwd, bwd) seconds ``[N, 2]`` of each sample under ``fit`` (None: Σ anchors),
    the kernel's ``overhead`` counted once per kernel."""
    out = np.zeros((len(samples), 2))
    mean = np.asarray(fit.mean if fit else (0.0,) * len(RANK_FEATURES))
    std = np.asarray(fit.std if fit else (1.0,) * len(RANK_FEATURES))
    for part, fusion in enumerate((fit.fwd, fit.bwd) if fit else (Fusion(), Fusion())):
        solos, phis, _ = _design(samples, part, overhead)
        lo, hi = (fit.lo, fit.hi) if fit else (None, None)
        zs = [(in_range(p, lo, hi) - mean) / std for p in phis]
        out[:, part] = _predict_part(solos, zs, fusion.bias, np.asarray(fusion.coef))
    return out


# --------------------------------------------------------------------------- judging


def rank_metrics(
    predicted: Sequence[float] | F64, measured: Sequence[float] | F64, plans: Sequence[str]
) -> dict[str, Any]:
    """Per rank and per plan maximum: Spearman, MAPE, σ and the median bias (plain
    JSON; None where a figure needs more ranks or plans than there are)."""
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    if len(m) == 0:
        return {"ranks": 0, "plans": 0}
    log_err = np.log(np.maximum(p, 1e-12) / np.maximum(m, 1e-12))
    per_rank = metrics(p, m)
    labels = list(dict.fromkeys(plans))
    out: dict[str, Any] = {
        "ranks": len(m),
        "plans": len(labels),
        "rank_spearman": _finite(per_rank["spearman"]),
        "rank_mape": _finite(per_rank["mape"]),
        "sigma": float(np.sqrt(np.mean(log_err**2))),
        "median_ratio": float(np.exp(np.median(log_err))),
        "plan_max_spearman": None,
        "plan_max_mape": None,
    }
    if len(labels) >= 2:
        arr = np.asarray(plans)
        pm = [float(p[arr == lab].max()) for lab in labels]
        mm = [float(m[arr == lab].max()) for lab in labels]
        per_plan = metrics(pm, mm)
        out["plan_max_spearman"] = _finite(per_plan["spearman"]) if len(labels) >= 3 else None
        out["plan_max_mape"] = _finite(per_plan["mape"])
    return out


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def log_spread(predicted: Sequence[float] | F64, measured: Sequence[float] | F64) -> float | None:
    """RMS of log(predicted / measured) over pairs above zero; None without any."""
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    ok = (p > 0) & (m > 0)
    if not ok.any():
        return None
    return float(np.sqrt(np.mean(np.log(p[ok] / m[ok]) ** 2)))

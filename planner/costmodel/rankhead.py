"""A calibrated model's price of a whole rank: measured tables, a fitted fusion factor,
and the error it was measured to make (docs/design.md §14, docs/calibration.md).

A search asks one question very often: what does *this rank* cost? The networks answer
it from table features, and on tables they never saw they misprice single tables by
tens of percent; summed over a rank and exploited by a search, those errors decide the
plan. A calibration therefore measures every job table alone at the job's batch (its
*anchor*, and the column halves of the heaviest), and prices a rank as

    fwd = (Σ solo_fwd - (n - 1)·k_fwd) · exp(θ_fwd · φ(rank)),   bwd likewise

where ``solo`` is each shard's anchor (the network's relative price scales it to a
width or batch that was not measured; a table with no anchor falls back to the
network with a fitted factor), ``k`` the kernel's own overhead (dispatch, the output's
allocation: in every anchor, but once in a fused kernel of ``n`` shards; 0.25 ms of
forward at global batch 8,192 on this project's CPU hosts, a third of a light table's
anchor) and ``φ`` are a few rank-level inputs that may explain why a fused kernel
costs other than its parts (:data:`RANK_FEATURES`). ``θ`` is fitted
on the measured ranks of candidate plans, by the calibration.

Every input is a sum over the rank's shards of a per-shard vector
(:data:`CHANNELS`), so a search keeps per-rank sums and asks :class:`AnchoredHead`,
exactly as it does with the network's encodings and head. The head also gives each
rank's error spread ``σ`` (log scale): the held-out error of anchored ranks, plus the
larger error of shards priced without an anchor in proportion to their share, which a
risk-aware search weighs (:mod:`shardwise.planner.neuroshard.risk`).

The head is stored as plain JSON in ``metadata["calibration"]["rank_head"]``, so a
model file stays weights-only; :func:`rank_head_of` reads and checks it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from shardwise.basics import UserError

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

#: The per-shard vector a search sums per rank (its "encoding" under a rank head).
CHANNELS: tuple[str, ...] = (
    "solo_fwd",  # the shard alone: forward seconds on this machine
    "solo_bwd",  # ... and backward
    "uncertain",  # solo seconds × the shard's own error spread (0 when measured)
    "count",  # 1 per shard
    "touched_mib",  # unique rows read per batch × width × bytes: the working set
    "lookups",  # indices read per batch (global batch × pooling factor)
    "width",  # output columns
)
SOLO_FWD, SOLO_BWD, UNCERTAIN, COUNT, TOUCHED, LOOKUPS, WIDTH = range(len(CHANNELS))
#: The rank-level inputs a fusion factor may use, from the summed channels.
RANK_FEATURES: tuple[str, ...] = (
    "log_tables",  # how many tables the fused kernel holds
    "log_touched",  # its working set against the caches (MiB)
    "log_lookups",  # indices it sorts and reads
    "log_width",  # the output row it writes per sample
    "log_solo_ms",  # how much work its parts are
)
PARTS: tuple[str, ...] = ("fwd", "bwd")
#: A model without a calibration on the job's ranks is assumed this far off (log σ):
#: the bundled model's per-rank MAPE on tables it never saw was 9-60 % (docs/calibration.md).
UNCALIBRATED_SIGMA = 0.25
_MIN_S = 1e-9


def rank_features(summed: npt.NDArray[np.floating[Any]]) -> F64:
    """:data:`RANK_FEATURES` of summed channels ``[N, C]`` → ``[N, F]`` (float64)."""
    s = np.asarray(summed, dtype=np.float64)
    solo = np.maximum(s[:, SOLO_FWD] + s[:, SOLO_BWD], _MIN_S)
    return np.stack(
        [
            np.log(np.maximum(s[:, COUNT], 1.0)),
            np.log1p(np.maximum(s[:, TOUCHED], 0.0)),
            np.log1p(np.maximum(s[:, LOOKUPS], 0.0)),
            np.log1p(np.maximum(s[:, WIDTH], 0.0)),
            np.log(1e3 * solo),
        ],
        axis=1,
    )


@dataclass(frozen=True)
class Fusion:
    """``log(fused / Σ solo)`` of one part as ``bias + Σ coef · (φ - mean) / std``."""

    bias: float = 0.0
    coef: tuple[float, ...] = (0.0,) * len(RANK_FEATURES)

    def log_factor(self, phi: F64, mean: F64, std: F64) -> F64:
        out: F64 = self.bias + ((phi - mean) / std) @ np.asarray(self.coef, dtype=np.float64)
        return out

    @property
    def used(self) -> list[str]:
        return [name for name, c in zip(RANK_FEATURES, self.coef, strict=True) if c != 0.0]


@dataclass(frozen=True)
class RankHead:
    """Anchors, fusion factors and errors of one calibration (module docstring)."""

    #: The global batch the anchors were measured at (the job's).
    batch: int
    #: Whole-table signature → {columns: (fwd, bwd) seconds measured alone}.
    anchors: Mapping[str, Mapping[int, tuple[float, float]]]
    fwd: Fusion = Fusion()
    bwd: Fusion = Fusion()
    mean: tuple[float, ...] = (0.0,) * len(RANK_FEATURES)
    std: tuple[float, ...] = (1.0,) * len(RANK_FEATURES)
    #: The features' range over the calibrated kernels: a kernel outside it (one shard
    #: alone where every calibrated rank fused ten) is priced at the range's edge, not by
    #: extrapolating a line fitted inside it (``None``: a model stored without one).
    lo: tuple[float, ...] | None = None
    hi: tuple[float, ...] | None = None
    #: Measured / network (with speed factors) over the anchors: what an unanchored
    #: table's network price is multiplied by.
    unanchored: tuple[float, float] = (1.0, 1.0)
    #: (fwd, bwd) seconds every kernel costs besides its tables (dispatch, the output's
    #: allocation): in each anchor once, in a fused rank once, so n anchors summed
    #: count it n - 1 times too many (measured by :mod:`~shardwise.profiler.calibrate`).
    overhead: tuple[float, float] = (0.0, 0.0)
    #: Log error spreads: a rank of anchored shards (held out), a shard scaled from
    #: another width's anchor, a shard with none. ``None``: not measured.
    sigma: float | None = None
    sigma_scaled: float = 0.15
    sigma_unanchored: float = 0.5
    #: The batch per rank data-parallel copies were measured at, and their anchors
    #: (signature → {columns: (fwd, bwd)}); ``None``/empty: none measured (a head
    #: stored before data-parallel anchors existed).
    local_batch: int | None = None
    local_anchors: Mapping[str, Mapping[int, tuple[float, float]]] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rank_sigma(self) -> float:
        """The spread of a rank of anchored shards (the uncalibrated default if unknown)."""
        return UNCALIBRATED_SIGMA if self.sigma is None else self.sigma

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "anchors": _anchors_json(self.anchors),
            "fusion": {
                "features": list(RANK_FEATURES),
                "mean": list(self.mean),
                "std": list(self.std),
                **({"lo": list(self.lo)} if self.lo is not None else {}),
                **({"hi": list(self.hi)} if self.hi is not None else {}),
                "fwd": {"bias": self.fwd.bias, "coef": list(self.fwd.coef)},
                "bwd": {"bias": self.bwd.bias, "coef": list(self.bwd.coef)},
            },
            "unanchored": list(self.unanchored),
            "overhead": list(self.overhead),
            "sigma": self.sigma,
            "sigma_scaled": self.sigma_scaled,
            "sigma_unanchored": self.sigma_unanchored,
            **(
                {
                    "local_batch": self.local_batch,
                    "local_anchors": _anchors_json(self.local_anchors),
                }
                if self.local_batch is not None and self.local_anchors
                else {}
            ),
            **dict(self.extra),
        }


def _anchors_json(
    anchors: Mapping[str, Mapping[int, tuple[float, float]]],
) -> dict[str, dict[str, list[float]]]:
    return {
        sig: {str(c): [f, b] for c, (f, b) in sorted(by_cols.items())}
        for sig, by_cols in sorted(anchors.items())
    }


class _Check:
    """Field checks of a stored head; each failure names the model and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> UserError:
        return UserError(
            f"{self.source} is a damaged cost model: metadata.calibration.rank_head{where} "
            f"{what}. Calibrate again (`shardwise calibrate`)."
        )

    def number(self, value: Any, where: str, *, positive: bool = False) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or (positive and value <= 0):
            kind = "a finite number > 0" if positive else "a finite number"
            raise self.fail(where, f"is {value!r}, not {kind}")
        return float(value)

    def numbers(
        self, value: Any, where: str, n: int, *, positive: bool = False
    ) -> tuple[float, ...]:
        if not isinstance(value, list | tuple) or len(value) != n:
            raise self.fail(where, f"is not a list of {n} numbers")
        return tuple(
            self.number(v, f"{where}[{i}]", positive=positive) for i, v in enumerate(value)
        )

    def mapping(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(where, f"is a {type(value).__name__}, not a mapping")
        return value


def rank_head_from_json(doc: Any, source: str = "the cost model") -> RankHead:
    """The head stored in a model's metadata, checked whole (a :class:`UserError` names
    the field that is wrong)."""
    check = _Check(source)
    d = check.mapping(doc, "")
    batch = d.get("batch")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise check.fail(".batch", f"is {batch!r}, not a whole number >= 1")
    anchors = _read_anchors(check, d.get("anchors"), ".anchors")
    local_batch = d.get("local_batch")
    local_anchors: dict[str, dict[int, tuple[float, float]]] = {}
    if local_batch is not None:
        if isinstance(local_batch, bool) or not isinstance(local_batch, int) or local_batch < 1:
            raise check.fail(".local_batch", f"is {local_batch!r}, not a whole number >= 1")
        local_anchors = _read_anchors(check, d.get("local_anchors"), ".local_anchors")
    fusion = check.mapping(d.get("fusion"), ".fusion")
    if list(fusion.get("features", [])) != list(RANK_FEATURES):
        raise check.fail(
            ".fusion.features",
            f"is {fusion.get('features')!r}; this Shardwise's rank features are "
            f"{list(RANK_FEATURES)}",
        )
    n = len(RANK_FEATURES)
    parts = {}
    for part in PARTS:
        p = check.mapping(fusion.get(part), f".fusion.{part}")
        parts[part] = Fusion(
            check.number(p.get("bias"), f".fusion.{part}.bias"),
            check.numbers(p.get("coef"), f".fusion.{part}.coef", n),
        )
    sigma = d.get("sigma")
    known = {"batch", "anchors", "fusion", "unanchored", "overhead", "sigma", "sigma_scaled"}
    known |= {"sigma_unanchored", "local_batch", "local_anchors"}
    return RankHead(
        batch=batch,
        anchors=anchors,
        fwd=parts["fwd"],
        bwd=parts["bwd"],
        mean=check.numbers(fusion.get("mean"), ".fusion.mean", n),
        std=check.numbers(fusion.get("std"), ".fusion.std", n, positive=True),
        lo=None if fusion.get("lo") is None else check.numbers(fusion["lo"], ".fusion.lo", n),
        hi=None if fusion.get("hi") is None else check.numbers(fusion["hi"], ".fusion.hi", n),
        unanchored=tuple(check.numbers(d.get("unanchored"), ".unanchored", 2, positive=True)),  # type: ignore[arg-type]
        overhead=tuple(check.numbers(d.get("overhead", [0.0, 0.0]), ".overhead", 2)),  # type: ignore[arg-type]
        sigma=None if sigma is None else check.number(sigma, ".sigma", positive=True),
        sigma_scaled=check.number(d.get("sigma_scaled", 0.15), ".sigma_scaled", positive=True),
        sigma_unanchored=check.number(
            d.get("sigma_unanchored", 0.5), ".sigma_unanchored", positive=True
        ),
        local_batch=local_batch,
        local_anchors=local_anchors,
        extra={k: v for k, v in d.items() if k not in known},
    )


def _read_anchors(check: _Check, value: Any, at: str) -> dict[str, dict[int, tuple[float, float]]]:
    anchors: dict[str, dict[int, tuple[float, float]]] = {}
    for sig, by_cols in check.mapping(value, at).items():
        where = f"{at}[{sig!r}]"
        got: dict[int, tuple[float, float]] = {}
        for cols, fb in check.mapping(by_cols, where).items():
            if not str(cols).isdigit() or int(cols) < 1:
                raise check.fail(where, f"has a width {cols!r} that is not a whole number >= 1")
            f, b = check.numbers(fb, f"{where}[{cols}]", 2, positive=True)
            got[int(cols)] = (f, b)
        anchors[str(sig)] = got
    return anchors


def rank_head_of(metadata: Mapping[str, Any], source: str = "the cost model") -> RankHead | None:
    """The model's rank head, or None when it was not calibrated on a job's ranks."""
    calibration = metadata.get("calibration")
    if not isinstance(calibration, Mapping) or calibration.get("rank_head") is None:
        return None
    return rank_head_from_json(calibration["rank_head"], source)


def in_range(phi: F64, lo: Sequence[float] | None, hi: Sequence[float] | None) -> F64:
    """Features clipped into the calibrated range (unchanged without one): the fusion is
    a line fitted inside it, and a search would exploit its extrapolation (a lone shard
    priced at 3 % of its own measurement, seen with ranks of ten shards calibrated)."""
    if lo is None or hi is None:
        return phi
    out: F64 = np.clip(phi, np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64))
    return out


class AnchoredHead:
    """Summed :data:`CHANNELS` of fused kernels → (fwd, bwd) seconds, and each kernel's
    error spread: the search's per-rank question, in NumPy."""

    def __init__(self, head: RankHead) -> None:
        self.head = head
        self._mean = np.asarray(head.mean, dtype=np.float64)
        self._std = np.asarray(head.std, dtype=np.float64)

    def seconds(self, summed: F32, counts: npt.NDArray[np.int64]) -> F32:
        """``summed [..., C]`` of kernels of ``counts [...]`` shards → ``[..., 2]``
        seconds (fwd, bwd); a kernel of 0 shards costs 0."""
        shape = counts.shape
        flat = np.asarray(summed, dtype=np.float64).reshape(-1, summed.shape[-1])
        phi = in_range(rank_features(flat), self.head.lo, self.head.hi)
        out = np.empty((flat.shape[0], 2), dtype=np.float64)
        n = np.maximum(flat[:, COUNT], 1.0)
        for k, (part, channel) in enumerate(((self.head.fwd, SOLO_FWD), (self.head.bwd, SOLO_BWD))):
            factor = np.exp(np.clip(part.log_factor(phi, self._mean, self._std), -5.0, 5.0))
            out[:, k] = fused_parts(flat[:, channel], n, self.head.overhead[k]) * factor
        out[counts.reshape(-1) == 0] = 0.0
        result: F32 = out.reshape(*shape, 2).astype(np.float32)
        return result

    def sigma(self, summed: npt.NDArray[np.floating[Any]]) -> F64:
        """Each kernel's log error spread ``[...]``: the anchored ranks' σ, and the share
        of its seconds priced without an anchor at that shard's own spread."""
        s = np.asarray(summed, dtype=np.float64)
        solo = np.maximum(s[..., SOLO_FWD] + s[..., SOLO_BWD], _MIN_S)
        extra = np.maximum(s[..., UNCERTAIN], 0.0) / solo
        out: F64 = np.sqrt(self.head.rank_sigma**2 + extra**2)
        return out


def fused_parts(
    solo_sum: npt.NDArray[np.floating[Any]], count: npt.NDArray[np.floating[Any]], overhead: float
) -> F64:
    """A fused kernel's summed anchors with the kernel's own overhead counted once, not
    once per table (never below the one overhead, nor below a tenth of the sum)."""
    s = np.maximum(np.asarray(solo_sum, dtype=np.float64), 0.0)
    once: F64 = s - (np.asarray(count, dtype=np.float64) - 1.0) * overhead
    floor: F64 = np.minimum(s, np.maximum(overhead, 0.1 * s))
    return np.maximum(once, floor)


def shard_channels(
    solo: Sequence[tuple[float, float]],
    spread: Sequence[float],
    touched_mib: Sequence[float],
    lookups: Sequence[float],
    widths: Sequence[int],
) -> F32:
    """Per-shard :data:`CHANNELS` ``[N, C]`` from its solo price and its shape."""
    n = len(solo)
    out = np.zeros((n, len(CHANNELS)), dtype=np.float64)
    if n:
        fb = np.asarray(solo, dtype=np.float64).reshape(n, 2)
        out[:, SOLO_FWD], out[:, SOLO_BWD] = fb[:, 0], fb[:, 1]
        out[:, UNCERTAIN] = fb.sum(axis=1) * np.asarray(spread, dtype=np.float64)
        out[:, COUNT] = 1.0
        out[:, TOUCHED] = np.asarray(touched_mib, dtype=np.float64)
        out[:, LOOKUPS] = np.asarray(lookups, dtype=np.float64)
        out[:, WIDTH] = np.asarray(widths, dtype=np.float64)
    result: F32 = out.astype(np.float32)
    return result


#: Fewest held-out ranks holding a kind that a calibration's verdict on it rests on
#: (the calibration's own minimum for its overall verdict).
VERDICT_MIN_RANKS = 8
#: Kinds a plan's warning speaks of: the fused kinds are what the overall verdict judges.
_SPLIT_KINDS = ("row_wise", "table_row_wise", "grid", "data_parallel")


def reliability_warning(
    metadata: Mapping[str, Any], plan_kinds: Iterable[str] | None = None
) -> str | None:
    """The line every `plan` prints for a model whose calibration's verdict is
    ``unreliable`` (its held-out plan ranks were priced only within a large σ); with
    ``plan_kinds`` (the kinds a plan uses), also what :func:`kind_warnings` says of
    them. None when there is nothing to warn of."""
    lines = []
    cal = metadata.get("calibration")
    found = cal.get("verdict") if isinstance(cal, Mapping) else None
    if isinstance(found, Mapping) and found.get("level") == "unreliable":
        sigma = found.get("sigma")
        figure = f"±{100 * float(sigma):.0f}%" if isinstance(sigma, int | float) else "large"
        lines.append(
            f"this cost model priced held-out plan ranks only within {figure} (calibration's "
            "verdict): model-only plans are not reliable; use --refine measured where this "
            "machine can measure, or calibrate longer"
        )
    lines += kind_warnings(metadata, plan_kinds or ())
    return "; ".join(lines) or None


def kind_warnings(metadata: Mapping[str, Any], plan_kinds: Iterable[str]) -> list[str]:
    """One sentence per row-wise, table-row-wise, grid or data-parallel kind of a plan
    that the model's calibration did not judge (fewer than :data:`VERDICT_MIN_RANKS`
    held-out ranks held it, or the calibration predates judging kinds) or judged
    unreliable. A model without a calibration verdict says nothing here: its note
    already asks for a calibration."""
    cal = metadata.get("calibration")
    found = cal.get("verdict") if isinstance(cal, Mapping) else None
    if not isinstance(found, Mapping):
        return []
    judged = found.get("kinds")
    judged = judged if isinstance(judged, Mapping) else {}
    wanted = set(plan_kinds)
    out = []
    for kind in _SPLIT_KINDS:
        if kind not in wanted:
            continue
        words = kind.replace("_", "-")
        entry = judged.get(kind)
        entry = entry if isinstance(entry, Mapping) else {}
        ranks = entry.get("ranks")
        n = int(ranks) if isinstance(ranks, int | float) and not isinstance(ranks, bool) else 0
        level = entry.get("level", "unjudged")
        if level == "unjudged":
            fix = (
                "measure this plan (--refine measured) before trusting them"
                if "kinds" in found
                else "its calibration predates judging ranks by kind: calibrate again "
                "(`shardwise calibrate` times ranks of every kind), or measure this plan "
                "(--refine measured)"
            )
            out.append(
                f"this cost model's {words} prices are unjudged: its calibration measured "
                f"{n} held-out {words} rank(s), and a verdict needs {VERDICT_MIN_RANKS}; "
                f"this plan's {words} tables are priced without that evidence: {fix}"
            )
        elif level == "unreliable":
            sigma = entry.get("sigma")
            figure = f"±{100 * float(sigma):.0f}%" if isinstance(sigma, int | float) else "large"
            out.append(
                f"this cost model priced held-out {words} ranks only within {figure}: this "
                f"plan's {words} tables are not reliably priced; use --refine measured"
            )
    return out

"""This machine's speed factors against a cost model: the first, quick calibration phase.

A model trained on one machine ranks kernels on another fairly well but is off by a
factor (the bundled model, trained on an Intel Xeon, predicts 3–9× too much on an AMD
EPYC; backward more than forward). That offset is one number per part of the cost,
so a few dozen kernels measured here fix it: the factor is the geometric mean of
measured / predicted, taken as the median of the log ratios so that a kernel caught
by a noisy neighbour (15–40 % spikes happen on a shared 2-core host) cannot move it.

Predictions are the model's *with* its own factors, so a model calibrated before
gets its factors corrected, not replaced by the raw networks'. Measured times are
first brought to the machine's median speed during the calibration with the reference
kernel timed beside them (a shared host's speed drifts by ±25 % over minutes), so
the factor is the machine's typical speed, not that of the minute it was measured in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from shardwise.planner.costmodel.artifact import CostModel, SpeedFactors
from shardwise.planner.costmodel.predictor import CostPredictor
from shardwise.planner.tables import TableSpec
from shardwise.profiler.pretrain.data import drift_factors

F64 = npt.NDArray[np.float64]
#: Measured or predicted times below this are noise, not a ratio to trust.
_FLOOR_S = 1e-7


#: What a table name may not hold: a row range's record names it ``base[lo:hi]``.
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_\-]")


def record_shards(record: Mapping[str, Any]) -> list[tuple[TableSpec, int]]:
    """A compute record's kernel as the predictor takes it: (table, columns) pairs (a
    row range as its kernel saw it: its rows, its share of the lookups)."""
    return [
        (
            TableSpec(
                name=_NOT_IN_NAME.sub("_", t["name"]),
                rows=t["rows"],
                dim=t["cols"],
                pooling_factor=t["pooling_factor"],
                access_hist=tuple(t["access_hist"]),
                dtype=t["dtype"],
            ),
            int(t["cols"]),
        )
        for t in record["tables"]
    ]


def predict_compute(model: CostModel, records: Sequence[Mapping[str, Any]]) -> F64:
    """The network's predicted (fwd, bwd) seconds ``[N, 2]`` of each record's kernel at
    its batch, with the model's speed factors (never its rank head: that is what the
    factors and a fine-tune are fitted for)."""
    predictor = CostPredictor(model)
    out = np.zeros((len(records), 2), dtype=np.float64)
    by_batch: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        by_batch.setdefault(int(r["batch_size"]), []).append(i)
    for batch, idx in by_batch.items():
        got = predictor.network_compute([record_shards(records[i]) for i in idx], batch)
        out[idx] = got
    return out


def measured_compute(records: Sequence[Mapping[str, Any]], drift: bool = False) -> F64:
    """Measured (fwd, bwd) seconds ``[N, 2]``; with ``drift``, brought to the median
    machine speed by the reference kernel timed beside them (when every record has it)."""
    out = np.array([[r["fwd_s"], r["bwd_s"]] for r in records], dtype=np.float64).reshape(-1, 2)
    factors = drift_factors([dict(r) for r in records]) if drift and records else None
    if factors is not None:
        out *= np.asarray(factors, dtype=np.float64)[:, None]
    return out


#: Fewest anchors timed twice that can judge the reference kernel's correction.
MIN_REFERENCE_PAIRS = 8


@dataclass(frozen=True)
class ReferenceCheck:
    """Does dividing the reference kernel's drift out make the anchors timed twice
    agree better? ``raw`` and ``corrected``: the standard deviation of the log ratio of
    each anchor's two timings, as measured and after the correction. Measured on a
    2-core AMD EPYC, the correction widened that spread in 16 of 17 calibrations
    (0.25-0.37 raw, 0.27-0.56 corrected): the small reference kernel's own swings do
    not track the job's kernels there. So a calibration keeps it only where it helps."""

    pairs: int
    raw: float
    corrected: float

    @property
    def helps(self) -> bool:
        return self.corrected < self.raw

    def note(self) -> str:
        verb = "narrowed" if self.helps else "widened"
        used = "corrected" if self.helps else "left as measured"
        return (
            f"reference-kernel drift correction {verb} the spread of the {self.pairs} "
            f"anchors timed twice ({self.raw:.2f} -> {self.corrected:.2f} sd of the log "
            f"ratio): timings {used}"
        )


def _anchor_key(record: Mapping[str, Any]) -> str:
    extra = {k: v for k, v in record.get("extra", {}).items() if k not in _PER_TIMING}
    tables = [(t["name"], t["rows"], t["cols"]) for t in record["tables"]]
    return repr((tables, int(record["batch_size"]), sorted(extra.items())))


#: What differs between two timings of one anchor.
_PER_TIMING = ("pass", "reference_s", "allocator_mitigated")


def reference_check(records: Sequence[Mapping[str, Any]]) -> ReferenceCheck | None:
    """:class:`ReferenceCheck` over the anchors of ``records`` timed in both passes,
    each with its reference; None with fewer than :data:`MIN_REFERENCE_PAIRS`."""
    first: dict[str, Mapping[str, Any]] = {}
    second: dict[str, Mapping[str, Any]] = {}
    for r in records:
        if float(r.get("extra", {}).get("reference_s", 0.0)) > 0 and r["total_s"] > _FLOOR_S:
            (second if r["extra"].get("pass") == 2 else first)[_anchor_key(r)] = r
    both = [(first[k], second[k]) for k in first.keys() & second.keys()]
    if len(both) < MIN_REFERENCE_PAIRS:
        return None
    meas = np.log([a["total_s"] / b["total_s"] for a, b in both])
    refs = np.log([a["extra"]["reference_s"] / b["extra"]["reference_s"] for a, b in both])
    return ReferenceCheck(len(both), float(meas.std()), float((meas - refs).std()))


def log_ratio(measured: Sequence[float] | F64, predicted: Sequence[float] | F64) -> float:
    """exp(median(log(measured / predicted))) over pairs both above the noise floor;
    1 when there is none."""
    m = np.asarray(measured, dtype=np.float64).ravel()
    p = np.asarray(predicted, dtype=np.float64).ravel()
    ok = (m > _FLOOR_S) & (p > _FLOOR_S)
    if not ok.any():
        return 1.0
    return float(math.exp(float(np.median(np.log(m[ok] / p[ok])))))


@dataclass(frozen=True)
class SpeedFit:
    """The fitted factors and what they rest on."""

    factors: SpeedFactors
    compute_samples: int
    comm_samples: int
    #: The middle half of the log ratios (a spread of 0.1 is about ±5 %), per part.
    spread: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "factors": self.factors.to_dict(),
            "compute_samples": self.compute_samples,
            "comm_samples": self.comm_samples,
            "spread": dict(self.spread),
        }


def _iqr(measured: F64, predicted: F64) -> float:
    ok = (measured > _FLOOR_S) & (predicted > _FLOOR_S)
    if ok.sum() < 2:
        return math.nan
    q1, q3 = np.percentile(np.log(measured[ok] / predicted[ok]), [25, 75])
    return float(q3 - q1)


def fit_speed(
    model: CostModel,
    compute_records: Sequence[Mapping[str, Any]],
    comm_records: Sequence[Mapping[str, Any]] = (),
    drift: bool = True,
) -> SpeedFit:
    """The factors that make ``model`` predict what was measured here (see the module
    docstring; ``drift`` off: the timings as measured, :class:`ReferenceCheck`).
    Without all-to-all samples, or without a comm network, the comm factor stays the
    model's own."""
    old = model.speed_factors
    spread: dict[str, float] = {}
    fwd, bwd = old.fwd, old.bwd
    if compute_records:
        pred = predict_compute(model, compute_records)
        meas = measured_compute(compute_records, drift=drift)
        fwd *= log_ratio(meas[:, 0], pred[:, 0])
        bwd *= log_ratio(meas[:, 1], pred[:, 1])
        spread["fwd"] = _iqr(meas[:, 0], pred[:, 0])
        spread["bwd"] = _iqr(meas[:, 1], pred[:, 1])
    comm = old.comm
    used_comm = 0
    if comm_records and model.comm is not None:
        predictor = CostPredictor(model)
        p: list[float] = []
        m: list[float] = []
        for r in comm_records:
            pf, pb = predictor.comm(r["dims"], r["delays_s"], int(r["batch_size"]))
            p.extend([*pf.tolist(), *pb.tolist()])
            m.extend([*r["fwd_s"], *r["bwd_s"]])
        comm *= log_ratio(m, p)
        spread["comm"] = _iqr(np.asarray(m), np.asarray(p))
        used_comm = len(comm_records)
    return SpeedFit(
        SpeedFactors(fwd=fwd, bwd=bwd, comm=comm),
        len(compute_records),
        used_comm,
        spread,
    )


@dataclass
class Collectives:
    """What the calibration's comm phase makes of the reduce-scatters and all-reduces
    it timed: factors for the model's fitted lines, or lines fitted here for a model
    without any (``metadata["comm_collectives"]``), and a note on either."""

    factors: dict[str, dict[str, Any]] = field(default_factory=dict)
    fitted: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def fit_collectives(
    model: CostModel, comm_records: Sequence[Mapping[str, Any]], cores: int
) -> Collectives:
    """The model's fitted collectives rescaled to this machine (its factor times the
    median ratio of measured to predicted, as the all-to-all's comm factor); a model
    pre-trained without fits gets α–β lines fitted on these records (two ranks: labelled
    learned there and modelled at other world sizes). Nothing without records."""
    from shardwise.planner.comm.learned import (
        collective_factors,
        collectives_metadata,
        fit_learned,
        learned_collectives,
    )

    out = Collectives()
    if not any(r.get("extra", {}).get("collectives") for r in comm_records):
        return out
    fits = learned_collectives(model.metadata, model.source)
    if fits:
        out.factors = collective_factors(fits, comm_records)
        if out.factors:
            said = ", ".join(f"{n} x{f['factor']:.2f}" for n, f in sorted(out.factors.items()))
            out.notes.append(f"collectives rescaled to this machine: {said}")
        return out
    learned = fit_learned(comm_records, "this machine's calibration", cores=cores)
    if learned:
        out.fitted = collectives_metadata(learned)
        out.notes.append(
            f"collectives fitted here ({', '.join(sorted(learned))}, 2 ranks): the model "
            "had no fitted collectives"
        )
    return out

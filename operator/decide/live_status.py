"""What the operator shows of a running job's live costs, and the closed loop's record.

``status.live`` (:func:`live_fields`) is the workers' latest summary, measured against
predicted; ``status.imbalanceLoop`` (:class:`LoopRecord`) is the one earlier state the
loop (:mod:`shardwise.operator.decide.imbalance`) reads back, so a debounce, a reshard
under way and the rate bound survive an operator restart.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardwise.operator.cluster.summaries import PlanRecord, format_time, parse_time
from shardwise.operator.decide.lifecycle import Condition
from shardwise.planner.live.summary import LiveSummary, RankPoint

#: The loop's states (``status.imbalanceLoop.state``).
WATCHING = "Watching"
SUSTAINED = "Sustained"
REPLANNING = "Replanning"
DECLINED = "Declined"
RESHARDING = "Resharding"
VERIFYING = "Verifying"
STOPPED = "Stopped"
STATES = (WATCHING, SUSTAINED, REPLANNING, DECLINED, RESHARDING, VERIFYING, STOPPED)
#: ``Resharding``'s reason once a reshard moved the workers (a node reshard's too).
R_RESHARDED = "Resharded"
#: Measured ranks kept as evidence for later re-plans (the newest).
MAX_EVIDENCE = 64


@dataclass(frozen=True)
class LoopRecord:
    """``status.imbalanceLoop``: the one earlier state the loop reads back (a debounce,
    a reshard under way, the plan adopted and the rate bound survive a restart)."""

    state: str = WATCHING
    #: When the running debounce began: the imbalance above the threshold (Sustained),
    #: or above a decline's retry bar (Declined); None when none runs.
    since: datetime.datetime | None = None
    base_plan: str = ""
    #: The live re-plan under consideration (or the last one adopted).
    live_plan: str = ""
    #: The workers run (or are moving to) a live re-plan: ``running_plan``.
    adopted: bool = False
    #: The inputs hash of the live re-plan the workers run, kept apart from
    #: ``live_plan``: a later episode's re-plan must not replace it before it is
    #: adopted (empty: the declared plan runs).
    running_plan: str = ""
    from_max_ms: float = 0.0
    predicted_max_ms: float = 0.0
    #: Max/mean of the ranks' compute: measured before, predicted, measured after.
    from_imbalance: float = 0.0
    predicted_imbalance: float = 0.0
    measured_imbalance: float = 0.0
    predicted_gain: float = 0.0
    measured_max_ms: float = 0.0
    reshard_seconds: float = 0.0
    started_at: datetime.datetime | None = None
    reshards: tuple[datetime.datetime, ...] = ()
    generation: int = 0
    message: str = ""
    #: The last reshard's verdict, with its figures (kept while the loop watches on).
    verdict: str = ""
    #: The re-planned workers' summaries so far while verifying: (written at, max/mean,
    #: max-rank compute ms), one per distinct summary.
    verify_samples: tuple[tuple[str, float, float], ...] = ()
    #: The re-plan's uncertainty on its gain (plausible prices and noise), as decided on.
    uncertainty: float = 0.0
    #: Reshards of this generation of the spec (the first, and at most one that learns
    #: from a reshard that did not deliver).
    attempts: int = 0
    #: Measured ranks of the plans the loop re-planned from: what a later re-plan
    #: learns from (the newest :data:`MAX_EVIDENCE`).
    evidence: tuple[RankPoint, ...] = ()

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "adopted": self.adopted}
        for key, text in (
            ("basePlan", self.base_plan),
            ("livePlan", self.live_plan),
            ("runningPlan", self.running_plan),
        ):
            if text:
                out[key] = text
        for key, value in (
            ("fromMaxMilliseconds", self.from_max_ms),
            ("predictedMaxMilliseconds", self.predicted_max_ms),
            ("fromImbalance", self.from_imbalance),
            ("predictedImbalance", self.predicted_imbalance),
            ("measuredImbalance", self.measured_imbalance),
            ("predictedGain", self.predicted_gain),
            ("measuredMaxMilliseconds", self.measured_max_ms),
            ("reshardSeconds", self.reshard_seconds),
            ("uncertainty", self.uncertainty),
        ):
            if value:
                out[key] = round(value, 4)
        if self.attempts:
            out["attempts"] = self.attempts
        for key, when in (("since", self.since), ("startedAt", self.started_at)):
            if when is not None:
                out[key] = format_time(when)
        if self.reshards:
            out["reshards"] = [format_time(t) for t in self.reshards]
        out["generation"] = self.generation
        if self.message:
            out["message"] = self.message
        if self.verdict:
            out["verdict"] = self.verdict
        if self.verify_samples:
            out["verifySummaries"] = [
                {"writtenAt": w, "imbalance": round(i, 4), "maxMilliseconds": round(m, 4)}
                for w, i, m in self.verify_samples
            ]
        if self.evidence:
            out["evidence"] = [
                {**p.model_dump(by_alias=True), "probeMs": round(p.probe_ms, 4),
                 "computeMs": round(p.compute_ms, 4), "emptyMs": round(p.empty_ms, 4)}
                for p in self.evidence
            ]  # fmt: skip
        return out

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> LoopRecord | None:
        if not isinstance(raw, Mapping) or raw.get("state") not in STATES:
            return None

        def num(key: str) -> float:
            v = raw.get(key)
            return float(v) if isinstance(v, int | float) else 0.0

        stamps = [parse_time(t) for t in raw.get("reshards") or [] if isinstance(t, str)]
        samples = tuple(
            (str(v["writtenAt"]), float(v["imbalance"]), float(v["maxMilliseconds"]))
            for v in raw.get("verifySummaries") or []
            if isinstance(v, Mapping)
            and isinstance(v.get("imbalance"), int | float)
            and isinstance(v.get("maxMilliseconds"), int | float)
        )
        evidence = []
        for v in raw.get("evidence") or []:
            try:
                evidence.append(RankPoint.model_validate(v))
            except ValueError:
                continue  # a point edited out of shape is not evidence
        running = str(raw.get("runningPlan") or "")
        live_plan = str(raw.get("livePlan") or "")
        if not running and raw.get("adopted") and live_plan:
            running = live_plan  # a record written before runningPlan existed
        return cls(
            state=str(raw["state"]),
            since=parse_time(raw.get("since")),
            base_plan=str(raw.get("basePlan") or ""),
            live_plan=live_plan,
            adopted=bool(raw.get("adopted")),
            running_plan=running,
            from_max_ms=num("fromMaxMilliseconds"),
            predicted_max_ms=num("predictedMaxMilliseconds"),
            from_imbalance=num("fromImbalance"),
            predicted_imbalance=num("predictedImbalance"),
            measured_imbalance=num("measuredImbalance"),
            predicted_gain=num("predictedGain"),
            measured_max_ms=num("measuredMaxMilliseconds"),
            reshard_seconds=num("reshardSeconds"),
            started_at=parse_time(raw.get("startedAt")),
            reshards=tuple(t for t in stamps if t is not None),
            generation=int(raw.get("generation") or 0),
            message=str(raw.get("message") or ""),
            verdict=str(raw.get("verdict") or ""),
            verify_samples=samples,
            uncertainty=num("uncertainty"),
            attempts=int(raw.get("attempts") or 0),
            evidence=tuple(evidence),
        )


def resharded(rec: LoopRecord | None) -> Condition | None:
    """``Resharding=False``, reason ``Resharded``, once the loop's last reshard moved the
    workers (its record is past ``Resharding``): why it resharded, with the figures it
    resharded on while verifying, with the verdict's once judged; ``None`` before any
    reshard of this record (a new declaration starts a new one)."""
    if rec is None or rec.started_at is None or rec.state == RESHARDING:
        return None
    if rec.state == VERIFYING or not rec.verdict:
        why = (
            f"measured max/mean {rec.from_imbalance:.3f}, predicted "
            f"{rec.predicted_imbalance:.3f}; max-rank compute {rec.from_max_ms:.2f} → "
            f"{rec.predicted_max_ms:.2f} ms predicted ({100 * rec.predicted_gain:.1f} % "
            f"gain); {rec.message}"
        )
    else:
        why = rec.verdict
    return Condition("Resharding", False, R_RESHARDED, f"resharded for imbalance: {why}")


def live_inputs_hash(
    base_inputs: str, live: LiveSummary, evidence: tuple[RankPoint, ...] = ()
) -> str:
    """A live re-plan is named by the plan it replans, the summary it replans from and
    the earlier plans' evidence it learns from."""
    text = f"{base_inputs}|{live.plan_hash}|{live.written_at}|{live.step}"
    if evidence:
        text += "|" + "|".join(p.model_dump_json() for p in evidence)
    return hashlib.sha256(text.encode()).hexdigest()


#: Probe windows every shard of a rank must have before the rank is evidence.
EVIDENCE_PROBES = 3


def with_evidence(rec_evidence: tuple[RankPoint, ...], live: LiveSummary) -> tuple[RankPoint, ...]:
    """The record's evidence with ``live``'s fully probed ranks (every shard timed
    :data:`EVIDENCE_PROBES` times, and the probe seeing something) in place of any
    earlier points of the same plan (the newest :data:`MAX_EVIDENCE`). A rank whose
    probe saw nothing (every call no dearer than the empty one: a disturbed window)
    is no evidence of what its shards cost."""
    mine = live.plan_hash[:12]
    fresh = [p for p in live.points(EVIDENCE_PROBES) if p.probe_ms > 0]
    if not fresh:
        return rec_evidence
    kept = [p for p in rec_evidence if p.plan != mine]
    return tuple([*kept, *fresh][-MAX_EVIDENCE:])


def live_fields(live: LiveSummary, running: PlanRecord | None) -> dict[str, Any]:
    """``status.live``: measured against predicted."""
    ranks = live.measured()
    out: dict[str, Any] = {
        "planHash": live.plan_hash,
        "step": live.step,
        "steps": live.steps,
        "ranks": len(ranks),
        "writtenAt": live.written_at,
    }
    if ranks:
        total = max(r.total_ms for r in ranks)
        out["measuredMaxMilliseconds"] = round(total, 3)
        out["measuredMaxComputeMilliseconds"] = round(live.max_compute_ms(), 3)
        slow = live.straggler()
        if slow is not None:
            out["straggler"] = f"rank {slow.rank}" + (f" ({slow.pod})" if slow.pod else "")
        predicted = running.summary.get("predictedMaxSeconds") if running else None
        if isinstance(predicted, int | float) and total > 0:
            out["predictedMaxMilliseconds"] = round(1e3 * predicted, 3)
            out["predictedOverMeasured"] = round(1e3 * predicted / total, 3)
    imb = live.imbalance()
    if imb is not None:
        out["measuredImbalance"] = round(imb, 4)
    if live.probe.train_seconds > 0:
        out["probeOverhead"] = round(live.probe.overhead, 5)
    return out


def measured_text(live: LiveSummary) -> str:
    """The summary in one line for a message: the straggler and the imbalance, or how
    many ranks reported."""
    imb = live.imbalance()
    slow = live.straggler()
    if imb is None or slow is None:
        got = len(live.measured())
        return f"{got} of {live.world_size} ranks reported (step {live.step})"
    return (
        f"max-rank compute {live.max_compute_ms():.2f} ms on rank {slow.rank}, imbalance "
        f"{imb:.3f} (max/mean over {live.world_size} ranks, step {live.step})"
    )

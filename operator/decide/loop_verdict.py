"""The closed loop's verdict on a reshard it made (:mod:`.imbalance` calls it while
``Verifying``): did the live re-plan deliver what it predicted, judged on the re-planned
workers' own measurements?

The verdict is the median max/mean of the first :data:`VERIFY_SUMMARIES` trusted
summaries with :data:`VERIFY_SAMPLES` sampled steps behind every rank: absolute times
on a shared machine drift with its load between two summaries a minute apart, the
imbalance does not, and moving whole shards keeps the total work.
A reshard delivered when it brought the job to the ``threshold`` or below (balanced, by
the user's own measure), or removed at least :data:`DELIVERED_SHARE` of the imbalance
it predicted to remove. A first reshard that did not deliver is evidence: its ranks join
the record's, and the loop watches on, so that a re-plan from both plans' measurements
may reshard once more if it still pays; a second stops the loop for this generation of
the spec, with the figures, so it never oscillates.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from shardwise.operator.cluster.summaries import parse_time
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.decide.live_status import STOPPED, WATCHING, LoopRecord, with_evidence
from shardwise.planner.live.summary import LiveSummary

BALANCED = "Balanced"
R_VERIFYING = "VerifyingReshard"
R_DELIVERED = "ReshardDelivered"
R_NOT_DELIVERED = "ReshardDidNotDeliver"
#: A reshard delivered if it removed at least this share of the excess imbalance it
#: predicted to remove.
DELIVERED_SHARE = 0.5
#: Reshards per generation of the spec: the first, and one more that learns from it
#: when it did not deliver. A second that does not deliver stops the loop.
MAX_ATTEMPTS = 2
#: Distinct trusted summaries of the re-planned workers behind a verdict (their median).
VERIFY_SUMMARIES = 3
#: Sampled steps every rank must have behind a summary before it counts for a verdict:
#: most of the workers' window (20), so the new workers' first seconds (freshly loaded
#: tables, a machine still busy with the reshard) do not decide what the plan measures.
VERIFY_SAMPLES = 16


def verify(
    threshold: float, rec: LoopRecord, live: LiveSummary | None
) -> tuple[LoopRecord, Condition, str | None]:
    """The record, the ``Balanced`` condition and the decision to count (``None``: none
    yet) once the workers run the live plan (``live``: their trusted summary, if any)."""
    if live is None or min(r.samples for r in live.measured()) < VERIFY_SAMPLES:
        msg = (
            f"waiting for the re-planned workers' measurements ({VERIFY_SAMPLES} sampled "
            f"steps on every rank; {rec.message})"
        )
        return rec, Condition(BALANCED, False, R_VERIFYING, msg), None
    seen = rec.verify_samples
    if not seen or seen[-1][0] != live.written_at:
        seen = (*seen, (live.written_at, live.imbalance() or 1.0, live.max_compute_ms()))
    first = parse_time(live.first_step_at)
    cost = (
        (first - rec.started_at).total_seconds()
        if first is not None and rec.started_at is not None and first > rec.started_at
        else rec.reshard_seconds
    )
    rec = replace(rec, verify_samples=seen, reshard_seconds=cost)
    imb = statistics.median(s[1] for s in seen)
    measured = statistics.median(s[2] for s in seen)
    before, meant = max(rec.from_imbalance, 1.0), max(rec.predicted_imbalance, 1.0)
    if len(seen) < VERIFY_SUMMARIES:
        so_far = ", ".join(f"{s[1]:.3f}" for s in seen)
        msg = (
            f"verifying the reshard on {VERIFY_SUMMARIES} summaries of the re-planned "
            f"workers: max/mean {so_far} so far (from {before:.3f}, predicted {meant:.3f})"
        )
        return rec, Condition(BALANCED, False, R_VERIFYING, msg), None
    figures = (
        f"max/mean {before:.3f} → {imb:.3f} measured (median of {len(seen)} summaries; "
        f"predicted {meant:.3f}); max-rank compute {rec.from_max_ms:.2f} → {measured:.2f} ms "
        f"(predicted {rec.predicted_max_ms:.2f} ms); the reshard took {cost:.0f} s"
    )
    rec = replace(rec, measured_max_ms=measured, measured_imbalance=imb)
    balanced = imb <= threshold
    if balanced or before - imb >= DELIVERED_SHARE * (before - meant):
        msg = f"the reshard delivered: {figures}"
        done = replace(rec, state=WATCHING, since=None, message=msg, verdict=msg)
        return done, Condition(BALANCED, balanced, R_DELIVERED, msg), "delivered"
    if rec.attempts < MAX_ATTEMPTS:
        msg = (
            f"the reshard did not deliver: {figures}; learning from it: a re-plan from "
            "both plans' measured ranks reshards once more only if it still pays"
        )
        learnt = replace(
            rec, state=WATCHING, since=None, message=msg, verdict=msg,
            evidence=with_evidence(rec.evidence, live),
        )  # fmt: skip
        return learnt, Condition(BALANCED, False, R_NOT_DELIVERED, msg), None
    msg = f"the reshard did not deliver: {figures}; the loop stops for this job"
    stopped = replace(rec, state=STOPPED, message=msg, verdict=msg)
    return stopped, Condition(BALANCED, False, R_NOT_DELIVERED, msg), "stopped"

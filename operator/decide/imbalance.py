"""The closed loop: reshard a running job whose workers measure a straggler.

:func:`step` is the whole decision, pure, like :func:`shardwise.operator.decide.resharding.reshard`:
from a :class:`LoopInput` (the ``resharding.onImbalance`` settings, the loop's record
in ``status.imbalanceLoop``, rank 0's live summary, the plan the workers run and the
live re-plan when there is one, the clock) to a :class:`LoopOutcome` (the record to
write, the conditions, a re-plan to make, the plan the workers should run).

The loop, as an engineer would run it (docs/resharding.md):

- **Measure.** Only a complete live summary (every rank reported) *for the plan the
  workers run* counts; its figures are medians over the workers' recent sampled steps,
  so one slow step moves nothing. Imbalance is max/mean of the ranks' embedding
  *compute* (:mod:`shardwise.planner.live.summary` says why not the totals).
- **Sustain.** Above ``threshold`` in every summary for ``sustainSeconds`` (a summary
  at or below it resets the clock), then re-plan from the live costs.
- **Predict and decide.** The re-plan (``planner.live.replan``) predicts the max-rank
  compute and how far that may be off (its prices' plausible range, the probe's
  spread, a rank's measurement noise); the gain is ``measured max / predicted max -
  1``. The loop declines below ``minGain``, when the gain does not beat its uncertainty
  (the live prices could not be checked well enough to vouch for it), and when the time
  saved over the remaining steps does not pay :data:`PAYBACK` times the reshard's
  measured cost; it waits while ``maxPerHour`` reshards already started in the last
  hour. A decline stands until the measured excess imbalance (max/mean − 1) has grown
  by :data:`RETRY_GROWTH` in every summary for ``sustainSeconds`` (the data drifted
  further), or the probe's spread has narrowed to :data:`NARROWED` of what the decline
  was judged on (more probe windows: the evidence a decline within the uncertainty
  asks for, and a gain too small on an early, noisy probe is looked at again).
  Each re-plan records the measured ranks it started from (``evidence``).
- **Reshard** through the same checkpoint → new plan → resume path as a node change:
  the workers run the live plan from now on (``runningPlan``, kept apart from the
  re-plan target ``livePlan``, so a later episode's re-plan never takes it away before
  it is adopted), as long as the declared inputs stay the same (a new size or spec
  re-plans from the declaration).
- **Verify** (:mod:`.loop_verdict`) on the median max/mean of the re-planned workers'
  first :data:`VERIFY_SUMMARIES` trusted summaries. A first reshard that did not
  deliver is evidence: the next re-plan prices both plans' measured ranks and reshards
  once more only if that still pays; a second stops the loop for this generation of
  the spec, with the figures: it never oscillates.

Without live data for a running job (rank 0 cannot write, or nothing reaches the
operator) the ``LiveCosts`` condition names the pods and why, and nothing reshards.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.operator.cluster.summaries import JobState, PlanRecord, parse_time
from shardwise.operator.crd import OnImbalanceSpec
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.decide.live_status import (
    DECLINED,
    REPLANNING,
    RESHARDING,
    STOPPED,
    SUSTAINED,
    VERIFYING,
    WATCHING,
    LoopRecord,
    live_fields,
    live_inputs_hash,
    measured_text,
    resharded,
    with_evidence,
)
from shardwise.operator.decide.loop_verdict import DELIVERED_SHARE as DELIVERED_SHARE
from shardwise.operator.decide.loop_verdict import MAX_ATTEMPTS as MAX_ATTEMPTS
from shardwise.operator.decide.loop_verdict import R_DELIVERED as R_DELIVERED
from shardwise.operator.decide.loop_verdict import R_NOT_DELIVERED as R_NOT_DELIVERED
from shardwise.operator.decide.loop_verdict import R_VERIFYING as R_VERIFYING
from shardwise.operator.decide.loop_verdict import VERIFY_SUMMARIES as VERIFY_SUMMARIES
from shardwise.operator.decide.loop_verdict import verify
from shardwise.planner.live.summary import LiveSummary, RankPoint

#: The condition the loop reports on, and the liveness of its data.
BALANCED = "Balanced"
LIVE_COSTS = "LiveCosts"
#: Reasons (each an Event when it changes); the warnings are in lifecycle.py.
R_BALANCED = "Balanced"
R_SUSTAINING = "ImbalanceSustaining"
R_REPLANNING = "ReplanningFromLiveCosts"
R_GAIN_TOO_SMALL = "GainTooSmall"
R_UNCERTAIN = "GainWithinUncertainty"
R_DOES_NOT_PAY = "ReshardDoesNotPay"
R_RATE_LIMITED = "ReshardRateLimited"
R_NO_STEPS = "NoStepsLeft"
R_PLAN_FAILED = "LiveReplanFailed"
R_RESHARDING = "ReshardingForImbalance"
R_NO_LIVE = "NoLiveCosts"
R_LIVE = "Measured"
WARNINGS = frozenset({R_NOT_DELIVERED, R_NO_LIVE, R_PLAN_FAILED})
#: Reasons of the planner's failures for a live re-plan (planmaker.py records them).
LIVE_REPLAN_FAILED = R_PLAN_FAILED
NO_BETTER_PLAN = "NoBetterPlan"

#: The time a reshard saves over the remaining steps must be this many times its cost.
PAYBACK = 2.0
#: A declined re-plan is tried again once the measured excess imbalance grew this much.
RETRY_GROWTH = 0.5
#: A declined re-plan is also tried again once the probe's spread over the running
#: plan's ranks has narrowed to this share of what it was judged on (more probe windows
#: behind every shard's median): a decline on an early, noisy probe is not final.
NARROWED = 0.7
#: Sampled steps every rank must have behind a summary before the loop trusts it.
MIN_SAMPLES = 3
#: Probe windows every shard must have behind its live cost before the loop re-plans.
MIN_PROBES = 3
#: A reshard's cost before one was measured: the current workers' own start (Job
#: created → first step), else this.
DEFAULT_RESHARD_SECONDS = 120.0
HOUR = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class LoopInput:
    """What :func:`step` reads."""

    settings: OnImbalanceSpec
    record: LoopRecord | None
    #: Rank 0's live summary (``None``: none yet), or why it cannot be read.
    live: LiveSummary | None
    live_problem: str | None
    #: The worker Job, and the plan its pods mount (``None``: not found).
    worker: JobState | None
    running: PlanRecord | None
    #: The inputs hash of the plan for the declared specs at the current placement.
    base_inputs: str
    #: The live re-plan named by ``record.live_plan`` once it exists, or why it failed.
    live_plan: PlanRecord | None
    #: Why the live re-plan failed: (reason, message); ``NoBetterPlan`` is a decline.
    live_plan_failure: tuple[str, str] | None
    #: Names of the worker Job's pods, to name them when the data is missing.
    pods: Sequence[str]
    generation: int
    now: datetime.datetime
    #: The job checkpoints (``template.checkpointDir``): without it a reshard loses steps.
    checkpoints: bool = True
    #: How long running workers may go without a summary before that is a problem.
    live_grace_seconds: float = 180.0


@dataclass(frozen=True)
class Replan:
    """Re-plan the running plan from ``live``; the result is named ``inputs_hash``."""

    base: PlanRecord
    live: LiveSummary
    inputs_hash: str
    #: Measured ranks of other plans the job ran: evidence for the live prices.
    history: tuple[RankPoint, ...] = ()


@dataclass(frozen=True)
class LoopOutcome:
    record: LoopRecord | None = None
    conditions: tuple[Condition, ...] = ()
    replan: Replan | None = None
    #: The inputs hash of the plan the workers should run instead of the declared one.
    use_plan: str | None = None
    #: A decision to count (``shardwise_imbalance_decisions_total``) and its gain.
    decision: str | None = None
    gain: float | None = None
    requeue_after: float | None = None
    #: ``status.live``.
    live_fields: Mapping[str, Any] = field(default_factory=dict)


def _trusted(live: LiveSummary | None, plan_hash: str) -> LiveSummary | None:
    """The summary, when it is complete, for ``plan_hash``, with enough samples."""
    if live is None or live.plan_hash != plan_hash or not live.complete():
        return None
    if min(r.samples for r in live.measured()) < MIN_SAMPLES:
        return None
    return live


def _reshard_cost(record: LoopRecord, inp: LoopInput, live: LiveSummary) -> float:
    """Seconds a reshard costs: the last one measured, else this run's own start."""
    if record.reshard_seconds > 0:
        return record.reshard_seconds
    first = parse_time(live.first_step_at)
    created = inp.worker.ref.created if inp.worker is not None else None
    if first is not None and created is not None and first > created:
        return (first - created).total_seconds() + live.resume_seconds
    return DEFAULT_RESHARD_SECONDS


def _cond(status: bool, reason: str, message: str) -> Condition:
    return Condition(BALANCED, status, reason, message)


def _missing(inp: LoopInput) -> Condition | None:
    """Running workers that have not reported for longer than the grace: say who."""
    wj = inp.worker
    if wj is None or wj.complete or wj.failure is not None or wj.ref.deleting or wj.ready < 1:
        return None
    since = wj.started_at or wj.ref.created
    if since is None or (inp.now - since).total_seconds() < inp.live_grace_seconds:
        return None
    pods = ", ".join(sorted(inp.pods)[:4]) or wj.ref.name
    if inp.live_problem:
        why = inp.live_problem
    elif inp.live is None:
        why = (
            "rank 0 has written no live summary; check its log for the warning: the "
            "worker's service account needs get/create/patch on configmaps"
        )
    elif inp.running is not None and inp.live.plan_hash != inp.running.plan_hash:
        why = f"the live summary is for plan {inp.live.plan_hash[:8]}, not the running one"
    else:
        return None  # a summary for this plan, still filling: no problem yet
    return Condition(LIVE_COSTS, False, R_NO_LIVE, f"no live costs from pods {pods}: {why}")


def step(inp: LoopInput) -> LoopOutcome:
    """The loop's decision in this pass; the rules are in the module docstring. Once a
    reshard of the loop's has moved the workers, ``Resharding`` stays False with reason
    ``Resharded`` saying why (:func:`resharded`), as a node reshard ends."""
    out = _step(inp)
    ended = resharded(out.record)
    if ended is None or any(c.type == "Resharding" for c in out.conditions):
        return out
    return replace(out, conditions=(*out.conditions, ended))


def _step(inp: LoopInput) -> LoopOutcome:
    s = inp.settings
    rec = inp.record or LoopRecord(base_plan=inp.base_inputs, generation=inp.generation)
    if rec.base_plan != inp.base_inputs or rec.generation != inp.generation:
        # The declaration, the size or the spec changed: the live plan no longer applies.
        rec = LoopRecord(
            base_plan=inp.base_inputs,
            generation=inp.generation,
            reshards=rec.reshards,
            reshard_seconds=rec.reshard_seconds,
        )
    use = rec.running_plan or None
    running_hash = inp.running.plan_hash if inp.running is not None else ""
    fields: dict[str, Any] = {}
    conds: list[Condition] = []
    if inp.live is not None and inp.running is not None and inp.live.plan_hash == running_hash:
        fields = live_fields(inp.live, inp.running)
        conds.append(Condition(LIVE_COSTS, True, R_LIVE, measured_text(inp.live)))
    else:
        missing = _missing(inp)
        if missing is not None:
            conds.append(missing)
    out = LoopOutcome(record=rec, conditions=tuple(conds), use_plan=use, live_fields=fields)
    if not s.enabled:
        # Off (or turned off): the record stays as it is, and so does an adopted plan
        # (going back to the declared one would be a reshard of its own).
        return replace(out, record=inp.record)
    if not inp.checkpoints:
        msg = "resharding.onImbalance needs template.checkpointDir: a reshard would lose steps"
        return replace(out, conditions=(*conds, _cond(False, R_PLAN_FAILED, msg)))
    wj = inp.worker
    idle = wj is None or wj.complete or wj.failure is not None or inp.running is None
    if idle and rec.state != RESHARDING:
        return out
    live = _trusted(inp.live, running_hash)
    nxt = _advance(inp, rec, live, running_hash)
    return replace(
        nxt,
        conditions=(*conds, *nxt.conditions),
        live_fields=fields,
        use_plan=(nxt.record.running_plan or None) if nxt.record else None,
    )


def _advance(
    inp: LoopInput, rec: LoopRecord, live: LiveSummary | None, running_hash: str
) -> LoopOutcome:
    s, now = inp.settings, inp.now
    if rec.state == STOPPED:
        return LoopOutcome(record=rec, conditions=(_cond(False, R_NOT_DELIVERED, rec.message),))
    if rec.state == RESHARDING:
        if inp.live_plan is not None and running_hash == inp.live_plan.plan_hash:
            rec = replace(rec, state=VERIFYING)
        else:
            msg = f"moving the workers to the live re-plan: {rec.message}"
            return LoopOutcome(
                record=rec,
                conditions=(
                    _cond(False, R_RESHARDING, rec.message),
                    Condition("Resharding", True, R_RESHARDING, msg),
                ),
            )
    if rec.state == VERIFYING:
        return _verify(inp, rec, live)
    if live is None:
        keep = _cond(False, R_SUSTAINING, rec.message) if rec.state == SUSTAINED else None
        return LoopOutcome(record=rec, conditions=(keep,) if keep else ())
    imb = live.imbalance() or 1.0
    max_ms = live.max_compute_ms()
    if rec.state == DECLINED:
        grown = _grown(inp, rec, imb)
        if grown is not None and not _narrowed(inp, rec, live, imb):
            return grown
        rec = replace(rec, state=SUSTAINED)  # sustained since rec.since: re-plan now
    if rec.state == REPLANNING:
        return _judge(inp, rec, live)
    if imb <= s.threshold:
        msg = f"measured imbalance {imb:.3f} ≤ threshold {s.threshold:g}"
        return LoopOutcome(
            record=replace(rec, state=WATCHING, since=None, message=msg),
            conditions=(_cond(True, R_BALANCED, msg),),
        )
    since = rec.since if rec.state == SUSTAINED and rec.since is not None else now
    waited = (now - since).total_seconds()
    if waited < s.sustain_seconds:
        msg = (
            f"measured imbalance {imb:.3f} > threshold {s.threshold:g} for {waited:.0f} s "
            f"of {s.sustain_seconds} s (max-rank compute {max_ms:.2f} ms)"
        )
        return LoopOutcome(
            record=replace(rec, state=SUSTAINED, since=since, message=msg),
            conditions=(_cond(False, R_SUSTAINING, msg),),
            requeue_after=s.sustain_seconds - waited,
        )
    recent = tuple(t for t in rec.reshards if now - t < HOUR)
    if len(recent) >= s.max_per_hour:
        wait = (min(recent) + HOUR - now).total_seconds()
        msg = (
            f"imbalance {imb:.3f} sustained, but {len(recent)} reshard(s) started in the "
            f"last hour (maxPerHour {s.max_per_hour}); next possible in {wait:.0f} s"
        )
        return LoopOutcome(
            record=replace(rec, state=SUSTAINED, since=since, reshards=recent, message=msg),
            conditions=(_cond(False, R_RATE_LIMITED, msg),),
            decision="rate_limited",
            requeue_after=wait,
        )
    if live.steps - live.step <= 0:
        msg = "the run is at its last step: nothing left to gain"
        no_steps = (_cond(False, R_NO_STEPS, msg),)
        return LoopOutcome(record=replace(rec, message=msg), conditions=no_steps)
    got, want = live.probed(MIN_PROBES)
    if got < want:  # re-plan on every shard's own cost, not on a guess for some
        msg = (
            f"measured imbalance {imb:.3f} > {s.threshold:g} for {waited:.0f} s; waiting for "
            f"the per-shard probe: {got} of {want} shards timed {MIN_PROBES}+ times"
        )
        return LoopOutcome(
            record=replace(rec, state=SUSTAINED, since=since, reshards=recent, message=msg),
            conditions=(_cond(False, R_SUSTAINING, msg),),
        )
    assert inp.running is not None
    evidence = with_evidence(rec.evidence, live)
    target = live_inputs_hash(inp.base_inputs, live, _history(evidence, live))
    learnt = (
        f" and {len(_history(evidence, live))} measured ranks of earlier plans"
        if _history(evidence, live)
        else ""
    )
    msg = (
        f"measured imbalance {imb:.3f} > {s.threshold:g} for {waited:.0f} s (max-rank "
        f"compute {max_ms:.2f} ms): re-planning from the live per-shard costs{learnt}"
    )
    rec = replace(
        rec, state=REPLANNING, since=since, live_plan=target, from_max_ms=max_ms,
        from_imbalance=imb, reshards=recent, message=msg, evidence=evidence,
    )  # fmt: skip
    return _judge(inp, rec, live)


def _history(evidence: tuple[RankPoint, ...], live: LiveSummary) -> tuple[RankPoint, ...]:
    """The evidence of plans other than the one ``live`` measures."""
    return tuple(p for p in evidence if p.plan != live.plan_hash[:12])


def _grown(inp: LoopInput, rec: LoopRecord, imb: float) -> LoopOutcome | None:
    """A declined loop: ``None`` once the measured excess imbalance has stayed
    :data:`RETRY_GROWTH` above the declined one in every summary for ``sustainSeconds``
    (the data drifted further: re-plan), else the decline, standing. One summary above
    the bar is not drift: on a shared machine single summaries swing by more, and a
    retry on each swing would re-plan (and decline) over and over."""
    s, now = inp.settings, inp.now
    bar = 1.0 + (rec.from_imbalance - 1.0) * (1.0 + RETRY_GROWTH)
    reason, text = _why(rec)
    if imb < bar or imb <= s.threshold:
        kept = replace(rec, since=None)
        return LoopOutcome(record=kept, conditions=(_cond(imb <= s.threshold, reason, text),))
    since = rec.since if rec.since is not None else now
    waited = (now - since).total_seconds()
    if waited >= s.sustain_seconds:
        return None
    note = (
        f"{text}; measured imbalance {imb:.3f} ≥ {bar:.3f} (grown by "
        f"{100 * RETRY_GROWTH:.0f} %) for {waited:.0f} s of {s.sustain_seconds} s"
    )
    return LoopOutcome(
        record=replace(rec, since=since),
        conditions=(_cond(False, reason, note),),
        requeue_after=s.sustain_seconds - waited,
    )


def _probe_spread(points: Sequence[RankPoint]) -> float:
    return math.sqrt(sum(p.probe_spread**2 for p in points))


def _narrowed(inp: LoopInput, rec: LoopRecord, live: LiveSummary, imb: float) -> bool:
    """A declined re-plan, the imbalance still above the threshold, and the probe's
    spread over the running plan's ranks narrowed to :data:`NARROWED` of what the
    declined re-plan saw: re-plan on the new evidence. Once every shard's probe holds
    its full window the spread stops narrowing, and so do the re-plans."""
    if imb <= inp.settings.threshold or rec.message.startswith(R_PLAN_FAILED + ":"):
        return False
    mine = live.plan_hash[:12]
    before = _probe_spread([p for p in rec.evidence if p.plan == mine])
    now = live.points(MIN_PROBES)
    if before <= 0 or len(now) != len([p for p in rec.evidence if p.plan == mine]):
        return False
    return _probe_spread(now) <= NARROWED * before


def _why(rec: LoopRecord) -> tuple[str, str]:
    """A declined record's reason and message, from its message's decision."""
    return (rec.message.split(":", 1)[0] or R_GAIN_TOO_SMALL, rec.message.split(":", 1)[-1].strip())


def _judge(inp: LoopInput, rec: LoopRecord, live: LiveSummary) -> LoopOutcome:
    """The re-plan exists (or is made now): decline, or reshard."""
    s, now = inp.settings, inp.now
    assert inp.running is not None
    if inp.live_plan is None or inp.live_plan.inputs_hash != rec.live_plan:
        if inp.live_plan_failure is not None:
            reason, why = inp.live_plan_failure
            if reason == NO_BETTER_PLAN:
                msg = f"{R_GAIN_TOO_SMALL}: {why}: keeping the running plan"
                return _decline(rec, msg, "declined_gain", 0.0)
            msg = f"{R_PLAN_FAILED}: the live re-plan failed: {why}"
            return _decline(rec, msg, "plan_failed", 0.0)
        return LoopOutcome(
            record=rec,
            conditions=(_cond(False, R_REPLANNING, rec.message),),
            replan=Replan(inp.running, live, rec.live_plan, _history(rec.evidence, live)),
        )
    info = inp.live_plan.summary.get("live") or {}
    predicted = float(info.get("predictedMaxMs") or 0.0)
    from_ms = float(info.get("fromMaxMs") or rec.from_max_ms)
    gain = from_ms / predicted - 1.0 if predicted > 0 else 0.0
    rec = replace(
        rec, predicted_max_ms=predicted, from_max_ms=from_ms, predicted_gain=gain,
        from_imbalance=float(info.get("fromImbalance") or rec.from_imbalance or 1.0),
        predicted_imbalance=float(info.get("predictedImbalance") or 1.0),
    )  # fmt: skip
    moves = str(info.get("describe") or f"{info.get('moves', '?')} shard move(s)")
    unsure = float(info.get("uncertainty") or 0.0)
    rec = replace(rec, uncertainty=unsure)
    if gain < s.min_gain:
        msg = (
            f"{R_GAIN_TOO_SMALL}: the live re-plan ({moves}) predicts {100 * gain:.1f} % "
            f"gain < minGain {100 * s.min_gain:.0f} %: keeping the running plan"
        )
        return _decline(rec, msg, "declined_gain", gain)
    if gain <= unsure:
        fit = str(info.get("fit") or "")
        msg = (
            f"{R_UNCERTAIN}: the live re-plan ({moves}) predicts {100 * gain:.1f} % gain, "
            f"within its uncertainty of {100 * unsure:.1f} % ({fit}): keeping the running "
            "plan until the evidence narrows it"
        )
        # counted as declined_gain: the gain it can vouch for is below the bar
        return _decline(rec, msg, "declined_gain", gain)
    remaining = max(0, live.steps - live.step)
    saved = (from_ms - predicted) / 1e3 * remaining
    cost = _reshard_cost(rec, inp, live)
    if saved < PAYBACK * cost:
        msg = (
            f"{R_DOES_NOT_PAY}: the live re-plan ({moves}) would save {saved:.0f} s over the "
            f"{remaining} remaining steps, < {PAYBACK:g} x the reshard's cost {cost:.0f} s"
        )
        return _decline(rec, msg, "declined_cost", gain)
    msg = (
        f"{moves}: saves ~{saved:.0f} s over the {remaining} remaining steps, for a "
        f"reshard of ~{cost:.0f} s"
    )
    rec = replace(
        rec, state=RESHARDING, adopted=True, running_plan=rec.live_plan, started_at=now,
        reshards=(*rec.reshards, now), message=msg, verify_samples=(),
        attempts=rec.attempts + 1,
    )  # fmt: skip
    going = Condition("Resharding", True, R_RESHARDING, f"resharding for imbalance: {msg}")
    return LoopOutcome(
        record=rec,
        conditions=(_cond(False, R_RESHARDING, msg), going),
        decision="resharded",
        gain=gain,
    )


def _decline(rec: LoopRecord, msg: str, decision: str, gain: float) -> LoopOutcome:
    reason, text = msg.split(": ", 1)
    return LoopOutcome(
        record=replace(
            rec, state=DECLINED, adopted=bool(rec.running_plan), since=None, message=msg
        ),
        conditions=(_cond(False, reason, text),),
        decision=decision,
        gain=gain,
    )


def _verify(inp: LoopInput, rec: LoopRecord, live: LiveSummary | None) -> LoopOutcome:
    """The workers run the live plan: did it deliver? (:mod:`.loop_verdict` says)."""
    done, cond, decision = verify(inp.settings.threshold, rec, live)
    return LoopOutcome(record=done, conditions=(cond,), decision=decision)

"""The closed loop's pure decision (:mod:`shardwise.operator.decide.imbalance`,
docs/resharding.md): measure, sustain, re-plan, decide, reshard, verify. The loop on
kopf's engine with real torchrun workers is in tests/test_e2e_loop_scenarios.py."""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from operator_builders import observed

from shardwise.operator.cluster.summaries import ChildRef, JobState, PlanRecord, format_time
from shardwise.operator.crd import OnImbalanceSpec
from shardwise.operator.decide import imbalance as im
from shardwise.operator.decide import live_status as ls
from shardwise.operator.decide import resharding as rs
from shardwise.operator.decide.lifecycle import Condition, build_status, transition_events
from shardwise.operator.decide.reconcile import Decision, add_loop_conditions
from shardwise.planner.live.summary import LiveSummary, RankCost

T0 = datetime.datetime(2026, 11, 26, 12, tzinfo=datetime.UTC)
ON = OnImbalanceSpec(enabled=True, threshold=1.2, min_gain=0.1, max_per_hour=2, sustain_seconds=60)
BASE = "base-inputs"


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def plan(name: str, plan_hash: str, inputs: str = BASE, **summary: Any) -> PlanRecord:
    ref = ChildRef("ConfigMap", name, "ml", f"uid-{name}", "1")
    return PlanRecord(ref, inputs, {"hash": plan_hash, "predictedMaxSeconds": 0.01, **summary})


RUNNING = plan("dj-plan-aaaa", "a" * 64)


def worker(created: float = -600) -> JobState:
    ref = ChildRef("Job", "dj-workers", "ml", "uid-w", "1", annotations={}, created=at(created))
    return JobState(ref, active=2, ready=2, started_at=at(created))


def summary(
    compute: list[float],
    *,
    plan_hash: str = "a" * 64,
    step: int = 100,
    steps: int = 10_000,
    samples: int = 20,
    written: float = 0,
    first_step: float = -590,
) -> LiveSummary:
    return LiveSummary(
        planHash=plan_hash,
        worldSize=len(compute),
        batchSizePerRank=64,
        step=step,
        steps=steps,
        firstStepAt=format_time(at(first_step)),
        writtenAt=format_time(at(written)),
        ranks=[
            RankCost(
                rank=i,
                pod=f"dj-workers-{i}",
                samples=samples,
                fwdComputeMs=c / 3,
                bwdComputeMs=2 * c / 3,
                fwdCommMs=1.0,
            )
            for i, c in enumerate(compute)
        ],
    )


def loop(
    live: LiveSummary | None, now: float, record: ls.LoopRecord | None = None, **kw: Any
) -> im.LoopOutcome:
    args: dict[str, Any] = dict(
        settings=ON, record=record, live=live, live_problem=None, worker=worker(),
        running=RUNNING, base_inputs=BASE, live_plan=None, live_plan_failure=None,
        pods=["dj-workers-0-x", "dj-workers-1-y"], generation=1, now=at(now),
    )  # fmt: skip
    args.update(kw)
    return im.step(im.LoopInput(**args))


def reasons(out: im.LoopOutcome) -> dict[str, str]:
    return {c.type: c.reason for c in out.conditions}


def roundtrip(out: im.LoopOutcome) -> ls.LoopRecord:
    """The record as a restarted operator reads it back from status."""
    assert out.record is not None
    back = ls.LoopRecord.from_status(json.loads(json.dumps(out.record.to_status())))
    assert back is not None
    return back


def test_balanced_job_is_watched_and_status_shows_measured_against_predicted() -> None:
    out = loop(summary([10.0, 9.5]), 0)
    assert reasons(out) == {"LiveCosts": im.R_LIVE, "Balanced": im.R_BALANCED}
    assert out.replan is None and out.use_plan is None
    live = dict(out.live_fields)
    assert live["measuredMaxComputeMilliseconds"] == 10.0
    assert live["measuredImbalance"] == round(10 / 9.75, 4)
    assert live["predictedMaxMilliseconds"] == 10.0  # the plan's 0.01 s
    assert live["predictedOverMeasured"] == round(10 / 11, 3)  # total = compute + 1 ms comm
    assert live["straggler"] == "rank 0 (dj-workers-0)"


def test_a_sustained_imbalance_replans_only_after_the_sustain_period() -> None:
    first = loop(summary([20.0, 10.0]), 0)
    assert reasons(first)["Balanced"] == im.R_SUSTAINING and first.replan is None
    assert first.requeue_after == 60
    mid = loop(summary([20.0, 10.0], written=30), 30, roundtrip(first))
    assert mid.replan is None and roundtrip(mid).since == at(0)  # the clock survives
    due = loop(summary([20.0, 10.0], written=61), 61, roundtrip(mid))
    assert due.replan is not None and reasons(due)["Balanced"] == im.R_REPLANNING
    assert due.replan.base == RUNNING and due.replan.inputs_hash == roundtrip(due).live_plan


def test_one_balanced_summary_resets_the_clock_so_a_spike_never_reshards() -> None:
    first = loop(summary([20.0, 10.0]), 0)
    calm = loop(summary([10.0, 10.0], written=30), 30, roundtrip(first))
    assert reasons(calm)["Balanced"] == im.R_BALANCED and roundtrip(calm).since is None
    again = loop(summary([20.0, 10.0], written=70), 70, roundtrip(calm))
    assert again.replan is None and roundtrip(again).since == at(70)


def test_partial_or_thin_or_stale_summaries_are_not_trusted() -> None:
    first = loop(summary([20.0, 10.0]), 0)
    rec = roundtrip(first)
    thin = loop(summary([20.0, 10.0], samples=1, written=90), 90, rec)
    other = loop(summary([20.0, 10.0], plan_hash="b" * 64, written=90), 90, rec)
    for out in (thin, other):
        assert out.replan is None and roundtrip(out).state == ls.SUSTAINED


def _replanning(gain: float, *, steps: int = 10_000) -> tuple[ls.LoopRecord, PlanRecord]:
    first = roundtrip(loop(summary([20.0, 10.0], steps=steps), 0))
    due = loop(summary([20.0, 10.0], steps=steps), 61, first)
    rec = roundtrip(due)
    made = plan(
        "dj-plan-bbbb", "b" * 64, rec.live_plan,
        live={"fromMaxMs": 20.0, "predictedMaxMs": 20.0 / (1 + gain), "moves": 2,
              "fromImbalance": 20 / 15, "predictedImbalance": 1.0,
              "describe": "moving 2 shards"},
    )  # fmt: skip
    return rec, made


def test_a_paying_replan_reshards_and_the_workers_run_it_from_then_on() -> None:
    rec, made = _replanning(0.5)
    out = loop(summary([20.0, 10.0], written=62), 62, rec, live_plan=made)
    assert reasons(out)["Resharding"] == im.R_RESHARDING and out.decision == "resharded"
    assert out.use_plan == rec.live_plan and out.gain == 0.5
    after = roundtrip(out)
    assert after.adopted and after.reshards == (at(62),) and after.started_at == at(62)
    # the new workers run it: verifying, then the first complete summary measures it
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    wait = loop(None, 120, after, running=moved, live_plan=moved)
    assert reasons(wait)["Balanced"] == im.R_VERIFYING and wait.use_plan == rec.live_plan
    done = _verified(roundtrip(wait), moved, [[14.0, 13.0], [14.5, 12.5], [13.8, 13.1]])
    assert reasons(done)["Balanced"] == im.R_DELIVERED, done.conditions
    back = roundtrip(done)
    assert back.state == ls.WATCHING and back.adopted and back.reshard_seconds == 38
    assert back.measured_max_ms == 14.0 and back.verdict.startswith("the reshard delivered")
    assert len(back.verify_samples) == 3 and "median of 3 summaries" in back.verdict


def test_a_reshard_for_imbalance_ends_with_a_resharded_event_saying_why() -> None:
    """As a node reshard ends: ``Resharding`` goes False with reason ``Resharded`` once
    the workers run the live re-plan (one Event, naming the imbalance and its figures),
    and stays so, its message the verdict once judged (no Event: same reason)."""
    rec, made = _replanning(0.5)
    going = loop(summary([20.0, 10.0], written=62), 62, rec, live_plan=made)
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    wait = loop(None, 120, roundtrip(going), running=moved, live_plan=moved)
    ended = next(c for c in wait.conditions if c.type == "Resharding")
    assert (ended.status, ended.reason) == (False, "Resharded")
    assert ended.message.startswith("resharded for imbalance: measured max/mean 1.333")
    assert "max-rank compute 20.00 → 13.33 ms predicted (50.0 % gain)" in ended.message
    assert "moving 2 shards" in ended.message
    done = _verified(roundtrip(wait), moved, [[14.0, 13.0], [14.5, 12.5], [13.8, 13.1]])
    after = next(c for c in done.conditions if c.type == "Resharding")
    assert after.reason == "Resharded" and "the reshard delivered" in after.message
    watched = loop(summary([14.0, 13.0], plan_hash="b" * 64, written=300), 300,
                   roundtrip(done), running=moved, live_plan=moved)  # fmt: skip
    assert reasons(watched)["Resharding"] == "Resharded"  # kept, not re-announced
    said, status = [], None
    for out in (going, wait, done, watched):
        new = build_status(status, list(out.conditions), 1, at(0))
        said += [e for e in transition_events(status, new) if e.message.startswith("Resharding=")]
        status = new
    assert [(e.type, e.reason) for e in said] == [
        ("Normal", im.R_RESHARDING),
        ("Normal", "Resharded"),
    ]
    assert said[1].message.startswith("Resharding=False: resharded for imbalance")
    # before any reshard, and while one is under way, no ending is stated
    assert im.resharded(rec) is None and im.resharded(roundtrip(going)) is None


def _verified(
    rec: ls.LoopRecord,
    moved: PlanRecord,
    computes: list[list[float]],
    *,
    plan_hash: str = "b" * 64,
    probe: bool = False,
) -> im.LoopOutcome:
    """The re-planned workers' summaries, 10 s apart from t=200, each read back from
    status (each but the last read twice: a summary seen again is not a new one)."""
    out = im.LoopOutcome()
    for k, compute in enumerate(computes):
        s = summary(compute, plan_hash=plan_hash, first_step=100, written=200 + 10 * k)
        s = probed(s) if probe else s
        for again in range(2 if k < len(computes) - 1 else 1):
            out = loop(s, 200 + 10 * k + again, rec, running=moved, live_plan=moved)
            rec = roundtrip(out)
            if k < len(computes) - 1:
                assert reasons(out)["Balanced"] == im.R_VERIFYING, out.conditions
                assert len(rec.verify_samples) == k + 1
    return out


def test_one_noisy_summary_does_not_decide_the_verdict() -> None:
    """A single summary of a balanced plan can read high on a loaded machine: the verdict
    is the median of three, so the loop neither stops on one spike nor passes on one dip."""
    rec, made = _replanning(0.5)  # from 20/15 = 1.333, predicted 1.0
    out = roundtrip(loop(summary([20.0, 10.0]), 62, rec, live_plan=made))
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    spike = _verified(out, moved, [[16.0, 12.0], [13.5, 13.0], [13.4, 13.1]])  # 1.14 first
    assert reasons(spike)["Balanced"] == im.R_DELIVERED, spike.conditions
    dip = _verified(out, moved, [[13.5, 13.0], [20.0, 11.0], [19.5, 11.5]])  # 1.26
    assert reasons(dip)["Balanced"] == im.R_NOT_DELIVERED, dip.conditions


def test_a_reshard_that_balanced_the_job_delivered_short_of_its_prediction() -> None:
    """From 1.333 (predicted 1.0) to 1.18: 0.15 of the predicted 0.33 removed, less than
    half, but under the 1.2 threshold: balanced by the user's own measure, so delivered,
    and the loop watches on."""
    rec, made = _replanning(0.5)  # from 20/15 = 1.333, predicted 1.0
    out = roundtrip(loop(summary([20.0, 10.0]), 62, rec, live_plan=made))
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    near = _verified(out, moved, [[16.2, 11.3], [16.3, 11.3], [16.1, 11.2]])  # 1.18
    assert reasons(near)["Balanced"] == im.R_DELIVERED, near.conditions
    balanced = next(c for c in near.conditions if c.type == "Balanced")
    assert balanced.status and roundtrip(near).state == ls.WATCHING


def probed(live: LiveSummary) -> LiveSummary:
    """``live`` with every rank's probe done: two shards each, half its compute each."""
    from shardwise.planner.live.summary import ShardCost

    ranks = [r.model_copy(update={"probe_shards": 2, "probe_empty_ms": 0.5}) for r in live.ranks]
    shards = [
        ShardCost(table=f"t{r.rank}{k}", rank=r.rank, cols=16, ms=r.compute_ms / 2, samples=5)
        for r in live.ranks
        for k in "ab"
    ]
    return live.model_copy(update={"ranks": ranks, "shards": shards})


def _made(name: str, h: str, inputs: str, gain: float, **live: Any) -> PlanRecord:
    info = {"fromMaxMs": 20.0, "predictedMaxMs": 20.0 / (1 + gain), "moves": 2,
            "fromImbalance": 20 / 15, "predictedImbalance": 1.0, "describe": "moving 2 shards",
            **live}  # fmt: skip
    return plan(name, h * 64, inputs, live=info)


def test_a_reshard_that_did_not_deliver_is_learnt_from_once_then_the_loop_stops() -> None:
    """The first reshard that does not deliver is evidence: its ranks join the first
    plan's, and the loop re-plans from both once the imbalance is sustained again,
    resharding once more only if that re-plan still pays. A second that does not
    deliver stops the loop for good: it never oscillates."""
    first = roundtrip(loop(probed(summary([20.0, 10.0])), 0))
    rec = roundtrip(loop(probed(summary([20.0, 10.0])), 61, first))
    assert [p.plan for p in rec.evidence] == ["a" * 12] * 2
    made = _made("dj-plan-bbbb", "b", rec.live_plan, 0.5)
    out = roundtrip(loop(probed(summary([20.0, 10.0])), 62, rec, live_plan=made))
    assert out.attempts == 1 and out.running_plan == rec.live_plan
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    bad = [[19.0, 12.0], [18.0, 12.0], [19.5, 12.5]]
    learnt = _verified(out, moved, bad, probe=True)
    assert reasons(learnt)["Balanced"] == im.R_NOT_DELIVERED and learnt.decision is None
    back = roundtrip(learnt)
    assert back.state == ls.WATCHING and "learning from it" in back.verdict
    assert learnt.use_plan == rec.live_plan  # the workers stay on what they run
    assert sorted({p.plan for p in back.evidence}) == ["a" * 12, "b" * 12]
    # sustained again on the plan that did not deliver: re-planned with the first's ranks
    worse = probed(summary([19.5, 12.5], plan_hash="b" * 64, written=300, steps=100_000))
    again = roundtrip(loop(worse, 300, back, running=moved, live_plan=moved))
    due = loop(worse, 361, again, running=moved, live_plan=moved)
    assert due.replan is not None and due.replan.base == moved
    assert [p.plan for p in due.replan.history] == ["a" * 12] * 2
    assert due.use_plan == rec.live_plan
    rec2 = roundtrip(due)
    made2 = _made("dj-plan-cccc", "c", rec2.live_plan, 0.4)
    going = roundtrip(loop(worse, 362, rec2, running=moved, live_plan=made2))
    assert going.state == ls.RESHARDING and going.attempts == 2
    assert going.running_plan == rec2.live_plan != rec.live_plan
    moved2 = plan("dj-plan-cccc", "c" * 64, rec2.live_plan, live=made2.summary["live"])
    stop = _verified(going, moved2, bad, plan_hash="c" * 64)
    assert reasons(stop)["Balanced"] == im.R_NOT_DELIVERED and stop.decision == "stopped"
    stopped = roundtrip(stop)
    assert stopped.state == ls.STOPPED and "the loop stops" in stopped.message
    # however long the imbalance lasts afterwards, nothing more happens
    later = loop(summary([30.0, 10.0], plan_hash="c" * 64, written=5000), 5000, stopped,
                 running=moved2, live_plan=moved2)  # fmt: skip
    assert later.replan is None and reasons(later)["Balanced"] == im.R_NOT_DELIVERED
    assert later.use_plan == rec2.live_plan  # and it does not flip back either


def test_a_second_episode_keeps_the_adopted_plan_running_while_it_replans() -> None:
    """After a reshard the loop adopted, a new imbalance on the adopted plan re-plans
    from it: the workers keep running it (the record's runningPlan) while the loop
    sustains, re-plans and declines; the re-plan target never replaces it unadopted."""
    rec, made = _replanning(0.5)
    going = roundtrip(loop(summary([20.0, 10.0], written=62), 62, rec, live_plan=made))
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    wait = roundtrip(loop(None, 120, going, running=moved, live_plan=moved))
    done = roundtrip(_verified(wait, moved, [[14.0, 13.0], [14.5, 12.5], [13.8, 13.1]]))
    assert done.state == ls.WATCHING and done.running_plan == rec.live_plan
    drift = summary([24.0, 12.0], plan_hash="b" * 64, written=1000)
    seen = []
    out = loop(drift, 1000, done, running=moved, live_plan=moved)
    seen.append(out)
    out = loop(drift, 1061, roundtrip(out), running=moved, live_plan=moved)
    seen.append(out)
    assert out.replan is not None and out.replan.base == moved
    target = roundtrip(out).live_plan
    assert target != rec.live_plan
    small = _made("dj-plan-dddd", "d", target, 0.02)
    out = loop(drift, 1062, roundtrip(out), running=moved, live_plan=small)
    seen.append(out)
    assert reasons(out)["Balanced"] == im.R_GAIN_TOO_SMALL
    assert [o.use_plan for o in seen] == [rec.live_plan] * 3
    kept = roundtrip(out)
    assert kept.running_plan == rec.live_plan and kept.adopted


def test_a_gain_within_its_uncertainty_is_declined_with_what_the_fit_could_not_check() -> None:
    """A re-plan predicting 20 % whose prices leave it uncertain by 30 % (two ranks
    could not tell a rank's fixed part from its shards' share) does not reshard; the
    reason says so with the figures, and the running plan stays."""
    rec, _ = _replanning(0.2)
    fit = "unchecked: every measured rank holds 4 shards"
    made = _made("dj-plan-bbbb", "b", rec.live_plan, 0.2, uncertainty=0.3, fit=fit)
    out = loop(summary([20.0, 10.0]), 62, rec, live_plan=made)
    assert reasons(out)["Balanced"] == im.R_UNCERTAIN and out.decision == "declined_gain"
    msg = out.conditions[-1].message
    assert "20.0 % gain, within its uncertainty of 30.0 %" in msg and fit in msg
    assert out.use_plan is None and roundtrip(out).uncertainty == 0.3
    sure = _made("dj-plan-bbbb", "b", rec.live_plan, 0.2, uncertainty=0.1)
    assert loop(summary([20.0, 10.0]), 62, rec, live_plan=sure).decision == "resharded"


def test_the_loop_record_keeps_the_running_plan_and_evidence_across_restarts() -> None:
    from shardwise.planner.live.summary import RankPoint

    point = RankPoint(plan="a" * 12, rank=1, shards=4, probe_ms=0.85, compute_ms=3.07)
    rec = ls.LoopRecord(state=ls.REPLANNING, live_plan="new", running_plan="old",
                        adopted=True, attempts=1, uncertainty=0.12, evidence=(point,))  # fmt: skip
    back = ls.LoopRecord.from_status(json.loads(json.dumps(rec.to_status())))
    assert back == rec
    # a record written before runningPlan: an adopted livePlan is the running one
    old = ls.LoopRecord.from_status({"state": "Watching", "adopted": True, "livePlan": "x"})
    assert old is not None and old.running_plan == "x"


def test_a_small_gain_is_declined_once_and_stays_declined() -> None:
    rec, made = _replanning(0.05)
    out = loop(summary([20.0, 10.0]), 62, rec, live_plan=made)
    assert reasons(out)["Balanced"] == im.R_GAIN_TOO_SMALL and out.decision == "declined_gain"
    assert out.use_plan is None and "5.0 %" in out.conditions[-1].message
    later = loop(summary([20.5, 10.0], written=900), 900, roundtrip(out))
    assert later.replan is None and reasons(later)["Balanced"] == im.R_GAIN_TOO_SMALL
    # one summary grown by half is noise: the decline stands, the growth's clock starts
    swing = loop(summary([31.0, 10.0], written=960), 960, roundtrip(later))  # 1.33 → 1.51
    assert reasons(swing)["Balanced"] == im.R_GAIN_TOO_SMALL and swing.replan is None
    assert "for 0 s of 60 s" in swing.conditions[-1].message
    assert roundtrip(swing).state == ls.DECLINED and swing.requeue_after == 60
    # a summary below the bar resets that clock
    back = loop(summary([22.0, 10.0], written=990), 990, roundtrip(swing))
    assert roundtrip(back).since is None and reasons(back)["Balanced"] == im.R_GAIN_TOO_SMALL
    grown = loop(summary([31.0, 10.0], written=1000), 1000, roundtrip(back))
    grown = loop(summary([31.5, 10.0], written=1040), 1040, roundtrip(grown))
    assert grown.replan is None and roundtrip(grown).since == at(1000)
    # grown in every summary for sustainSeconds: the data drifted further, re-plan
    worse = loop(summary([31.0, 10.0], written=1061), 1061, roundtrip(grown))
    assert worse.replan is not None and reasons(worse)["Balanced"] == im.R_REPLANNING
    assert roundtrip(worse).from_imbalance == round(31 / 20.5, 4)


def test_a_gain_that_does_not_pay_for_the_reshard_is_declined() -> None:
    rec, made = _replanning(0.5, steps=150)  # 50 steps left: 50 x 6.7 ms saves 0.3 s
    out = loop(summary([20.0, 10.0], steps=150), 62, rec, live_plan=made)
    assert reasons(out)["Balanced"] == im.R_DOES_NOT_PAY and out.decision == "declined_cost"
    assert "the reshard's cost 10 s" in out.conditions[-1].message  # Job created → first step


def test_no_better_placement_declines_and_a_failed_replan_warns() -> None:
    rec, _ = _replanning(0.5)
    none = loop(
        summary([20.0, 10.0]), 62, rec, live_plan_failure=(im.NO_BETTER_PLAN, "no move helps")
    )
    assert reasons(none)["Balanced"] == im.R_GAIN_TOO_SMALL
    bad = loop(summary([20.0, 10.0]), 62, rec, live_plan_failure=(im.R_PLAN_FAILED, "crashed"))
    assert reasons(bad)["Balanced"] == im.R_PLAN_FAILED and "crashed" in bad.conditions[-1].message


def test_at_most_max_per_hour_reshards() -> None:
    rec, _ = _replanning(0.5)
    busy = dataclasses.replace(rec, state=ls.WATCHING, reshards=(at(-3000), at(-100)))
    out = loop(summary([20.0, 10.0]), 0, busy)
    out = loop(summary([20.0, 10.0]), 61, roundtrip(out))
    assert reasons(out)["Balanced"] == im.R_RATE_LIMITED and out.replan is None
    assert out.requeue_after == 600 - 61  # the older one leaves the hour at 600 s
    free = loop(summary([20.0, 10.0]), 601, roundtrip(out))
    assert free.replan is not None


def test_running_workers_without_live_costs_are_named_and_nothing_reshards() -> None:
    out = loop(None, 0)
    assert reasons(out) == {"LiveCosts": im.R_NO_LIVE}
    msg = out.conditions[0].message
    assert "dj-workers-0-x, dj-workers-1-y" in msg and "service account" in msg
    young = loop(None, 0, worker=worker(created=-30))
    assert "LiveCosts" not in reasons(young)  # still inside the grace period
    broken = loop(None, 0, live_problem="ConfigMap dj-live key live.json is unreadable")
    assert "unreadable" in broken.conditions[0].message


def test_a_changed_declaration_drops_the_adopted_live_plan() -> None:
    rec, made = _replanning(0.5)
    adopted = roundtrip(loop(summary([20.0, 10.0]), 62, rec, live_plan=made))
    assert loop(None, 63, adopted).use_plan == rec.live_plan
    resized = loop(None, 63, adopted, base_inputs="other-size")
    assert resized.use_plan is None and roundtrip(resized).reshards == (at(62),)


def test_disabled_loop_reports_live_costs_but_decides_nothing() -> None:
    out = loop(summary([30.0, 10.0]), 0, settings=OnImbalanceSpec())
    assert reasons(out) == {"LiveCosts": im.R_LIVE} and out.record is None
    assert out.live_fields["measuredImbalance"] == 1.5


def test_the_replan_waits_until_every_shard_was_probed() -> None:
    """A summary whose ranks say how many shards their probe times: no re-plan on a
    guess for the shards not yet timed MIN_PROBES times."""
    from shardwise.planner.live.summary import ShardCost

    def probed(samples: int) -> LiveSummary:
        s = summary([20.0, 10.0])
        ranks = [r.model_copy(update={"probe_shards": 2}) for r in s.ranks]
        shards = [
            ShardCost(table=f"t{r}{i}", rank=r, cols=16, ms=1.0, samples=samples)
            for r in (0, 1)
            for i in (0, 1)
        ]
        return s.model_copy(update={"ranks": ranks, "shards": shards})

    rec = roundtrip(loop(probed(1), 0))
    early = loop(probed(1), 61, rec)
    assert early.replan is None and "0 of 4 shards" in early.conditions[-1].message
    ready = loop(probed(im.MIN_PROBES), 62, roundtrip(early))
    assert ready.replan is not None


def test_of_a_node_reshard_and_the_loops_the_one_under_way_else_the_later_shows() -> None:
    """``Resharding`` is one condition: a node reshard under way wins; otherwise the
    later reshard's (the loop's going on after a node reshard ended, and its ending)."""
    node_rec = rs.Record(rs.DONE, 2, 3, "NodeAdded", started_at=at(-600), last_at=at(-590))
    node_done = Condition("Resharding", False, "Resharded", "resharded from 2 to 3 workers")
    node_going = Condition("Resharding", True, "NodeAdded", "resharding from 2 to 3 workers")
    loop_rec = ls.LoopRecord(state=ls.VERIFYING, started_at=at(0), message="moving 2 shards")
    loop_going = Condition("Resharding", True, im.R_RESHARDING, "resharding for imbalance")
    loop_done = im.resharded(loop_rec)
    assert loop_done is not None

    def shown(node: Condition, mine: Condition, rec: ls.LoopRecord = loop_rec) -> Condition:
        d = Decision(conditions=[node], fields={"resharding": node_rec.to_status()})
        out = im.LoopOutcome(record=rec, conditions=(mine,))
        add_loop_conditions(observed(), d, out)
        (only,) = [c for c in d.conditions if c.type == "Resharding"]
        return only

    assert shown(node_done, loop_going) is loop_going
    assert shown(node_done, loop_done) is loop_done  # the loop resharded later
    assert shown(node_going, loop_done) is node_going
    older = dataclasses.replace(loop_rec, started_at=at(-900))
    assert shown(node_done, loop_done, older) is node_done


def test_a_decline_on_a_noisy_probe_is_looked_at_again_once_the_probe_narrows() -> None:
    """A re-plan declined within its uncertainty on the probe's first windows (each
    rank's probe sum ± 2 ms): the decline stands while the spread stays, and once more
    windows narrowed it to NARROWED of that, the loop re-plans on the new evidence."""
    from shardwise.planner.live.summary import ShardCost

    def probed(spread: float, written: float) -> LiveSummary:
        s = summary([20.0, 10.0], written=written)
        ranks = [r.model_copy(update={"probe_shards": 2}) for r in s.ranks]
        shards = [
            ShardCost(table=f"t{r}{i}", rank=r, cols=16, ms=1.0, samples=5, spreadMs=spread)
            for r in (0, 1)
            for i in (0, 1)
        ]
        return s.model_copy(update={"ranks": ranks, "shards": shards})

    rec = roundtrip(loop(probed(1.5, 0), 0))
    rec = roundtrip(loop(probed(1.5, 61), 61, rec))
    assert rec.state == ls.REPLANNING and rec.evidence
    made = _made("dj-plan-bbbb", "b", rec.live_plan, 0.2, uncertainty=0.3, fit="unchecked")
    out = loop(probed(1.5, 62), 62, rec, live_plan=made)
    assert reasons(out)["Balanced"] == im.R_UNCERTAIN
    same = loop(probed(1.3, 90), 90, roundtrip(out))
    assert same.replan is None and reasons(same)["Balanced"] == im.R_UNCERTAIN
    narrower = loop(probed(0.9, 120), 120, roundtrip(same))  # 0.9 / 1.5 = 0.6 ≤ 0.7
    assert roundtrip(narrower).state == ls.SUSTAINED  # sustained again, then re-planned
    due = loop(probed(0.9, 181), 181, roundtrip(narrower))
    assert due.replan is not None and reasons(due)["Balanced"] == im.R_REPLANNING
    # a balanced job is not re-planned however the probe narrows
    calm = summary([10.0, 9.8], written=130)
    assert loop(calm, 130, roundtrip(same)).replan is None


def test_the_new_workers_first_seconds_do_not_decide_the_verdict() -> None:
    """Summaries of the re-planned workers with fewer than VERIFY_SAMPLES sampled steps
    (freshly loaded tables, a machine still busy with the reshard) are waited out; a
    rank whose probe saw nothing (every call no dearer than the empty one) is no
    evidence."""
    from shardwise.operator.decide.loop_verdict import VERIFY_SAMPLES
    from shardwise.planner.live.summary import ShardCost

    rec, made = _replanning(0.5)
    out = roundtrip(loop(summary([20.0, 10.0]), 62, rec, live_plan=made))
    moved = plan("dj-plan-bbbb", "b" * 64, rec.live_plan, live=made.summary["live"])
    going = roundtrip(loop(None, 100, out, running=moved, live_plan=moved))
    thin = summary([30.0, 10.0], plan_hash="b" * 64, samples=VERIFY_SAMPLES - 1, written=200)
    early = loop(thin, 200, going, running=moved, live_plan=moved)
    assert reasons(early)["Balanced"] == im.R_VERIFYING and not roundtrip(early).verify_samples
    blind = thin.model_copy(
        update={"shards": [ShardCost(table="t", rank=r, cols=8, ms=0.0, samples=5) for r in (0, 1)]}
    )
    assert ls.with_evidence((), blind) == ()

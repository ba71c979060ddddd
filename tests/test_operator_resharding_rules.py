"""The pure rules and the decision of :mod:`shardwise.operator.decide.resharding`
(docs/resharding.md), called directly and through ``decide()``: the target size, the
debounce clock and the rate bound, the gain rule, and ``reshard()`` itself. The same
resharding on kopf's engine against the API emulator is in
tests/test_operator_resharding.py.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from k8s.helpers import NAMESPACE as NS
from operator_builders import A100, CFG, JOB, NOW, observed, plan_record, spec

from shardwise import names
from shardwise.operator.cluster.capacity import NodeInfo, Placement
from shardwise.operator.cluster.summaries import ChildRef, JobState, job_state
from shardwise.operator.decide import resharding as rs
from shardwise.operator.decide.planning import plan_inputs
from shardwise.operator.decide.reconcile import decide
from shardwise.operator.models.plan_inputs import PlanInputs
from shardwise.operator.render import children as render

# --------------------------------------------------------------------------- pure rules
T0 = datetime.datetime(2026, 11, 22, tzinfo=datetime.UTC)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def test_target_clamps_to_max_and_is_zero_below_min() -> None:
    assert [rs.target(s, 2, 4) for s in (0, 1, 2, 3, 4, 9)] == [0, 0, 2, 3, 4, 4]


def test_debounce_clock_survives_and_flips_reset_it() -> None:
    r = rs.pending(None, 2, 4, rs.NODE_ADDED, at(0))
    assert r is not None and r.since == at(0)
    again = rs.pending(rs.Record.from_status(r.to_status()), 2, 4, rs.NODE_ADDED, at(5))
    assert again == r and rs.due_at(r, 10) == at(10)  # the clock is not restarted
    assert rs.pending(r, 2, 2, "", at(6)) is None  # flipped back: cleared
    other = rs.pending(r, 2, 3, rs.NODE_ADDED, at(7))
    assert other is not None and other.since == at(7)  # another target: a new clock


def test_rate_bound_after_a_finished_reshard() -> None:
    last = rs.finish(rs.start(rs.Record(rs.PENDING, 2, 4, since=at(0)), at(0)), at(1))
    r = rs.pending(last, 4, 2, rs.NODE_LOST, at(2))
    assert r is not None and r.last_at == at(1)
    assert rs.due_at(r, 10) == at(21)  # 2 x debounce after the last one finished


def test_gain_is_throughput_over_predicted_time() -> None:
    assert abs(rs.gain(2, 1.0, 4, 1.5) - (4 / 1.5 / 2 - 1)) < 1e-12
    assert rs.gain(2, 1.0, 4, 2.2) < rs.MIN_GAIN  # twice the ranks, more than twice as slow
    assert rs.gain(2, None, 3, None) == 0.5


# --------------------------------------------------------------------------- decide()
def _spec() -> Any:
    return spec(workers=(1, 4), resharding={"enabled": True, "debounceSeconds": 30})


def _running(workers: int, failure: str | None = None, complete: bool = False) -> Any:
    """The worker Job the operator would have made for ``workers`` on plan dj-plan-x."""
    body = render.worker_job(JOB, _spec(), "dj-plan-x", "a" * 64, workers, A100, CFG)
    body["metadata"]["uid"] = "w1"
    conds = []
    if failure:
        conds = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
    if complete:
        conds = [{"type": "Complete", "status": "True"}]
    body["status"] = {"active": workers, "conditions": conds}
    return job_state(body)


def _decide(worker: Any, gpus: tuple[int, ...], record: dict[str, Any] | None = None) -> Any:
    labels = {CFG.gpu_type_label: A100, CFG.gpu_memory_label: "81920"}
    nodes = [NodeInfo(f"n{i}", labels, gpus=g) for i, g in enumerate(gpus)]
    s = _spec()
    running = int(worker.ref.annotations[names.ANN_WORKERS])
    ih = plan_inputs(s, Placement(A100, running), 2 * 2**30).hash()
    return decide(
        observed(
            spec=s,
            nodes=nodes,
            worker_job=worker,
            plans=[plan_record("dj-plan-x", ih)],
            resharding=record,
            now=NOW,
        )
    )


def test_decide_a_failure_with_the_capacity_intact_still_fails() -> None:
    d = _decide(_running(2, failure="boom"), (4,))
    assert any(x.type == "Failed" for x in d.conditions) and "resharding" not in d.fields
    assert d.deletes == []


def test_decide_never_reshards_a_finished_job() -> None:
    d = _decide(_running(2, complete=True), (4, 4))
    assert "resharding" not in d.fields and d.deletes == [] and d.plan is None


def test_decide_debounces_then_a_restarted_operator_goes_on_with_a_started_reshard() -> None:
    d = _decide(_running(2), (4, 4))
    assert d.fields["resharding"]["state"] == "Pending" and d.requeue_after == 30.0
    assert d.plan is None and d.deletes == []  # nothing before the debounce
    started = {**d.fields["resharding"], "state": "Started", "startedAt": "2026-05-01T12:00:00Z"}
    again = _decide(_running(2), (4, 4), started)  # the record read back after a restart
    cond = next(x for x in again.conditions if x.type == "Resharding")
    assert cond.status and cond.reason == "NodeAdded"
    assert again.plan is not None and again.plan.inputs.workers == 4  # planning for 4


def test_decide_names_the_reshards_cause_when_it_replaces_the_workers() -> None:
    started = {
        **_decide(_running(2), (4, 4)).fields["resharding"],
        "state": "Started",
        "startedAt": "2026-05-01T12:00:00Z",
    }
    s = _spec()
    to_four = plan_inputs(s, Placement(A100, 4), 2 * 2**30).hash()
    labels = {CFG.gpu_type_label: A100, CFG.gpu_memory_label: "81920"}
    d = decide(
        observed(
            spec=s,
            nodes=[NodeInfo(f"n{i}", labels, gpus=4) for i in range(2)],
            worker_job=_running(2),
            plans=[plan_record("dj-plan-x", "old"), plan_record("dj-plan-y", to_four)],
            resharding=started,
            now=NOW,
        )
    )
    replacing = next(x for x in d.conditions if x.type == "WorkersReady")
    assert replacing.reason == "Replacing"
    assert replacing.message.startswith("resharding from 2 worker(s) to 4 worker(s) (NodeAdded)")
    assert "template changed" not in replacing.message


# --------------------------------------------------------------------------- reshard()
def _worker(workers: int, deleting: bool = False, failure: str | None = None) -> Any:
    labels = {names.LABEL_GPU_TYPE: "A100", names.LABEL_COMPONENT: names.COMPONENT_WORKER}
    annotations = {names.ANN_WORKERS: str(workers), names.ANN_PLAN: "dj-plan-x"}
    ref = ChildRef("Job", "dj-workers", NS, "w1", "1", labels, annotations, deleting=deleting)
    return JobState(ref, active=workers, failure=failure)


def _situation(worker: Any, slots: int, **changes: Any) -> rs.Situation:
    base: dict[str, Any] = {
        "record": None,
        "worker": worker,
        "pinned": True,
        "slots": {"A100": slots},
        "nodes": [NodeInfo("n0", {CFG.gpu_type_label: "A100"}, gpus=2 * slots)],
        "workers_min": 2,
        "workers_max": 4,
        "gpus_per_worker": 2,
        "device": "cuda",
        "debounce_seconds": 10,
        "suspend": False,
        "now": at(0),
    }
    return rs.Situation(**(base | changes))


def _inputs(workers: int) -> Any:
    return PlanInputs([], "neuroshard", 0, "A100", workers, 2, 2**30, 0.15, 512, "cuda")


def _plan(seconds: float) -> Any:
    p = plan_record("dj-plan-y", "h")
    return dataclasses.replace(p, summary={**p.summary, "predictedMaxSeconds": seconds})


def test_reshard_debounces_then_shrinks_and_finishes_with_the_new_workers() -> None:
    waiting = rs.reshard(_situation(_worker(4), 3))
    rec = waiting.record
    assert rec is not None and (rec.state, rec.from_workers, rec.to_workers) == (rs.PENDING, 4, 3)
    assert (rec.reason, rec.gpu_type, rec.since) == (rs.NODE_LOST, "A100", at(0))
    assert waiting.placement is None and waiting.requeue_after == 10.0
    assert waiting.conditions == () and waiting.deletes == () and waiting.plan is None
    going = rs.reshard(_situation(_worker(4), 3, record=rec, now=at(10)))
    assert going.placement == rs.Placement("A100", 3)
    assert going.record is not None and going.record.state == rs.STARTED
    assert going.record.started_at == at(10)
    assert [(x.type, x.status, x.reason) for x in going.conditions] == [
        ("Resharding", True, rs.NODE_LOST)
    ]
    # done once the worker Job at the new size is created in a pass, or seen
    assert rs.finished(going.record, _worker(4), [], at(11)) is None
    new = _worker(3).ref
    created = {"kind": "Job", "metadata": {"labels": new.labels, "annotations": new.annotations}}
    done = rs.finished(going.record, _worker(4), [created], at(12))
    assert done is not None and done.finished == going.record
    assert done.record is not None and (done.record.state, done.record.last_at) == (rs.DONE, at(12))
    assert [(x.type, x.status, x.reason) for x in done.conditions] == [
        ("Resharding", False, "Resharded")
    ]
    seen = rs.finished(going.record, _worker(3), [], at(13))
    assert seen is not None and seen.finished is None  # no metric twice after a restart
    assert rs.finished(waiting.record, _worker(3), [created], at(13)) is None  # not started


def test_reshard_below_min_stops_the_workers_then_returns_with_capacity() -> None:
    out = rs.reshard(_situation(_worker(4), 1, debounce_seconds=0))
    assert isinstance(out.placement, rs.Shortfall)
    assert out.deletes == (_worker(4).ref,)
    assert out.record is not None and (out.record.state, out.record.to_workers) == (rs.STARTED, 0)
    assert [x.type for x in out.conditions] == ["WaitingForCapacity"]
    still = rs.reshard(_situation(_worker(4, deleting=True), 1, record=out.record))
    assert isinstance(still.placement, rs.Shortfall) and still.deletes == ()
    back = rs.reshard(_situation(None, 3, record=out.record, pinned=False, now=at(60)))
    assert back.placement == rs.Placement("A100", 3)
    assert back.record is not None and back.record.reason == rs.CAPACITY_RETURNED


def test_reshard_grows_only_when_the_plan_promises_a_gain() -> None:
    def grow(candidate: rs.Candidate) -> rs.Outcome:
        s = _situation(_worker(2), 4, debounce_seconds=0, running_seconds=1.0)
        return rs.reshard(dataclasses.replace(s, plan_for=lambda p: candidate))

    first = grow(rs.Candidate(_inputs(4)))
    assert first.plan == _inputs(4) and first.placement is None  # plan for 4 first
    assert first.record is not None and first.record.state == rs.PENDING
    assert first.record.reason == rs.NODE_ADDED
    slower = grow(rs.Candidate(_inputs(4), _plan(2.2)))
    assert slower.placement is None and slower.record is not None
    assert slower.record.state == rs.DECLINED and "staying at 2" in slower.record.message
    assert [(x.type, x.reason) for x in slower.conditions] == [("Resharding", "NoGain")]
    faster = grow(rs.Candidate(_inputs(4), _plan(1.5)))
    assert faster.placement == rs.Placement("A100", 4)
    assert faster.record is not None and faster.record.state == rs.STARTED
    failed = grow(rs.Candidate(_inputs(4), failure="infeasible"))
    assert failed.record is not None and failed.record.message == "no plan for 4: infeasible"
    no_memory = grow(rs.Candidate(None))
    assert no_memory.placement is None and no_memory.plan is None and no_memory.conditions == ()


def test_reshard_leaves_alone_what_it_does_not_own() -> None:
    last = rs.Record(rs.DONE, last_at=at(-100))
    for changes in ({"pinned": False}, {"suspend": True}, {"worker": None}):
        out = rs.reshard(dataclasses.replace(_situation(_worker(2), 4, record=last), **changes))
        assert out.placement is None and out.record == rs.Record(rs.DONE, last_at=at(-100))
    assert rs.reshard(_situation(_worker(2), 4, pinned=False)) == rs.Outcome()
    # a failed worker Job with the capacity intact is the job's failure, not a reshard
    assert rs.reshard(_situation(_worker(2, failure="boom"), 4)) == rs.Outcome()
    lost = rs.reshard(_situation(_worker(3, failure="boom"), 2))
    assert lost.placement == rs.Placement("A100", 2)
    assert lost.record is not None and lost.record.reason == rs.WORKER_LOST

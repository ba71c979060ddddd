"""Resharding decisions: the target worker count, the debounce, gain or must.

:func:`reshard` is the whole decision, pure: from a :class:`Situation` (the record in
``status.resharding``, the worker Job, the free worker slots, the spec's bounds, the
time, and what planning says about a larger size) to an :class:`Outcome` (the
placement or the shortfall, the conditions, the record to write, the Job to stop);
:func:`finished` says when a started reshard is done. ``reconcile.decide`` calls both.
The rules below are the small pure functions they are made of.

The :class:`Record` in ``status.resharding`` is the one piece of earlier state the
reconcile reads back: a debounce needs to know since when the target has differed, and
that must survive an operator restart (a restarted operator would otherwise restart
the clock, or forget that a reshard is half done).

Rules (docs/resharding.md):

- the target is ``min(workers.max, slots)`` of the running GPU type, or 0 below
  ``workers.min``;
- a target that differs from the running size becomes due once it has stayed the same
  for ``debounceSeconds``, and no sooner than ``2 x debounceSeconds`` after the previous
  reshard finished (the rate bound); a target that flips back clears the record, so a
  node flapping faster than the debounce never reshards;
- a smaller target (node lost, NotReady, cordoned) must reshard; a larger one reshards
  only if the plan for it is predicted to gain at least :data:`MIN_GAIN` throughput;
- a worker Job that failed while capacity shrank (its pods went with a node) reshards
  at once from the last checkpoint instead of failing the job;
- for a job queued through Kueue the slots are also bounded by its queue's GPU quota
  (:func:`~shardwise.operator.decide.queueing.quota_room`): a change the quota binds is
  ``QuotaChanged``, and follows the same rules, debounced at least
  :data:`QUOTA_SETTLE_SECONDS`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise import names
from shardwise.operator.cluster.capacity import NodeInfo, Placement, Shortfall, choose, gpu_type
from shardwise.operator.cluster.summaries import ChildRef, JobState, PlanRecord
from shardwise.operator.config import OperatorConfig
from shardwise.operator.decide.lifecycle import Condition
from shardwise.operator.models.plan_inputs import PlanInputs

#: A scale-up must promise this much more throughput (samples/s), else it is declined.
MIN_GAIN = 0.05

PENDING = "Pending"  # debouncing, or planning the candidate
DECLINED = "Declined"  # the candidate would not gain: kept until the target changes
STARTED = "Started"  # stopping the workers, then starting them at ``to``
DONE = "Done"  # the last reshard finished at ``last_at``

NODE_ADDED = "NodeAdded"
NODE_LOST = "NodeLost"
NODE_NOT_READY = "NodeNotReady"
NODE_CORDONED = "NodeCordoned"
WORKER_LOST = "WorkerLost"
CAPACITY_RETURNED = "CapacityReturned"
#: Other workloads took GPUs on the job's nodes.
CAPACITY_TAKEN = "CapacityTaken"
#: The job's Kueue queue has more or less GPU quota left for it (queueing.py).
QUOTA_CHANGED = "QuotaChanged"
#: The least debounce of a change the quota causes: Kueue writes the Job, its Workload
#: and the ClusterQueue's usage one after another, and between those writes the room
#: read is off by the job's own share (a flap seen with debounce 0: 2 → 4 → 2 workers).
QUOTA_SETTLE_SECONDS = 5.0


def _stamp(when: datetime.datetime) -> str:
    """Milliseconds, not the whole seconds of ``format_time``: a debounce of a few
    seconds read back must not come due up to a second early."""
    return when.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass(frozen=True)
class Record:
    """``status.resharding``: the reshard under way or last finished."""

    state: str
    from_workers: int = 0
    to_workers: int = 0
    reason: str = ""
    gpu_type: str = ""
    since: datetime.datetime | None = None
    started_at: datetime.datetime | None = None
    last_at: datetime.datetime | None = None
    message: str = ""

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "from": self.from_workers}
        out.update(to=self.to_workers, reason=self.reason)
        if self.gpu_type:
            out["gpuType"] = self.gpu_type
        for key, when in (
            ("since", self.since),
            ("startedAt", self.started_at),
            ("lastAt", self.last_at),
        ):
            if when is not None:
                out[key] = _stamp(when)
        if self.message:
            out["message"] = self.message
        return out

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> Record | None:
        if not isinstance(raw, Mapping) or raw.get("state") not in (
            PENDING,
            DECLINED,
            STARTED,
            DONE,
        ):
            return None
        return cls(
            state=str(raw["state"]),
            from_workers=int(raw.get("from") or 0),
            to_workers=int(raw.get("to") or 0),
            reason=str(raw.get("reason") or ""),
            gpu_type=str(raw.get("gpuType") or ""),
            since=_parse(raw.get("since")),
            started_at=_parse(raw.get("startedAt")),
            last_at=_parse(raw.get("lastAt")),
            message=str(raw.get("message") or ""),
        )

    def describe(self) -> str:
        to = f"{self.to_workers} worker(s)" if self.to_workers else "none (below workers.min)"
        return f"from {self.from_workers} worker(s) to {to} ({self.reason})"


def target(slots: int, minimum: int, maximum: int) -> int:
    """Workers the job should run with ``slots`` free worker slots: 0 below the minimum."""
    return min(maximum, slots) if slots >= minimum else 0


def why(
    current: int,
    to: int,
    all_nodes: Sequence[NodeInfo],
    kind: str,
    device: str,
    cfg: OperatorConfig,
    used: Mapping[str, int] | None = None,
) -> str:
    """Name the cause of a change from what the nodes of ``kind`` look like now (and
    the GPUs other pods hold on them)."""
    if to > current:
        return NODE_ADDED
    mine = [n for n in all_nodes if gpu_type(n, device, cfg) == kind]
    if any(not n.schedulable for n in mine):
        return NODE_CORDONED
    if any(not n.ready for n in mine):
        return NODE_NOT_READY
    if used and any(used.get(n.name, 0) > 0 for n in mine):
        return CAPACITY_TAKEN
    return NODE_LOST


def pending(
    prev: Record | None, current: int, to: int, reason: str, now: datetime.datetime
) -> Record | None:
    """The record while the target is ``to``: the clock keeps running while the target
    stays the same; ``None`` (but the last finish time kept) when nothing differs."""
    last = prev.last_at if prev is not None else None
    if to == current:
        if prev is not None and prev.state == DONE:
            return prev
        return Record(DONE, last_at=last) if last is not None else None
    if (
        prev is not None
        and prev.state in (PENDING, DECLINED)
        and (prev.from_workers, prev.to_workers) == (current, to)
    ):
        return prev
    return Record(PENDING, current, to, reason, since=now, last_at=last)


def due_at(record: Record, debounce: float) -> datetime.datetime:
    """When a pending record may start: debounced, and rate-bounded after the last one."""
    assert record.since is not None
    step = datetime.timedelta(seconds=debounce)
    at = record.since + step
    if record.last_at is not None:
        at = max(at, record.last_at + 2 * step)
    return at


def gain(current: int, current_seconds: float | None, to: int, to_seconds: float | None) -> float:
    """Predicted relative throughput gain of ``to`` workers over ``current``: samples per
    second scale with the workers over the predicted iteration time (batch per rank is
    fixed); without predictions, with the workers alone."""
    if current_seconds and to_seconds and current_seconds > 0 and to_seconds > 0:
        return (to / to_seconds) / (current / current_seconds) - 1.0
    return to / current - 1.0


def start(record: Record, now: datetime.datetime) -> Record:
    return replace(record, state=STARTED, started_at=now, message="")


def finish(record: Record, now: datetime.datetime) -> Record:
    return replace(record, state=DONE, last_at=now)


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Candidate:
    """What planning says about a larger size the workers could grow to."""

    #: The plan inputs at that size; ``None`` when no GPU memory is known for the GPU
    #: type (``decide`` reports NoGPUMemory).
    inputs: PlanInputs | None
    #: The plan made for ``inputs``, once there is one.
    plan: PlanRecord | None = None
    #: Why planning for ``inputs`` failed, when it did.
    failure: str | None = None


def _unplanned(placement: Placement) -> Candidate:
    return Candidate(None)


@dataclass(frozen=True)
class Situation:
    """What :func:`reshard` reads; everything else about the job is not its business."""

    #: ``status.resharding`` as last written.
    record: Record | None
    #: The worker Job, if there is one.
    worker: JobState | None
    #: The worker Job runs this generation of the spec and names its GPU type.
    pinned: bool
    #: Free worker slots by GPU type on the eligible nodes (``capacity.worker_slots``).
    slots: Mapping[str, int]
    #: Every node (not only the eligible ones): to name the cause of a change.
    nodes: Sequence[NodeInfo]
    workers_min: int
    workers_max: int
    gpus_per_worker: int
    device: str
    debounce_seconds: float
    suspend: bool
    now: datetime.datetime
    #: What planning says about a placement (a lookup: the plan for its inputs, or why
    #: there is none); asked only for a scale-up that is due.
    plan_for: Callable[[Placement], Candidate] = _unplanned
    #: Predicted seconds per iteration of the plan the workers run on.
    running_seconds: float | None = None
    #: GPUs that other pods hold, by node.
    gpu_usage: Mapping[str, int] = field(default_factory=dict)
    config: OperatorConfig = field(default_factory=OperatorConfig)
    #: The workers the job's Kueue queue has quota for (``None``: not queued); already
    #: applied to ``slots``, here only to name the cause of a change.
    quota_workers: int | None = None


@dataclass(frozen=True)
class Outcome:
    """What :func:`reshard` (or :func:`finished`) decided."""

    #: Where the workers go: the new size while a reshard is under way, a
    #: :class:`~shardwise.operator.cluster.capacity.Shortfall` (stopped, waiting for capacity),
    #: or ``None``: place them as usual.
    placement: Placement | Shortfall | None = None
    #: ``status.resharding`` to write; ``None`` writes none.
    record: Record | None = None
    conditions: tuple[Condition, ...] = ()
    #: The worker Job to delete, when the workers stop below ``workers.min``.
    deletes: tuple[ChildRef, ...] = ()
    #: Seconds until the debounce ends.
    requeue_after: float | None = None
    #: Plan these inputs first (a scale-up candidate; the workers keep running).
    plan: PlanInputs | None = None
    #: The reshard that finished in this pass, its new worker Job created (for metrics).
    finished: Record | None = None


def _declined(record: Record, message: str) -> Outcome:
    declined = replace(record, state=DECLINED, message=message)
    return Outcome(record=declined, conditions=(Condition("Resharding", False, "NoGain", message),))


def _reshard_to(record: Record) -> Outcome:
    going = Condition("Resharding", True, record.reason, f"resharding {record.describe()}")
    return Outcome(
        placement=Placement(record.gpu_type, record.to_workers), record=record, conditions=(going,)
    )


def _wait_for_capacity(s: Situation, record: Record, message: str) -> Outcome:
    """Below workers.min: stop the workers (they checkpoint) and wait, woken by nodes."""
    wj = s.worker
    stop = (wj.ref,) if wj is not None and not wj.ref.deleting else ()
    return Outcome(
        placement=Shortfall(message),
        record=record,
        conditions=(Condition("WaitingForCapacity", True, record.reason, message),),
        deletes=stop,
    )


def predicted_seconds(plan: PlanRecord | None) -> float | None:
    """The plan's predicted seconds per iteration, when it has them."""
    v = plan.summary.get("predictedMaxSeconds") if plan is not None else None
    return float(v) if isinstance(v, int | float) else None


def reshard(s: Situation) -> Outcome:
    """The placement while a reshard is due or under way, and what goes with it; the
    rules are in the module docstring."""
    wj, now = s.worker, s.now
    prev = s.record
    lo, hi = s.workers_min, s.workers_max
    if prev is not None and prev.state == STARTED:
        if prev.to_workers == 0:
            again = choose(s.slots, lo, hi, s.gpus_per_worker)
            if isinstance(again, Shortfall):
                return _wait_for_capacity(s, prev, again.message)
            prev = replace(
                prev, to_workers=again.workers, gpu_type=again.gpu_type, reason=CAPACITY_RETURNED
            )
        return _reshard_to(prev)
    if not s.pinned or wj is None or wj.complete or s.suspend:
        if prev is not None and prev.last_at is not None:
            return Outcome(record=Record(DONE, last_at=prev.last_at))
        return Outcome()
    kind = wj.ref.labels[names.LABEL_GPU_TYPE]
    current = int(wj.ref.annotations.get(names.ANN_WORKERS, "1"))
    to = target(s.slots.get(kind, 0), lo, hi)
    reason = why(current, to, s.nodes, kind, s.device, s.config, s.gpu_usage)
    if s.quota_workers is not None and to == min(hi, s.quota_workers) and to != current:
        reason = QUOTA_CHANGED
    if wj.failure is not None:
        if to >= current:
            return Outcome()  # a failure with the capacity intact: the job fails
        last = prev.last_at if prev is not None else None
        lost = Record(STARTED, current, to, WORKER_LOST, kind, now, now, last)
        if to == 0:
            return _wait_for_capacity(s, lost, f"{lost.describe()}; waiting for capacity")
        return _reshard_to(lost)
    rec = pending(prev, current, to, reason, now)
    if rec is None:
        return Outcome()
    if rec.state == DONE:
        if rec.to_workers:
            done = Condition("Resharding", False, "Resharded", f"resharded {rec.describe()}")
            return Outcome(record=rec, conditions=(done,))
        return Outcome(record=rec)
    rec = replace(rec, gpu_type=kind)
    if rec.state == DECLINED:
        return Outcome(
            record=rec, conditions=(Condition("Resharding", False, "NoGain", rec.message),)
        )
    debounce = s.debounce_seconds
    if rec.reason == QUOTA_CHANGED:
        debounce = max(debounce, QUOTA_SETTLE_SECONDS)
    due = due_at(rec, debounce)
    if now < due:
        return Outcome(record=rec, requeue_after=(due - now).total_seconds())
    if to == 0:
        rec = start(rec, now)
        return _wait_for_capacity(s, rec, f"{rec.describe()}; waiting for capacity")
    if to < current:
        return _reshard_to(start(rec, now))
    return _scale_up(s, rec, current)


def _scale_up(s: Situation, rec: Record, current: int) -> Outcome:
    """Plan for the larger size first (the workers keep running), then reshard only if
    the plan is predicted to gain; otherwise decline until the target changes."""
    candidate = s.plan_for(Placement(rec.gpu_type, rec.to_workers))
    if candidate.inputs is None:
        return Outcome(record=rec)  # decide reports NoGPUMemory
    if candidate.plan is None:
        if candidate.failure is not None:
            return _declined(rec, f"no plan for {rec.to_workers}: {candidate.failure}")
        return Outcome(record=rec, plan=candidate.inputs)
    g = gain(current, s.running_seconds, rec.to_workers, predicted_seconds(candidate.plan))
    if g < MIN_GAIN:
        return _declined(
            rec,
            f"{rec.to_workers} worker(s) would gain {100 * g:.1f} % throughput "
            f"(< {100 * MIN_GAIN:.0f} %): staying at {current}",
        )
    return _reshard_to(start(rec, s.now))


def finished(
    record: Record | None,
    worker: JobState | None,
    created: Sequence[Mapping[str, Any]],
    now: datetime.datetime,
) -> Outcome | None:
    """A started reshard (``record``, as :func:`reshard` wrote it in this pass) is done
    once the worker Job at the new size is created (``created``: this pass's creates)
    or seen: resized in place (the pass after the resize, so the start is announced
    too), or after a restart between the create and the status write; ``None`` while
    it is not."""
    if record is None or record.state != STARTED or record.to_workers == 0:
        return None
    made = any(
        b.get("kind") == "Job"
        and b["metadata"]["labels"].get(names.LABEL_COMPONENT) == names.COMPONENT_WORKER
        and b["metadata"]["annotations"].get(names.ANN_WORKERS) == str(record.to_workers)
        for b in created
    )
    seen = (
        worker is not None
        and not worker.ref.deleting
        and worker.failure is None
        and worker.ref.annotations.get(names.ANN_WORKERS) == str(record.to_workers)
        and worker.ref.labels.get(names.LABEL_GPU_TYPE) == record.gpu_type
    )
    if not (made or seen):
        return None
    done = Condition("Resharding", False, "Resharded", f"resharded {record.describe()}")
    counted = made or (seen and worker is not None and worker.slices)  # once: for metrics
    return Outcome(
        record=finish(record, now), conditions=(done,), finished=record if counted else None
    )

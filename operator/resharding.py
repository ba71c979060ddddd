"""Resharding decisions (issue 8): the target worker count, the debounce, gain or must.

Pure functions over the capacity summary and a :class:`Record` kept in
``status.resharding``. The record is the one piece of earlier state the reconcile reads
back: a debounce needs to know since when the target has differed, and that must
survive an operator restart (a restarted operator would otherwise restart the clock,
or forget that a reshard is half done).

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
  at once from the last checkpoint instead of failing the job.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardwise.operator.capacity import NodeInfo, gpu_type
from shardwise.operator.config import OperatorConfig

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

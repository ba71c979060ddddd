"""Phases, conditions and the Events that announce their transitions (docs/operator.md).

Each reconcile states the conditions that apply now; :func:`build_status` keeps a
condition's ``lastTransitionTime`` while its status stays the same, and stamps
``observedGeneration`` on the status and on every condition. The phase follows from
the conditions (:func:`phase_of`), and :func:`transition_events` turns every condition
that changed (status or reason) into one Event whose message names the cause: the
problem in the spec, the failed profiling attempt, the first failing pod.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from shardwise.operator.cluster.startup import CONDITION_REASONS as STARTUP_REASONS
from shardwise.operator.cluster.startup import FAILED_CREATE
from shardwise.operator.cluster.summaries import format_time


class Phase(StrEnum):
    PENDING = "Pending"
    PROFILING = "Profiling"
    PLANNING = "Planning"
    #: Waiting for Kueue to admit the worker Job (its quota), or preempted by Kueue.
    QUEUED = "Queued"
    PREEMPTED = "Preempted"
    RUNNING = "Running"
    RESHARDING = "Resharding"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


#: The order conditions are listed in (and phases are derived in).
ORDER = (
    "SpecValid",
    "Capacity",
    "CostModelReady",
    "Planned",
    "Admitted",
    "WorkersReady",
    "Resharding",
    "LiveCosts",
    "Balanced",
    "WaitingForCapacity",
    "Degraded",
    "Suspended",
    "Complete",
    "Failed",
)

#: Reasons that announce a problem (Warning events).
WARNING_REASONS = frozenset(
    {
        "InvalidSpec",
        "InsufficientCapacity",
        "NoGPUMemory",
        "ProfilingAttemptFailed",
        "ProfilingFailed",
        "Infeasible",
        "PlanningError",
        "TablesNotFound",
        "InvalidTables",
        "WorkersFailed",
        "WorkersLost",
        "ModelUnreadable",
        "InvalidProfilingSettings",
        "ProfilingPodRefused",
        # the closed loop (imbalance.py): live data missing, a re-plan or a reshard failed
        "NoLiveCosts",
        "LiveReplanFailed",
        "ReshardDidNotDeliver",
        # Kueue (queueing.py): the queue is missing or inactive; quota taken back
        "Inadmissible",
        "Preempted",
        *STARTUP_REASONS,
    }
)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""

    @property
    def status_text(self) -> str:
        return "True" if self.status else "False"


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


def phase_of(conditions: Sequence[Condition]) -> tuple[Phase, str]:
    """The phase the conditions put the job in, and the message that explains it."""
    by = {c.type: c for c in conditions}

    def msg(t: str) -> str:
        return by[t].message

    if "Failed" in by and by["Failed"].status:
        return Phase.FAILED, msg("Failed")
    if "Complete" in by and by["Complete"].status:
        return Phase.SUCCEEDED, msg("Complete")
    if "Suspended" in by and by["Suspended"].status:
        return Phase.PENDING, msg("Suspended")
    if "Capacity" in by and not by["Capacity"].status:
        return Phase.PENDING, msg("Capacity")
    if "Admitted" in by and not by["Admitted"].status:
        waiting = Phase.PREEMPTED if by["Admitted"].reason == "Preempted" else Phase.QUEUED
        return waiting, msg("Admitted")
    if "Resharding" in by and by["Resharding"].status:
        return Phase.RESHARDING, msg("Resharding")
    if "WorkersReady" in by:
        if by["WorkersReady"].reason == FAILED_CREATE:
            # the Job exists but none of its pods could be created: nothing runs
            return Phase.PENDING, msg("WorkersReady")
        return Phase.RUNNING, msg("WorkersReady")
    if "Planned" in by and by["Planned"].reason == "Planning":
        return Phase.PLANNING, msg("Planned")
    if "CostModelReady" in by and not by["CostModelReady"].status:
        return Phase.PROFILING, msg("CostModelReady")
    if "Planned" in by:
        return Phase.PLANNING, msg("Planned")
    return Phase.PENDING, "waiting for the operator"


def build_status(
    old: Mapping[str, Any] | None,
    conditions: Sequence[Condition],
    generation: int,
    now: datetime.datetime,
    fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole ``status``: phase, message, conditions, observedGeneration, ``fields``."""
    previous = {c.get("type"): c for c in (old or {}).get("conditions") or []}
    ordered = sorted(conditions, key=lambda c: ORDER.index(c.type) if c.type in ORDER else 99)
    rendered = []
    for cond in ordered:
        before = previous.get(cond.type)
        since = (
            before.get("lastTransitionTime")
            if before
            and before.get("status") == cond.status_text
            and before.get("lastTransitionTime")
            else format_time(now)
        )
        rendered.append(
            {
                "type": cond.type,
                "status": cond.status_text,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since,
                "observedGeneration": generation,
            }
        )
    phase, message = phase_of(ordered)
    return {
        **(fields or {}),
        "phase": str(phase),
        "message": message,
        "observedGeneration": generation,
        "conditions": rendered,
    }


def _warning(cond: Mapping[str, Any]) -> bool:
    if cond.get("type") in ("Failed", "Degraded") and cond.get("status") == "True":
        return True
    return cond.get("reason") in WARNING_REASONS


def transition_events(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[EventSpec]:
    """One Event per condition whose status or reason changed (or that appeared), and
    per new message of a warning (attempt 2 failed) other than a pod's startup problem."""
    before = {c.get("type"): c for c in (old or {}).get("conditions") or []}
    out = []
    for cond in new.get("conditions") or []:
        prev = before.get(cond["type"])
        same = prev is not None and (prev.get("status"), prev.get("reason")) == (
            cond["status"],
            cond["reason"],
        )
        if (
            prev is not None
            and same
            and (
                prev.get("message") == cond.get("message")
                or cond["reason"] not in WARNING_REASONS
                # a stuck pod's wording changes as the kubelet retries (ErrImagePull,
                # ImagePullBackOff, …) and as pods come: announced once, kept current
                # in the condition
                or cond["reason"] in STARTUP_REASONS
            )
        ):
            continue
        out.append(condition_event(cond))
    return out


def condition_event(cond: Mapping[str, Any]) -> EventSpec:
    """The Event announcing a rendered condition (the same words each time it repeats,
    so the recorder counts a repeat on the Event already posted)."""
    return EventSpec(
        "Warning" if _warning(cond) else "Normal",
        str(cond["reason"]),
        f"{cond['type']}={cond['status']}: {cond['message']}".rstrip(": "),
    )


def repeated_events(
    status: Mapping[str, Any], attempts: Mapping[str, int], counted: dict[str, tuple[str, int]]
) -> list[EventSpec]:
    """The Event again for each condition whose failure was retried and failed alike
    (``attempts``: condition type → the failed attempt it reports), once per attempt;
    ``counted`` remembers what was announced (updated here)."""
    out = []
    for gone in set(counted) - set(attempts):  # no longer failing: a return starts anew
        del counted[gone]
    by_type = {c.get("type"): c for c in status.get("conditions") or []}
    for ctype, n in attempts.items():
        cond = by_type.get(ctype)
        if cond is None:
            continue
        key = (str(cond.get("reason")), n)
        before = counted.get(ctype)
        counted[ctype] = key
        # the first attempt, and a failure for another reason, are announced by their
        # transition; a retry that failed alike (or one after an operator restart) by this
        alike = before is None or before[0] == key[0]
        if before != key and n > 1 and alike:
            out.append(condition_event(cond))
    return out


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Equal for the purpose of writing: nothing would change."""
    return dict(a or {}) == dict(b or {})

"""Conditions → phase, the status, and the Events of transitions
(:mod:`shardwise.operator.decide.lifecycle`)."""

from __future__ import annotations

import datetime
from typing import Any

from operator_builders import NOW

from shardwise.operator.decide.lifecycle import (
    Condition,
    Phase,
    build_status,
    phase_of,
    transition_events,
)


def test_phase_follows_conditions() -> None:
    running = [
        Condition("Planned", True, "PlanReady", "p"),
        Condition("WorkersReady", False, "Starting", "w"),
    ]
    assert phase_of(running) == (Phase.RUNNING, "w")
    assert phase_of([*running, Condition("Failed", True, "WorkersFailed", "boom")]) == (
        Phase.FAILED,
        "boom",
    )
    assert phase_of([Condition("CostModelReady", False, "Profiling", "m")])[0] is Phase.PROFILING
    assert phase_of([Condition("Capacity", False, "InsufficientCapacity", "c")])[0] is Phase.PENDING


def test_status_keeps_transition_times_and_events_name_changes() -> None:
    first = build_status(None, [Condition("CostModelReady", False, "Profiling", "a")], 1, NOW)
    later = NOW + datetime.timedelta(minutes=5)
    same = build_status(
        first, [Condition("CostModelReady", False, "ProfilingAttemptFailed", "b")], 2, later
    )
    assert (
        same["conditions"][0]["lastTransitionTime"] == first["conditions"][0]["lastTransitionTime"]
    )
    assert same["conditions"][0]["observedGeneration"] == 2 and same["observedGeneration"] == 2
    flipped = build_status(same, [Condition("CostModelReady", True, "Fresh", "c")], 2, later)
    assert flipped["conditions"][0]["lastTransitionTime"] == "2026-05-01T12:05:00Z"
    events = transition_events(first, same)
    assert [(e.type, e.reason) for e in events] == [("Warning", "ProfilingAttemptFailed")]
    assert transition_events(same, same) == []
    retry = build_status(
        same, [Condition("CostModelReady", False, "ProfilingAttemptFailed", "b2")], 2, later
    )
    assert [e.message for e in transition_events(same, retry)] == ["CostModelReady=False: b2"]


def test_startup_problems_are_announced_once_per_reason() -> None:
    def status(reason: str, message: str) -> dict[str, Any]:
        cond = Condition("WorkersReady", False, reason, message)
        return build_status(None, [cond], 1, NOW)

    pulling = status("ImagePullError", "pod p: ErrImagePull: x")
    assert [e.type for e in transition_events(None, pulling)] == ["Warning"]
    assert transition_events(pulling, status("ImagePullError", "pod p: ImagePullBackOff: x")) == []
    assert [e.reason for e in transition_events(pulling, status("Unschedulable", "no"))] == [
        "Unschedulable"
    ]
    failed = status("WorkersFailed", "attempt 1")
    assert transition_events(failed, status("WorkersFailed", "attempt 2")), "re-announced"

"""Events as Kubernetes users expect them (:mod:`shardwise.operator.events`): one Event
per distinct thing said about an object, its repeats counted; a restarted operator
counts on the same Event, an expired one starts a new series. Against the emulator,
which validates Events as a real API server does."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import types
from collections.abc import Callable

import pytest
from k8s.helpers import DJ, dlrmjob
from k8s.server import EmulatorServer

from shardwise.operator.context import OperatorContext
from shardwise.operator.decide.lifecycle import (
    Condition,
    EventSpec,
    condition_event,
    repeated_events,
)
from shardwise.operator.decide.records import Decision
from shardwise.operator.events import EventRecorder, event_name, involved
from shardwise.operator.kube import ApiError, KubeApi
from shardwise.operator.loop.status import StatusWriter
from shardwise.operator.loop.tableswatch import TablesWatch
from shardwise.operator.render.children import JobMeta

pytest_plugins = ["k8s.fixtures"]

NS = "ml"
JOB = {
    "apiVersion": "shardwise.dev/v1alpha1",
    "kind": "DLRMJob",
    "metadata": {"name": "dj", "namespace": NS, "uid": "uid-1"},
}
BAD = {"kind": "DLRMJob", "metadata": {"name": "Not_A_Name", "namespace": NS}}
MISSING = EventSpec("Warning", "TablesNotFound", "Planned=False: ConfigMap ml/t does not exist")


def events(kube: KubeApi) -> list[dict[str, object]]:
    return kube.list("v1", "events", NS)


def test_a_repeat_is_counted_on_the_event_posted(api_server: EmulatorServer, kube: KubeApi) -> None:
    rec = EventRecorder(kube, instance="op-0")
    for _ in range(3):
        rec.post(involved(JOB), MISSING)
    other = EventSpec("Normal", "Planning", "Planned=False: planning 6 tables")
    rec.post(involved(JOB), other)
    got = {e["reason"]: e for e in events(kube)}
    assert len(events(kube)) == 2
    warning = got["TablesNotFound"]
    assert warning["count"] == 3 and warning["type"] == "Warning"
    assert warning["involvedObject"] == {
        "apiVersion": "shardwise.dev/v1alpha1", "kind": "DLRMJob", "name": "dj",
        "namespace": NS, "uid": "uid-1",
    }  # fmt: skip
    assert warning["firstTimestamp"] <= warning["lastTimestamp"]
    assert got["Planning"]["count"] == 1
    # what the API server asks of an Event with an eventTime (microseconds: Events
    # posted within one second sort in the order posted)
    assert warning["reportingComponent"] == "shardwise-operator"
    assert warning["reportingInstance"] == "op-0" and warning["action"]
    assert warning["eventTime"] < got["Planning"]["eventTime"]
    long = EventSpec("Warning", "Long", "→" * 600)  # 1800 bytes: cut to 1 KiB
    assert len(rec.post(involved(JOB), long)["message"].encode()) <= 1024
    # another object saying the same thing is its own series
    rec.post(involved({**JOB, "metadata": {**JOB["metadata"], "uid": "uid-2"}}), MISSING)
    assert sorted(e["count"] for e in events(kube)) == [1, 1, 1, 3]


def test_a_restarted_operator_counts_on_and_an_expired_event_starts_again(
    api_server: EmulatorServer, kube: KubeApi
) -> None:
    EventRecorder(kube).post(involved(JOB), MISSING)
    EventRecorder(kube).post(involved(JOB), MISSING)  # a new process: 409, then counted
    (only,) = events(kube)
    assert only["count"] == 2
    rec = EventRecorder(kube)
    rec.post(involved(JOB), MISSING)
    assert kube.delete("v1", "events", NS, event_name(involved(JOB), MISSING))  # its TTL
    rec.post(involved(JOB), MISSING)
    (again,) = events(kube)
    assert again["count"] == 1


def test_emit_never_blocks_nor_fails_the_loop(api_server: EmulatorServer, kube: KubeApi) -> None:
    """Queued from the event loop, posted in order in a thread; an error is a log line."""

    async def run() -> None:
        rec = EventRecorder(kube)
        for _ in range(4):
            rec.emit(JOB, MISSING)
        rec.emit(BAD, MISSING)  # refused: its name is no DNS subdomain
        await rec.drain()

    asyncio.run(run())
    (only,) = events(kube)
    assert only["count"] == 4
    with pytest.raises(ApiError) as err:  # what the emit above logged and went on from
        EventRecorder(kube).post(involved(BAD), MISSING)
    assert err.value.status == 422


def test_a_retry_that_failed_alike_is_announced_once_per_attempt() -> None:
    cond = {"type": "Planned", "status": "False", "reason": "TablesNotFound", "message": "gone"}
    status = {"conditions": [cond]}
    counted: dict[str, tuple[str, int]] = {}
    assert repeated_events(status, {"Planned": 1}, counted) == []  # its transition says it
    assert repeated_events(status, {"Planned": 1}, counted) == []  # the same attempt
    again = repeated_events(status, {"Planned": 2}, counted)
    assert again == [condition_event(cond)] and again[0].type == "Warning"
    assert repeated_events(status, {"Planned": 2}, counted) == []
    assert repeated_events(status, {}, counted) == []  # no failure reported
    # the problem came back later: its transition announces attempt 1, not this too
    assert counted == {} and repeated_events(status, {"Planned": 1}, counted) == []
    # after a restart, the first retry alike is counted too (its transition was before)
    assert repeated_events(status, {"Planned": 3}, {}) == [condition_event(cond)]
    # another reason: its transition announces it, whatever the attempt
    invalid = {**cond, "reason": "InvalidTables"}
    for n in (1, 3):
        counted = {"Planned": ("TablesNotFound", 2)}
        assert repeated_events({"conditions": [invalid]}, {"Planned": n}, counted) == []
        # and its retries alike by this
        assert repeated_events({"conditions": [invalid]}, {"Planned": n + 1}, counted) != []


# --------------------------------------------------------------------------- the fix, at once


def test_the_tables_watch_sees_the_configmap_created_then_edited(
    api_server: EmulatorServer, kube: KubeApi
) -> None:
    """The user's tables ConfigMap has none of our labels: while it cannot be read, one
    watch on its name wakes the job when it appears or changes, never for what it was."""
    woken: list[tuple[str | None, str | None]] = []

    class Wakeups:
        def wake(self, namespace: str | None, name: str | None) -> None:
            woken.append((namespace, name))

    ctx = types.SimpleNamespace(kube=kube, wakeups=Wakeups())
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "t", "namespace": NS}}

    async def run() -> None:
        watch = TablesWatch(ctx, NS, "dj")  # type: ignore[arg-type]
        watch.follow("t", exists=False)
        await asyncio.sleep(1.0)
        assert not watch.take_change() and woken == []  # missing, as read: nothing
        kube.create({**cm, "data": {"tables.yaml": "[]"}})
        await _until(lambda: woken, "the creation")
        assert watch.take_change() and not watch.take_change()
        kube.patch("v1", "configmaps", NS, "t", {"data": {"tables.yaml": "- x"}})
        await _until(lambda: len(woken) >= 2, "the edit")
        assert watch.take_change() and set(woken) == {(NS, "dj")}
        watch.follow(None)
        kube.patch("v1", "configmaps", NS, "t", {"data": {"tables.yaml": "- y"}})
        await asyncio.sleep(1.0)
        assert not watch.take_change()  # stopped: nothing more
        # a missing ConfigMap that exists by the time the watch starts: a change at once
        watch.follow("t", exists=False)
        await _until(watch.take_change, "the ConfigMap already there")
        watch.stop()

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        t.name.startswith("shardwise tables watch") for t in threading.enumerate()
    ):
        time.sleep(0.1)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shardwise tables")]


async def _until(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        await asyncio.sleep(0.05)


class FailingStatus:
    """The emulator's API, but the next ``fail`` status writes answer 500."""

    def __init__(self, kube: KubeApi, fail: int) -> None:
        self.kube, self.fail = kube, fail

    def __getattr__(self, name: str) -> object:
        return getattr(self.kube, name)

    def patch(self, *args: object) -> object:
        if args[-1] == "status" and self.fail > 0:
            self.fail -= 1
            raise ApiError(500, "InternalError", "etcd timed out")
        return self.kube.patch(*args)  # type: ignore[arg-type]


def test_an_event_is_posted_once_the_status_holds_what_it_announces(
    api_server: EmulatorServer, kube: KubeApi
) -> None:
    """A status write that fails posts nothing (the next pass announces it, once); a
    retry that failed alike is counted only once its status is written."""
    body = kube.create(dlrmjob("dj", NS))
    said: list[EventSpec] = []
    ctx = OperatorContext(
        kube=FailingStatus(kube, fail=1),  # type: ignore[arg-type]
        planner=None,  # type: ignore[arg-type]
        emit=lambda _body, ev: said.append(ev),
    )
    writer = StatusWriter(ctx, NS, "dj")
    job = JobMeta("dj", NS, body["metadata"]["uid"], 1)
    gone = Condition("Planned", False, "TablesNotFound", "ConfigMap ml/t does not exist")
    now = datetime.datetime.now(datetime.UTC)

    def write(attempt: int, cond: Condition = gone) -> None:
        decision = Decision(conditions=[cond], attempts={"Planned": attempt})
        asyncio.run(writer.write(body, job, decision, now))

    with pytest.raises(ApiError):
        write(1)
    assert said == [] and "status" not in (kube.get(*DJ, NS, "dj") or {})
    write(1)  # written now: announced now
    assert [e.reason for e in said] == ["TablesNotFound"]
    planned = (kube.get(*DJ, NS, "dj") or {})["status"]["conditions"][0]
    assert planned["reason"] == "TablesNotFound"
    write(2)  # the status is unchanged (nothing to write): the retry counted, once
    write(2)
    assert [e.reason for e in said] == ["TablesNotFound"] * 2
    # a retry that failed otherwise: its new words, and the count, once written
    ctx.kube.fail = 1  # type: ignore[attr-defined]
    invalid = Condition("Planned", False, "InvalidTables", "ConfigMap ml/t: line 1: bad")
    with pytest.raises(ApiError):
        write(3, invalid)
    assert len(said) == 2
    write(3, invalid)
    assert [e.reason for e in said] == ["TablesNotFound"] * 2 + ["InvalidTables"]

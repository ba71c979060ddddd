"""Events as Kubernetes' own recorders post them: one Event per distinct problem of an
object, its repeats counted.

kopf's ``kopf.event`` posts a new Event each call. A job whose tables cannot be read
would then say the same thing once per retry, hundreds of times a day. Here an Event
is named by what it says (the object's uid, type, reason and message), so a repeat
finds the one already posted and raises its ``count`` and ``lastTimestamp``, as
client-go's event correlator does. ``kubectl describe`` then shows "(x12 over 3h)".

- The name is deterministic, so a restarted operator counts on the same Event: its
  create answers 409, it reads the count and raises it.
- An Event the API server expired (its TTL, an hour by default) is posted anew, from 1.
- Posting never blocks the reconcile loop and never fails it: the posts run one at a time
  in a thread, and an error is logged.

RBAC: ``events`` create, get and patch (the chart grants them).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from shardwise.operator.decide.lifecycle import EventSpec
from shardwise.operator.kube import ApiError, KubeApi

logger = logging.getLogger("shardwise.operator")

COMPONENT = "shardwise-operator"
#: Events remembered (name → count); older ones are read back from the server if needed.
REMEMBERED = 4096


def _now() -> str:
    """Microseconds: Events posted within one second still sort in the order posted."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def involved(body: Mapping[str, Any]) -> dict[str, str]:
    """The ``involvedObject`` of an Event about ``body``."""
    meta = body.get("metadata") or {}
    out = {
        "apiVersion": str(body.get("apiVersion", "")),
        "kind": str(body.get("kind", "")),
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace", "")),
        "uid": str(meta.get("uid", "")),
    }
    return {k: v for k, v in out.items() if v}


def event_name(obj: Mapping[str, str], event: EventSpec) -> str:
    """``<object>.<16 hex>``: the same object saying the same thing names one Event."""
    said = "\0".join((obj.get("uid", ""), event.type, event.reason, event.message))
    digest = hashlib.sha256(said.encode()).hexdigest()[:16]
    return f"{obj.get('name', 'object')[:200]}.{digest}"


def event_body(
    obj: Mapping[str, str], event: EventSpec, name: str, now: str, instance: str
) -> dict[str, Any]:
    """A new core/v1 Event, counted once."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": obj.get("namespace") or "default"},
        "involvedObject": dict(obj),
        "type": event.type,
        "reason": event.reason,
        "message": event.message.encode()[:1024].decode(errors="ignore"),  # 1 KiB at most
        "count": 1,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "eventTime": now,
        "action": "Reconcile",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance[:128],
    }


class EventRecorder:
    """Posts Events through ``kube``, counting repeats (module docstring)."""

    def __init__(self, kube: KubeApi, instance: str | None = None) -> None:
        self.kube = kube
        self.instance = instance or os.environ.get("POD_NAME") or socket.gethostname()
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def emit(self, body: Mapping[str, Any], event: EventSpec) -> None:
        """Post ``event`` about ``body`` soon, in order; never blocks, never raises."""
        task = asyncio.get_running_loop().create_task(self._post(involved(body), event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the Events queued so far (at shutdown, and in tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _post(self, obj: dict[str, str], event: EventSpec) -> None:
        async with self._lock:
            try:
                await asyncio.to_thread(self.post, obj, event)
            except Exception as err:  # an Event is worth a log line, never a failed loop
                logger.warning("could not post Event %s about %s: %s", event.reason, obj, err)

    def post(self, obj: Mapping[str, str], event: EventSpec) -> dict[str, Any]:
        """Post now (blocking): count a repeat, else create; the Event as stored."""
        ns, name, now = obj.get("namespace") or "default", event_name(obj, event), _now()
        key = (ns, name)
        count = self._counts.get(key)
        if count is None:
            try:
                stored = self.kube.create(event_body(obj, event, name, now, self.instance))
                self._remember(key, 1)
                return stored
            except ApiError as err:
                if err.status != 409:
                    raise
                # posted before this process started (a restart): count on it
                existing = self.kube.get("v1", "events", ns, name) or {}
                count = int(existing.get("count") or 1)
        try:
            stored = self.kube.patch(
                "v1", "events", ns, name, {"count": count + 1, "lastTimestamp": now}
            )
        except ApiError as err:
            if err.status != 404:
                raise
            # expired since (the API server's Event TTL): a new series, from 1
            stored = self.kube.create(event_body(obj, event, name, now, self.instance))
            count = 0
        self._remember(key, count + 1)
        return stored

    def _remember(self, key: tuple[str, str], count: int) -> None:
        self._counts[key] = count
        self._counts.move_to_end(key)
        while len(self._counts) > REMEMBERED:
            self._counts.popitem(last=False)

"""Watches: every change is logged as an event, and a watch streams those of its kind
from a ``resourceVersion`` on (``410 Gone`` when it is older than the retained
history), with ADDED/DELETED when an object starts or stops matching a selector."""

from __future__ import annotations

import asyncio
import bisect
import copy
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kmock

from k8s.apierrors import gone
from k8s.kinds import Key, Kind, metadata

HISTORY = 50_000  # watch events kept for watches "from a resourceVersion"


@dataclass
class Event:
    rv: int
    key: Key
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class EventLog:
    """Every change, in ``resourceVersion`` order (the latest ``HISTORY`` of them), and
    the event that wakes the watches waiting for the next one."""

    events: list[Event] = field(default_factory=list)
    rvs: list[int] = field(default_factory=list)
    changed: asyncio.Event | None = None

    def append(self, event: Event) -> None:
        self.events.append(event)
        self.rvs.append(event.rv)
        if len(self.events) > HISTORY:
            del self.events[: HISTORY // 10]
            del self.rvs[: HISTORY // 10]
        if self.changed is not None:
            self.changed.set()
        self.changed = asyncio.Event()


class Watches:
    """The watch handler of :class:`k8s.emulator.ApiEmulator`, and its event log."""

    __slots__ = ()
    _store: dict[tuple[Key, str | None, str], dict[str, Any]]
    _rv: int
    _events: EventLog
    _mutex: threading.RLock
    _kind: Callable[[kmock.Request], Kind]
    _matching: Callable[[Kind, str | None, Mapping[str, str]], Callable[[dict[str, Any]], bool]]

    def _record(
        self, key: Key, type_: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        self._events.append(Event(self._rv, key, type_, copy.deepcopy(obj), old))

    def _oldest_watchable(self) -> int:
        rvs = self._events.rvs
        return rvs[0] - 1 if rvs else self._rv

    async def _watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        kind = self._kind(request)
        match = self._matching(kind, request.namespace, request.params)
        if request.name is not None:
            name, inner = request.name, match
            match = lambda o: inner(o) and metadata(o).get("name") == name  # noqa: E731
        since_raw = request.params.get("resourceVersion") or ""
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        yield b""  # the headers go out now, as a real watch does
        with self._mutex:
            if since_raw in ("", "0"):
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for (key, _, _), o in self._store.items()
                    if key == kind.key and match(o)
                ]
                cursor = self._rv
            else:
                initial, cursor = [], int(since_raw)
                if cursor < self._oldest_watchable():
                    initial = [gone(cursor)]
                    cursor = -1
        for item in initial:
            yield item
        if cursor < 0:
            return
        while True:
            with self._mutex:
                start = bisect.bisect_right(self._events.rvs, cursor)
                events = self._events.events[start:]
                waiter = self._events.changed
            for ev in events:
                cursor = ev.rv
                if ev.key != kind.key:
                    continue
                now_in, was_in = match(ev.obj), ev.old is not None and match(ev.old)
                if ev.type == "MODIFIED" and now_in != was_in:
                    yield {"type": "ADDED" if now_in else "DELETED", "object": ev.obj}
                elif now_in or (ev.type == "DELETED" and was_in):
                    yield {"type": ev.type, "object": ev.obj}
            if waiter is None:
                waiter = self._events.changed = asyncio.Event()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(waiter.wait(), remaining)
            except TimeoutError:
                return

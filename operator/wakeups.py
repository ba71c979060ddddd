"""Wake-up calls for the per-DLRMJob reconcile loops.

Kopf delivers each watch event once, to the handler of that resource kind; the job's
loop, sleeping in its daemon, must hear about its children, the nodes and the cost
models too. Event handlers call :meth:`Wakeups.wake` (and friends); the loop waits on
its :class:`asyncio.Event`. Everything runs on the operator's event loop.
"""

from __future__ import annotations

import asyncio


class Wakeups:
    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def register(self, namespace: str, name: str) -> asyncio.Event:
        event = self._events.setdefault((namespace, name), asyncio.Event())
        event.set()  # reconcile at once
        return event

    def unregister(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)

    def wake(self, namespace: str | None, name: str | None) -> None:
        event = self._events.get((namespace or "", name or ""))
        if event is not None:
            event.set()

    def wake_namespace(self, namespace: str | None) -> None:
        for (ns, _), event in self._events.items():
            if ns == namespace:
                event.set()

    def wake_all(self) -> None:
        for event in self._events.values():
            event.set()

    def __len__(self) -> int:
        return len(self._events)

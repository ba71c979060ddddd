"""While a job's tables ConfigMap cannot be read, watch that one ConfigMap.

The operator's watches select its own ConfigMaps by label (server-side); the user's
tables ConfigMap carries none, so no watch sees it. Without this, the fix (creating
the ConfigMap, or correcting its file) would wait for the backed-off retry, up to
``max_tables_retry_seconds`` (10 min). With it, the job is woken and reads the tables at
once.

One watch per job and only while its tables fail: a field selector on the name, from
the resourceVersion of a list, so it reports changes, not the object as it already
is. A missing ConfigMap that exists by the time the list runs wakes the job at once.
The watch runs in a daemon thread (the API client blocks); stopping it closes its
response, so no thread outlives the job's loop by more than a read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from shardwise.operator.context import OperatorContext

logger = logging.getLogger("shardwise.operator")

#: Seconds the server holds one watch open; then it is opened again.
WATCH_SECONDS = 60
#: Seconds to wait after a failed list or watch before trying again.
RETRY_SECONDS = 5.0


class TablesWatch:
    """The watch of one job's tables ConfigMap (at most one at a time)."""

    def __init__(self, ctx: OperatorContext, namespace: str, job: str) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.job = job
        self.following: tuple[str, bool] | None = None
        self._stop: threading.Event | None = None
        self._response: Any = None
        #: Orders a stop against a watch being opened: a watch opened after its stop
        #: is ended at once (under load, one outlived its stop by its whole timeout).
        self._lock = threading.Lock()
        self._changed = threading.Event()

    def follow(self, configmap: str | None, exists: bool = False) -> None:
        """Watch ``configmap`` (``None``: watch nothing); ``exists`` is what the failed
        read saw (a missing one that is there now is a change)."""
        want = None if configmap is None else (configmap, exists)
        if want == self.following:
            return
        self.stop()
        if want is None:
            return
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        self.following, self._stop = want, stop
        threading.Thread(
            target=self._run,
            args=(want[0], want[1], stop, loop),
            name=f"shardwise tables watch {self.namespace}/{want[0]}",
            daemon=True,
        ).start()

    def take_change(self) -> bool:
        """Whether the ConfigMap changed since the last call (then read it at once)."""
        changed = self._changed.is_set()
        self._changed.clear()
        return changed

    def stop(self) -> None:
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                if self._response is not None:
                    _shut(self._response)
            self.following, self._stop, self._response = None, None, None

    def _changed_now(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        if stop.is_set():
            return
        self._changed.set()
        try:
            loop.call_soon_threadsafe(self.ctx.wakeups.wake, self.namespace, self.job)
        except RuntimeError:  # the event loop is closed: the operator is exiting
            stop.set()

    def _opened(self, stop: threading.Event, response: Any) -> None:
        with self._lock:
            if stop.is_set():
                _shut(response)
            else:
                self._response = response

    def _run(
        self, name: str, exists: bool, stop: threading.Event, loop: asyncio.AbstractEventLoop
    ) -> None:
        selector = f"metadata.name={name}"
        version = ""
        while not stop.is_set():
            try:
                if not version:
                    items, version = self.ctx.kube.list_version(
                        "v1", "configmaps", self.namespace, selector
                    )
                    if bool(items) != exists:
                        self._changed_now(loop, stop)
                for event in self.ctx.kube.watch(
                    "v1", "configmaps", self.namespace, field_selector=selector,
                    resource_version=version, timeout_seconds=WATCH_SECONDS,
                    opened=lambda r: self._opened(stop, r),
                ):  # fmt: skip
                    kind = event.get("type")
                    obj = event.get("object") or {}
                    if kind == "ERROR":  # e.g. 410 Gone: list again
                        version = ""
                        break
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._changed_now(loop, stop)
            except Exception as err:
                if stop.is_set():
                    return
                logger.debug("watching ConfigMap %s/%s: %s", self.namespace, name, err)
                version = ""
                stop.wait(RETRY_SECONDS)


def _shut(response: Any) -> None:
    """End a watch's response, unblocking a read in progress (urllib3 >= 2.3); one
    already closed is fine."""
    with contextlib.suppress(Exception):
        response.shutdown()

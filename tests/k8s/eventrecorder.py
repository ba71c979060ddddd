"""client-go's event recorder (``tools/record``), as kube-controller-manager's controllers
post core/v1 Events, for the stand-in controllers.

- an Event is named ``<object>.<hex nanoseconds>``, about the object (kind, name,
  namespace, uid, apiVersion, resourceVersion), with ``source.component`` and
  ``reportingComponent`` the controller's, ``count``, ``firstTimestamp`` and
  ``lastTimestamp``;
- the correlator: the same event again (object, type, reason, message) raises the
  count of the one posted (a patch); after 10 *similar* ones (the same but for the
  message) within 10 minutes, the next are folded into one Event whose message is
  ``(combined from similar events): <the latest message>``, counted the same way.

Not done: the spam filter's token bucket (25 events, one more per 5 minutes, per
object), which the stand-ins' own backoff keeps them far from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from k8s.helpers import now
from shardwise.operator.kube import ApiError, KubeApi

#: The correlator's defaults: similar events folded after this many, within this window.
MAX_SIMILAR = 10
SIMILAR_WINDOW_SECONDS = 600.0
COMBINED = "(combined from similar events): "


class EventRecorder:
    def __init__(self, kube: KubeApi, component: str) -> None:
        self.kube, self.component = kube, component
        self._posted: dict[tuple[str, ...], tuple[str, int]] = {}  # key → (name, count)
        self._similar: dict[tuple[str, ...], tuple[float, set[str]]] = {}

    def event(
        self,
        obj: Mapping[str, Any],
        type_: str,
        reason: str,
        message: str,
        *,
        kind: str,
        api_version: str,
    ) -> None:
        """Record an Event about ``obj`` (a list's items carry no kind: it is given)."""
        meta = obj.get("metadata") or {}
        about = (str(meta.get("uid")), type_, reason)
        first, messages = self._similar.get(about, (time.monotonic(), set()))
        if time.monotonic() - first > SIMILAR_WINDOW_SECONDS:
            first, messages = time.monotonic(), set()
        messages.add(message)
        self._similar[about] = (first, messages)
        if len(messages) > MAX_SIMILAR:
            key, message = (*about, COMBINED), COMBINED + message
        else:
            key = (*about, message)
        stamp = now()
        posted = self._posted.get(key)
        if posted is not None:
            name, count = posted
            patch = {"count": count + 1, "lastTimestamp": stamp, "message": message}
            try:
                self.kube.patch("v1", "events", meta.get("namespace"), name, patch)
                self._posted[key] = (name, count + 1)
                return
            except ApiError as err:
                if err.status != 404:
                    raise
        name = f"{meta.get('name')}.{time.time_ns():x}"
        self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": meta.get("namespace")},
                "involvedObject": {
                    "apiVersion": api_version,
                    "kind": kind,
                    "name": meta.get("name"),
                    "namespace": meta.get("namespace"),
                    "uid": meta.get("uid"),
                    "resourceVersion": meta.get("resourceVersion"),
                },
                "reason": reason,
                "message": message,
                "type": type_,
                "source": {"component": self.component},
                "reportingComponent": self.component,
                "reportingInstance": "",
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
            }
        )
        self._posted[key] = (name, 1)

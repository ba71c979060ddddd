"""The requests a test counts: kmock records each one; these name them by verb."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kmock


@dataclass
class RecordedCall:
    """One request as a test counts it."""

    verb: str  # create, get, list, watch, patch, put, delete
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    data: Any = field(repr=False, default=None)
    #: The ``labelSelector`` of a list or watch ("" without one): the operator's own
    #: lookups select by label, kopf's watch streams (and their initial lists) do not.
    selector: str = ""


_VERBS: dict[tuple[str, bool, Any], str] = {
    ("GET", False, kmock.action.LIST): "list",
    ("GET", False, kmock.action.WATCH): "watch",
    ("GET", True, kmock.action.WATCH): "watch",
    ("GET", True, kmock.action.FETCH): "get",
    ("POST", False, kmock.action.CREATE): "create",
    ("PATCH", True, kmock.action.UPDATE): "patch",
    ("PUT", True, None): "put",
    ("DELETE", True, kmock.action.DELETE): "delete",
}


class Recording:
    """The request counters of :class:`k8s.emulator.ApiEmulator`."""

    __slots__ = ()
    _requests: list[kmock.Request]

    def calls(self) -> list[RecordedCall]:
        """Every request so far, as verbs (thread-safe snapshot)."""
        out = []
        for r in list(self._requests):
            verb = _VERBS.get((str(r.method.value), r.name is not None, r.action))
            if verb is None or r.resource is None:
                continue
            out.append(
                RecordedCall(
                    verb,
                    r.resource.plural or "",
                    r.namespace,
                    r.name,
                    r.subresource,
                    r.data,
                    str(r.params.get("labelSelector") or ""),
                )
            )
        return out

    def count(
        self,
        verb: str,
        plural: str,
        *,
        name: str | None = None,
        subresource: str | None = "*",
        namespace: str | None = None,
        selected: bool = False,
    ) -> int:
        """How many ``verb`` requests for ``plural`` (and ``name``) were made;
        ``selected``: only those with a label selector (the operator's own lookups)."""
        return sum(
            1
            for c in self.calls()
            if c.verb == verb
            and c.plural == plural
            and (name is None or c.name == name)
            and (subresource == "*" or c.subresource == subresource)
            and (namespace is None or c.namespace == namespace)
            and (not selected or bool(c.selector))
        )

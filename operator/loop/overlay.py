"""One job loop's memory of its own creates and deletes, laid over the kopf indexes.

The indexes learn of a write a moment after it is made (when its watch event arrives),
so the loop keeps what it created and deleted itself: a created object shows before
its watch event arrives, a deleted one shows as deleting until the index drops it.
Without it, a reconcile right after a create would create again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shardwise import names
from shardwise.operator.cluster.summaries import ChildRef, child_ref, job_state, plan_record

T = TypeVar("T")
#: How long this loop trusts its own record of a create over the index's silence.
OVERLAY_SECONDS = 60.0


def ref_of(x: Any) -> ChildRef:
    """The :class:`ChildRef` of a summary (a ChildRef, or one that has a ``ref``)."""
    ref: ChildRef = x if isinstance(x, ChildRef) else x.ref
    return ref


def as_deleting(x: Any) -> Any:
    """The summary, marked as being deleted."""
    if isinstance(x, ChildRef):
        return dataclasses.replace(x, deleting=True)
    return dataclasses.replace(x, ref=dataclasses.replace(x.ref, deleting=True))


class Overlay:
    """What this loop created and deleted, until the index shows it."""

    def __init__(self) -> None:
        #: (kind, name) → (summary, when) of what this loop created, until the index
        #: shows that very object (same uid), or for OVERLAY_SECONDS at most.
        self.created: dict[tuple[str, str], tuple[Any, float]] = {}
        #: (kind, name) → uid this loop deleted, until the index drops it.
        self.deleted: dict[tuple[str, str], str] = {}

    def remember(self, obj: Mapping[str, Any]) -> None:
        """An object this loop created, patched or adopted (as the API answered). Of
        the ConfigMaps only plans are read back (a profiling pod's tables are not)."""
        kind = str(obj.get("kind", ""))
        summary: Any = child_ref(obj)
        if kind == "Job":
            summary = job_state(obj)
        elif kind == "ConfigMap":
            if summary.labels.get(names.LABEL_COMPONENT) != names.COMPONENT_PLAN:
                return
            summary = plan_record(obj)
        self.created[(kind, ref_of(summary).name)] = (summary, time.monotonic())

    def deleting(self, kind: str, name: str, uid: str) -> None:
        """An object this loop asked the API server to delete."""
        created = self.created.pop((kind, name), None)
        if created is not None:
            self.created[(kind, name)] = (as_deleting(created[0]), created[1])
        self.deleted[(kind, name)] = uid

    def children(self, kind: str, indexed: list[T], ref: Callable[[T], ChildRef]) -> list[T]:
        """The index's view, corrected by this loop's own recent creates and deletes:
        a created object shows before its watch event arrives, a deleted one shows as
        deleting until the index drops it."""
        seen = {(ref(x).name, ref(x).uid) for x in indexed}
        now = time.monotonic()
        for key, (summary, when) in list(self.created.items()):
            mine = ref_of(summary)
            if key[0] == kind and ((mine.name, mine.uid) in seen or now - when > OVERLAY_SECONDS):
                del self.created[key]
        for key, uid in list(self.deleted.items()):
            if key[0] == kind and (key[1], uid) not in seen:
                del self.deleted[key]
        overlay = {k[1]: v for k, (v, _) in self.created.items() if k[0] == kind}
        out = [
            as_deleting(x) if self.deleted.get((kind, ref(x).name)) == ref(x).uid else x
            for x in indexed
            if ref(x).name not in overlay or ref(x).deleting or ref(x).uid in self.deleted.values()
        ]
        # Live objects first: a replacement shows before the one it replaces.
        return sorted([*out, *overlay.values()], key=lambda x: ref_of(x).deleting)

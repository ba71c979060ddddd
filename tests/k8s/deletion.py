"""Deletion as the API server and its controllers carry it out: finalizers
(``deletionTimestamp``, deletion when the last one is removed), garbage collection by
``ownerReferences`` (background, foreground and orphan propagation; dependents whose
owners no longer exist are deleted), and graceful deletion of pods bound to a node: they
stay ``Terminating`` (deletionTimestamp = now + their grace period) until the node's
kubelet confirms, which a Ready node's does at once and a NotReady or missing node's
never does; ``gracePeriodSeconds: 0`` deletes at once, and deleting the node removes its
pods (the pod garbage collector)."""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Callable
from typing import Any

import kmock

from k8s.apierrors import error, not_found
from k8s.kinds import NODES, PODS, Key, Kind, now

_DONE = ("Succeeded", "Failed")


class Deletion:
    """The DELETE handler of :class:`k8s.emulator.ApiEmulator`, and the removals that
    follow from one."""

    __slots__ = ()
    _store: dict[tuple[Key, str | None, str], dict[str, Any]]
    _rv: int
    _mutex: threading.RLock
    _kind: Callable[[kmock.Request], Kind]
    _namespace: Callable[[Kind, kmock.Request], str | None]
    _next_rv: Callable[[], int]
    _record: Callable[[Key, str, dict[str, Any], dict[str, Any] | None], None]
    _drop_crd: Callable[[dict[str, Any]], None]

    async def _delete(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        options = request.data if isinstance(request.data, dict) else {}
        policy = (
            request.params.get("propagationPolicy")
            or options.get("propagationPolicy")
            or "Background"
        )
        preconditions = options.get("preconditions") or {}
        key = (kind.key, self._namespace(kind, request), request.name or "")
        with self._mutex:
            obj = self._store.get(key)
            if obj is None:
                raise not_found(kind, request.name)
            for f in ("uid", "resourceVersion"):
                if preconditions.get(f) and preconditions[f] != obj["metadata"].get(f):
                    raise error(
                        409, "Conflict", f"Precondition failed: {f} in precondition differs"
                    )
            if request.params.get("dryRun") == "All":
                return copy.deepcopy(obj)
            if policy == "Foreground" and self._dependents(obj["metadata"]["uid"]):
                return self._delete_foreground(key)
            grace = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
            if self._awaits_kubelet(key, grace):
                return copy.deepcopy(obj)
            if obj["metadata"].get("finalizers"):
                self._mark_deleted(key)
                return copy.deepcopy(obj)
            self._remove(key, orphan=policy == "Orphan")
            return copy.deepcopy(obj)

    def _mark_deleted(self, key: tuple[Key, str | None, str]) -> None:
        """An object with finalizers is not removed: it gets a ``deletionTimestamp`` (once)
        and stays until its last finalizer is."""
        obj = self._store[key]
        if not obj["metadata"].get("deletionTimestamp"):
            old = copy.deepcopy(obj)
            obj["metadata"]["deletionTimestamp"] = now()
            obj["metadata"]["resourceVersion"] = str(self._next_rv())
            self._record(key[0], "MODIFIED", obj, old)

    def _remove(self, key: tuple[Key, str | None, str], orphan: bool = False) -> None:
        obj = self._store.pop(key)
        self._next_rv()
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._record(key[0], "DELETED", gone, obj)
        if key[0] == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._drop_crd(obj)
        if key[0] == NODES:
            self._settle_pods_on(key[2])
        self._collect(obj, orphan=orphan)
        for ref in obj["metadata"].get("ownerReferences") or []:
            self._finish_foreground(str(ref.get("uid")))

    # ------------------------------------------------------------------ foreground deletion
    def _dependents(self, uid: str) -> list[tuple[Key, str | None, str]]:
        return [
            k
            for k, o in self._store.items()
            if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
        ]

    def _delete_foreground(self, key: tuple[Key, str | None, str]) -> dict[str, Any]:
        """The owner stays (``deletionTimestamp``, finalizer ``foregroundDeletion``) until
        its dependents are gone; then the garbage collector removes it."""
        obj = self._store[key]
        old = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.setdefault("deletionTimestamp", now())
        meta["finalizers"] = [*(meta.get("finalizers") or []), "foregroundDeletion"]
        meta["resourceVersion"] = str(self._next_rv())
        self._record(key[0], "MODIFIED", obj, old)
        result = copy.deepcopy(obj)
        for dep in self._dependents(meta["uid"]):
            if dep in self._store:
                self._delete_dependent(dep, owner_gone=meta["uid"])
        self._finish_foreground(meta["uid"])
        return result

    def _finish_foreground(self, uid: str) -> None:
        owner = next((k for k, o in self._store.items() if o["metadata"]["uid"] == uid), None)
        if owner is None:
            return
        meta = self._store[owner]["metadata"]
        if "foregroundDeletion" not in (meta.get("finalizers") or []) or self._dependents(uid):
            return
        old = copy.deepcopy(self._store[owner])
        meta["finalizers"] = [f for f in meta["finalizers"] if f != "foregroundDeletion"]
        if not meta["finalizers"]:
            del meta["finalizers"]
            self._remove(owner)
            return
        meta["resourceVersion"] = str(self._next_rv())
        self._record(owner[0], "MODIFIED", self._store[owner], old)

    # ------------------------------------------------------------------ garbage collection
    def _live_uids(self) -> set[str]:
        return {o["metadata"]["uid"] for o in self._store.values()}

    def _collect(self, owner: dict[str, Any], orphan: bool = False) -> None:
        """Delete (or orphan) the dependents of a removed owner, as the garbage collector."""
        uid = owner["metadata"]["uid"]
        for key, obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if key not in self._store or not any(r.get("uid") == uid for r in refs):
                continue
            if orphan:
                old = copy.deepcopy(obj)
                obj["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                obj["metadata"]["resourceVersion"] = str(self._next_rv())
                self._record(key[0], "MODIFIED", obj, old)
                continue
            self._delete_dependent(key)

    def _delete_dependent(self, key: tuple[Key, str | None, str], owner_gone: str = "") -> None:
        obj = self._store[key]
        live = self._live_uids() - {owner_gone}
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs or any(r.get("uid") in live for r in refs):
            return  # no owner (orphaned meanwhile), or another owner is still there
        if self._awaits_kubelet(key, None):
            return
        if obj["metadata"].get("finalizers"):
            self._mark_deleted(key)
            return
        self._remove(key)

    # ------------------------------------------------------------------ graceful pod deletion
    def _kubelet_alive(self, node: str) -> bool:
        """A Ready node's kubelet confirms a deletion at once (the stand-in for stopping
        the containers); a NotReady or missing node's kubelet never does."""
        obj = self._store.get((NODES, None, node))
        conditions = ((obj or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _awaits_kubelet(self, key: tuple[Key, str | None, str], grace: Any) -> bool:
        """Delete a pod as the API server does: one bound to a node and not finished is
        only marked (``deletionTimestamp`` = now + its grace period) until the node's
        kubelet confirms; ``True`` when it now waits for a kubelet that will not."""
        obj = self._store[key]
        spec, meta = obj.get("spec") or {}, obj["metadata"]
        node = spec.get("nodeName")
        if key[0] != PODS or not node or (obj.get("status") or {}).get("phase") in _DONE:
            return False
        seconds = int(spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)
        if seconds <= 0 or self._kubelet_alive(str(node)):
            return False  # forced, or confirmed at once: deleted now (finalizers permitting)
        if not meta.get("deletionTimestamp"):
            old = copy.deepcopy(obj)
            due = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
            meta["deletionTimestamp"] = due.strftime("%Y-%m-%dT%H:%M:%SZ")
            meta["deletionGracePeriodSeconds"] = seconds
            meta["resourceVersion"] = str(self._next_rv())
            self._record(key[0], "MODIFIED", obj, old)
        return True

    def _settle_pods_on(self, node: str) -> None:
        """Terminating pods on ``node`` go once its kubelet is back (Ready), or when the
        node is deleted (the pod garbage collector removes pods of nodes that are gone)."""
        gone = (NODES, None, node) not in self._store
        if not gone and not self._kubelet_alive(node):
            return
        for key, obj in list(self._store.items()):
            if (
                key[0] == PODS
                and (obj.get("spec") or {}).get("nodeName") == node
                and obj["metadata"].get("deletionTimestamp")
                and not obj["metadata"].get("finalizers")
            ):
                self._remove(key)

    def _collect_orphan(self, key: tuple[Key, str | None, str]) -> None:
        """An object created with owners that do not exist is collected, as on a cluster."""
        with self._mutex:
            if key in self._store:
                self._delete_dependent(key)

"""A Kubernetes API server in memory, faithful where the operator depends on it.

Built on kmock's :class:`~kmock.KubernetesScaffold` (HTTP server, API discovery, request
recording, reactions a test can add in front of the defaults). What it adds over
kmock's own ``KubernetesEmulator``, which merges dicts and stamps nothing:

- metadata stamped by the server: ``uid``, ``resourceVersion`` (one global counter),
  ``creationTimestamp``, ``generation`` (bumped only when the spec changes), the
  namespace from the URL, ``generateName``;
- the ``status`` subresource: a write to the object ignores ``status``, a write to
  ``/status`` changes nothing else; a no-op write bumps nothing and emits no event;
- ``409`` on duplicates and on a stale ``resourceVersion``; ``404`` as the API words it
  (:mod:`k8s.apierrors`);
- ``422`` from a CRD's ``openAPIV3Schema`` (pruning, defaults, the OpenAPI keywords,
  list-map and set keys, CEL rules, in the API server's order and words: fields,
  values and messages as the server reports them, ``<nil>`` for a root rule;
  :mod:`k8s.schema`), with the status subresource checked against the status schema;
  from invalid names and labels, from immutable ConfigMaps and Job templates (but the
  scheduling directives of a suspended Job that has not started), a Job's
  ``completions`` changed (an Indexed Job's only in tandem with ``parallelism``), a
  pod's scheduling gate added, and from ConfigMaps over 1 MiB (:mod:`k8s.kinds`); a
  422's message lists each distinct cause once;
- a Job's and a Pod's defaults (:mod:`k8s.kinds`: a host-network pod's ports get their
  ``containerPort`` as ``hostPort``, as Pods, not templates, do since 1.28, and any
  other ``hostPort`` on the host's network is a 422);
- ``403`` from the admission plugins that refuse pods (:mod:`k8s.admission`): an
  unknown PriorityClass, Pod Security by the namespace's ``enforce`` label
  (:mod:`k8s.podsecurity`), ResourceQuota;
- list responses with ``kind``/``apiVersion`` and the list's ``resourceVersion``
  (items of built-in kinds carry no ``kind``, as on a real server), label and field
  selectors, ``limit``/``continue``;
- watches from a ``resourceVersion``, with ADDED/DELETED as objects enter or leave a
  selector (:mod:`k8s.watches`);
- finalizers, garbage collection by ``ownerReferences``, and graceful deletion of pods
  bound to a node, which a NotReady or missing node's kubelet never confirms
  (:mod:`k8s.deletion`);
- CRDs: creating one is refused as the API server refuses it (:mod:`k8s.crds`: names,
  versions, structural schema, every ``default`` against its schema and CEL rules as
  written, list types, rule compilation and estimated cost), else serves its resource
  (discovery included), its objects validated as above.

Simplifications (documented, not hidden): namespaces need not exist; there are no
controllers (no pods for Jobs, no kubelet beyond confirming deletions): tests patch Job
and Pod status as the controllers would; strategic merge patch merges lists by
``name`` only; no bookmarks; updates are validated as creates (no ratcheting of
unchanged invalid fields, no ``oldSelf`` rules); :mod:`k8s.schema` and :mod:`k8s.crds`,
and the modules they name, list what of the schema and CRD checks is not emulated.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import kmock
from kmock import KubernetesError, ResourceInfo
from kmock import resource as kresource

from k8s import admission, patches, selectors
from k8s.apierrors import error, invalid, not_found, qualified_kind
from k8s.crds import crd_causes, crd_defaults
from k8s.deletion import Deletion
from k8s.dispatch import serve
from k8s.kinds import (
    BUILTIN_KINDS,
    NAMESPACES,
    NODES,
    PODS,
    PRIORITY_CLASSES,
    QUOTAS,
    Key,
    Kind,
    crd_kinds,
    crd_status,
    immutable_part,
    job_defaults,
    metadata,
    metadata_causes,
    now,
    pod_defaults,
)
from k8s.recording import Recording
from k8s.routing import namespace_request
from k8s.watches import EventLog, Watches

_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"


def _without(obj: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


@attrs.define(kw_only=True)
class ApiEmulator(Deletion, Watches, Recording, kmock.KubernetesScaffold):
    """The emulated API server; see the module docstring for what it honours."""

    _kinds: dict[Key, Kind] = attrs.field(factory=dict, init=False)
    _store: dict[tuple[Key, str | None, str], dict[str, Any]] = attrs.field(
        factory=dict, init=False
    )
    _rv: int = attrs.field(default=0, init=False)
    _generated: int = attrs.field(default=0, init=False)
    _events: EventLog = attrs.field(factory=EventLog, init=False)
    _mutex: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    unexpected: list[BaseException] = attrs.field(factory=list, init=False)
    #: Opt-in authorization (e.g. :class:`k8s.rbac.RbacAuthorizer`): called with each raw
    #: request before anything else; a response it returns (401, 403) is the answer.
    authorizer: Callable[[Any], Any] | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in BUILTIN_KINDS:
            self._serve(copy.copy(kind))
        self.fallback[kmock.action.LIST] << self._list
        self.fallback[kmock.action.WATCH] << self._watch
        self.fallback[kmock.action.FETCH] << self._get
        self.fallback[kmock.action.CREATE] << self._create
        self.fallback[kmock.action.UPDATE] << self._patch
        self.fallback[kmock.action.DELETE] << self._delete
        self.fallback[kmock.method.PUT] << self._put

    # ------------------------------------------------------------------ requests
    async def __call__(self, raw_request: Any) -> Any:
        """Authorized first (when an authorizer is set); namespaces paths are parsed by
        :mod:`k8s.routing`, everything else by kmock."""
        if self.authorizer is not None and (refused := self.authorizer(raw_request)) is not None:
            return refused
        request = await namespace_request(raw_request, len(self._requests))
        if request is None:
            return await super().__call__(raw_request)
        self._requests.append(request)
        try:
            return await self._handle(request)
        except KubernetesError as err:
            return await self._render_error(err)

    async def _handle(self, request: kmock.Request) -> Any:
        """kmock's dispatch, in time that does not grow with the requests served."""
        return await serve(self, request)

    # ------------------------------------------------------------------ kinds
    def _serve(self, kind: Kind) -> None:
        self._kinds[kind.key] = kind
        self.resources[kresource(*kind.key)] = ResourceInfo(
            kind=kind.kind,
            namespaced=kind.namespaced,
            singular=kind.singular or kind.kind.lower(),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            shortnames=set(kind.short_names),
            subresources={"status"} if kind.status else set(),
        )

    def _unserve(self, key: Key) -> None:
        self._kinds.pop(key, None)
        res = kresource(*key)
        if res in self.resources:
            del self.resources[res]

    def _kind(self, request: kmock.Request) -> Kind:
        res = request.resource
        key = (res.group or "", res.version or "", res.plural or "") if res else ("", "", "")
        kind = self._kinds.get(key)
        if kind is None:
            raise error(404, "NotFound", "the server could not find the requested resource")
        if request.subresource not in (None, "status") or (
            request.subresource == "status" and not kind.status
        ):
            raise error(404, "NotFound", "the server could not find the requested resource")
        return kind

    def _namespace(self, kind: Kind, request: kmock.Request) -> str | None:
        return request.namespace if kind.namespaced else None

    # ------------------------------------------------------------------ test helpers
    def objects(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Stored objects of ``plural`` (deep copies; thread-safe)."""
        with self._mutex:
            return [
                copy.deepcopy(obj)
                for (key, ns, _), obj in self._store.items()
                if key[2] == plural and (namespace is None or ns == namespace)
            ]

    # ------------------------------------------------------------------ store internals
    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    # ------------------------------------------------------------------ validation
    def _admit(self, kind: Kind, obj: dict[str, Any], request: kmock.Request) -> dict[str, Any]:
        """Prune, default and validate a custom resource (or check a built-in, or a CRD as
        :mod:`k8s.crds` does); a 422 in the server's words if bad."""
        causes = metadata_causes(kind, obj)
        if kind.schema is not None:
            obj, dropped = kind.schema.admit(obj)
            if dropped and request.params.get("fieldValidation") == "Strict":
                raise error(
                    400, "BadRequest", f"strict decoding error: unknown field {dropped[0]!r}"
                )
            if request.subresource == "status":
                causes += kind.schema.validate_status(obj)
            else:
                causes += kind.schema.validate(obj)
        if kind.validate is not None:
            causes += kind.validate(obj)
        if kind.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            obj = crd_defaults(obj)
            causes += crd_causes(obj)
        if causes:
            name = metadata(obj).get("name", "")
            raise invalid(kind, name, causes)
        return obj

    # ------------------------------------------------------------------ pod admission
    def _pods_in(self, namespace: str | None) -> list[dict[str, Any]]:
        return [o for (k, ns, _), o in self._store.items() if k == PODS and ns == namespace]

    def _admit_pod(self, pod: dict[str, Any], namespace: str | None, before_name: bool) -> None:
        """The admission plugins' 403s (:mod:`k8s.admission`): Priority before the name
        is generated; PodSecurity, then ResourceQuota, after the object is validated."""
        if before_name:
            known = [name for (k, _, name) in self._store if k == PRIORITY_CLASSES]
            why = admission.priority_refusal(pod, known)
        else:
            ns = self._store.get((NAMESPACES, None, namespace or ""))
            quotas = [o for (k, n, _), o in self._store.items() if k == QUOTAS and n == namespace]
            why = admission.pod_security_refusal(pod, ns) or admission.quota_refusal(
                pod, quotas, self._pods_in(namespace)
            )
        if why is not None:
            raise error(403, "Forbidden", why, name=admission.pod_name(pod), kind="pods")

    def _count_quota(self, namespace: str | None) -> None:
        """Each quota of the namespace counts the pods again (its ``status.used``)."""
        pods = self._pods_in(namespace)
        for key, quota in list(self._store.items()):
            if key[0] == QUOTAS and key[1] == namespace:
                status = admission.quota_status(quota, pods)
                if status != quota.get("status"):
                    new = {**quota, "status": status}
                    new["metadata"] = {**quota["metadata"], "resourceVersion": str(self._next_rv())}
                    self._store[key] = new
                    self._record(QUOTAS, "MODIFIED", new, quota)

    # ------------------------------------------------------------------ reading
    async def _get(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        with self._mutex:
            obj = self._store.get((kind.key, self._namespace(kind, request), request.name or ""))
            if obj is None:
                raise not_found(kind, request.name)
            return copy.deepcopy(obj)

    def _matching(
        self, kind: Kind, namespace: str | None, params: Mapping[str, str]
    ) -> Callable[[dict[str, Any]], bool]:
        try:
            labels = selectors.parse_label_selector(params.get("labelSelector"))
            fields = selectors.parse_field_selector(params.get("fieldSelector"))
        except selectors.SelectorError as err:
            raise error(400, "BadRequest", str(err)) from None

        def match(obj: dict[str, Any]) -> bool:
            ns = metadata(obj).get("namespace")
            return (
                (namespace is None or ns == namespace)
                and selectors.labels_match(labels, obj)
                and selectors.fields_match(fields, obj)
            )

        return match

    def _as_item(self, kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        return copy.deepcopy(obj) if kind.custom else _without(obj, "kind", "apiVersion")

    async def _list(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        match = self._matching(kind, request.namespace, request.params)
        with self._mutex:
            items = [
                self._as_item(kind, obj)
                for (key, _, _), obj in sorted(
                    self._store.items(), key=lambda kv: (kv[0][1] or "", kv[0][2])
                )
                if key == kind.key and match(obj)
            ]
            rv = str(self._rv)
        start = int(request.params.get("continue") or 0)
        limit = int(request.params.get("limit") or 0)
        more = ""
        if limit:
            more = str(start + limit) if start + limit < len(items) else ""
            items = items[start : start + limit]
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": rv, **({"continue": more} if more else {})},
            "items": items,
        }

    # ------------------------------------------------------------------ writing
    async def _create(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        if request.subresource:
            raise error(405, "MethodNotAllowed", "create is not supported on a subresource")
        obj = request.data
        if not isinstance(obj, dict):
            raise error(400, "BadRequest", "the request body must be a JSON object")
        # Like the API server's decoder, missing type fields default to the URL's.
        if (
            obj.get("kind", kind.kind) != kind.kind
            or obj.get("apiVersion", kind.api_version) != kind.api_version
        ):
            raise error(
                400,
                "BadRequest",
                f"the object's kind/apiVersion {obj.get('kind')}/{obj.get('apiVersion')} "
                f"do not match the URL's {kind.kind}/{kind.api_version}",
            )
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        namespace = self._namespace(kind, request)
        if kind.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise error(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request",
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if kind.key == PODS:
            pod_defaults(obj)  # defaulting happens as the body is decoded, before admission
        with self._mutex:
            if kind.key == PODS:
                self._admit_pod(obj, namespace, before_name=True)
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise error(422, "Invalid", "name or generateName is required")
                self._generated += 1
                n, tail = self._generated, ""
                for _ in range(5):
                    n, r = divmod(n * 7919 + 13, len(_SUFFIX))
                    tail += _SUFFIX[r]
                meta["name"] = meta["generateName"] + tail
            for k in (
                "uid",
                "resourceVersion",
                "creationTimestamp",
                "deletionTimestamp",
                "generation",
            ):
                meta.pop(k, None)
            if kind.status:
                obj.pop("status", None)
            if kind.key == ("batch", "v1", "jobs"):
                job_defaults(obj)
            obj = self._admit(kind, obj, request)
            if kind.key == PODS:
                self._admit_pod(obj, namespace, before_name=False)
            key = (kind.key, namespace, obj["metadata"]["name"])
            if key in self._store:
                raise error(
                    409,
                    "AlreadyExists",
                    f'{kind.qualified} "{key[2]}" already exists',
                    name=key[2],
                    group=kind.group,
                    kind=kind.plural,
                )
            if request.params.get("dryRun") == "All":
                return kmock.Response(status=201, payload=obj)
            meta = obj["metadata"]
            # Random, as an API server's: two emulators (tests on two xdist workers)
            # counting alike gave two pods one uid, and a local kubelet finds a pod's
            # processes by its uid, so one test's pod deletion killed the other's ranks.
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now()
            if kind.generation:
                meta["generation"] = 1
            meta["resourceVersion"] = str(self._next_rv())
            obj["kind"], obj["apiVersion"] = kind.kind, kind.api_version
            if kind.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
                self._establish(obj)
            if kind.key == QUOTAS:
                obj["status"] = admission.quota_status(obj, self._pods_in(namespace))
            self._store[key] = obj
            self._record(kind.key, "ADDED", obj, None)
            if kind.key == PODS:
                self._count_quota(namespace)
            result = copy.deepcopy(obj)
        if meta.get("ownerReferences"):
            asyncio.get_running_loop().call_later(0.05, self._collect_orphan, key)
        return kmock.Response(status=201, payload=result)

    def _update(
        self, kind: Kind, request: kmock.Request, build: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any]:
        """Shared by PATCH and PUT: build the new object from the old, then admit it."""
        namespace = self._namespace(kind, request)
        key = (kind.key, namespace, request.name or "")
        with self._mutex:
            old = self._store.get(key)
            if old is None:
                raise not_found(kind, request.name)
            new = build(copy.deepcopy(old))
            wanted_rv = metadata(new).get("resourceVersion")
            if wanted_rv not in (None, "", old["metadata"]["resourceVersion"]):
                raise error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {kind.qualified} "{key[2]}": the object '
                    "has been modified; please apply your changes to the latest version and "
                    "try again",
                    name=key[2],
                    kind=kind.plural,
                )
            if request.subresource == "status":
                new = {**old, "status": new.get("status")}
                if new["status"] is None:
                    new.pop("status")
                new = self._admit(kind, new, request)  # status is validated (and pruned) too
            else:
                if kind.status:
                    new = _without(new, "status")
                    if "status" in old:
                        new["status"] = old["status"]
                meta = new.setdefault("metadata", {})
                for k in (
                    "uid",
                    "name",
                    "namespace",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "generation",
                ):
                    if k in old["metadata"]:
                        meta[k] = old["metadata"][k]
                    else:
                        meta.pop(k, None)
                new["kind"], new["apiVersion"] = kind.kind, kind.api_version
                if old["metadata"].get("deletionTimestamp"):
                    added = set(meta.get("finalizers") or []) - set(
                        old["metadata"].get("finalizers") or []
                    )
                    if added:
                        raise error(
                            422,
                            "Invalid",
                            "no new finalizers can be added if the object is being deleted: "
                            f"{sorted(added)}",
                        )
                for path in kind.immutable:
                    if immutable_part(kind, path, new, old) != immutable_part(kind, path, old, old):
                        raise error(
                            422,
                            "Invalid",
                            f'{qualified_kind(kind)} "{key[2]}" is invalid: '
                            f"{'.'.join(path)}: Invalid value: field is immutable",
                        )
                if kind.validate_update is not None and (causes := kind.validate_update(new, old)):
                    raise invalid(kind, key[2], causes)
                if old.get("immutable") and (
                    new.get("data") != old.get("data")
                    or new.get("binaryData") != old.get("binaryData")
                    or not new.get("immutable")
                ):
                    raise error(
                        422,
                        "Invalid",
                        f'ConfigMap "{key[2]}" is invalid: data: Forbidden: field is immutable '
                        "when `immutable` is set",
                    )
                new = self._admit(kind, new, request)
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            if new == old:
                return copy.deepcopy(old)  # a no-op write changes nothing, not even the version
            if request.params.get("dryRun") == "All":
                return new
            spec_changed = _without(new, "metadata", "status") != _without(
                old, "metadata", "status"
            )
            if kind.generation and spec_changed and request.subresource != "status":
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            meta = new["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self._store[key] = new
                self._remove(key)  # the last finalizer is gone: delete (and collect) for real
                return copy.deepcopy(new)
            self._store[key] = new
            self._record(kind.key, "MODIFIED", new, old)
            if kind.key == NODES:
                self._settle_pods_on(key[2])
            return copy.deepcopy(new)

    async def _patch(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        content_type = request.headers.get("Content-Type", "")

        def build(old: dict[str, Any]) -> dict[str, Any]:
            try:
                return patches.apply_patch(old, request.data, content_type)
            except patches.PatchError as err:
                raise error(
                    err.status, "Invalid" if err.status == 422 else "BadRequest", str(err)
                ) from None

        return self._update(kind, request, build)

    async def _put(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        if request.name is None or not isinstance(request.data, dict):
            raise error(405, "MethodNotAllowed", "PUT needs an object name and a JSON object")
        body = request.data
        if metadata(body).get("name") not in (None, request.name):
            raise error(
                400, "BadRequest", "the name of the object does not match the name on the URL"
            )
        return self._update(kind, request, lambda old: copy.deepcopy(body))

    # ------------------------------------------------------------------ CRDs
    def _establish(self, crd: dict[str, Any]) -> None:
        for kind in crd_kinds(crd):
            self._serve(kind)
        crd["status"] = crd_status(crd)

    def _drop_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            key = (spec["group"], version["name"], spec["names"]["plural"])
            for skey in [k for k in self._store if k[0] == key]:
                self._remove(skey)
            self._unserve(key)

    # ------------------------------------------------------------------ errors
    async def _render_error(self, exc: Exception) -> Any:
        if not isinstance(exc, KubernetesError):
            self.unexpected.append(exc)
        return await super()._render_error(exc)

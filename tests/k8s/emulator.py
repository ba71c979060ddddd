"""A Kubernetes API server in memory, faithful where the operator depends on it.

Built on kmock's :class:`~kmock.KubernetesScaffold` (HTTP server, API discovery, request
recording, reactions a test can add in front of the defaults). What it adds over
kmock's own ``KubernetesEmulator``, which merges dicts and stamps nothing:

- metadata stamped by the server: ``uid``, ``resourceVersion`` (one global counter),
  ``creationTimestamp``, ``generation`` (bumped only when the spec changes), the
  namespace from the URL, ``generateName``;
- the ``status`` subresource: a write to the object ignores ``status``, a write to
  ``/status`` changes nothing else; a no-op write bumps nothing and emits no event;
- ``409`` on duplicates and on a stale ``resourceVersion``; ``404`` as the API words it;
- ``422`` from a CRD's ``openAPIV3Schema`` (pruning, defaults, the OpenAPI keywords,
  list-map and set keys, CEL rules, in the API server's order and words: fields,
  values and messages as the server reports them, ``<nil>`` for a root rule;
  :mod:`k8s.schema`), with the status subresource checked against the status schema;
  from invalid names and labels, from immutable ConfigMaps and Job templates, and from
  ConfigMaps over 1 MiB; a 422's message lists each distinct cause once;
- list responses with ``kind``/``apiVersion`` and the list's ``resourceVersion``
  (items of built-in kinds carry no ``kind``, as on a real server), label and field
  selectors, ``limit``/``continue``;
- watches from a ``resourceVersion`` (``410 Gone`` when it is older than the retained
  history), with ADDED/DELETED when an object starts or stops matching a selector;
- finalizers (``deletionTimestamp``, deletion when the last one is removed) and
  garbage collection by ``ownerReferences`` (background and orphan propagation;
  dependents whose owners no longer exist are deleted);
- graceful deletion of pods bound to a node: they stay ``Terminating`` (deletionTimestamp
  = now + their grace period) until the node's kubelet confirms, which a Ready node's
  does at once and a NotReady or missing node's never does; ``gracePeriodSeconds: 0``
  deletes at once, and deleting the node removes its pods (the pod garbage collector);
- CRDs: creating one is refused as the API server refuses it (:mod:`k8s.crds`: names,
  versions, structural schema, every ``default`` against its schema and CEL rules as
  written, list types, rule compilation and estimated cost), else serves its resource
  (discovery included), its objects validated as above.

Simplifications (documented, not hidden): namespaces need not exist; there are no
controllers (no pods for Jobs, no kubelet beyond confirming deletions): tests patch Job
and Pod status as the controllers would; strategic merge patch merges lists by
``name`` only; no bookmarks; updates are validated as creates (no ratcheting of
unchanged invalid fields, no ``oldSelf`` rules); :mod:`k8s.schema` and :mod:`k8s.crds`
list what of the schema and CRD checks is not emulated.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import copy
import datetime
import json
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import attrs
import kmock
from kmock import KubernetesError, ResourceInfo
from kmock import resource as kresource

from k8s import patches, selectors
from k8s.crds import crd_causes, crd_defaults
from k8s.schema import Cause, StructuralSchema

CONFIGMAP_LIMIT = 1 << 20
HISTORY = 50_000  # watch events kept for watches "from a resourceVersion"

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_CM_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"
Key = tuple[str, str, str]  # group, version, plural
_PODS: Key = ("", "v1", "pods")
_NODES: Key = ("", "v1", "nodes")
_DONE = ("Succeeded", "Failed")


@dataclass
class Kind:
    """A resource the emulator serves."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status: bool = False
    generation: bool = False
    name_rule: str = "subdomain"  # "subdomain", "dns1035" (Services), "subdomain63" (Jobs)
    schema: StructuralSchema | None = None
    short_names: tuple[str, ...] = ()
    singular: str = ""
    custom: bool = False
    immutable: tuple[tuple[str, ...], ...] = ()
    validate: Callable[[dict[str, Any]], list[Cause]] | None = None

    @property
    def key(self) -> Key:
        return (self.group, self.version, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


@dataclass
class Event:
    rv: int
    key: Key
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _err(status: int, reason: str, message: str, **details: Any) -> KubernetesError:
    return KubernetesError(
        status=status, reason=reason, message=message, details=details or {"x": 1}
    )


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _without(obj: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def _job_causes(obj: dict[str, Any]) -> list[Cause]:
    spec = obj.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {}
    out = []
    policy = pod.get("restartPolicy")
    if policy not in ("Never", "OnFailure"):
        out.append(
            Cause(
                "spec.template.spec.restartPolicy",
                f'Unsupported value: "{policy}": supported values: "OnFailure", "Never"',
                "FieldValueNotSupported",
            )
        )
    if spec.get("podFailurePolicy") and policy != "Never":
        out.append(
            Cause(
                "spec.template.spec.restartPolicy",
                "Invalid value: only Never is supported when podFailurePolicy is specified",
            )
        )
    if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
        out.append(Cause("spec.completions", "Required value: when completionMode is Indexed"))
    if not (pod.get("containers") or []):
        out.append(Cause("spec.template.spec.containers", "Required value", "FieldValueRequired"))
    return out


def _configmap_causes(obj: dict[str, Any]) -> list[Cause]:
    out, size = [], 0
    for section in ("data", "binaryData"):
        for key, value in (obj.get(section) or {}).items():
            if not _CM_KEY.match(key) or len(key) > 253:
                out.append(Cause(f"{section}[{key}]", "Invalid value: a valid config key"))
            if section == "data":
                size += len(str(value).encode())
            else:
                try:
                    size += len(base64.b64decode(value, validate=True))
                except ValueError:
                    out.append(Cause(f"binaryData[{key}]", "Invalid value: not base64"))
    if size > CONFIGMAP_LIMIT:
        out.append(
            Cause("", f"Too long: must have at most {CONFIGMAP_LIMIT} bytes", "FieldValueTooLong")
        )
    return out


BUILTIN_KINDS: tuple[Kind, ...] = (
    Kind("", "v1", "namespaces", "Namespace", False, status=True),
    Kind(
        "", "v1", "configmaps", "ConfigMap", True, short_names=("cm",), validate=_configmap_causes
    ),
    Kind("", "v1", "pods", "Pod", True, status=True, short_names=("po",)),
    Kind(
        "",
        "v1",
        "services",
        "Service",
        True,
        status=True,
        name_rule="dns1035",
        short_names=("svc",),
    ),
    Kind("", "v1", "events", "Event", True, short_names=("ev",)),
    Kind("", "v1", "nodes", "Node", False, status=True, short_names=("no",)),
    Kind("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
    Kind(
        "batch",
        "v1",
        "jobs",
        "Job",
        True,
        status=True,
        generation=True,
        name_rule="subdomain63",
        immutable=(("spec", "template"), ("spec", "selector"), ("spec", "completionMode")),
        validate=_job_causes,
    ),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        status=True,
        generation=True,
        short_names=("crd",),
    ),
)


@attrs.define(kw_only=True)
class ApiEmulator(kmock.KubernetesScaffold):
    """The emulated API server; see the module docstring for what it honours."""

    _kinds: dict[Key, Kind] = attrs.field(factory=dict, init=False)
    _store: dict[tuple[Key, str | None, str], dict[str, Any]] = attrs.field(
        factory=dict, init=False
    )
    _rv: int = attrs.field(default=0, init=False)
    _uids: int = attrs.field(default=0, init=False)
    _log: list[Event] = attrs.field(factory=list, init=False)
    _log_rvs: list[int] = attrs.field(factory=list, init=False)
    _changed: asyncio.Event | None = attrs.field(default=None, init=False)
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
        """kmock parses ``/api/v1/namespaces[/NAME]`` as a namespace *scope* (and fails on
        the bare list); those paths are parsed here, everything else by kmock."""
        if self.authorizer is not None and (refused := self.authorizer(raw_request)) is not None:
            return refused
        m = _NAMESPACE_PATH.fullmatch(raw_request.path)
        if m is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        query = dict(raw_request.query)
        name, sub = m.group(1), m.group(2)
        method = raw_request.method.upper()
        action = _guess_action(method, name is not None, query)
        request = kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            method=method,
            url=raw_request.url,
            params=query,
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
            action=action,
            resource=kresource("", "v1", "namespaces"),
            namespace=None,
            name=name,
            subresource=sub,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except KubernetesError as err:
            return await self._render_error(err)

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
            raise _err(404, "NotFound", "the server could not find the requested resource")
        if request.subresource not in (None, "status") or (
            request.subresource == "status" and not kind.status
        ):
            raise _err(404, "NotFound", "the server could not find the requested resource")
        return kind

    def _namespace(self, kind: Kind, request: kmock.Request) -> str | None:
        return request.namespace if kind.namespaced else None

    # ------------------------------------------------------------------ test helpers
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

    def _record(
        self, key: Key, type_: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        self._log.append(Event(self._rv, key, type_, copy.deepcopy(obj), old))
        self._log_rvs.append(self._rv)
        if len(self._log) > HISTORY:
            del self._log[: HISTORY // 10]
            del self._log_rvs[: HISTORY // 10]
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    def _oldest_watchable(self) -> int:
        return self._log_rvs[0] - 1 if self._log_rvs else self._rv

    # ------------------------------------------------------------------ validation
    def _check_metadata(self, kind: Kind, obj: dict[str, Any]) -> list[Cause]:
        meta = _meta(obj)
        name = meta.get("name", "")
        out = []
        if kind.name_rule == "dns1035":
            ok, limit, rule = bool(_DNS1035.match(name)), 63, "a DNS-1035 label"
        else:
            limit = 63 if kind.name_rule == "subdomain63" else 253
            ok, rule = bool(_SUBDOMAIN.match(name)), "a lowercase RFC 1123 subdomain"
        if not ok or len(name) > limit:
            out.append(
                Cause(
                    "metadata.name",
                    f'Invalid value: "{name}": must be {rule} of at most {limit} characters',
                )
            )
        for key, value in (meta.get("labels") or {}).items():
            prefix, _, lname = key.rpartition("/")
            if (
                (prefix and not _SUBDOMAIN.match(prefix))
                or len(lname) > 63
                or not _LABEL_NAME.match(lname)
            ):
                out.append(
                    Cause("metadata.labels", f'Invalid value: "{key}": name part must be valid')
                )
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                out.append(
                    Cause(
                        "metadata.labels",
                        f'Invalid value: "{value}": a valid label must be an empty string or '
                        "consist of at most 63 alphanumeric characters, '-', '_' or '.'",
                    )
                )
        for i, ref in enumerate(meta.get("ownerReferences") or []):
            for f in ("apiVersion", "kind", "name", "uid"):
                if not ref.get(f):
                    out.append(
                        Cause(
                            f"metadata.ownerReferences[{i}].{f}",
                            "Required value",
                            "FieldValueRequired",
                        )
                    )
        return out

    def _admit(self, kind: Kind, obj: dict[str, Any], request: kmock.Request) -> dict[str, Any]:
        """Prune, default and validate a custom resource (or check a built-in, or a CRD as
        :mod:`k8s.crds` does); a 422 in the server's words if bad."""
        causes = self._check_metadata(kind, obj)
        if kind.schema is not None:
            obj, dropped = kind.schema.admit(obj)
            if dropped and request.params.get("fieldValidation") == "Strict":
                raise _err(
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
            name = _meta(obj).get("name", "")
            raise _invalid(kind, name, causes)
        return obj

    # ------------------------------------------------------------------ reading
    async def _get(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        with self._mutex:
            obj = self._store.get((kind.key, self._namespace(kind, request), request.name or ""))
            if obj is None:
                raise _not_found(kind, request.name)
            return copy.deepcopy(obj)

    def _matching(
        self, kind: Kind, namespace: str | None, params: Mapping[str, str]
    ) -> Callable[[dict[str, Any]], bool]:
        try:
            labels = selectors.parse_label_selector(params.get("labelSelector"))
            fields = selectors.parse_field_selector(params.get("fieldSelector"))
        except selectors.SelectorError as err:
            raise _err(400, "BadRequest", str(err)) from None

        def match(obj: dict[str, Any]) -> bool:
            ns = _meta(obj).get("namespace")
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

    async def _watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        kind = self._kind(request)
        match = self._matching(kind, request.namespace, request.params)
        if request.name is not None:
            name, inner = request.name, match
            match = lambda o: inner(o) and _meta(o).get("name") == name  # noqa: E731
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
                    initial = [_gone(cursor)]
                    cursor = -1
        for item in initial:
            yield item
        if cursor < 0:
            return
        while True:
            with self._mutex:
                start = bisect.bisect_right(self._log_rvs, cursor)
                events = self._log[start:]
                waiter = self._changed
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
                waiter = self._changed = asyncio.Event()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(waiter.wait(), remaining)
            except TimeoutError:
                return

    # ------------------------------------------------------------------ writing
    async def _create(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        if request.subresource:
            raise _err(405, "MethodNotAllowed", "create is not supported on a subresource")
        obj = request.data
        if not isinstance(obj, dict):
            raise _err(400, "BadRequest", "the request body must be a JSON object")
        # Like the API server's decoder, missing type fields default to the URL's.
        if (
            obj.get("kind", kind.kind) != kind.kind
            or obj.get("apiVersion", kind.api_version) != kind.api_version
        ):
            raise _err(
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
                raise _err(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request",
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        with self._mutex:
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise _err(422, "Invalid", "name or generateName is required")
                self._uids += 1
                n, tail = self._uids, ""
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
                _job_defaults(obj)
            obj = self._admit(kind, obj, request)
            key = (kind.key, namespace, obj["metadata"]["name"])
            if key in self._store:
                raise _err(
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
            self._uids += 1
            meta["uid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"shardwise-emulator/{self._uids}"))
            meta["creationTimestamp"] = _now()
            if kind.generation:
                meta["generation"] = 1
            meta["resourceVersion"] = str(self._next_rv())
            obj["kind"], obj["apiVersion"] = kind.kind, kind.api_version
            if kind.key == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
                self._establish(obj)
            self._store[key] = obj
            self._record(kind.key, "ADDED", obj, None)
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
                raise _not_found(kind, request.name)
            new = build(copy.deepcopy(old))
            wanted_rv = _meta(new).get("resourceVersion")
            if wanted_rv not in (None, "", old["metadata"]["resourceVersion"]):
                raise _err(
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
                        raise _err(
                            422,
                            "Invalid",
                            "no new finalizers can be added if the object is being deleted: "
                            f"{sorted(added)}",
                        )
                for path in kind.immutable:
                    if _dig(new, path) != _dig(old, path):
                        raise _err(
                            422,
                            "Invalid",
                            f'{kind.kind}.{kind.group or "core"} "{key[2]}" is invalid: '
                            f"{'.'.join(path)}: Invalid value: field is immutable",
                        )
                if old.get("immutable") and (
                    new.get("data") != old.get("data")
                    or new.get("binaryData") != old.get("binaryData")
                    or not new.get("immutable")
                ):
                    raise _err(
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
            if kind.key == _NODES:
                self._settle_pods_on(key[2])
            return copy.deepcopy(new)

    async def _patch(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        content_type = request.headers.get("Content-Type", "")

        def build(old: dict[str, Any]) -> dict[str, Any]:
            try:
                return patches.apply_patch(old, request.data, content_type)
            except patches.PatchError as err:
                raise _err(
                    err.status, "Invalid" if err.status == 422 else "BadRequest", str(err)
                ) from None

        return self._update(kind, request, build)

    async def _put(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        if request.name is None or not isinstance(request.data, dict):
            raise _err(405, "MethodNotAllowed", "PUT needs an object name and a JSON object")
        body = request.data
        if _meta(body).get("name") not in (None, request.name):
            raise _err(
                400, "BadRequest", "the name of the object does not match the name on the URL"
            )
        return self._update(kind, request, lambda old: copy.deepcopy(body))

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
                raise _not_found(kind, request.name)
            for f in ("uid", "resourceVersion"):
                if preconditions.get(f) and preconditions[f] != obj["metadata"].get(f):
                    raise _err(409, "Conflict", f"Precondition failed: {f} in precondition differs")
            if request.params.get("dryRun") == "All":
                return copy.deepcopy(obj)
            if policy == "Foreground" and self._dependents(obj["metadata"]["uid"]):
                return self._delete_foreground(key)
            grace = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
            if self._awaits_kubelet(key, grace):
                return copy.deepcopy(obj)
            if obj["metadata"].get("finalizers"):
                if not obj["metadata"].get("deletionTimestamp"):
                    old = copy.deepcopy(obj)
                    obj["metadata"]["deletionTimestamp"] = _now()
                    obj["metadata"]["resourceVersion"] = str(self._next_rv())
                    self._record(kind.key, "MODIFIED", obj, old)
                return copy.deepcopy(obj)
            self._remove(key, orphan=policy == "Orphan")
            return copy.deepcopy(obj)

    def _remove(self, key: tuple[Key, str | None, str], orphan: bool = False) -> None:
        obj = self._store.pop(key)
        self._next_rv()
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._record(key[0], "DELETED", gone, obj)
        if key[0] == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._drop_crd(obj)
        if key[0] == _NODES:
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
        meta.setdefault("deletionTimestamp", _now())
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
            if not obj["metadata"].get("deletionTimestamp"):
                old = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["resourceVersion"] = str(self._next_rv())
                self._record(key[0], "MODIFIED", obj, old)
            return
        self._remove(key)

    # ------------------------------------------------------------------ graceful pod deletion
    def _kubelet_alive(self, node: str) -> bool:
        """A Ready node's kubelet confirms a deletion at once (the stand-in for stopping
        the containers); a NotReady or missing node's kubelet never does."""
        obj = self._store.get((_NODES, None, node))
        conditions = ((obj or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _awaits_kubelet(self, key: tuple[Key, str | None, str], grace: Any) -> bool:
        """Delete a pod as the API server does: one bound to a node and not finished is
        only marked (``deletionTimestamp`` = now + its grace period) until the node's
        kubelet confirms; ``True`` when it now waits for a kubelet that will not."""
        obj = self._store[key]
        spec, meta = obj.get("spec") or {}, obj["metadata"]
        node = spec.get("nodeName")
        if key[0] != _PODS or not node or (obj.get("status") or {}).get("phase") in _DONE:
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
        gone = (_NODES, None, node) not in self._store
        if not gone and not self._kubelet_alive(node):
            return
        for key, obj in list(self._store.items()):
            if (
                key[0] == _PODS
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

    # ------------------------------------------------------------------ CRDs
    def _establish(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
            status = "status" in (version.get("subresources") or {})
            self._serve(
                Kind(
                    spec["group"],
                    version["name"],
                    names["plural"],
                    names["kind"],
                    spec.get("scope", "Namespaced") == "Namespaced",
                    status=status,
                    generation=True,
                    schema=StructuralSchema(schema),
                    short_names=tuple(names.get("shortNames") or ()),
                    singular=names.get("singular", ""),
                    custom=True,
                )
            )
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": r,
                    "lastTransitionTime": _now(),
                    "message": "",
                }
                for t, r in (
                    ("NamesAccepted", "NoConflicts"),
                    ("Established", "InitialNamesAccepted"),
                )
            ],
        }

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


_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces(?:/([^/]+)(?:/(status|finalize))?)?/?")


def _guess_action(method: str, named: bool, query: Mapping[str, str]) -> Any:
    if method == "GET" and query.get("watch") in ("true", "1"):
        return kmock.action.WATCH
    table = {
        ("GET", False): kmock.action.LIST,
        ("POST", False): kmock.action.CREATE,
        ("GET", True): kmock.action.FETCH,
        ("PATCH", True): kmock.action.UPDATE,
        ("DELETE", True): kmock.action.DELETE,
    }
    return table.get((method, named))


def _not_found(kind: Kind, name: str | None) -> KubernetesError:
    return _err(
        404, "NotFound", f'{kind.qualified} "{name}" not found', name=name, kind=kind.plural
    )


def _gone(rv: int) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": f"too old resource version: {rv}",
            "reason": "Expired",
            "code": 410,
        },
    }


def _job_defaults(job: dict[str, Any]) -> None:
    """What the Job strategy fills in: the selector and the template's controller labels."""
    spec = job.setdefault("spec", {})
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    meta = spec.setdefault("template", {}).setdefault("metadata", {})
    name = _meta(job).get("name", "")
    labels = meta.setdefault("labels", {})
    labels.setdefault("job-name", name)
    labels.setdefault("batch.kubernetes.io/job-name", name)
    spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/job-name": name}})


def _invalid(kind: Kind, name: str, causes: list[Cause]) -> KubernetesError:
    """``errors.NewInvalid``: the causes, and a message that lists each distinct one once
    (in brackets when there are several)."""
    shown = list(dict.fromkeys(str(c) for c in causes))
    joined = shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"
    return _err(
        422,
        "Invalid",
        f'{kind.kind}.{kind.group or "core"} "{name}" is invalid: {joined}',
        name=name,
        group=kind.group,
        kind=kind.kind,
        causes=[{"reason": c.reason, "message": c.message, "field": c.field} for c in causes],
    )

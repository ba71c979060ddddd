"""RBAC for the API emulator: bearer tokens, and Roles, ClusterRoles and their bindings
evaluated as Kubernetes' RBAC authorizer does.

Opt-in: ``ApiEmulator(authorizer=RbacAuthorizer(objects, tokens))``; without it the
emulator serves everyone (every other test). What it follows:

- request attributes as the API server's ``RequestInfoFactory`` derives them: verb
  from the method (``list``/``watch`` for a GET without a name, ``?watch=true``,
  ``deletecollection``), API group, resource, subresource, namespace, name; paths
  outside ``/api`` and ``/apis`` resources (discovery, ``/version``) are non-resource
  requests;
- authentication: ``Authorization: Bearer <token>`` mapped to a user; an unknown token
  is ``401``; no token is ``system:anonymous`` in ``system:unauthenticated``;
  authenticated users are in ``system:authenticated``, service accounts
  (``system:serviceaccount:NS:NAME``) also in ``system:serviceaccounts`` and
  ``system:serviceaccounts:NS``; ``system:masters`` may do anything;
- rules: verbs, apiGroups, resources (``resource/subresource``, ``*``, ``*/sub``),
  resourceNames, nonResourceURLs (``*`` suffix), each may be ``*``; a ClusterRoleBinding
  grants everywhere, a RoleBinding (to a Role of its namespace or a ClusterRole) only
  in its namespace; aggregated ClusterRoles collect the rules of the ClusterRoles their
  selectors match;
- the bootstrap policy's discovery roles: ``system:discovery`` (authenticated users
  read ``/api``, ``/apis``, ``/version``, ``/openapi``…) and
  ``system:public-info-viewer`` (everyone reads ``/healthz``, ``/livez``,
  ``/readyz``, ``/version``);
- a denial is ``403`` with the API server's wording, and is recorded in
  :attr:`RbacAuthorizer.denials`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
MASTERS = "system:masters"
RBAC_KINDS = ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")

#: The bootstrap policy's rules for non-resource URLs (kube-apiserver's defaults).
DISCOVERY_URLS = (
    "/api",
    "/api/*",
    "/apis",
    "/apis/*",
    "/healthz",
    "/livez",
    "/readyz",
    "/openapi",
    "/openapi/*",
    "/version",
    "/version/",
)
PUBLIC_URLS = ("/healthz", "/livez", "/readyz", "/version", "/version/")
_METHOD_VERBS = {
    "GET": "get",
    "POST": "create",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()


def service_account(namespace: str, name: str) -> User:
    """The user a ServiceAccount's token authenticates as."""
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


def admin(name: str = "admin") -> User:
    return User(name, (MASTERS, AUTHENTICATED))


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do (the authorizer's input)."""

    verb: str
    resource_request: bool
    path: str = ""
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def qualified(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """The API server's reading of a request (its ``RequestInfoFactory``)."""
    verb = _METHOD_VERBS.get(method.upper(), method.lower())
    parts = [p for p in path.strip("/").split("/") if p]
    non_resource = Attributes(verb, False, path=path)
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return non_resource
    prefix, parts = parts[0], parts[1:]
    group = ""
    if prefix == "apis":
        if len(parts) < 3:
            return non_resource
        group, parts = parts[0], parts[1:]
    version, parts = parts[0], parts[1:]
    if parts and parts[0] == "watch":  # the deprecated /watch/ prefix
        verb, parts = "watch", parts[1:]
    namespace = ""
    if parts and parts[0] == "namespaces" and len(parts) > 1:
        namespace = parts[1]
        if len(parts) > 2 and parts[2] not in _NAMESPACE_SUBRESOURCES:
            parts = parts[2:]
    resource = parts[0] if parts else ""
    name = parts[1] if len(parts) > 1 else ""
    subresource = parts[2] if len(parts) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("true", "1") else "list"
        selector = query.get("fieldSelector") or ""
        if selector.startswith("metadata.name=") and "," not in selector:
            name = selector.removeprefix("metadata.name=")
    elif verb == "get" and query.get("watch") in ("true", "1"):
        verb = "watch"
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb, True, path, group, version, resource, subresource, namespace, name)


def _match(values: Iterable[str], wanted: str) -> bool:
    return any(v == "*" or v == wanted for v in values)


def _resource_match(resources: Iterable[str], attrs: Attributes) -> bool:
    for r in resources:
        if r == "*" or r == attrs.qualified:
            return True
        if attrs.subresource and r == f"*/{attrs.subresource}":
            return True
    return False


def _url_match(urls: Iterable[str], path: str) -> bool:
    return any(u == "*" or u == path or (u.endswith("*") and path.startswith(u[:-1])) for u in urls)


def rule_allows(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    """One PolicyRule against one request (as ``rbac.RuleAllows``)."""
    if not _match(rule.get("verbs") or [], attrs.verb):
        return False
    if not attrs.resource_request:
        return _url_match(rule.get("nonResourceURLs") or [], attrs.path)
    names = rule.get("resourceNames") or []
    return (
        _match(rule.get("apiGroups") or [], attrs.api_group)
        and _resource_match(rule.get("resources") or [], attrs)
        and (not names or attrs.name in names)
    )


def _labels_match(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if (
            (op == "In" and not (present and labels[key] in values))
            or (op == "NotIn" and present and labels[key] in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


@dataclass
class Denial:
    user: str
    attributes: Attributes
    message: str


@dataclass
class RbacAuthorizer:
    """Authorizes emulator requests; call it with the raw request (the emulator's hook)."""

    objects: Iterable[Mapping[str, Any]] = ()
    tokens: Mapping[str, User] = field(default_factory=dict)
    denials: list[Denial] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: list[Mapping[str, Any]] = []
        self.tokens = dict(self.tokens)
        for obj in self.objects:
            self.add(obj)

    def add(self, obj: Mapping[str, Any]) -> None:
        """Load a Role, ClusterRole or binding (other kinds are ignored)."""
        if obj.get("kind") in RBAC_KINDS:
            self._objects.append(obj)

    # ------------------------------------------------------------------ policy
    def _roles(self, kind: str, namespace: str | None = None) -> dict[str, Mapping[str, Any]]:
        return {
            o["metadata"]["name"]: o
            for o in self._objects
            if o["kind"] == kind
            and (namespace is None or o["metadata"].get("namespace") == namespace)
        }

    def _cluster_role_rules(self, name: str) -> list[Mapping[str, Any]]:
        roles = self._roles("ClusterRole")
        role = roles.get(name)
        if role is None:
            return []
        rules = list(role.get("rules") or [])
        for selector in (role.get("aggregationRule") or {}).get("clusterRoleSelectors") or []:
            for other in roles.values():
                if other is not role and _labels_match(
                    selector, other["metadata"].get("labels") or {}
                ):
                    rules += other.get("rules") or []
        return rules

    def _subject_matches(self, subject: Mapping[str, Any], user: User, ns: str | None) -> bool:
        kind = subject.get("kind")
        if kind == "User":
            return bool(subject.get("name") == user.name)
        if kind == "Group":
            return subject.get("name") in user.groups
        if kind == "ServiceAccount":
            sa_ns = subject.get("namespace") or ns or ""
            return user.name == f"system:serviceaccount:{sa_ns}:{subject.get('name')}"
        return False

    def rules_for(self, user: User, namespace: str) -> list[Mapping[str, Any]]:
        """Every rule that applies to ``user`` for a request in ``namespace`` ("" for
        cluster-scoped or all-namespaces requests)."""
        rules: list[Mapping[str, Any]] = []
        for b in self._objects:
            if b["kind"] == "ClusterRoleBinding":
                if any(self._subject_matches(s, user, None) for s in b.get("subjects") or []):
                    rules += self._cluster_role_rules(b["roleRef"]["name"])
            elif b["kind"] == "RoleBinding":
                bns = b["metadata"].get("namespace", "")
                if not namespace or bns != namespace:
                    continue
                if not any(self._subject_matches(s, user, bns) for s in b.get("subjects") or []):
                    continue
                ref = b["roleRef"]
                if ref["kind"] == "ClusterRole":
                    rules += self._cluster_role_rules(ref["name"])
                else:
                    role = self._roles("Role", bns).get(ref["name"])
                    rules += (role or {}).get("rules") or []
        return rules

    def allowed(self, user: User, attrs: Attributes) -> bool:
        if MASTERS in user.groups:
            return True
        if not attrs.resource_request:
            urls = DISCOVERY_URLS if AUTHENTICATED in user.groups else PUBLIC_URLS
            if attrs.verb == "get" and _url_match(urls, attrs.path):
                return True
        return any(rule_allows(r, attrs) for r in self.rules_for(user, attrs.namespace))

    # ------------------------------------------------------------------ requests
    def authenticate(self, headers: Mapping[str, str]) -> User | None:
        """The user of a request; ``None`` for a token nobody issued (401)."""
        auth = headers.get("Authorization") or headers.get("authorization") or ""
        if not auth.lower().startswith("bearer "):
            return User("system:anonymous", (UNAUTHENTICATED,))
        return self.tokens.get(auth[7:].strip())

    def __call__(self, raw_request: Any) -> web.Response | None:
        """The emulator's hook: ``None`` serves the request, a response refuses it."""
        user = self.authenticate(raw_request.headers)
        if user is None:
            return _status(401, "Unauthorized", "Unauthorized", {})
        query = {k: v[-1] for k, v in parse_qs(raw_request.query_string).items()}
        attrs = request_attributes(raw_request.method, raw_request.path, query)
        if self.allowed(user, attrs):
            return None
        message = forbidden_message(user, attrs)
        with self._lock:
            self.denials.append(Denial(user.name, attrs, message))
        details = {"name": attrs.name, "group": attrs.api_group, "kind": attrs.resource}
        return _status(403, "Forbidden", message, {k: v for k, v in details.items() if v})


def forbidden_message(user: User, attrs: Attributes) -> str:
    """The API server's wording of a denial."""
    if not attrs.resource_request:
        return f'forbidden: User "{user.name}" cannot {attrs.verb} path "{attrs.path}"'
    what = attrs.resource + (f' "{attrs.name}"' if attrs.name else "")
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    return (
        f'{what} is forbidden: User "{user.name}" cannot {attrs.verb} resource '
        f'"{attrs.qualified}" in API group "{attrs.api_group}" {where}'
    )


def _status(code: int, reason: str, message: str, details: Mapping[str, str]) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": dict(details),
        "code": code,
    }
    return web.Response(status=code, text=json.dumps(body), content_type="application/json")

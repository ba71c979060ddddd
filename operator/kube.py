"""A small dict-in, dict-out REST layer over the official ``kubernetes`` client.

The official client does configuration, authentication, TLS and retries; this module
only builds resource paths and maps HTTP errors to :class:`ApiError`. It works on
plain dicts (what :mod:`shardwise.operator.render.children` produces and kopf hands over)
and skips the typed models (slow to build, and lossy for custom resources). Calls are
blocking: the operator runs them in threads (``asyncio.to_thread``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s_client

from shardwise.basics import UserError

MERGE_PATCH = "application/merge-patch+json"

#: Kind → plural for the kinds the operator touches.
PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Job": "jobs",
    "Pod": "pods",
    "Node": "nodes",
    "Event": "events",
    "Namespace": "namespaces",
    "DLRMJob": "dlrmjobs",
    "CustomResourceDefinition": "customresourcedefinitions",
}
CLUSTER_SCOPED = frozenset({"nodes", "namespaces", "customresourcedefinitions"})


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body


def _decoded(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except ValueError:
        return data.decode(errors="replace")


def _api_error(status: int, reason: str, decoded: Any) -> ApiError:
    """The API server's Status (reason, message) when it sent one."""
    if isinstance(decoded, dict):
        return ApiError(
            status,
            str(decoded.get("reason", reason)),
            str(decoded.get("message", decoded)),
            decoded,
        )
    return ApiError(status, reason, str(decoded), decoded)


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace and plural not in CLUSTER_SCOPED:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


class KubeApi:
    """REST verbs on any resource; ``api_client`` is a ``kubernetes.client.ApiClient``."""

    def __init__(self, api_client: Any, timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.timeout = timeout

    @classmethod
    def for_host(
        cls,
        host: str,
        token: str | None = None,
        verify_ssl: bool = True,
        ca_cert: str | None = None,
    ) -> KubeApi:
        """A client for an explicit API URL (tests, the emulator, port-forwards). TLS is
        verified unless ``verify_ssl`` is False; ``ca_cert`` is the CA bundle to trust."""
        conf = k8s_client.Configuration(host=host)
        conf.verify_ssl = verify_ssl
        if ca_cert:
            conf.ssl_ca_cert = ca_cert
        if token:
            conf.api_key = {"BearerToken": token}
            conf.api_key_prefix = {"BearerToken": "Bearer"}
        return cls(k8s_client.ApiClient(conf))

    @classmethod
    def from_environment(cls) -> KubeApi:
        """The pod's service account, else the local kubeconfig (as ``kubectl`` would);
        neither is a :class:`UserError` that says where it looked and what would fix it."""
        from kubernetes import config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException as in_cluster:
            try:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            except (config.ConfigException, yaml.YAMLError, OSError, ValueError) as kubeconfig:
                raise UserError(no_credentials(str(in_cluster), str(kubeconfig))) from None
        return cls(k8s_client.ApiClient())

    def without_retries(self) -> KubeApi:
        """A second client with the same server and credentials whose requests fail at
        once (urllib3 retries each failed request 3 times by default): a check that
        must answer within its timeout, and must not hold up a shutdown, uses it."""
        conf = copy.deepcopy(self.api_client.configuration)
        conf.retries = 0
        return KubeApi(k8s_client.ApiClient(conf), self.timeout)

    # ------------------------------------------------------------------ raw
    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: Any = None,
        unread: bool = False,
    ) -> Any:
        """The decoded answer (an :class:`ApiError` unless 2xx); with ``unread``, the
        response itself, its body not read yet (the client never preloads it)."""
        ac = self.api_client
        method_, url, headers, body_, post = ac.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = ac.call_api(
            method_,
            url,
            header_params=headers,
            body=body_,
            post_params=post,
            _request_timeout=self.timeout if timeout is None else timeout,
        )
        if unread:
            return response
        decoded = _decoded(response.read())
        if not 200 <= response.status < 300:
            raise _api_error(int(response.status), str(response.reason), decoded)
        return decoded

    # ------------------------------------------------------------------ verbs
    def get(
        self, api_version: str, plural: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        try:
            obj: dict[str, Any] = self.request(
                "GET", resource_path(api_version, plural, namespace, name)
            )
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return obj

    def list(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            query["fieldSelector"] = field_selector
        result = self.request("GET", resource_path(api_version, plural, namespace), query=query)
        kind = str(result.get("kind", "")).removesuffix("List")
        items: list[dict[str, Any]] = result.get("items") or []
        for item in items:
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", result.get("apiVersion", api_version))
        return items

    def list_version(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        field_selector: str,
    ) -> tuple[tuple[dict[str, Any], ...], str]:
        """The items and the list's ``resourceVersion`` (a watch from it misses nothing)."""
        result = self.request(
            "GET",
            resource_path(api_version, plural, namespace),
            query={"fieldSelector": field_selector},
        )
        version = str((result.get("metadata") or {}).get("resourceVersion", ""))
        return tuple(result.get("items") or ()), version

    def watch(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        *,
        field_selector: str,
        resource_version: str,
        timeout_seconds: int = 60,
        opened: Callable[[Any], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Watch events (``{"type": ..., "object": ...}``) as the server sends them, until
        it ends the watch after ``timeout_seconds``. ``opened`` gets the open response:
        closing it from another thread ends the watch at once."""
        query = {
            "watch": "true",
            "fieldSelector": field_selector,
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
        }
        response = self.request(
            "GET",
            resource_path(api_version, plural, namespace),
            query=query,
            timeout=(self.timeout, timeout_seconds + self.timeout),
            unread=True,
        )
        raw = response.response  # urllib3's, read line by line as events come
        if not 200 <= raw.status < 300:
            raise _api_error(int(raw.status), str(raw.reason), _decoded(raw.data))
        if opened is not None:
            opened(raw)
        try:
            for line in iter(raw.readline, b""):
                if line.strip():
                    yield json.loads(line)
        finally:
            raw.release_conn()

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        plural = PLURALS[str(body["kind"])]
        ns = (body.get("metadata") or {}).get("namespace")
        created: dict[str, Any] = self.request(
            "POST", resource_path(str(body["apiVersion"]), plural, ns), body=dict(body)
        )
        return created

    def patch(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386)."""
        patched: dict[str, Any] = self.request(
            "PATCH",
            resource_path(api_version, plural, namespace, name, subresource),
            body=dict(patch),
            content_type=MERGE_PATCH,
        )
        return patched

    def replace(self, body: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        meta = body["metadata"]
        path = resource_path(
            str(body["apiVersion"]),
            PLURALS[str(body["kind"])],
            meta.get("namespace"),
            meta["name"],
            subresource,
        )
        replaced: dict[str, Any] = self.request("PUT", path, body=dict(body))
        return replaced

    def delete(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        propagation: str = "Background",
        grace_period_seconds: int | None = None,
    ) -> bool:
        """Delete; ``False`` when it was already gone. ``grace_period_seconds=0`` deletes
        a pod at once, without waiting for its kubelet (``kubectl delete --force``)."""
        options: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": propagation,
        }
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        try:
            self.request(
                "DELETE", resource_path(api_version, plural, namespace, name), body=options
            )
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    def close(self) -> None:
        self.api_client.close()


def no_credentials(in_cluster: str, kubeconfig: str) -> str:
    """Where :meth:`KubeApi.from_environment` looked, and how to give it an API server."""
    env = os.environ.get("KUBECONFIG")
    default = Path("~/.kube/config").expanduser()
    if env:
        files = [Path(f).expanduser() for f in env.split(os.pathsep) if f]
        where = (
            "$KUBECONFIG="
            + env
            + " ("
            + ", ".join(f"{f}: {'found' if f.is_file() else 'no such file'}" for f in files)
            + ")"
        )
    else:
        found = "found" if default.is_file() else "no such file"
        where = f"$KUBECONFIG is unset, so {default} ({found})"
    return (
        "no Kubernetes API server to talk to. Looked for:\n"
        "  - the pod's service account ($KUBERNETES_SERVICE_HOST and "
        f"/var/run/secrets/kubernetes.io/serviceaccount/token): {in_cluster}\n"
        f"  - a kubeconfig: {where}: {kubeconfig}\n"
        "Point $KUBECONFIG at a kubeconfig file (`kubectl config view` shows the one kubectl "
        "uses), run the operator in a pod with a service account (the Helm chart), or give "
        "--server http://127.0.0.1:8001 after `kubectl proxy`."
    )

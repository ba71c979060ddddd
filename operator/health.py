"""Liveness and readiness endpoints for the operator's pod, and the API check behind
readiness (docs/operator.md, "The operator process").

``/healthz`` answers 200 while the event loop runs (a hung loop cannot answer, and the
kubelet restarts the pod). ``/readyz`` answers 200 only while the operator can do its
work: kopf has started, and the last check of the DLRMJob API, a list of at most one
DLRMJob where the operator serves them (the endpoint kopf watches), succeeded recently.
An unreachable API server, a deleted CRD or a revoked right turn it 503 within one
check, with the reason in the body; kopf's watch reconnects by itself, and the next
successful check turns it 200 again. The same check runs once before kopf starts, so
``shardwise operator`` refuses to start, saying why, where it could not work at all.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from shardwise.names import API_VERSION, GROUP, PLURAL, VERSION
from shardwise.operator.kube import ApiError, KubeApi, resource_path

CRD_NAME = f"{PLURAL}.{GROUP}"
INSTALL_CRD = (
    "Install it with `kubectl apply -f crds/dlrmjob.yaml` (or the Helm chart, which "
    "installs it first)."
)


class Readiness:
    """What ``/readyz`` answers: ready while kopf has started and the last API check,
    at most ``max_age`` seconds ago, succeeded. ``max_age=None`` runs no check (an
    embedded operator without health endpoints): started is ready."""

    def __init__(
        self,
        started: threading.Event,
        max_age: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.started = started
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ok: float | None = None
        self._problem: str | None = None

    def succeeded(self) -> None:
        with self._lock:
            self._last_ok = self._clock()
            self._problem = None

    def failed(self, problem: str) -> None:
        with self._lock:
            self._problem = problem

    def state(self) -> tuple[bool, str]:
        """(ready, why): the reason is what ``/readyz`` shows when it answers 503."""
        if not self.started.is_set():
            return False, "starting: kopf has not finished its startup"
        if self.max_age is None:
            return True, "ready"
        with self._lock:
            problem, last_ok = self._problem, self._last_ok
        if problem is not None:
            return False, problem
        if last_ok is None:
            return False, "starting: the API server has not answered the first check yet"
        age = self._clock() - last_ok
        if age > self.max_age:
            return False, f"the API server has not answered a check for {age:.0f} s"
        return True, "ready"


@dataclass(frozen=True)
class ApiCheck:
    """Can the operator read DLRMJobs where it serves them? ``()`` is None when it can,
    else what is wrong and how to fix it. Blocking: call it in a thread."""

    kube: KubeApi
    #: Exact namespace names; empty with ``clusterwide`` or with kopf's patterns, which
    #: only the API's discovery document is checked for (no right to list is assumed).
    namespaces: Sequence[str]
    clusterwide: bool
    #: The API server's URL, for the messages.
    server: str
    timeout: float = 5.0

    def __call__(self) -> str | None:
        try:
            if self.clusterwide:
                self._list(None)
            elif self.namespaces:
                for namespace in self.namespaces:
                    self._list(namespace)
            else:
                self._discover()
        except ApiError as err:
            return self._api_error(err)
        except Exception as err:  # the client's connection, TLS and timeout errors
            return self._transport_error(err)
        return None

    def _list(self, namespace: str | None) -> None:
        path = resource_path(API_VERSION, PLURAL, namespace)
        self.kube.request("GET", path, query={"limit": "1"}, timeout=self.timeout)

    def _discover(self) -> None:
        path = f"/apis/{API_VERSION}"
        found = self.kube.request("GET", path, timeout=self.timeout)
        names = {r.get("name") for r in (found or {}).get("resources", [])}
        if PLURAL not in names:
            raise ApiError(404, "NotFound", f"{path} lists no {PLURAL}", found)

    def _is_kubernetes(self) -> bool:
        try:
            answer = self.kube.request("GET", "/version", timeout=self.timeout)
        except Exception:
            return False
        return isinstance(answer, dict) and "gitVersion" in answer

    def _where(self) -> str:
        if self.clusterwide or not self.namespaces:
            return "in all namespaces"
        return "in namespace " + ", ".join(self.namespaces)

    def _api_error(self, err: ApiError) -> str:
        # a Kubernetes Status says what was wrong; another server's error page does not
        message = " ".join(str(err.message).split()) if isinstance(err.body, dict) else ""
        message = message if len(message) <= 300 else message[:297] + "..."
        said = f"{err.status} {err.reason}" + (f": {message}" if message else "")
        if err.status == 404 and self._is_kubernetes():
            return (
                f"the DLRMJob CRD ({CRD_NAME}, version {VERSION}) is not installed on "
                f"{self.server}: the API server answered {said}. {INSTALL_CRD}"
            )
        if err.status == 404:
            return (
                f"{self.server} answered {said}, and no Kubernetes version at /version: it "
                "is not a Kubernetes API server, or the URL's path is wrong. Check --server "
                "or the kubeconfig's cluster.server; if it is a cluster, check the DLRMJob "
                f"CRD too. {INSTALL_CRD}"
            )
        if err.status == 401:
            return (
                f"{self.server} refused the credentials ({said}). Check the kubeconfig's "
                "user (`kubectl auth whoami`) or the pod's service account token."
            )
        if err.status == 403 and "system:anonymous" in message:
            return (
                f"{self.server} took the request as anonymous ({said}): --server sends no "
                "credentials. Use --server http://127.0.0.1:8001 after `kubectl proxy`, or "
                "leave --server out to use the kubeconfig."
            )
        if err.status == 403:
            return (
                f"not allowed to list DLRMJobs {self._where()} ({said}). The operator's "
                "service account needs get, list, watch and patch on dlrmjobs "
                "(docs/operations.md, RBAC; the Helm chart grants them)."
            )
        return f"{self.server} answered {said} when listing DLRMJobs {self._where()}."

    def _transport_error(self, err: Exception) -> str:
        reason = getattr(err, "reason", None) or err
        text = str(reason)
        if "CERTIFICATE_VERIFY_FAILED" in text or "SSLCertVerificationError" in text:
            return (
                f"cannot verify the TLS certificate of {self.server} ({text}). Give the "
                "cluster's CA with --certificate-authority FILE (or fix the kubeconfig's "
                "certificate-authority); --insecure-skip-tls-verify turns verification "
                "off, for a test cluster only."
            )
        if "timed out" in text.lower() or "timeout" in type(reason).__name__.lower():
            return f"the API server at {self.server} did not answer within {self.timeout:g} s."
        return (
            f"cannot reach the API server at {self.server} ({text}). Is it running, and "
            "is the address right (--server, or the kubeconfig's cluster.server)?"
        )


async def keep_checking(
    readiness: Readiness, check: Callable[[], str | None], interval: float, timeout: float
) -> None:
    """Run ``check`` every ``interval`` seconds (in a thread) and record the outcome;
    a check still waiting after ``timeout`` is a failure until it returns."""
    while True:
        pending = asyncio.ensure_future(asyncio.to_thread(check))
        try:
            problem = await asyncio.wait_for(asyncio.shield(pending), timeout)
        except TimeoutError:
            readiness.failed(f"the API server has not answered a check for {timeout:g} s")
            problem = await pending
        if problem is None:
            readiness.succeeded()
        else:
            readiness.failed(problem)
        await asyncio.sleep(interval)


class HealthServer:
    def __init__(self, readiness: Readiness, host: str = "0.0.0.0", port: int = 8080) -> None:
        self.readiness = readiness
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, why = self.readiness.state()
        body: dict[str, Any] = {"status": "ready"} if ready else {"status": "not ready"}
        if not ready:
            body["reason"] = why
        return web.json_response(body, status=200 if ready else 503, dumps=_dumps)

    async def start(self) -> int:
        """Start serving; returns the port (useful with port 0)."""
        app = web.Application()
        app.add_routes([web.get("/healthz", self._healthz), web.get("/readyz", self._readyz)])
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)

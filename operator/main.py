"""Run the operator: kopf's engine (what ``kopf run`` starts) embedded in our process,
with our handlers, settings, health endpoints and planner pool.

``shardwise operator`` calls :func:`run`; tests call :func:`operate` on a thread with
a login pointing at the API emulator. Before kopf starts, :class:`ApiCheck` lists the
DLRMJobs where the operator serves them: no API server, no CRD, no rights or an
unverifiable certificate is a :class:`UserError` saying which and how to fix it (exit
2), not kopf's retries or a traceback; afterwards the same check feeds ``/readyz``
(docs/operator.md, "The operator process").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from shardwise.basics import UserError
from shardwise.operator.config import OperatorConfig
from shardwise.operator.context import OperatorContext
from shardwise.operator.events import EventRecorder
from shardwise.operator.handlers import configure, register
from shardwise.operator.health import INSTALL_CRD, ApiCheck, HealthServer, Readiness, keep_checking
from shardwise.operator.kube import KubeApi
from shardwise.operator.loop.planner_pool import PlanExecutor
from shardwise.operator.metrics import OperatorMetrics

logger = logging.getLogger("shardwise.operator")


@dataclass
class RunOptions:
    namespaces: Sequence[str] = ()
    clusterwide: bool = False
    health_host: str = "0.0.0.0"
    #: 0 picks a free port; None serves no health endpoints.
    health_port: int | None = 8080
    #: Port of the Prometheus ``/metrics`` endpoint; 0 picks a free port, None (the
    #: embedded default, as in tests) serves none. ``shardwise operator`` passes 9090.
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    #: The operator's series (tests read an embedded operator's registry here).
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    #: kopf peering: None runs standalone; a name joins that peering object.
    peering: str | None = None
    priority: int = 0
    config: OperatorConfig = field(default_factory=OperatorConfig)
    #: Where to reach the API; None means the pod's service account or the kubeconfig.
    server: str | None = None
    #: A bearer token for ``server`` (tests log in as the chart's service account).
    token: str | None = None
    #: ``server``'s TLS certificate is verified (against ``certificate_authority``, else
    #: the system's CAs) unless this is set; a plain http ``server`` has no TLS.
    insecure_skip_tls_verify: bool = False
    certificate_authority: str | None = None
    #: Check the DLRMJob API once before kopf starts (a problem is a UserError).
    preflight: bool = True
    #: Readiness re-checks the API this often (seconds), each check allowed this long.
    api_check_seconds: float = 10.0
    api_check_timeout: float = 5.0
    #: Set it to stop an embedded operator; None leaves stopping to SIGTERM/SIGINT.
    stop_flag: threading.Event | None = None
    ready_flag: threading.Event = field(default_factory=threading.Event)


def build_registry(ctx: OperatorContext, options: RunOptions) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    if options.server is None:
        kopf.on.login(registry=registry)(kopf.login_via_client)
    else:
        server, token = options.server, options.token

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(
                server=server,
                insecure=options.insecure_skip_tls_verify,
                ca_path=options.certificate_authority,
                scheme="Bearer" if token else None,
                token=token,
            )

    return registry


def exact_names(namespaces: Sequence[str]) -> bool:
    """Whether every namespace is a plain name, not one of kopf's patterns (globs,
    negations, comma lists)."""
    return bool(namespaces) and not any(set(ns) & set("*?!,") for ns in namespaces)


def settings_for(options: RunOptions) -> kopf.OperatorSettings:
    """kopf's settings for this run. With plain namespace names, kopf's cluster scanning
    is off: it would list and watch *all* namespaces to match patterns (and every CRD
    to notice new resources), which a namespaced operator is not allowed to, and kopf
    retries each 403 for about a minute before it serves the names as given. Without
    scanning it serves exactly those namespaces at once; the DLRMJob CRD must then
    exist when the operator starts (helm installs the chart's CRD first)."""
    settings = kopf.OperatorSettings()
    configure(settings)
    if not options.clusterwide and exact_names(options.namespaces):
        settings.scanning.disabled = True
    return settings


def api_check(options: RunOptions, kube: KubeApi) -> ApiCheck:
    """The check of the DLRMJob API for this scope (patterns: the discovery document)."""
    exact = tuple(options.namespaces) if exact_names(options.namespaces) else ()
    return ApiCheck(
        kube=kube,
        namespaces=exact,
        clusterwide=options.clusterwide,
        server=str(kube.api_client.configuration.host),
        timeout=options.api_check_timeout,
    )


def kopf_failure(err: BaseException, server: str) -> UserError | None:
    """kopf's own API errors (its ``APIError`` and subclasses, which kopf does not export)
    as a UserError that says what was not found; None for anything else (a bug)."""
    status = getattr(err, "status", None)
    if not type(err).__module__.startswith("kopf.") or not isinstance(status, int):
        return None
    cause = err.__cause__
    url = getattr(getattr(cause, "request_info", None), "real_url", None) or "a request"
    said = str(err).strip() or getattr(cause, "message", "") or "(no message)"
    text = f"the API server at {server} answered {status} for {url}: {said[:300]}"
    if status == 404:
        text += (
            ". Usually the DLRMJob CRD is not installed, or --server has a wrong path. "
            + INSTALL_CRD
        )
    return UserError(text)


async def operate(options: RunOptions, kube: KubeApi, planner: PlanExecutor) -> None:
    """Run until ``options.stop_flag`` is set (or the process is signalled)."""
    if not options.clusterwide and not options.namespaces:
        raise ValueError("give the namespaces to serve, or run cluster-wide")
    checker = kube.without_retries()
    check = api_check(options, checker)
    try:
        await _operate(options, kube, planner, check)
    finally:
        checker.close()


async def _operate(
    options: RunOptions, kube: KubeApi, planner: PlanExecutor, check: ApiCheck
) -> None:
    if options.preflight:
        problem = await asyncio.to_thread(check)
        if problem is not None:
            raise UserError(problem)
    recorder = EventRecorder(kube)
    ctx = OperatorContext(
        kube=kube,
        planner=planner,
        config=options.config,
        emit=recorder.emit,
        metrics=options.metrics,
    )
    metrics_server = None
    if options.metrics_port is not None:
        metrics_server = ctx.metrics.serve(options.metrics_port, options.metrics_host)
        logger.info("metrics on %s:%d (/metrics)", options.metrics_host, metrics_server.server_port)
    registry = build_registry(ctx, options)
    settings = settings_for(options)
    health = None
    checking: asyncio.Task[None] | None = None
    if options.health_port is not None:
        readiness = Readiness(
            options.ready_flag,
            max_age=2 * options.api_check_seconds + options.api_check_timeout,
        )
        health = HealthServer(readiness, options.health_host, options.health_port)
        port = await health.start()
        logger.info("health endpoints on %s:%d (/healthz, /readyz)", options.health_host, port)
        checking = asyncio.create_task(
            keep_checking(readiness, check, options.api_check_seconds, options.api_check_timeout),
            name="shardwise readiness check",
        )
    try:
        await kopf.operator(
            registry=registry,
            settings=settings,
            clusterwide=options.clusterwide,
            namespaces=list(options.namespaces),
            standalone=options.peering is None,
            peering_name=options.peering,
            priority=options.priority,
            stop_flag=options.stop_flag,
            ready_flag=options.ready_flag,
        )
    except Exception as err:
        failure = kopf_failure(err, check.server)
        if failure is None:
            raise
        raise failure from None
    finally:
        if options.stop_flag is not None:
            options.stop_flag.set()  # releases kopf's thread that waits for it
        if checking is not None:
            checking.cancel()
        await recorder.drain()  # the last transitions' Events
        if health is not None:
            await health.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


def run(options: RunOptions, planner_workers: int = 1) -> None:
    """Blocking entry for ``shardwise operator``; a problem with the API server, its
    credentials or the CRD is a :class:`UserError` (exit 2)."""
    if options.server:
        kube = KubeApi.for_host(
            options.server,
            options.token,
            verify_ssl=not options.insecure_skip_tls_verify,
            ca_cert=options.certificate_authority,
        )
    else:
        kube = KubeApi.from_environment()
    planner = PlanExecutor(workers=planner_workers)
    try:
        asyncio.run(operate(options, kube, planner))
    finally:
        planner.shutdown()
        kube.close()

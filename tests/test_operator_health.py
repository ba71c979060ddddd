"""The health endpoints and the API check behind readiness
(:mod:`shardwise.operator.health`): ``/readyz`` reflects whether the operator can
reach its API, not only that kopf started."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from k8s.server import EmulatorServer

from shardwise.operator.health import HealthServer, Readiness

pytest_plugins = ["k8s.fixtures"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_health_endpoints() -> None:
    ready = threading.Event()
    port = free_port()

    async def probe() -> list[int]:
        server = HealthServer(Readiness(ready), "127.0.0.1", port)
        await server.start()
        codes = []
        for path, flip in (("/healthz", False), ("/readyz", False), ("/readyz", True)):
            if flip:
                ready.set()
            code, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{port}{path}")
            codes.append(code)
        await server.stop()
        return codes

    assert asyncio.run(probe()) == [200, 503, 200]


def test_readiness_needs_a_recent_successful_check() -> None:
    now = [100.0]
    started = threading.Event()
    readiness = Readiness(started, max_age=10.0, clock=lambda: now[0])
    assert readiness.state() == (False, "starting: kopf has not finished its startup")
    started.set()
    ready, why = readiness.state()
    assert not ready and "first check" in why
    readiness.succeeded()
    assert readiness.state() == (True, "ready")
    now[0] += 11
    ready, why = readiness.state()
    assert not ready and "for 11 s" in why
    readiness.succeeded()
    readiness.failed("cannot reach the API server")
    assert readiness.state() == (False, "cannot reach the API server")
    readiness.succeeded()
    assert readiness.state() == (True, "ready")


@pytest.fixture
def own_api_server() -> Iterator[EmulatorServer]:
    """An emulator this test stops itself (the shared fixture's teardown would not)."""
    from k8s.helpers import NAMESPACE, load_crd

    from shardwise.operator.kube import KubeApi

    server = EmulatorServer().start()
    kube = KubeApi.for_host(server.url)
    kube.create(load_crd())
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    kube.close()
    yield server
    server.stop()


@pytest.mark.slow
def test_readyz_turns_503_when_the_api_server_goes_away(
    own_api_server: EmulatorServer, plan_pool: Any
) -> None:
    from k8s.fixtures import OperatorThread

    port = free_port()
    op = OperatorThread(own_api_server.url, plan_pool, health_port=port)
    op.options.api_check_seconds = 0.2
    op.options.api_check_timeout = 1.0
    op.start()
    try:
        url = f"http://127.0.0.1:{port}/readyz"
        deadline = time.monotonic() + 10
        while get(url)[0] != 200:
            assert time.monotonic() < deadline, get(url)
            time.sleep(0.1)
        own_api_server.stop()
        deadline = time.monotonic() + 10
        while (answer := get(url))[0] == 200:
            assert time.monotonic() < deadline, "/readyz stayed 200 with no API server"
            time.sleep(0.1)
        code, body = answer
        assert code == 503 and body["status"] == "not ready"
        assert "cannot reach the API server" in body["reason"]
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        op.stop()

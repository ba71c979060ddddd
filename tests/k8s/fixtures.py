"""Pytest fixtures: the API emulator, the operator on kopf's real engine, the planner pool.

Load them with ``pytest_plugins = ["k8s.fixtures"]`` in a test module. The operator
runs embedded (``kopf.operator()``) on a thread with its own event loop, logging in
to the emulator over HTTP; the tests act as a user and as the missing controllers
would, over HTTP too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s.helpers import NAMESPACE, TEST_CONFIG, load_crd
from k8s.kubelet import LocalCluster, wait_for_local_kubelets
from k8s.server import EmulatorServer
from shardwise.operator.config import OperatorConfig
from shardwise.operator.kube import KubeApi
from shardwise.operator.loop.planner_pool import PlanExecutor, process_pool
from shardwise.operator.main import RunOptions, operate


class OperatorThread:
    """``kopf.operator()`` on a thread with its own event loop; stop() is graceful."""

    def __init__(
        self,
        url: str,
        executor: concurrent.futures.Executor,
        config: OperatorConfig | None = None,
        namespaces: tuple[str, ...] = (NAMESPACE,),
        clusterwide: bool = False,
        health_port: int | None = None,
        token: str | None = None,
    ) -> None:
        self.options = RunOptions(
            namespaces=namespaces,
            clusterwide=clusterwide,
            health_host="127.0.0.1",
            health_port=health_port,
            config=config or TEST_CONFIG,
            server=url,
            token=token,
            stop_flag=threading.Event(),
        )
        self.kube = KubeApi.for_host(url, token)
        self.planner = PlanExecutor(executor)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardwise-operator", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(operate(self.options, self.kube, self.planner))
        except BaseException as err:
            self.error = err
            self.options.ready_flag.set()

    def start(self, timeout: float = 30.0) -> OperatorThread:
        self._thread.start()
        if not self.options.ready_flag.wait(timeout):
            raise RuntimeError("the operator did not become ready")
        if self.error is not None:
            raise RuntimeError("the operator failed to start") from self.error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        assert self.options.stop_flag is not None
        self.options.stop_flag.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("the operator did not stop")
        self.kube.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


@pytest.fixture(scope="session")
def plan_pool() -> Iterator[concurrent.futures.ProcessPoolExecutor]:
    """One planner process for the session: torch is imported once."""
    pool = process_pool(1)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def api_server() -> Iterator[EmulatorServer]:
    """A fresh emulator with the DLRMJob CRD installed (as `kubectl apply -f crds/`)."""
    server = EmulatorServer().start()
    kube = KubeApi.for_host(server.url)
    kube.create(load_crd())
    for ns in ("default", NAMESPACE):
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.close()
    yield server
    server.stop()
    assert server.emulator.unexpected == [], "the emulator hit an internal error"


@pytest.fixture
def kube(api_server: EmulatorServer) -> Iterator[KubeApi]:
    client = KubeApi.for_host(api_server.url)
    yield client
    client.close()


@pytest.fixture
def start_operator(
    api_server: EmulatorServer, plan_pool: concurrent.futures.Executor
) -> Iterator[Callable[..., OperatorThread]]:
    """Start operators against the emulator; all are stopped at teardown."""
    started: list[OperatorThread] = []

    def start(**kwargs: Any) -> OperatorThread:
        op = OperatorThread(api_server.url, plan_pool, **kwargs).start()
        started.append(op)
        return op

    yield start
    for op in started:
        if op.alive:
            op.stop()


# --------------------------------------------------------------------------- pods that run
@pytest.fixture
def local_cluster(
    api_server: EmulatorServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[LocalCluster]:
    """The Job controller, scheduler and kubelet stand-ins (:mod:`k8s.kubelet`) on a
    thread: pods of worker Jobs bound to nodes made with ``add_local_node`` run as local
    processes (logs, volumes under ``tmp_path/cluster``). At teardown every process is
    killed; when the test failed, every pod's log is printed."""
    wait_for_local_kubelets(monkeypatch)
    cluster = LocalCluster(api_server.url, tmp_path / "cluster").start()
    failed = request.session.testsfailed
    yield cluster
    cluster.stop()
    if request.session.testsfailed > failed:
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", f"pods of {request.node.name}")
            reporter.write_line(cluster.kubelet.logs(last=60))
    assert cluster.errors == [], "the local cluster hit an error:\n" + "\n".join(cluster.errors)

"""The operator's metrics from a real run: kopf's engine against the API emulator plans
a DLRMJob, and its registry shows the plan's prediction, phase and planning time; when
the job is deleted, its series go."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from k8s.helpers import DJ, add_node, dlrmjob, wait_phase
from k8s.helpers import NAMESPACE as NS
from k8s.server import EmulatorServer
from prometheus_client import generate_latest

from shardwise.operator.kube import KubeApi
from shardwise.planner.plan import Plan

if TYPE_CHECKING:
    from k8s.fixtures import OperatorThread

pytest_plugins = ["k8s.fixtures"]
ROOT = Path(__file__).resolve().parents[1]
Start = Callable[..., "OperatorThread"]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in exposition text (labels in any order)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        got = dict(kv.split("=", 1) for kv in head[len(name) + 1 : -1].split(","))
        if {k: v.strip('"') for k, v in got.items()} == labels:
            return float(value)
    return None


def test_a_planned_job_has_series_and_loses_them_when_deleted(
    api_server: EmulatorServer, kube: KubeApi, start_operator: Start
) -> None:
    add_node(kube, "gpu-1", gpus=4)
    op = start_operator()
    registry = op.options.metrics.registry
    kube.create(dlrmjob("small", NS))
    status = wait_phase(kube, NS, "small", "Running")
    cm = kube.get("v1", "configmaps", NS, status["plan"]["configMap"])
    assert cm is not None
    plan = Plan.model_validate_json(cm["data"]["plan.json"])
    assert plan.predicted is not None
    out = generate_latest(registry).decode()
    job = {"namespace": NS, "job": "small"}
    for rank, seconds in enumerate(plan.predicted.per_rank_seconds):
        got = sample(
            out,
            "shardwise_predicted_embedding_cost_seconds",
            **job,
            rank=str(rank),
            phase="total",
        )
        assert got == pytest.approx(seconds)
    assert sample(out, "shardwise_plan_imbalance_ratio", **job) == pytest.approx(
        status["plan"]["imbalance"]
    )
    assert sample(out, "shardwise_planning_duration_seconds_count", **job) == 1
    assert sample(out, "shardwise_job_phase", **job, phase="Running") == 1
    assert sample(out, "shardwise_job_phase", **job, phase="Pending") == 0
    assert sample(out, "shardwise_job_waiting_for_capacity", **job) == 0
    kinds = plan.kinds()
    for kind in ("table_wise", "column_wise", "row_wise", "table_row_wise", "grid"):
        assert sample(out, "shardwise_plan_tables", **job, kind=kind) == kinds.get(kind, 0)

    kube.delete(*DJ, NS, "small")
    deadline = time.monotonic() + 20
    while 'job="small"' in generate_latest(registry).decode():
        assert time.monotonic() < deadline, "the deleted job's series stayed"
        time.sleep(0.1)


def test_shardwise_operator_takes_the_charts_args_and_serves_metrics(
    api_server: EmulatorServer, kube: KubeApi
) -> None:
    """``shardwise operator`` with exactly the args the chart's Deployment passes serves
    /healthz on the liveness port and the operator's /metrics on the metrics port."""
    helm = Path(os.environ.get("HELM") or ROOT / ".tools" / "bin" / "helm")
    if not helm.exists():
        pytest.fail(f"{helm} is missing: run `make tools`")
    liveness, metrics = free_port(), free_port()
    proc = subprocess.run(
        [
            str(helm),
            "template",
            "r",
            str(ROOT / "charts" / "shardwise"),
            "-n",
            NS,
            "--set",
            "operator.watch.allNamespaces=false",
            "--set",
            f"operator.livenessPort={liveness}",
            "--set",
            f"operator.metricsPort={metrics}",
            "--show-only",
            "templates/deployment.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    (container,) = yaml.safe_load(proc.stdout)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "operator" and "--standalone" in args
    add_node(kube, "gpu-1", gpus=4)
    exe = Path(sys.executable).parent / "shardwise"
    op = subprocess.Popen(
        [str(exe), *args, f"--server={api_server.url}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        kube.create(dlrmjob("cli", NS))
        wait_phase(kube, NS, "cli", "Running", timeout=60)
        # The chart's worker account reaches the workers (rank 0 writes the live summary).
        assert f"--worker-service-account-namespace={NS}" in args
        workers = kube.get("batch/v1", "jobs", NS, "cli-workers")
        assert workers is not None
        pod = workers["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "shardwise-worker"
        deadline = time.monotonic() + 30
        while True:
            assert op.poll() is None, op.stderr.read() if op.stderr else ""
            with contextlib.suppress(OSError):
                body = fetch(f"http://127.0.0.1:{metrics}/metrics")
                if 'shardwise_job_phase{job="cli",namespace="ml",phase="Running"} 1.0' in body:
                    break
            assert time.monotonic() < deadline, "no Running series on /metrics"
            time.sleep(0.2)
        assert "shardwise_predicted_embedding_cost_seconds{" in body
        assert '"alive"' in fetch(f"http://127.0.0.1:{liveness}/healthz")
    finally:
        op.terminate()
        try:
            op.wait(20)
        except subprocess.TimeoutExpired:
            op.kill()
            op.wait()
        if op.stderr:
            op.stderr.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def test_a_worker_account_namespace_needs_the_account() -> None:
    """``--worker-service-account-namespace`` says where the account exists: alone it
    would mean nothing, so it is refused before anything starts."""
    from cli_helpers import shardwise

    ran = shardwise("operator", "-n", NS, "--worker-service-account-namespace", NS)
    assert ran.code == 2
    assert "give that too" in ran.stderr and "--worker-service-account" in ran.stderr

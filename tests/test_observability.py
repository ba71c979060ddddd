"""Observability: the operator's metrics, the alert rules under promtool, and a
real Prometheus (Debian's ``prometheus``, ``make tools``) scraping the operator's and
the workers' endpoints on loopback, queried through ``/api/v1/query``.

The Prometheus binaries are required, not optional: a missing binary fails with the
command that installs it (a skip would let CI pass without checking anything).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import load_script
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from shardwise.operator.metrics import PHASES, OperatorMetrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "charts" / "shardwise" / "rules" / "shardwise-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "promtool" / "shardwise-alerts.test.yaml"
DASHBOARDS = ROOT / "charts" / "shardwise" / "dashboards"
NS, JOB = "ml", "demo"
#: The scenario the real-Prometheus test exports: the plan's prediction per rank and
#: what the workers measure (rank 3 slower than predicted: a stale model).
PREDICTED = [0.010, 0.014, 0.012, 0.016]
MEASURED = [0.011, 0.015, 0.0126, 0.028]


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed: run `make tools` (scripts/install-tools.sh installs "
            "Debian's prometheus package, which has prometheus and promtool)"
        )
    return path


def text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


# --------------------------------------------------------------------------- the operator's series


def test_plan_series_are_replaced_and_forgotten() -> None:
    m = OperatorMetrics()
    m.observe_plan(NS, JOB, [0.01, 0.02, 0.03], 0.33, planning_seconds=0.5)
    m.observe_plan(NS, "other", [0.01], 0.0)
    rank2 = 'job="demo",namespace="ml",phase="total",rank="2"'
    assert f"shardwise_predicted_embedding_cost_seconds{{{rank2}}} 0.03" in text(m.registry)
    # A re-plan for 2 ranks drops rank 2's series.
    m.observe_plan(NS, JOB, [0.01, 0.02], 0.25, planning_seconds=0.2)
    out = text(m.registry)
    assert 'rank="2"' not in out
    assert 'shardwise_plan_imbalance_ratio{job="demo",namespace="ml"} 0.25' in out
    assert 'shardwise_planning_duration_seconds_count{job="demo",namespace="ml"} 2.0' in out
    m.observe_status(NS, JOB, {"phase": "Running", "conditions": []})
    m.observe_reshard(NS, JOB, "NodeLost")
    m.observe_reshard(NS, JOB, "NodeAdded", 2.5)
    assert 'shardwise_reshard_duration_seconds_sum{job="demo",namespace="ml"} 2.5' in text(
        m.registry
    )
    assert 'shardwise_reshards_total{job="demo",namespace="ml",reason="NodeLost"} 1.0' in text(
        m.registry
    )
    m.observe_reconcile_error(NS, JOB)
    m.forget_job(NS, JOB)
    out = text(m.registry)
    assert 'job="demo"' not in out
    assert 'job="other"' in out  # the other job's series stay


def test_status_sets_phase_capacity_and_model_age() -> None:
    m = OperatorMetrics()
    now = datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.UTC)
    status = {
        "phase": "Pending",
        "conditions": [{"type": "Capacity", "status": "False", "reason": "InsufficientCapacity"}],
        "plan": {"imbalance": 0.125, "predictedMaxSeconds": 0.02},
        "costModel": {"gpuType": "H100", "publishedAt": "2026-11-22T11:00:00Z"},
    }
    m.observe_status(NS, JOB, status, now)
    out = text(m.registry)
    for phase in PHASES:
        value = "1.0" if phase == "Pending" else "0.0"
        assert f'shardwise_job_phase{{job="demo",namespace="ml",phase="{phase}"}} {value}' in out
    assert 'shardwise_job_waiting_for_capacity{job="demo",namespace="ml"} 1.0' in out
    assert 'shardwise_cost_model_age_seconds{gpu_type="H100",namespace="ml"} 3600.0' in out
    assert 'shardwise_plan_imbalance_ratio{job="demo",namespace="ml"} 0.125' in out
    m.observe_status(NS, JOB, {"phase": "Running", "conditions": []}, now)
    assert 'shardwise_job_waiting_for_capacity{job="demo",namespace="ml"} 0.0' in text(m.registry)


def test_live_figures_and_imbalance_decisions() -> None:
    """The loop's measured figures, its predicted gain and its decisions: set, counted,
    dropped when stale, refused outside the fixed set, and forgotten with the job."""
    m = OperatorMetrics()
    job = 'job="demo",namespace="ml"'
    m.observe_live(NS, JOB, 0.028, 1.47)
    m.observe_imbalance_decision(NS, JOB, "declined_gain", 0.04)
    m.observe_imbalance_decision(NS, JOB, "resharded", 0.31)
    m.observe_imbalance_decision(NS, JOB, "rate_limited")
    m.observe_imbalance_decision(NS, JOB, "rate_limited")
    m.observe_live(NS, "other", 0.01, 1.02)
    out = text(m.registry)
    assert f"shardwise_measured_max_rank_seconds{{{job}}} 0.028" in out
    assert f"shardwise_measured_imbalance{{{job}}} 1.47" in out
    # A decision without a re-plan keeps the last re-plan's gain.
    assert f"shardwise_predicted_reshard_gain{{{job}}} 0.31" in out
    counts = 'shardwise_imbalance_decisions_total{decision="%s",job="demo",namespace="ml"} %s'
    assert counts % ("rate_limited", "2.0") in out
    assert counts % ("resharded", "1.0") in out
    assert counts % ("declined_gain", "1.0") in out
    with pytest.raises(ValueError, match="'ImbalanceResharded': not one of resharded"):
        m.observe_imbalance_decision(NS, JOB, "ImbalanceResharded")
    # Workers stopped (a reshard): no measured figure, so no alert on a stale one.
    m.forget_live(NS, JOB)
    out = text(m.registry)
    assert f"shardwise_measured_imbalance{{{job}}}" not in out
    assert f"shardwise_measured_max_rank_seconds{{{job}}}" not in out
    assert counts % ("resharded", "1.0") in out
    m.forget_job(NS, JOB)
    out = text(m.registry)
    assert 'job="demo"' not in out
    assert 'shardwise_measured_imbalance{job="other",namespace="ml"} 1.02' in out


# --------------------------------------------------------------------------- rules under promtool


def test_promtool_checks_the_rules() -> None:
    proc = subprocess.run(
        [binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 8 rules found" in proc.stdout


def test_promtool_unit_tests_every_alert(tmp_path: Path) -> None:
    import yaml

    proc = subprocess.run(
        [binary("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = {
        r["alert"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert alerts == tested
    # The unit tests can fail: the same tests against a rules file whose thresholds moved.
    broken = tmp_path / "rules" / RULES.name
    broken.parent.mkdir()
    broken.write_text(
        RULES.read_text()
        .replace("> 1.5", "> 2.5")
        .replace("> 0.25", "> 0.5")
        .replace("> 1.3", "> 1.6")
    )
    tests = tmp_path / "tests" / RULE_TESTS.name
    tests.parent.mkdir()
    tests.write_text(RULE_TESTS.read_text().replace("../../charts/shardwise/rules/", "../rules/"))
    proc = subprocess.run(
        [binary("promtool"), "test", "rules", str(tests)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "ShardwiseCostModelStale" in proc.stdout + proc.stderr
    assert "ShardwiseJobImbalanced" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- a real Prometheus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = get_json(url)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait(self, expr: str, want: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Poll until ``expr`` returns ``want`` series (scrapes and rules run every 1 s)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if len(result) == want or time.monotonic() > deadline:
                return result
            time.sleep(0.25)


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: dict[str, list[str]]) -> Iterator[Prometheus]:
    exe = binary("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            # honor_labels: the series' own namespace/job (the DLRMJob) labels win, as the
            # chart's ServiceMonitor and PodMonitor set it.
            {"job_name": name, "honor_labels": True, "static_configs": [{"targets": t}]}
            for name, t in targets.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                get_json(f"{base}/api/v1/status/buildinfo")
                break
            except OSError:
                assert time.monotonic() < deadline, "prometheus did not start"
                time.sleep(0.1)
        yield Prometheus(base)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_a_real_prometheus_scrapes_the_operator_and_the_workers(tmp_path: Path) -> None:
    from shardwise.runtime.live_cost import CostSample, WorkerMetrics

    # The operator's endpoint, as `shardwise operator --metrics-port` serves it.
    op = OperatorMetrics()
    op.observe_plan(NS, JOB, PREDICTED, 0.1875, planning_seconds=0.42)
    op.observe_status(NS, JOB, {"phase": "Running", "conditions": []})
    op.observe_status(NS, "gone", {"phase": "Pending", "conditions": []})
    op.observe_profiling_run(NS, "H100")
    op.observe_reshard(NS, JOB, "NodeAdded")
    # The live summary's figures: rank 3's compute against the ranks' mean.
    op.observe_live(NS, JOB, max(MEASURED), max(MEASURED) / (sum(MEASURED) / len(MEASURED)))
    op.observe_imbalance_decision(NS, JOB, "declined_cost", 0.12)
    servers = [op.serve(0, "127.0.0.1")]
    # One endpoint per rank, as the worker runtime serves them.
    for rank, measured in enumerate(MEASURED):
        wm = WorkerMetrics(CollectorRegistry(), namespace=NS, job=JOB, rank=rank)
        part = measured / 4
        wm.observe_cost(CostSample(part, part, part, part, input_dist=0.001))
        for _ in range(3):
            wm.observe_step(0.05, loss=0.7)
        # (WorkerMetrics.serve(0) means "off"; the test needs a free port)
        servers.append(start_http_server(0, "127.0.0.1", registry=wm.registry)[0])
    addr = [f"127.0.0.1:{s.server_port}" for s in servers]
    started = time.monotonic()
    try:
        with prometheus(
            tmp_path, {"shardwise-operator": addr[:1], "shardwise-workers": addr[1:]}
        ) as prom:
            up = prom.wait("up == 1", want=5)
            assert len(up) == 5, up
            predicted = prom.wait('shardwise_predicted_embedding_cost_seconds{phase="total"}', 4)
            measured = prom.wait('shardwise_embedding_cost_seconds{phase="total"}', 4)
            ratio = prom.wait("shardwise:embedding_cost_measured_over_predicted:ratio", 4)
            imbalance = prom.wait("shardwise:embedding_cost_imbalance:ratio", 1)

            def by_rank(result: list[dict[str, Any]]) -> dict[int, float]:
                assert {(r["metric"]["namespace"], r["metric"]["job"]) for r in result} == {
                    (NS, JOB)
                }
                return {int(r["metric"]["rank"]): float(r["value"][1]) for r in result}

            assert by_rank(predicted) == pytest.approx(dict(enumerate(PREDICTED)))
            assert by_rank(measured) == pytest.approx(dict(enumerate(MEASURED)))
            want = {r: m / p for r, (m, p) in enumerate(zip(MEASURED, PREDICTED, strict=True))}
            assert by_rank(ratio) == pytest.approx(want)
            mean = sum(MEASURED) / len(MEASURED)
            assert float(imbalance[0]["value"][1]) == pytest.approx(1 - mean / max(MEASURED))
            # Counters, histograms and the phase gauge reach Prometheus under their names.
            (plan_imb,) = prom.query("shardwise_plan_imbalance_ratio")
            assert float(plan_imb["value"][1]) == pytest.approx(0.1875)
            (planning,) = prom.query("shardwise_planning_duration_seconds_count")
            assert float(planning["value"][1]) == 1
            (running,) = prom.query('shardwise_job_phase{job="demo"} == 1')
            assert running["metric"]["phase"] == "Running"
            (reshards,) = prom.query("shardwise_reshards_total")
            assert reshards["metric"]["reason"] == "NodeAdded"
            steps = prom.query("sum(shardwise_worker_steps_total)")
            assert float(steps[0]["value"][1]) == 12
            # The stale-model alert's condition holds for rank 3 only (pending: `for` 30m).
            (stale,) = prom.query("shardwise:embedding_cost_measured_over_predicted:ratio > 1.5")
            assert stale["metric"]["rank"] == "3"
            # The job-imbalanced alert's condition holds (1.69 > 1.3; pending: `for` 15m).
            alert = "max by (namespace, job) (shardwise_measured_imbalance) > 1.3"
            (imbalanced,) = prom.query(alert)
            assert float(imbalanced["value"][1]) == pytest.approx(
                max(MEASURED) / (sum(MEASURED) / len(MEASURED))
            )
            (decided,) = prom.query("shardwise_imbalance_decisions_total")
            assert decided["metric"]["decision"] == "declined_cost"
            # Every query of the operator dashboard parses and runs ($namespace, $job set);
            # the bar gauge's two queries show the 4 ranks each.
            dash = json.loads((DASHBOARDS / "shardwise-operator.json").read_text())
            for panel in dash["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace("$namespace", NS).replace("$job", JOB)
                    result = prom.query(expr)
                    if panel["type"] == "bargauge":
                        assert len(result) == 4, expr
            # A deleted job's series vanish from Prometheus at the next scrape.
            assert len(prom.query('shardwise_job_phase{job="gone"}')) == len(PHASES)
            op.forget_job(NS, "gone")
            assert prom.wait('shardwise_job_phase{job="gone"}', 0) == []
            data = {
                "namespace": NS,
                "job": JOB,
                "prometheus": get_json(f"{prom.base}/api/v1/status/buildinfo")["data"]["version"],
                "predicted": by_rank(predicted),
                "measured": by_rank(measured),
                "ratio": by_rank(ratio),
            }
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert time.monotonic() - started < 45
    # The same data, plotted as docs/observability-predicted-vs-measured.png shows it.
    out = os.environ.get("SHARDWISE_OBSERVABILITY_JSON")
    if out:
        Path(out).write_text(json.dumps(data, indent=2))
    module = load_script("scripts/render_metrics_png.py")
    png = tmp_path / "out.png"
    module.render(json.loads(json.dumps(data)), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The chart's Grafana dashboards: the operator dashboard is what scripts/dashboards.py
(grafana-foundation-sdk) generates, and every query of every dashboard names only
metrics the code exports or recording rules the chart's rules file defines."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from conftest import load_script
from prometheus_client import CollectorRegistry

from shardwise.operator.metrics import OperatorMetrics
from shardwise.runtime.live_cost import WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "charts" / "shardwise" / "dashboards"
RULES = ROOT / "charts" / "shardwise" / "rules" / "shardwise-alerts.yaml"
NAME = re.compile(r"\bshardwise[_:][a-zA-Z0-9_:]*")


def exported() -> set[str]:
    """Every series name a scrape of the operator or a worker can show."""
    worker = CollectorRegistry()
    WorkerMetrics(worker, namespace="ns", job="j", rank=0)
    names: set[str] = set()
    for family in [*worker.collect(), *OperatorMetrics().registry.collect()]:
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names.update(f"{family.name}_{s}" for s in ("bucket", "sum", "count"))
    return names


def recorded() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["record"] for g in groups for r in g["rules"] if "record" in r}


def expressions(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if v.get("type") == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    exprs += [a["expr"] for a in dash.get("annotations", {}).get("list", []) if "expr" in a]
    return exprs


def unknown_metrics(exprs: list[str], known: set[str]) -> set[str]:
    return {m for e in exprs for m in NAME.findall(e)} - known


def test_operator_dashboard_is_generated_by_the_sdk() -> None:
    committed = (DASHBOARDS / "shardwise-operator.json").read_text()
    assert committed == load_script("scripts/dashboards.py").render(), (
        "run: python scripts/dashboards.py"
    )


def test_every_query_names_exported_metrics() -> None:
    known = exported() | recorded()
    paths = sorted(DASHBOARDS.glob("*.json"))
    assert {p.name for p in paths} >= {"shardwise-operator.json", "shardwise-workers.json"}
    for path in paths:
        exprs = expressions(json.loads(path.read_text()))
        assert exprs, path.name
        assert all(NAME.search(e) for e in exprs), path.name
        assert not unknown_metrics(exprs, known), path.name
    # The check can fail: a typo'd or removed metric is caught.
    assert unknown_metrics(['rate(shardwise_reshard_total{job="$job"}[5m])'], known) == {
        "shardwise_reshard_total"
    }


def test_operator_dashboard_has_the_issue_panels() -> None:
    dash = json.loads((DASHBOARDS / "shardwise-operator.json").read_text())
    by_title = {p["title"]: p for p in dash["panels"]}
    bar = by_title["Embedding cost per rank: predicted vs measured"]
    assert bar["type"] == "bargauge"
    used = {m for t in bar["targets"] for m in NAME.findall(t["expr"])}
    assert used == {
        "shardwise_predicted_embedding_cost_seconds",
        "shardwise_embedding_cost_seconds",
    }
    types = {p["type"] for p in dash["panels"]}
    assert {"bargauge", "timeseries", "stat"} <= types
    (annotation,) = dash["annotations"]["list"]
    assert "shardwise_reshards_total" in annotation["expr"]
    text = json.dumps(dash)
    for metric in (
        "shardwise_plan_imbalance_ratio",
        "shardwise_planning_duration_seconds_bucket",
        "shardwise_cost_model_age_seconds",
        "shardwise_job_phase",
        "shardwise_profiling_failures_total",
    ):
        assert metric in text, metric
    kinds = by_title["Tables by sharding kind"]
    assert kinds["type"] == "stat"
    assert [t["expr"] for t in kinds["targets"]] == [
        'shardwise_plan_tables{namespace="$namespace", job="$job"} > 0'
    ]


def test_operator_dashboard_shows_the_imbalance_loop() -> None:
    """The measured imbalance (the alert's figure) on the left axis; the loop's predicted
    gain (a fraction) and its decisions on the right, each in its own unit."""
    dash = json.loads((DASHBOARDS / "shardwise-operator.json").read_text())
    by_title = {p["title"]: p for p in dash["panels"]}
    panel = by_title["Measured imbalance (max/mean) and predicted reshard gain"]
    assert panel["type"] == "timeseries"
    metrics = {t["refId"]: set(NAME.findall(t["expr"])) for t in panel["targets"]}
    assert metrics == {
        "A": {"shardwise_measured_imbalance"},
        "B": {"shardwise_predicted_reshard_gain"},
        "C": {"shardwise_imbalance_decisions_total"},
    }
    assert all('job="$job"' in t["expr"] for t in panel["targets"])
    assert panel["fieldConfig"]["defaults"]["unit"] == "none"  # a ratio >= 1, not a percent
    overrides = {
        o["matcher"]["options"]: {p["id"]: p["value"] for p in o["properties"]}
        for o in panel["fieldConfig"]["overrides"]
    }
    assert overrides["B"]["unit"] == "percentunit"
    assert overrides["B"]["custom.axisPlacement"] == overrides["C"]["custom.axisPlacement"]
    assert overrides["C"]["custom.axisPlacement"] == "right"
    # The alert the description names exists, on the same metric.
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert "ShardwiseJobImbalanced" in panel["description"]
    assert "shardwise_measured_imbalance" in alerts["ShardwiseJobImbalanced"]["expr"]
    # No panel overlaps another on Grafana's 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert g["x"] + g["w"] <= 24 and not cells & mine, p["title"]
        cells |= mine

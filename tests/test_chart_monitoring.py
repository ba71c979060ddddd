"""The chart's monitoring: the metrics Service, the ServiceMonitor, PodMonitor and
PrometheusRule (only where the Prometheus Operator is served), and the Grafana
dashboards, which query only metrics the workers and the operator export."""

from __future__ import annotations

import json
import re

import yaml
from chart_helpers import CHART, NS, Obj, find, one, operator_container
from test_observability_dashboards import exported as exported_metric_names

from shardwise import names

pytest_plugins = ["chart_helpers"]


# --------------------------------------------------------------------------- metrics


def test_metrics_service_selects_the_operator(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["customized"]
    svc = one(objs, "Service")
    pod = one(objs, "Deployment")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 9191
    assert port["targetPort"] in {p["name"] for p in operator_container(objs)["ports"]}


def test_monitors_only_where_the_prometheus_operator_is_served(
    rendered: dict[str, list[Obj]],
) -> None:
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert not find(rendered["default"], kind)
        assert find(rendered["default+monitoring"], kind)
        assert not find(rendered["minimal"], kind)


def test_service_monitor_targets_the_metrics_service(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["namespaced"]
    sm = one(objs, "ServiceMonitor")
    svc = one(objs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    assert sm["metadata"]["labels"]["release"] == "prom"


def test_pod_monitor_scrapes_every_worker_rank(rendered: dict[str, list[Obj]]) -> None:
    """Workers are labelled shardwise.dev/component=worker (docs/design.md §3); rank r serves
    port SHARDWISE_METRICS_PORT + local rank, named `metrics` or `metrics-<r>`."""
    cluster = one(rendered["default+monitoring"], "PodMonitor")
    assert cluster["spec"]["namespaceSelector"] == {"any": True}
    assert cluster["spec"]["selector"]["matchLabels"] == {"shardwise.dev/component": "worker"}
    (endpoint,) = cluster["spec"]["podMetricsEndpoints"]
    keep = next(r for r in endpoint["relabelings"] if r["action"] == "keep")
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    pattern = re.compile(f"^(?:{keep['regex']})$")  # Prometheus anchors relabel regexes
    assert all(pattern.match(n) for n in ("metrics", "metrics-1", "metrics-63"))
    assert not any(pattern.match(n) for n in ("rdzv", "health", "metricsx"))
    namespaced = one(rendered["namespaced"], "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_worker_rendering_matches_the_pod_monitor() -> None:
    """The operator's worker pods carry the labels and the port name the PodMonitor
    selects (shardwise.operator.render.container)."""

    assert names.LABEL_COMPONENT == "shardwise.dev/component"
    assert names.LABEL_JOB == "shardwise.dev/job"
    assert names.COMPONENT_WORKER == "worker"


def test_prometheus_rule_is_the_rules_file_with_the_values_threshold(
    rendered: dict[str, list[Obj]],
) -> None:
    """The PrometheusRule carries rules/shardwise-alerts.yaml verbatim, except that
    ShardwiseJobImbalanced's threshold is metrics.prometheusRule.imbalanceThreshold."""
    groups = yaml.safe_load((CHART / "rules" / "shardwise-alerts.yaml").read_text())["groups"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    default = values["metrics"]["prometheusRule"]["imbalanceThreshold"]

    def imbalanced(gs: list[Obj]) -> Obj:
        (rule,) = [r for g in gs for r in g["rules"] if r.get("alert") == "ShardwiseJobImbalanced"]
        return rule

    # The file's own threshold is the values' default, so the plain file and the chart agree.
    assert imbalanced(groups)["expr"].endswith(f"> {default}")
    assert one(rendered["default+monitoring"], "PrometheusRule")["spec"]["groups"] == groups
    custom = one(rendered["customized"], "PrometheusRule")["spec"]["groups"]
    assert imbalanced(custom)["expr"] == imbalanced(groups)["expr"].replace(
        f"> {default}", "> 1.55"
    )
    imbalanced(custom)["expr"] = imbalanced(groups)["expr"]
    assert custom == groups, "only that threshold differs"


# --------------------------------------------------------------------------- dashboards


def test_dashboards_query_exported_metrics(rendered: dict[str, list[Obj]]) -> None:
    paths = sorted((CHART / "dashboards").glob("*.json"))
    assert paths
    exported = exported_metric_names()
    uids = set()
    for path in paths:
        dash = json.loads(path.read_text())
        assert dash["title"] and dash["uid"] not in uids
        uids.add(dash["uid"])
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        exprs += [
            v["query"]["query"]
            for v in dash["templating"]["list"]
            if isinstance(v.get("query"), dict)
        ]
        assert exprs, path.name
        used = {m for e in exprs for m in re.findall(r"\bshardwise_[a-z_]+", e)}
        assert used, path.name
        assert used <= exported, (
            f"{path.name} queries metrics nobody exports: {sorted(used - exported)}"
        )
    maps = find(rendered["default"], "ConfigMap")
    assert {next(iter(m["data"])) for m in maps} == {p.name for p in paths}
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        (body,) = m["data"].values()
        json.loads(body)
    assert {m["metadata"]["namespace"] for m in find(rendered["customized"], "ConfigMap")} == {
        "monitoring"
    }

"""The operator's Deployment: one hardened replica, its flags following the watch scope
and peering, its image reference, and the customized values reaching its pod."""

from __future__ import annotations

import yaml
from chart_helpers import CHART, NS, SCENARIOS, Obj, find, is_hook, one, operator_container

pytest_plugins = ["chart_helpers"]


def test_deployment_is_one_hardened_replica(rendered: dict[str, list[Obj]]) -> None:
    for scenario, objs in rendered.items():
        deploy = one(objs, "Deployment")
        spec = deploy["spec"]
        assert spec["replicas"] == 1, scenario
        assert spec["strategy"] == {"type": "Recreate"}, scenario
        pod = spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        c = operator_container(objs)
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
        assert f"--liveness-port={ports['health']}" in c["args"]
        assert f"--metrics-port={ports['metrics']}" in c["args"]
        # The read-only root filesystem leaves /tmp (an emptyDir) as the only writable path.
        assert [m["mountPath"] for m in c["volumeMounts"]] == ["/tmp"]
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["HOME"]["value"].startswith("/tmp")
        # The pod template's labels match the selector (else the API refuses it).
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_operator_args_follow_the_scope_and_peering(rendered: dict[str, list[Obj]]) -> None:
    """The assumed `shardwise operator` interface (docs/operations.md, "Operator flags")."""
    args = {s: operator_container(objs)["args"] for s, objs in rendered.items()}
    assert args["default"] == [
        "operator",
        "--all-namespaces",
        "--liveness-port=8080",
        "--metrics-port=9090",
        "--worker-service-account=shardwise-worker",
        f"--worker-service-account-namespace={NS}",
        "--standalone",
    ]
    assert args["namespaced"][:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in args["namespaced"]
    assert args["namespaced-release-ns"][1] == f"--namespace={NS}"
    assert args["peering-cluster"][-2:] == ["--peering=shardwise", "--priority=50"]
    assert "--standalone" not in args["peering-cluster"]
    assert args["customized"][-1] == "--verbose"


def test_workers_run_as_the_account_the_chart_creates(rendered: dict[str, list[Obj]]) -> None:
    """The operator names the workers' account only where the chart created it: a pod
    naming a missing account is never created, and the job would not train."""
    for scenario, objs in rendered.items():
        args = operator_container(objs)["args"]
        given = [a.split("=", 1)[1] for a in args if a.startswith("--worker-service-account=")]
        where = [
            a.split("=", 1)[1] for a in args if a.startswith("--worker-service-account-namespace=")
        ]
        accounts = {
            (o["metadata"]["namespace"], o["metadata"]["name"])
            for o in find(objs, "ServiceAccount")
            if not is_hook(o) and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
        }
        if not accounts:
            assert not given and not where, scenario
            continue
        (name,) = given
        assert where and accounts == {(ns, name) for ns in where}, scenario
    assert ("team-a", "dlrm-worker") in {
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in find(rendered["customized"], "ServiceAccount")
    }
    namespaced = operator_container(rendered["namespaced"])["args"]
    assert "--worker-service-account-namespace=team-b" in namespaced


def test_image_reference(rendered: dict[str, list[Obj]]) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (
        operator_container(rendered["default"])["image"]
        == f"ghcr.io/shardwise/shardwise:{chart['appVersion']}"
    )
    assert operator_container(rendered["customized"])["image"] == (
        "registry.example.com/ml/shardwise@sha256:" + "ab" * 32
    )


def test_customized_values_reach_the_pod(rendered: dict[str, list[Obj]]) -> None:
    pod = one(rendered["customized"], "Deployment")["spec"]["template"]
    values = SCENARIOS["customized"][0]["operator"]
    assert pod["metadata"]["annotations"] == values["podAnnotations"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    spec = pod["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert spec[key] == values[key], key
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["volumes"][0]["emptyDir"]["sizeLimit"] == "2Gi"
    c = operator_container(rendered["customized"])
    assert c["resources"] == values["resources"]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 120
    assert {"name": "SHARDWISE_LOG", "value": "debug"} in c["env"]

"""The Helm chart's tests (tests/test_chart_*.py): helm, the render scenarios and
lookups in what they render.

What a user's ``helm install`` meets, short of a cluster, checked with the real helm
and the API's schemas:

- ``helm lint --strict`` and ``helm template`` with default and non-default values, at
  the oldest Kubernetes the chart supports and at helm's own, and every rendered object
  against the API's schemas, the chart's CRD and its object count (test_chart_render);
- values.schema.json rejects bad values and describes every value (test_chart_values);
- the Deployment is hardened and takes the values it is given (test_chart_deployment);
- the RBAC rules are exactly the documented ones (test_chart_rbac);
- the metrics Service, the monitors and the dashboards (test_chart_monitoring);
- the helm test hook, the NOTES and the install doc's DLRMJobs (test_chart_hooks).

Load the ``rendered`` fixture (every scenario rendered once per session) with
``pytest_plugins = ["chart_helpers"]`` in a test module and import the rest;
tests/conftest.py marks this module for pytest's assertion rewriting first.

helm comes from ``make tools`` (scripts/install-tools.sh); these tests fail without it.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.schema import StructuralSchema

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "shardwise"
CRD = ROOT / "crds" / "dlrmjob.yaml"
HELM = Path(os.environ.get("HELM") or ROOT / ".tools" / "bin" / "helm")
#: The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and helm 4.1's own.
KUBE_VERSIONS = ("1.29.0", "1.35.0")
NS = "shardwise"
MONITORING = "monitoring.coreos.com/v1"
KOPF = "kopf.dev/v1"

Obj = dict[str, Any]
Rule = tuple[str, str, tuple[str, ...]]


# --------------------------------------------------------------------------- helm


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    if not HELM.is_file():
        pytest.fail(
            f"helm is not installed at {HELM}: run `make tools` (scripts/install-tools.sh), "
            "or point HELM at a helm v4 binary"
        )
    proc = subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, timeout=60, check=False
    )
    # helm logs every symlink it follows (charts/shardwise/crds/dlrmjob.yaml) at INFO.
    proc.stderr = "\n".join(
        line for line in proc.stderr.splitlines() if "found symbolic link" not in line
    )
    return proc


def values_file(tmp_path: Path, values: Mapping[str, Any]) -> str:
    path = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
    path.write_text(yaml.safe_dump(dict(values)))
    return str(path)


def template_args(
    tmp_path: Path,
    values: Mapping[str, Any] | None = None,
    api_versions: Sequence[str] = (),
    kube_version: str | None = None,
    namespace: str = NS,
) -> list[str]:
    args = ["template", "r", str(CHART), "-n", namespace]
    if values:
        args += ["-f", values_file(tmp_path, values)]
    for api in api_versions:
        args += ["--api-versions", api]
    if kube_version:
        args += ["--kube-version", kube_version]
    return args


def render(
    tmp_path: Path,
    values: Mapping[str, Any] | None = None,
    api_versions: Sequence[str] = (),
    kube_version: str | None = None,
    include_crds: bool = False,
) -> list[Obj]:
    args = template_args(tmp_path, values, api_versions, kube_version)
    if include_crds:
        args.append("--include-crds")
    proc = run_helm(*args)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_error(
    tmp_path: Path, values: Mapping[str, Any], api_versions: Sequence[str] = ()
) -> str:
    proc = run_helm(*template_args(tmp_path, values, api_versions))
    assert proc.returncode != 0, f"helm template accepted {values}"
    return proc.stderr


# --------------------------------------------------------------------------- lookups


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def is_hook(obj: Obj) -> bool:
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def count_kinds(objs: list[Obj]) -> dict[str, int]:
    """How many objects of each kind."""
    out: dict[str, int] = {}
    for o in objs:
        out[o["kind"]] = out.get(o["kind"], 0) + 1
    return out


def operator_container(objs: list[Obj]) -> Obj:
    """The Deployment's one container: the operator."""
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return dict(container)


def rules(role: Obj) -> set[Rule]:
    """A (Cluster)Role's rules, one (group, resource, verbs) per group and resource."""
    out: set[Rule] = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/URLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.add((group, resource, tuple(rule["verbs"])))
    return out


# --------------------------------------------------------------------------- the CRD's schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], StructuralSchema]:
    crd = yaml.safe_load(CRD.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    return {
        (f"{group}/{v['name']}", kind): StructuralSchema(v["schema"]["openAPIV3Schema"])
        for v in crd["spec"]["versions"]
    }


# --------------------------------------------------------------------------- scenarios

#: Non-default values that change what is rendered (each is rendered and validated).
SCENARIOS: dict[str, tuple[Obj, tuple[str, ...]]] = {
    "default": ({}, ()),
    "default+monitoring": ({}, (MONITORING,)),
    "namespaced": (
        {
            "operator": {"watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}},
            "metrics": {"serviceMonitor": {"labels": {"release": "prom"}}},
        },
        (MONITORING,),
    ),
    "namespaced-release-ns": ({"operator": {"watch": {"allNamespaces": False}}}, ()),
    "peering-cluster": ({"peering": {"enabled": True, "priority": 50}}, (KOPF, MONITORING)),
    "peering-namespaced": (
        {
            "peering": {"enabled": True},
            "operator": {"watch": {"allNamespaces": False, "namespaces": ["team-a"]}},
        },
        (KOPF,),
    ),
    "standby": (
        {
            "fullnameOverride": "shardwise-standby",
            "peering": {"enabled": True, "priority": 10, "createObject": False},
            "profiler": {"serviceAccount": {"create": False}},
            "workers": {"serviceAccount": {"create": False}},
            "rbac": {"aggregateToDefaultRoles": False},
            "dashboards": {"enabled": False},
            "tests": {"enabled": False},
        },
        (KOPF,),
    ),
    "customized": (
        {
            "image": {
                "repository": "registry.example.com/ml/shardwise",
                "digest": "sha256:" + "ab" * 32,
                "pullPolicy": "Always",
            },
            "imagePullSecrets": [{"name": "regcred"}],
            "operator": {
                "livenessPort": 8081,
                "metricsPort": 9191,
                "extraArgs": ["--verbose"],
                "extraEnv": [{"name": "SHARDWISE_LOG", "value": "debug"}],
                "resources": {
                    "requests": {"cpu": "1", "memory": "2Gi"},
                    "limits": {"memory": "8Gi"},
                },
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
                ],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "pool", "operator": "In", "values": ["system"]}
                                    ]
                                }
                            ]
                        }
                    }
                },
                "priorityClassName": "system-cluster-critical",
                "podAnnotations": {"example.com/owner": "ml-platform"},
                "podLabels": {"team": "ml"},
                "tmpSizeLimit": "2Gi",
                "startupSeconds": 120,
            },
            "serviceAccount": {"annotations": {"iam.example.com/role": "shardwise"}},
            "profiler": {"namespaces": ["team-a", "team-b"]},
            "workers": {"serviceAccount": {"name": "dlrm-worker"}, "namespaces": ["team-a"]},
            "metrics": {
                "service": {"annotations": {"prometheus.io/scrape": "true"}},
                "prometheusRule": {"imbalanceThreshold": 1.55},
            },
            "dashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "ML"}},
            "tests": {
                "timeoutSeconds": 120,
                "workerImage": "registry.example.com/ml/shardwise:0.1.0",
            },
        },
        (MONITORING,),
    ),
    "minimal": (
        {
            "serviceAccount": {"create": False, "name": "existing-sa"},
            "rbac": {"create": False},
            "profiler": {"serviceAccount": {"create": False}},
            "workers": {"serviceAccount": {"create": False}},
            "metrics": {
                "service": {"enabled": False},
                "serviceMonitor": {"enabled": False},
                "podMonitor": {"enabled": False},
                "prometheusRule": {"enabled": False},
            },
            "dashboards": {"enabled": False},
            "tests": {"enabled": False},
        },
        (MONITORING,),
    ),
}


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every scenario rendered once per session (helm template takes ~0.1 s each);
    tests copy an object before they change it."""
    tmp = tmp_path_factory.mktemp("values")
    return {
        name: render(tmp, values, api_versions)
        for name, (values, api_versions) in SCENARIOS.items()
    }

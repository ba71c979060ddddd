"""The Helm chart (charts/shardwise), checked with the real helm and the API's schemas.

What a user's ``helm install`` meets, short of a cluster:

- ``helm lint --strict`` and ``helm template`` with default and non-default values, at
  the oldest Kubernetes the chart supports and at helm's own;
- values.schema.json rejects bad values (and describes every value);
- every rendered object passes ``kubernetes-validate --strict`` (the API's OpenAPI
  schemas, bundled offline); kinds it does not know are checked against their own
  schema: the DLRMJob against our CRD, the Prometheus Operator's ServiceMonitor and
  PodMonitor against the subset of their CRDs this chart writes, kopf's peering
  objects against kopf's CRD;
- the chart's CRD is ``crds/dlrmjob.yaml`` itself, also inside ``helm package``;
- the RBAC rules are exactly the documented ones, the Deployment is hardened, the
  dashboards query metrics the workers export.

helm comes from ``make tools`` (scripts/install-tools.sh); these tests fail without it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s.schema import StructuralSchema
from test_observability_dashboards import exported as exported_metric_names

from shardwise import names

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
            "metrics": {"service": {"annotations": {"prometheus.io/scrape": "true"}}},
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


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every scenario rendered once (helm template takes ~0.1 s each)."""
    tmp = tmp_path_factory.mktemp("values")
    return {
        name: render(tmp, values, api_versions)
        for name, (values, api_versions) in SCENARIOS.items()
    }


# --------------------------------------------------------------------------- lint


@pytest.mark.parametrize("scenario", ["default", "namespaced", "customized", "minimal"])
def test_helm_lint_strict(tmp_path: Path, scenario: str) -> None:
    values, _ = SCENARIOS[scenario]
    args = ["lint", "--strict", str(CHART)]
    if values:
        args += ["-f", values_file(tmp_path, values)]
    proc = run_helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_helm_is_v4() -> None:
    proc = run_helm("version", "--template", "{{.Version}}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("v4."), f"the checks expect helm v4, got {proc.stdout}"


# --------------------------------------------------------------------------- API validation


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], StructuralSchema]:
    crd = yaml.safe_load(CRD.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    return {
        (f"{group}/{v['name']}", kind): StructuralSchema(v["schema"]["openAPIV3Schema"])
        for v in crd["spec"]["versions"]
    }


# The fields of monitoring.coreos.com/v1 (prometheus-operator 0.91 CRDs) this chart
# writes, with those CRDs' types, patterns and enums; anything else is refused so that
# a new field gets checked against the real CRD before it is added here.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_RELABEL_ACTIONS = [
    v
    for a in ("Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep",
              "Lowercase", "Uppercase", "KeepEqual", "DropEqual")
    for v in (a, a.lower())
]  # fmt: skip
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRMAP},
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRMAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "any": {"type": "boolean"},
        "matchNames": {"type": "array", "items": {"type": "string"}},
    },
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {"enum": _RELABEL_ACTIONS},
        "sourceLabels": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
        },
        "regex": {"type": "string"},
        "targetLabel": {"type": "string"},
        "replacement": {"type": "string"},
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": _DURATION},
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": _RELABEL},
    },
}


def _monitor_schema(kind: str, endpoints: str) -> Obj:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": MONITORING},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", endpoints],
                "additionalProperties": False,
                "properties": {
                    "selector": _SELECTOR,
                    "namespaceSelector": _NS_SELECTOR,
                    endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


#: PrometheusRule: the groups of rules/shardwise-alerts.yaml (promtool checks the rules
#: themselves: tests/test_observability.py).
_PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": MONITORING},
        "kind": {"const": "PrometheusRule"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": _DURATION},
                                        "labels": _STRMAP,
                                        "annotations": _STRMAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


#: kopf's peering CRDs (kopf.dev/v1): no spec; kopf writes the status.
_PEERING = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": KOPF},
        "kind": {"enum": ["KopfPeering", "ClusterKopfPeering"]},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": _STRMAP,
            },
        },
    },
}

OTHER_SCHEMAS: dict[tuple[str, str], Obj] = {
    (MONITORING, "ServiceMonitor"): _monitor_schema("ServiceMonitor", "endpoints"),
    (MONITORING, "PodMonitor"): _monitor_schema("PodMonitor", "podMetricsEndpoints"),
    (MONITORING, "PrometheusRule"): _PROMETHEUS_RULE,
    (KOPF, "KopfPeering"): _PEERING,
    (KOPF, "ClusterKopfPeering"): _PEERING,
}


def api_problems(obj: Obj, kube_version: str) -> list[str]:
    """What the API server would refuse in ``obj``: kubernetes-validate --strict for the
    built-in kinds, the kind's own schema for custom resources."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in OTHER_SCHEMAS:
        validator = jsonschema.Draft202012Validator(OTHER_SCHEMAS[key])
        return [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)
        ]
    crds = _crd_schemas()
    if key in crds:
        return [str(c) for c in crds[key].validate(obj)]
    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{'.'.join(map(str, err.path))}: {err.message}"]
    except kubernetes_validate.SchemaNotFoundError as err:
        return [f"no schema to validate it against: {err.message}"]
    return []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rendered_objects_pass_strict_api_validation(
    rendered: dict[str, list[Obj]], scenario: str, kube_version: str
) -> None:
    objs = rendered[scenario]
    assert objs
    problems = {
        f"{o['kind']}/{o['metadata']['name']}": p
        for o in objs
        if (p := api_problems(o, kube_version))
    }
    assert not problems, json.dumps(problems, indent=2)


def test_strict_validation_catches_a_bad_object(rendered: dict[str, list[Obj]]) -> None:
    """The validation above can fail: an unknown field and a wrong type are refused."""
    deploy = copy.deepcopy(one(rendered["default"], "Deployment"))
    deploy["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    assert api_problems(deploy, "1.35.0")
    deploy = copy.deepcopy(one(rendered["default"], "Deployment"))
    deploy["spec"]["replicas"] = "one"
    assert api_problems(deploy, "1.35.0")
    monitor = copy.deepcopy(one(rendered["default+monitoring"], "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    assert api_problems(monitor, "1.35.0")
    assert api_problems(
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}, "1.35.0"
    )


def test_crd_passes_strict_api_validation(tmp_path: Path) -> None:
    for version in KUBE_VERSIONS:
        crds = find(
            render(tmp_path, include_crds=True, kube_version=version), "CustomResourceDefinition"
        )
        assert [c["metadata"]["name"] for c in crds] == ["dlrmjobs.shardwise.dev"]
        assert api_problems(crds[0], version) == []


def test_namespaced_objects_name_their_namespace(rendered: dict[str, list[Obj]]) -> None:
    """`helm template | kubectl apply` puts every object where `helm install` would."""
    cluster_kinds = {
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterKopfPeering",
        "CustomResourceDefinition",
    }
    for scenario, objs in rendered.items():
        for o in objs:
            if o["kind"] not in cluster_kinds:
                assert o["metadata"].get("namespace"), (
                    f"{scenario}: {o['kind']}/{o['metadata']['name']}"
                )
            else:
                assert "namespace" not in o["metadata"]


def test_object_names_are_unique(rendered: dict[str, list[Obj]]) -> None:
    for scenario, objs in rendered.items():
        keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
        assert len(keys) == len(set(keys)), f"{scenario}: {keys}"


def test_supports_kubernetes_from_1_29(tmp_path: Path) -> None:
    render(tmp_path, kube_version="1.29.0")
    proc = run_helm(*template_args(tmp_path, kube_version="1.28.9"))
    assert proc.returncode != 0
    assert "kubeVersion" in proc.stderr or ">=1.29" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- object count

#: The default install (`helm template` with no values, plus the CRD): documented in
#: docs/install.md. A change here is a change users see.
DEFAULT_OBJECTS = {
    "CustomResourceDefinition": 1,
    "ServiceAccount": 2,  # the operator's, the profiler's
    "ClusterRole": 4,  # cluster rules, namespaced rules, DLRMJob edit and view
    "ClusterRoleBinding": 2,
    "Role": 1,  # the profiler's
    "RoleBinding": 1,
    "Deployment": 1,
    "Service": 1,
    "ConfigMap": 2,  # the dashboards (workers, operator)
}
DEFAULT_TEST_HOOKS = {"ServiceAccount": 1, "Role": 1, "RoleBinding": 1, "Pod": 1}


def _count(objs: list[Obj]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in objs:
        out[o["kind"]] = out.get(o["kind"], 0) + 1
    return out


def test_default_object_count(tmp_path: Path) -> None:
    objs = render(tmp_path, include_crds=True)
    assert _count([o for o in objs if not is_hook(o)]) == DEFAULT_OBJECTS
    assert _count([o for o in objs if is_hook(o)]) == DEFAULT_TEST_HOOKS
    assert sum(DEFAULT_OBJECTS.values()) == 15
    monitored = render(tmp_path, api_versions=(MONITORING,))
    assert _count(monitored).get("ServiceMonitor") == 1
    assert _count(monitored).get("PodMonitor") == 1
    assert _count(monitored).get("PrometheusRule") == 1


# --------------------------------------------------------------------------- the CRD


def test_chart_crd_is_the_repository_crd_not_a_copy() -> None:
    link = CHART / "crds" / "dlrmjob.yaml"
    assert link.is_symlink(), "charts/shardwise/crds/dlrmjob.yaml must link to crds/dlrmjob.yaml"
    assert link.resolve() == CRD.resolve()
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["dlrmjob.yaml"]


def test_helm_reads_the_crd_byte_for_byte(tmp_path: Path) -> None:
    proc = run_helm("show", "crds", str(CHART))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.removeprefix("---\n").strip() == CRD.read_text().strip()
    rendered_crd = one(render(tmp_path, include_crds=True), "CustomResourceDefinition")
    assert rendered_crd == yaml.safe_load(CRD.read_text())


def test_helm_package_carries_the_crd(tmp_path: Path) -> None:
    """`helm package` follows the link and archives the file's bytes."""
    proc = run_helm("package", str(CHART), "-d", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (archive,) = tmp_path.glob("shardwise-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.extractfile("shardwise/crds/dlrmjob.yaml")
        assert member is not None
        assert member.read() == CRD.read_bytes()
        names = tar.getnames()
    assert "shardwise/values.schema.json" in names
    assert "shardwise/dashboards/shardwise-workers.json" in names
    assert "shardwise/dashboards/shardwise-operator.json" in names
    assert "shardwise/rules/shardwise-alerts.yaml" in names
    proc = run_helm("template", "r", str(archive), "-n", NS, "--include-crds")
    assert proc.returncode == 0, proc.stderr
    assert "name: dlrmjobs.shardwise.dev" in proc.stdout


# --------------------------------------------------------------------------- values schema


def _schema() -> Obj:
    schema: Obj = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _leaves(values: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            yield (*path, key)
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key)


def test_schema_describes_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = _schema()
    for path in _leaves(values):
        node = schema
        for key in path:
            props = node.get("properties") or {}
            if key in props:
                node = props[key]
            else:
                assert isinstance(node.get("additionalProperties"), dict), (
                    f"values.yaml has {'.'.join(path)}, which values.schema.json does not describe"
                )
                node = node["additionalProperties"]
                break
        assert node.get("type") or node.get("enum"), f"{'.'.join(path)} has no type"
    # Draft 7: what every helm 3.8+ and helm 4 validate values with.
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)


def _objects_closed(node: Obj, path: str = "") -> Iterator[str]:
    if (
        node.get("type") == "object"
        and "properties" in node
        and node.get("additionalProperties") is not False
    ):
        yield path or "(top)"
    for key, sub in (node.get("properties") or {}).items():
        if isinstance(sub, dict):
            yield from _objects_closed(sub, f"{path}.{key}" if path else key)


def test_schema_refuses_unknown_keys() -> None:
    """A typo (`operater.watch`) fails the install instead of being ignored."""
    assert list(_objects_closed(_schema())) == []


BAD_VALUES: list[tuple[Obj, str]] = [
    ({"operater": {}}, "operater"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"image": {"digest": "sha256:abc"}}, "digest"),
    ({"image": {"repository": ""}}, "repository"),
    ({"operator": {"watch": {"allNamespaces": True, "namespaces": ["team-a"]}}}, "namespaces"),
    ({"operator": {"watch": {"allNamespaces": False, "namespaces": ["Team_A"]}}}, "namespaces"),
    ({"operator": {"watch": {"allNamespaces": "yes"}}}, "allNamespaces"),
    ({"operator": {"livenessPort": 70000}}, "livenessPort"),
    ({"operator": {"metricsPort": 0}}, "metricsPort"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "cpu"),
    ({"operator": {"resources": {"limit": {"memory": "1Gi"}}}}, "limit"),
    ({"operator": {"extraArgs": "--verbose"}}, "extraArgs"),
    ({"operator": {"startupSeconds": 1}}, "startupSeconds"),
    ({"peering": {"priority": -1}}, "priority"),
    ({"peering": {"name": "Not A Name"}}, "name"),
    ({"serviceAccount": {"name": "UPPER"}}, "name"),
    ({"profiler": {"namespaces": ["ok", "ok"]}}, "namespaces"),
    ({"metrics": {"podMonitor": {"interval": "15 seconds"}}}, "interval"),
    ({"metrics": {"serviceMonitor": {"labels": {"release": 1}}}}, "release"),
    ({"dashboards": {"labels": []}}, "labels"),
    ({"tests": {"timeoutSeconds": 5}}, "timeoutSeconds"),
    ({"fullnameOverride": "x" * 41}, "fullnameOverride"),
]


@pytest.mark.parametrize(("values", "key"), BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_schema_rejects_bad_values(tmp_path: Path, values: Obj, key: str) -> None:
    err = render_error(tmp_path, values)
    assert "values don't meet the specifications of the schema" in err, err
    assert key in err, err


def test_templates_reject_what_the_schema_cannot(tmp_path: Path) -> None:
    err = render_error(tmp_path, {"operator": {"livenessPort": 9090, "metricsPort": 9090}})
    assert "livenessPort and operator.metricsPort must differ" in err
    err = render_error(tmp_path, {"peering": {"enabled": True}})  # no kopf.dev/v1 served
    assert "kopf's peering CRDs" in err
    err = render_error(tmp_path, {"serviceAccount": {"create": False}})
    assert "serviceAccount.name is required" in err


# --------------------------------------------------------------------------- the Deployment


def _container(objs: list[Obj]) -> Obj:
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return dict(container)


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
        c = _container(objs)
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
    args = {s: _container(objs)["args"] for s, objs in rendered.items()}
    assert args["default"] == [
        "operator",
        "--all-namespaces",
        "--liveness-port=8080",
        "--metrics-port=9090",
        "--standalone",
    ]
    assert args["namespaced"][:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in args["namespaced"]
    assert args["namespaced-release-ns"][1] == f"--namespace={NS}"
    assert args["peering-cluster"][-2:] == ["--peering=shardwise", "--priority=50"]
    assert "--standalone" not in args["peering-cluster"]
    assert args["customized"][-1] == "--verbose"


def test_image_reference(rendered: dict[str, list[Obj]]) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (
        _container(rendered["default"])["image"]
        == f"ghcr.io/shardwise/shardwise:{chart['appVersion']}"
    )
    assert _container(rendered["customized"])["image"] == (
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
    c = _container(rendered["customized"])
    assert c["resources"] == values["resources"]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 120
    assert {"name": "SHARDWISE_LOG", "value": "debug"} in c["env"]


# --------------------------------------------------------------------------- RBAC

Rule = tuple[str, str, tuple[str, ...]]

#: Every rule the operator gets, with nothing else: docs/operations.md ("RBAC") gives
#: the reason for each. A new verb here is a new right in every cluster.
OPERATOR_CLUSTER_RULES: set[Rule] = {("", "nodes", ("get", "list", "watch"))}
#: kopf's CRD observer, cluster-wide operators only (a namespaced one serves exact
#: namespace names with kopf's scanning off; tests/test_operator_rbac.py runs both).
CRD_RULE: Rule = ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"))
OPERATOR_NAMESPACED_RULES: set[Rule] = {
    ("shardwise.dev", "dlrmjobs", ("get", "list", "watch", "patch")),
    ("shardwise.dev", "dlrmjobs/status", ("patch",)),
    ("batch", "jobs", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "pods", ("get", "list", "watch", "delete")),
    ("", "configmaps", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "services", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "events", ("create", "list")),
}
PEERING_CLUSTER_RULE: Rule = ("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"))
PEERING_NAMESPACED_RULE: Rule = ("kopf.dev", "kopfpeerings", ("list", "watch", "patch"))
PROFILER_RULES: set[Rule] = {("", "configmaps", ("create", "update"))}


def rules(role: Obj) -> set[Rule]:
    out: set[Rule] = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/URLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.add((group, resource, tuple(rule["verbs"])))
    return out


def _bound_roles(objs: list[Obj], sa: str) -> dict[tuple[str, str | None], Obj]:
    """The (Cluster)Roles bound to a service account, keyed by (kind, namespace)."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objs
        if o["kind"] in ("Role", "ClusterRole") and not is_hook(o)
    }
    out = {}
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding") or is_hook(b):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles[(ref["kind"], ns, ref["name"])]
        out[(b["kind"], b["metadata"].get("namespace"))] = role
    return out


def test_no_wildcards_or_secrets_anywhere(rendered: dict[str, list[Obj]]) -> None:
    for scenario, objs in rendered.items():
        for role in (o for o in objs if o["kind"] in ("Role", "ClusterRole")):
            for rule in role["rules"]:
                flat = [*rule["apiGroups"], *rule["resources"], *rule["verbs"]]
                assert "*" not in flat, f"{scenario}: {role['metadata']['name']}: {rule}"
                assert "secrets" not in rule["resources"]
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_operator_rbac_all_namespaces(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    bound = _bound_roles(objs, "r-shardwise")
    assert (
        set(bound) == {("ClusterRoleBinding", None)} and len(find(objs, "ClusterRoleBinding")) == 2
    )
    cluster = one(objs, "ClusterRole", "r-shardwise-cluster")
    namespaced = one(objs, "ClusterRole", "r-shardwise-namespaced")
    assert rules(cluster) == OPERATOR_CLUSTER_RULES | {CRD_RULE}
    assert rules(namespaced) == OPERATOR_NAMESPACED_RULES


def test_operator_rbac_namespaced_is_split(rendered: dict[str, list[Obj]]) -> None:
    """A namespaced operator gets only cluster-scoped rules cluster-wide, and its
    namespaced rules in the served namespaces alone."""
    objs = rendered["namespaced"]
    bound = _bound_roles(objs, "r-shardwise")
    assert set(bound) == {
        ("ClusterRoleBinding", None),
        ("RoleBinding", "team-a"),
        ("RoleBinding", "team-b"),
    }
    assert rules(bound[("ClusterRoleBinding", None)]) == OPERATOR_CLUSTER_RULES
    for ns in ("team-a", "team-b"):
        assert rules(bound[("RoleBinding", ns)]) == OPERATOR_NAMESPACED_RULES
    assert not find(objs, "ClusterRole", "r-shardwise-namespaced")
    # The operator's bindings in other namespaces name its service account in the release's.
    for binding in find(objs, "RoleBinding") + find(objs, "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            if subject["name"] == "r-shardwise":
                assert subject["namespace"] == NS


def test_peering_rbac_follows_the_scope(rendered: dict[str, list[Obj]]) -> None:
    cluster = _bound_roles(rendered["peering-cluster"], "r-shardwise")
    assert PEERING_CLUSTER_RULE in rules(cluster[("ClusterRoleBinding", None)]) | rules(
        one(rendered["peering-cluster"], "ClusterRole", "r-shardwise-cluster")
    )
    assert one(rendered["peering-cluster"], "ClusterKopfPeering")["metadata"]["name"] == "shardwise"
    ns = _bound_roles(rendered["peering-namespaced"], "r-shardwise")
    assert PEERING_NAMESPACED_RULE in rules(ns[("RoleBinding", "team-a")])
    assert PEERING_CLUSTER_RULE not in rules(ns[("ClusterRoleBinding", None)])
    assert one(rendered["peering-namespaced"], "KopfPeering")["metadata"]["namespace"] == "team-a"
    for scenario in ("default", "namespaced"):
        flat = set().union(
            *(
                rules(r)
                for r in find(rendered[scenario], "ClusterRole") + find(rendered[scenario], "Role")
            )
        )
        assert not {r for r in flat if r[0] == "kopf.dev"}, scenario
    assert not find(rendered["standby"], "ClusterKopfPeering")


def test_profiler_service_account(rendered: dict[str, list[Obj]]) -> None:
    crd = yaml.safe_load(CRD.read_text())
    profiling = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["profiling"]
    default_sa = profiling["properties"]["serviceAccountName"]["default"]
    expected = {
        "default": [NS],
        "namespaced": ["team-a", "team-b"],
        "customized": ["team-a", "team-b"],
    }
    for scenario, namespaces in expected.items():
        objs = rendered[scenario]
        sas = [o for o in find(objs, "ServiceAccount", default_sa) if not is_hook(o)]
        assert sorted(o["metadata"]["namespace"] for o in sas) == namespaces, scenario
        bound = _bound_roles(objs, default_sa)
        assert set(bound) == {("RoleBinding", ns) for ns in namespaces}
        for role in bound.values():
            assert rules(role) == PROFILER_RULES
    assert not find(rendered["standby"], "ServiceAccount", default_sa)


def test_aggregated_dlrmjob_roles(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    edit = one(objs, "ClusterRole", "r-shardwise-dlrmjobs-edit")
    view = one(objs, "ClusterRole", "r-shardwise-dlrmjobs-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert ("shardwise.dev", "dlrmjobs", ("get", "list", "watch")) in rules(view)
    assert all(verb in ("get", "list", "watch") for _, _, verbs in rules(view) for verb in verbs)
    # Users may not write the status: that is the operator's.
    assert all(
        not (res == "dlrmjobs/status" and set(verbs) - {"get"}) for _, res, verbs in rules(edit)
    )
    assert not find(rendered["standby"], "ClusterRole", "shardwise-standby-dlrmjobs-edit")


def test_rbac_rules_are_documented() -> None:
    """docs/operations.md lists every rule with its reason (the table under "RBAC")."""
    text = (ROOT / "docs" / "operations.md").read_text()
    documented = set()
    for m in re.finditer(r"^\| `([^`]*)` \| `([^`]+)` \| `([^`]+)` \|", text, re.MULTILINE):
        group, resource, verbs = m.groups()
        documented.add((group, resource, tuple(v.strip() for v in verbs.split(","))))
    expected = OPERATOR_CLUSTER_RULES | OPERATOR_NAMESPACED_RULES | PROFILER_RULES | {CRD_RULE}
    expected |= {PEERING_CLUSTER_RULE, PEERING_NAMESPACED_RULE}
    assert expected <= documented, sorted(expected - documented)


def test_minimal_renders_no_rbac(rendered: dict[str, list[Obj]]) -> None:
    objs = [o for o in rendered["minimal"] if not is_hook(o)]
    assert _count(objs) == {"Deployment": 1}
    assert (
        one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing-sa"
    )


# --------------------------------------------------------------------------- metrics


def test_metrics_service_selects_the_operator(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["customized"]
    svc = one(objs, "Service")
    pod = one(objs, "Deployment")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 9191
    assert port["targetPort"] in {p["name"] for p in _container(objs)["ports"]}


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
    selects (shardwise.operator.constants)."""

    assert names.LABEL_COMPONENT == "shardwise.dev/component"
    assert names.LABEL_JOB == "shardwise.dev/job"
    assert names.COMPONENT_WORKER == "worker"


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


# --------------------------------------------------------------------------- helm test, NOTES


def test_helm_test_hook_applies_a_valid_tiny_job(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    hooks = [o for o in objs if is_hook(o)]
    assert {o["metadata"]["annotations"]["helm.sh/hook"] for o in hooks} == {"test"}
    pod = one(hooks, "Pod")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    job = json.loads(env["DLRMJOB"])
    # The API server names it from generateName before validating.
    job["metadata"]["name"] = job["metadata"].pop("generateName") + "x7k2p"
    schema = _crd_schemas()[(job["apiVersion"], job["kind"])]
    assert schema.validate(schema.default(job)) == []
    assert job["spec"]["planner"]["device"] == "cpu"  # plans without GPUs
    assert job["spec"]["profiling"]["policy"] == "Never"
    assert "Planned" in pod["spec"]["containers"][0]["args"][0]
    assert compile(pod["spec"]["containers"][0]["args"][0], "helm-test", "exec")
    role = one(hooks, "Role")
    assert rules(role) == {("shardwise.dev", "dlrmjobs", ("create", "get", "delete"))}
    # Served namespace: the first watched one.
    namespaced = [o for o in rendered["namespaced"] if is_hook(o)]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"team-a"}
    assert not [o for o in rendered["standby"] if is_hook(o)]


def test_notes_tell_what_to_apply_next(tmp_path: Path) -> None:
    proc = run_helm("install", "r", str(CHART), "-n", "team-a", "--dry-run=client")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    for expected in (
        "rollout status deployment/r-shardwise",
        "helm test r -n team-a",
        "kind: DLRMJob",
        "kubectl -n team-a get dj",
        "describe dj first",
        "helm uninstall r -n team-a",
        "no ServiceMonitor or PodMonitor",
    ):
        assert expected in notes, expected
    # The DLRMJob the notes show is valid against the CRD.
    block = notes.split("<<'EOF'\n", 1)[1].split("\n  EOF", 1)[0]
    job = yaml.safe_load("\n".join(line.removeprefix("  ") for line in block.splitlines()))
    schema = _crd_schemas()[(job["apiVersion"], job["kind"])]
    assert schema.validate(schema.default(job)) == []


def test_install_doc_dlrmjobs_are_valid() -> None:
    """The DLRMJobs docs/install.md tells users to apply pass the CRD's schema."""
    text = (ROOT / "docs" / "install.md").read_text()
    jobs = [
        doc
        for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
        if (doc := yaml.safe_load(block)) and doc.get("kind") == "DLRMJob"
    ]
    assert jobs
    for job in jobs:
        job["spec"]["template"]["image"] = "registry.example.com/shardwise:0.1.0-gpu"
        schema = _crd_schemas()[(job["apiVersion"], job["kind"])]
        assert schema.validate(schema.default(job)) == [], job["metadata"]["name"]

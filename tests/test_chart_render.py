"""The chart renders what the API server accepts: ``helm lint --strict``, every object of
every scenario through ``kubernetes-validate --strict`` (the API's OpenAPI schemas,
bundled offline) at the oldest Kubernetes the chart supports and at helm's own, the
default install's object count, and the chart's CRD, which is ``crds/dlrmjob.yaml``
itself, also inside ``helm package``.

Kinds kubernetes-validate does not know are checked against their own schema: the
DLRMJob against our CRD, the Prometheus Operator's ServiceMonitor, PodMonitor and
PrometheusRule against the subset of their CRDs this chart writes, kopf's peering
objects against kopf's CRD.
"""

from __future__ import annotations

import copy
import json
import tarfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_helpers import (
    CHART,
    CRD,
    KOPF,
    KUBE_VERSIONS,
    MONITORING,
    NS,
    SCENARIOS,
    Obj,
    count_kinds,
    crd_schemas,
    find,
    is_hook,
    one,
    render,
    run_helm,
    template_args,
    values_file,
)

pytest_plugins = ["chart_helpers"]


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
    crds = crd_schemas()
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
    "ServiceAccount": 3,  # the operator's, the profiler's, the workers'
    "ClusterRole": 4,  # cluster rules, namespaced rules, DLRMJob edit and view
    "ClusterRoleBinding": 2,
    "Role": 2,  # the profiler's, the workers'
    "RoleBinding": 2,
    "Deployment": 1,
    "Service": 1,
    "ConfigMap": 2,  # the dashboards (workers, operator)
}
DEFAULT_TEST_HOOKS = {"ServiceAccount": 1, "Role": 1, "RoleBinding": 1, "Pod": 1}


def test_default_object_count(tmp_path: Path) -> None:
    objs = render(tmp_path, include_crds=True)
    assert count_kinds([o for o in objs if not is_hook(o)]) == DEFAULT_OBJECTS
    assert count_kinds([o for o in objs if is_hook(o)]) == DEFAULT_TEST_HOOKS
    assert sum(DEFAULT_OBJECTS.values()) == 18
    monitored = render(tmp_path, api_versions=(MONITORING,))
    assert count_kinds(monitored).get("ServiceMonitor") == 1
    assert count_kinds(monitored).get("PodMonitor") == 1
    assert count_kinds(monitored).get("PrometheusRule") == 1


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

"""The chart's values.schema.json describes every value of values.yaml, refuses
unknown keys and bad values; the templates refuse what the schema cannot express."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from chart_helpers import CHART, Obj, render_error

pytest_plugins = ["chart_helpers"]


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
    ({"workers": {"namespaces": ["ok", "ok"]}}, "namespaces"),
    ({"workers": {"serviceAccount": {"name": "Worker"}}}, "name"),
    ({"metrics": {"prometheusRule": {"imbalanceThreshold": 1}}}, "imbalanceThreshold"),
    ({"metrics": {"prometheusRule": {"imbalanceThreshold": "1.3"}}}, "imbalanceThreshold"),
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

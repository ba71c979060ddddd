"""The DLRMJob CRD: its schema accepts the example, rejects every invalid example with
the field named, agrees with the operator's typed models, and its printer columns
point at status fields that exist."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml
from k8s.crds import crd_causes, crd_defaults
from k8s.schema import StructuralSchema
from pydantic import BaseModel

from shardwise.operator.crd import DLRMJobSpec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "dlrmjob.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "dlrmjob.yaml").read_text())
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[Any]]:
    """Pruned, defaulted and validated, in the API server's order."""
    schema = StructuralSchema(SCHEMA)
    admitted, dropped = schema.admit(obj)
    return admitted, dropped, schema.validate(admitted)


def test_crd_names_and_subresources() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "dlrmjobs.shardwise.dev"
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == (
        "shardwise.dev",
        "DLRMJob",
        "dlrmjobs",
    )
    assert spec["names"]["shortNames"] == ["dj"]
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {"status": {}}
    assert crd_causes(crd_defaults(CRD)) == [], "the API server would refuse the CRD"


def test_a_rule_that_reads_an_optional_field_fails_on_its_default() -> None:
    """The API server runs each rule on its node's ``default`` as written: without the
    ``has()`` guard, ``planner: {default: {}}`` has no ``device``."""
    crd = copy.deepcopy(CRD)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rule = spec["properties"]["planner"]["x-kubernetes-validations"][0]
    rule["rule"] = "self.device != 'cpu' || has(self.gpuMemory)"
    assert [str(c) for c in crd_causes(crd_defaults(crd))] == [
        "spec.validation.openAPIV3Schema.properties[spec].properties[planner].default: "
        'Invalid value: "object": no such key: device evaluating rule: '
        "planner.gpuMemory is required when planner.device is cpu"
    ]


def test_example_is_valid_and_loses_nothing_to_pruning() -> None:
    pruned, dropped, causes = admit(EXAMPLE)
    assert causes == []
    assert dropped == []
    spec = parse_spec(pruned["spec"])
    assert len(spec.tables.inline or []) == 3
    assert spec.workers.min == 1 and spec.workers.max == 4


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_examples_are_rejected_naming_the_field(path: Path) -> None:
    text = path.read_text()
    field = re.search(r"^# expect-field: (.+)$", text, re.M)
    message = re.search(r"^# expect-message: (.+)$", text, re.M)
    assert field and message, f"{path.name} must say what it expects"
    _, _, causes = admit(yaml.safe_load(text))
    assert causes, f"{path.name} was accepted"
    matching = [c for c in causes if c.field == field.group(1) and message.group(1) in c.message]
    assert matching, f"{path.name}: expected {field.group(1)}: {message.group(1)}; got {causes}"


def test_unknown_fields_are_pruned() -> None:
    obj = {**EXAMPLE, "spec": {**EXAMPLE["spec"], "gpusPerWorkers": 4}}
    pruned, dropped, causes = admit(obj)
    assert dropped == ["spec.gpusPerWorkers"]
    assert "gpusPerWorkers" not in pruned["spec"] and causes == []


def _alias(model: type[BaseModel], name: str) -> str:
    info = model.model_fields[name]
    return info.alias or name


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _compare(model: type[BaseModel], schema: dict[str, Any], path: str, out: list[str]) -> None:
    props = schema.get("properties") or {}
    fields = {_alias(model, n): info for n, info in model.model_fields.items()}
    for missing in sorted(props.keys() - fields.keys()):
        out.append(f"{path}.{missing}: in the CRD, not in {model.__name__}")
    for extra in sorted(fields.keys() - props.keys()):
        out.append(f"{path}.{extra}: in {model.__name__}, not in the CRD")
    for key in sorted(props.keys() & fields.keys()):
        sub_model = _model_of(fields[key].annotation)
        sub_schema = props[key]
        if get_origin(fields[key].annotation) in (list,) or sub_schema.get("type") == "array":
            sub_schema = sub_schema.get("items") or {}
        if sub_model is not None:
            _compare(sub_model, sub_schema, f"{path}.{key}", out)


def test_typed_models_mirror_the_crd_spec() -> None:
    problems: list[str] = []
    _compare(DLRMJobSpec, SCHEMA["properties"]["spec"], "spec", problems)
    assert problems == []


def test_crd_defaults_agree_with_the_typed_defaults() -> None:
    minimal = yaml.safe_load((ROOT / "examples" / "invalid" / "min-above-max.yaml").read_text())
    minimal["spec"]["workers"] = {"max": 2}
    defaulted, _, causes = admit(minimal)
    assert causes == []
    assert parse_spec(defaulted["spec"]) == parse_spec(minimal["spec"])


def _resolve(schema: dict[str, Any], json_path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for part in json_path.strip(".").split("."):
        part = part.split("[")[0]
        if node is None:
            return None
        if node.get("type") == "array":
            node = node.get("items")
        node = (node or {}).get("properties", {}).get(part)
    return node


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    main = [c["name"] for c in VERSION["additionalPrinterColumns"] if not c.get("priority")]
    assert main == ["Phase", "Workers", "GPUs", "Planner", "Max ms", "Imbalance", "Age"]
    assert all(c.get("priority") == 1 for c in columns.values() if c["name"] not in main)
    for column in columns.values():
        if column["jsonPath"] == ".metadata.creationTimestamp":
            continue
        target = _resolve(SCHEMA, column["jsonPath"])
        assert target is not None, (
            f"column {column['name']}: {column['jsonPath']} is not in the schema"
        )
        expected = {"integer": "integer", "number": "number", "string": "string", "date": "string"}
        assert target.get("type") == expected[column["type"]], column["name"]

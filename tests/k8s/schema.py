"""A CRD's ``openAPIV3Schema`` applied as the API server applies it to custom resources.

In order: defaulting (``default``), pruning of unknown fields (unless
``x-kubernetes-preserve-unknown-fields``), then validation. Validation covers the
OpenAPI v3 keywords (through ``jsonschema``'s Draft 4 validator, whose
``exclusiveMinimum`` is the boolean of OpenAPI 3.0; ``nullable`` and
``x-kubernetes-int-or-string`` are rewritten first), ``x-kubernetes-list-type: map|set``
uniqueness, and ``x-kubernetes-validations`` CEL rules (evaluated with ``cel-python``;
``oldSelf`` transition rules are not supported). Each problem is a :class:`Cause` with
the field path and a message worded like the API server's, so a test sees the 422 a
user would.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema


@dataclass(frozen=True)
class Cause:
    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _path(parts: Iterator[Any] | list[Any], root: str = "") -> str:
    out = root
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _to_jsonschema(node: Any) -> Any:
    """OpenAPI 3.0 (Kubernetes flavour) → JSON Schema Draft 4."""
    if isinstance(node, list):
        return [_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {k: _to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[key] = _to_jsonschema(value)
        elif key.startswith("x-kubernetes-") or key in ("nullable", "default", "description"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _k8s_message(err: jsonschema.ValidationError, field: str) -> Cause:
    v, value = err.validator, err.instance
    shown = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    if v == "required":
        missing = str(err.message).split("'")[1]
        return Cause(
            f"{field}.{missing}" if field else missing, "Required value", "FieldValueRequired"
        )
    if v == "enum":
        allowed = ", ".join(json.dumps(x) for x in err.validator_value)
        return Cause(
            field,
            f"Unsupported value: {shown}: supported values: {allowed}",
            "FieldValueNotSupported",
        )
    templates = {
        "minimum": "should be greater than or equal to {}",
        "maximum": "should be less than or equal to {}",
        "minLength": "should be at least {} chars long",
        "maxLength": "may not be longer than {}",
        "minItems": "should have at least {} items",
        "maxItems": "must have at most {} items",
        "pattern": "should match '{}'",
        "multipleOf": "should be a multiple of {}",
        "type": "must be of type {}",
    }
    if v in templates:
        rule = templates[str(v)].format(err.validator_value)
        return Cause(field, f"Invalid value: {shown}: {field} in body {rule}")
    return Cause(field, f"Invalid value: {shown}: {err.message}")


@functools.lru_cache(maxsize=512)
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def compile_rule(rule: str) -> str | None:
    """``None`` when the CEL rule compiles, else the compiler's message."""
    try:
        _cel_program(rule)
    except Exception as err:  # cel-python raises its own parser errors
        return str(err).splitlines()[0]
    return None


class StructuralSchema:
    """One version's ``openAPIV3Schema``: default, prune, validate."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema = copy.deepcopy(dict(schema))
        self._validator = jsonschema.Draft4Validator(_to_jsonschema(self.schema))

    # ------------------------------------------------------------------ defaulting
    def default(self, obj: Any) -> Any:
        return _default(self.schema, copy.deepcopy(obj))

    # ------------------------------------------------------------------ pruning
    def prune(self, obj: Any) -> tuple[Any, list[str]]:
        """The object without unknown fields, and the paths of what was dropped."""
        dropped: list[str] = []
        return _prune(self.schema, copy.deepcopy(obj), "", dropped, top=True), dropped

    # ------------------------------------------------------------------ validation
    def validate(self, obj: Any) -> list[Cause]:
        causes = [
            _k8s_message(e, _path(list(e.absolute_path)))
            for e in sorted(self._validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
        ]
        causes.extend(_list_types(self.schema, obj, ""))
        if not causes:  # CEL sees only structurally valid objects, as on a real server
            causes.extend(_cel(self.schema, obj, "", root=True))
        return causes


def _default(schema: Mapping[str, Any], obj: Any) -> Any:
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = _default(sub, obj[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj:
                if key not in props:
                    obj[key] = _default(extra, obj[key])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], item) for item in obj]
    return obj


def _prune(schema: Mapping[str, Any], obj: Any, path: str, dropped: list[str], top: bool) -> Any:
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return obj
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for key, value in obj.items():
            sub_path = f"{path}.{key}" if path else key
            if top and key in ("apiVersion", "kind", "metadata"):
                out[key] = value
            elif props is not None and key in props:
                out[key] = _prune(props[key], value, sub_path, dropped, top=False)
            elif isinstance(extra, dict):
                out[key] = _prune(extra, value, sub_path, dropped, top=False)
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                out[key] = value
            else:
                dropped.append(sub_path)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [
            _prune(schema["items"], item, f"{path}[{i}]", dropped, top=False)
            for i, item in enumerate(obj)
        ]
    return obj


def _children(schema: Mapping[str, Any], obj: Any, path: str) -> Iterator[tuple[Any, Any, str]]:
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if isinstance(sub, dict):
                yield sub, value, f"{path}.{key}" if path else key
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            yield schema["items"], item, f"{path}[{i}]"


def _list_types(schema: Mapping[str, Any], obj: Any, path: str) -> list[Cause]:
    out: list[Cause] = []
    kind = schema.get("x-kubernetes-list-type")
    if isinstance(obj, list) and kind in ("map", "set"):
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen: dict[str, int] = {}
        for i, item in enumerate(obj):
            key = (
                json.dumps({k: item.get(k) for k in keys}, sort_keys=True)
                if kind == "map" and isinstance(item, dict)
                else json.dumps(item, sort_keys=True)
            )
            if key in seen:
                out.append(Cause(f"{path}[{i}]", f"Duplicate value: {key}", "FieldValueDuplicate"))
            seen.setdefault(key, i)
    for sub, value, sub_path in _children(schema, obj, path):
        out.extend(_list_types(sub, value, sub_path))
    return out


def _cel(schema: Mapping[str, Any], obj: Any, path: str, root: bool = False) -> list[Cause]:
    out: list[Cause] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" in rule["rule"]:
            continue  # transition rules need the old object: not emulated
        value = obj
        if root and isinstance(obj, dict):  # at the root, CEL sees only metadata.name/generateName
            meta = obj.get("metadata") or {}
            value = {
                **obj,
                "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta},
            }
        try:
            ok = _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as err:  # an evaluation error rejects the object on a real server too
            ok, detail = False, f" (evaluation error: {err})"
        else:
            detail = ""
        if not bool(ok):
            field = path
            if rule.get("fieldPath"):
                field = f"{path}{rule['fieldPath']}" if path else rule["fieldPath"].lstrip(".")
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            reason = {
                "FieldValueRequired": "FieldValueRequired",
                "FieldValueForbidden": "FieldValueForbidden",
                "FieldValueDuplicate": "FieldValueDuplicate",
            }.get(rule.get("reason", ""), "FieldValueInvalid")
            out.append(
                Cause(field or "<root>", f'Invalid value: "object": {message}{detail}', reason)
            )
    for sub, value, sub_path in _children(schema, obj, path):
        out.extend(_cel(sub, value, sub_path))
    return out

"""What the API server checks when a CustomResourceDefinition is created, with its
field paths and wording (each error as the server prints it, Go structs included).

A single-version CRD (or one whose versions share a schema) is checked as the server's
internal form holds it: the schema at ``spec.validation.openAPIV3Schema`` and the
printer columns at ``spec.additionalPrinterColumns``; versions with schemas of their
own at ``spec.versions[i].schema.openAPIV3Schema``. Checked, in the server's order:

- ``metadata.name`` is ``<plural>.<group>``; the group has a dot; the scope; version
  names; exactly one storage version; names and short names are DNS-1035 labels;
  printer column types, formats and JSON paths;
- a status subresource allows only some keywords at the schema's root;
- the structural schema rules: every node has a ``type`` (unless
  ``x-kubernetes-int-or-string`` or ``x-kubernetes-preserve-unknown-fields``), arrays
  have ``items``, no ``additionalProperties`` at the root, the root's ``metadata`` may
  restrict only ``name`` and ``generateName``, nothing inside ``anyOf``/``allOf``/
  ``oneOf``/``not`` but value validations (no ``type``, ``default``, ``description``,
  ``x-kubernetes-*``, ``metadata``), what the root's constrain is also declared
  outside them, patterns compile (Go's wording for the common mistakes); errors sorted,
  as the server sorts them;
- every ``default`` against its own schema: pruned (no unknown fields), then the
  OpenAPI keywords, then the CEL rules at and below it, on the default exactly as
  written: nested defaults are not applied to it first, so ``default: {}`` under a rule
  that reads an optional field fails with ``no such key``;
- the OpenAPI schema rules: supported types, no ``uniqueItems``, ``properties`` or
  ``additionalProperties`` (not both), no defaults in ``metadata``,
  ``x-kubernetes-list-type``/``-list-map-keys``/``-map-type`` consistency (map keys
  scalar, required or defaulted), ``x-kubernetes-validations`` (rule present, message
  and ``fieldPath`` on one line, ``reason`` supported, ``fieldPath`` a declared field);
- each CEL rule (where nothing at or below its node has a schema error): its estimated
  cost times how often it can run, against the per-rule and per-schema budgets (cel-go's
  estimator, ported: :func:`rule_cost`); then its compilation: a syntax error, a field
  the schema does not declare (``undefined field 'x'``, located as cel-go locates it),
  or an expression that is plainly not a bool.

Unknown schema keywords are dropped, as the server's decoder drops them (a misspelt
``x-kubernetes-validation`` is silently no rule). Not emulated: conversion webhooks,
selectable fields, ``deprecationWarning``, ``oldSelf``/ratcheting, CEL type checking
beyond declared fields and the outermost operator (a wrong overload compiles here), the
wording of CEL syntax errors (cel-python's, after ``Syntax error:``), defaults inside
``metadata``, and the cost of CEL functions other than the standard library, the
string, regex and list extensions.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import celpy

from k8s.schema import (
    Cause,
    Schema,
    additional,
    cel_causes,
    forbidden,
    go_json,
    invalid,
    items,
    key,
    not_supported,
    openapi_causes,
    props,
    prune,
    required,
)

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_TYPES = ("array", "boolean", "integer", "number", "object", "string")
_REASONS = ("FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired")
_COLUMN_TYPES = "boolean,date,integer,number,string"
_COLUMN_FORMATS = ("byte", "date", "date-time", "double", "float", "int32", "int64", "password")
_ROOT_KEYS = {
    "description",
    "type",
    "format",
    "title",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "multipleOf",
    "required",
    "items",
    "properties",
    "externalDocs",
    "example",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
}
_ROOT_FIELD_NAMES = (
    "[Description Type Format Title Maximum ExclusiveMaximum Minimum ExclusiveMinimum "
    "MaxLength MinLength Pattern MaxItems MinItems UniqueItems MultipleOf Required Items "
    "Properties ExternalDocs Example XPreserveUnknownFields XValidations]"
)
#: Estimated-cost limits of one rule and of a whole schema, and the request size the
#: server assumes for lists and strings without bounds.
RULE_COST_LIMIT = 10_000_000
SCHEMA_COST_LIMIT = 100_000_000
MAX_REQUEST_BYTES = 3 * 1024 * 1024


def _dns1035(value: str) -> str:
    """``IsDNS1035Label``'s messages, joined as the CRD checks join them."""
    out = []
    if len(value) > 63:
        out.append("must be no more than 63 characters")
    if not _DNS1035.match(value):
        out.append(
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
            "start with an alphabetic character, and end with an alphanumeric character "
            "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
            "'[a-z]([-a-z0-9]*[a-z0-9])?')"
        )
    return ",".join(out)


def _subdomain(value: str) -> list[str]:
    out = []
    if len(value) > 253:
        out.append("must be no more than 253 characters")
    if not _SUBDOMAIN.match(value):
        out.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
            "characters, '-' or '.', and must start and end with an alphanumeric character "
            "(e.g. 'example.com', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    return out


# ---------------------------------------------------------------------------- the CRD
def crd_causes(crd: Mapping[str, Any]) -> list[Cause]:
    """Every field error the server gives for creating ``crd`` (empty: it is accepted)."""
    meta = crd.get("metadata") or {}
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    out: list[Cause] = []
    name = str(meta.get("name") or "")
    for msg in _subdomain(name) if name else []:
        out.append(invalid("metadata.name", name, msg))
    if name and name != f"{names.get('plural', '')}.{spec.get('group', '')}":
        out.append(invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))

    group = str(spec.get("group") or "")
    if not group:
        out.append(required("spec.group"))
    elif _subdomain(group):
        out.append(invalid("spec.group", group, ",".join(_subdomain(group))))
    elif "." not in group:
        out.append(invalid("spec.group", group, "should be a domain with at least one dot"))
    scope = str(spec.get("scope") or "")
    if not scope:
        out.append(required("spec.scope"))
    elif scope not in ("Cluster", "Namespaced"):
        out.append(not_supported("spec.scope", scope, ["Cluster", "Namespaced"]))

    versions = list(spec.get("versions") or [])
    schemas = [v.get("schema") for v in versions]
    shared = bool(versions) and all(s == schemas[0] for s in schemas)
    columns = [v.get("additionalPrinterColumns") for v in versions]
    shared_columns = bool(versions) and all(c == columns[0] for c in columns)
    subresources = [v.get("subresources") for v in versions]
    shared_subresources = bool(versions) and all(s == subresources[0] for s in subresources)
    if not shared or not (schemas[0] or {}).get("openAPIV3Schema"):
        for i, s in enumerate(schemas):
            if not (s or {}).get("openAPIV3Schema"):
                out.append(required(f"spec.versions[{i}].schema.openAPIV3Schema"))
    for i, version in enumerate(versions):
        vname = str(version.get("name") or "")
        if _dns1035(vname):
            out.append(invalid(f"spec.versions[{i}].name", vname, _dns1035(vname)))
        status = "status" in (version.get("subresources") or {})
        if not shared and (version.get("schema") or {}).get("openAPIV3Schema"):
            out.extend(
                schema_causes(
                    version["schema"]["openAPIV3Schema"],
                    f"spec.versions[{i}].schema.openAPIV3Schema",
                    status,
                )
            )
        if not shared_columns:
            for j, column in enumerate(version.get("additionalPrinterColumns") or []):
                out.extend(
                    _column_causes(column, f"spec.versions[{i}].additionalPrinterColumns[{j}]")
                )
    shown = _versions_value(versions, shared, shared_subresources, shared_columns)
    if len({v.get("name") for v in versions}) != len(versions):
        out.append(invalid_raw("spec.versions", shown, "must contain unique version names"))
    if sum(1 for v in versions if v.get("storage")) != 1:
        detail = "must have exactly one version marked as storage version"
        out.append(invalid_raw("spec.versions", shown, detail))
    for f in ("plural", "singular", "kind", "listKind"):
        if not names.get(f):
            out.append(required(f"spec.names.{f}"))
    out.extend(_names_causes(names))
    if shared and (schemas[0] or {}).get("openAPIV3Schema"):
        status = any("status" in (s or {}) for s in subresources)
        out.extend(
            schema_causes(schemas[0]["openAPIV3Schema"], "spec.validation.openAPIV3Schema", status)
        )
    if shared_columns:
        for j, column in enumerate(columns[0] or []):
            out.extend(_column_causes(column, f"spec.additionalPrinterColumns[{j}]"))
    if not any(v.get("storage") for v in versions):
        out.append(invalid("status.storedVersions", None, "must have at least one stored version"))
    return out


def invalid_raw(path: str, shown: str, detail: str) -> Cause:
    """An ``Invalid value`` whose value is already rendered (a Go struct, as JSON)."""
    return Cause(path, f"Invalid value: {shown}: {detail}")


def _versions_value(
    versions: list[Any], shared_schema: bool, shared_sub: bool, shared_columns: bool
) -> str:
    """The versions as the server prints them: internal Go structs, as JSON, with what
    all versions share moved out of them (to ``spec``)."""
    out = []
    for v in versions:
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        schema_text = (
            "null"
            if shared_schema or v.get("schema") is None
            else '{"OpenAPIV3Schema":' + go_schema(schema) + "}"
        )
        sub = v.get("subresources")
        if shared_sub or sub is None:
            sub_text = "null"
        else:
            status = "{}" if "status" in sub else "null"
            scale = sub.get("scale")
            scale_text = (
                "null"
                if scale is None
                else '{"SpecReplicasPath":'
                + go_json(scale.get("specReplicasPath", ""))
                + ',"StatusReplicasPath":'
                + go_json(scale.get("statusReplicasPath", ""))
                + ',"LabelSelectorPath":'
                + go_json(scale.get("labelSelectorPath"))
                + "}"
            )
            sub_text = f'{{"Status":{status},"Scale":{scale_text}}}'
        columns = v.get("additionalPrinterColumns")
        columns_text = (
            "null"
            if shared_columns or not columns
            else "["
            + ",".join(
                "{"
                + ",".join(
                    f'"{name}":{go_json(c.get(k, 0 if k == "priority" else ""))}'
                    for name, k in (
                        ("Name", "name"),
                        ("Type", "type"),
                        ("Format", "format"),
                        ("Description", "description"),
                        ("Priority", "priority"),
                        ("JSONPath", "jsonPath"),
                    )
                )
                + "}"
                for c in columns
            )
            + "]"
        )
        fields = v.get("selectableFields")
        fields_text = (
            "null"
            if not fields
            else "["
            + ",".join('{"JSONPath":' + go_json(f.get("jsonPath", "")) + "}" for f in fields)
            + "]"
        )
        out.append(
            "{"
            + f'"Name":{go_json(v.get("name", ""))},"Served":{go_json(bool(v.get("served")))},'
            + f'"Storage":{go_json(bool(v.get("storage")))},'
            + f'"Deprecated":{go_json(bool(v.get("deprecated")))},'
            + f'"DeprecationWarning":{go_json(v.get("deprecationWarning"))},'
            + f'"Schema":{schema_text},"Subresources":{sub_text},'
            + f'"AdditionalPrinterColumns":{columns_text},"SelectableFields":{fields_text}'
            + "}"
        )
    return "[" + ",".join(out) + "]"


def _names_causes(names: Mapping[str, Any]) -> list[Cause]:
    out = []
    for f in ("plural", "singular"):
        value = str(names.get(f) or "")
        if value and _dns1035(value):
            out.append(invalid(f"spec.names.{f}", value, _dns1035(value)))
    for f in ("kind", "listKind"):
        value = str(names.get(f) or "")
        if value and _dns1035(value.lower()):
            detail = "may have mixed case, but should otherwise match: " + _dns1035(value.lower())
            out.append(invalid(f"spec.names.{f}", value, detail))
    for i, short in enumerate(names.get("shortNames") or []):
        if _dns1035(short):
            out.append(invalid(f"spec.names.shortNames[{i}]", short, _dns1035(short)))
    if names.get("kind") and names.get("kind") == names.get("listKind"):
        out.append(
            invalid(
                "spec.names.listKind", names["listKind"], "kind and listKind may not be the same"
            )
        )
    for i, category in enumerate(names.get("categories") or []):
        if _dns1035(category):
            out.append(invalid(f"spec.names.categories[{i}]", category, _dns1035(category)))
    return out


def _column_causes(column: Mapping[str, Any], path: str) -> list[Cause]:
    out = []
    if not column.get("name"):
        out.append(required(f"{path}.name"))
    ctype = column.get("type")
    if not ctype:
        out.append(required(f"{path}.type", f"must be one of {_COLUMN_TYPES}"))
    elif ctype not in _COLUMN_TYPES.split(","):
        out.append(invalid(f"{path}.type", ctype, f"must be one of {_COLUMN_TYPES}"))
    fmt = column.get("format")
    if fmt and fmt not in _COLUMN_FORMATS:
        out.append(invalid(f"{path}.format", fmt, f"must be one of {','.join(_COLUMN_FORMATS)}"))
    json_path = str(column.get("jsonPath") or "")
    if not json_path:
        out.append(required(f"{path}.JSONPath"))
    elif not json_path.startswith("."):
        out.append(
            invalid(f"{path}.JSONPath", json_path, "must be a simple json path starting with .")
        )
    return out


# ---------------------------------------------------------------------------- Go values
_STRUCT_FIELDS = (
    ("ID", "id", "str"),
    ("Schema", "$schema", "str"),
    ("Ref", "$ref", "ptr"),
    ("Description", "description", "str"),
    ("Type", "type", "str"),
    ("Nullable", "nullable", "bool"),
    ("Format", "format", "str"),
    ("Title", "title", "str"),
    ("Default", "default", "ptr"),
    ("Maximum", "maximum", "float"),
    ("ExclusiveMaximum", "exclusiveMaximum", "bool"),
    ("Minimum", "minimum", "float"),
    ("ExclusiveMinimum", "exclusiveMinimum", "bool"),
    ("MaxLength", "maxLength", "ptr"),
    ("MinLength", "minLength", "ptr"),
    ("Pattern", "pattern", "str"),
    ("MaxItems", "maxItems", "ptr"),
    ("MinItems", "minItems", "ptr"),
    ("UniqueItems", "uniqueItems", "bool"),
    ("MultipleOf", "multipleOf", "float"),
    ("Enum", "enum", "ptr"),
    ("MaxProperties", "maxProperties", "ptr"),
    ("MinProperties", "minProperties", "ptr"),
    ("Required", "required", "ptr"),
    ("Items", "items", "items"),
    ("AllOf", "allOf", "list"),
    ("OneOf", "oneOf", "list"),
    ("AnyOf", "anyOf", "list"),
    ("Not", "not", "schema"),
    ("Properties", "properties", "map"),
    ("AdditionalProperties", "additionalProperties", "bool_or_schema"),
    ("PatternProperties", "patternProperties", "map"),
    ("Dependencies", "dependencies", "ptr"),
    ("AdditionalItems", "additionalItems", "bool_or_schema"),
    ("Definitions", "definitions", "map"),
    ("ExternalDocs", "externalDocs", "docs"),
    ("Example", "example", "ptr"),
    ("XPreserveUnknownFields", "x-kubernetes-preserve-unknown-fields", "ptr"),
    ("XEmbeddedResource", "x-kubernetes-embedded-resource", "bool"),
    ("XIntOrString", "x-kubernetes-int-or-string", "bool"),
    ("XListMapKeys", "x-kubernetes-list-map-keys", "ptr"),
    ("XListType", "x-kubernetes-list-type", "ptr"),
    ("XMapType", "x-kubernetes-map-type", "ptr"),
    ("XValidations", "x-kubernetes-validations", "rules"),
)


def go_schema(s: Any) -> str:
    """A schema as the server prints it in an error: its internal Go struct, as JSON."""
    if not isinstance(s, Mapping):
        return "null"
    parts = []
    for name, k, kind in _STRUCT_FIELDS:
        v = s.get(k)
        if kind == "str":
            text = go_json(v or "")
        elif kind == "bool":
            text = go_json(bool(v))
        elif kind == "float":
            text = "null" if v is None else go_json(float(v))
        elif kind == "items":
            text = "null" if v is None else '{"Schema":' + go_schema(v) + ',"JSONSchemas":null}'
        elif kind == "list":
            text = "null" if not v else "[" + ",".join(go_schema(x) for x in v) + "]"
        elif kind == "schema":
            text = go_schema(v) if v is not None else "null"
        elif kind == "map":
            inner = ",".join(f"{go_json(n)}:{go_schema(x)}" for n, x in sorted((v or {}).items()))
            text = "null" if not v else "{" + inner + "}"
        elif kind == "bool_or_schema":
            if v is None:
                text = "null"
            else:
                sub = go_schema(v) if isinstance(v, Mapping) else "null"
                text = f'{{"Allows":{go_json(v is not False)},"Schema":{sub}}}'
        elif kind == "docs":
            text = "null" if v is None else go_json(v)
        elif kind == "rules":
            text = "null" if not v else "[" + ",".join(_rule_value(r) for r in v) + "]"
        else:
            text = go_json(v)
        parts.append(f'"{name}":{text}')
    return "{" + ",".join(parts) + "}"


_GO_REGEXP_ERRORS = (
    ("missing ), unterminated subpattern", "missing closing )", "all"),
    ("unbalanced parenthesis", "unexpected )", "all"),
    ("unterminated character set", "missing closing ]", "from"),
    ("nothing to repeat", "missing argument to repetition operator", "at"),
    ("multiple repeat", "invalid nested repetition operator", "at2"),
)


def regexp_error(pattern: str) -> str | None:
    """Go's ``regexp.Compile`` error for the common mistakes (Python's parser finds them;
    Perl look-arounds and back references, which Go refuses, are checked by hand)."""
    m = re.search(r"\(\?<?[=!]", pattern)
    if m:
        return f"error parsing regexp: invalid or unsupported Perl syntax: `{m.group(0)}`"
    m = re.search(r"\\[1-9]", pattern)
    if m:
        return f"error parsing regexp: invalid escape sequence: `{m.group(0)}`"
    try:
        re.compile(pattern)
    except re.error as err:
        text = str(err)
        pos = err.pos or 0
        for py, go, part in _GO_REGEXP_ERRORS:
            if text.startswith(py):
                shown = {
                    "all": pattern,
                    "from": pattern[pattern.rfind("[", 0, pos + 1) :],
                    "at": pattern[pos : pos + 1],
                    "at2": pattern[max(0, pos - 1) : pos + 1],
                }[part]
                return f"error parsing regexp: {go}: `{shown}`"
        return f"error parsing regexp: {text}"
    return None


# ---------------------------------------------------------------------------- one schema
def schema_causes(schema: Schema, path: str, status: bool) -> list[Cause]:
    """``validateCustomResourceDefinitionValidation`` for one ``openAPIV3Schema``."""
    out: list[Cause] = []
    if status:
        if schema.get("type") not in (None, "object"):
            out.append(
                invalid(
                    f"{path}.type",
                    schema["type"],
                    'only "object" is allowed as the type at the root of the schema if the '
                    "status subresource is enabled",
                )
            )
        elif any(k not in _ROOT_KEYS for k in schema if schema.get(k) not in (None, False, "")):
            out.append(
                Cause(
                    path,
                    f"Invalid value: {go_schema(schema)}: only {_ROOT_FIELD_NAMES} fields are "
                    "allowed at the root of the schema if the status subresource is enabled",
                )
            )
    if schema.get("nullable"):
        out.append(forbidden(f"{path}.nullable", "nullable cannot be true at the root"))
    unsupported = _unsupported(schema)
    structural = structural_causes(schema, path) if unsupported is None else []
    defaults: list[Cause] = []
    if unsupported is None and not structural:
        defaults = default_causes(schema, path)
    out.extend(structural or defaults)
    walk = _Walk(compile_rules=unsupported is None and not structural and not defaults)
    schema_errors, cel_errors = _openapi_schema_causes(schema, path, walk, root=True)
    out.extend(schema_errors + cel_errors)
    if not out and unsupported is not None:
        out.append(invalid(path, "", unsupported))
    total = min(sum(c for _, c in walk.costs), MAX_U64)
    if total > SCHEMA_COST_LIMIT:
        expensive = sorted(
            (c for c in walk.costs if c[1] >= SCHEMA_COST_LIMIT // 100), key=lambda c: -c[1]
        )
        for rule_path, _ in expensive[:4]:
            out.append(
                forbidden(
                    rule_path,
                    "contributed to estimated rule cost total exceeding cost limit for entire "
                    "OpenAPIv3 schema",
                )
            )
        what = "x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema"
        out.append(forbidden(path, _cost_message(what, total, SCHEMA_COST_LIMIT)))
    return out


def _unsupported(s: Any) -> str | None:
    """``NewStructural``'s refusal of keywords a structural schema never has."""
    if not isinstance(s, Mapping):
        return None
    for k, word in (
        ("id", "id"),
        ("$schema", "schema"),
        ("$ref", "$ref"),
        ("patternProperties", "patternProperties"),
        ("dependencies", "dependencies"),
        ("additionalItems", "additionalItems"),
        ("definitions", "definitions"),
    ):
        if s.get(k):
            return f"OpenAPIV3Schema '{word}' is not supported"
    if isinstance(s.get("items"), list):
        return "OpenAPIV3Schema 'items' must be a schema, but is an array"
    for sub in _subschemas(s):
        problem = _unsupported(sub)
        if problem:
            return problem
    return None


def _subschemas(s: Mapping[str, Any]) -> Iterator[Any]:
    yield from props(s).values()
    if isinstance(s.get("items"), Mapping):
        yield s["items"]
    if isinstance(s.get("additionalProperties"), Mapping):
        yield s["additionalProperties"]
    for k in ("allOf", "anyOf", "oneOf"):
        yield from s.get(k) or []
    if isinstance(s.get("not"), Mapping):
        yield s["not"]


# ---------------------------------------------------------------------------- structural
_VALUE_KEYS = {
    "format",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "multipleOf",
    "enum",
    "maxProperties",
    "minProperties",
    "required",
    "allOf",
    "oneOf",
    "anyOf",
    "not",
}
_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def structural_causes(schema: Schema, path: str) -> list[Cause]:
    """``ValidateStructural``: the invariants and completeness of a structural schema,
    sorted by their text as the server sorts them."""
    out = _invariants(schema, "root", path)
    out.extend(_completeness(schema, schema, path, path))
    return sorted(out, key=lambda c: f"{c.field}: {c.message}")


def _invariants(s: Schema, level: str, path: str) -> list[Cause]:
    out: list[Cause] = []
    if s.get("type") == "array" and not isinstance(s.get("items"), Mapping):
        out.append(required(f"{path}.items", "must be specified"))
    if isinstance(s.get("items"), Mapping):
        out.extend(_invariants(s["items"], "item", f"{path}.items"))
    for k, sub in props(s).items():
        out.extend(_invariants(sub, "field", key(f"{path}.properties", k)))
    if s.get("additionalProperties") is not None:
        if level == "root":
            out.append(forbidden(f"{path}.additionalProperties", "must not be used at the root"))
        if isinstance(s["additionalProperties"], Mapping):
            out.extend(
                _invariants(s["additionalProperties"], "field", f"{path}.additionalProperties")
            )
    if s.get("x-kubernetes-int-or-string") and s.get("x-kubernetes-preserve-unknown-fields"):
        out.append(
            invalid(
                f"{path}.x-kubernetes-preserve-unknown-fields",
                True,
                "must be false if x-kubernetes-int-or-string is true",
            )
        )
    if s.get("x-kubernetes-int-or-string") and s.get("x-kubernetes-embedded-resource"):
        out.append(
            invalid(
                f"{path}.x-kubernetes-embedded-resource",
                True,
                "must be false if x-kubernetes-int-or-string is true",
            )
        )
    skip_any = _strip(s.get("anyOf")) == _INT_OR_STRING
    all_of = s.get("allOf") or []
    skip_first_all = bool(all_of) and _strip(all_of[0].get("anyOf")) == _INT_OR_STRING
    out.extend(_value_validation(s, skip_any, skip_first_all, path))
    embedded = bool(s.get("x-kubernetes-embedded-resource"))
    t = s.get("type", "")
    if embedded and t != "object":
        if not t:
            out.append(
                required(f"{path}.type", "must be object if x-kubernetes-embedded-resource is true")
            )
        else:
            out.append(
                invalid(
                    f"{path}.type", t, "must be object if x-kubernetes-embedded-resource is true"
                )
            )
    elif (
        not t
        and not s.get("x-kubernetes-int-or-string")
        and not s.get("x-kubernetes-preserve-unknown-fields")
    ):
        where = {"root": "at the root", "item": "for specified array items"}.get(
            level, "for specified object fields"
        )
        out.append(required(f"{path}.type", f"must not be empty {where}"))
    if embedded and s.get("additionalProperties") is not None:
        out.append(
            forbidden(
                f"{path}.additionalProperties",
                "must not be used if x-kubernetes-embedded-resource is set",
            )
        )
    if level == "root" and t and t != "object":
        out.append(invalid(f"{path}.type", t, "must be object at the root"))
    check_meta = level == "root" or embedded
    for f in ("kind", "apiVersion"):
        if f in props(s) and check_meta and props(s)[f].get("type", "") != "string":
            sub_path = key(f"{path}.properties", f) + ".type"
            out.append(invalid(sub_path, props(s)[f].get("type", ""), "must be string"))
    if "metadata" in props(s):
        out.extend(
            _metadata(
                props(s)["metadata"], check_meta, level, key(f"{path}.properties", "metadata")
            )
        )
    if embedded and not s.get("x-kubernetes-preserve-unknown-fields") and not props(s):
        out.append(
            required(
                f"{path}.properties",
                "must not be empty if x-kubernetes-embedded-resource is true without "
                "x-kubernetes-preserve-unknown-fields",
            )
        )
    return out


def _strip(value: Any) -> Any:
    """A list of schemas without their descriptions, for the int-or-string pattern."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in (x or {}).items()} for x in value]


def _metadata(s: Schema, check: bool, level: str, path: str) -> list[Cause]:
    out = []
    if check and s.get("type") != "object":
        out.append(invalid(f"{path}.type", s.get("type", ""), "must be object"))
    if level == "root":
        rest = {k: v for k, v in s.items() if k not in ("type", "default")}
        names = set(props(s))
        if names and names <= {"name", "generateName"}:
            rest.pop("properties", None)
        if rest:
            out.append(
                forbidden(
                    path,
                    "must not specify anything other than name and generateName, but metadata "
                    "is implicitly specified",
                )
            )
    return out


def _value_validation(s: Schema, skip_any: bool, skip_first_all: bool, path: str) -> list[Cause]:
    out: list[Cause] = []
    if not skip_any:
        for i, sub in enumerate(s.get("anyOf") or []):
            out.extend(_nested(sub, False, f"{path}.anyOf[{i}]"))
    for i, sub in enumerate(s.get("allOf") or []):
        out.extend(_nested(sub, skip_first_all and i == 0, f"{path}.allOf[{i}]"))
    for i, sub in enumerate(s.get("oneOf") or []):
        out.extend(_nested(sub, False, f"{path}.oneOf[{i}]"))
    if isinstance(s.get("not"), Mapping):
        out.extend(_nested(s["not"], False, f"{path}.not"))
    if s.get("pattern"):
        problem = regexp_error(str(s["pattern"]))
        if problem:
            detail = f"must be a valid regular expression, but isn't: {problem}"
            out.append(invalid(f"{path}.pattern", s["pattern"], detail))
    return out


_NESTED_FORBIDDEN = (
    ("type", "type", "must be empty to be structural"),
    ("additionalProperties", "additionalProperties", "must be undefined to be structural"),
    ("default", "default", "must be undefined to be structural"),
    ("title", "title", "must be empty to be structural"),
    ("description", "description", "must be empty to be structural"),
    ("nullable", "nullable", "must be false to be structural"),
    (
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-preserve-unknown-fields",
        "must be false to be structural",
    ),
    (
        "x-kubernetes-embedded-resource",
        "x-kubernetes-embedded-resource",
        "must be false to be structural",
    ),
    ("x-kubernetes-int-or-string", "x-kubernetes-int-or-string", "must be false to be structural"),
    ("x-kubernetes-list-map-keys", "x-kubernetes-list-map-keys", "must be empty to be structural"),
    ("x-kubernetes-list-type", "x-kubernetes-list-type", "must be undefined to be structural"),
    ("x-kubernetes-map-type", "x-kubernetes-map-type", "must be undefined to be structural"),
    ("x-kubernetes-validations", "x-kubernetes-validations", "must be empty to be structural"),
)


def _nested(s: Any, skip_any: bool, path: str) -> list[Cause]:
    """A schema inside anyOf/allOf/oneOf/not: value validations only."""
    if not isinstance(s, Mapping):
        return []
    out = _value_validation(s, skip_any, False, path)
    if isinstance(s.get("items"), Mapping):
        out.extend(_nested(s["items"], False, f"{path}.items"))
    for k, sub in props(s).items():
        out.extend(_nested(sub, False, key(f"{path}.properties", k)))
    for k, word, detail in _NESTED_FORBIDDEN:
        if s.get(k) not in (None, False, "", []):
            if k == "additionalProperties":
                out.append(forbidden(f"{path}.{word}", detail))
                continue
            out.append(forbidden(f"{path}.{word}", detail))
    if "metadata" in props(s):
        out.append(
            forbidden(
                key(f"{path}.properties", "metadata"), "must not be specified in a nested context"
            )
        )
    return out


def _completeness(s: Schema | None, v: Schema, s_path: str, v_path: str) -> list[Cause]:
    """What anyOf/allOf/oneOf/not constrain must be declared in the schema itself."""
    out: list[Cause] = []
    for word in ("allOf", "anyOf", "oneOf"):
        for i, sub in enumerate(v.get(word) or []):
            out.extend(_nested_complete(sub, s, s_path, f"{v_path}.{word}[{i}]"))
    if isinstance(v.get("not"), Mapping):
        out.extend(_nested_complete(v["not"], s, s_path, f"{v_path}.not"))
    return out


def _nested_complete(v: Schema, s: Schema | None, s_path: str, v_path: str) -> list[Cause]:
    if s is None:
        return [required(s_path, f"because it is defined in {v_path}")]
    out = _completeness(s, v, s_path, v_path)
    if isinstance(v.get("items"), Mapping):
        out.extend(_nested_complete(v["items"], items(s), f"{s_path}.items", f"{v_path}.items"))
    for k, sub in props(v).items():
        if k not in props(s):
            out.append(
                required(
                    key(f"{s_path}.properties", k),
                    f"because it is defined in {key(f'{v_path}.properties', k)}",
                )
            )
        else:
            out.extend(
                _nested_complete(
                    sub, props(s)[k], key(f"{s_path}.properties", k), key(f"{v_path}.properties", k)
                )
            )
    return out


# ---------------------------------------------------------------------------- defaults
def default_causes(schema: Schema, path: str) -> list[Cause]:
    """``ValidateDefaults``: each ``default`` is pruned, valid for its schema and passes
    the CEL rules at and below it, exactly as written."""
    out: list[Cause] = []
    _defaults(schema, path, out, meta=False, root=True)
    return out


def _defaults(s: Schema, path: str, out: list[Cause], meta: bool, root: bool) -> None:
    if s.get("default") is not None and not meta:
        value = s["default"]
        at = f"{path}.default"
        pruned = copy.deepcopy(value)
        prune(pruned, s, "", [], root=bool(s.get("x-kubernetes-embedded-resource")))
        if pruned != value:
            out.append(invalid(at, value, "must not have unknown fields"))
        problems = openapi_causes(s, value, at)
        if problems:
            out.extend(problems)
        else:
            out.extend(cel_causes(s, value, at))
    if isinstance(s.get("items"), Mapping):
        _defaults(s["items"], f"{path}.items", out, meta, False)
    for k, sub in props(s).items():
        sub_meta = meta or (
            (root or bool(s.get("x-kubernetes-embedded-resource")))
            and k in ("metadata", "apiVersion", "kind")
        )
        _defaults(sub, key(f"{path}.properties", k), out, sub_meta, False)


# ---------------------------------------------------------------------------- OpenAPI rules
@dataclass
class _Walk:
    """What ``ValidateCustomResourceDefinitionOpenAPISchema`` carries down the schema:
    whether rules are compiled at all (the schema is structural and its defaults are
    valid), and each rule's estimated cost."""

    compile_rules: bool
    costs: list[tuple[str, int]] = field(default_factory=list)


def _openapi_schema_causes(
    s: Schema,
    path: str,
    walk: _Walk,
    root: bool = False,
    meta: bool = False,
    no_defaults: str = "",
    cardinality: int | None = 1,
    rules: bool = True,
) -> tuple[list[Cause], list[Cause]]:
    """The schema errors and the CEL errors of a node and everything below it; a node's
    rules are compiled only when nothing at or below it has a schema error."""
    errors = _keyword_causes(s, path, meta, no_defaults)
    cel: list[Cause] = []

    def below(
        sub: Schema,
        sub_path: str,
        sub_meta: bool = meta,
        reason: str = no_defaults,
        sub_rules: bool = False,
    ) -> None:
        inner = _times(s, cardinality) if sub_rules else None
        sub_errors, sub_cel = _openapi_schema_causes(
            sub, sub_path, walk, False, sub_meta, reason, inner, sub_rules and rules
        )
        errors.extend(sub_errors)
        cel.extend(sub_cel)

    extra = s.get("additionalProperties")
    if extra is not None:
        if props(s) and extra is not True:
            errors.append(
                forbidden(
                    f"{path}.additionalProperties",
                    "additionalProperties and properties are mutual exclusive",
                )
            )
        if isinstance(extra, Mapping):
            reason = (
                "inside additionalProperties applying to object metadata" if meta else no_defaults
            )
            below(extra, f"{path}.additionalProperties", reason=reason, sub_rules=True)
    for k, sub in props(s).items():
        sub_meta, reason = meta, no_defaults
        if (root or s.get("x-kubernetes-embedded-resource")) and k in _META_FIELDS:
            sub_meta = True
            if root:
                reason = f"in top-level {k}"
        below(sub, key(f"{path}.properties", k), sub_meta, reason, sub_rules=True)
    if isinstance(s.get("not"), Mapping):
        below(s["not"], f"{path}.not")
    for word in ("allOf", "oneOf", "anyOf"):
        for i, sub in enumerate(s.get(word) or []):
            if isinstance(sub, Mapping):
                below(sub, f"{path}.{word}[{i}]")
    if isinstance(s.get("items"), Mapping):
        below(s["items"], f"{path}.items", sub_rules=True)
    if s.get("x-kubernetes-preserve-unknown-fields") is False:
        errors.append(
            invalid(
                f"{path}.x-kubernetes-preserve-unknown-fields", False, "must be true or undefined"
            )
        )
    errors.extend(_map_and_list_types(s, path))
    errors.extend(_rule_fields(s, path))
    if s.get("x-kubernetes-validations") and not errors and walk.compile_rules and rules:
        is_root = root or bool(s.get("x-kubernetes-embedded-resource"))
        cel.extend(_rule_causes(s, path, walk, cardinality, is_root))
    return errors, cel


_META_FIELDS = ("metadata", "kind", "apiVersion")


def _keyword_causes(s: Schema, path: str, meta: bool, no_defaults: str) -> list[Cause]:
    """``specStandardValidatorV3`` and ``uniqueItems``: keywords a CRD schema may not use."""
    out: list[Cause] = []
    t = s.get("type", "")
    if t and t not in _TYPES:
        out.append(not_supported(f"{path}.type", t, list(_TYPES)))
    if s.get("default") is not None and no_defaults:
        out.append(forbidden(f"{path}.default", f"must not be set {no_defaults}"))
    for k, detail in (
        ("id", "id is not supported"),
        ("additionalItems", "additionalItems is not supported"),
        ("patternProperties", "patternProperties is not supported"),
        ("definitions", "definitions is not supported"),
        ("dependencies", "dependencies is not supported"),
        ("$ref", "$ref is not supported"),
    ):
        if s.get(k):
            out.append(forbidden(f"{path}.{k}", detail))
    if t == "null":
        out.append(
            forbidden(f"{path}.type", "type cannot be set to null, use nullable as an alternative")
        )
    if isinstance(s.get("items"), list):
        out.append(forbidden(f"{path}.items", "items must be a schema object and not an array"))
    if meta and s.get("x-kubernetes-embedded-resource"):
        out.append(
            forbidden(
                f"{path}.x-kubernetes-embedded-resource", "must not be used inside of resource meta"
            )
        )
    if s.get("uniqueItems"):
        out.append(
            forbidden(
                f"{path}.uniqueItems",
                "uniqueItems cannot be set to true since the runtime complexity becomes quadratic",
            )
        )
    return out


def _map_and_list_types(s: Schema, path: str) -> list[Cause]:
    out: list[Cause] = []
    t = s.get("type", "")
    map_type = s.get("x-kubernetes-map-type")
    if map_type is not None and t != "object":
        if not t:
            out.append(
                required(f"{path}.type", "must be object if x-kubernetes-map-type is specified")
            )
        else:
            out.append(
                invalid(f"{path}.type", t, "must be object if x-kubernetes-map-type is specified")
            )
    if map_type is not None and map_type not in ("atomic", "granular"):
        out.append(not_supported(f"{path}.x-kubernetes-map-type", map_type, ["atomic", "granular"]))
    list_type = s.get("x-kubernetes-list-type")
    sub = items(s)
    if list_type is not None and t != "array":
        if not t:
            out.append(
                required(f"{path}.type", "must be array if x-kubernetes-list-type is specified")
            )
        else:
            out.append(
                invalid(f"{path}.type", t, "must be array if x-kubernetes-list-type is specified")
            )
    elif list_type == "set" and sub is not None:
        if sub.get("type") == "array" and sub.get("x-kubernetes-list-type", "atomic") != "atomic":
            out.append(
                invalid(
                    f"{path}.items.x-kubernetes-list-type",
                    sub.get("x-kubernetes-list-type"),
                    "must be atomic as item of a list with x-kubernetes-list-type=set",
                )
            )
        if sub.get("type") == "object" and sub.get("x-kubernetes-map-type") != "atomic":
            out.append(
                invalid(
                    f"{path}.items.x-kubernetes-map-type",
                    list_type,
                    "must be atomic as item of a list with x-kubernetes-list-type=set",
                )
            )
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        out.append(
            not_supported(f"{path}.x-kubernetes-list-type", list_type, ["atomic", "set", "map"])
        )
    keys = s.get("x-kubernetes-list-map-keys") or []
    if keys:
        if list_type is None:
            out.append(
                required(
                    f"{path}.x-kubernetes-list-type",
                    "must be map if x-kubernetes-list-map-keys is non-empty",
                )
            )
        elif list_type != "map":
            out.append(
                invalid(
                    f"{path}.x-kubernetes-list-type",
                    list_type,
                    "must be map if x-kubernetes-list-map-keys is non-empty",
                )
            )
    if list_type == "map":
        if not keys:
            out.append(
                required(
                    f"{path}.x-kubernetes-list-map-keys",
                    "must not be empty if x-kubernetes-list-type is map",
                )
            )
        if s.get("items") is None:
            out.append(
                required(f"{path}.items", "must have a schema if x-kubernetes-list-type is map")
            )
        if sub is not None and sub.get("type") != "object":
            out.append(
                invalid(
                    f"{path}.items.type",
                    sub.get("type", ""),
                    "must be object if parent array's x-kubernetes-list-type is map",
                )
            )
        if sub is not None and sub.get("type") == "object":
            seen: set[str] = set()
            for k in keys:
                if k in props(sub):
                    if props(sub)[k].get("type") in ("array", "object"):
                        out.append(
                            invalid(
                                key(f"{path}.items.properties", k) + ".type",
                                "object",
                                "must be a scalar type if parent array's x-kubernetes-list-type "
                                "is map",
                            )
                        )
                else:
                    out.append(
                        invalid(
                            f"{path}.x-kubernetes-list-map-keys",
                            keys,
                            "entries must all be names of item properties",
                        )
                    )
                if k in seen:
                    out.append(
                        invalid(
                            f"{path}.x-kubernetes-list-map-keys",
                            keys,
                            "must not contain duplicate entries",
                        )
                    )
                seen.add(k)
    if list_type in ("set", "map") and sub is not None:
        if sub.get("nullable"):
            out.append(
                forbidden(
                    f"{path}.items.nullable",
                    f"cannot be nullable when x-kubernetes-list-type is {list_type}",
                )
            )
        if list_type == "map":
            for k in keys:
                prop = props(sub).get(k)
                if prop is None:
                    continue
                if k not in (sub.get("required") or []) and prop.get("default") is None:
                    out.append(
                        required(
                            key(f"{path}.items.properties", k) + ".default",
                            "this property is in x-kubernetes-list-map-keys, so it must have a "
                            "default or be a required property",
                        )
                    )
                if prop.get("nullable"):
                    out.append(
                        forbidden(
                            key(f"{path}.items.properties", k) + ".nullable",
                            "this property is in x-kubernetes-list-map-keys, so it cannot be "
                            "nullable",
                        )
                    )
    return out


def _rule_fields(s: Schema, path: str) -> list[Cause]:
    """The static checks of each ``x-kubernetes-validations`` entry."""
    out: list[Cause] = []
    for i, rule in enumerate(s.get("x-kubernetes-validations") or []):
        at = f"{path}.x-kubernetes-validations[{i}]"
        text = str(rule.get("rule") or "").strip()
        msg = str(rule.get("message") or "")
        if not text:
            out.append(required(f"{at}.rule", "rule is not specified"))
        elif msg and not msg.strip():
            out.append(invalid(f"{at}.message", msg, "must be non-empty if specified"))
        elif re.search(r"[\n\r]", msg.strip()):
            out.append(invalid(f"{at}.message", msg, "must not contain line breaks"))
        elif re.search(r"[\n\r]", text) and not msg.strip():
            out.append(
                required(f"{at}.message", "message must be specified if rule contains line breaks")
            )
        expr = rule.get("messageExpression")
        if expr is not None and expr != "" and not str(expr).strip():
            out.append(
                required(
                    f"{at}.messageExpression", "messageExpression must be non-empty if specified"
                )
            )
        reason = rule.get("reason")
        if reason is not None and reason not in _REASONS:
            out.append(not_supported(f"{at}.reason", reason, list(_REASONS)))
        field_path = rule.get("fieldPath")
        if field_path:
            if not str(field_path).strip():
                out.append(invalid(f"{at}.fieldPath", field_path, "must be non-empty if specified"))
            if "\n" in str(field_path):
                out.append(invalid(f"{at}.fieldPath", field_path, "must not contain line breaks"))
            if not _valid_field_path(str(field_path), s):
                out.append(invalid(f"{at}.fieldPath", field_path, "must be a valid path"))
    return out


def _valid_field_path(field_path: str, s: Schema) -> bool:
    """``ValidFieldPath``: ``.a.b`` and ``['k']`` steps through declared fields."""
    node: Schema | None = s
    pos = 0
    text = field_path
    while pos < len(text):
        m = re.compile(r"\.([^.\[\]]+)|\[\s*'((?:[^'\\]|\\.)*)'\s*\]").match(text, pos)
        if m is None or node is None:
            return False
        name = m.group(1) if m.group(1) is not None else m.group(2)
        if props(node):
            node = props(node).get(name)
            if node is None:
                return False
        elif additional(node) is not None:
            node = additional(node)
        else:
            return False
        pos = m.end()
    return True


# ---------------------------------------------------------------------------- CEL rules
def _rule_causes(
    s: Schema, path: str, walk: _Walk, cardinality: int | None, root: bool
) -> list[Cause]:
    """Each rule of a node: its estimated cost (times how often it can run) against the
    per-rule budget, then its compilation, then its messageExpression's."""
    out: list[Cause] = []
    for i, rule in enumerate(s.get("x-kubernetes-validations") or []):
        at = path_rule(path, i)
        text = str(rule.get("rule") or "")
        if not text.strip():
            continue
        problem = _compile(text, s, root)
        cost = 0 if problem else rule_cost(text, s, root)
        times = cardinality if cardinality is not None else max_cardinality(s, root)
        cost = min(cost * times, MAX_U64) if cost else 0
        if cost > RULE_COST_LIMIT:
            out.append(forbidden(at, _cost_message("estimated rule cost", cost, RULE_COST_LIMIT)))
        walk.costs.append((at, cost))
        if problem == "!bool":
            out.append(
                Cause(
                    at,
                    f"Invalid value: {_rule_value(rule)}: cel expression must evaluate to a bool",
                )
            )
            continue
        if problem:
            out.append(
                Cause(at, f"Invalid value: {_rule_value(rule)}: compilation failed: {problem}")
            )
            continue
        expr = str(rule.get("messageExpression") or "")
        if expr.strip():
            at_expr = path_rule(path, i, "messageExpression")
            problem = _compile(expr, s, root)
            if problem and problem != "!bool":
                detail = f"messageExpression compilation failed: {problem}"
                out.append(Cause(at_expr, f"Invalid value: {_rule_value(rule)}: {detail}"))
                continue
            expr_cost = rule_cost(expr, s, root)
            if expr_cost > RULE_COST_LIMIT:
                what = "estimated messageExpression cost"
                out.append(forbidden(at_expr, _cost_message(what, expr_cost, RULE_COST_LIMIT)))
            walk.costs.append((at_expr, expr_cost))
    return out


def path_rule(node_path: str, i: int, part: str = "rule") -> str:
    return f"{node_path}.x-kubernetes-validations[{i}].{part}"


def _rule_value(rule: Mapping[str, Any]) -> str:
    """The rule as the server prints it: its internal Go struct, as JSON."""
    fields = (
        ("Rule", rule.get("rule", "")),
        ("Message", rule.get("message", "")),
        ("MessageExpression", rule.get("messageExpression", "")),
        ("Reason", rule.get("reason")),
        ("FieldPath", rule.get("fieldPath", "")),
        ("OptionalOldSelf", rule.get("optionalOldSelf")),
    )
    return "{" + ",".join(f'"{k}":{go_json(v)}' for k, v in fields) + "}"


def _times(s: Schema, cardinality: int | None) -> int | None:
    """How often a child of ``s`` can occur in one object (``None``: unbounded), as the
    server's cost context tracks it: lists and maps multiply by their bounds."""
    if cardinality is None:
        return None
    t = s.get("type")
    if t == "array":
        return cardinality * int(s["maxItems"]) if "maxItems" in s else None
    if t == "object" and s.get("additionalProperties") is not None:
        return cardinality * int(s["maxProperties"]) if "maxProperties" in s else None
    return cardinality


def _cost_message(what: str, cost: int, limit: int) -> str:
    factor = cost / limit
    if factor > 100:
        shown = "more than 100x"
    elif factor < 1.5:
        shown = f"{factor:f}x"
    else:
        shown = f"{factor:.1f}x"
    return (
        f"{what} exceeds budget by factor of {shown} (try simplifying the rule, or adding "
        "maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)"
    )


# ---------------------------------------------------------------------------- compilation
def _compile(expr: str, s: Schema, root: bool) -> str | None:
    """``None`` when ``expr`` compiles against the schema, else cel-go's issue text (the
    syntax errors' wording is cel-python's)."""
    try:
        env = celpy.Environment()
        tree = env.compile(expr)
    except Exception as err:  # cel-python raises its own parser errors
        lines = str(err).splitlines()
        col = max(0, len(lines[1]) - 1) if len(lines) > 1 else 0
        return f"ERROR: <input>:1:{col + 1}: Syntax error: {lines[0] if lines else err}"
    self_schema = _root_view(s) if root else s
    for name, column in _undefined_fields(tree, {"self": self_schema}):
        line = expr.splitlines()[0] if expr else ""
        return (
            f"ERROR: <input>:1:{column + 1}: undefined field '{name}'\n | {line}\n | "
            + "." * column
            + "^"
        )
    if _result_kind(tree, {"self": self_schema}) == "other":
        return "!bool"
    return None


_BOOL_METHODS = ("all", "exists", "exists_one", "matches", "startsWith", "endsWith", "contains")
_OTHER_METHODS = ("map", "filter", "size", "lowerAscii", "upperAscii", "trim", "split", "join")
_OTHER_CALLS = ("size", "int", "uint", "double", "string", "bytes", "duration", "timestamp")


def _result_kind(tree: Any, scope: dict[str, Schema | None]) -> str | None:
    """``"bool"``, ``"other"`` or ``None`` (unknown): what an expression evaluates to, as
    far as its outermost operator (or a declared field's type) tells."""
    node = tree
    while True:
        kids = [c for c in getattr(node, "children", []) if hasattr(c, "children")]
        data = getattr(node, "data", "")
        if data in ("conditionalor", "conditionaland") and len(node.children) > 1:
            return "bool"
        if data == "relation" and len(node.children) > 1:
            return "bool"
        if data in ("addition", "multiplication") and len(node.children) > 1:
            return "other"
        if (
            data == "unary"
            and node.children
            and getattr(node.children[0], "data", "") == "unary_not"
        ):
            return "bool"
        if (
            data == "unary"
            and node.children
            and getattr(node.children[0], "data", "") == "unary_neg"
        ):
            return "other"
        if data == "expr" and len(node.children) > 1:
            return None
        if len(node.children) == 1 and len(kids) == 1:
            node = kids[0]
            continue
        break
    data = getattr(node, "data", "")
    if data == "literal" and node.children:
        return "bool" if str(node.children[0]) in ("true", "false") else "other"
    if data == "member_dot_arg" and len(node.children) >= 2:
        method = str(node.children[1])
        return "bool" if method in _BOOL_METHODS else "other" if method in _OTHER_METHODS else None
    if data == "ident_arg" and node.children:
        name = str(node.children[0])
        return "bool" if name == "has" else "other" if name in _OTHER_CALLS else None
    if data in ("member_dot", "ident"):
        found = _resolve(node, scope)
        if found is None or found.get("x-kubernetes-int-or-string") or not found.get("type"):
            return None
        return "bool" if found.get("type") == "boolean" else "other"
    if data in ("list_lit", "map_lit"):
        return "other"
    return None


def _root_view(s: Schema) -> dict[str, Any]:
    """The root as CEL declares it: ``metadata`` has only ``name`` and ``generateName``."""
    view = dict(s)
    view["properties"] = {
        **props(s),
        "metadata": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
        },
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
    }
    return view


_MACROS = ("all", "exists", "exists_one", "map", "filter")


def _undefined_fields(tree: Any, scope: dict[str, Schema | None]) -> Iterator[tuple[str, int]]:
    """Field selections on ``self`` (and on a macro's variable bound to its items) that the
    schema does not declare, with cel-go's 0-based column: the selection's dot, or the
    ``(`` of ``has(...)`` for the selection it tests."""
    data = getattr(tree, "data", None)
    if data == "member_dot_arg" and len(tree.children) >= 3:
        target, method, args = tree.children[0], tree.children[1], tree.children[2]
        var = _ident(args.children[0]) if str(method) in _MACROS and args.children else None
        if var:
            over = _resolve(target, scope)
            element = items(over) if (over or {}).get("type") == "array" else None
            yield from _undefined_fields(target, scope)
            for body in args.children[1:]:
                yield from _undefined_fields(body, {**scope, var: element})
            return
    if data == "ident_arg" and tree.children and str(tree.children[0]) == "has":
        arg = tree.children[1] if len(tree.children) > 1 else None
        select = _outer_select(arg)
        if select is not None:
            base, name = select.children
            parent = _resolve(base, scope)
            if parent is not None and _declares_fields(parent) and str(name) not in props(parent):
                yield str(name), int(tree.meta.column) - 1 + len("has")
                return
            yield from _undefined_fields(base, scope)
            return
    if data == "member_dot":
        base, name = tree.children
        yield from _undefined_fields(base, scope)
        parent = _resolve(base, scope)
        if parent is not None and _declares_fields(parent) and str(name) not in props(parent):
            yield str(name), _dot_column(tree)
        return
    for sub in getattr(tree, "children", []):
        if hasattr(sub, "children"):
            yield from _undefined_fields(sub, scope)


def _outer_select(tree: Any) -> Any:
    """The ``a.b`` that ``has(...)``'s argument is, through the parser's wrappers."""
    node = tree
    while (
        hasattr(node, "children")
        and len(node.children) == 1
        and hasattr(node.children[0], "children")
    ):
        node = node.children[0]
    return node if getattr(node, "data", None) == "member_dot" else None


def _walk(tree: Any) -> Iterator[Any]:
    yield tree
    for sub in getattr(tree, "children", []):
        if hasattr(sub, "children"):
            yield from _walk(sub)


def _declares_fields(s: Schema) -> bool:
    return (
        s.get("type") == "object"
        and not s.get("x-kubernetes-preserve-unknown-fields")
        and additional(s) is None
    )


def _ident(tree: Any) -> str | None:
    """The identifier an expression is made of, if it is one."""
    node = tree
    while (
        hasattr(node, "children")
        and len(node.children) == 1
        and hasattr(node.children[0], "children")
    ):
        node = node.children[0]
    if getattr(node, "data", None) == "ident" and node.children:
        return str(node.children[0])
    return None


def _resolve(tree: Any, scope: dict[str, Schema | None]) -> Schema | None:
    """The schema of a ``self.a.b`` chain, or ``None`` when it is not one."""
    node = tree
    while (
        hasattr(node, "children")
        and len(node.children) == 1
        and getattr(node, "data", "")
        in (
            "member",
            "primary",
            "expr",
            "conditionalor",
            "conditionaland",
            "relation",
            "addition",
            "multiplication",
            "unary",
        )
    ):
        node = node.children[0]
    data = getattr(node, "data", None)
    if data == "ident":
        return scope.get(str(node.children[0]))
    if data == "member_dot":
        parent = _resolve(node.children[0], scope)
        if parent is None:
            return None
        name = str(node.children[1])
        if props(parent):
            return props(parent).get(name)
        return additional(parent)
    return None


def _dot_column(node: Any) -> int:
    token = node.children[1]
    column = getattr(token, "column", None)
    if column is None:
        return max(0, int(getattr(getattr(node, "meta", None), "column", 1)) - 1)
    return max(0, int(column) - 2)


# ---------------------------------------------------------------------------- cost
MAX_U64 = 2**64 - 1
_SCALARS = ("bool", "double", "int", "timestamp", "duration", "uint")


def _add(*xs: int) -> int:
    return min(sum(xs), MAX_U64)


def _mul(a: int, b: int) -> int:
    return min(a * b, MAX_U64)


def _factor(x: int, y: float) -> int:
    """cel-go's ``multiplyByCostFactor``: ``ceil(x * y)``, saturating."""
    if x > 0 and y > 0 and float(x) > MAX_U64 / y:
        return MAX_U64
    product = math.ceil(float(x) * y)
    return MAX_U64 if product >= 2.0**64 else int(product)


@dataclass
class Decl:
    """The server's CEL declaration of a schema node (``SchemaDeclType``): its kind, the
    most elements (string length, items, properties) a request can hold, its smallest
    JSON size, and its fields or element type."""

    kind: str
    max_elements: int = 0
    min_size: int = 0
    fields: dict[str, Decl] = field(default_factory=dict)
    elem: Decl | None = None
    key: Decl | None = None


def decl(s: Schema, root: bool = False) -> Decl | None:
    """``SchemaDeclType``: ``None`` where CEL cannot see the node."""
    if s.get("x-kubernetes-int-or-string"):
        size = int(s["maxLength"]) * 4 if "maxLength" in s else MAX_REQUEST_BYTES - 2
        return Decl("dyn", size, 1)
    if root or s.get("x-kubernetes-embedded-resource"):
        s = _root_view(s)
    t = s.get("type")
    if t == "array":
        sub = items(s)
        elem = decl(sub, bool(sub.get("x-kubernetes-embedded-resource"))) if sub else None
        if elem is None:
            return None
        most = (
            int(s["maxItems"])
            if "maxItems" in s
            else (MAX_REQUEST_BYTES - 2) // (elem.min_size + 1)
        )
        return Decl("list", max(0, most), 2, elem=elem)
    if t == "object":
        return _object_decl(s)
    if t == "string":
        return _string_decl(s)
    return {
        "boolean": Decl("bool", 0, 4),
        "number": Decl("double", 0, 1),
        "integer": Decl("int", 0, 1),
    }.get(str(t))


def _object_decl(s: Schema) -> Decl | None:
    extra = s.get("additionalProperties")
    if isinstance(extra, Mapping):
        elem = decl(extra, bool(extra.get("x-kubernetes-embedded-resource")))
        if elem is None:
            return None
        most = (
            int(s["maxProperties"])
            if "maxProperties" in s
            else (MAX_REQUEST_BYTES - 2) // (elem.min_size + 6)
        )
        return Decl("map", max(0, most), 2, elem=elem, key=Decl("string", 0, 2))
    fields: dict[str, Decl] = {}
    size = 2
    required_names = set(s.get("required") or [])
    for name, prop in props(s).items():
        sub = decl(prop, bool(prop.get("x-kubernetes-embedded-resource")))
        if sub is None:
            continue
        fields[name] = sub
        if name in required_names and prop.get("default") is None:
            size += len(name) + sub.min_size + 4
    return Decl("object", 0, size, fields=fields)


def _string_decl(s: Schema) -> Decl:
    fmt = s.get("format")
    if fmt == "byte":
        return Decl("bytes", int(s.get("maxLength", MAX_REQUEST_BYTES - 2)), 2)
    if fmt in ("duration", "date", "date-time"):
        least = {"duration": 3, "date": 12, "date-time": 21}[str(fmt)]
        most = {"duration": 32, "date": 12, "date-time": 32}[str(fmt)]
        return Decl("duration" if fmt == "duration" else "timestamp", most, least)
    names = [e for e in s.get("enum") or [] if isinstance(e, str)]
    if "maxLength" in s:
        most = int(s["maxLength"]) * 4
    elif s.get("enum"):
        most = max((len(e) for e in names), default=0)
    else:
        most = MAX_REQUEST_BYTES - 2
    return Decl("string", most, 2)


@dataclass
class _X:
    """An expression's estimated cost and what its size estimate is made from."""

    cost: int
    kind: str | None = None
    path: tuple[str, ...] = ()
    size: int | None = None  # computed: call results, literals
    var_size: int | None = None
    entry: int | None = None  # a list literal's largest element


_QUOTED = re.compile(r"^([rRbB]*)('''|\"\"\"|'|\")(.*)\2$", re.S)
_ESCAPE = re.compile(r"\\(x..|u....|U........|[0-7]{3}|.)")
_KINDS = {
    "size": "int",
    "int": "int",
    "uint": "uint",
    "double": "double",
    "string": "string",
    "bool": "bool",
    "duration": "duration",
    "timestamp": "timestamp",
    "type": "type",
    "join": "string",
}


class _Coster:
    """cel-go's static cost estimator (its maximum only) over cel-python's parse tree,
    with the server's size estimates from the schema."""

    def __init__(self, root: Decl) -> None:
        self.root = root
        self.vars: dict[str, list[_X]] = {}

    def decl_at(self, path: tuple[str, ...]) -> Decl | None:
        """The server's size estimator walks a path from ``self``, whatever its first
        step is called (so any identifier's size is the rule's own node's)."""
        if not path:
            return None
        node: Decl | None = self.root
        for name in path[1:]:
            if node is None:
                return None
            if name in ("@items", "@values"):
                node = node.elem
            elif name == "@keys":
                node = node.key
            else:
                node = node.fields.get(name)
        return node

    def size(self, x: _X) -> int:
        """cel-go's ``computeSize``: computed, else the schema's, else 1 for a scalar."""
        if x.size is not None:
            return x.size
        found = self.decl_at(x.path)
        if found is not None:
            return found.max_elements
        if x.kind in _SCALARS:
            return 1
        return x.var_size if x.var_size is not None else MAX_U64

    def ev(self, t: Any) -> _X:
        """The cost of one parse-tree node (each grammar rule as cel-go costs its AST)."""
        if not hasattr(t, "data"):
            return _X(0)
        data = str(t.data)
        kids = list(t.children)
        binary = len(kids) == 2
        if data == "expr" and len(kids) == 3:
            c, a, b = (self.ev(k) for k in kids)
            size = max(self.size(a), self.size(b))
            return _X(_add(c.cost, max(a.cost, b.cost)), a.kind or b.kind, size=size)
        if data in ("conditionalor", "conditionaland") and binary:
            return _X(_add(self.ev(kids[0]).cost, self.ev(kids[1]).cost), "bool")
        if data == "relation" and binary:
            return self.relation(str(kids[0].data), self.ev(kids[0].children[0]), self.ev(kids[1]))
        if data == "addition" and binary:
            return self.addition(self.ev(kids[0].children[0]), self.ev(kids[1]))
        if data == "multiplication" and binary:
            a, b = self.ev(kids[0].children[0]), self.ev(kids[1])
            return _X(_add(1, a.cost, b.cost), a.kind or b.kind)
        if data == "unary" and binary:
            x = self.ev(kids[1])
            return _X(_add(1, x.cost), "bool" if str(kids[0].data) == "unary_not" else x.kind)
        handler = {
            "member_dot": self.select,
            "member_dot_arg": self.method,
            "member_index": self.index,
            "ident_arg": self.call,
            "list_lit": self.list_lit,
            "map_lit": self.map_lit,
        }.get(data)
        if handler is not None:
            return handler(kids)
        if data in ("ident", "dot_ident"):
            return self.ident(str(kids[0]))
        if data == "literal":
            return self.literal(str(kids[0]))
        if data == "member_object":
            inits = [k for k in (kids[1].children if len(kids) > 1 else []) if hasattr(k, "data")]
            return _X(_add(40, *(self.ev(k).cost for k in inits)))
        if len(kids) == 1:
            return self.ev(kids[0])
        return _X(_add(*(self.ev(k).cost for k in kids)))

    def select(self, kids: list[Any]) -> _X:
        o = self.ev(kids[0])
        extra = 1 if o.kind in ("object", "map", None) else 0
        path = (*o.path, str(kids[1])) if o.path else ()
        found = self.decl_at(path)
        return _X(_add(o.cost, extra), found.kind if found else None, path)

    def index(self, kids: list[Any]) -> _X:
        o, i = self.ev(kids[0]), self.ev(kids[1])
        path = (*o.path, "@items" if o.kind == "list" else "@values") if o.path else ()
        found = self.decl_at(path)
        return _X(_add(1, o.cost, i.cost), found.kind if found else None, path)

    def list_lit(self, kids: list[Any]) -> _X:
        elems = [self.ev(k) for k in (kids[0].children if kids else [])]
        entry = max((self.size(e) for e in elems), default=0)
        return _X(_add(10, *(e.cost for e in elems)), "list", size=len(elems), entry=entry)

    def map_lit(self, kids: list[Any]) -> _X:
        inits = kids[0].children if kids else []
        return _X(_add(30, *(self.ev(k).cost for k in inits)), "map", size=len(inits) // 2)

    def ident(self, name: str) -> _X:
        if self.vars.get(name):
            var = self.vars[name][-1]
            return _X(1, var.kind, var.path, var_size=var.var_size)
        return _X(1, self.root.kind if name == "self" else None, (name,))

    def literal(self, text: str) -> _X:
        if text in ("true", "false"):
            return _X(0, "bool", size=1)
        if text == "null":
            return _X(0, "null", size=1)
        quoted = _QUOTED.match(text)
        if quoted:
            body = quoted.group(3)
            if "r" not in quoted.group(1).lower():
                body = _ESCAPE.sub("_", body)
            return _X(0, "bytes" if "b" in quoted.group(1).lower() else "string", size=len(body))
        if text.endswith(("u", "U")):
            return _X(0, "uint", size=1)
        is_double = bool(re.search(r"[.eE]", text)) and not text.lower().startswith("0x")
        return _X(0, "double" if is_double else "int", size=1)

    def relation(self, op: str, a: _X, b: _X) -> _X:
        sized = op in ("relation_eq", "relation_ne") or (
            op in ("relation_lt", "relation_le", "relation_gt", "relation_ge")
            and bool({a.kind, b.kind} & {"string", "bytes"})
        )
        if sized:
            smallest = min(self.size(a), self.size(b))
            return _X(_add(_factor(smallest, 0.1), a.cost, b.cost), "bool")
        if op == "relation_in" and b.kind not in ("map", "object"):
            return _X(_add(self.size(b), a.cost, b.cost), "bool")
        return _X(_add(1, a.cost, b.cost), "bool")

    def addition(self, a: _X, b: _X) -> _X:
        if "string" in (a.kind, b.kind):
            total = _add(self.size(a), self.size(b))
            return _X(_add(_factor(total, 0.1), a.cost, b.cost), "string", size=total)
        if "list" in (a.kind, b.kind):
            total = _add(self.size(a), self.size(b))
            return _X(_add(1, a.cost, b.cost), "list", size=total)
        return _X(_add(1, a.cost, b.cost), a.kind or b.kind)

    def call(self, kids: list[Any]) -> _X:
        name = str(kids[0])
        arg_nodes = list(kids[1].children) if len(kids) > 1 else []
        if name == "has" and arg_nodes:
            inner = _outer_select(arg_nodes[0])
            if inner is not None:  # a presence test costs its operand only
                return _X(self.ev(inner.children[0]).cost, "bool")
        args = [self.ev(a) for a in arg_nodes]
        costs = [a.cost for a in args]
        if name == "dyn" and args:
            return _X(_add(1, costs[0]), args[0].kind, args[0].path, args[0].size)
        if name == "matches" and len(args) == 2:
            return _X(_add(self.matches(args[0], args[1]), *costs), "bool")
        return _X(_add(1, *costs), _KINDS.get(name))

    def matches(self, target: _X, regex: _X) -> int:
        text = _factor(_add(self.size(target), 1), 0.1)
        return _mul(text, _factor(self.size(regex), 0.25))

    def method(self, kids: list[Any]) -> _X:
        name = str(kids[1])
        arg_nodes = list(kids[2].children) if len(kids) > 2 else []
        var = _ident(arg_nodes[0]) if name in _MACROS and len(arg_nodes) >= 2 else None
        if var:
            return self.macro(name, kids[0], var, arg_nodes[1:])
        target = self.ev(kids[0])
        args = [self.ev(a) for a in arg_nodes]
        size = self.size(target)
        kind: str | None = _KINDS.get(name)
        out_size: int | None = None
        if name in ("matches", "find", "findAll") and args:
            cost, kind = self.matches(target, args[0]), "bool" if name == "matches" else None
        elif name == "contains" and args:
            cost, kind = _mul(_factor(size, 0.1), _factor(self.size(args[0]), 0.1)), "bool"
        elif name in ("startsWith", "endsWith") and args:
            cost, kind = _factor(self.size(args[0]), 0.1), "bool"
        elif name in ("lowerAscii", "upperAscii", "substring", "trim"):
            cost, kind, out_size = _factor(size, 0.1), "string", size
        elif name in ("replace", "split"):
            cost = _factor(size, 0.2)
        elif name in ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf"):
            cost = self.list_scan(target, size)
        else:
            cost = 1
        return _X(_add(target.cost, cost, *(a.cost for a in args)), kind, size=out_size)

    def list_scan(self, target: _X, size: int) -> int:
        found = self.decl_at(target.path)
        if target.kind != "list" and (found is None or found.kind != "list"):
            return _factor(size, 0.1)
        element = 1
        if found is not None and found.elem is not None and found.elem.kind in ("string", "bytes"):
            element = _add(1, _factor(found.elem.max_elements, 0.1))
        return _mul(size, element)

    def macro(self, name: str, target_node: Any, var: str, bodies: list[Any]) -> _X:
        """A comprehension: range + init + result + size x (loop condition + step)."""
        rng = self.ev(target_node)
        count = self.size(rng)
        step = "@keys" if rng.kind == "map" else "@items"
        path = (*rng.path, step) if rng.path else ()
        found = self.decl_at(path)
        self.vars.setdefault(var, []).append(
            _X(0, found.kind if found else None, path, var_size=rng.entry)
        )
        try:
            costs = [self.ev(b).cost for b in bodies]
        finally:
            self.vars[var].pop()
        body = costs[0] if costs else 0
        if name == "all":
            per, init, result = _add(3, body), 0, 1
        elif name == "exists":
            per, init, result = _add(4, body), 0, 1
        elif name == "exists_one":
            per, init, result = _add(2, body), 0, 2
        elif name == "filter":
            per, init, result = _add(body, 13), 10, 1
        elif len(costs) == 2:  # map(x, filter, transform)
            per, init, result = _add(costs[0], max(_add(12, costs[1]), 1)), 10, 1
        else:
            per, init, result = _add(12, body), 10, 1
        is_list = name in ("map", "filter")
        total = _add(rng.cost, init, result, _mul(count, per))
        return _X(total, "list" if is_list else "bool", size=count if is_list else None)


def rule_cost(expr: str, s: Schema, root: bool = False) -> int:
    """The server's estimated maximum cost of one evaluation of ``expr`` on node ``s``."""
    node = decl(s, root)
    if node is None:
        return 0
    try:
        tree = celpy.Environment().compile(expr)
    except Exception:  # a syntax error is reported on its own
        return 0
    return _Coster(node).ev(tree).cost


def max_cardinality(s: Schema, root: bool = False) -> int:
    """How often a rule on ``s`` can run under an unbounded list or map: as many times as
    its smallest JSON form (plus a comma) fits in a request."""
    node = decl(s, root)
    least = node.min_size if node is not None else 0
    return MAX_REQUEST_BYTES // (least + 1)


# ---------------------------------------------------------------------------- defaulting
_SCHEMA_KEYS = frozenset(
    [
        "id",
        "$schema",
        "$ref",
        "description",
        "type",
        "format",
        "title",
        "default",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "maxItems",
        "minItems",
        "uniqueItems",
        "multipleOf",
        "enum",
        "maxProperties",
        "minProperties",
        "required",
        "items",
        "allOf",
        "oneOf",
        "anyOf",
        "not",
        "properties",
        "additionalProperties",
        "patternProperties",
        "dependencies",
        "additionalItems",
        "definitions",
        "externalDocs",
        "example",
        "nullable",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-embedded-resource",
        "x-kubernetes-int-or-string",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-list-type",
        "x-kubernetes-map-type",
        "x-kubernetes-validations",
    ]
)


def crd_defaults(crd: Mapping[str, Any]) -> dict[str, Any]:
    """What the server fills in (singular and list kind, conversion ``None``) and drops
    (schema keywords it does not know, such as a misspelt ``x-kubernetes-validation``)."""
    out = copy.deepcopy(dict(crd))
    spec = out.setdefault("spec", {})
    names = spec.setdefault("names", {})
    if names.get("kind"):
        names.setdefault("singular", str(names["kind"]).lower())
        names.setdefault("listKind", f"{names['kind']}List")
    spec.setdefault("conversion", {"strategy": "None"})
    for version in spec.get("versions") or []:
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if isinstance(schema, dict):
            _drop_unknown_keywords(schema)
    return out


def _drop_unknown_keywords(s: dict[str, Any]) -> None:
    for k in [k for k in s if k not in _SCHEMA_KEYS]:
        del s[k]
    for k in ("properties", "patternProperties", "definitions"):
        for sub in (s.get(k) or {}).values():
            if isinstance(sub, dict):
                _drop_unknown_keywords(sub)
    for k in ("items", "additionalProperties", "not", "additionalItems"):
        if isinstance(s.get(k), dict):
            _drop_unknown_keywords(s[k])
    for k in ("allOf", "anyOf", "oneOf"):
        for sub in s.get(k) or []:
            if isinstance(sub, dict):
                _drop_unknown_keywords(sub)

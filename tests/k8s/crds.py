"""What the API server checks when a CustomResourceDefinition is created, with its
field paths and wording (each error as the server prints it, Go structs included): a
CRD the server would refuse must be refused here too.

A single-version CRD (or one whose versions share a schema) is checked as the server's
internal form holds it: the schema at ``spec.validation.openAPIV3Schema`` and the
printer columns at ``spec.additionalPrinterColumns``; versions with schemas of their
own at ``spec.versions[i].schema.openAPIV3Schema``. Checked, in the server's order:
``metadata.name`` is ``<plural>.<group>``; the group has a dot; the scope; version
names; exactly one storage version; names and short names are DNS-1035 labels; printer
column types, formats and JSON paths; each schema (:mod:`k8s.crd_schema`).

Unknown schema keywords are dropped, as the server's decoder drops them (a misspelt
``x-kubernetes-validation`` is silently no rule). Not emulated: conversion webhooks,
selectable fields, ``deprecationWarning``, ``oldSelf``/ratcheting; the schema's
modules list what else of their part is not.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from k8s.crd_schema import schema_causes
from k8s.fielderrors import Cause, invalid, invalid_raw, not_supported, required
from k8s.go import SCHEMA_FIELDS, go_json, go_schema

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_COLUMN_TYPES = "boolean,date,integer,number,string"
_COLUMN_FORMATS = ("byte", "date", "date-time", "double", "float", "int32", "int64", "password")
#: What the server's decoder keeps of a schema node: the fields of ``JSONSchemaProps``.
_SCHEMA_KEYS = frozenset(k for _, k, _ in SCHEMA_FIELDS)


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

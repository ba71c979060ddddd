"""The OpenAPI rules a CRD's schema must follow, checked when the CRD is created (the
server's ``ValidateCustomResourceDefinitionOpenAPISchema``): supported types, no
``uniqueItems``, ``properties`` or ``additionalProperties`` (not both), no defaults in
``metadata``, ``x-kubernetes-list-type``/``-list-map-keys``/``-map-type`` consistency
(map keys scalar, required or defaulted), and the ``x-kubernetes-validations`` at each
node (:mod:`k8s.crd_rules`), whose cost depends on how often the walk down the schema
found the node can occur.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from k8s.cel.cost import cardinality_below
from k8s.crd_rules import rule_causes, rule_field_causes
from k8s.fielderrors import (
    Cause,
    forbidden,
    invalid,
    key,
    not_supported,
    required,
    required_or_invalid,
)
from k8s.nodes import META_FIELDS, Schema, items, props

_TYPES = ("array", "boolean", "integer", "number", "object", "string")


@dataclass
class Walk:
    """What ``ValidateCustomResourceDefinitionOpenAPISchema`` carries down the schema:
    whether rules are compiled at all (the schema is structural and its defaults are
    valid), and each rule's estimated cost."""

    compile_rules: bool
    costs: list[tuple[str, int]] = field(default_factory=list)


def openapi_schema_causes(
    s: Schema,
    path: str,
    walk: Walk,
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
        inner = cardinality_below(s, cardinality) if sub_rules else None
        sub_errors, sub_cel = openapi_schema_causes(
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
        if (root or s.get("x-kubernetes-embedded-resource")) and k in META_FIELDS:
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
    errors.extend(rule_field_causes(s, path))
    if s.get("x-kubernetes-validations") and not errors and walk.compile_rules and rules:
        is_root = root or bool(s.get("x-kubernetes-embedded-resource"))
        cel.extend(rule_causes(s, path, walk.costs, cardinality, is_root))
    return errors, cel


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
        detail = "must be object if x-kubernetes-map-type is specified"
        out.append(required_or_invalid(f"{path}.type", t, detail))
    if map_type is not None and map_type not in ("atomic", "granular"):
        out.append(not_supported(f"{path}.x-kubernetes-map-type", map_type, ["atomic", "granular"]))
    list_type = s.get("x-kubernetes-list-type")
    sub = items(s)
    if list_type is not None and t != "array":
        detail = "must be array if x-kubernetes-list-type is specified"
        out.append(required_or_invalid(f"{path}.type", t, detail))
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

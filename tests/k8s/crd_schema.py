"""One version's ``openAPIV3Schema`` checked when the CRD is created, in the server's
order: with a status subresource only some keywords at the root; the structural schema
rules (:mod:`k8s.structural`), and only if they hold, the defaults
(:mod:`k8s.defaults`); the OpenAPI rules with the CEL rules (:mod:`k8s.crd_openapi`);
last, all rules' estimated cost against the schema's budget.
"""

from __future__ import annotations

from k8s.cel.cost import MAX_U64, SCHEMA_COST_LIMIT, cost_message
from k8s.crd_openapi import Walk, openapi_schema_causes
from k8s.defaults import default_causes
from k8s.fielderrors import Cause, forbidden, invalid
from k8s.go import SCHEMA_FIELDS, go_schema
from k8s.nodes import Schema
from k8s.structural import structural_causes, unsupported_keyword

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
_ROOT_FIELD_NAMES = "[" + " ".join(name for name, k, _ in SCHEMA_FIELDS if k in _ROOT_KEYS) + "]"


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
    unsupported = unsupported_keyword(schema)
    structural = structural_causes(schema, path) if unsupported is None else []
    defaults: list[Cause] = []
    if unsupported is None and not structural:
        defaults = default_causes(schema, path)
    out.extend(structural or defaults)
    walk = Walk(compile_rules=unsupported is None and not structural and not defaults)
    schema_errors, cel_errors = openapi_schema_causes(schema, path, walk, root=True)
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
        out.append(forbidden(path, cost_message(what, total, SCHEMA_COST_LIMIT)))
    return out

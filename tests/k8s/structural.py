"""Whether a CRD's schema is structural, checked when the CRD is created (the server's
``NewStructural`` and ``ValidateStructural``): custom resources can be pruned, defaulted
and validated only against a schema that says what every node is.

Checked: none of the keywords a structural schema never has; every node has a ``type``
(unless ``x-kubernetes-int-or-string`` or ``x-kubernetes-preserve-unknown-fields``),
arrays have ``items``, no ``additionalProperties`` at the root, the root's ``metadata``
may restrict only ``name`` and ``generateName``, nothing inside ``anyOf``/``allOf``/
``oneOf``/``not`` but value validations (no ``type``, ``default``, ``description``,
``x-kubernetes-*``, ``metadata``), what they constrain is declared outside them too,
patterns compile (Go's wording for the common mistakes); errors sorted, as the server
sorts them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from k8s.fielderrors import Cause, forbidden, invalid, key, required, required_or_invalid
from k8s.go import regexp_error
from k8s.nodes import Schema, items, props


def unsupported_keyword(s: Any) -> str | None:
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
        problem = unsupported_keyword(sub)
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
        detail = "must be object if x-kubernetes-embedded-resource is true"
        out.append(required_or_invalid(f"{path}.type", t, detail))
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
    ("type", "must be empty to be structural"),
    ("additionalProperties", "must be undefined to be structural"),
    ("default", "must be undefined to be structural"),
    ("title", "must be empty to be structural"),
    ("description", "must be empty to be structural"),
    ("nullable", "must be false to be structural"),
    ("x-kubernetes-preserve-unknown-fields", "must be false to be structural"),
    ("x-kubernetes-embedded-resource", "must be false to be structural"),
    ("x-kubernetes-int-or-string", "must be false to be structural"),
    ("x-kubernetes-list-map-keys", "must be empty to be structural"),
    ("x-kubernetes-list-type", "must be undefined to be structural"),
    ("x-kubernetes-map-type", "must be undefined to be structural"),
    ("x-kubernetes-validations", "must be empty to be structural"),
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
    for k, detail in _NESTED_FORBIDDEN:
        if s.get(k) not in (None, False, "", []):
            out.append(forbidden(f"{path}.{k}", detail))
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

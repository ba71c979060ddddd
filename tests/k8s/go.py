"""Values as Go prints them in the API server's errors (``fmt``, ``strconv``,
``encoding/json``, the CRD's internal structs, ``regexp``'s messages): a message matches
a real server's only if every value in it is spelt the Go way."""

from __future__ import annotations

import decimal
import json
import math
import re
from collections.abc import Mapping
from typing import Any


def go_float(x: float) -> str:
    """``fmt``'s ``%v`` of a float64: shortest digits, exponent form from 1e+06 and below 1e-04."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "-0" if math.copysign(1, x) < 0 else "0"
    digits, point = _shortest(x)
    exp = point - 1
    sign = "-" if x < 0 else ""
    if exp < -4 or exp >= 21 or exp >= 6:
        mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mant}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return sign + _plain(digits, point)


def _shortest(x: float) -> tuple[str, int]:
    """The shortest round-trip digits of ``|x|`` and where the decimal point goes."""
    tup = decimal.Decimal(repr(abs(x))).as_tuple()
    digits = "".join(map(str, tup.digits))
    point = len(digits) + int(tup.exponent)
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    return stripped.rstrip("0") or "0", point


def _plain(digits: str, point: int) -> str:
    if point <= 0:
        return "0." + "0" * -point + digits
    if point >= len(digits):
        return digits + "0" * (point - len(digits))
    return digits[:point] + "." + digits[point:]


def _json_float(x: float) -> str:
    """``encoding/json``'s float64: plain between 1e-6 and 1e21, else ``1e+21``/``1e-7``."""
    if x == 0:
        return "0" if math.copysign(1, x) > 0 else "-0"
    digits, point = _shortest(x)
    sign = "-" if x < 0 else ""
    if 1e-6 <= abs(x) < 1e21:
        return sign + _plain(digits, point)
    exp = point - 1
    mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    width = "02d" if exp >= 0 else "d"
    return f"{sign}{mant}e{'-' if exp < 0 else '+'}{abs(exp):{width}}"


def go_quote(s: str) -> str:
    """``strconv.Quote``."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(ch)])
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join([*out, '"'])


def go_json(value: Any) -> str:
    """``encoding/json``'s ``Marshal`` of a decoded JSON value: sorted keys, no spaces,
    ``<``, ``>`` and ``&`` escaped."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
            text = text.replace(ch, esc)
        return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    if isinstance(value, Mapping):
        items = (f"{go_json(str(k))}:{go_json(v)}" for k, v in sorted(value.items()))
        return "{" + ",".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    return go_json(str(value))


def go_value(value: Any) -> str:
    """How a field error prints its bad value: ``%v`` for numbers and booleans, ``%q``
    for strings, JSON for the rest (which is ``%v`` for booleans and integers too)."""
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, str):
        return go_quote(value)
    return go_json(value)


# ---------------------------------------------------------------------------- the CRD's structs
#: ``JSONSchemaProps``' fields: Go name, JSON key, how it prints. The server's decoder
#: keeps only these keys.
SCHEMA_FIELDS = (
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
    for name, k, kind in SCHEMA_FIELDS:
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
            text = "null" if not v else "[" + ",".join(rule_value(r) for r in v) + "]"
        else:
            text = go_json(v)
        parts.append(f'"{name}":{text}')
    return "{" + ",".join(parts) + "}"


def rule_value(rule: Mapping[str, Any]) -> str:
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


# ---------------------------------------------------------------------------- regexp
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

"""A CRD's ``openAPIV3Schema`` applied as the API server applies it to custom resources.

In the API server's order: pruning of unknown fields (unless
``x-kubernetes-preserve-unknown-fields``) and of non-nullable nulls without a default,
defaulting (a default is copied in, then defaulted itself), then validation:

- the OpenAPI keywords, ported from the server's validator (``kube-openapi``) so that
  each problem carries the server's field path, value and wording (``in body should
  be less than or equal to …``, ``Too long: may not be more than N bytes``, ``Too
  many: N: must have at most M items``, type errors as ``Invalid value: "string": …``,
  anyOf/oneOf/allOf/not failures under the field ``<nil>``);
- ``x-kubernetes-list-type: map|set`` uniqueness (``Duplicate value: {"name":"t0"}``);
- ``x-kubernetes-validations`` CEL rules (``cel-python``), skipped as on the server
  when the object already has a Required, Unsupported, Too long, Too many or type
  error (a ``<nil>`` cause then says so, if the schema has rules at all); an
  evaluation error is ``Invalid value: "<type>": <error> evaluating rule: …``; ``self``
  is typed by the schema (numbers are doubles, ``date-time`` strings
  timestamps), at the root it sees only ``metadata.name``/``generateName``; a missing
  field is ``no such key: X evaluating rule: …``; ``fieldPath``, ``reason`` and
  ``messageExpression`` are honoured; a failed rule on an object or list names no
  value (``Invalid value: MESSAGE``), on a scalar the value; a root rule's field is
  ``<nil>``.

A write to the status subresource is checked against the status schema, whose messages
name fields relative to ``status`` (``count in body should be …``), as the server's are.

Not emulated: ``oldSelf`` (transition rules are skipped) and ratcheting (an update is
checked like a create), the runtime CEL cost budget, the ``float`` format range and
string formats other than ``date-time`` and ``date``, which of several failing anyOf
branches is reported (the server picks by a match count); sibling errors come in schema
order where the server's order is a Go map's.
:mod:`k8s.crds` holds what the server checks when the CRD itself is created.
"""

from __future__ import annotations

import copy
import datetime
import decimal
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel

Schema = Mapping[str, Any]


# ---------------------------------------------------------------------------- field errors
@dataclass(frozen=True)
class Cause:
    """One field error of a 422, as the API server words it (``message`` is its body)."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class _Omit:
    """The server's ``OmitValueType``: an error that names no value."""


OMIT: Final = _Omit()
_WORDS = {
    "FieldValueNotFound": "Not found",
    "FieldValueRequired": "Required value",
    "FieldValueDuplicate": "Duplicate value",
    "FieldValueInvalid": "Invalid value",
    "FieldValueNotSupported": "Unsupported value",
    "FieldValueForbidden": "Forbidden",
    "FieldValueTooLong": "Too long",
    "FieldValueTooMany": "Too many",
    "InternalError": "Internal error",
    "FieldValueTypeInvalid": "Invalid value",
}
_NO_VALUE = ("FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong", "InternalError")


def field_error(reason: str, path: str, value: Any = OMIT, detail: str = "") -> Cause:
    """A field error rendered like the server's ``field.Error``; an empty path is ``<nil>``."""
    body = _WORDS[reason]
    if reason not in _NO_VALUE and value is not OMIT:
        body += f": {go_value(value)}"
    if detail:
        body += f": {detail}"
    return Cause(path or "<nil>", body, reason)


def invalid(path: str, value: Any, detail: str) -> Cause:
    return field_error("FieldValueInvalid", path, value, detail)


def required(path: str, detail: str = "") -> Cause:
    return field_error("FieldValueRequired", path, detail=detail)


def forbidden(path: str, detail: str) -> Cause:
    return field_error("FieldValueForbidden", path, detail=detail)


def not_supported(path: str, value: Any, supported: list[str]) -> Cause:
    detail = "supported values: " + ", ".join(go_quote(s) for s in supported) if supported else ""
    return field_error("FieldValueNotSupported", path, value, detail)


def child(path: str, name: str) -> str:
    """``field.Path.Child``: a dotted name (the empty path is the server's nil path)."""
    return f"{path}.{name}" if path else name


def key(path: str, name: str) -> str:
    """``field.Path.Key``: a map key or a property name in brackets."""
    return f"{path}[{name}]"


# ---------------------------------------------------------------------------- Go formatting
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
    for strings, JSON for the rest."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, str):
        return go_quote(value)
    return go_json(value)


# ---------------------------------------------------------------------------- schema access
def props(s: Schema | None) -> Mapping[str, Any]:
    return (s or {}).get("properties") or {}


def items(s: Schema | None) -> Schema | None:
    sub = (s or {}).get("items")
    return sub if isinstance(sub, Mapping) else None


def additional(s: Schema | None) -> Schema | None:
    """``additionalProperties`` as a schema (``true`` is the empty schema)."""
    sub = (s or {}).get("additionalProperties")
    if sub is True:
        return {}
    return sub if isinstance(sub, Mapping) else None


def _types(s: Schema) -> list[str]:
    if s.get("x-kubernetes-int-or-string"):
        return ["integer", "string"]
    return [s["type"]] if s.get("type") else []


# ---------------------------------------------------------------------------- prune, default
def prune(x: Any, s: Schema | None, path: str, dropped: list[str], root: bool = False) -> None:
    """The server's pruning, in place; ``dropped`` collects the unknown fields' paths."""
    if s is not None and s.get("x-kubernetes-preserve-unknown-fields"):
        _skip_prune(x, s, path, dropped, root)
        return
    if isinstance(x, dict):
        for k in list(x):
            sub_path = child(path, k)
            if (root or (s or {}).get("x-kubernetes-embedded-resource")) and k in _META:
                continue
            if s is not None and k in props(s):
                prune(x[k], props(s)[k], sub_path, dropped)
            elif s is not None and s.get("additionalProperties") is not None:
                extra = s["additionalProperties"]
                prune(x[k], extra if isinstance(extra, Mapping) else None, sub_path, dropped)
            else:
                dropped.append(sub_path)
                del x[k]
    elif isinstance(x, list):
        for i, v in enumerate(x):
            prune(v, items(s), f"{path}[{i}]", dropped)


def _skip_prune(x: Any, s: Schema | None, path: str, dropped: list[str], root: bool) -> None:
    if s is None:
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if (root or s.get("x-kubernetes-embedded-resource")) and k in _META:
                continue
            if k in props(s):
                prune(v, props(s)[k], child(path, k), dropped)
            elif additional(s) is not None:
                prune(v, additional(s), child(path, k), dropped)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _skip_prune(v, items(s), f"{path}[{i}]", dropped, False)


_META = ("apiVersion", "kind", "metadata")


def prune_nulls(x: Any, s: Schema | None) -> None:
    """Drop non-nullable ``null`` fields that have no default (the server does, in place)."""
    if isinstance(x, dict):
        for k in list(x):
            sub = props(s).get(k) if k in props(s) else additional(s)
            if (
                x[k] is None
                and sub is not None
                and not sub.get("nullable")
                and "default" not in sub
            ):
                del x[k]
            else:
                prune_nulls(x[k], sub)
    elif isinstance(x, list):
        for v in x:
            prune_nulls(v, items(s))


def default(x: Any, s: Schema | None) -> None:
    """The server's defaulting, in place: a missing (or non-nullable null) field with a
    ``default`` gets a copy of it, and every value is then defaulted in turn, so a
    ``default: {}`` object is filled in from its properties' own defaults."""
    if s is None:
        return
    if isinstance(x, dict):
        for k, prop in props(s).items():
            if prop.get("default") is None:
                continue
            if k not in x or (x[k] is None and not prop.get("nullable")):
                x[k] = copy.deepcopy(prop["default"])
        extra = additional(s)
        for k in x:
            if k in props(s):
                default(x[k], props(s)[k])
            elif extra is not None:
                if x[k] is None and not extra.get("nullable"):
                    x[k] = copy.deepcopy(extra.get("default"))
                default(x[k], extra)
    elif isinstance(x, list):
        sub = items(s)
        for i in range(len(x)):
            if sub is not None and x[i] is None and not sub.get("nullable"):
                x[i] = copy.deepcopy(sub.get("default"))
            default(x[i], sub)


# ---------------------------------------------------------------------------- OpenAPI validation
@dataclass
class _Err:
    """One ``kube-openapi`` validation error before it becomes a field error."""

    code: str  # required, enum, too_long, max_items, too_many_props, type, other, composite
    name: str
    message: str
    value: Any = None
    valid: Any = None
    values: list[Any] = field(default_factory=list)


@dataclass
class _Result:
    errors: list[_Err] = field(default_factory=list)
    matches: int = 0

    def merge(self, other: _Result) -> None:
        self.errors.extend(other.errors)
        self.matches += other.matches


def _in(template: str, name: str, *args: Any) -> str:
    """A ``kube-openapi`` message: ``NAME in body …`` (the root's name is empty)."""
    return template % (name, "body", *args)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _is_json_int(v: float) -> bool:
    return math.isfinite(v) and v == math.floor(v) and abs(v) < 2**53


def _num(v: float | int) -> str:
    """A bound in a message: an integer value is compared (and printed) as an int64."""
    return str(v) if isinstance(v, int) else go_float(v)


_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _check_format(fmt: str, v: str) -> bool:
    if fmt in ("date-time", "datetime"):
        return bool(_DATE_TIME.match(v))
    if fmt == "date":
        try:
            datetime.date.fromisoformat(v)
        except ValueError:
            return False
    return True


@functools.lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


_CHECKS: dict[str, tuple[Any, ...]] = {}


def _openapi(s: Schema, data: Any, path: str) -> _Result:
    """``kube-openapi``'s ``SchemaValidator.Validate``: type, anyOf/oneOf/allOf/not,
    string, format, number, array, enum and object checks, in that order (each only for
    the kinds of value it applies to)."""
    res = _Result()
    types = _types(s)
    kind = _kind(data)
    for check in _CHECKS[kind]:
        errs = check(s, types, data, kind, path)
        if errs is not None:
            if errs.errors:
                res.errors.extend(errs.errors)
            res.matches += errs.matches + 1
    res.matches += 1
    return res


def _type_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    fmt = s.get("format", "")
    if not types and not fmt:
        return None
    out = _Result()

    def fail(expected: str, actual: str) -> _Result:
        msg = _in("%s in %s must be of type %s: %s", path, expected, go_quote(actual))
        return _Result([_Err("type", path, msg, value=actual)])

    if v is None:
        if types and not s.get("nullable"):
            return fail(",".join(types), "null")
        return out
    is_float_int = kind == "number" and _is_json_int(v) and "integer" in types
    is_int_float = kind == "integer" and "number" in types
    own_format = {"integer": "int64", "number": "float64"}.get(kind, "")
    if (
        kind not in ("string", "array")
        and fmt
        and not (kind in types or own_format == fmt or is_float_int or is_int_float)
    ):
        return fail(fmt, own_format)
    if not ("number" in types or "integer" in types) and fmt and kind in ("string", "array"):
        return out
    if not (kind in types or is_float_int or is_int_float):
        return fail(",".join(types), kind)
    return out


def _props_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result:
    out = _Result()
    if s.get("anyOf"):
        best: _Result | None = None
        ok = False
        for sub in s["anyOf"]:
            r = _openapi(sub, v, path)
            if not r.errors:
                ok, best = True, r
                break
            if best is None or r.matches > best.matches:
                best = r
        if not ok:
            out.errors.append(
                _Err(
                    "composite", path, f"{go_quote(path)} must validate at least one schema (anyOf)"
                )
            )
        if best is not None:
            out.merge(best)
    if s.get("oneOf"):
        valid, best, first = 0, None, None
        for sub in s["oneOf"]:
            r = _openapi(sub, v, path)
            if not r.errors:
                valid += 1
                first = first or r
                best = None
                continue
            if valid == 0 and (best is None or r.matches > best.matches):
                best = r
        if valid != 1:
            extra = "Found none valid" if valid == 0 else f"Found {valid} valid alternatives"
            out.errors.append(
                _Err(
                    "composite",
                    path,
                    f"{go_quote(path)} must validate one and only one schema (oneOf). {extra}",
                )
            )
            if best is not None:
                out.merge(best)
        elif first is not None:
            out.merge(first)
    if s.get("allOf"):
        valid = 0
        for sub in s["allOf"]:
            r = _openapi(sub, v, path)
            valid += not r.errors
            out.merge(r)
        if valid != len(s["allOf"]):
            extra = ". None validated" if valid == 0 else ""
            out.errors.append(
                _Err(
                    "composite",
                    path,
                    f"{go_quote(path)} must validate all the schemas (allOf){extra}",
                )
            )
    if isinstance(s.get("not"), Mapping) and not _openapi(s["not"], v, path).errors:
        out.errors.append(
            _Err("composite", path, f"{go_quote(path)} must not validate the schema (not)")
        )
    return out


def _string_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    if kind != "string":
        return None
    n = len(v)
    if "maxLength" in s and n > s["maxLength"]:
        msg = _in("%s in %s should be at most %d chars long", path, s["maxLength"])
        return _Result([_Err("too_long", path, msg, value=v, valid=s["maxLength"])])
    if "minLength" in s and n < s["minLength"]:
        msg = _in("%s in %s should be at least %d chars long", path, s["minLength"])
        return _Result([_Err("other", path, msg, value=v)])
    if s.get("pattern") and not _regex(s["pattern"]).search(v):
        msg = _in("%s in %s should match '%s'", path, s["pattern"])
        return _Result([_Err("other", path, msg, value=v)])
    return _Result()


def _format_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    fmt = s.get("format")
    if kind != "string" or not fmt:
        return None
    if types not in ([], ["string"]) or _check_format(fmt, v):
        return _Result()
    msg = _in("%s in %s must be of type %s: %s", path, fmt, go_quote(v))
    return _Result([_Err("type", path, msg, value=v)])


def _number_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    if kind not in ("integer", "number"):
        return None
    out = _Result()
    is_int = kind == "integer"
    if types == ["integer"] and not _fits_int(v, s.get("format", "")):
        fmt = s.get("format") if s.get("format") in ("int32", "int64") else ""
        shape = f"with format {fmt}" if fmt else "(default format)"
        msg = f"Checked value must be of type integer {shape} in {path}"
        out.errors.append(_Err("composite", path, msg))
    if s.get("multipleOf") is not None:
        factor = s["multipleOf"]
        if is_int and float(factor) == int(factor):
            if v % int(factor):
                msg = _in("%s in %s should be a multiple of %s", path, int(factor))
                out.errors.append(_Err("other", path, msg, value=v))
        else:
            mult = (1 / factor * v) if factor < 1 else v / factor
            if not _is_json_int(mult):
                msg = _in("%s in %s should be a multiple of %s", path, go_float(float(factor)))
                out.errors.append(_Err("other", path, msg, value=v))
    for bound, excl, word in (
        ("minimum", "exclusiveMinimum", "greater"),
        ("maximum", "exclusiveMaximum", "less"),
    ):
        if s.get(bound) is None:
            continue
        limit = int(s[bound]) if is_int else float(s[bound])
        exclusive = bool(s.get(excl))
        beyond = v < limit if word == "greater" else v > limit
        if beyond or (exclusive and v == limit):
            rel = f"{word} than" if exclusive else f"{word} than or equal to"
            msg = _in("%s in %s should be %s %s", path, rel, _num(limit))
            out.errors.append(_Err("other", path, msg, value=v))
    return out


def _fits_int(v: float, fmt: str) -> bool:
    """Whether a float's shortest decimal form parses as the integer format (int64 unless
    ``int32``), as the server's range check parses it."""
    if not math.isfinite(v) or v != math.floor(v):
        return False
    bits = 31 if fmt == "int32" else 63
    return bool(-(2**bits) <= int(v) < 2**bits)


def _array_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    if kind != "array":
        return None
    out = _Result()
    sub = items(s)
    if sub is not None:
        for i, item in enumerate(v):
            out.merge(_openapi(sub, item, f"{path}[{i}]"))
    if "minItems" in s and len(v) < s["minItems"]:
        msg = _in("%s in %s should have at least %d items", path, s["minItems"])
        out.errors.append(_Err("other", path, msg, value=len(v)))
    if "maxItems" in s and len(v) > s["maxItems"]:
        msg = _in("%s in %s should have at most %d items", path, s["maxItems"])
        out.errors.append(_Err("max_items", path, msg, value=len(v), valid=s["maxItems"]))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _enum_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    if "enum" not in s:
        return _Result()
    if any(_same(v, e) for e in s["enum"]):
        return _Result()
    msg = _in("%s in %s should be one of %s", path, s["enum"])
    return _Result([_Err("enum", path, msg, value=v, values=list(s["enum"]))])


def _object_check(s: Schema, types: list[str], v: Any, kind: str, path: str) -> _Result | None:
    if kind != "object":
        return None
    out = _Result()
    n = len(v)
    if "minProperties" in s and n < s["minProperties"]:
        msg = _in("%s in %s should have at least %d properties", path, s["minProperties"])
        out.errors.append(_Err("other", path, msg, value=n))
    if "maxProperties" in s and n > s["maxProperties"]:
        msg = _in("%s in %s should have at most %d properties", path, s["maxProperties"])
        out.errors.append(_Err("too_many_props", path, msg, value=n, valid=s["maxProperties"]))
    extra = s.get("additionalProperties")
    if extra is False:
        for k in v:
            if k not in props(s):
                msg = _in("%s.%s in %s is a forbidden property", path, k)
                out.errors.append(_Err("other", f"{path}.{k}", msg))
    elif isinstance(extra, Mapping):
        for k, value in v.items():
            if k not in props(s):
                out.merge(_openapi(extra, value, f"{path}.{k}"))
    for name, sub in props(s).items():
        if name in v:
            out.merge(_openapi(sub, v[name], f"{path}.{name}" if path else name))
    for name in s.get("required") or []:
        if name not in v:
            out.errors.append(_Err("required", f"{path}.{name}", ""))
    return out


_ALL_CHECKS = (_type_check, _props_check, _string_check, _format_check, _number_check)
_CHECKS.update(
    {
        "null": (_type_check, _enum_check),
        "string": (*_ALL_CHECKS, _enum_check),
        "integer": (_type_check, _props_check, _number_check, _enum_check),
        "number": (_type_check, _props_check, _number_check, _enum_check),
        "boolean": (_type_check, _props_check, _enum_check),
        "array": (_type_check, _props_check, _array_check, _enum_check),
        "object": (_type_check, _props_check, _enum_check, _object_check),
    }
)


def openapi_causes(s: Schema, value: Any, fld_path: str = "") -> list[Cause]:
    """``ValidateCustomResource``: the OpenAPI errors of ``value`` as field errors under
    ``fld_path`` (empty for a custom resource, whose composite errors are then ``<nil>``)."""
    out = []
    for err in _openapi(s, value, "").errors:
        name = err.name.removeprefix(".") if err.name not in ("", ".") else ""
        at = child(fld_path, name) if name else fld_path
        value_or_empty = "" if err.value is None else err.value
        if err.code == "required":
            out.append(required(at))
        elif err.code == "enum":
            allowed = [e if isinstance(e, str) else go_json(e) for e in err.values]
            out.append(not_supported(at, err.value, allowed))
        elif err.code == "too_long":
            unit = "byte" if err.valid == 1 else "bytes"
            detail = f"may not be more than {err.valid} {unit}"
            out.append(field_error("FieldValueTooLong", at, detail=detail))
        elif err.code in ("max_items", "too_many_props"):
            unit = "item" if err.valid == 1 else "items"
            detail = f"must have at most {err.valid} {unit}"
            out.append(field_error("FieldValueTooMany", at, err.value, detail))
        elif err.code == "type":
            out.append(field_error("FieldValueTypeInvalid", at, value_or_empty, err.message))
        elif err.code == "composite":
            out.append(invalid(fld_path, "", err.message))
        else:
            out.append(invalid(at, value_or_empty, err.message))
    return out


# ---------------------------------------------------------------------------- list types
def list_type_causes(s: Schema | None, x: Any, path: str) -> list[Cause]:
    """``x-kubernetes-list-type`` ``set`` and ``map`` uniqueness, everywhere in ``x``."""
    out: list[Cause] = []
    if isinstance(x, dict):
        for k, v in x.items():
            if k in props(s):
                out.extend(list_type_causes(props(s)[k], v, child(path, k)))
            elif additional(s) is not None:
                out.extend(list_type_causes(additional(s), v, key(path, k)))
    elif isinstance(x, list) and s is not None:
        kind = s.get("x-kubernetes-list-type")
        if kind == "set":
            out.extend(_duplicates(path, x, x))
        elif kind == "map":
            out.extend(_map_duplicates(s, path, x))
        for i, v in enumerate(x):
            out.extend(list_type_causes(items(s), v, f"{path}[{i}]"))
    return out


def _duplicates(path: str, keys: list[Any], shown: list[Any]) -> list[Cause]:
    seen: dict[str, int] = {}
    out = []
    for i, k in enumerate(keys):
        token = go_json(k) + _kind(k)
        seen[token] = seen.get(token, 0) + 1
        if seen[token] == 2:
            out.append(field_error("FieldValueDuplicate", f"{path}[{i}]", shown[i]))
    return out


def _map_duplicates(s: Schema, path: str, x: list[Any]) -> list[Cause]:
    for i, item in enumerate(x):
        if item is not None and not isinstance(item, dict):
            return [
                invalid(f"{path}[{i}]", item, "must be an object for an array of list-type map")
            ]
    names = s.get("x-kubernetes-list-map-keys") or []
    keys = [{k: item[k] for k in names if k in item} for item in (i or {} for i in x)]
    if len(x) <= 1:
        return []
    return _duplicates(path, keys, keys)


# ---------------------------------------------------------------------------- CEL
@functools.lru_cache(maxsize=512)
def _cel_program(expr: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expr))


def compile_rule(rule: str) -> str | None:
    """``None`` when the CEL expression parses, else the parser's message."""
    try:
        _cel_program(rule)
    except Exception as err:  # cel-python raises its own parser errors
        return str(err).splitlines()[0]
    return None


def to_cel(value: Any, s: Schema | None) -> Any:
    """A JSON value as the server hands it to CEL, typed by its schema: ``number``
    fields are doubles even when written as integers, ``date-time`` strings timestamps."""
    if s is None or (s.get("x-kubernetes-preserve-unknown-fields") and not props(s)):
        return json_to_cel(value)
    if value is None:
        return None
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    t = s.get("type")
    if isinstance(value, (int, float)):
        if t == "number":
            return celtypes.DoubleType(float(value))
        if isinstance(value, float) and not _is_json_int(value):
            return celtypes.DoubleType(value)
        return celtypes.IntType(int(value))
    if isinstance(value, str):
        fmt = s.get("format")
        if fmt in ("date-time", "date") and _check_format(fmt, value):
            text = value if fmt == "date-time" else value + "T00:00:00Z"
            try:
                return celtypes.TimestampType(text)
            except ValueError:
                return celtypes.StringType(value)
        return celtypes.StringType(value)
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v, items(s)) for v in value])
    if isinstance(value, dict):
        return celtypes.MapType(
            {
                celtypes.StringType(k): to_cel(v, props(s)[k] if k in props(s) else additional(s))
                for k, v in value.items()
            }
        )
    return json_to_cel(value)


def _cel_error(err: Exception) -> tuple[str, bool]:
    """cel-python's evaluation error in cel-go's words, and whether it is an overload error."""
    text = str(err.args[0]) if err.args else str(err)
    cause = err.args[1] if len(err.args) > 1 else None
    detail = err.args[2] if len(err.args) > 2 else None
    if cause is KeyError or "no such member" in text or text == "no such key":
        m = re.search(r"'([^']*)'", text)
        missing = m.group(1) if m else (str(detail[0]) if isinstance(detail, tuple) else "")
        return f"no such key: {missing}", False
    if cause is ZeroDivisionError:
        words = str(detail[0]) if isinstance(detail, tuple) and detail else ""
        modulo = "modulo by zero" in words and "division" not in words
        return ("modulus by zero" if modulo else "division by zero"), False
    if cause is IndexError:
        return "index out of bounds", False
    if "overflow" in text:
        return "integer overflow", False
    if cause is TypeError or "no matching overload" in text:
        return "no such overload", True
    return text, False


def rule_string(rule: Mapping[str, Any]) -> str:
    """How the server names a rule in an error: its message, else the rule."""
    return str(rule.get("message") or "").strip() or str(rule.get("rule", "")).strip()


def normalize_field_path(field_path: str) -> str:
    """A rule's ``fieldPath`` (``.a.b``, ``.a['k']``) as the field path it names."""
    out = ""
    for m in re.finditer(r"\.([^.\[]+)|\[\s*'((?:[^'\\]|\\.)*)'\s*\]", field_path):
        out = child(out, m.group(1)) if m.group(1) is not None else key(out, m.group(2))
    return out


def cel_causes(
    s: Schema, value: Any, path: str, root: bool = False, embedded: bool = False
) -> list[Cause]:
    """Every ``x-kubernetes-validations`` rule of ``s`` and below it, against ``value``."""
    out: list[Cause] = []
    if value is None:
        return out
    rules = [r for r in s.get("x-kubernetes-validations") or [] if "oldSelf" not in r["rule"]]
    if rules:
        seen = value
        if (root or embedded) and isinstance(value, dict):
            meta = value.get("metadata") or {}
            seen = {
                **value,
                "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta},
            }
        t = s.get("type", "")
        for rule in rules:
            activation = {"self": to_cel(_needed(rule["rule"], seen), s)}
            try:
                ok = _cel_program(rule["rule"]).evaluate(activation)
            except Exception as err:  # an evaluation error is a field error on the server too
                text, overload = _cel_error(err)
                if overload:
                    detail = (
                        f"'{text}': call arguments did not match a supported operator, "
                        f"function or macro signature for rule: {rule_string(rule)}"
                    )
                else:
                    detail = f"{text} evaluating rule: {rule_string(rule)}"
                out.append(invalid(path, t, detail))
                continue
            if isinstance(ok, Exception):
                text, _ = _cel_error(ok)
                out.append(invalid(path, t, f"{text} evaluating rule: {rule_string(rule)}"))
                continue
            if ok is True or (isinstance(ok, celtypes.BoolType) and bool(ok)):
                continue
            out.append(_rule_failure(rule, s, value, path, activation))
    for sub, v, sub_path in _children(s, value, path):
        out.extend(
            cel_causes(sub, v, sub_path, embedded=bool(sub.get("x-kubernetes-embedded-resource")))
        )
    return out


def _needed(rule: str, value: Any) -> Any:
    """The part of an object a rule can read: the fields it selects from ``self`` (a field
    it only tests with ``has()`` as a placeholder), when it uses ``self`` for nothing else;
    converting thousands of table specs for a rule on ``metadata.name`` would be most of
    a write's cost."""
    fields = _self_fields(rule)
    if fields is None or not isinstance(value, dict):
        return value
    read, tested = fields
    return {k: (value[k] if k in read else False) for k in read | tested if k in value}


@functools.lru_cache(maxsize=512)
def _self_fields(rule: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """The fields of ``self`` a rule reads and those it only tests for presence, or
    ``None`` if it uses ``self`` otherwise."""
    try:
        tree = celpy.Environment().compile(rule)
    except Exception:  # the rule does not compile: evaluate it on everything
        return None
    read: set[str] = set()
    tested: set[str] = set()
    uses = 0
    presence: set[int] = set()
    for node in tree.iter_subtrees():
        if node.data == "ident_arg" and len(node.children) > 1 and str(node.children[0]) == "has":
            arg = node.children[1]
            while hasattr(arg, "children") and len(arg.children) == 1:
                arg = arg.children[0]
            if getattr(arg, "data", "") == "member_dot":
                presence.add(id(arg))
    for node in tree.iter_subtrees():
        if node.data == "ident" and node.children and str(node.children[0]) == "self":
            uses += 1
        if node.data == "member_dot" and _is_self(node.children[0]):
            (tested if id(node) in presence else read).add(str(node.children[1]))
            uses -= 1
    return (frozenset(read), frozenset(tested - read)) if uses == 0 else None


def _is_self(node: Any) -> bool:
    while hasattr(node, "children") and len(node.children) == 1:
        if getattr(node, "data", "") == "ident":
            return str(node.children[0]) == "self"
        node = node.children[0]
    return False


def _rule_failure(
    rule: Mapping[str, Any], s: Schema, value: Any, path: str, activation: dict[str, Any]
) -> Cause:
    at = path
    if rule.get("fieldPath"):
        at = child(path, normalize_field_path(str(rule["fieldPath"]).strip()))
    detail = ""
    if rule.get("messageExpression"):
        try:
            text = str(_cel_program(rule["messageExpression"]).evaluate(activation)).strip()
        except Exception:  # the server logs it and falls back to the message
            text = ""
        if text and "\n" not in text and len(text) <= 5 * 1024:
            detail = text
    if not detail:
        msg = str(rule.get("message") or "").strip()
        detail = msg or f"failed rule: {rule_string(rule)}"
    shown: Any = OMIT if s.get("type") in ("object", "array") else value
    reason = rule.get("reason")
    if reason == "FieldValueForbidden":
        return forbidden(at, detail)
    if reason == "FieldValueRequired":
        return required(at, detail)
    if reason == "FieldValueDuplicate":
        return field_error("FieldValueDuplicate", at, shown)
    return invalid(at, shown, detail)


def _children(s: Schema, obj: Any, path: str) -> Iterator[tuple[Schema, Any, str]]:
    if isinstance(obj, dict):
        extra = additional(s)
        for k, v in obj.items():
            if extra is not None and k not in props(s):
                yield extra, v, key(path, k)
        for k, v in obj.items():
            if k in props(s):
                yield props(s)[k], v, child(path, k)
    elif isinstance(obj, list) and items(s) is not None:
        sub = items(s)
        assert sub is not None
        for i, v in enumerate(obj):
            yield sub, v, f"{path}[{i}]"


def has_rules(s: Any) -> bool:
    """Whether a schema has any ``x-kubernetes-validations`` (else the server has no CEL
    validator for it, and never says that rules were not checked)."""
    if not isinstance(s, Mapping):
        return False
    if s.get("x-kubernetes-validations"):
        return True
    subs = [*props(s).values(), s.get("items"), s.get("additionalProperties")]
    return any(has_rules(sub) for sub in subs)


#: Errors after which the server does not run the CEL rules.
BLOCKING = frozenset(
    (
        "FieldValueNotSupported",
        "FieldValueRequired",
        "FieldValueTooLong",
        "FieldValueTooMany",
        "FieldValueTypeInvalid",
    )
)
NOT_CHECKED = invalid(
    "",
    None,
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation",
)


class StructuralSchema:
    """One version's ``openAPIV3Schema``: prune, default, validate a custom resource."""

    def __init__(self, schema: Schema) -> None:
        self.schema: dict[str, Any] = copy.deepcopy(dict(schema))
        self.has_rules = has_rules(self.schema)

    def default(self, obj: Any) -> Any:
        obj = copy.deepcopy(obj)
        default(obj, self.schema)
        return obj

    def prune(self, obj: Any) -> tuple[Any, list[str]]:
        """The object without unknown fields and non-nullable nulls, and the paths of the
        unknown fields (sorted, as the server reports them)."""
        obj = copy.deepcopy(obj)
        dropped: list[str] = []
        prune(obj, self.schema, "", dropped, root=True)
        prune_nulls(obj, self.schema)
        return obj, sorted(dropped)

    def admit(self, obj: Any) -> tuple[Any, list[str]]:
        """Pruned, then defaulted, as the server decodes a request body."""
        pruned, dropped = self.prune(obj)
        default(pruned, self.schema)
        return pruned, dropped

    def validate(self, obj: Any) -> list[Cause]:
        """The field errors of a (pruned, defaulted) custom resource, the server's way."""
        causes = openapi_causes(self.schema, obj)
        causes.extend(list_type_causes(self.schema, obj, ""))
        return self._with_rules(causes, obj)

    def validate_status(self, obj: Any) -> list[Cause]:
        """A write to ``/status``: its status against the status schema (whose messages
        name fields relative to ``status``), then the whole object's lists and rules."""
        causes = []
        status_schema = props(self.schema).get("status")
        if isinstance(obj, dict) and "status" in obj and status_schema is not None:
            causes = openapi_causes(status_schema, obj["status"], "status")
        causes.extend(list_type_causes(self.schema, obj, ""))
        return self._with_rules(causes, obj)

    def _with_rules(self, causes: list[Cause], obj: Any) -> list[Cause]:
        if not self.has_rules:
            return causes
        if any(c.reason in BLOCKING for c in causes):
            return [*causes, NOT_CHECKED]
        return causes + cel_causes(self.schema, obj, "", root=True)

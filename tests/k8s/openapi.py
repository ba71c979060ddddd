"""``kube-openapi``'s validator, ported so that each problem in a custom resource carries
the server's field path, value and wording (``in body should be less than or equal to
…``, ``Too long: may not be more than N bytes``, ``Too many: N: must have at most M
items``, type errors as ``Invalid value: "string": …``, anyOf/oneOf/allOf/not failures
under the field ``<nil>``).

Not emulated: the ``float`` format's range, string formats other than ``date-time`` and
``date``, which of several failing anyOf branches is reported (the server picks by a
match count); sibling errors come in schema order where the server's order is a Go
map's.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from k8s.fielderrors import Cause, child, field_error, invalid, not_supported, required
from k8s.go import go_float, go_json, go_quote
from k8s.nodes import Schema, items, props


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


def json_kind(v: Any) -> str:
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


def is_json_int(v: float) -> bool:
    return math.isfinite(v) and v == math.floor(v) and abs(v) < 2**53


def _num(v: float | int) -> str:
    """A bound in a message: an integer value is compared (and printed) as an int64."""
    return str(v) if isinstance(v, int) else go_float(v)


def _types(s: Schema) -> list[str]:
    if s.get("x-kubernetes-int-or-string"):
        return ["integer", "string"]
    return [s["type"]] if s.get("type") else []


_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def check_format(fmt: str, v: str) -> bool:
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
    kind = json_kind(data)
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
    is_float_int = kind == "number" and is_json_int(v) and "integer" in types
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
    if types not in ([], ["string"]) or check_format(fmt, v):
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
            if not is_json_int(mult):
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

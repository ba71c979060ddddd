"""``x-kubernetes-validations`` rules evaluated on a custom resource (cel-python), each
failure in the server's words: ``self`` is typed by the schema (numbers are doubles,
``date-time`` strings timestamps), at the root it sees only ``metadata.name`` and
``generateName``; an evaluation error is ``Invalid value: "<type>": <error> evaluating
rule: …``, a missing field ``no such key: X evaluating rule: …``; ``fieldPath``,
``reason`` and ``messageExpression`` are honoured; a failed rule on an object or list
names no value (``Invalid value: MESSAGE``), on a scalar the value; a root rule's field
is ``<nil>``.

Not emulated: ``oldSelf`` (transition rules are skipped), the runtime cost budget.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel

from k8s.cel.syntax import identifier, outer_select
from k8s.fielderrors import OMIT, Cause, child, field_error, forbidden, invalid, key, required
from k8s.nodes import Schema, additional, items, props
from k8s.openapi import check_format, is_json_int


@functools.lru_cache(maxsize=512)
def _cel_program(expr: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expr))


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
        if isinstance(value, float) and not is_json_int(value):
            return celtypes.DoubleType(value)
        return celtypes.IntType(int(value))
    if isinstance(value, str):
        fmt = s.get("format")
        if fmt in ("date-time", "date") and check_format(fmt, value):
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
            select = outer_select(node.children[1])
            if select is not None:
                presence.add(id(select))
    for node in tree.iter_subtrees():
        if node.data == "ident" and node.children and str(node.children[0]) == "self":
            uses += 1
        if node.data == "member_dot" and identifier(node.children[0]) == "self":
            (tested if id(node) in presence else read).add(str(node.children[1]))
            uses -= 1
    return (frozenset(read), frozenset(tested - read)) if uses == 0 else None


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

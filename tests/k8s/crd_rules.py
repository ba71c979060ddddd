"""A CRD's ``x-kubernetes-validations`` checked when the CRD is created: each entry's
fields (rule present, message and ``fieldPath`` on one line, ``reason`` supported,
``fieldPath`` a declared field); then, where nothing at or below the rule's node has a
schema error, its estimated cost times how often it can run against the per-rule budget
(:mod:`k8s.cel.cost`), and its compilation (:mod:`k8s.cel.compile`), then its
``messageExpression``'s.
"""

from __future__ import annotations

import re

from k8s.cel.compile import compile_problem
from k8s.cel.cost import MAX_U64, RULE_COST_LIMIT, cost_message, max_cardinality, rule_cost
from k8s.fielderrors import Cause, forbidden, invalid, not_supported, required
from k8s.go import rule_value
from k8s.nodes import Schema, additional, props

_REASONS = ("FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired")


def rule_field_causes(s: Schema, path: str) -> list[Cause]:
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


def rule_causes(
    s: Schema, path: str, costs: list[tuple[str, int]], cardinality: int | None, root: bool
) -> list[Cause]:
    """Each rule of a node: its estimated cost (times how often it can run) against the
    per-rule budget, then its compilation, then its messageExpression's."""
    out: list[Cause] = []
    for i, rule in enumerate(s.get("x-kubernetes-validations") or []):
        at = _path_rule(path, i)
        text = str(rule.get("rule") or "")
        if not text.strip():
            continue
        problem = compile_problem(text, s, root)
        cost = 0 if problem else rule_cost(text, s, root)
        times = cardinality if cardinality is not None else max_cardinality(s, root)
        cost = min(cost * times, MAX_U64) if cost else 0
        if cost > RULE_COST_LIMIT:
            out.append(forbidden(at, cost_message("estimated rule cost", cost, RULE_COST_LIMIT)))
        costs.append((at, cost))
        if problem == "!bool":
            out.append(
                Cause(
                    at,
                    f"Invalid value: {rule_value(rule)}: cel expression must evaluate to a bool",
                )
            )
            continue
        if problem:
            out.append(
                Cause(at, f"Invalid value: {rule_value(rule)}: compilation failed: {problem}")
            )
            continue
        expr = str(rule.get("messageExpression") or "")
        if expr.strip():
            at_expr = _path_rule(path, i, "messageExpression")
            problem = compile_problem(expr, s, root)
            if problem and problem != "!bool":
                detail = f"messageExpression compilation failed: {problem}"
                out.append(Cause(at_expr, f"Invalid value: {rule_value(rule)}: {detail}"))
                continue
            expr_cost = rule_cost(expr, s, root)
            if expr_cost > RULE_COST_LIMIT:
                what = "estimated messageExpression cost"
                out.append(forbidden(at_expr, cost_message(what, expr_cost, RULE_COST_LIMIT)))
            costs.append((at_expr, expr_cost))
    return out


def _path_rule(node_path: str, i: int, part: str = "rule") -> str:
    return f"{node_path}.x-kubernetes-validations[{i}].{part}"

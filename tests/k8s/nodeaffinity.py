"""A pod's required node affinity as kube-scheduler's NodeAffinity filter applies it,
for the scheduler stand-in (:mod:`k8s.scheduler`).

Written after the scheduler's ``nodeaffinity`` helpers rather than shared with the
operator's own reading (``shardwise.operator.cluster.node_affinity``), so that the
contract tests check each against a real cluster on their own: each term is parsed
first (a term that does not parse matches nothing, the others still may), then the
parsed terms are ORed; an absent or empty term list matches no node, and so does a term
with neither ``matchExpressions`` nor ``matchFields``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Labels = Mapping[str, str]
#: One parsed requirement: a test of (node name, node labels).
Test = Callable[[str, Labels], bool]

_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_GO_INT = re.compile(r"^[+-]?\d+$", re.ASCII)


def _parse_int(text: str) -> int | None:
    """Go's ``strconv.ParseInt(text, 10, 64)``: sign, ASCII digits, int64 range."""
    if not _GO_INT.match(text) or not -(2**63) <= int(text) < 2**63:
        return None
    return int(text)


def _valid_key(key: str) -> bool:
    parts = key.split("/")
    if len(parts) > 2 or (len(parts) == 2 and not parts[0]):
        return False
    name = parts[-1]
    prefix_ok = len(parts) == 1 or (
        len(parts[0]) <= 253
        and re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", parts[0])
        is not None
    )
    return prefix_ok and 0 < len(name) <= 63 and _VALUE.match(name) is not None


def _expression(req: Mapping[str, Any]) -> Test | None:
    """``labels.NewRequirement`` of one matchExpressions entry (``None``: it errs)."""
    key, op, values = req.get("key", ""), req.get("operator"), list(req.get("values") or [])
    if not _valid_key(key) or any(len(v) > 63 or not _VALUE.match(v) for v in values):
        return None
    if op in ("In", "NotIn"):
        if not values:
            return None
        if op == "In":
            return lambda _name, labels: key in labels and labels[key] in values
        return lambda _name, labels: key not in labels or labels[key] not in values
    if op in ("Exists", "DoesNotExist"):
        if values:
            return None
        return lambda _name, labels: (key in labels) == (op == "Exists")
    if op in ("Gt", "Lt"):
        if len(values) != 1 or (bound := _parse_int(values[0])) is None:
            return None

        def compare(_name: str, labels: Labels) -> bool:
            have = _parse_int(labels[key]) if key in labels else None
            if have is None:
                return False
            return have > bound if op == "Gt" else have < bound

        return compare
    return None


def _field(req: Mapping[str, Any]) -> Test | None:
    """One matchFields entry as a field selector over the node's fields."""
    values, op = [str(v) for v in req.get("values") or []], req.get("operator")
    if op not in ("In", "NotIn") or len(values) != 1:
        return None
    key, equal = req.get("key"), op == "In"

    def test(name: str, _labels: Labels) -> bool:
        value = name if key == "metadata.name" else ""
        return (value == values[0]) is equal

    return test


def _term(term: Mapping[str, Any]) -> list[Test] | None:
    tests = [_expression(r) for r in term.get("matchExpressions") or []]
    tests += [_field(r) for r in term.get("matchFields") or []]
    if any(t is None for t in tests):
        return None
    return [t for t in tests if t is not None]


def required_affinity_matches(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether ``node`` satisfies the pod's
    ``affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution``."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    selector = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if selector is None:
        return True
    meta = node.get("metadata") or {}
    name, labels = str(meta.get("name", "")), meta.get("labels") or {}
    for term in selector.get("nodeSelectorTerms") or []:
        if not (term.get("matchExpressions") or term.get("matchFields")):
            continue  # an empty term selects nothing
        tests = _term(term)
        if tests is not None and all(t(name, labels) for t in tests):
            return True
    return False

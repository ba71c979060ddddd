"""A pod's required node affinity, matched against a node as kube-scheduler matches it.

The operator counts the nodes a job may use (:func:`shardwise.operator.cluster.capacity.
eligible`); a pod that may land only on a GPU pool chosen by
``affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`` must be sized on
that pool alone, so the rules here are the scheduler's own (its ``nodeaffinity``
helpers and the label selector's requirements):

- the ``nodeSelectorTerms`` are ORed; none at all matches no node;
- a term matches when all its ``matchExpressions`` and all its ``matchFields`` do; a term
  with neither matches no node;
- ``In`` needs the label with one of the values; ``NotIn`` holds when the label is absent
  or has none of them; ``Exists``/``DoesNotExist`` test presence; ``Gt``/``Lt`` need the
  label, both sides read as base-10 int64 (a label that is not one fails);
- ``matchFields`` read only the node's fields (``metadata.name``), ``In``/``NotIn`` with
  exactly one value;
- a term that is malformed (an unknown operator, a wrong number of values, a bad key or
  value) matches no node; the other terms still may.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

LABEL_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
FIELD_OPERATORS = ("In", "NotIn")
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_INT = re.compile(r"^[+-]?[0-9]+$")
_INT64 = (-(2**63), 2**63 - 1)


def required(affinity: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The node selector of a pod's ``affinity`` that scheduling requires (``None``:
    the pod requires nothing of a node's labels beyond its nodeSelector)."""
    node_affinity = (affinity or {}).get("nodeAffinity") or {}
    selector = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    return selector if isinstance(selector, Mapping) else None


def matches(selector: Mapping[str, Any] | None, name: str, labels: Mapping[str, str]) -> bool:
    """Whether a node (its name and labels) satisfies a required node ``selector``
    (``None``: every node does)."""
    if selector is None:
        return True
    terms = selector.get("nodeSelectorTerms") or []
    return any(_term(t or {}, name, labels) for t in terms)


def problems(selector: Mapping[str, Any] | None, where: str) -> list[str]:
    """What the API server would refuse in ``selector`` (no terms; a malformed requirement,
    which also matches nothing), each named by its path under ``where``: for a spec check
    to say before any pod is refused."""
    if selector is None:
        return []
    terms = selector.get("nodeSelectorTerms") or []
    if not terms:
        return [f"{where}.nodeSelectorTerms: must have at least one node selector term"]
    out: list[str] = []
    for i, term in enumerate(terms):
        for section, check in (("matchExpressions", _label_problem),
                               ("matchFields", _field_problem)):  # fmt: skip
            for j, req in enumerate((term or {}).get(section) or []):
                why = check(req or {})
                if section == "matchFields" and (req or {}).get("key") != "metadata.name":
                    why = why or f"key {(req or {}).get('key')!r}: only metadata.name is a field"
                if why:
                    out.append(f"{where}.nodeSelectorTerms[{i}].{section}[{j}]: {why}")
    return out


def _term(term: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> bool:
    expressions: Sequence[Mapping[str, Any]] = term.get("matchExpressions") or []
    fields: Sequence[Mapping[str, Any]] = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    if any(_label_problem(r) for r in expressions) or any(_field_problem(r) for r in fields):
        return False
    if not all(_label_holds(r, labels) for r in expressions):
        return False
    # The scheduler reads fields only of a node that has some (every node has a name).
    return not name or all(_field_holds(r, name) for r in fields)


def _values(req: Mapping[str, Any]) -> list[str]:
    return [str(v) for v in req.get("values") or []]


def _int64(text: str) -> int | None:
    """``text`` as Go's ``strconv.ParseInt(text, 10, 64)`` reads it, or ``None``."""
    if not _INT.match(text):
        return None
    value = int(text)
    return value if _INT64[0] <= value <= _INT64[1] else None


def _key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return f"key {key!r}: the prefix part must be non-empty"
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"key {key!r}: the prefix part must be a DNS subdomain"
    if len(name) > 63 or not _NAME.match(name):
        return f"key {key!r} is not a valid label key"
    return None


def _label_problem(req: Mapping[str, Any]) -> str | None:
    op, values = req.get("operator"), _values(req)
    if op not in LABEL_OPERATORS:
        return f"operator {op!r} is not one of {', '.join(LABEL_OPERATORS)}"
    why = _key_problem(str(req.get("key", "")))
    if why:
        return why
    if op in ("In", "NotIn") and not values:
        return f"{op} needs at least one value"
    if op in ("Exists", "DoesNotExist") and values:
        return f"{op} takes no values"
    if op in ("Gt", "Lt") and (len(values) != 1 or _int64(values[0]) is None):
        return f"{op} takes exactly one value, an integer"
    bad = [v for v in values if v and (len(v) > 63 or not _NAME.match(v))]
    return f"{bad[0]!r} is not a valid label value" if bad else None


def _field_problem(req: Mapping[str, Any]) -> str | None:
    op = req.get("operator")
    if op not in FIELD_OPERATORS:
        return f"operator {op!r} is not one of {', '.join(FIELD_OPERATORS)}"
    if len(_values(req)) != 1:
        return f"{op} on a field takes exactly one value"
    return None


def _label_holds(req: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = str(req.get("key", "")), req.get("operator"), _values(req)
    present = key in labels
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op == "In":
        return present and labels[key] in values
    if op == "NotIn":
        return not present or labels[key] not in values
    if not present:  # Gt, Lt
        return False
    have, bound = _int64(labels[key]), _int64(values[0])
    if have is None or bound is None:
        return False
    return have > bound if op == "Gt" else have < bound


def _field_holds(req: Mapping[str, Any], name: str) -> bool:
    # A node's only field is metadata.name; any other reads as "" (as a fields.Set does).
    value = name if req.get("key") == "metadata.name" else ""
    wanted = _values(req)[0]
    return value == wanted if req.get("operator") == "In" else value != wanted

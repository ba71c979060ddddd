"""Label and field selectors as the API server parses them (``?labelSelector=…``).

Supported label syntax: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)`` and
``k notin (a,b)``, joined by commas — everything ``kubectl -l`` sends. Field selectors
take ``path=value`` / ``path!=value`` over dotted paths (``metadata.name``, ``status.phase``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector the API server would answer with 400 Bad Request."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.op:
            case "=" | "in":
                return present and value in self.values
            case "!=" | "notin":
                return not present or value not in self.values
            case "exists":
                return present
            case "!":
                return not present
        raise AssertionError(self.op)  # pragma: no cover


_SET = re.compile(r"^\s*(!?)([^\s!=(),]+)\s+(in|notin)\s*\(([^)]*)\)\s*$")
_EQ = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")
_EXISTS = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split(text: str) -> list[str]:
    """Split on the commas that are not inside ``( … )``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text:
        return []
    out: list[Requirement] = []
    for part in _split(text):
        if m := _SET.match(part):
            if m.group(1):
                raise SelectorError(f"unable to parse requirement: {part!r}")
            values = tuple(v.strip() for v in m.group(4).split(",") if v.strip())
            out.append(Requirement(m.group(2), m.group(3), values))
        elif m := _EQ.match(part):
            op = "!=" if m.group(2) == "!=" else "="
            out.append(Requirement(m.group(1), op, (m.group(3),)))
        elif m := _EXISTS.match(part):
            out.append(Requirement(m.group(2), "!" if m.group(1) else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return out


def labels_match(requirements: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in requirements)


@dataclass(frozen=True)
class FieldRequirement:
    path: tuple[str, ...]
    negate: bool
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        node: Any = obj
        for part in self.path:
            node = node.get(part) if isinstance(node, Mapping) else None
        actual = "" if node is None else str(node)
        return (actual == self.value) != self.negate


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    if not text:
        return []
    out = []
    for part in _split(text):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if m is None:
            raise SelectorError(f"invalid field selector: {part!r}")
        out.append(FieldRequirement(tuple(m.group(1).split(".")), m.group(2) == "!=", m.group(3)))
    return out


def fields_match(requirements: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all(r.matches(obj) for r in requirements)

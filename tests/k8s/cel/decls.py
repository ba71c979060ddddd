"""What CEL sees of a schema node, as the server declares it (``SchemaDeclType``): the
fields a rule may select, and the sizes the cost estimator multiplies by."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from k8s.nodes import Schema, items, props

#: The request size the server assumes for lists, maps and strings without bounds.
MAX_REQUEST_BYTES = 3 * 1024 * 1024


def root_view(s: Schema) -> dict[str, Any]:
    """The root as CEL declares it: ``metadata`` has only ``name`` and ``generateName``."""
    view = dict(s)
    view["properties"] = {
        **props(s),
        "metadata": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
        },
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
    }
    return view


@dataclass
class Decl:
    """The server's CEL declaration of a schema node (``SchemaDeclType``): its kind, the
    most elements (string length, items, properties) a request can hold, its smallest
    JSON size, and its fields or element type."""

    kind: str
    max_elements: int = 0
    min_size: int = 0
    fields: dict[str, Decl] = field(default_factory=dict)
    elem: Decl | None = None
    key: Decl | None = None


def decl(s: Schema, root: bool = False) -> Decl | None:
    """``SchemaDeclType``: ``None`` where CEL cannot see the node."""
    if s.get("x-kubernetes-int-or-string"):
        size = int(s["maxLength"]) * 4 if "maxLength" in s else MAX_REQUEST_BYTES - 2
        return Decl("dyn", size, 1)
    if root or s.get("x-kubernetes-embedded-resource"):
        s = root_view(s)
    t = s.get("type")
    if t == "array":
        sub = items(s)
        elem = decl(sub, bool(sub.get("x-kubernetes-embedded-resource"))) if sub else None
        if elem is None:
            return None
        most = (
            int(s["maxItems"])
            if "maxItems" in s
            else (MAX_REQUEST_BYTES - 2) // (elem.min_size + 1)
        )
        return Decl("list", max(0, most), 2, elem=elem)
    if t == "object":
        return _object_decl(s)
    if t == "string":
        return _string_decl(s)
    return {
        "boolean": Decl("bool", 0, 4),
        "number": Decl("double", 0, 1),
        "integer": Decl("int", 0, 1),
    }.get(str(t))


def _object_decl(s: Schema) -> Decl | None:
    extra = s.get("additionalProperties")
    if isinstance(extra, Mapping):
        elem = decl(extra, bool(extra.get("x-kubernetes-embedded-resource")))
        if elem is None:
            return None
        most = (
            int(s["maxProperties"])
            if "maxProperties" in s
            else (MAX_REQUEST_BYTES - 2) // (elem.min_size + 6)
        )
        return Decl("map", max(0, most), 2, elem=elem, key=Decl("string", 0, 2))
    fields: dict[str, Decl] = {}
    size = 2
    required_names = set(s.get("required") or [])
    for name, prop in props(s).items():
        sub = decl(prop, bool(prop.get("x-kubernetes-embedded-resource")))
        if sub is None:
            continue
        fields[name] = sub
        if name in required_names and prop.get("default") is None:
            size += len(name) + sub.min_size + 4
    return Decl("object", 0, size, fields=fields)


def _string_decl(s: Schema) -> Decl:
    fmt = s.get("format")
    if fmt == "byte":
        return Decl("bytes", int(s.get("maxLength", MAX_REQUEST_BYTES - 2)), 2)
    if fmt in ("duration", "date", "date-time"):
        least = {"duration": 3, "date": 12, "date-time": 21}[str(fmt)]
        most = {"duration": 32, "date": 12, "date-time": 32}[str(fmt)]
        return Decl("duration" if fmt == "duration" else "timestamp", most, least)
    names = [e for e in s.get("enum") or [] if isinstance(e, str)]
    if "maxLength" in s:
        most = int(s["maxLength"]) * 4
    elif s.get("enum"):
        most = max((len(e) for e in names), default=0)
    else:
        most = MAX_REQUEST_BYTES - 2
    return Decl("string", most, 2)

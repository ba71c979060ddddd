"""``x-kubernetes-list-type`` ``set`` and ``map`` in a custom resource: no two items (or
no two items' keys) alike, each duplicate named as the server names it
(``Duplicate value: {"name":"t0"}``)."""

from __future__ import annotations

from typing import Any

from k8s.fielderrors import Cause, child, field_error, invalid, key
from k8s.go import go_json
from k8s.nodes import Schema, additional, items, props
from k8s.openapi import json_kind


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
        token = go_json(k) + json_kind(k)
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

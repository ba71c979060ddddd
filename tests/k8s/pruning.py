"""Pruning and defaulting, as the API server decodes a custom resource before it validates
it: unknown fields are dropped (unless ``x-kubernetes-preserve-unknown-fields``), and so
are non-nullable nulls without a default; then each missing field's default is copied in
and defaulted in turn.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from k8s.fielderrors import child
from k8s.nodes import META_FIELDS, Schema, additional, items, props


def prune(x: Any, s: Schema | None, path: str, dropped: list[str], root: bool = False) -> None:
    """The server's pruning, in place; ``dropped`` collects the unknown fields' paths."""
    if s is not None and s.get("x-kubernetes-preserve-unknown-fields"):
        _skip_prune(x, s, path, dropped, root)
        return
    if isinstance(x, dict):
        for k in list(x):
            sub_path = child(path, k)
            if (root or (s or {}).get("x-kubernetes-embedded-resource")) and k in META_FIELDS:
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
            if (root or s.get("x-kubernetes-embedded-resource")) and k in META_FIELDS:
                continue
            if k in props(s):
                prune(v, props(s)[k], child(path, k), dropped)
            elif additional(s) is not None:
                prune(v, additional(s), child(path, k), dropped)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _skip_prune(v, items(s), f"{path}[{i}]", dropped, False)


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

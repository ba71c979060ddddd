"""Reading a schema node's children as the server's structural schema reads them,
shared by the checks of a CRD and of its custom resources."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Schema = Mapping[str, Any]
#: The fields of an object's root (and of an embedded resource) that are its metadata,
#: not its schema's: pruning leaves them alone, and so do the CRD's checks of defaults.
META_FIELDS = ("apiVersion", "kind", "metadata")


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

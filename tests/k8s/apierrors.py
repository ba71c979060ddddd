"""The API's error responses, worded as the API server words them (clients, kopf
included, branch on the status, the reason and the causes)."""

from __future__ import annotations

from typing import Any

from kmock import KubernetesError

from k8s.fielderrors import Cause
from k8s.kinds import Kind


def error(status: int, reason: str, message: str, **details: Any) -> KubernetesError:
    return KubernetesError(
        status=status, reason=reason, message=message, details=details or {"x": 1}
    )


def not_found(kind: Kind, name: str | None) -> KubernetesError:
    return error(
        404, "NotFound", f'{kind.qualified} "{name}" not found', name=name, kind=kind.plural
    )


def qualified_kind(kind: Kind) -> str:
    """``schema.GroupKind.String()``: ``Job.batch``, but a core kind bare (``Pod``)."""
    return f"{kind.kind}.{kind.group}" if kind.group else kind.kind


def invalid(kind: Kind, name: str, causes: list[Cause]) -> KubernetesError:
    """``errors.NewInvalid``: the causes, and a message that lists each distinct one once
    (in brackets when there are several)."""
    shown = list(dict.fromkeys(str(c) for c in causes))
    joined = shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"
    return error(
        422,
        "Invalid",
        f'{qualified_kind(kind)} "{name}" is invalid: {joined}',
        name=name,
        group=kind.group,
        kind=kind.kind,
        causes=[{"reason": c.reason, "message": c.message, "field": c.field} for c in causes],
    )


def gone(rv: int) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": f"too old resource version: {rv}",
            "reason": "Expired",
            "code": 410,
        },
    }

"""Every ``default`` of a CRD's schema checked when the CRD is created (the server's
``ValidateDefaults``), so that defaulting can never make a custom resource invalid: the
default is pruned (no unknown fields), then checked against the OpenAPI keywords, then
the CEL rules at and below it, exactly as written: nested defaults are not applied to it
first, so ``default: {}`` under a rule that reads an optional field fails with ``no such
key``.

Not emulated: defaults inside ``metadata``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from k8s.cel.evaluate import cel_causes
from k8s.fielderrors import Cause, invalid, key
from k8s.nodes import META_FIELDS, Schema, props
from k8s.openapi import openapi_causes
from k8s.pruning import prune


def default_causes(schema: Schema, path: str) -> list[Cause]:
    """``ValidateDefaults``: each ``default`` is pruned, valid for its schema and passes
    the CEL rules at and below it, exactly as written."""
    out: list[Cause] = []
    _defaults(schema, path, out, meta=False, root=True)
    return out


def _defaults(s: Schema, path: str, out: list[Cause], meta: bool, root: bool) -> None:
    if s.get("default") is not None and not meta:
        value = s["default"]
        at = f"{path}.default"
        pruned = copy.deepcopy(value)
        prune(pruned, s, "", [], root=bool(s.get("x-kubernetes-embedded-resource")))
        if pruned != value:
            out.append(invalid(at, value, "must not have unknown fields"))
        problems = openapi_causes(s, value, at)
        if problems:
            out.extend(problems)
        else:
            out.extend(cel_causes(s, value, at))
    if isinstance(s.get("items"), Mapping):
        _defaults(s["items"], f"{path}.items", out, meta, False)
    for k, sub in props(s).items():
        sub_meta = meta or (
            (root or bool(s.get("x-kubernetes-embedded-resource"))) and k in META_FIELDS
        )
        _defaults(sub, key(f"{path}.properties", k), out, sub_meta, False)

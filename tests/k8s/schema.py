"""A CRD's ``openAPIV3Schema`` applied as the API server applies it to custom resources.

In the API server's order: pruning and defaulting (:mod:`k8s.pruning`), then validation:
the OpenAPI keywords (:mod:`k8s.openapi`), ``x-kubernetes-list-type: map|set``
uniqueness (:mod:`k8s.listtypes`), and the ``x-kubernetes-validations`` CEL rules
(:mod:`k8s.cel.evaluate`), skipped as on the server when the object already has a
Required, Unsupported, Too long, Too many or type error (a ``<nil>`` cause then says so,
if the schema has rules at all).

A write to the status subresource is checked against the status schema, whose messages
name fields relative to ``status`` (``count in body should be …``), as the server's are.

Not emulated: ratcheting (an update is checked like a create); those modules list what
else of their part is not. :mod:`k8s.crds` holds what the server checks when the CRD
itself is created.
"""

from __future__ import annotations

import copy
from typing import Any

from k8s.cel.evaluate import BLOCKING, NOT_CHECKED, cel_causes, has_rules
from k8s.fielderrors import Cause
from k8s.listtypes import list_type_causes
from k8s.nodes import Schema, props
from k8s.openapi import openapi_causes
from k8s.pruning import default, prune, prune_nulls


class StructuralSchema:
    """One version's ``openAPIV3Schema``: prune, default, validate a custom resource."""

    def __init__(self, schema: Schema) -> None:
        self.schema: dict[str, Any] = copy.deepcopy(dict(schema))
        self.has_rules = has_rules(self.schema)

    def default(self, obj: Any) -> Any:
        obj = copy.deepcopy(obj)
        default(obj, self.schema)
        return obj

    def prune(self, obj: Any) -> tuple[Any, list[str]]:
        """The object without unknown fields and non-nullable nulls, and the paths of the
        unknown fields (sorted, as the server reports them)."""
        obj = copy.deepcopy(obj)
        dropped: list[str] = []
        prune(obj, self.schema, "", dropped, root=True)
        prune_nulls(obj, self.schema)
        return obj, sorted(dropped)

    def admit(self, obj: Any) -> tuple[Any, list[str]]:
        """Pruned, then defaulted, as the server decodes a request body."""
        pruned, dropped = self.prune(obj)
        default(pruned, self.schema)
        return pruned, dropped

    def validate(self, obj: Any) -> list[Cause]:
        """The field errors of a (pruned, defaulted) custom resource, the server's way."""
        causes = openapi_causes(self.schema, obj)
        causes.extend(list_type_causes(self.schema, obj, ""))
        return self._with_rules(causes, obj)

    def validate_status(self, obj: Any) -> list[Cause]:
        """A write to ``/status``: its status against the status schema (whose messages
        name fields relative to ``status``), then the whole object's lists and rules."""
        causes = []
        status_schema = props(self.schema).get("status")
        if isinstance(obj, dict) and "status" in obj and status_schema is not None:
            causes = openapi_causes(status_schema, obj["status"], "status")
        causes.extend(list_type_causes(self.schema, obj, ""))
        return self._with_rules(causes, obj)

    def _with_rules(self, causes: list[Cause], obj: Any) -> list[Cause]:
        if not self.has_rules:
            return causes
        if any(c.reason in BLOCKING for c in causes):
            return [*causes, NOT_CHECKED]
        return causes + cel_causes(self.schema, obj, "", root=True)

"""The three patch types the API server takes on ``PATCH``.

JSON merge patch (RFC 7386) is what kopf and our operator send; JSON patch (RFC 6902,
via the ``jsonpatch`` library kmock depends on) is what kopf uses for finalizers with a
``test`` of ``resourceVersion``; strategic merge patch (kubectl's default) is
approximated: lists of objects with a ``name`` merge by name, other lists replace.
Server-side apply is answered 415, as by a server without it.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class PatchError(ValueError):
    """A patch that cannot apply: 422 (a failed ``test``, a bad path) or 415."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _by_name(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if (
        isinstance(patch, list)
        and isinstance(target, list)
        and _by_name(patch)
        and _by_name(target)
    ):
        merged = {i["name"]: copy.deepcopy(i) for i in target}
        for item in patch:
            merged[item["name"]] = strategic_merge_patch(merged.get(item["name"]), item)
        return list(merged.values())
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            raise PatchError(f"strategic merge directive {key} is not supported by the emulator")
        if value is None:
            out.pop(key, None)
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def apply_patch(target: dict[str, Any], patch: Any, content_type: str) -> dict[str, Any]:
    kind = content_type.split(";")[0].strip().lower()
    if kind == MERGE:
        if not isinstance(patch, dict):
            raise PatchError("a merge patch must be a JSON object", 400)
        result = merge_patch(target, patch)
    elif kind == STRATEGIC:
        if not isinstance(patch, dict):
            raise PatchError("a strategic merge patch must be a JSON object", 400)
        result = strategic_merge_patch(target, patch)
    elif kind == JSON:
        if not isinstance(patch, list):
            raise PatchError("a JSON patch must be a list of operations", 400)
        try:
            result = jsonpatch.apply_patch(target, patch)
        except jsonpatch.JsonPatchTestFailed as err:
            raise PatchError(
                f"the server rejected our request due to an error in our request: {err}"
            ) from None
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
            raise PatchError(str(err)) from None
    else:
        raise PatchError(f"the body of the request was in an unknown format: {kind!r}", 415)
    if not isinstance(result, dict):
        raise PatchError("the patched object is not a JSON object")
    return result

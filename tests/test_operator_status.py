"""Writing the status (:mod:`shardwise.operator.loop.status`)."""

from __future__ import annotations

from shardwise.operator.loop.status import merge_patch_between


def test_merge_patch_between() -> None:
    old = {"a": 1, "b": {"c": 1, "d": 2}, "e": [1]}
    new = {"a": 1, "b": {"c": 2}, "e": [2], "f": 3}
    assert merge_patch_between(old, new) == {"b": {"c": 2, "d": None}, "e": [2], "f": 3}

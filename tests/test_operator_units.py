"""Quantities and durations as the spec writes them (:mod:`shardwise.operator.units`)."""

from __future__ import annotations

import pytest

from shardwise.operator.units import parse_duration, parse_quantity


def test_quantities_and_durations() -> None:
    assert parse_quantity("80Gi", "f") == 80 * 2**30
    assert parse_quantity("16GiB", "f") == 16 * 2**30
    assert parse_quantity("80G", "f") == 80 * 10**9
    assert parse_quantity(1024, "f") == 1024
    with pytest.raises(ValueError, match=r"spec\.planner\.gpuMemory: cannot read '80 gigs'"):
        parse_quantity("80 gigs", "spec.planner.gpuMemory")
    assert parse_duration("1h30m", "f") == 5400 and parse_duration("7d", "f") == 7 * 86400
    with pytest.raises(ValueError, match="maxAge"):
        parse_duration("soon", "maxAge")

"""The basics (:mod:`shardwise.basics`): sizes as the command line and a DLRMJob write them,
durations, and the error a user can fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.basics import (
    UserError,
    format_bytes,
    parse_bytes,
    parse_duration,
    parse_quantity,
    read_text,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("16G", 16 * 2**30),
        ("16GB", 16 * 10**9),
        ("512 MiB", 2**29),
        ("1.5GiB", 3 * 2**29),
        ("17179869184", 17179869184),
        ("4gib", 4 * 2**30),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "16 parsecs", "-1GiB", "0", "1e9"])
def test_parse_bytes_rejects_with_example(text: str) -> None:
    with pytest.raises(UserError, match="16GiB|positive"):
        parse_bytes(text, "--gpu-memory")


def test_format_bytes() -> None:
    assert format_bytes(9.3 * 2**30) == "9.3 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.0 MiB"


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


def test_read_text_names_the_file_and_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("tables: []\n", encoding="utf-8")
    assert read_text(tmp_path / "t.yaml", "tables") == "tables: []\n"
    with pytest.raises(UserError, match=r"nope\.yaml: no such tables file\."):
        read_text(tmp_path / "nope.yaml", "tables")
    with pytest.raises(UserError, match="cannot read it"):
        read_text(tmp_path, "plan")  # a directory
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match=r"bin\.json: cannot read it"):
        read_text(tmp_path / "bin.json", "plan")

"""The basics (:mod:`shardwise.basics`): sizes as the command line and a DLRMJob write them,
durations, and the error a user can fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.basics import (
    MAX_BYTES,
    UserError,
    check_output_path,
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


@pytest.mark.parametrize("text", ["1" + "0" * 400, "9" * 400 + ".5TiB", "8388608TiB"])
def test_parse_bytes_refuses_sizes_beyond_any_memory(text: str) -> None:
    """A 400-digit size used to overflow float (OverflowError, a traceback)."""
    with pytest.raises(UserError, match=r"--gpu-memory: .* is more than 8 EiB"):
        parse_bytes(text, "--gpu-memory")
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES
    assert parse_bytes("12345678901234567.5") == 12345678901234567  # exact, no float rounding


def test_check_output_path_says_why_and_what_to_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    assert check_output_path(tmp_path / "new" / "deep" / "p.json", "--out", "p.json")
    assert not (tmp_path / "new").exists()  # nothing created by asking
    with pytest.raises(UserError, match=r"--out .*: this is a directory; .* e\.g\. .*/plan\.json"):
        check_output_path(tmp_path, "--out", "plan.json")
    with pytest.raises(UserError, match=r"file is a file, so nothing can be created under it"):
        check_output_path(tmp_path / "file" / "p.json", "--out", "plan.json")
    with pytest.raises(UserError, match="is not a regular file"):
        check_output_path("/dev/null", "--out", "plan.json")
    if Path("/proc/self").exists():
        with pytest.raises(UserError, match="cannot create files in /proc"):
            check_output_path("/proc/x", "--out", "plan.json")

    def read_only(*_: object, **__: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("shardwise.basics.tempfile.mkstemp", read_only)
    with pytest.raises(UserError, match=r"cannot create files in .* \(Read-only file system\)"):
        check_output_path(tmp_path / "p.json", "--out", "plan.json")


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

import pytest

from shardwise.planner.errors import UserError
from shardwise.planner.units import format_bytes, parse_bytes


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

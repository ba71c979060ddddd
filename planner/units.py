"""Byte sizes as people write them ("16GiB", "512 MB") and as we print them."""

from __future__ import annotations

import re

from shardwise.planner.errors import UserError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """Parse ``"16GiB"``, ``"16G"`` (binary), ``"16GB"`` (decimal) or a plain byte count."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(
            f"{what}: cannot read {text!r} as a size. Write a number with an optional unit, "
            "for example 16GiB, 512MiB, 80GB or 17179869184."
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{what}: {text!r} is not a positive size.")
    return value


def format_bytes(n: float) -> str:
    """Binary units with one decimal: ``9.3 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"

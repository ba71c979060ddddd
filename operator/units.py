"""Quantities and durations as a DLRMJob spells them (``80Gi``, ``168h``)."""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|KiB|MiB|GiB|TiB|k|M|G|T|kB|MB|GB|TB)?$")
_SCALE = {
    None: 1,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}  # fmt: skip
_DURATION = re.compile(r"([0-9]+)(s|m|h|d)")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_quantity(value: int | str, field: str) -> int:
    """Bytes from ``80Gi`` (Kubernetes, binary), ``80G`` (Kubernetes, decimal), ``80GiB``
    or a plain number of bytes; a ``ValueError`` naming ``field`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _QUANTITY.match(str(value).strip())
        if m is None:
            raise ValueError(
                f"{field}: cannot read {value!r} as a memory size; write e.g. 80Gi, 16GiB or "
                "17179869184"
            )
        n = int(float(m.group(1)) * _SCALE[m.group(2)])
    if n <= 0:
        raise ValueError(f"{field}: {value!r} is not a positive size")
    return n


def parse_duration(text: str, field: str) -> float:
    """Seconds from ``168h``, ``7d``, ``1h30m``."""
    parts = _DURATION.findall(text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"{field}: cannot read {text!r} as a duration; write e.g. 168h, 7d or 90m")
    return float(sum(int(n) * _SECONDS[u] for n, u in parts))

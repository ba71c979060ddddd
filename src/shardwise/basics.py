"""The basics every part uses: the error a user can fix, sizes and durations as people
write them, and atomic file writes.

- :class:`UserError`: the CLI prints it as a short paragraph and exits 2; anything else
  is a bug and keeps its traceback.
- Sizes. The command line reads ``16G`` as 16 GiB, as ``free`` and ``ls -h`` do
  (:func:`parse_bytes`); a DLRMJob is a Kubernetes object and reads quantities as
  Kubernetes does, ``80G`` = 80·10⁹ bytes and ``80Gi`` = 80 GiB (:func:`parse_quantity`).
  Both print with :func:`format_bytes`.
- :func:`read_text`: a file's text, or a :class:`UserError` that names the file and
  what it was meant to be (``"no such tables file"``).
- :func:`write_atomic`: a reader sees the old file or the whole new one, never a half,
  and once written a crash does not lose it (file and directory are fsync'd). Cost-dataset
  manifests and checkpoint commit markers depend on it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class UserError(Exception):
    """A problem in the user's input, with a message that says what would fix it."""

    exit_code = 2


# --------------------------------------------------------------------------- sizes
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


# --------------------------------------------------------------------------- Kubernetes
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


# --------------------------------------------------------------------------- files
def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path``; a missing or unreadable file is a :class:`UserError`
    naming it (``what`` says what the file holds: ``"tables"``, ``"plan"``)."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{p}: no such {what} file.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{p}: cannot read it ({err}).") from None


# --------------------------------------------------------------------------- atomic writes
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_dir(p.parent)

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
  manifests, checkpoint commit markers and plan.json depend on it.
- :func:`check_output_path`: whether a file can be written there, asked *before* minutes
  of planning or training rather than after.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import tempfile
from decimal import Decimal
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
#: The largest size :func:`parse_bytes` accepts (8 EiB, the int64 that torch, JSON
#: readers and Kubernetes hold sizes in); larger is a typo, not a memory.
MAX_BYTES = 2**63 - 1


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
    # Decimal, not float: no overflow to infinity however many digits are given.
    value = int(Decimal(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"{what}: {text!r} is not a positive size.")
    if value > MAX_BYTES:
        raise UserError(
            f"{what}: {text[:40]!r}{'…' if len(text) > 40 else ''} is more than 8 EiB "
            "(2^63 bytes), more than any memory; write a size such as 80GB or 16GiB."
        )
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


def _stat(path: Path) -> os.stat_result | None:
    """``os.stat`` of ``path``, or None where nothing is (a missing or non-directory part)."""
    try:
        return os.stat(path)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise UserError(f"{path}: cannot look at it ({err.strerror}).") from None


def check_output_path(path: str | Path, option: str, example: str) -> Path:
    """``path`` if a file can be written there (its missing folders created), else a
    :class:`UserError` saying why and what to give instead. Commands call it before
    their work, so a bad ``--out`` costs no minutes of planning or measuring.

    ``option`` is the flag (``"--out"``) and ``example`` a file name to suggest when
    ``path`` is a directory (``"plan.json"``). Writability is tried, not guessed from
    permission bits: root passes every permission check yet cannot write to a
    read-only filesystem or to ``/proc``.
    """
    p = Path(path)
    st = _stat(p)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UserError(
            f"{option} {p}: this is a directory; give the file to write inside it, "
            f"e.g. {p / example}."
        )
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(
            f"{option} {p}: this exists and is not a regular file (a device, pipe or "
            f"socket), and writing would replace it; give a file path, e.g. {example}."
        )
    folder = p.parent
    while (fst := _stat(folder)) is None and folder != folder.parent:
        folder = folder.parent
    if fst is not None and not stat.S_ISDIR(fst.st_mode):
        raise UserError(
            f"{option} {p}: {folder} is a file, so nothing can be created under it; "
            "give a path in a directory."
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{p.name[:40]}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UserError(
            f"{option} {p}: cannot create files in {folder} ({err.strerror}); "
            "give a path in a writable directory."
        ) from None
    return p


# --------------------------------------------------------------------------- atomic writes
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it.

    Each call writes its own temporary file (``<name>.<random>.tmp`` beside ``path``,
    created exclusively), so concurrent writers of one path never rename each other's
    half-written file or find theirs gone: the last rename wins, whole. The temporary
    file is removed if the write fails.
    """
    p = Path(path)
    for _ in range(100):
        tmp = p.with_name(f"{p.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 collisions of 48 random bits
        raise FileExistsError(f"no free temporary name beside {p}")
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)

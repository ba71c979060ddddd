"""The glibc allocator mitigation of docs/design.md §6, applied and *checked* for real.

glibc serves every allocation above its mmap threshold (at most 32 MiB, often far
less) with a fresh ``mmap`` and unmaps it on free, so a kernel that writes a large
output faults in new zero pages on every call. On CPU that cost grows with a rank's
total embedding width (measured 1.9× the kernel's own time at 60 tables, batch 8192)
and would reward plans for keeping ranks narrow: an artifact, not embedding cost.

The mitigation turns mmap'd chunks off (``M_MMAP_MAX = 0``) and keeps freed heap
memory (a large ``M_TRIM_THRESHOLD``), so a repeated output reuses warm pages:

- :func:`mitigate` applies it to the running process through ``mallopt``;
- :func:`allocator_env` / :data:`ENV` are the same settings for a child process
  (glibc reads ``MALLOC_MMAP_MAX_`` and ``MALLOC_TRIM_THRESHOLD_`` at start-up);
- :func:`is_active` does not trust a flag: it allocates a probe larger than any mmap
  threshold and asks glibc (``mallinfo2``) whether an mmap'd chunk appeared.

On a non-glibc C library (musl, macOS) all three are no-ops and :func:`reason`
says why: those allocators do not have this knob, and timings there say so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping
from functools import cache

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: The largest value ``mallopt`` takes (an int); 2 GiB of freed heap stays mapped.
TRIM_THRESHOLD = 2**31 - 1
#: Settings for a child process, read by glibc before ``main``.
ENV: dict[str, str] = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}
#: Probe size: above glibc's largest dynamic mmap threshold (32 MiB on 64-bit).
_PROBE_BYTES = 64 * 2**20


_MALLINFO_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    """``struct mallinfo2`` (glibc >= 2.33): every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO_FIELDS]


class _MallInfo(ctypes.Structure):
    """``struct mallinfo`` (older glibc): int fields, enough for chunk counts."""

    _fields_ = [(name, ctypes.c_int) for name in _MALLINFO_FIELDS]


@cache
def _libc() -> ctypes.CDLL | None:
    """The process's glibc, or None when the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    elif hasattr(libc, "mallinfo"):
        libc.mallinfo.restype = _MallInfo
    else:
        return None
    return libc


def glibc_version() -> str | None:
    """The running glibc's version ("2.36"), or None off glibc."""
    libc = _libc()
    if libc is None:
        return None
    version: bytes = libc.gnu_get_libc_version()
    return version.decode()


def reason() -> str:
    """One line on the mitigation's state in this process, for reports and logs."""
    if _libc() is None:
        return "not glibc: no mmap-threshold knob, allocator left as is (not mitigated)"
    if is_active():
        return f"glibc {glibc_version()}: mmap'd chunks off, freed heap kept (mitigated)"
    return f"glibc {glibc_version()}: large outputs are mmap'd fresh each call (NOT mitigated)"


def mitigate() -> None:
    """Stop glibc from mmap'ing large blocks and from trimming freed heap, in this process.

    Idempotent and cheap; a no-op off glibc. Memory freed after this stays mapped up to
    :data:`TRIM_THRESHOLD`, which is what a benchmark wants and a long-lived server may not.
    """
    libc = _libc()
    if libc is None:
        return
    if not libc.mallopt(_M_MMAP_MAX, 0) or not libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        raise OSError("glibc refused mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD)")


def _mallinfo() -> tuple[int, int]:
    """(mmap'd chunks, heap bytes obtained with sbrk/arenas) from glibc."""
    libc = _libc()
    assert libc is not None
    info = libc.mallinfo2() if hasattr(libc, "mallinfo2") else libc.mallinfo()
    return int(info.hblks), int(info.arena)


def is_active() -> bool:
    """True when a large allocation in this process is *not* served by a fresh mmap.

    Checked, not remembered: allocate :data:`_PROBE_BYTES` with ``malloc`` (the
    allocator torch's and numpy's CPU buffers come from), see whether glibc's count of
    mmap'd chunks grew, then free it and see whether the heap was trimmed (given back,
    so the next call would fault it in again). Always False off glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    chunks_before, _ = _mallinfo()
    block = libc.malloc(_PROBE_BYTES)
    if not block:
        raise MemoryError(f"cannot allocate the {_PROBE_BYTES}-byte allocator probe")
    try:
        chunks_during, heap_during = _mallinfo()
    finally:
        libc.free(block)
    _, heap_after = _mallinfo()
    return chunks_during == chunks_before and heap_after >= heap_during


def allocator_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process with the mitigation set before it starts
    (``base`` defaults to this process's environment; on non-glibc it is unchanged)."""
    env = dict(os.environ if base is None else base)
    if _libc() is not None:
        env.update(ENV)
    return env

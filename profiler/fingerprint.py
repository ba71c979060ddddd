"""The hardware fingerprint every cost sample and cost model carries (docs/design.md §6, §7).

Measured costs only mean something on the hardware and software stack that produced
them: the same fused kernel runs at different speeds on another CPU model, another
GPU, another core count or another torch/FBGEMM build. A dataset or a model therefore
records the fingerprint it was measured on, and the code that reuses it compares
fingerprints and says what differs ("trained on X, this device is Y").

``python`` is recorded for the record only: it does not change kernel timings, so it
takes no part in :meth:`Fingerprint.matches` or :meth:`Fingerprint.key`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from shardwise.basics import UserError

DeviceType = Literal["cpu", "cuda"]

#: The fields that decide whether timings are comparable (all but ``python``).
TIMING_FIELDS: tuple[str, ...] = ("device_type", "device", "cores", "torch", "fbgemm")
_FBGEMM_DISTS = ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-genai", "fbgemm-gpu-nightly")


@dataclass(frozen=True)
class Fingerprint:
    """What the measuring machine was: device, its cores, and the kernel stack.

    ``cores`` is the number of CPU cores this process may use for a ``cpu`` device
    (the CPU kernel is multi-threaded), and the GPU's streaming-multiprocessor count
    for ``cuda`` (a MIG slice of the same GPU model has fewer and is slower).
    """

    device: str
    device_type: DeviceType
    cores: int
    torch: str
    fbgemm: str
    python: str

    def key(self) -> str:
        """A short stable id (16 hex digits) of the timing-relevant fields."""
        blob = json.dumps({f: getattr(self, f) for f in TIMING_FIELDS}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def matches(self, other: Fingerprint) -> bool:
        """True when timings measured on ``other`` are valid here."""
        return all(getattr(self, f) == getattr(other, f) for f in TIMING_FIELDS)

    def differences(self, other: Fingerprint) -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for every timing field that differs."""
        return [
            (f, getattr(self, f), getattr(other, f))
            for f in TIMING_FIELDS
            if getattr(self, f) != getattr(other, f)
        ]

    def describe(self) -> str:
        return (
            f"{self.device} ({self.cores} {'SMs' if self.device_type == 'cuda' else 'cores'}), "
            f"torch {self.torch}, fbgemm {self.fbgemm}"
        )

    def describe_mismatch(self, other: Fingerprint) -> str:
        """One sentence: ``self`` is where the data/model came from, ``other`` is here."""
        diffs = self.differences(other)
        if not diffs:
            return f"Both fingerprints describe {self.describe()}."
        what = "; ".join(f"{f} {a!r} vs {b!r}" for f, a, b in diffs)
        return (
            f"This was measured on {self.describe()}, but this device is {other.describe()} "
            f"(differs in {what})."
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def problems(data: object) -> list[tuple[str, str]]:
        """(field, what is wrong) for each way ``data`` is not a stored fingerprint;
        empty when :meth:`from_dict` accepts it. Field ``""`` is the whole object.

        Strict on purpose: a fingerprint decides whether timings are comparable, so a
        hand-edited one must be exactly what :meth:`to_dict` writes, not coerced.
        """
        names = [f.name for f in fields(Fingerprint)]
        if not isinstance(data, Mapping):
            return [("", f"must be an object with fields {', '.join(names)}")]
        found: list[tuple[str, str]] = [
            (str(k), f"unknown field (a fingerprint has {', '.join(names)})")
            for k in data
            if k not in names
        ]
        missing = [name for name in names if name not in data]
        if missing:
            found.append(("", f"missing {', '.join(missing)}"))
        for name in names:
            if name not in data:
                continue
            value = data[name]
            if name == "device_type":
                if value not in ("cpu", "cuda"):
                    found.append((name, f"must be 'cpu' or 'cuda', got {value!r}"))
            elif name == "cores":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    found.append((name, f"must be a whole number >= 1, got {value!r}"))
            elif not isinstance(value, str) or not value:
                found.append((name, f"must be a non-empty string, got {value!r}"))
        return found

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fingerprint:
        """Read back :meth:`to_dict`; anything else (an unknown key, a wrong type) is a
        ``ValueError`` naming the field, so typos show."""
        found = cls.problems(data)
        if found:
            what = "; ".join(f"{f}: {msg}" if f else msg for f, msg in found)
            raise ValueError(f"not a fingerprint: {what}")
        return cls(
            device=data["device"],
            device_type=data["device_type"],
            cores=data["cores"],
            torch=data["torch"],
            fbgemm=data["fbgemm"],
            python=data["python"],
        )


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cgroup_cpu_limit(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """The cgroup v2 CPU quota in whole cores (rounded up), or None when unlimited.

    A Kubernetes pod with ``resources.limits.cpu`` sees every core of its node in its
    affinity mask, yet is throttled to the quota: the quota is what timings reflect.
    """
    try:
        quota, _, period = cpu_max.read_text().strip().partition(" ")
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period or "100000")))
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return min(cores, limit) if limit else cores


def fbgemm_version() -> str:
    """The installed FBGEMM-GPU distribution's version (CPU or CUDA build), or "none"."""
    for dist in _FBGEMM_DISTS:
        try:
            return f"{metadata.version(dist)}" + ("+cpu" if dist.endswith("-cpu") else "")
        except metadata.PackageNotFoundError:
            continue
    return "none"


def current_fingerprint(device: str | None = None) -> Fingerprint:
    """The fingerprint of this machine for ``device`` ("cpu", "cuda", "cuda:N" or None,
    which picks ``cuda`` when a GPU is visible, as the benchmarks do)."""
    import torch  # imported here: a fingerprint of a stored artifact needs no torch

    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, ordinal = want.partition(":")
    versions = {"torch": str(torch.__version__), "fbgemm": fbgemm_version()}
    versions["python"] = platform.python_version()
    if kind == "cpu":
        return Fingerprint(f"cpu:{cpu_model_name()}", "cpu", usable_cores(), **versions)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"device {want!r} was asked for, but this machine has no usable CUDA GPU "
                f"(torch {torch.__version__}). Use --measure-on cpu or run on a GPU node."
            )
        index = int(ordinal) if ordinal.isdigit() else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UserError(
                f"device {want!r} was asked for, but only {torch.cuda.device_count()} "
                "CUDA device(s) are visible."
            )
        props = torch.cuda.get_device_properties(index)
        return Fingerprint(str(props.name), "cuda", int(props.multi_processor_count), **versions)
    raise UserError(f"unknown device {want!r}; use cpu, cuda or cuda:N.")

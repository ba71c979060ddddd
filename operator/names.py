"""Deterministic names for every child: the same job always maps to the same names, so
a restarted operator finds (and never duplicates) what an earlier one created."""

from __future__ import annotations

import hashlib
import re

#: Jobs, Services and pod hostnames are limited to a DNS label.
MAX_NAME = 63


def _digest(text: str, n: int = 5) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def slug(value: str, limit: int = 20) -> str:
    """A DNS-label-safe form of ``value`` (e.g. a GPU product name), unique by a hash
    suffix when it had to be shortened or changed."""
    s = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-") or "x"
    if s != value or len(s) > limit:
        s = f"{s[: max(1, limit - 5)].strip('-')}-{_digest(value, 4)}"
    return s


def child_name(job: str, *parts: str) -> str:
    """``<job>-<parts…>``, shortened with a hash when longer than a DNS label."""
    name = "-".join((job, *parts))
    if len(name) <= MAX_NAME:
        return name
    return f"{name[: MAX_NAME - 6].rstrip('-')}-{_digest(name)}"


def workers_name(job: str) -> str:
    """The worker Job and its headless Service share this name."""
    return child_name(job, "workers")


def plan_configmap_name(job: str, plan_hash: str) -> str:
    return child_name(job, "plan", plan_hash[:8])


def profiling_job_name(job: str, gpu_type: str, attempt: int) -> str:
    return child_name(job, "profile", slug(gpu_type), str(attempt))


def costmodel_name(gpu_type: str) -> str:
    """The published cost model of a GPU type, shared by every job in the namespace
    (chunks are ``<name>-<i>``)."""
    return f"shardwise-costmodel-{slug(gpu_type, 40)}"

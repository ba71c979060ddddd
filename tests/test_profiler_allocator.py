"""The allocator mitigation is checked, not assumed: each case runs a fresh Python so
glibc starts from its defaults (or from the environment under test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardwise.profiler import allocator

glibc_only = pytest.mark.skipif(allocator.glibc_version() is None, reason="needs glibc")

PROBE = """
from shardwise.profiler import allocator
before = allocator.is_active()
allocator.mitigate()
print(before, allocator.is_active())
"""


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in allocator.ENV:
        env.pop(key, None)
    return env


def _run(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


@glibc_only
def test_inactive_by_default_active_after_mitigate() -> None:
    assert _run(PROBE, _clean_env()) == "False True"


@glibc_only
def test_child_env_is_active_from_the_start() -> None:
    env = allocator.allocator_env(_clean_env())
    assert env["MALLOC_MMAP_MAX_"] == "0"
    assert _run("from shardwise.profiler import allocator; print(allocator.is_active())", env) == (
        "True"
    )


@glibc_only
def test_half_a_mitigation_is_not_active() -> None:
    """Either knob alone leaves a cost: no mmap but trimming, or mmap with no trimming."""
    env = _clean_env()
    env["MALLOC_MMAP_MAX_"] = "0"
    code = "from shardwise.profiler import allocator; print(allocator.is_active())"
    assert _run(code, env) == "False"


@glibc_only
def test_reason_names_the_state() -> None:
    allocator.mitigate()  # harmless in the test process: a benchmark setting
    assert "mitigated" in allocator.reason() and "NOT" not in allocator.reason()


def test_non_glibc_is_a_clear_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    allocator.mitigate()
    assert allocator.is_active() is False
    assert allocator.glibc_version() is None
    assert "not glibc" in allocator.reason()
    assert allocator.allocator_env({"A": "1"}) == {"A": "1"}

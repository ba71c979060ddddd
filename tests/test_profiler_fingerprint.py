"""The hardware fingerprint: what it records, its key, and the mismatch sentence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardwise.basics import UserError
from shardwise.profiler.fingerprint import Fingerprint, cgroup_cpu_limit, current_fingerprint

BASE = Fingerprint(
    device="cpu:Intel(R) Xeon(R) Processor",
    device_type="cpu",
    cores=2,
    torch="2.13.0+cpu",
    fbgemm="1.8.0+cpu",
    python="3.11.7",
)


def test_current_fingerprint_describes_this_cpu() -> None:
    fp = current_fingerprint("cpu")
    assert fp.device_type == "cpu"
    assert fp.device.startswith("cpu:") and len(fp.device) > 4
    assert fp.cores >= 1
    assert fp.torch.startswith("2.")
    assert fp.fbgemm != "none"
    assert fp.python.count(".") == 2
    assert fp.matches(current_fingerprint("cpu"))
    assert fp.key() == current_fingerprint("cpu").key()


def test_default_device_is_what_torch_sees() -> None:
    import torch

    assert current_fingerprint().device_type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_key_is_short_stable_and_ignores_python() -> None:
    key = BASE.key()
    assert len(key) == 16 and int(key, 16) >= 0
    assert key == dataclasses.replace(BASE).key()
    other_python = dataclasses.replace(BASE, python="3.12.1")
    assert other_python.key() == key and other_python.matches(BASE)


@pytest.mark.parametrize(
    ("field", "value"),
    [("device", "cpu:AMD EPYC"), ("cores", 16), ("torch", "2.14.0"), ("fbgemm", "1.9.0")],
)
def test_each_timing_field_breaks_the_match(field: str, value: object) -> None:
    other = dataclasses.replace(BASE, **{field: value})
    assert not BASE.matches(other)
    assert BASE.key() != other.key()
    sentence = BASE.describe_mismatch(other)
    assert sentence.startswith("This was measured on cpu:Intel")
    assert "this device is" in sentence and field in sentence and str(value) in sentence


def test_mismatch_sentence_names_both_devices() -> None:
    gpu = Fingerprint("NVIDIA H100 80GB HBM3", "cuda", 132, "2.13.0+cu128", "1.8.0", "3.11.7")
    s = gpu.describe_mismatch(BASE)
    assert (
        "NVIDIA H100 80GB HBM3 (132 SMs)" in s and "cpu:Intel(R) Xeon(R) Processor (2 cores)" in s
    )
    assert BASE.describe_mismatch(BASE).startswith("Both fingerprints describe")


def test_round_trip_and_refusal() -> None:
    assert Fingerprint.from_dict(BASE.to_dict()) == BASE
    with pytest.raises(ValueError, match="not a fingerprint"):
        Fingerprint.from_dict({**BASE.to_dict(), "colour": "red"})
    with pytest.raises(ValueError, match="not a fingerprint"):
        Fingerprint.from_dict({**BASE.to_dict(), "device_type": "tpu"})


def test_unknown_or_missing_device_is_a_user_error() -> None:
    import torch

    with pytest.raises(UserError, match="unknown device"):
        current_fingerprint("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no usable CUDA GPU"):
            current_fingerprint("cuda")


def test_cgroup_quota_caps_the_cores(tmp_path: Path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert cgroup_cpu_limit(f) is None
    f.write_text("150000 100000\n")  # a pod limited to 1.5 CPUs
    assert cgroup_cpu_limit(f) == 2
    f.write_text("20000 100000\n")
    assert cgroup_cpu_limit(f) == 1
    assert cgroup_cpu_limit(tmp_path / "absent") is None

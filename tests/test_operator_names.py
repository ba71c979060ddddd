"""Deterministic child names that fit a DNS label (:mod:`shardwise.operator.names`)."""

from __future__ import annotations

from operator_builders import A100

from shardwise.operator.names import MAX_NAME, child_name, plan_configmap_name, slug


def test_names_are_deterministic_and_fit_a_dns_label() -> None:
    assert plan_configmap_name("dj", "0123456789abcdef") == "dj-plan-01234567"
    long = child_name("a" * 40, "profile", slug(A100), "10")
    assert len(long) <= MAX_NAME and long == child_name("a" * 40, "profile", slug(A100), "10")
    assert long != child_name("a" * 40, "profile", slug(A100), "11")
    assert slug("cpu") == "cpu" and slug("NVIDIA-H100") != slug("nvidia-h100")

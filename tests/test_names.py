"""Deterministic child names that fit a DNS label (:mod:`shardwise.names`)."""

from __future__ import annotations

import yaml
from k8s.helpers import CRD_PATH
from operator_builders import A100

from shardwise import names
from shardwise.names import MAX_NAME, child_name, plan_configmap_name, slug


def test_names_are_deterministic_and_fit_a_dns_label() -> None:
    assert plan_configmap_name("dj", "0123456789abcdef") == "dj-plan-01234567"
    long = child_name("a" * 40, "profile", slug(A100), "10")
    assert len(long) <= MAX_NAME and long == child_name("a" * 40, "profile", slug(A100), "10")
    assert long != child_name("a" * 40, "profile", slug(A100), "11")
    assert slug("cpu") == "cpu" and slug("NVIDIA-H100") != slug("nvidia-h100")


def test_the_crd_uses_these_names() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())["spec"]
    assert (crd["group"], crd["names"]["kind"], crd["names"]["plural"]) == (
        names.GROUP,
        names.KIND,
        names.PLURAL,
    )
    assert [v["name"] for v in crd["versions"]] == [names.VERSION]
